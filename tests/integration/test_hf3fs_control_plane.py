"""The HF3FS metadata service as a control plane: pre-auth limits, token files and the open-port
warning, recovery after a restart, SGLang's mini-server flags and URL.

Real: ``kvconnect hf3fs-meta serve`` processes on 127.0.0.1 (or inside a network namespace made
here, for the 0.0.0.0 warning), HF3FS stores with real files reading and writing bytes, SGLang's
own ``mini_3fs_metadata_server`` process for the wrong-URL error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from kvconnect.connectors.base import BackendUnavailable, ConfigError
from kvconnect.connectors.buffers import HostBuffer
from kvconnect.connectors.registry import create_store
from kvconnect.connectors.testing.conformance import PAGE, page_bytes
from kvconnect.connectors.testing.hf3fs import MetaProcess
from kvconnect.connectors.testing.netns import Netns, netns_available
from kvconnect.connectors.testing.processes import (child_env, free_port, hold_connections, own_open_file_limit,
                                                    still_open, stop)

grpc = pytest.importorskip("grpc", reason="the metadata service needs grpcio (extra 'hf3fs')")


def opts(tmp_path, meta, token_file=None, **kw):
    o = {"file_path_prefix": str(tmp_path / "data" / "hicache"), "file_size": 64 * PAGE, "numjobs": 2,
         "entries": 4, "client_timeout": 3, "metadata_server_url": meta.url}
    if token_file:
        o["auth_token_file"] = str(token_file)
    o.update(kw)
    return o


def put_get(store, keys, gen=0):
    """Write ``keys`` then read them back: (put results, get results, bytes right)."""
    b = HostBuffer(len(keys), PAGE, 2)
    for i, k in enumerate(keys):
        b.fill(i, page_bytes(k, gen, PAGE))
    put = store.put_from(keys, [b.page(i) for i in range(len(keys))])
    r = HostBuffer(len(keys), PAGE, 2)
    got = store.get_into(keys, [r.page(i) for i in range(len(keys))])
    return put, got, [r.read(i) == page_bytes(k, gen, PAGE) for i, k in enumerate(keys)]


def token_file(tmp_path, name="token", value=None):
    p = tmp_path / name
    p.write_text(value or "tok-" + os.urandom(8).hex())
    return p


# ---------------------------------------------------------------------------------
# Pre-auth limits
# ---------------------------------------------------------------------------------


@pytest.mark.failure_injection
def test_two_thousand_idle_connections_at_a_hard_limit_of_1024_do_not_lock_out_a_client(tmp_path):
    """2,000 framed TCP connections that never send HELLO, against a service whose soft *and*
    hard open-file limits are 1,024 (so it cannot raise them; a soft limit alone it raises,
    ``tests/unit/test_rpc.py``): the service closes connections past its cap of waiting ones
    and those that do not authenticate in time, and a real client still writes and reads
    pages byte-exact within a bound."""
    restore_limit = own_open_file_limit(2200, "the test itself holds 2,000 sockets")
    tok = token_file(tmp_path)
    meta = MetaProcess(tmp_path / "meta", tok, nofile=1024, nofile_hard=True).start()
    idle: list[socket.socket] = []
    try:
        store = create_store("hf3fs", opts(tmp_path, meta, tok))
        port = store.meta._endpoint(time.monotonic() + 3)  # the framed TCP port the service announces
        assert port
        idle = hold_connections(port, 2000)  # bounded: one connection each, none authenticates
        store.close()  # its pooled connection predates the flood
        t0 = time.monotonic()
        fresh = create_store("hf3fs", opts(tmp_path, meta, tok))
        try:
            keys = [f"flood-{i}" for i in range(8)]
            put, got, right = put_get(fresh, keys, gen=3)
            took = time.monotonic() - t0
        finally:
            fresh.close()
        assert put == [True] * 8 and got == [True] * 8 and all(right)
        assert took < 3.0, f"served after {took:.2f}s"
        assert len(idle) >= 1900
        # every idle connection was closed by the service within the HELLO deadline (+ slack)
        open_left = still_open(idle, 10)
        assert not open_left, f"{len(open_left)} unauthenticated connections still open"
    finally:
        for s in idle:
            s.close()
        meta.stop()
        restore_limit()


@pytest.mark.failure_injection
def test_two_thousand_idle_grpc_connections_at_a_hard_limit_of_1024(tmp_path):
    """The gRPC port (framed TCP off, so clients use gRPC) of a service whose soft and hard
    open-file limits are both 1,024: 2,000 TCP connections that never start HTTP/2 are held.
    gRPC accepts at most ``rpc.connection_limit()`` of them (closing the rest at once) and closes
    those that do not finish the handshake within ``rpc.HANDSHAKE_TIMEOUT_MS``; a real client
    then writes and reads pages byte-exact, a refused attempt being a miss, not a hang."""
    from kvconnect.connectors.rpc import HANDSHAKE_TIMEOUT_MS

    restore_limit = own_open_file_limit(2200, "the test itself holds 2,000 sockets")
    tok = token_file(tmp_path)
    meta = MetaProcess(tmp_path / "meta", tok, nofile=1024, nofile_hard=True, args=["--tcp-port", "-1"]).start()
    idle: list[socket.socket] = []
    try:
        idle = hold_connections(meta.port, 2000)
        assert len(idle) >= 1900
        t0 = time.monotonic()
        store = None
        for _ in range(10):  # bounded: a start while the cap is full fails fast (BackendUnavailable), as designed
            try:
                store = create_store("hf3fs", opts(tmp_path, meta, tok, client_timeout=1))
                break
            except BackendUnavailable:
                continue
        assert store is not None, f"no start in {time.monotonic() - t0:.1f}s"
        try:
            keys = [f"grpc-flood-{i}" for i in range(8)]
            for attempt in range(40):  # bounded: the first tries may be refused while the cap is full
                put, got, right = put_get(store, keys, gen=attempt)
                if put == [True] * 8:
                    break
                time.sleep(0.25)
            took = time.monotonic() - t0
        finally:
            store.close()
        assert put == [True] * 8 and got == [True] * 8 and all(right), (put, got)
        assert took < HANDSHAKE_TIMEOUT_MS / 1000 + 4, f"served after {took:.2f}s"
        assert meta.proc.poll() is None
        # the service closed every connection that never handshook: those past its cap at once,
        # the rest at the handshake deadline (+ slack)
        open_left = still_open(idle, HANDSHAKE_TIMEOUT_MS / 1000 + 5)
        assert not open_left, f"{len(open_left)} connections without a handshake still open"
    finally:
        for s in idle:
            s.close()
        meta.stop()
        restore_limit()


@pytest.mark.failure_injection
def test_unknown_framed_method_is_refused_by_name_not_with_a_traceback(tmp_path):
    """After HELLO, a framed message whose method id the service does not have is answered
    ``INVALID_ARGUMENT unknown method id``: no Python exception text goes back, and the
    connection keeps serving (a real Endpoint call on it afterwards). An empty frame breaks the
    framing itself: the service closes that connection, as it does one that announces a frame
    over 4 KiB before HELLO, or sends a HELLO with the wrong token (after answering it)."""
    from kvconnect.connectors.hf3fs import protocol as P

    tok = token_file(tmp_path)
    meta = MetaProcess(tmp_path / "meta", tok).start()
    try:
        store = create_store("hf3fs", opts(tmp_path, meta, tok))
        port = store.meta._endpoint(time.monotonic() + 3)
        store.close()

        def call(sock, msg: bytes) -> bytes:
            sock.sendall(P.FRAME.pack(len(msg)) + msg)
            data = b""
            while len(data) < 4 or len(data) < 4 + P.FRAME.unpack_from(data)[0]:
                chunk = sock.recv(1 << 16)
                assert chunk, "the service closed the connection"
                data += chunk
            return data[4:4 + P.FRAME.unpack_from(data)[0]]

        with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
            assert call(sock, bytes((P.HELLO,)) + tok.read_text().encode())[:1] == P.OK
            for msg in (bytes((200,)) + b"junk", bytes((len(P.METHODS),))):
                rep = call(sock, msg)
                assert rep[:1] == P.ERR, rep
                code, _, text = rep[1:].decode().partition("\n")
                assert code == "INVALID_ARGUMENT" and text.startswith("unknown method id"), rep
                assert "Error" not in text and "Traceback" not in text
            rep = call(sock, bytes((P.METHOD_ID["Endpoint"],)))
            assert rep[:1] == P.OK and len(rep) == 3 and int.from_bytes(rep[1:], "little") == port
            sock.sendall(P.FRAME.pack(0))
            assert sock.recv(16) == b""
        # before HELLO: a frame over 4 KiB closes the connection unread (no reply), and a HELLO
        # with the wrong token is answered UNAUTHENTICATED, then closed
        with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
            sock.sendall(P.FRAME.pack(4097))  # its length alone is refused: the body is never read
            assert sock.recv(16) == b""
        with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
            rep = call(sock, bytes((P.HELLO,)) + b"not-the-token")
            assert rep[:1] == P.ERR and rep[1:].decode().startswith("UNAUTHENTICATED"), rep
            assert sock.recv(16) == b""
    finally:
        meta.stop()


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.failure_injection
def test_unauthenticated_large_bodies_are_refused_before_they_are_read(tmp_path):
    """Six 64 MiB bodies without a token: refused UNAUTHENTICATED, and the service's memory
    does not grow by the bodies (the token is checked from the call's metadata first)."""
    tok = token_file(tmp_path)
    meta = MetaProcess(tmp_path / "meta", tok).start()
    try:
        before = _rss_kb(meta.proc.pid)
        body = b"\0" * ((64 << 20) - 1024)
        ch = grpc.insecure_channel(meta.address, options=[("grpc.max_send_message_length", 64 << 20)])
        call = ch.unary_unary("/kvconnect.hf3fs.Meta/Exists")
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(6) as pool:
            errs = list(pool.map(lambda _: _code(call, body), range(6)))
        peak = _rss_kb(meta.proc.pid)
        ch.close()
        print(f"service RSS before {before // 1024} MiB, after six unauthenticated 64 MiB bodies "
              f"{peak // 1024} MiB (+{(peak - before) // 1024} MiB)")
        assert errs == ["UNAUTHENTICATED"] * 6
        assert peak - before < 128 << 10, f"RSS grew {(peak - before) >> 10} MiB"
    finally:
        meta.stop()


def _code(call, body) -> str:
    try:
        call(body, timeout=20)
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


# ---------------------------------------------------------------------------------
# Tokens and warnings
# ---------------------------------------------------------------------------------


def test_auth_token_file_end_to_end(tmp_path):
    """``--auth-token-file`` on the service, ``auth_token_file`` in the store: the right token
    reads and writes bytes, a wrong one is refused naming the config key."""
    tok = token_file(tmp_path, value="right-token")
    meta = MetaProcess(tmp_path / "meta", args=["--auth-token-file", str(tok)]).start()
    try:
        with create_store("hf3fs", opts(tmp_path, meta, tok)) as s:
            put, got, right = put_get(s, ["a", "b"], gen=1)
            assert put == got == [True, True] and all(right)
        wrong = token_file(tmp_path, "wrong", "wrong-token")
        with pytest.raises(ConfigError, match="auth_token"):
            create_store("hf3fs", opts(tmp_path, meta, wrong))
        with pytest.raises(ConfigError, match="auth_token"):
            create_store("hf3fs", opts(tmp_path, meta))  # none at all
    finally:
        meta.stop()


def _serve_log(tmp_path, host: str, extra: list[str], exec_prefix: list[str] | None = None) -> str:
    m = MetaProcess(tmp_path / f"meta-{host}", args=extra, host=host, exec_prefix=exec_prefix,
                    log_path=tmp_path / f"log-{host}")
    m.start()
    m.stop()
    return (tmp_path / f"log-{host}").read_text()


def test_open_control_plane_warns_and_loopback_does_not(tmp_path):
    """No token and a bind beyond loopback: a WARNING at start. 127.0.0.1 without a token, or
    any address with a token: none. A token on the command line: a warning about ps."""
    loop = _serve_log(tmp_path, "127.0.0.1", [])
    assert "NO auth token" not in loop
    reason = netns_available()
    if reason:
        pytest.skip(reason)
    ns = Netns("kvw")  # 0.0.0.0 only inside a namespace of our own: nothing outside can reach it
    try:
        opened = _serve_log(tmp_path, "0.0.0.0", [], ns.exec_prefix())
        assert "WARNING" in opened and "NO auth token" in opened and "0.0.0.0" in opened
        tok = token_file(tmp_path)
        with_file = _serve_log(tmp_path / "f", "0.0.0.0", ["--auth-token-file", str(tok)], ns.exec_prefix())
        assert "NO auth token" not in with_file and "command line" not in with_file
        on_cli = _serve_log(tmp_path / "c", "0.0.0.0", ["--auth-token", "xyz"], ns.exec_prefix())
        assert "NO auth token" not in on_cli and "command line" in on_cli and "ps" in on_cli
    finally:
        ns.delete()


# ---------------------------------------------------------------------------------
# Recovery
# ---------------------------------------------------------------------------------


def _restart_and_time(tmp_path, port, meta, call) -> float | None:
    """kill -9 ``meta``, start it again on ``port`` and its data directory: seconds from its
    being ready to the first ``call()`` that returns True (None: not within 10 s)."""
    meta.kill9()
    assert not call()  # down: a miss or an error, no hang
    meta = MetaProcess(tmp_path / "meta", port=port).start()
    ready = time.monotonic()
    try:
        while time.monotonic() - ready < 10:  # bounded
            if call():
                return time.monotonic() - ready
            time.sleep(0.01)
        return None
    finally:
        meta.stop()


@pytest.mark.failure_injection
def test_store_is_back_within_a_second_of_a_restart(tmp_path):
    """The store (framed TCP): the first successful read, bytes checked, <= 1.5 s after the
    restarted service is ready."""
    port = free_port()
    meta = MetaProcess(tmp_path / "meta", port=port).start()
    store = create_store("hf3fs", opts(tmp_path, meta))
    try:
        keys = [f"r-{i}" for i in range(4)]
        put, got, right = put_get(store, keys, gen=5)
        assert put == got == [True] * 4 and all(right)
        b = HostBuffer(4, PAGE, 2)

        def read() -> bool:
            return store.get_into(keys, [b.page(i) for i in range(4)]) == [True] * 4

        back = _restart_and_time(tmp_path, port, meta, read)
        print(f"store: first successful read {back} s after the restarted service was ready")
        assert back is not None and back <= 1.5, f"back after {back}"
        assert [b.read(i) for i in range(4)] == [page_bytes(k, 5, PAGE) for k in keys]
    finally:
        store.close()
        meta.stop()


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_grpc_clients_are_back_within_a_second_of_a_restart(tmp_path, transport):
    """The gRPC paths (unary calls, Session streams) reconnect as fast."""
    from kvconnect.connectors.hf3fs.client import MetadataError, RemoteMetadata

    port = free_port()
    meta = MetaProcess(tmp_path / "meta", port=port).start()
    c = RemoteMetadata(meta.address, timeout=2, transport=transport)
    try:
        c.connect()
        c.initialize("0:kv", 64, PAGE)

        def usage() -> bool:
            try:
                return c.usage("0:kv")["num_pages"] == 64
            except MetadataError:
                return False

        assert usage()
        back = _restart_and_time(tmp_path, port, meta, usage)
        print(f"{transport}: first successful call {back} s after the restarted service was ready")
        assert back is not None and back <= 1.5, f"back after {back}"
    finally:
        c.close()
        meta.stop()


# ---------------------------------------------------------------------------------
# SGLang compatibility
# ---------------------------------------------------------------------------------


def test_sglang_mini_server_flags_start_the_service(tmp_path):
    """``--persistence-path`` / ``--save-interval`` (SGLang's mini_3fs_metadata_server flags)
    start our service; what is written survives a restart from that path."""
    port = free_port()
    path = tmp_path / "persist"
    cmd = [sys.executable, "-m", "kvconnect", "hf3fs-meta", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--persistence-path", str(path), "--save-interval", "60"]

    def start():
        ready = tmp_path / "ready"
        ready.unlink(missing_ok=True)
        p = subprocess.Popen(cmd + ["--ready-file", str(ready)], env=child_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        t0 = time.monotonic()
        while not ready.exists() and p.poll() is None and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert ready.exists(), p.stderr.read() if p.poll() is not None else "no ready file"
        return p

    class _M:
        url = f"http://127.0.0.1:{port}"

    p = start()
    try:
        with create_store("hf3fs", opts(tmp_path, _M)) as s:
            put, got, right = put_get(s, ["p1", "p2"], gen=2)
            assert put == got == [True, True] and all(right)
    finally:
        stop(p)
    err = p.stderr.read()
    assert "--save-interval 60" in err and "journaled" in err
    p = start()
    try:
        with create_store("hf3fs", opts(tmp_path, _M)) as s:
            b = HostBuffer(2, PAGE, 2)
            assert s.get_into(["p1", "p2"], [b.page(0), b.page(1)]) == [True, True]
            assert b.read(0) == page_bytes("p1", 2, PAGE)
    finally:
        stop(p)
    assert path.is_dir()


def test_url_of_sglang_http_metadata_server_says_what_to_run(tmp_path):
    """``metadata_server_url`` pointing at SGLang's own HTTP metadata server: a ConfigError
    naming the key and the command to run instead, not a bare timeout."""
    pytest.importorskip("sglang")
    pytest.importorskip("fastapi")
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server",
                          "--host", "127.0.0.1", "--port", str(port)], env=child_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:  # bounded: wait for its HTTP port
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                assert p.poll() is None, "SGLang's mini server exited"
                time.sleep(0.2)

        class _M:
            url = f"http://127.0.0.1:{port}"

        t0 = time.monotonic()
        with pytest.raises(ConfigError) as e:
            create_store("hf3fs", opts(tmp_path, _M, client_timeout=1, meta_retries=1))
        assert e.value.key == "metadata_server_url"
        assert "kvconnect hf3fs-meta serve" in str(e.value) and "mini_3fs_metadata_server" in str(e.value)
        assert time.monotonic() - t0 < 10
    finally:
        stop(p)
