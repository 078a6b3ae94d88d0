"""The HF3FS page index on Redis Cluster: real ``redis-server --cluster-enabled yes`` nodes on
127.0.0.1 (``kvconnect.connectors.testing.redis_cluster.RedisClusterSet``), through
``redis+cluster://``.

* the conformance suite on 3 primaries + 3 replicas with ``WAIT 1``, a password on every node;
* sharding: each namespace's keys in one hash slot, on the shard the cluster says, a
  lookup batch of 128 keys one script call on that one node; namespaces of several ranks and
  deployments (key prefixes) spread over the shards;
* a manual failover (``CLUSTER FAILOVER``): the old primary answers ``MOVED``, the store
  follows it with no failed call and reads byte-exact pages;
* a shard primary killed -9 under writers (``WAIT 1``): 0 confirmed pages lost, no wrong
  bytes, the shard serves lookups and hits again within 10 s (writes once the restarted node
  is its replica again), the other shards' writers never stop;
* the fail-closed rule after a failover: a replica that missed writes taken over
  (``CLUSTER FAILOVER TAKEOVER``) maps keys to slots since given to other keys; those reads
  are misses (the page identity check), never the other keys' bytes;
* a dead cluster: every call a miss / failed write within the bound, never an exception;
  served again once the node is back.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvconnect.connectors.base import BackendUnavailable
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.hf3fs.config import HF3FSConfig
from kvconnect.connectors.hf3fs.index import DEFAULT_READ_LEASE_S
from kvconnect.connectors.hf3fs.store import HF3FSStore
from kvconnect.connectors.testing.conformance import PAGE, PageStoreConformance, check_page
from kvconnect.connectors.testing.hf3fs_failover import bound_s, check_all, wait_until
from kvconnect.connectors.testing.redis_cluster import DURABILITY, RedisClusterSet, redis_skip_reason

SKIP = redis_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

T = PageStoreConformance()
CAPACITY_PAGES = 64
SERVE_AGAIN_S = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """3 primaries + 3 replicas, a password on every node (as docs/hf3fs_ha.md deploys them)."""
    with RedisClusterSet(shards=3, replicas=1, durability=DURABILITY["wait"],
                         workdir=tmp_path_factory.mktemp("cluster"), password="kvc-" + os.urandom(6).hex()) as c:
        yield c


def options(cluster: RedisClusterSet, tmp_path, **kw) -> dict:
    opts = {"file_path_prefix": str(tmp_path / "hicache"), "file_size": 1024 * PAGE, "numjobs": 2, "entries": 4,
            "metadata_server_url": cluster.url, "metadata_key_prefix": f"kvc-{os.urandom(4).hex()}",
            "metadata_wait_replicas": 1, "metadata_wait_timeout": 0.5, "client_timeout": 2.0}
    if cluster.password:
        (tmp_path / "pw").write_text(cluster.password)
        opts["auth_token_file"] = str(tmp_path / "pw")
    return {**opts, **kw}


def make_store(opts: dict, rank: int = 0, size: int = 1) -> HF3FSStore:
    return HF3FSStore(HF3FSConfig(**opts), EngineContext(tp_rank=rank, tp_size=size))


def commandstat(node, name: str = "evalsha") -> int:
    stats = node.command("INFO", "commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


# ----------------------------------------------------------------------------- conformance


class TestHF3FSRedisCluster(PageStoreConformance):
    """The whole conformance suite with the page index on Redis Cluster (WAIT 1)."""

    store_name = "hf3fs"
    capacity_bytes = CAPACITY_PAGES * PAGE

    @pytest.fixture(autouse=True)
    def _cluster(self, cluster, tmp_path):
        self.opts = options(cluster, tmp_path, file_size=self.capacity_bytes)

    def store_options(self):
        return self.opts

    def make_store(self):
        return HF3FSStore(HF3FSConfig(**self.opts), EngineContext())

    # the suite's eviction test runs on the single server (test_hf3fs_redis.py): it evicts under 2 s read leases
    test_eviction_under_capacity_pressure = None


# ----------------------------------------------------------------------------- sharding


def test_a_namespace_is_one_slot_and_a_lookup_one_call_on_its_shard(cluster, tmp_path):
    opts = options(cluster, tmp_path, metadata_key_prefix="kvc-spread")  # fixed: the placement too
    stores = [make_store(opts, r, 8) for r in range(8)]
    other = make_store({**opts, "metadata_key_prefix": opts["metadata_key_prefix"] + "-b",
                        "file_path_prefix": str(tmp_path / "b")})
    try:
        shards = set()
        for s in stores + [other]:
            keys = T.keys(128, s.ns)
            assert T.write(s, keys) == [True] * 128
            meta = s.meta
            names = meta._ns_keys(s.ns)
            slots = {int(cluster.nodes[0].command("CLUSTER", "KEYSLOT", n)) for n in names}
            assert len(slots) == 1, f"namespace {s.ns}: its keys in slots {slots}"
            owner = cluster.primary_of_slot(slots.pop())
            assert owner.command("EXISTS", names[0]) == 1 and owner.command("HLEN", names[1]) == 129
            shards.add(owner.addr)
            s.exists(keys[:1])  # loads the script on that node (NOSCRIPT, SCRIPT LOAD: once per node)
            before = {n.addr: commandstat(n) for n in cluster.primaries()}
            assert s.exists(keys) == [True] * 128
            after = {n.addr: commandstat(n) for n in cluster.primaries()}
            assert {a: after[a] - before[a] for a in after} == {a: int(a == owner.addr) for a in after}
            check_all(s, keys[:32])
        # 9 namespaces (8 ranks of one deployment, rank 0 of another) over 3 shards: not all on one
        assert len(shards) >= 2, shards
        assert stores[0].meta._ns_keys("0:kv") != other.meta._ns_keys("0:kv")  # the prefix is in the tag
    finally:
        for s in stores + [other]:
            s.close()


def test_manual_failover_is_followed_through_moved(cluster, tmp_path):
    s = make_store(options(cluster, tmp_path))
    try:
        keys = T.keys(64, "moved")
        assert T.write(s, keys) == [True] * 64
        slot = cluster.slot_of(s.meta._ns_keys(s.ns)[0])
        old = cluster.primary_of_slot(slot)
        replica = next(n for n in cluster.nodes if n is not old and
                       n.command("INFO", "replication").get("master_port") == old.port)
        refreshes = s.meta._slots.refreshes
        replica.command("CLUSTER", "FAILOVER")
        cluster.wait_failover(old, slot, 15)
        wait_until(lambda: old.command("INFO", "replication").get("role") == "slave", 15, "the old primary demoted")
        failed = s.meta.failed_calls
        check_all(s, keys)  # the old primary answers MOVED: followed within the call
        assert s.meta.failed_calls == failed
        assert s.meta._slots.refreshes > refreshes
        more = T.keys(16, "after")
        assert wait_until(lambda: T.write(s, more) == [True] * 16, 10, "confirmed writes on the new primary") < 10
        check_all(s, keys + more)
        cluster.wait_ready(20)
    finally:
        s.close()


# ----------------------------------------------------------------------------- failures


@pytest.fixture
def own_cluster(tmp_path):
    made = []

    def make(shards: int, replicas: int, mode: str = "wait") -> RedisClusterSet:
        c = RedisClusterSet(shards=shards, replicas=replicas, durability=DURABILITY[mode],
                            workdir=tmp_path / f"c{len(made)}", password="kvc-" + os.urandom(6).hex())
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.close()


def test_shard_primary_killed_under_writers_loses_no_confirmed_page(own_cluster, tmp_path):
    c = own_cluster(3, 1)
    # a fixed key prefix: with the kit's even slot split, ranks 0-3 land on 2 or 3 shards
    # files larger than what the writers confirm: no eviction, so any confirmed page missing is lost
    num_pages = 8192
    opts = options(c, tmp_path, client_timeout=1.0, metadata_key_prefix="kvc-kill9", file_size=num_pages * PAGE)
    bound = bound_s(1.0, 3)
    stores = [make_store(opts, r, 4) for r in range(4)]
    shard = {s.ns: c.primary_of_slot(c.slot_of(s.meta._ns_keys(s.ns)[0])) for s in stores}
    victim_slot = c.slot_of(stores[0].meta._ns_keys(stores[0].ns)[0])
    victim = shard[stores[0].ns]
    on_victim = [s for s in stores if shard[s.ns] is victim]
    assert len(on_victim) < len(stores), "every writer on the victim's shard: pick another key prefix"
    confirmed: dict[int, list[tuple[str, float]]] = {i: [] for i in range(len(stores))}
    errors: list[BaseException] = []
    slow: list[float] = []
    stop = threading.Event()

    def writer(i: int) -> None:
        s, n = stores[i], 0
        while not stop.is_set() and len(confirmed[i]) < num_pages - 64:
            keys = T.keys(8, f"w{i}-{n}")
            n += 1
            t0 = time.monotonic()
            try:
                ok = T.write(s, keys)
            except BaseException as e:  # noqa: BLE001 - an exception into the engine is a failure
                errors.append(e)
                return
            t1 = time.monotonic()
            if t1 - t0 > bound:
                slow.append(t1 - t0)
            confirmed[i] += [(k, t1) for k, o in zip(keys, ok) if o]
            time.sleep(0.01)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        t_kill = time.monotonic()
        victim.kill9()
        failover_s = c.wait_failover(victim, victim_slot, 15)
        victim.start()  # a supervisor restarts it: it rejoins as the new primary's replica

        s0 = stores[0]
        early = [k for k, _ in confirmed[0][:16]]

        def serves() -> bool:
            ok, buf = T.read(s0, early)
            return ok == [True] * len(early) and all(check_page(k, buf.read(j)) >= 0 for j, k in enumerate(early))

        wait_until(serves, SERVE_AGAIN_S + 5, "hits on the failed-over shard")
        reads_again_s = time.monotonic() - t_kill
        wait_until(lambda: any(t > time.monotonic() - 0.5 for _, t in confirmed[0][-1:]), SERVE_AGAIN_S + 5,
                 "confirmed writes on the failed-over shard")
        writes_again_s = time.monotonic() - t_kill
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    print(f"failover {failover_s:.2f} s, hits again {reads_again_s:.2f} s, confirmed writes again "
          f"{writes_again_s:.2f} s after the kill; confirmed {sum(map(len, confirmed.values()))} pages")
    assert not errors, errors
    assert not slow, f"store calls over the {bound:.2f} s bound: {slow}"
    assert reads_again_s < SERVE_AGAIN_S and writes_again_s < SERVE_AGAIN_S
    for i, s in enumerate(stores):
        if s not in on_victim:  # the other shards' writers went on while the victim's shard had no primary
            assert any(t_kill < t < t_kill + failover_s for _, t in confirmed[i]), f"writer {i} stopped"
    try:
        for i, s in enumerate(stores):
            assert 0 < len(confirmed[i]) < num_pages
            check_all(s, [k for k, _ in confirmed[i]])  # 0 confirmed pages lost, every byte as written
    finally:
        for s in stores:
            s.close()


def test_replica_that_missed_writes_taken_over_serves_misses_not_other_keys(own_cluster, tmp_path):
    """Asynchronous replication (no WAIT): the replica is killed, the primary evicts its keys
    and gives their file slots to new keys, then dies; the replica comes back with its old
    copy and takes over. Its index maps the old keys to slots that hold the new keys' pages:
    the store's page identity check turns every such read into a miss."""
    c = own_cluster(1, 1, "async")
    opts = options(c, tmp_path, file_size=8 * PAGE, metadata_wait_replicas=0)
    s = make_store(opts)
    try:
        assert s.verify  # a cluster index may serve stale mappings: the identity check is on
        primary, replica = c.nodes
        old = T.keys(8, "old")
        assert T.write(s, old) == [True] * 8

        def offsets():
            return primary.command("INFO", "replication")["master_repl_offset"], \
                replica.command("INFO", "replication").get("slave_repl_offset")

        wait_until(lambda: offsets()[0] == offsets()[1], 10, "the replica in sync")
        replica.kill9()  # its AOF holds the old keys
        new = T.keys(8, "new")
        assert T.write(s, new) == [True] * 8  # evicts the old keys, overwrites their pages
        check_all(s, new)
        assert T.read(s, old)[0] == [False] * 8
        primary.kill9()
        replica.start()
        replica.command("CLUSTER", "FAILOVER", "TAKEOVER")
        c.wait_failover(primary, 0, 15)
        c.wait_ready(15, nodes=[replica])
        stale = s.stale_reads

        def stale_seen() -> bool:
            ok, _ = T.read(s, old)
            assert ok == [False] * 8, "a read returned the bytes now in an old key's slot"
            return s.stale_reads >= stale + 8

        wait_until(stale_seen, 10, "reads through the taken-over replica")  # the first ones may meet the dead node
        assert T.read(s, old)[0] == [False] * 8  # the stale entries were dropped: plain misses now
        assert T.read(s, new)[0] == [False] * 8  # unknown to the replica
        again = T.keys(4, "again")
        # the new primary takes writes once the stale reads' read leases on the file's 8 slots end
        wait_until(lambda: T.write(s, again) == [True] * 4, DEFAULT_READ_LEASE_S + 5, "writes on the new primary")
        check_all(s, again)
    finally:
        s.close()


