"""Peer-pool membership through a Redis registry (``membership_url``): real ``redis-server``.

Outside a namespace: ``RegistryMembership`` objects against a real server on loopback
(joins, ``Leave``, expiry, a restarted node, a stalled server, a reply that skips events).
Inside a loopback-only namespace (the Transfer Engine listens on every interface): three
real ``peer_rdma`` stores on one registry, pages written on one and read byte-exact on the
others, then a node that leaves and one that dies.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from kvconnect.connectors.testing.netns import outer_test
from kvconnect.connectors.testing.peer import skip_reason
from kvconnect.connectors.testing.processes import wait_for
from kvconnect.connectors.testing.redis_cluster import RedisProcess, free_port, redis_skip_reason

INNER = os.environ.get("KVCONNECT_PEER_REG_NS")
PAGE = 64 << 10


def wait(pred, timeout: float) -> bool:
    return bool(wait_for(pred, timeout, interval=0.02))


@pytest.fixture
def server(tmp_path):
    why = redis_skip_reason()
    if why:
        pytest.skip(why)
    s = RedisProcess("127.0.0.1", free_port(), tmp_path / "redis").start()
    yield s
    s.terminate()


def _deps() -> str | None:
    return skip_reason("grpc", "mooncake.engine") or redis_skip_reason()


if not INNER:
    test_pool_on_a_registry_in_loopback_namespace = outer_test(__file__, "KVCONNECT_PEER_REG_NS", _deps,
                                                               prefix="kvr")

    def _node(server, i: int, *, ttl: float = 1.0, interval: float = 0.2, inc: int | None = None, timeout=0.3,
              url: str = ""):
        from kvconnect.connectors.peer_rdma.membership import Member
        from kvconnect.connectors.peer_rdma.registry_membership import RegistryMembership, registry_client

        client = registry_client(url or f"redis://127.0.0.1:{server.port}", None, timeout)
        me = Member(f"10.9.0.{i}:31998", inc or time.time_ns(), f"10.9.0.{i}:15000", 4096 * i, 1 << 20)
        return RegistryMembership(me, client, pool="t", interval=interval, ttl=ttl)

    def ids(m) -> set[str]:
        return set(m.view.members)

    def test_views_follow_joins_leaves_expiry_and_restarts(server):
        """Every node's view is the live set: after joins (records byte-exact: the segment
        address a reader would use), a Leave (at the next beat), a node that stops beating
        (after member_ttl) and a restart (the new incarnation replaces the old)."""
        nodes = [_node(server, i) for i in range(3)]
        try:
            for m in nodes:
                assert m.join(2.0)
            for m in nodes:
                m.start()
            every = {m.me.node_id for m in nodes}
            assert wait(lambda: all(ids(m) == every for m in nodes), 2.0), [ids(m) for m in nodes]
            got = nodes[0].view.members["10.9.0.2:31998"]
            assert (got.te_name, got.seg_base, got.seg_size, got.incarnation) == \
                ("10.9.0.2:15000", 8192, 1 << 20, nodes[2].me.incarnation)

            nodes[1].stop(leave=True)
            t0 = time.monotonic()
            assert wait(lambda: "10.9.0.1:31998" not in ids(nodes[0]), 1.0)
            assert time.monotonic() - t0 < 0.5  # a Leave is one beat away, not a TTL

            nodes[2].stop(leave=False)  # dies: only expiry removes it
            t0 = time.monotonic()
            assert "10.9.0.2:31998" in ids(nodes[0])
            assert wait(lambda: ids(nodes[0]) == {"10.9.0.0:31998"}, 3.0)
            assert 0.8 <= time.monotonic() - t0 <= 1.0 + 3 * 0.2 + 0.5  # member_ttl, give or take two beats

            again = _node(server, 2, inc=nodes[2].me.incarnation + 1)
            assert again.join(2.0)
            again.start()
            nodes.append(again)
            assert wait(lambda: nodes[0].view.members.get("10.9.0.2:31998") is not None and
                        nodes[0].view.members["10.9.0.2:31998"].incarnation == again.me.incarnation, 1.0)
            assert ids(again) == {"10.9.0.0:31998", "10.9.0.2:31998"}
        finally:
            for m in nodes:
                m.stop(leave=False)

    def test_a_stalled_registry_is_a_bounded_miss_then_a_rejoin(server):
        """A registry that stops answering (SIGSTOP) never blocks a beat past its socket
        timeout, never raises; after member_ttl the node works alone (the others have
        dropped it), and it rejoins with the full live set once the registry is back."""
        a, b = _node(server, 0), _node(server, 1)
        try:
            for m in (a, b):
                assert m.join(2.0)
            assert a.beat() and ids(a) == ids(b) == {"10.9.0.0:31998", "10.9.0.1:31998"}
            server.stop()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:  # bounded: past member_ttl
                t = time.monotonic()
                assert a.beat() is False
                assert time.monotonic() - t < 0.3 + 0.3  # one socket timeout, then a miss
            assert ids(a) == {"10.9.0.0:31998"}
        finally:
            server.cont()
        assert wait(lambda: a.beat() and b.beat() and ids(a) == ids(b) == {"10.9.0.0:31998", "10.9.0.1:31998"}, 3.0)
        for m in (a, b):
            m.stop(leave=False)

    def test_a_node_behind_the_trimmed_stream_reads_a_snapshot(server):
        """Events a node never saw (trimmed from the stream while it was away) show as a
        gap in their numbers: the node reads the live set again instead of missing a leave."""
        import redis

        a, b, c = (_node(server, i, ttl=30.0) for i in range(3))
        for m in (a, b, c):
            assert m.join(2.0)
        assert a.beat() and ids(a) == {"10.9.0.0:31998", "10.9.0.1:31998", "10.9.0.2:31998"}
        c.stop(leave=True)
        d = _node(server, 3, ttl=30.0)
        assert d.join(2.0)
        r = redis.Redis(host="127.0.0.1", port=server.port)
        r.xtrim(a.keys[2], maxlen=0)  # every event since a's last beat is gone
        r.close()
        e = _node(server, 4, ttl=30.0)
        assert e.join(2.0)  # its join is the only event left
        assert a.beat() and a.beat()
        assert ids(a) == {"10.9.0.0:31998", "10.9.0.1:31998", "10.9.0.3:31998", "10.9.0.4:31998"}
        for m in (a, b, d, e):
            m.stop(leave=False)

    def test_a_node_whose_last_event_the_registry_lost_reads_a_snapshot(server):
        """A registry that lost events a node had seen (a failover to a replica that had not
        received them) numbers new events from its own counter: when that counter has caught
        up with the node's, only the last event's tag tells the histories apart."""
        import redis

        a, b, c = (_node(server, i, ttl=30.0) for i in range(3))
        for m in (a, b, c):
            assert m.join(2.0)
        assert a.beat() and ids(a) == {"10.9.0.0:31998", "10.9.0.1:31998", "10.9.0.2:31998"}
        seen = a._last_seq
        r = redis.Redis(host="127.0.0.1", port=server.port)
        r.delete(a.keys[2], a.keys[3])  # the stream and its counter: every event is lost
        r.close()
        b.stop(leave=True)  # event 1 of the new history
        more = []
        while True:  # joins until the new counter is where a's was (bounded: one event each)
            more.append(_node(server, 3 + len(more), ttl=30.0))
            assert more[-1].join(2.0)
            if more[-1]._last_seq >= seen:
                break
        assert a._last_seq == seen
        assert a.beat()
        assert ids(a) == {"10.9.0.0:31998", "10.9.0.2:31998"} | {m.me.node_id for m in more}
        for m in (a, c, *more):
            m.stop(leave=False)

    def test_a_sentinel_failover_of_the_registry_keeps_the_pool_together(tmp_path):
        """The registry's primary killed -9 (a Sentinel group: primary, replica, three
        sentinels): with member_ttl above the failover time no view loses a member, the nodes
        follow the promoted replica, and a node that joins afterwards is in every view."""
        from kvconnect.connectors.testing.redis_cluster import RedisHA

        why = redis_skip_reason()
        if why:
            pytest.skip(why)
        ha = RedisHA(workdir=tmp_path / "ha").start()
        nodes = []
        try:
            nodes = [_node(None, i, ttl=8.0, url=ha.url) for i in range(3)]
            for m in nodes:
                assert m.join(3.0)
                m.start()
            every = {m.me.node_id for m in nodes}
            assert wait(lambda: all(ids(m) == every for m in nodes), 3.0)
            old = (ha.primary.host, ha.primary.port)
            ha.primary.kill9()
            def whole_until(done, timeout: float) -> None:
                deadline = time.monotonic() + timeout
                while not done():  # bounded
                    assert all(ids(m) == every for m in nodes), [ids(m) for m in nodes]
                    assert time.monotonic() < deadline
                    time.sleep(0.05)

            whole_until(lambda: ha.master_addr() not in (None, old), 12.0)
            answered = [m.traffic.messages for m in nodes]  # beats answered so far
            whole_until(lambda: all(m.traffic.messages >= n + 2 for m, n in zip(nodes, answered)), 5.0)
            assert all(m.traffic.failures >= 1 for m in nodes)  # they did lose the old primary
            late = _node(None, 7, ttl=8.0, url=ha.url)
            assert late.join(3.0)
            late.start()
            nodes.append(late)
            every.add(late.me.node_id)
            assert wait(lambda: all(ids(m) == every for m in nodes), 3.0), [ids(m) for m in nodes]
        finally:
            for m in nodes:
                m.stop(leave=False)
            ha.close()

    def test_bad_membership_config_names_the_key():
        from kvconnect.connectors.errors import ConfigError
        from kvconnect.connectors.peer_rdma.config import PeerRdmaConfig

        with pytest.raises(ConfigError, match=r"'membership_url'.*redis\+sentinel://"):
            PeerRdmaConfig(membership_url="etcd://127.0.0.1:2379")
        with pytest.raises(ConfigError, match=r"'membership_url'.*not run on a Redis Cluster"):
            PeerRdmaConfig(membership_url="redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
        with pytest.raises(ConfigError, match="'membership_pool'"):
            PeerRdmaConfig(membership_url="redis://127.0.0.1:6379", membership_pool="a{b}")

    def test_vectorised_placement_matches_the_scalar_rule():
        """Pools from 48 members on score with numpy: the owners must be the ones the
        pure-Python rule picks (nodes of different sizes must agree on every key)."""
        import xxhash

        from kvconnect.connectors.peer_rdma import placement

        members = [f"10.1.{i // 250}.{i % 250}:31998" for i in range(300)]

        def scalar(key, ms, n):
            h = xxhash.xxh64_intdigest(key.encode())
            return sorted(ms, key=lambda m: placement._mix(h ^ placement._seed(m)), reverse=True)[:n]

        for size in (47, 48, 49, 300):
            for k in range(200):
                for n in (1, 2, 3):
                    assert placement.owners(f"key{k}", members[:size], n) == scalar(f"key{k}", members[:size], n)
else:
    from kvconnect.connectors.buffers import HostBuffer
    from kvconnect.connectors.registry import create_store
    from kvconnect.connectors.testing.conformance import page_bytes

    @pytest.fixture(scope="module")
    def registry():
        s = RedisProcess("127.0.0.1", free_port(), Path(tempfile.mkdtemp(prefix="kvr-"))).start()
        yield f"redis://127.0.0.1:{s.port}"
        s.terminate()

    def _store(url: str):
        return create_store("peer_rdma", {
            "discovery_addr": "127.0.0.1:1", "control_port": 0, "membership_url": url, "protocol": "tcp",
            "global_segment_size": 32 * PAGE, "heartbeat_interval": 0.2, "member_ttl": 1.0, "join_timeout": 3.0})

    def test_three_stores_on_a_registry_share_pages_byte_exact(registry):
        """Pages written on one store are read byte-exact on the other two (the directory
        is placed over the registry's view); a store that leaves is out of every view at
        the next beat, one that dies within member_ttl, and their pages are then misses,
        never other bytes."""
        stores = [_store(registry) for _ in range(3)]
        try:
            views = lambda: [set(s.node.view.members) for s in stores]  # noqa: E731
            assert wait(lambda: all(len(v) == 3 for v in views()), 3.0), views()
            keys = [f"reg-{i}" for i in range(12)]
            src = HostBuffer(len(keys), PAGE, 2)
            for i, k in enumerate(keys):
                src.fill(i, page_bytes(k, 1, PAGE))
            assert stores[0].put_from(keys, [src.page(i) for i in range(len(keys))]) == [True] * len(keys)
            for reader in stores[1:]:
                dst = HostBuffer(len(keys), PAGE, 2)
                assert reader.get_into(keys, [dst.page(i) for i in range(len(keys))]) == [True] * len(keys)
                assert [dst.read(i) for i in range(len(keys))] == [page_bytes(k, 1, PAGE) for k in keys]
                assert reader.node.metrics()["read_remote_hits"] >= len(keys)

            m = stores[1].node.metrics()  # exported as kvconnect_peer_membership_*_total counters
            assert m["membership_calls"] >= 1 and m["membership_snapshots"] >= 1, m
            assert {"membership_calls", "membership_failures", "membership_snapshots"} <= stores[1].metric_counters

            leaving = stores.pop(0)
            gone = leaving.node.node_id
            t0 = time.monotonic()
            leaving.close()
            assert wait(lambda: all(gone not in s.node.view.members for s in stores), 1.0)
            assert time.monotonic() - t0 < 1.0
            dst = HostBuffer(len(keys), PAGE, 2)
            assert stores[0].get_into(keys, [dst.page(i) for i in range(len(keys))]) == [False] * len(keys)

            dead = stores.pop()
            gone = dead.node.node_id
            t0 = time.monotonic()
            dead.node.close(leave=False)
            assert wait(lambda: gone not in stores[0].node.view.members, 3.0)
            assert time.monotonic() - t0 < 1.0 + 0.2 * 3 + 1.0
            assert set(stores[0].node.view.members) == {stores[0].node.node_id}
        finally:
            for s in stores:
                s.close()
