"""HF3FS metadata service: framed TCP next to gRPC, and one-call writes (write leases + Put).

Real: ``MetaServer`` on 127.0.0.1 in this process, or ``kvconnect hf3fs-meta serve`` as a
child process where it is killed with SIGKILL; ``RemoteMetadata`` clients as the store
uses them (``reserve`` hands out leased slots, ``commit`` is one ``Put``).
"""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

grpc = pytest.importorskip("grpc", reason="the metadata service needs grpcio (extra 'hf3fs')")

from kvconnect.connectors.hf3fs import protocol as P  # noqa: E402
from kvconnect.connectors.hf3fs.client import AuthError, RemoteMetadata  # noqa: E402
from kvconnect.connectors.hf3fs.index import NEW  # noqa: E402
from kvconnect.connectors.hf3fs.service import MetaServer  # noqa: E402
from kvconnect.connectors.testing.hf3fs import MetaProcess  # noqa: E402

NS = "0:kv"


def keys(n: int, tag: str) -> list[bytes]:
    salt = os.urandom(4).hex()
    return [f"{tag}-{salt}-{i}".encode() for i in range(n)]


def write(c: RemoteMetadata, batch: list[bytes], crc: int = 0) -> bytes:
    """What the store does for a batch whose pages were all written."""
    st, sl, gn = c.reserve(NS, batch)
    new = [i for i, s in enumerate(st) if s == NEW]
    assert new, st
    ok = c.commit(NS, [batch[i] for i in new], [sl[i] for i in new], [gn[i] for i in new], [crc] * len(new),
                  b"\x01" * len(new))
    return ok


@pytest.fixture
def server(tmp_path):
    srv = MetaServer("127.0.0.1", 0, str(tmp_path / "meta"), token="s3cret", fsync="never",
                     write_lease_s=1.0).start()
    yield srv
    srv.stop(0)


@pytest.mark.parametrize("transport", ["auto", "tcp", "stream", "unary"])
def test_every_transport_serves_the_same_calls(server, transport):
    c = RemoteMetadata(server.address, "s3cret", timeout=5, transport=transport)
    try:
        c.connect()
        c.initialize(NS, 4096, 4096)
        batch = keys(128, transport)
        assert write(c, batch, crc=5) == b"\x01" * 128
        slots, gens, crcs = c.get(NS, batch)
        assert min(slots) >= 0 and len(set(slots)) == 128 and crcs == [5] * 128
        assert c.validate(NS, slots, gens) == b"\x01" * 128
        assert c.exists(NS, batch + [b"nope"]) == b"\x01" * 128 + b"\x00"
        assert c.delete(NS, batch[:3]) == b"\x01" * 3
        assert c.exists(NS, batch[:4]) == b"\x00\x00\x00\x01"
        if transport in ("auto", "tcp"):
            assert c._tcp_port == server.service.tcp_port > 0  # framed TCP, not gRPC
        assert c.usage(NS)["leased"] > 0  # slots leased ahead, for the next batches
    finally:
        c.close()
    other = RemoteMetadata(server.address, "s3cret", timeout=5)
    assert other.usage(NS)["leased"] == 0  # close gave them back
    other.close()


@pytest.mark.failure_injection
def test_framed_tcp_serves_nothing_before_the_token(server):
    bad = RemoteMetadata(server.address, "wrong", timeout=2, transport="tcp")
    with pytest.raises(AuthError):
        bad.exists(NS, [b"k"])
    bad.close()
    with socket.create_connection(("127.0.0.1", server.service.tcp_port), timeout=5) as s:
        msg = bytes((P.METHOD_ID["Spaces"],))  # a call without HELLO first
        s.sendall(struct.pack("<I", len(msg)) + msg)
        data = b""
        while True:
            more = s.recv(4096)
            if not more:
                break  # the service hung up
            data += more
        assert data[4:5] == P.ERR and b"UNAUTHENTICATED" in data
        assert b"0:kv" not in data


