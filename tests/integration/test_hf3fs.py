"""HF3FS store end to end: real metadata service processes, real files, real SGLang pools.

Real: ``kvconnect hf3fs-meta serve`` started as its own process on 127.0.0.1 (killed with
SIGKILL in the durability test), data files in a temporary directory shared by two engine
processes, SGLang 0.5.23's ``StorageBackendFactory`` + CPU host pools + kvconnect's
``KVConnectStorage`` in each engine process (examples/hf3fs/engine.py).

Not real: a 3FS mount (none here), so the usrbio client is only tested where one exists
(``KVCONNECT_TEST_3FS_DIR``); everything else uses the POSIX client, which is what runs on
any filesystem.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvconnect.connectors.base import BackendUnavailable, Capability, ConfigError, MissingCapability, UnknownConfigKey
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.buffers import HostBuffer
from kvconnect.connectors.hf3fs.client import LocalMetadata
from kvconnect.connectors.hf3fs.config import HF3FSConfig
from kvconnect.connectors.hf3fs.index import PageIndex
from kvconnect.connectors.hf3fs.store import HF3FSStore
from kvconnect.connectors.registry import create_store
from kvconnect.connectors.testing.hf3fs import MetaProcess
from kvconnect.connectors.testing.processes import free_port
from kvconnect.connectors.testing.conformance import PAGE, check_page, page_bytes, race

ROOT = Path(__file__).resolve().parents[2]
grpc = pytest.importorskip("grpc", reason="the metadata service needs grpcio (extra 'hf3fs')")


@pytest.fixture
def meta(tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-" + os.urandom(8).hex())
    m = MetaProcess(tmp_path / "meta", token).start()
    yield m
    m.stop()


def store_opts(tmp_path, meta=None, **kw):
    opts = {"file_path_prefix": str(tmp_path / "shared" / "hicache"), "file_size": 64 * PAGE,
            "numjobs": 4, "entries": 4, "client_timeout": 3}
    if meta is not None:
        opts.update(metadata_server_url=meta.url, auth_token_file=str(meta.token_file))
    opts.update(kw)
    return opts


def write_pages(store, keys, gen=0, size=PAGE):
    b = HostBuffer(len(keys), size, 2)
    for i, k in enumerate(keys):
        b.fill(i, page_bytes(k, gen, size))
    return store.put_from(keys, [b.page(i) for i in range(len(keys))])


def read_pages(store, keys, size=PAGE):
    b = HostBuffer(len(keys), size, 2)
    ok = store.get_into(keys, [b.page(i) for i in range(len(keys))])
    return ok, [b.read(i) for i in range(len(keys))]


def keyset(n, tag=""):
    salt = os.urandom(4).hex()
    return [hashlib.sha256(f"{tag}{salt}{i}".encode()).hexdigest() for i in range(n)]


# ---------------------------------------------------------------------------------
# Two engine processes, one service, one shared directory
# ---------------------------------------------------------------------------------


@pytest.mark.sglang
def test_two_sglang_processes_share_pages_byte_exact(tmp_path, meta):
    """Process 1 backs up 300 real SGLang pages; process 2 (its own pool) hits all of them
    and reads them byte-exact, through SGLang's dynamic backend loading."""
    pytest.importorskip("sglang", reason="needs sglang 0.5.23 (scripts/install.sh)")
    out_w, out_r = tmp_path / "write.json", tmp_path / "read.json"
    cfg = {"pages": 300, "seed": 7, "store": store_opts(tmp_path, meta, file_size=8 << 20)}
    cfg_path = tmp_path / "engine.json"
    cfg_path.write_text(json.dumps(cfg))
    engine = [sys.executable, str(ROOT / "examples" / "hf3fs" / "engine.py")]
    # both engines start at once (their imports overlap); the reader waits for the writer
    procs = [subprocess.Popen(engine + ["write", "--config", str(cfg_path), "--out", str(out_w)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
             subprocess.Popen(engine + ["read", "--config", str(cfg_path), "--out", str(out_r),
                                        "--wait-for", str(out_w)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [json.loads(out_w.read_text()), json.loads(out_r.read_text())]
    w, r = outs
    assert w["written"] == 300
    assert r["exists"] == 300, r
    assert r["hits"] == 300 and r["exact"] == 300 and r["wrong"] == 0, r
    assert r["digest"] == w["digest"]  # both sides derived the same bytes
    assert (tmp_path / "shared" / "hicache.0.bin").exists()


# ---------------------------------------------------------------------------------
# Durability: kill -9 of the service under a write load
# ---------------------------------------------------------------------------------


@pytest.mark.failure_injection
def test_kill9_during_writes_keeps_every_confirmed_page(tmp_path, meta):
    """Writers hammer the service; SIGKILL it mid-load; restart on the same data dir: every
    key whose put returned True is found and byte-exact, and no page has two keys."""
    opts = store_opts(tmp_path, meta, file_size=4096 * PAGE, client_timeout=1, meta_retries=1)
    confirmed: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(seed):
        try:
            s = create_store("hf3fs", opts)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            return
        try:
            while not stop.is_set():
                keys = keyset(16, f"w{seed}")
                ok = write_pages(s, keys)
                with lock:
                    confirmed.extend(k for k, o in zip(keys, ok) if o)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            s.close()

    ts = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 30
    while len(confirmed) < 600 and time.monotonic() < deadline:
        time.sleep(0.05)
    meta.kill9()  # mid-load: writers are between reserve, write and confirm
    time.sleep(0.5)
    stop.set()
    for t in ts:
        t.join(30)
    assert not errors, errors[0]
    assert len(confirmed) >= 600
    assert len(set(confirmed)) == len(confirmed)

    meta.start()
    s = create_store("hf3fs", opts)
    try:
        for i in range(0, len(confirmed), 128):
            batch = confirmed[i:i + 128]
            ok, data = read_pages(s, batch)
            assert all(ok), f"{ok.count(False)} confirmed pages lost after kill -9"
            for k, d in zip(batch, data):
                check_page(k, d)
        # new writes after the restart must not land on a confirmed page
        fresh = keyset(256, "after")
        assert all(write_pages(s, fresh[:128])) and all(write_pages(s, fresh[128:]))
        everything = confirmed + fresh
        slots = []
        for i in range(0, len(everything), 128):
            batch = everything[i:i + 128]
            ok, data = read_pages(s, batch)
            assert all(ok)
            for k, d in zip(batch, data):
                check_page(k, d)
            sl, _, _ = s.meta.get(s.ns, [k.encode() for k in batch])
            slots += sl
        assert len(set(slots)) == len(slots), "a page is assigned to two keys"
    finally:
        s.close()


def test_restart_with_a_million_keys_is_ready_fast(tmp_path):
    """1,000,000 confirmed keys (half in a snapshot, half only in the journal): a fresh
    service process is serving in < 5 s and answers for keys from both halves."""
    from kvconnect.connectors.hf3fs.wal import Journal

    data = tmp_path / "meta"
    j = Journal(data, fsync="never", snapshot_interval_s=1e9)
    ix = PageIndex(journal=j)
    j.open(ix)
    ix.initialize("0:kv", 1_100_000, 4096)
    total, batch = 1_000_000, 1000
    sample = []
    for b in range(total // batch):
        keys = [f"{b:06d}-{i:04d}-".encode() + b"k" * 64 for i in range(batch)]
        st, sl, gn = ix.reserve("0:kv", keys)
        ix.commit("0:kv", keys, sl, gn, [0] * batch, b"\x01" * batch)
        if b % 100 == 0:
            sample.append(keys[b % batch])
        if b == total // batch // 2:
            j.snapshot()
    j.close()
    m = MetaProcess(data).start(timeout=60)
    try:
        assert m.recovery["keys"] == total
        # the index is rebuilt (snapshot + journal) in < 5 s; the whole process start adds
        # the interpreter and grpc imports, which a loaded shared machine slows down
        assert m.recovery["seconds"] < 5.0, m.recovery
        assert m.started_s < 5.0 + 5.0 * max(0.0, os.getloadavg()[0] / (os.cpu_count() or 1) - 1), (
            f"ready after {m.started_s:.2f}s", m.recovery, os.getloadavg())
        from kvconnect.connectors.hf3fs.client import RemoteMetadata

        c = RemoteMetadata(f"127.0.0.1:{m.port}")
        assert c.exists("0:kv", sample) == b"\x01" * len(sample)
        c.close()
    finally:
        m.stop()


# ---------------------------------------------------------------------------------
# Readers racing writers, evictions and deletes
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("read_lease_s", [5.0, 0.0], ids=["leases", "validate-every-read"])
def test_readers_racing_evictions_and_deletes_never_see_wrong_bytes(tmp_path, read_lease_s):
    """A 24-page file under constant eviction, deletion and rewrite while readers read:
    every hit is its own key's untorn page. With a zero read lease every read takes the
    generation re-check path and slots are reused under readers."""
    index = PageIndex(read_lease_s=read_lease_s, write_lease_s=5.0)
    meta = LocalMetadata(index)
    cfg = HF3FSConfig(**store_opts(tmp_path, file_size=24 * PAGE))
    stores = [HF3FSStore(cfg, metadata=meta) for _ in range(2)]
    keys = keyset(48)
    counts = {"hits": 0, "misses": 0, "rewrites": 0}

    def churn(seed, stop):
        rng = random.Random(seed)
        gen = 1
        while not stop.is_set():
            batch = rng.sample(keys, 6)
            if rng.random() < 0.3:
                stores[seed % 2].delete(batch[:2])
            write_pages(stores[seed % 2], batch, gen=gen)
            gen += 1
            counts["rewrites"] += 1

    def reader(seed, stop):
        rng = random.Random(seed)
        while not stop.is_set():
            batch = rng.sample(keys, 8)
            ok, data = read_pages(stores[seed % 2], batch)
            for k, hit, d in zip(batch, ok, data):
                if hit:
                    check_page(k, d)
                    counts["hits"] += 1
                else:
                    counts["misses"] += 1

    workers = [functools.partial(churn, i) for i in range(3)]
    workers += [functools.partial(reader, 10 + i) for i in range(4)]
    errors = race(workers, seconds=4, join_s=30)
    for s in stores:
        s.close()
    assert not errors, errors[0]
    assert counts["hits"] > 50 and counts["misses"] > 0 and counts["rewrites"] > 50, counts
    assert index.usage("0:kv")["evictions"] > 0


def test_reused_slot_under_a_reader_is_a_miss(tmp_path):
    """Deterministic version: a reader got (slot, generation) for key A; A is evicted and B
    written into that very slot before the read; the read must be a miss, not B's bytes."""
    clock = [100.0]
    index = PageIndex(read_lease_s=1.0, write_lease_s=5.0, clock=lambda: clock[0])
    meta = LocalMetadata(index)
    s = HF3FSStore(HF3FSConfig(**store_opts(tmp_path, file_size=PAGE)), metadata=meta)  # one page
    try:
        a, b = keyset(2)
        assert write_pages(s, [a]) == [True]
        real_get = meta.get

        def get_then_overwrite(ns, kb):
            out = real_get(ns, kb)
            clock[0] += 2.0  # the reader stalls past its lease ...
            assert write_pages(s, [b]) == [True]  # ... and B evicts A, taking its only page
            return out

        meta.get = get_then_overwrite
        for lane in s.lanes.all():
            lane.read_lease_s = 0.0  # the store re-validates any read that outlived its lease
        ok, data = read_pages(s, [a])
        assert ok == [False]
        meta.get = real_get
        ok, data = read_pages(s, [b])
        assert ok == [True] and check_page(b, data[0]) == 0
        assert s.rejected_reads == 1
    finally:
        s.close()


def test_two_writers_of_one_key_get_one_page(tmp_path):
    """The second writer of an in-flight key is told so; no page leaks or is doubled."""
    index = PageIndex()
    index.initialize("0:kv", 8, PAGE)
    k = b"key-1"
    st1, s1, g1 = index.reserve("0:kv", [k])
    st2, s2, g2 = index.reserve("0:kv", [k, k])
    assert st1 == bytes([0]) and st2 == bytes([2, 2])
    assert index.commit("0:kv", [k], s1, g1, [0], b"\x01") == b"\x01"
    assert index.usage("0:kv")["keys"] == 1 and index.usage("0:kv")["reserved"] == 0
    assert index.usage("0:kv")["free"] == 7
    st3, s3, _ = index.reserve("0:kv", [k])
    assert st3 == bytes([1]) and s3 == s1


def test_expired_reservation_is_reclaimed_and_late_confirm_refused():
    clock = [0.0]
    index = PageIndex(write_lease_s=1.0, clock=lambda: clock[0])
    index.initialize("0:kv", 1, PAGE)
    _, s1, g1 = index.reserve("0:kv", [b"a"])
    clock[0] = 5.0  # the writer died
    st, s2, g2 = index.reserve("0:kv", [b"b"])
    assert st == bytes([0]) and s2 == s1 and g2[0] == g1[0] + 1  # same page, new generation
    assert index.commit("0:kv", [b"a"], s1, g1, [0], b"\x01") == b"\x00"  # too late: not yours any more
    assert index.commit("0:kv", [b"b"], s2, g2, [0], b"\x01") == b"\x01"


# ---------------------------------------------------------------------------------
# Configuration: SGLang's JSON unchanged, and clear errors for bad input
# ---------------------------------------------------------------------------------


def test_sglang_json_via_env_var_works_unchanged(tmp_path, meta, monkeypatch):
    sg = {"file_path_prefix": str(tmp_path / "d" / "hicache"), "file_size": 64 * PAGE, "numjobs": 2,
          "entries": 8, "metadata_server_url": meta.url}
    path = tmp_path / "hf3fs_config.json"
    path.write_text(json.dumps(sg))
    monkeypatch.setenv("SGLANG_HICACHE_HF3FS_CONFIG_PATH", str(path))
    monkeypatch.setenv("KVCONNECT_HF3FS_TOKEN", meta.token_file.read_text())
    s = create_store("hf3fs", {"checksums": True})  # our key inline, theirs from the file
    try:
        keys = keyset(4)
        assert write_pages(s, keys) == [True] * 4
        ok, data = read_pages(s, keys)
        assert ok == [True] * 4 and [check_page(k, d) for k, d in zip(keys, data)] == [0] * 4
        assert s.config.numjobs == 2 and s.config.checksums
        assert (tmp_path / "d" / "hicache.0.bin").exists()
    finally:
        s.close()


def test_checksums_catch_bytes_changed_behind_the_index(tmp_path):
    s = create_store("hf3fs", store_opts(tmp_path, checksums=True))
    try:
        k = keyset(1)
        write_pages(s, k)
        lane = s.lanes.primary
        fd = os.open(lane.path, os.O_RDWR)
        os.pwrite(fd, b"\xff" * 16, 100)  # e.g. a stale cache or a zombie writer
        os.close(fd)
        ok, _ = read_pages(s, k)
        assert ok == [False]
        assert read_pages(s, keyset(2))[0] == [False, False]
        # misses by cause (kvconnect_store_misses_total): the bad bytes, then two index misses
        assert s.stats().misses["get"] == {"corrupt": 1, "not_found": 2}
    finally:
        s.close()


def test_missing_required_key_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_HF3FS_CONFIG_PATH", raising=False)
    opts = store_opts(tmp_path)
    del opts["file_size"]
    with pytest.raises(ConfigError, match="file_size.*required"):
        create_store("hf3fs", opts)


def test_unknown_key_in_sglang_json_is_named(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**store_opts(tmp_path), "numjob": 3}))
    monkeypatch.setenv("SGLANG_HICACHE_HF3FS_CONFIG_PATH", str(path))
    with pytest.raises(UnknownConfigKey, match="numjob"):
        create_store("hf3fs", {})


def test_unreadable_sglang_json_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_HF3FS_CONFIG_PATH", str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="SGLANG_HICACHE_HF3FS_CONFIG_PATH"):
        create_store("hf3fs", {})


def test_file_size_holding_no_page(tmp_path):
    with pytest.raises(ConfigError, match="file_size.*hold no page"):
        create_store("hf3fs", store_opts(tmp_path, file_size=1000, page_bytes=4096))


def test_file_size_holding_no_page_from_engine_context(tmp_path):
    with pytest.raises(ConfigError, match="file_size"):
        create_store("hf3fs", store_opts(tmp_path, file_size=1000), context=EngineContext(page_bytes=4096))


def test_unwritable_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="file_path_prefix"):
        create_store("hf3fs", store_opts(tmp_path, file_path_prefix=str(blocker / "sub" / "hicache")))


def test_unreachable_service_fails_start_fast(tmp_path):
    opts = store_opts(tmp_path, metadata_server_url=f"http://127.0.0.1:{free_port()}", client_timeout=1)
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable, match="metadata_server_url"):
        create_store("hf3fs", opts)
    assert time.monotonic() - t0 < 5


def test_bad_url_is_named(tmp_path):
    with pytest.raises(ConfigError, match="metadata_server_url"):
        create_store("hf3fs", store_opts(tmp_path, metadata_server_url="http://no-port"))


def test_wrong_token_fails_start(tmp_path, meta):
    opts = store_opts(tmp_path, meta)
    del opts["auth_token_file"]
    with pytest.raises(ConfigError, match="auth_token"):
        create_store("hf3fs", {**opts, "auth_token": "wrong"})
    with pytest.raises(ConfigError, match="auth_token"):
        create_store("hf3fs", opts)  # no token at all


def test_service_going_away_is_a_fast_miss(tmp_path, meta):
    s = create_store("hf3fs", store_opts(tmp_path, meta, client_timeout=1, meta_retries=2))
    try:
        keys = keyset(8)
        assert write_pages(s, keys) == [True] * 8
        meta.kill9()
        t0 = time.monotonic()
        assert s.exists(keys) == [False] * 8
        ok, _ = read_pages(s, keys)
        assert ok == [False] * 8
        assert write_pages(s, keyset(4)) == [False] * 4
        assert time.monotonic() - t0 < 4, "a dead service must cost bounded time"
        assert s.stats().errors >= 1
        st = s.stats()  # misses by cause and the health gauge (kvconnect_store_up)
        assert st.misses["get"] == {"unavailable": 8} and st.misses["exists"] == {"unavailable": 8}
        assert st.up is False
        meta.start()  # back (same data dir): the same store reconnects by itself
        deadline = time.monotonic() + 15
        ok = [False]
        while not all(ok) and time.monotonic() < deadline:
            time.sleep(0.3)
            ok, data = read_pages(s, keys)
        assert all(ok) and [check_page(k, d) for k, d in zip(keys, data)] == [0] * 8
        assert s.stats().up is True
    finally:
        s.close()


def test_second_process_on_a_file_without_service(tmp_path):
    """Without a metadata service a file belongs to one process (an exclusive lock): a
    second process of the same TP rank (another pipeline stage) takes the next free file
    instead of sharing the first, and does not see the first's pages, which still read back
    byte-exact. (Stores of one process share that process's index and file.)"""
    opts = store_opts(tmp_path)
    s = create_store("hf3fs", opts, context=EngineContext(page_bytes=PAGE))
    keys = keyset(4)
    try:
        assert s.path.endswith("hicache.0.bin")
        assert write_pages(s, keys) == [True] * 4
        code = ("import sys; sys.path.insert(0, %r)\n"
                "from kvconnect.connectors.registry import create_store\n"
                "from kvconnect.connectors.context import EngineContext\n"
                "a = create_store('hf3fs', %r, context=EngineContext(pp_rank=1, pp_size=2))\n"
                "print(a.path, a.exists(%r))\n") % (str(ROOT), opts, keys)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        path, seen = r.stdout.split(" ", 1)
        assert path.endswith("hicache.1.bin"), r.stdout + r.stderr
        assert seen == "[False, False, False, False]\n", r.stdout
        ok, data = read_pages(s, keys)
        assert ok == [True] * 4 and [check_page(k, d) for k, d in zip(keys, data)] == [0] * 4
    finally:
        s.close()


def test_usrbio_client_on_3fs_mount(tmp_path):
    """Exercised only on a machine with a 3FS mount and hf3fs-py-usrbio installed."""
    mount = os.environ.get("KVCONNECT_TEST_3FS_DIR")
    if not mount:
        pytest.skip("no 3FS mount here: set KVCONNECT_TEST_3FS_DIR to a directory on a 3FS mount")
    pytest.importorskip("hf3fs_fuse.io", reason="needs hf3fs-py-usrbio")
    s = create_store("hf3fs", store_opts(tmp_path, file_path_prefix=os.path.join(mount, f"kvc-{os.getpid()}"),
                                         client="usrbio"))
    try:
        keys = keyset(16)
        assert write_pages(s, keys) == [True] * 16
        ok, data = read_pages(s, keys)
        assert ok == [True] * 16 and all(check_page(k, d) == 0 for k, d in zip(keys, data))
    finally:
        s.close()



def test_mla_ranks_share_the_writer_ranks_file(tmp_path, meta):
    """MLA (rank-replicated KV): every rank uses file .0.bin and namespace 0:kv and reads
    what the writer rank wrote (which rank writes is the integration's: the store stores
    what it is given). Without a service the store is not shared: an integration that needs
    that is refused, naming the capability and the key that gives it."""
    opts = store_opts(tmp_path, meta)
    ctx = [EngineContext(tp_rank=r, tp_size=2, rank_replicated=True, page_bytes=PAGE) for r in range(2)]
    writer = create_store("hf3fs", opts, context=ctx[0])
    reader = create_store("hf3fs", opts, context=ctx[1])
    try:
        assert writer.path == reader.path and writer.path.endswith("hicache.0.bin")
        assert ctx[0].is_writer and not ctx[1].is_writer
        keys = keyset(8)
        assert write_pages(writer, keys) == [True] * 8
        ok, data = read_pages(reader, keys)
        assert ok == [True] * 8 and [check_page(k, d) for k, d in zip(keys, data)] == [0] * 8
    finally:
        writer.close()
        reader.close()
    with pytest.raises(MissingCapability, match="'shared'.*metadata_server_url"):
        create_store("hf3fs", store_opts(tmp_path / "local"), context=ctx[1], require=[Capability.SHARED])


def test_second_page_size_gets_its_own_file_and_is_found_by_other_processes(tmp_path, meta):
    """A hybrid model's side pool through the same store: pages of another size go to
    .bin.p<bytes> under namespace 0:kv:p<bytes>; a fresh store (another engine) finds both."""
    opts = store_opts(tmp_path, meta, file_size=64 * PAGE)
    a = create_store("hf3fs", opts)
    try:
        kv, side = keyset(4, "kv"), keyset(4, "side")
        assert write_pages(a, kv) == [True] * 4
        assert write_pages(a, side, size=PAGE // 4) == [True] * 4
        assert sorted(p.name for p in (tmp_path / "shared").iterdir() if not p.name.endswith((".lock", ".owner", ".ids"))) == [
            "hicache.0.bin", f"hicache.0.bin.p{PAGE // 4}"]
        b = create_store("hf3fs", opts)  # never wrote anything
        try:
            assert b.exists(kv + side) == [True] * 8
            ok, data = read_pages(b, side, size=PAGE // 4)
            assert ok == [True] * 4 and [check_page(k, d) for k, d in zip(side, data)] == [0] * 4
            ok, _ = read_pages(b, kv, size=PAGE // 2)  # a size nobody stored: a miss
            assert ok == [False] * 4
        finally:
            b.close()
    finally:
        a.close()


# ---------------------------------------------------------------- POSIX file client paths


def _pages_with_segments(nbytes: int, count: int, segments: int, seed: int):
    """``count`` pages of ``segments`` segments each, in separate host regions (as K and V),
    filled with distinct random bytes; returns (buffers kept alive, pages, expected bytes)."""
    rng = random.Random(seed)
    seg = nbytes // segments
    bufs = [HostBuffer(count, seg, 1) for _ in range(segments)]
    pages, want = [], []
    for i in range(count):
        page, data = [], b""
        for b in bufs:
            chunk = rng.randbytes(seg)
            b.fill(i, chunk)
            page.append(b.page(i)[0])
            data += chunk
        pages.append(page)
        want.append(data)
    return bufs, pages, want


def _page_bytes(page) -> bytes:
    import ctypes

    return b"".join(ctypes.string_at(addr, n) for addr, n in page)


@pytest.mark.parametrize("stage_bytes", [0, 3000, 64 * 1024])
@pytest.mark.parametrize("mmap_reads", [True, False])
def test_posix_file_batches_are_byte_exact(tmp_path, stage_bytes, mmap_reads):
    """Pages of two segments at adjacent and scattered slots, given in shuffled order:
    runs of adjacent slots become single vectored calls (direct) or pass through a staging
    buffer whose size divides neither the segments nor the pages; every page reads back
    exactly, through the mapping and through preadv."""
    from kvconnect.connectors.hf3fs.files import PosixFile

    pb, n = 24 * 1024, 24
    _keep, pages, want = _pages_with_segments(pb, n, 2, seed=stage_bytes)
    slots = list(range(3, 13)) + [20, 22, 23, 24, 40, 41, 42, 60, 61, 62, 63, 0, 1, 2]
    order = list(range(n))
    random.Random(7).shuffle(order)
    f = PosixFile(str(tmp_path / "d.bin"), 64 * pb, mmap_reads=mmap_reads, stage_bytes=stage_bytes)
    try:
        assert f.write_batch([(slots[i] * pb, pages[i]) for i in order]) == [True] * n
        _keep2, back, _ = _pages_with_segments(pb, n, 2, seed=99)  # other bytes until read
        random.Random(8).shuffle(order)
        assert f.read_batch([(slots[i] * pb, back[i]) for i in order]) == [True] * n
        assert [_page_bytes(p) for p in back] == want
        with open(tmp_path / "d.bin", "rb") as raw:
            for i in range(n):
                raw.seek(slots[i] * pb)
                assert raw.read(pb) == want[i]
    finally:
        f.close()


def test_posix_file_more_segments_than_one_syscall_takes(tmp_path):
    """A run of more than IOV_MAX segments is split across calls, still byte-exact."""
    from kvconnect.connectors.hf3fs.files import IOV_MAX, PosixFile

    seg, n = 512, IOV_MAX + 300
    bufs = [HostBuffer(1, seg, 1) for _ in range(n)]  # separate regions: nothing merges
    rng = random.Random(3)
    data = [rng.randbytes(seg) for _ in range(n)]
    for b, d in zip(bufs, data):
        b.fill(0, d)
    page = [b.page(0)[0] for b in bufs]
    f = PosixFile(str(tmp_path / "d.bin"), 4 * n * seg, mmap_reads=False)
    try:
        assert f.write_batch([(seg * n, page)]) == [True]
        back = [HostBuffer(1, seg, 1) for _ in range(n)]
        assert f.read_batch([(seg * n, [b.page(0)[0] for b in back])]) == [True]
        assert [b.read(0) for b in back] == data
    finally:
        f.close()


@pytest.mark.parametrize("stage_bytes", [0, 4096])
def test_posix_file_write_after_deadline_writes_nothing(tmp_path, stage_bytes):
    from kvconnect.connectors.hf3fs.files import PosixFile

    pb = 16 * 1024
    _keep, pages, _ = _pages_with_segments(pb, 4, 1, seed=1)
    f = PosixFile(str(tmp_path / "d.bin"), 8 * pb, stage_bytes=stage_bytes)
    try:
        assert f.write_batch([(i * pb, p) for i, p in enumerate(pages)], deadline=time.monotonic() - 1) == [False] * 4
        assert (tmp_path / "d.bin").read_bytes() == bytes(8 * pb)
    finally:
        f.close()


def test_posix_file_failures_are_false_not_exceptions(tmp_path):
    """A read past the mapped length and a write that the OS refuses come back False."""
    from kvconnect.connectors.hf3fs.files import PosixFile

    pb = 8192
    _keep, pages, _ = _pages_with_segments(pb, 2, 1, seed=2)
    f = PosixFile(str(tmp_path / "d.bin"), 4 * pb, mmap_reads=True, stage_bytes=4096)
    try:
        assert f.read_batch([(4 * pb, pages[0]), (0, pages[1])]) == [False, True]
        ro = os.open(tmp_path / "d.bin", os.O_RDONLY)
        os.close(f.fd)
        f.fd = ro  # the kernel refuses writes on this descriptor (EBADF)
        assert f.write_batch([(0, pages[0]), (2 * pb, pages[1])]) == [False, False]
    finally:
        f.close()


@pytest.mark.parametrize("posix_write", ["direct", "staged"])
def test_store_write_paths_round_trip(tmp_path, posix_write):
    s = create_store("hf3fs", store_opts(tmp_path, posix_write=posix_write, numjobs=3, entries=5))
    try:
        assert s.lanes.primary is None or (s.lanes.primary.file.stage_bytes > 0) == (posix_write == "staged")
        keys = keyset(17)
        assert write_pages(s, keys) == [True] * 17
        assert (s.lanes.primary.file.stage_bytes > 0) == (posix_write == "staged")
        ok, data = read_pages(s, keys)
        assert ok == [True] * 17 and [check_page(k, d) for k, d in zip(keys, data)] == [0] * 17
    finally:
        s.close()


def test_posix_write_key_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="posix_write"):
        create_store("hf3fs", store_opts(tmp_path, posix_write="odirect"))


@pytest.mark.parametrize("stage_bytes", [0, 5000])
def test_striped_file_places_slots_round_robin_byte_exact(tmp_path, stage_bytes):
    """Slot s lies in file s % n at (s // n) * page; batches in any order read back exactly."""
    from kvconnect.connectors.hf3fs.files import StripedFile

    pb, n = 16 * 1024, 20
    _keep, pages, want = _pages_with_segments(pb, n, 2, seed=5)
    slots = list(range(n))
    random.Random(1).shuffle(slots)
    f = StripedFile(str(tmp_path / "d.bin"), 40 * pb, pb, 3, mmap_reads=True, stage_bytes=stage_bytes)
    try:
        assert f.write_batch([(s * pb, p) for s, p in zip(slots, pages)]) == [True] * n
        files = [tmp_path / "d.bin", tmp_path / "d.bin.1", tmp_path / "d.bin.2"]
        assert [p.stat().st_size for p in files] == [14 * pb] * 3  # ceil(40 / 3) pages each
        for s, d in zip(slots, want):
            with open(files[s % 3], "rb") as raw:
                raw.seek((s // 3) * pb)
                assert raw.read(pb) == d
        _keep2, back, _ = _pages_with_segments(pb, n, 2, seed=6)
        assert f.read_batch([(s * pb, p) for s, p in zip(slots, back)]) == [True] * n
        assert [_page_bytes(p) for p in back] == want
    finally:
        f.close()


def test_striped_store_has_its_own_files_and_namespace(tmp_path, meta):
    """posix_files=2 writes .bin.x2 and .bin.x2.1 under namespace 0:kv:x2; a store of the
    same prefix without striping (another layout) sees none of its keys: a miss, never
    bytes read through the wrong layout."""
    striped = create_store("hf3fs", store_opts(tmp_path, meta, posix_files=2))
    plain = create_store("hf3fs", store_opts(tmp_path, meta))
    try:
        keys = keyset(9)
        assert write_pages(striped, keys) == [True] * 9
        assert striped.ns == "0:kv:x2"
        names = sorted(p.name for p in (tmp_path / "shared").iterdir() if not p.name.endswith((".lock", ".owner", ".ids")))
        assert "hicache.0.bin.x2" in names and "hicache.0.bin.x2.1" in names
        ok, data = read_pages(striped, keys)
        assert ok == [True] * 9 and [check_page(k, d) for k, d in zip(keys, data)] == [0] * 9
        assert plain.exists(keys) == [False] * 9
        assert read_pages(plain, keys)[0] == [False] * 9
        again = create_store("hf3fs", store_opts(tmp_path, meta, posix_files=2))  # another engine, same layout
        try:
            ok, data = read_pages(again, keys)
            assert ok == [True] * 9 and [check_page(k, d) for k, d in zip(keys, data)] == [0] * 9
        finally:
            again.close()
    finally:
        striped.close()
        plain.close()


@pytest.mark.parametrize("bad", [0, 65, "two"])
def test_posix_files_key_is_validated(tmp_path, bad):
    with pytest.raises(ConfigError, match="posix_files"):
        create_store("hf3fs", store_opts(tmp_path, posix_files=bad))


def test_auto_write_mode(tmp_path):
    """auto stages with one file and two or more workers and CPUs; never when striped (the
    files already copy in parallel) or with one worker."""
    from kvconnect.connectors.hf3fs.files import usable_cpus

    for i, (opts, staged) in enumerate([({"numjobs": 3}, usable_cpus() >= 2), ({"numjobs": 1}, False),
                                        ({"numjobs": 3, "posix_files": 2}, False)]):
        s = create_store("hf3fs", store_opts(tmp_path / str(i), **opts), context=EngineContext(page_bytes=PAGE))
        try:
            f = s.lanes.primary.file
            assert all((p.stage_bytes > 0) == staged for p in getattr(f, "files", [f]))
        finally:
            s.close()


def test_start_up_line_names_files_index_auth_and_key_space(tmp_path, meta, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="kvconnect")
    opts = store_opts(tmp_path, meta)
    s = create_store("hf3fs", opts, context=EngineContext(engine="sglang-hicache", tp_rank=1, tp_size=2))
    try:
        (line,) = [r.getMessage() for r in caplog.records
                   if r.name == "kvconnect" and r.getMessage().startswith("kvconnect hf3fs:")]
        assert line.startswith(f"kvconnect hf3fs: files {opts['file_path_prefix']}.1.bin (posix, NOT a 3FS mount), "
                               f"index {meta.url} (auth on, "), line
        assert "key space 1:kv" in line and "for sglang-hicache" in line and "tp1/2" in line, line
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        s.close()


def test_a_3fs_looking_path_off_a_3fs_mount_warns(tmp_path, caplog):
    """/mnt/3fs/... that is no 3FS mount (the mount is missing) silently becomes a local file: say so."""
    import logging

    caplog.set_level(logging.INFO, logger="kvconnect")
    prefix = tmp_path / "3fs" / "kvc"
    s = create_store("hf3fs", store_opts(tmp_path, file_path_prefix=str(prefix)))
    try:
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and f"file_path_prefix {prefix} looks like a 3FS mount" in warned[0], warned
        assert "not 3FS" in warned[0]
        (line,) = [r.getMessage() for r in caplog.records
                   if r.levelno == logging.INFO and r.getMessage().startswith("kvconnect hf3fs:")]
        assert "NOT a 3FS mount" in line and "in-process index (this process only)" in line, line
    finally:
        s.close()
