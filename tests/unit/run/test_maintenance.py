"""The maintenance policy's decisions from file statistics (no Spark needed)."""

from __future__ import annotations

from cdc_join.run.maintenance import (
    MAX_DELETED_SHARE,
    MAX_LOOSE_FILES,
    MAX_LOOSE_SHARE,
    MAX_SMALL_FILES,
    inspect,
    loose,
    summary,
)
from cdc_join.storage import FileStats

MB = 1024 * 1024


def _file(name: str, lo, hi, size: int = 8 * MB) -> FileStats:
    return FileStats(name, size, 1000, {"k": lo}, {"k": hi})


class _Files:
    """A storage that knows only the files of one table."""

    def __init__(self, files: list[FileStats]) -> None:
        self._files = files

    def files(self, path: str) -> list[FileStats]:
        return self._files


def _compacted(n: int = 18, size: int = 8 * MB) -> list[FileStats]:
    """What a compaction in key order leaves: disjoint ranges, ends touching."""
    return [_file(f"c{i}", i * 100, (i + 1) * 100, size) for i in range(n)]


def _health(files: list[FileStats]):
    return inspect(_Files(files), "t", 8 * MB, ["k"])


def test_a_table_compacted_in_key_order_has_no_loose_file():
    assert loose(_compacted(), "k") == []
    # one key filling several files (1,000 clerks for 1.5 M orders) is still key order
    same_key = [_file("a", 1, 5), _file("b", 5, 5), _file("c", 5, 5), _file("d", 5, 9)]
    assert loose(same_key, "k") == []


def test_appended_files_spanning_the_keys_are_loose_and_the_heavier_order_is_kept():
    appended = [_file("run1", 0, 1800, 300_000), _file("run2", 5, 1795, 300_000)]
    assert {f.path for f in loose(_compacted() + appended, "k")} == {"run1", "run2"}
    # a file without statistics is read by every keyed read: loose
    unknown = FileStats("x", 10, None, {}, {})
    assert [f.path for f in loose([*_compacted(), unknown], "k")] == ["x"]


def test_a_few_small_appends_leave_a_big_table_alone_however_deep_they_overlap():
    # The benchmark's orders state at SF 1: 18 files of 8 MB and one append of 300 KB per run.
    # The former rule (overlap deeper than 4) compacted all of it every fourth run.
    runs = [_file(f"run{i}", 0, 1800, 300_000) for i in range(10)]
    health = _health(_compacted() + runs)
    assert health.action is None, health
    assert health.loose_files == 10 and 0.01 < health.loose_share < MAX_LOOSE_SHARE


def test_loose_files_holding_a_tenth_of_the_bytes_make_a_compaction_due():
    runs = [_file(f"run{i}", 0, 1800, 300_000) for i in range(60)]  # 18 MB next to 151 MB
    health = _health(_compacted() + runs)
    assert health.action == "compact" and health.loose_share >= MAX_LOOSE_SHARE, health
    assert _health(_compacted() + runs[:45]).action is None  # 13.5 MB: 8%


def test_more_loose_files_than_the_cap_make_a_compaction_due_whatever_they_weigh():
    tiny = [_file(f"run{i}", 0, 1800, 1_000) for i in range(MAX_LOOSE_FILES + 1)]
    assert _health(_compacted() + tiny).action == "compact"
    assert _health(_compacted() + tiny[:-1]).action is None


def test_small_disjoint_files_of_a_key_ordered_table_are_its_layout_not_a_problem():
    # delta-rs writes subscription tables in 16 KB files for narrow lookups: 1,465 of them.
    files = [_file(f"s{i}", i, i + 1, 3_000) for i in range(1_465)]
    assert _health(files).action is None


def test_tables_without_a_key_order_are_compacted_for_their_small_files():
    files = [_file(f"f{i}", None, None, 1_000) for i in range(MAX_SMALL_FILES + 1)]
    assert inspect(_Files(files), "t", 8 * MB, None).action == "compact"
    assert inspect(_Files(files[:-1]), "t", 8 * MB, None).action is None


def _dv_file(name: str, live: int, deleted: int, size: int = 30 * MB) -> FileStats:
    return FileStats(name, size, live, {"k": None}, {"k": None}, deleted_rows=deleted)


def test_a_table_whose_deletion_vectors_hide_a_fifth_of_its_rows_is_purged():
    # What 200 runs left in silver on delta-spark: four large files, each ~46% deleted.
    heavy = [_dv_file(f"b{i}", 201_000, 174_000) for i in range(4)]
    health = inspect(_Files(heavy), "t", 8 * MB, None)
    assert health.action == "purge"
    assert round(health.deleted_share, 2) == 0.46
    # just under the share: nothing (no small files either)
    live = int(1_000_000 * (1 - MAX_DELETED_SHARE)) + 1
    under = [_dv_file("a", live, 1_000_000 - live)]
    assert inspect(_Files(under), "t", 8 * MB, None).action is None
    at = [_dv_file("a", live - 1, 1_000_000 - live + 1)]
    assert inspect(_Files(at), "t", 8 * MB, None).action == "purge"


def test_deleted_rows_outweigh_small_files_and_a_key_ordered_table_is_compacted_instead():
    small = [_file(f"f{i}", None, None, 1_000) for i in range(MAX_SMALL_FILES + 1)]
    heavy = [_dv_file("b", 50_000, 50_000), *small]
    assert inspect(_Files(heavy), "t", 8 * MB, None).action == "purge"
    # a key-ordered table's compaction rewrites every row: it is what purges it
    ordered = _compacted()
    ordered[0] = FileStats("c0", 8 * MB, 100, {"k": 0}, {"k": 100}, deleted_rows=100_000)
    health = _health(ordered)
    assert health.action == "compact" and health.loose_files == 0


def test_files_without_row_counts_count_no_deleted_rows():
    files = [FileStats("a", MB, None, {}, {}, deleted_rows=10), _dv_file("b", 100, 0)]
    assert inspect(_Files(files), "t", 8 * MB, None).deleted_share == 0.0


def test_the_summary_names_the_deleted_share_and_what_a_purge_left():
    line = summary(
        [
            {
                "path": "silver",
                "files": 19,
                "small_files": 4,
                "deleted_share": 0.369,
                "action": "purge",
                "files_after": 6,
                "deleted_share_after": 0.0,
            }
        ]
    )
    assert line == "silver: 19 files (4 small), 37% of its stored rows deleted → purge: 6 files, 0% deleted"