def test_dead_writers_lease_expires_and_its_pages_come_back(server):
    a = RemoteMetadata(server.address, "s3cret", timeout=5)
    a.initialize(NS, 64, 4096)
    st, sl, gn = a.reserve(NS, keys(4, "dead"))  # leased, pages "being written"...
    assert st == bytes(4) and a.usage(NS)["leased"] == 4 + 64 // 16
    for conn in a._idle_tcp:  # ... and the writer dies: no Put, no Unlease
        conn.close()
    a._idle_tcp.clear()
    b = RemoteMetadata(server.address, "s3cret", timeout=5)
    try:
        time.sleep(2.2)  # the service's write lease is 1 s; sweeps run once a second
        assert write(b, keys(8, "b")) == b"\x01" * 8  # its Lease sweeps the expired one
        u = b.usage(NS)
        assert u["expired"] == 4 + 64 // 16 and u["keys"] == 8
        assert u["free"] + u["keys"] + u["leased"] == 64  # every page accounted for
        # the dead writer's late Put is refused, never stored on a page someone else may hold
        assert a.put(NS, [b"late"], sl[:1], gn[:1], [0]) == b"\x00"
        assert b.exists(NS, [b"late"]) == b"\x00"
    finally:
        b.close()
        a.close()


def test_two_clients_writing_the_same_keys_get_one_page_each_and_leak_none(server):
    a = RemoteMetadata(server.address, "s3cret", timeout=5)
    b = RemoteMetadata(server.address, "s3cret", timeout=5)
    try:
        a.initialize(NS, 1024, 4096)
        same = keys(16, "same")
        sa = a.reserve(NS, same)
        sb = b.reserve(NS, same)  # both hold pages for all 16 keys, both write them
        assert sa[0] == sb[0] == bytes(16) and not set(sa[1]) & set(sb[1])
        assert a.commit(NS, same, sa[1], sa[2], [1] * 16, b"\x01" * 16) == b"\x01" * 16
        assert b.commit(NS, same, sb[1], sb[2], [2] * 16, b"\x01" * 16) == b"\x01" * 16  # stored: by a
        slots, _, crcs = b.get(NS, same)
        assert slots == sa[1] and crcs == [1] * 16  # a's pages, one per key
        # b met duplicates: its next batches go through Reserve (which tells it not to
        # write pages that exist), and it gave its leased pages back at once
        assert b.usage(NS)["leased"] == 1024 // 16 and b._leases[NS].reserve_credit > 0  # a's spare ones
        st, _, _ = b.reserve(NS, same[:4] + keys(2, "new"))
        assert st[:4] == bytes([1]) * 4 and st[4:] == bytes(2)  # EXISTS, EXISTS, ..., NEW, NEW
    finally:
        a.close()
        b.close()
    c = RemoteMetadata(server.address, "s3cret", timeout=5)
    u = c.usage(NS)
    c.close()
    assert u["keys"] == 16 and u["leased"] == 0 and u["reserved"] == 2  # b's last two: in flight
    assert u["free"] == 1024 - 18


def test_a_full_file_rewritten_evicts_nothing_and_new_keys_reserve(server):
    c = RemoteMetadata(server.address, "s3cret", timeout=5)
    try:
        c.initialize(NS, 32, 4096)
        batch = keys(32, "full")
        for i in range(0, 32, 8):
            assert write(c, batch[i:i + 8]) == b"\x01" * 8
        # the same keys again: leases find no free page, so Reserve says they exist
        st, _, _ = c.reserve(NS, batch[:8])
        assert st == bytes([1]) * 8
        u = c.usage(NS)
        assert u["keys"] == 32 and u["evictions"] == 0
        # new keys into the full file: Reserve (evicting) + Commit, and a Lease tried less and
        # less often while the file stays full
        calls: dict[str, int] = {}
        real = c._call

        def counted(method, payload):
            calls[method] = calls.get(method, 0) + 1
            return real(method, payload)

        c._call = counted
        for r in range(120):
            assert write(c, keys(8, f"more{r}")) == b"\x01" * 8
        assert calls["Reserve"] == calls["Commit"] == 120 and calls.get("Lease", 0) <= 5, calls
        assert c.usage(NS)["keys"] == 32 and c.usage(NS)["evictions"] == 120 * 8
    finally:
        c.close()


