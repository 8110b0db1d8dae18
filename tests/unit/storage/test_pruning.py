"""Keyed reads skip data files by their statistics: which files a set of wanted keys keeps."""

from __future__ import annotations

import random

from cdc_join.storage.base import FileStats
from cdc_join.storage.pruning import candidate_files


def _files(*ranges) -> list[FileStats]:
    return [FileStats(f"f{i}", 1, 1, {"k": lo}, {"k": hi}) for i, (lo, hi) in enumerate(ranges)]


def _kept(files, values) -> set[str]:
    return set(candidate_files(None, "t", None, files, None, ("k", "k"), values))


def test_only_files_whose_range_holds_a_wanted_key_are_read():
    files = [*_files((0, 9), (10, 19), (20, 29)), FileStats("nostats", 1, 1, {}, {})]
    assert _kept(files, [12, 13, None]) == {"f1", "nostats"}
    assert _kept(files, [9, 30]) == {"f0", "nostats"}
    assert _kept(files, [None]) == {"nostats"}


def test_a_nan_key_keeps_every_file_and_never_hides_the_other_keys():
    files = _files((10.0, 11.0), (11.5, 12.0), (12.5, 13.0), (13.5, 14.0), (20.0, 30.0))
    rng = random.Random(3)
    for _ in range(20):  # NaN hashes by identity, so the value set's order varies from draw to draw
        values = [float("nan"), 11.0, 12.0, 13.0, 14.0, rng.choice([1.0, 25.0])]
        rng.shuffle(values)
        assert _kept(files, values) == {f.path for f in files}
    # A file whose statistics hold NaN can't exclude anything either.
    assert _kept(
        [*_files((0.0, 1.0)), FileStats("nan", 1, 1, {"k": float("nan")}, {"k": float("nan")})], [7.0]
    ) == {"nan"}
