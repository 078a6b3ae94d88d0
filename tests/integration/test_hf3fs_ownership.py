"""One page index per data file: the data-dir lock, index identities, data file stamps.

Real: ``kvconnect hf3fs-meta serve`` processes on 127.0.0.1 ports (killed with SIGKILL where
the test says so), a real ``redis-server`` for the Redis index, HF3FS stores writing and
reading real files in ``tmp_path``. Every read is checked byte for byte: a read that returns
True with another key's bytes is counted as wrong, and the count must be 0.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from kvconnect.connectors.base import ConfigError
from kvconnect.connectors.buffers import HostBuffer
from kvconnect.connectors.hf3fs.ownership import STAMP_SUFFIX, Locked, read_stamp
from kvconnect.connectors.registry import create_store
from kvconnect.connectors.testing.conformance import PAGE, page_bytes
from kvconnect.connectors.testing.hf3fs import MetaProcess

grpc = pytest.importorskip("grpc", reason="the metadata service needs grpcio (extra 'hf3fs')")


def opts(prefix: Path, url: str | None, **kw) -> dict:
    o = {"file_path_prefix": str(prefix), "file_size": 256 * PAGE, "numjobs": 2, "entries": 8,
         "client_timeout": 3, "page_bytes": PAGE}
    if url is not None:
        o["metadata_server_url"] = url
    o.update(kw)
    return o


def write(store, keys: list[str], gen: int) -> list[bool]:
    b = HostBuffer(len(keys), PAGE, 2)
    for i, k in enumerate(keys):
        b.fill(i, page_bytes(k, gen, PAGE))
    return store.put_from(keys, [b.page(i) for i in range(len(keys))])


def read(store, keys: list[str], gen: int) -> tuple[int, int]:
    """(hits with this key's bytes, hits with any other bytes)."""
    r = HostBuffer(len(keys), PAGE, 2)
    got = store.get_into(keys, [r.page(i) for i in range(len(keys))])
    right = sum(1 for i, k in enumerate(keys) if got[i] and r.read(i) == page_bytes(k, gen, PAGE))
    return right, sum(got) - right


@pytest.fixture
def services(tmp_path):
    started: list[MetaProcess] = []

    def start(name: str, **kw) -> MetaProcess:
        m = MetaProcess(tmp_path / name, fsync="never", **kw).start()
        started.append(m)
        return m

    yield start
    for m in started:
        m.stop()


# ---------------------------------------------------------------------------------
# The data dir: one service at a time
# ---------------------------------------------------------------------------------


@pytest.mark.failure_injection
def test_second_service_on_the_same_data_dir_is_refused(tmp_path, services):
    a = services("meta")
    b = MetaProcess(tmp_path / "meta", fsync="never")
    with pytest.raises(RuntimeError) as e:
        b.start(timeout=30)
    assert b.proc.returncode == 2, b.proc.returncode  # a one-line error, not a traceback
    msg = str(e.value)
    assert str(tmp_path / "meta") in msg and f"pid {a.proc.pid}" in msg, msg
    assert "in use by another metadata service" in msg and "Traceback" not in msg
    # the first one still serves, byte-exact
    s = create_store("hf3fs", opts(tmp_path / "data" / "hicache", a.url))
    try:
        keys = [f"dir-{i}" for i in range(16)]
        assert write(s, keys, 1) == [True] * 16
        assert read(s, keys, 1) == (16, 0)
    finally:
        s.close()


def test_in_process_server_on_a_held_data_dir_is_refused_and_frees_it_on_stop(tmp_path):
    from kvconnect.connectors.hf3fs.service import MetaServer

    first = MetaServer("127.0.0.1", 0, str(tmp_path / "meta"), fsync="never").start()
    try:
        with pytest.raises(Locked) as e:
            MetaServer("127.0.0.1", 0, str(tmp_path / "meta"), fsync="never")
        assert f"pid {os.getpid()}" in str(e.value) and str(tmp_path / "meta") in str(e.value)
        ident = first.identity
    finally:
        first.stop()
    again = MetaServer("127.0.0.1", 0, str(tmp_path / "meta"), fsync="never").start()
    try:
        assert again.identity == ident  # the same index, its identity kept in the dir
    finally:
        again.stop()


@pytest.mark.failure_injection
def test_kill9_of_the_holder_frees_the_dir_and_its_pages_stay_readable(tmp_path, services):
    a = services("meta")
    prefix = tmp_path / "data" / "hicache"
    keys = [f"k9-{i}" for i in range(64)]
    s = create_store("hf3fs", opts(prefix, a.url))
    try:
        assert write(s, keys, 7) == [True] * 64
    finally:
        s.close()
    a.kill9()
    b = services("meta")  # same dir: the kernel released the dead holder's lock
    assert b.identity == a.identity and b.recovery["keys"] == 64
    s = create_store("hf3fs", opts(prefix, b.url))
    try:
        assert read(s, keys, 7) == (64, 0)
    finally:
        s.close()


def test_restart_of_the_same_service_keeps_its_pages_readable(tmp_path, services):
    a = services("meta")
    prefix = tmp_path / "data" / "hicache"
    keys = [f"rs-{i}" for i in range(64)]
    s = create_store("hf3fs", opts(prefix, a.url))
    try:
        assert write(s, keys, 3) == [True] * 64
        a.stop()  # SIGTERM: a clean stop
        b = services("meta")
        assert b.identity == a.identity
        stamp = read_stamp(f"{prefix}.0.bin")
        assert stamp["index"] == a.identity and stamp["namespace"] == "0:kv"
        fresh = create_store("hf3fs", opts(prefix, b.url))  # a new engine process would open the file anew
        try:
            assert read(fresh, keys, 3) == (64, 0)
        finally:
            fresh.close()
    finally:
        s.close()


# ---------------------------------------------------------------------------------
# Data files: stamped with their index, refused by any other
# ---------------------------------------------------------------------------------


@pytest.mark.failure_injection
@pytest.mark.parametrize("verify_pages", ["off", "on"])
def test_two_services_sharing_a_prefix_never_return_another_keys_bytes(tmp_path, services, verify_pages):
    """The reported case: two services in separate dirs, engines of both on one
    file_path_prefix, 1,024 reads. The second index's clients are refused the file (with
    the identity check off too: the stamp alone keeps them out)."""
    a, b = services("meta-a"), services("meta-b")
    assert a.identity != b.identity
    prefix = tmp_path / "data" / "hicache"
    keys_a = [f"a-{i}" for i in range(128)]
    keys_b = [f"b-{i}" for i in range(128)]
    sa = create_store("hf3fs", opts(prefix, a.url, verify_pages=verify_pages))
    try:
        assert write(sa, keys_a, 1) == [True] * 128
        # a client of B that knows its page size opens the file at start: a clear error
        with pytest.raises(ConfigError) as e:
            create_store("hf3fs", opts(prefix, b.url, verify_pages=verify_pages))
        msg = str(e.value)
        assert e.value.key == "file_path_prefix"
        assert f"{prefix}.0.bin" in msg and a.identity in msg and b.identity in msg and STAMP_SUFFIX in msg, msg
        # one that does not (no page size known before the first page) writes nothing and reads nothing
        no_hint = {k: v for k, v in opts(prefix, b.url, verify_pages=verify_pages).items() if k != "page_bytes"}
        sb = create_store("hf3fs", no_hint)
        try:
            wrong = right_b = 0
            for r in range(4):  # 1,024 reads in all, a's keys and b's own
                assert write(sb, keys_b, 2) == [False] * 128
                ok, bad = read(sb, keys_a, 1)
                wrong += bad
                right_b += ok
                ok, bad = read(sb, keys_b, 2)
                wrong += bad
                right_b += ok
            assert wrong == 0 and right_b == 0
        finally:
            sb.close()
        # a's pages are untouched
        assert read(sa, keys_a, 1) == (128, 0)
    finally:
        sa.close()


def test_an_unstamped_file_is_adopted_by_the_first_index_that_opens_it(tmp_path, services):
    """A data file from before stamps (its stamp removed here) is adopted, not refused: its
    own index reads its pages again; another index is refused it afterwards."""
    a, b = services("meta-a"), services("meta-b")
    prefix = tmp_path / "data" / "hicache"
    keys = [f"old-{i}" for i in range(32)]
    s = create_store("hf3fs", opts(prefix, a.url))
    try:
        assert write(s, keys, 5) == [True] * 32
    finally:
        s.close()
    stamp = Path(f"{prefix}.0.bin{STAMP_SUFFIX}")
    stamp.unlink()  # as a file written before this version
    s = create_store("hf3fs", opts(prefix, a.url))
    try:
        assert json.loads(stamp.read_text())["index"] == a.identity
        assert read(s, keys, 5) == (32, 0)
    finally:
        s.close()
    with pytest.raises(ConfigError, match="belongs to another page index"):
        create_store("hf3fs", opts(prefix, b.url))


def test_pages_of_a_file_from_before_stamps_and_records_are_misses_then_rewritten(tmp_path, services):
    """A data file written by an older version (no stamp, no identity records: written here
    with verify_pages off and its stamp removed) is adopted; with the default (the identity
    check on with a service) its old pages read as misses, never as other bytes, and are
    written again; an engine with verify_pages off still reads them."""
    a = services("meta")
    prefix = tmp_path / "data" / "hicache"
    keys = [f"v0-{i}" for i in range(32)]
    old = create_store("hf3fs", opts(prefix, a.url, verify_pages="off"))
    try:
        assert not old.verify
        assert write(old, keys[:16], 1) == [True] * 16
    finally:
        old.close()
    Path(f"{prefix}.0.bin{STAMP_SUFFIX}").unlink()
    off = create_store("hf3fs", opts(prefix, a.url, verify_pages="off"))
    try:
        assert read(off, keys[:16], 1) == (16, 0)  # adopted: the old pages are there
        assert write(off, keys[16:], 1) == [True] * 16
    finally:
        off.close()
    s = create_store("hf3fs", opts(prefix, a.url))  # verify_pages: auto
    try:
        assert s.verify and s.stats().extra["verify_pages"] is True
        assert read(s, keys, 1) == (0, 0)  # no records for them: misses, dropped
        assert s.stale_reads == 32 and s.exists(keys) == [False] * 32
        assert write(s, keys, 2) == [True] * 32
        assert read(s, keys, 2) == (32, 0)
    finally:
        s.close()


def test_two_indexes_opening_a_new_file_at_once_one_wins(tmp_path, services):
    """Clients of two services race to adopt new files: each time exactly one index gets
    the file; every client of the winner opens it."""
    a, b = services("meta-a"), services("meta-b")
    for round_ in range(6):
        prefix = tmp_path / f"race-{round_}" / "hicache"
        results: dict[str, list] = {"a": [], "b": []}

        def open_one(name, url):
            try:
                results[name].append(create_store("hf3fs", opts(prefix, url)))
            except ConfigError as e:
                results[name].append(e)

        threads = [threading.Thread(target=open_one, args=(n, m.url)) for n, m in
                   (("a", a), ("b", b), ("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        won = [n for n, rs in results.items() if all(not isinstance(r, Exception) for r in rs)]
        lost = [n for n, rs in results.items() if all(isinstance(r, ConfigError) for r in rs)]
        assert len(won) == 1 and len(lost) == 1, results
        winner = {"a": a, "b": b}[won[0]]
        assert read_stamp(f"{prefix}.0.bin")["index"] == winner.identity
        stores = results[won[0]]
        keys = [f"race-{round_}-{i}" for i in range(8)]
        assert write(stores[0], keys, round_) == [True] * 8
        assert read(stores[1], keys, round_) == (8, 0)
        for st in stores:
            st.close()


def test_in_process_index_and_a_service_never_share_a_file(tmp_path, services):
    a = services("meta")
    # an engine with the in-process index holds its file: a service's client is refused it
    local_prefix = tmp_path / "local" / "hicache"
    local = create_store("hf3fs", opts(local_prefix, None))
    try:
        keys = [f"loc-{i}" for i in range(8)]
        assert write(local, keys, 1) == [True] * 8
        with pytest.raises(ConfigError) as e:
            create_store("hf3fs", opts(local_prefix, a.url))
        assert f"pid {os.getpid()}" in str(e.value) and "in-process index" in str(e.value)
        assert read(local, keys, 1) == (8, 0)
    finally:
        local.close()
    # a file a service's index adopted is refused to an in-process index
    prefix = tmp_path / "svc" / "hicache"
    s = create_store("hf3fs", opts(prefix, a.url))
    try:
        with pytest.raises(ConfigError, match="belongs to another page index"):
            create_store("hf3fs", opts(prefix, None, client_timeout=1))
    finally:
        s.close()


def test_redis_index_stamps_its_identity_and_other_indexes_are_refused(tmp_path, services, redis_url):
    pytest.importorskip("redis")
    from kvconnect.connectors.hf3fs.redis_index import RedisMetadata

    url, key_prefix = redis_url
    c = RedisMetadata(url, key_prefix=key_prefix)
    ident = c.identity()
    assert ident.startswith("redis:") and RedisMetadata(url, key_prefix=key_prefix).identity() == ident
    c.close()
    prefix = tmp_path / "data" / "hicache"
    keys = [f"r-{i}" for i in range(32)]
    r1 = create_store("hf3fs", opts(prefix, url, metadata_key_prefix=key_prefix))
    try:
        assert write(r1, keys, 4) == [True] * 32
        assert read_stamp(f"{prefix}.0.bin")["index"] == ident
        # a second client of the same Redis index: the same identity, the file is its too
        r2 = create_store("hf3fs", opts(prefix, url, metadata_key_prefix=key_prefix))
        try:
            assert read(r2, keys, 4) == (32, 0)
        finally:
            r2.close()
        # another index on the same server (another key prefix), and a kvconnect service: refused
        with pytest.raises(ConfigError, match="belongs to another page index"):
            create_store("hf3fs", opts(prefix, url, metadata_key_prefix=key_prefix + "-other"))
        with pytest.raises(ConfigError, match="belongs to another page index"):
            create_store("hf3fs", opts(prefix, services("meta").url))
        assert read(r1, keys, 4) == (32, 0)
    finally:
        r1.close()