def test_dead_cluster_is_a_miss_within_the_bound_and_serves_again(own_cluster, tmp_path):
    c = own_cluster(1, 0, "async")
    opts = options(c, tmp_path, client_timeout=1.0, metadata_wait_replicas=0)
    bound = bound_s(1.0, 3)
    s = make_store(opts)
    try:
        keys = T.keys(16, "dead")
        assert T.write(s, keys) == [True] * 16
        c.nodes[0].kill9()
        for call in (lambda: s.exists(keys), lambda: T.read(s, keys)[0], lambda: T.write(s, T.keys(4, "x"))):
            t0 = time.monotonic()
            got = call()  # raises nothing: a miss, a failed write
            assert time.monotonic() - t0 < bound, time.monotonic() - t0
            assert not any(got), got
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable, match="metadata_server_url"):
            make_store({**opts, "file_path_prefix": str(tmp_path / "other")})
        assert time.monotonic() - t0 < bound + 1.0
        c.nodes[0].start()
        wait_until(lambda: T.read(s, keys)[0] == [True] * 16, 10, "served again")  # AOF: the page index survived
        check_all(s, keys)
    finally:
        s.close()


# ----------------------------------------------------------------------------- the benchmark


def test_bench_hf3fs_cluster_quick(tmp_path):
    """``kvconnect bench hf3fs_cluster`` end to end, short: every lookup found all its keys
    and was one script call on one shard (the servers' call counts add up to the clients')."""
    import json

    from kvconnect.benchmarks import hf3fs_cluster

    out = tmp_path / "hf3fs_cluster.json"
    assert hf3fs_cluster.main(["--quick", "--clients", "2", "--seconds", "0.5", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sum(doc["figures"]["placement_3_shards"].values()) == len(hf3fs_cluster.namespaces()) == 48
    for shards in ("1", "3"):
        (p,) = doc["figures"]["passes"][shards]
        assert p["shards"] == int(shards) and p["calls"] > 0 and p["hit_ratio"] == 1.0
        assert sum(p["calls_by_shard"].values()) == p["calls"]  # one call per lookup, on one shard
        assert all(p["calls_by_shard"].values())  # every shard served some namespaces
    assert {r["metric"] for r in doc["ratios"]} == {"lookup_throughput/3_vs_1_shards", "capacity/3_vs_1_shards",
                                                  "capacity_saturated/3_vs_1_shards", "shard_alone_vs_1_shard_cluster"}
    for addr, (p,) in doc["figures"]["alone_passes"].items():  # a shard driven alone: only it served calls
        assert p["hit_ratio"] == 1.0 and p["calls_by_shard"][addr] == p["calls"] > 0
