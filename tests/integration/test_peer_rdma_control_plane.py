"""The peer pool's control plane: one server per port (no split brain), all-or-nothing starts,
token files and the open-port warnings.

Real: peer_rdma stores (gRPC control plane, Mooncake Transfer Engine over TCP) in this process
and ``kvconnect peer serve`` processes. The Transfer Engine listens on every interface, so the
module runs inside a loopback-only network namespace made for it (as the conformance suite).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time

import pytest

from kvconnect.connectors.testing.netns import outer_test
from kvconnect.connectors.testing.peer import skip_reason

INNER = os.environ.get("KVCONNECT_PEER_CP_NS")
PAGE = 64 << 10


def _deps() -> str | None:
    return skip_reason("grpc", "mooncake.engine")


if not INNER:
    test_control_plane_in_loopback_namespace = pytest.mark.failure_injection(  # runs the marked ones with -m
        outer_test(__file__, "KVCONNECT_PEER_CP_NS", _deps, prefix="kvq"))
else:
    from kvconnect.connectors.buffers import HostBuffer
    from kvconnect.connectors.registry import create_store
    from kvconnect.connectors.testing.conformance import page_bytes
    from kvconnect.connectors.testing.processes import free_port, python, stop

    def options(port: int, **kw) -> dict:
        o = {"discovery_addr": f"127.0.0.1:{port}", "protocol": "tcp", "global_segment_size": 64 * PAGE,
             "heartbeat_interval": 0.3, "member_ttl": 2.0, "join_timeout": 3.0}
        o.update(kw)
        return o

    def peer_threads() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("peer-")}

    def port_free(port: int) -> bool:
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
        finally:
            s.close()

    def wait(pred, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # bounded
            if pred():
                return True
            time.sleep(0.05)
        return pred()

    def write(store, keys, gen):
        b = HostBuffer(len(keys), PAGE, 2)
        for i, k in enumerate(keys):
            b.fill(i, page_bytes(k, gen, PAGE))
        return store.put_from(keys, [b.page(i) for i in range(len(keys))])

    def read(store, keys):
        b = HostBuffer(len(keys), PAGE, 2)
        ok = store.get_into(keys, [b.page(i) for i in range(len(keys))])
        return ok, [b.read(i) for i in range(len(keys))]

    def test_second_node_on_the_seed_port_joins_instead_of_serving_it():
        """Two nodes of one host with the same discovery address and the default control
        port (-1: the seed's port if free here): the first serves the seed port, the second
        cannot bind it (no SO_REUSEPORT) and joins the first as a member on a port of its
        own. No split brain: both see each other, and pages the second writes are read,
        byte-exact, by the first. An explicit control_port that is taken fails, naming it."""
        port = free_port()
        a = create_store("peer_rdma", options(port))
        try:
            b = create_store("peer_rdma", options(port))
            try:
                assert a.node.port == port and b.node.port != port
                assert wait(lambda: len(a.node.view.members) == 2 and len(b.node.view.members) == 2, 10), \
                    (a.node.view.ids, b.node.view.ids)
                keys = [f"sb-{i}" for i in range(16)]
                assert write(b, keys, 7) == [True] * 16
                ok, got = read(a, keys)
                assert ok == [True] * 16 and got == [page_bytes(k, 7, PAGE) for k in keys]
            finally:
                b.close()
            before = peer_threads()
            with pytest.raises(OSError, match=f"{port}"):
                create_store("peer_rdma", options(port, control_port=port))
            assert wait(lambda: peer_threads() <= before, 5), peer_threads() - before
        finally:
            a.close()

    @pytest.mark.failure_injection
    def test_failed_start_leaves_no_listener_and_no_threads(tmp_path):
        """A disk_path that cannot be created fails the start after the control port, the
        Transfer Engine and the pool threads were started: all of it is stopped again (the
        port can be bound, no peer-* thread is left)."""
        port = free_port()
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("x")
        before = peer_threads()
        from kvconnect.connectors.base import ConfigError

        with pytest.raises(ConfigError) as ei:  # named, not a bare OSError
            create_store("peer_rdma", options(port, control_port=port, disk_path=str(blocker / "disk")))
        assert ei.value.key == "disk_path" and "Not a directory" in str(ei.value), str(ei.value)
        assert wait(lambda: port_free(port), 5), "the control port is still bound"
        assert wait(lambda: peer_threads() <= before, 5), peer_threads() - before
        # and a node can start on that port right away
        s = create_store("peer_rdma", options(port, control_port=port))
        try:
            assert s.node.port == port
        finally:
            s.close()

    def wildcard_listeners() -> set[int]:
        """Ports of TCP sockets listening on every interface, in this module's own namespace."""
        ports = set()
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                cols = line.split()
                addr, port = cols[1].rsplit(":", 1)
                if cols[3] == "0A" and set(addr) == {"0"}:
                    ports.add(int(port, 16))
        return ports

    def test_a_closed_stores_transfer_engine_listeners_go_with_it():
        """docs/mooncake.md: a node's Transfer Engine opens two data listeners on every interface,
        whatever local_hostname says. They belong to the store: once a closed store is collected
        (it sits in a reference cycle, so Python's cycle collector frees it, not close() itself)
        they are gone, and create/close cycles do not pile them up. Counted by port, so a store an
        earlier test left for the collector may go away meanwhile without confusing the count."""
        import gc

        gc.collect()
        for _ in range(3):
            before = wildcard_listeners()
            s = create_store("peer_rdma", options(free_port()))
            # the engine's threads open and close its sockets: counted until they settle (bounded)
            assert wait(lambda: len(wildcard_listeners() - before) == 2, 5), (wildcard_listeners(), before)
            own = wildcard_listeners() - before
            s.close()
            del s
            gc.collect()
            assert wait(lambda: not (wildcard_listeners() & own), 5), (wildcard_listeners(), own)

    def _serve(tmp_path, name: str, args: list[str], env: dict | None = None, expect_ready: bool = True,
               nofile: int | None = None):
        from kvconnect.connectors.testing.processes import child_env, open_file_limit

        ready = tmp_path / f"ready-{name}"
        log = tmp_path / f"{name}.log"
        p = subprocess.Popen([python(), "-m", "kvconnect", "peer", "serve", "--protocol", "tcp",
                              "--global-segment-size", str(16 * PAGE), "--ready-file", str(ready), *args],
                             env=child_env(env or {}), stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                             start_new_session=True, preexec_fn=open_file_limit(nofile) if nofile else None)
        deadline = time.monotonic() + 60
        while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if expect_ready:
            assert ready.exists(), log.read_text()[-3000:]
        return p, log

    @pytest.mark.failure_injection
    def test_a_segment_larger_than_the_host_memory_is_refused_naming_the_key():
        """1,000 TB of lent memory on a host with far less: a ConfigError naming
        global_segment_size before anything is mapped or started."""
        from kvconnect.connectors.base import ConfigError

        before = peer_threads()
        with pytest.raises(ConfigError) as ei:
            create_store("peer_rdma", options(free_port(), global_segment_size="1000tb"))
        assert ei.value.key == "global_segment_size" and "memory" in str(ei.value), str(ei.value)
        assert wait(lambda: peer_threads() <= before, 5), peer_threads() - before

    @pytest.mark.failure_injection
    def test_two_thousand_idle_connections_at_a_hard_limit_of_1024(tmp_path):
        """A node (``kvconnect peer serve``) whose soft and hard open-file limits are both 1,024:
        2,000 TCP connections to its control port that never start HTTP/2 are held. gRPC takes at
        most ``rpc.connection_limit()`` of them and closes those without a handshake after
        ``rpc.HANDSHAKE_TIMEOUT_MS``; a client with the token is then served (a refused try is
        an error at once, not a hang), and the node stays up."""
        from kvconnect.connectors.peer_rdma.rpc import Clients, RpcError
        from kvconnect.connectors.rpc import HANDSHAKE_TIMEOUT_MS
        from kvconnect.connectors.testing.processes import hold_connections, own_open_file_limit, still_open

        restore_limit = own_open_file_limit(2200, "the test holds 2,000 sockets")
        tok = tmp_path / "tok"
        tok.write_text("peer-secret\n")
        port = free_port()
        p, log = _serve(tmp_path, "flooded", ["--discovery-addr", f"127.0.0.1:{port}", "--auth-token-file", str(tok)],
                        nofile=1024)
        idle: list[socket.socket] = []
        good = Clients("peer-secret", 1.0)
        try:
            idle = hold_connections(port, 2000)
            assert len(idle) >= 1900
            t0, stats, errors = time.monotonic(), None, []
            for _ in range(40):  # bounded
                try:
                    stats = good.call(f"127.0.0.1:{port}", "Stats", [])
                    break
                except RpcError as e:
                    errors.append(str(e))
                    time.sleep(0.25)
            took = time.monotonic() - t0
            assert stats is not None and stats["members"] == 1, errors[-3:]
            assert took < HANDSHAKE_TIMEOUT_MS / 1000 + 4, f"served after {took:.2f}s"
            open_left = still_open(idle, HANDSHAKE_TIMEOUT_MS / 1000 + 5)
            assert not open_left, f"{len(open_left)} connections without a handshake still open"
            assert p.poll() is None, log.read_text()[-2000:]
        finally:
            good.close()
            for s in idle:
                s.close()
            stop(p)
            restore_limit()

    def test_peer_serve_warnings_and_token_file(tmp_path):
        """``kvconnect peer serve``: a WARNING for a control plane on 0.0.0.0 without a token
        (none on 127.0.0.1), one for a token on the command line, one for a local_hostname
        nobody can reach; ``--auth-token-file`` works end to end (the wrong token is refused,
        the right one is served)."""
        from kvconnect.connectors.peer_rdma.rpc import Clients, RpcError

        port = free_port()
        p, log = _serve(tmp_path, "open", ["--discovery-addr", f"127.0.0.1:{port}", "--bind-host", "0.0.0.0"])
        stop(p)
        text = log.read_text()
        assert "WARNING" in text and "NO auth token" in text and "0.0.0.0" in text

        tok = tmp_path / "tok"
        tok.write_text("peer-secret\n")
        port = free_port()
        p, log = _serve(tmp_path, "closed", ["--discovery-addr", f"127.0.0.1:{port}",
                                             "--auth-token-file", str(tok)])
        try:
            assert "NO auth token" not in log.read_text()
            bad = Clients("wrong", 2.0)
            with pytest.raises(RpcError, match="UNAUTHENTICATED"):
                bad.call(f"127.0.0.1:{port}", "Stats", [])
            bad.close()
            good = Clients("peer-secret", 2.0)
            assert good.call(f"127.0.0.1:{port}", "Stats", [])["members"] == 1
            good.close()
        finally:
            stop(p)

        port = free_port()
        p, log = _serve(tmp_path, "cli-token", ["--discovery-addr", f"127.0.0.1:{port}", "--auth-token", "abc",
                                                "--local-hostname", "10.1.2.3"])
        stop(p)
        text = log.read_text()
        assert "command line" in text and "ps" in text
        assert "NO auth token" not in text
        assert "local_hostname 10.1.2.3" in text and "bind_host is 127.0.0.1" in text

    def test_peer_serve_that_fails_after_joining_leaves_at_once(tmp_path):
        """``kvconnect peer serve --metrics-port`` on a taken port: the node had joined; it
        exits with the error and leaves the pool (the seed drops it before member_ttl)."""
        port = free_port()
        seed = create_store("peer_rdma", options(port, member_ttl=30.0))
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            p, log = _serve(tmp_path, "metrics", ["--discovery-addr", f"127.0.0.1:{port}", "--control-port", "0",
                                                   "--metrics-port", str(taken.getsockname()[1])],
                            expect_ready=False)
            assert p.wait(60) != 0
            assert wait(lambda: len(seed.node.view.members) == 1, 5), seed.node.view.ids  # left, not timed out
        finally:
            taken.close()
            seed.close()

    def test_rdma_keys_of_the_pool_guide_reach_the_engine():
        """gid_index / ib_port (the peer-pool guide's RDMA keys) are accepted; with protocol
        rdma they reach the Transfer Engine (MC_GID_INDEX / MC_IB_PORT, read at its
        creation); the node starts and serves (TCP here: no NIC)."""
        for k in ("MC_GID_INDEX", "MC_IB_PORT"):
            os.environ.pop(k, None)
        port = free_port()
        s = create_store("peer_rdma", options(port, protocol="tcp", gid_index=3, ib_port=2))
        s.close()
        assert "MC_GID_INDEX" not in os.environ  # tcp: ignored (logged)
        s = create_store("peer_rdma", options(port, protocol="rdma", gid_index=3, ib_port=2))
        try:
            assert os.environ["MC_GID_INDEX"] == "3" and os.environ["MC_IB_PORT"] == "2"
            assert write(s, ["g1"], 1) == [True] and read(s, ["g1"])[1] == [page_bytes("g1", 1, PAGE)]
        finally:
            s.close()
