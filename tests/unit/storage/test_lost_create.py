"""What a failed CREATE means when another writer may be creating the same table."""

from __future__ import annotations

import pytest

from cdc_join.errors import ConcurrentRunError, StorageError
from cdc_join.storage.base import lost_create


def test_a_create_that_lost_to_a_writer_whose_table_shows_up_later_did_not_create_it():
    seen = iter([False, False, True])
    error = StorageError("could not create t: [TABLE_OR_VIEW_ALREADY_EXISTS] t already exists")
    assert lost_create(lambda _: next(seen), "t", error, wait=5) is False


def test_a_table_that_is_said_to_exist_but_never_shows_up_is_a_lost_race():
    error = StorageError("could not create t: [TABLE_OR_VIEW_ALREADY_EXISTS] t already exists")
    with pytest.raises(ConcurrentRunError, match="another run is creating it"):
        lost_create(lambda _: False, "t", error, wait=0.3)


def test_any_other_create_failure_is_raised_as_it_was():
    error = StorageError("could not create t: permission denied")
    with pytest.raises(StorageError, match="permission denied"):
        lost_create(lambda _: False, "t", error, wait=5)