@pytest.mark.failure_injection
def test_kill9_keeps_every_put_and_the_writers_leases(tmp_path):
    """SIGKILL the service between a writer's Lease and its Put: after the restart (on a
    new framed TCP port) every key put before is there, the writer's leased pages are
    still its own (no other writer gets them) and its Put succeeds."""
    token = tmp_path / "token"
    token.write_text("tok-" + os.urandom(4).hex())
    meta = MetaProcess(tmp_path / "meta", token).start()
    a = RemoteMetadata(f"127.0.0.1:{meta.port}", token.read_text(), timeout=3, retries=3)
    b = None
    try:
        a.initialize(NS, 4096, 4096)
        done = []
        for r in range(5):
            batch = keys(128, f"a{r}")
            assert write(a, batch) == b"\x01" * 128
            done += batch
        pending = keys(128, "pending")
        st, sl, gn = a.reserve(NS, pending)  # pages "being written" when the service dies
        assert st == bytes(128)
        meta.kill9()
        meta.start()  # the framed TCP port is a new one: the client asks for it again
        ok = a.commit(NS, pending, sl, gn, [0] * 128, b"\x01" * 128)
        assert ok == b"\x01" * 128 and a._tcp_port
        b = RemoteMetadata(f"127.0.0.1:{meta.port}", token.read_text(), timeout=3)
        theirs = [keys(128, f"b{r}") for r in range(4)]
        for batch in theirs:
            assert write(b, batch) == b"\x01" * 128
        everything = done + pending
        slots, _, _ = b.get(NS, everything)
        assert min(slots) >= 0, f"{slots.count(-1)} stored keys lost after kill -9"
        assert b.usage(NS)["keys"] == len(everything) + 4 * 128
        allslots = slots + b.get(NS, [k for batch in theirs for k in batch])[0]
        assert len(set(allslots)) == len(allslots), "a page is assigned to two keys"
    finally:
        a.close()
        if b is not None:
            b.close()
        meta.stop()


def test_close_with_leases_and_a_dead_service_is_fast(tmp_path):
    meta = MetaProcess(tmp_path / "meta").start()
    c = RemoteMetadata(f"127.0.0.1:{meta.port}", None, timeout=5)
    try:
        c.initialize(NS, 4096, 4096)
        assert c.reserve(NS, keys(8, "held"))[0] == bytes(8)  # slots leased ahead, held
        meta.kill9()
        t0 = time.monotonic()
        c.close()  # tries to give them back, gives up: they expire with the service's lease
        assert time.monotonic() - t0 < 2.5
    finally:
        meta.stop()


def test_framed_tcp_under_fsync_always_answers_in_order_from_many_threads(tmp_path):
    """``--fsync always``: calls run on the executor, each connection one at a time."""
    import threading

    srv = MetaServer("127.0.0.1", 0, str(tmp_path / "meta"), token="t", fsync="always").start()
    errors: list[BaseException] = []
    try:
        c = RemoteMetadata(srv.address, "t", timeout=10, transport="tcp")
        c.initialize(NS, 8192, 4096)

        def writer(i: int) -> None:
            try:
                for r in range(5):
                    batch = keys(64, f"w{i}-{r}")
                    assert write(c, batch, crc=i) == b"\x01" * 64
                    slots, _, crcs = c.get(NS, batch)
                    assert min(slots) >= 0 and crcs == [i] * 64
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors[0]
        assert c.usage(NS)["keys"] == 4 * 5 * 64
        assert srv.journal.synced == srv.journal.appended > 0  # every answer waited for its fdatasync
        c.close()
    finally:
        srv.stop(0)


def test_auto_falls_back_to_grpc_when_the_tcp_port_is_unreachable(server):
    """A deployment that forwards only the gRPC port: calls still work (over gRPC)."""
    c = RemoteMetadata(server.address, "s3cret", timeout=5)
    try:
        c.initialize(NS, 1024, 4096)
        assert write(c, keys(8, "before")) == b"\x01" * 8 and c._tcp_port
        server._loop.call_soon_threadsafe(server._tcp.close)  # the port stops accepting
        for conn in c._idle_tcp:
            conn.close()
        c._idle_tcp.clear()
        time.sleep(0.2)
        batch = keys(8, "after")
        assert write(c, batch) == b"\x01" * 8  # over gRPC
        assert c.exists(NS, batch) == b"\x01" * 8
        assert c._tcp_off_until > time.monotonic()
        assert c._idle  # a gRPC Session stream carried them
    finally:
        c.close()
