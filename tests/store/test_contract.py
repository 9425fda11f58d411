"""The store contract, run against a local directory and a real S3 server."""

import os

import pytest

from colonnade.store import InvalidKey, NotFound, ObjectTooLarge


def test_round_trip_and_overwrite(store):
    store.put("a/b/c.bin", b"one")
    assert store.get("a/b/c.bin") == b"one"
    store.put("a/b/c.bin", b"two")
    assert store.get("a/b/c.bin") == b"two"
    assert store.size("a/b/c.bin") == 3


def test_binary_empty_and_large_objects(store):
    blob = os.urandom(5 << 20)
    store.put("big", blob)
    store.put("empty", b"")
    store.put("bin", bytes(range(256)))
    assert store.get("big") == blob
    assert store.get("empty") == b""
    assert store.get("bin") == bytes(range(256))


def test_put_if_absent_writes_once(store):
    assert store.put_if_absent("weights/00000001/meta.json", b"first") is True
    assert store.put_if_absent("weights/00000001/meta.json", b"second") is False
    assert store.get("weights/00000001/meta.json") == b"first"


def test_exists_size_delete(store):
    assert not store.exists("x")
    store.put("x", b"12345")
    assert store.exists("x") and store.size("x") == 5
    store.delete("x")
    assert not store.exists("x")
    store.delete("x")  # deleting a missing key is fine
    with pytest.raises(NotFound):
        store.size("x")


def test_get_missing_raises_not_found(store):
    with pytest.raises(NotFound) as e:
        store.get("nope/never")
    assert "nope/never" in str(e.value)


def test_list_prefixes_sorted_and_scoped(store):
    for k in ["r/2/b", "r/1/a", "r/10/c", "rx/1", "other/z", "r/1/sub/d"]:
        store.put(k, b"v")
    assert store.list("r/") == ["r/1/a", "r/1/sub/d", "r/10/c", "r/2/b"]
    assert store.list("r/1") == ["r/1/a", "r/1/sub/d", "r/10/c"]
    assert store.list("r/1/") == ["r/1/a", "r/1/sub/d"]
    assert store.list("missing/") == []
    assert set(store.list()) >= {"rx/1", "other/z"}


def test_get_bounded_by_max_bytes(store):
    store.put("k", b"x" * 1000)
    assert store.get("k", max_bytes=1000) == b"x" * 1000
    with pytest.raises(ObjectTooLarge):
        store.get("k", max_bytes=999)


def test_put_bounded_by_store_limit(store):
    with pytest.raises(ObjectTooLarge):
        store.put("k", b"x" * ((16 << 20) + 1))
    with pytest.raises(ObjectTooLarge):
        store.put_if_absent("k", b"x" * ((16 << 20) + 1))
    assert not store.exists("k")


@pytest.mark.parametrize(
    "key", ["", "/abs", "a//b", "a/../b", "./a", "a/.", "a\\b", "a\0b", "x" * 1025]
)
def test_invalid_keys_rejected(store, key):
    with pytest.raises(InvalidKey):
        store.put(key, b"v")
    with pytest.raises(InvalidKey):
        store.get(key)


def test_list_times_gives_each_key_its_write_time(store):
    import time

    t0 = time.time()
    store.put("w1/heartbeat.json", b"{}")
    store.put("w1/metrics/000000.jsonl", b"{}")
    store.put("other/c", b"x")
    times = store.list_times("w1/")
    assert sorted(times) == ["w1/heartbeat.json", "w1/metrics/000000.jsonl"]
    assert all(abs(t - t0) < 60 for t in times.values())


def test_a_sub_store_is_a_folder_of_its_store(store):
    # The inbox, when it has no bucket of its own: the run store's `inbox/`.
    inbox = store.sub("inbox/")
    inbox.put("w1/heartbeat.json", b"{}")
    assert store.get("inbox/w1/heartbeat.json") == b"{}"
    store.put("run.json", b"run")
    assert inbox.list() == ["w1/heartbeat.json"]  # nothing of the run's beside it
    assert list(inbox.list_times("")) == ["w1/heartbeat.json"]
    with pytest.raises(NotFound):
        inbox.get("run.json")
    assert inbox.put_if_absent("claims/00000000/000000.json", b"a") is True
    assert inbox.put_if_absent("claims/00000000/000000.json", b"b") is False
    assert store.get("inbox/claims/00000000/000000.json") == b"a"
    inbox.delete("w1/heartbeat.json")
    assert not store.exists("inbox/w1/heartbeat.json")
    assert store.sub("inbox").list() == inbox.list()  # the slash is optional
    inbox.sub("w1/").put("x", b"nested")
    assert store.get("inbox/w1/x") == b"nested"
    with pytest.raises(ObjectTooLarge):  # the store's limits hold below too
        inbox.put("big", b"x" * ((16 << 20) + 1))
    for bad in ("..", "../x", "a//b", "a/./b"):  # no way out of the folder
        with pytest.raises(InvalidKey):
            store.sub(bad)
        with pytest.raises(InvalidKey):
            inbox.put(bad, b"v")
