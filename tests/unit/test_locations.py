"""Where a table lives: local paths, table names, and the bytes a local folder holds."""

from __future__ import annotations

from cdc_join.locations import local_bytes, local_path


def test_a_file_url_and_a_plain_path_are_local_and_other_schemes_are_not():
    assert local_path("file:///a/b") == "/a/b" and local_path("file:/a/b") == "/a/b"
    assert local_path("/a/b") == "/a/b" and local_path("s3://bucket/a") is None


def test_local_bytes_count_every_file_under_each_folder(tmp_path):
    (tmp_path / "t" / "_delta_log").mkdir(parents=True)
    (tmp_path / "t" / "part-0.parquet").write_bytes(b"x" * 10)
    (tmp_path / "t" / "_delta_log" / "0.json").write_bytes(b"y" * 5)
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "f").write_bytes(b"z" * 7)
    assert local_bytes([str(tmp_path / "t"), f"file://{tmp_path / 'u'}", str(tmp_path / "none")]) == 22
    assert local_bytes([str(tmp_path / "t"), "main.cdc.silver"]) is None  # a table name
    assert local_bytes(["s3://bucket/lake/silver"]) is None
