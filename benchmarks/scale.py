"""Pool membership, directory and page index at 10, 100 and 1,000 engines: the real code in one process.

Every simulated engine runs the product's own objects: a ``RegistryMembership`` (its beats
are real Lua scripts on a real ``redis-server``), a ``DirectoryShard`` (peer_rdma's share of
"which node holds which page", placed by ``placement.owners`` over the engine's view), and
the HF3FS page index client ``RedisMetadata`` on a real Redis Cluster (``--shards``
primaries; the engines use eight key spaces, each on the shard its hash tag names). What
is simulated: the engines are objects in one process (a ticker calls their beats every
``heartbeat_interval``, with random phases), directory calls between engines are function
calls (their messages and msgpack bytes are counted as a peer's gRPC call would carry), and
a partition is a loopback relay (``connectors/testing/relay.py``) that stops passing bytes
between a tenth of the engines and the registry.

Requests arrive by the Mooncake conversation trace's timestamps (compressed so that every
engine sees ``--rate`` requests/s whatever the pool size); each request looks up its
``hash_ids`` (one page per id) in the directory and in the index, and publishes / stores
the pages it missed. Scenario per size: all engines join (spaced as the trace's arrivals),
a steady window, 1 % of the pool joins, as many leave (``Leave``), as many crash (no
``Leave``: expiry), a tenth is cut off the registry and healed, a second steady window.

Measured: seconds until every engine's view is the live set after each event; membership
messages and bytes per engine per second (steady windows: the flat-cost target); directory
messages per engine per second; directory entries per engine; index script calls per shard
per second and the servers' CPU per call (their own ``INFO commandstats``); lookup latency
percentiles (directory: placement + shard, in process; index: one round trip to Redis),
taken on a host whose cores the thousand engines' threads share. The heartbeat mesh
(``membership.py``, the no-master mode) is measured beside it over an in-process transport
at the sizes it can be run at here.

``kvconnect bench scale`` writes ``benchmarks/results/scale.json`` and ``scale.png``;
``--quick``: 10 and 100 engines with a 0.25 s interval (seconds; what CI runs).
"""

from __future__ import annotations

import argparse
import heapq
import logging
import os
import random
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack

from kvconnect.benchmarks.harness import BenchResult

DIRECTORY_REPLICAS = 1
KEY_SPACES = 8  # models / rank groups sharing the pool: the index shards by key space


def _packed_len(obj: Any) -> int:
    return len(msgpack.packb(obj, use_bin_type=True))


def percentiles(samples: list[float], qs=(50, 90, 99)) -> dict[str, float]:
    data = sorted(samples)
    if not data:
        return {f"p{q}": 0.0 for q in qs}
    return {f"p{q}": data[min(len(data) - 1, int(q / 100 * len(data)))] for q in qs}


# -- the heartbeat mesh over an in-process transport ---------------------------------------
class LoopbackClients:
    """``rpc.Clients`` for ``Membership`` over function calls into the other members,
    counting this member's calls and their msgpack bytes."""

    def __init__(self, net: dict, timeout: float):
        self.net = net  # node id -> Membership
        self.timeout = timeout
        self.messages = 0
        self.bytes = 0

    def fan_out(self, requests: dict, method: str, timeout: float | None = None) -> dict:
        from kvconnect.connectors.peer_rdma.rpc import RpcError

        out = {}
        for target, req in requests.items():
            self.messages += 1
            self.bytes += _packed_len(req)
            peer = self.net.get(target)
            if peer is None:
                out[target] = RpcError(method, target, "UNAVAILABLE")
                continue
            rep = peer.handle_heartbeat(req) if method == "Heartbeat" else peer.handle_leave(req)
            self.bytes += _packed_len(rep)
            out[target] = rep
        return out


def run_mesh(n: int, interval: float, rounds: int = 3) -> dict:
    """Steady-state cost of today's full mesh: ``rounds`` heartbeat rounds of every member
    after the pool converged (rounds are driven one after another, not in real time, so
    the TTL is set long enough that no member expires meanwhile)."""
    from kvconnect.connectors.peer_rdma.membership import Member, Membership

    net: dict[str, Membership] = {}
    clients = {}
    ids = [f"sim{i}:31998" for i in range(n)]
    for i, node_id in enumerate(ids):
        clients[node_id] = LoopbackClients(net, 0.5)
        net[node_id] = Membership(Member(node_id, i + 1, node_id, 0, 1 << 30), [ids[0]], clients[node_id],
                                  interval=interval, ttl=3600.0)
    t0 = time.monotonic()
    for _ in range(64):
        for m in net.values():
            m._round()
        if all(len(m.view.members) == n for m in net.values()):
            break
    converge_rounds = _ + 1
    for c in clients.values():
        c.messages = c.bytes = 0
    for _ in range(rounds):
        for m in net.values():
            m._round()
    msgs = sum(c.messages for c in clients.values()) / n / rounds / interval
    nbytes = sum(c.bytes for c in clients.values()) / n / rounds / interval
    return {"engines": n, "bootstrap_rounds": converge_rounds, "messages_per_engine_s": msgs,
            "bytes_per_engine_s": nbytes, "wall_s": time.monotonic() - t0}


# -- the registry ----------------------------------------------------------------------------
class _ShardHost:
    """What a ``DirectoryShard`` asks of its node: the id and the current view."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.node_id = engine.id

    @property
    def view(self):
        return self.engine.membership.view


class Engine:
    """One simulated engine: its membership, its directory shard, its traffic."""

    def __init__(self, i: int, client, *, pool: str, interval: float, ttl: float, cut_group: bool):
        from kvconnect.connectors.peer_rdma.directory import DirectoryShard
        from kvconnect.connectors.peer_rdma.membership import Member
        from kvconnect.connectors.peer_rdma.registry_membership import RegistryMembership

        self.id = f"sim{i}:31998"  # never dialled: a registry pool sends nothing to peers here
        self.member = Member(self.id, time.time_ns(), self.id, 0, 1 << 30)
        self.membership = RegistryMembership(self.member, client, pool=pool, interval=interval, ttl=ttl)
        self.shard = DirectoryShard(_ShardHost(self))
        self.cut_group = cut_group
        self.beating = False
        self.busy = False
        self.dir_messages = 0
        self.dir_bytes = 0
        self.ns = ""  # its key space in the page index


class Ticker:
    """Calls each beating engine's ``beat()`` every ``interval`` (random phase), on two
    thread pools: engines behind the relay on their own, so that their stalled calls never
    delay the others' beats."""

    def __init__(self, interval: float):
        self.interval = interval
        self._heap: list[tuple[float, int, Engine]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pools = {False: ThreadPoolExecutor(8, "beat"), True: ThreadPoolExecutor(32, "beat-cut")}
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="ticker", daemon=True)
        self._thread.start()

    def add(self, e: Engine, first_in: float) -> None:
        e.beating = True
        with self._lock:
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + first_in, self._seq, e))

    def _beat(self, e: Engine) -> None:
        try:
            if e.beating:
                e.membership.beat()
        finally:
            e.busy = False

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            due = []
            with self._lock:
                while self._heap and self._heap[0][0] <= now:
                    t, _, e = heapq.heappop(self._heap)
                    if e.beating:
                        due.append(e)
                        self._seq += 1
                        heapq.heappush(self._heap, (max(t + self.interval, now), self._seq, e))
            for e in due:
                if not e.busy:  # a beat still in flight (a stalled call) is not doubled
                    e.busy = True
                    self._pools[e.cut_group].submit(self._beat, e)
            self._stop.wait(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for p in self._pools.values():
            p.shutdown(wait=True, cancel_futures=True)


class Workload:
    """Trace-driven lookups: each request on one live engine, its pages looked up in the
    directory and the index, the misses published and stored."""

    def __init__(self, sim: "Simulation", rate_per_engine: float, rows: list[dict]):
        self.sim = sim
        self.rate = rate_per_engine
        self.rows = rows
        self.dir_lat: list[float] = []
        self.index_lat: list[float] = []
        self.requests = 0
        self.pages = 0
        self.dir_hits = 0
        self.index_hits = 0
        self.errors = 0
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(4, "lookup")
        self._thread = threading.Thread(target=self._dispatch, name="trace", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _dispatch(self) -> None:
        rows = self.rows
        span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0 or 1.0
        trace_rate = len(rows) / span
        t0, start = time.monotonic(), rows[0]["timestamp"]
        i = 0
        while not self._stop.is_set():
            live = self.sim.reachable()
            if not live:
                self._stop.wait(0.05)
                continue
            row = rows[i % len(rows)]
            loops = i // len(rows)
            # compress (or stretch) the trace so that every engine sees self.rate requests/s
            scale = trace_rate / (self.rate * len(self.sim.engines_alive()))
            at = t0 + ((row["timestamp"] - start) / 1000.0 + loops * span) * scale
            delay = at - time.monotonic()
            if delay > 0 and self._stop.wait(min(delay, 0.2)):
                break
            if delay > 0.2:
                continue
            engine = live[i % len(live)]
            self._pool.submit(self._request, engine, row["hash_ids"])
            i += 1

    def _request(self, e: Engine, hash_ids: list[int]) -> None:
        from kvconnect.connectors.peer_rdma.placement import owners

        try:
            keys = [f"p{h}" for h in hash_ids]
            view = e.membership.view
            t0 = time.perf_counter()
            by_owner: dict[str, list[str]] = defaultdict(list)
            owner_lists = {}
            for k in keys:
                ol = owner_lists[k] = owners(k, view.ids, 1 + DIRECTORY_REPLICAS)
                by_owner[ol[0]].append(k)
            found: dict[str, Any] = {}
            for owner, ks in by_owner.items():
                target = self.sim.by_id.get(owner)
                e.dir_messages += 1
                e.dir_bytes += _packed_len(ks)
                if target is None or not self.sim.can_talk(e, target):
                    continue  # an unreachable owner: a miss
                rep = target.shard.get(ks)
                e.dir_bytes += _packed_len(rep)
                found.update(zip(ks, rep))
            self.dir_lat.append(time.perf_counter() - t0)
            missing = [k for k in keys if found.get(k) is None]
            self.dir_hits += len(keys) - len(missing)
            puts: dict[str, list] = defaultdict(list)
            for k in missing:
                entry = [e.id, e.member.incarnation, 0, 4096, 1, 0, True]
                for t in owner_lists[k]:
                    puts[t].append([k, entry])
            for t, items in puts.items():
                target = self.sim.by_id.get(t)
                e.dir_messages += 1
                e.dir_bytes += _packed_len(items)
                if target is not None and self.sim.can_talk(e, target):
                    target.shard.put([items, True])
            bkeys = [k.encode() for k in keys]
            t1 = time.perf_counter()
            slots, _, _ = self.sim.index.get(e.ns, bkeys)
            self.index_lat.append(time.perf_counter() - t1)
            new = [k for k, s in zip(bkeys, slots) if s < 0]
            self.index_hits += len(bkeys) - len(new)
            if new:
                status, slots, gens = self.sim.index.reserve(e.ns, new)
                todo = [(k, s, g) for k, st, s, g in zip(new, status, slots, gens) if st == 0 and s >= 0]
                if todo:
                    ks, ss, gs = map(list, zip(*todo))
                    self.sim.index.commit(e.ns, ks, ss, gs, [0] * len(ks), b"\x01" * len(ks))
            self.requests += 1
            self.pages += len(keys)
        except Exception:  # noqa: BLE001 - a failed lookup is counted, the run goes on
            self.errors += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pool.shutdown(wait=True, cancel_futures=True)


class Simulation:
    """``n`` engines on one registry (a tenth of them through a relay) and a page index on a
    Redis Cluster, the engines spread over ``KEY_SPACES`` key spaces (models, rank groups),
    each of which the index keeps on one shard."""

    def __init__(self, n: int, *, redis_port: int, index_url: str, relay_port: int, interval: float, ttl: float,
                 rate: float, rows: list[dict], seed: int = 7):
        from kvconnect.connectors.hf3fs.redis_index import RedisMetadata
        from kvconnect.connectors.peer_rdma.registry_membership import registry_client

        self.n = n
        self.interval, self.ttl = interval, ttl
        self.rng = random.Random(seed)
        timeout = min(0.5, interval)  # rpc_timeout's default, or less for quick intervals
        # the product's client; the engines share a few connections (a thousand would be a
        # thousand sockets); behind the relay a call stalls for its timeout, so waiting for a
        # connection there fails fast
        self._clients = {
            False: registry_client(f"redis://127.0.0.1:{redis_port}", None, timeout, connections=16, pool_wait=1.0),
            True: registry_client(f"redis://127.0.0.1:{relay_port}", None, timeout, connections=32, pool_wait=0.02),
        }
        self.pool = f"scale{n}x{seed}"
        self.engines: list[Engine] = []
        self.by_id: dict[str, Engine] = {}
        self.partitioned = False
        self._next = 0
        self.ticker = Ticker(interval)
        self.index = RedisMetadata(index_url, timeout=2.0, key_prefix=f"kvc:scale{n}")
        self.namespaces = [f"scale/model{j}/kv" for j in range(KEY_SPACES)]
        for ns in self.namespaces:
            self.index.initialize(ns, 1 << 18, 4096)
        self.workload = Workload(self, rate, rows)

    # -- who is where -----------------------------------------------------------------
    def engines_alive(self) -> list[Engine]:
        return [e for e in self.engines if e.beating]

    def reachable(self) -> list[Engine]:
        """Engines that take requests: beating, and in touch with the registry."""
        return [e for e in self.engines if e.beating and not (self.partitioned and e.cut_group)]

    def can_talk(self, a: Engine, b: Engine) -> bool:
        return b.beating and not (self.partitioned and (a.cut_group != b.cut_group))

    def expected(self) -> tuple[set[str], dict[Engine, set[str]]]:
        connected = {e.id for e in self.reachable()}
        alone = {e: {e.id} for e in self.engines_alive() if self.partitioned and e.cut_group}
        return connected, alone

    # -- events -----------------------------------------------------------------------
    def add(self, k: int, spread: float, gaps: list[float], cut_fraction: float = 0.0) -> list[Engine]:
        """``k`` engines join, spaced like the trace's arrivals over ``spread`` seconds."""
        new = []
        for j in range(k):
            i = self._next
            self._next += 1
            cut = cut_fraction > 0 and (i % round(1 / cut_fraction) == 0)
            e = Engine(i, self._clients[cut], pool=self.pool, interval=self.interval, ttl=self.ttl, cut_group=cut)
            e.ns = self.namespaces[i % len(self.namespaces)]
            self.engines.append(e)
            self.by_id[e.id] = e
            new.append(e)
        total = sum(gaps[:k]) or 1.0
        at = 0.0
        t0 = time.monotonic()
        for j, e in enumerate(new):
            at += gaps[j % len(gaps)] / total * spread
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.ticker.add(e, 0.0)
        return new

    def leave(self, engines: list[Engine]) -> None:
        for e in engines:
            e.beating = False
            e.membership.stop(leave=True)

    def crash(self, engines: list[Engine]) -> None:
        for e in engines:
            e.beating = False

    def converge(self, t0: float, limit: float) -> float | None:
        """Seconds from ``t0`` until every live engine's view is what it should be."""
        connected, alone = self.expected()
        pending = self.engines_alive()
        wrong: dict[Engine, int] = {}  # engine -> version of the view last found wrong
        deadline = t0 + limit
        while pending:
            still = []
            for e in pending:
                view = e.membership.view
                if wrong.get(e) == view.version:
                    still.append(e)
                    continue
                want = alone.get(e, connected)
                if len(view.members) != len(want) or view.members.keys() != want:
                    wrong[e] = view.version
                    still.append(e)
            pending = still
            if not pending:
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        return time.monotonic() - t0

    def health(self) -> str:
        t = [e.membership.traffic for e in self.engines]
        return f"(so far: {sum(x.snapshots for x in t)} snapshots, {sum(x.failures for x in t)} failed beats)"

    def traffic(self) -> tuple[int, int]:
        msgs = sum(e.membership.traffic.messages for e in self.engines)
        nbytes = sum(e.membership.traffic.bytes_out + e.membership.traffic.bytes_in for e in self.engines)
        return msgs, nbytes

    def close(self) -> None:
        self.workload.stop()
        self.ticker.close()
        self.index.close()
        for c in self._clients.values():
            c.close()


def _script_stats(servers) -> tuple[int, int]:
    """(script calls, server microseconds spent in them) so far, summed over ``servers``."""
    calls = usec = 0
    for r in servers:
        stats = r.info("commandstats")
        for name in ("cmdstat_evalsha", "cmdstat_eval"):
            calls += int(stats.get(name, {}).get("calls", 0))
            usec += int(stats.get(name, {}).get("usec", 0))
    return calls, usec


def _per_shard_calls(shards) -> list[int]:
    return [_script_stats([r])[0] for r in shards]


def run_registry(n: int, *, redis_port: int, index_url: str, index_nodes: list[tuple[str, int]], relay, interval: float, ttl: float, rate: float,
                 rows: list[dict],
                 gaps: list[float], window: float, log=print) -> dict:
    """One size through the whole scenario; returns its figures."""
    import redis

    shards = [redis.Redis(host=h, port=p) for h, p in index_nodes]  # the index's primaries
    registry_admin = redis.Redis(host="127.0.0.1", port=redis_port)
    sim = Simulation(n, redis_port=redis_port, index_url=index_url, relay_port=relay.port, interval=interval,
                     ttl=ttl, rate=rate,
                     rows=rows)
    for r in (*shards, registry_admin):  # after the index's one-time initialize
        r.config_resetstat()
    out: dict[str, Any] = {"engines": n}
    limit = 6 * ttl
    try:
        t0 = time.monotonic()
        sim.add(n, spread=max(2 * interval, n / 200), gaps=gaps, cut_fraction=0.1)
        out["bootstrap_s"] = sim.converge(t0, limit + n * 0.01)
        log(f"  [{n}] {n} engines joined; views converged in {out['bootstrap_s']}")
        sim.workload.start()
        run_calls, run_t0 = _per_shard_calls(shards), time.monotonic()
        time.sleep(interval)

        def steady(tag: str) -> None:
            m0, b0 = sim.traffic()
            c0, t = _per_shard_calls(shards), time.monotonic()
            s0 = {"index": _script_stats(shards), "registry": _script_stats([registry_admin])}
            d0 = sum(e.dir_messages for e in sim.engines)
            time.sleep(window)
            m1, b1 = sim.traffic()
            dt = time.monotonic() - t
            # the servers' own CPU per script call in steady state (beats only on the registry)
            for what, rs in (("index", shards), ("registry", [registry_admin])):
                calls, usec = _script_stats(rs)
                dc = calls - s0[what][0]
                out[f"{tag}_{what}_server_us_per_call"] = (usec - s0[what][1]) / dc if dc else 0.0
            live = len(sim.engines_alive())
            out[f"{tag}_messages_per_engine_s"] = (m1 - m0) / live / dt
            out[f"{tag}_bytes_per_engine_s"] = (b1 - b0) / live / dt
            out[f"{tag}_directory_messages_per_engine_s"] = (sum(e.dir_messages for e in sim.engines) - d0) / live / dt
            out[f"{tag}_index_calls_per_shard_s"] = [(c - b) / dt for c, b in zip(_per_shard_calls(shards), c0)]
            log(f"  [{n}] {tag}: {out[f'{tag}_messages_per_engine_s']:.2f} msg/engine/s, "
                f"{out[f'{tag}_bytes_per_engine_s']:.0f} B/engine/s, "
                f"index calls/s per shard {[round(x) for x in out[f'{tag}_index_calls_per_shard_s']]}")

        steady("steady")
        k = max(1, n // 100)
        m_ev0, b_ev0 = sim.traffic()
        t_ev0 = time.monotonic()
        t0 = time.monotonic()
        sim.add(k, spread=interval, gaps=gaps[n:] or gaps)
        out["join_converge_s"] = sim.converge(time.monotonic(), limit)
        out["join_engines"] = k
        log(f"  [{n}] {k} joined: converged in {out['join_converge_s']}")
        time.sleep(interval)
        victims = sim.rng.sample([e for e in sim.engines_alive() if not e.cut_group], k)
        sim.leave(victims)
        out["leave_converge_s"] = sim.converge(time.monotonic(), limit)
        log(f"  [{n}] {k} left: converged in {out['leave_converge_s']}")
        time.sleep(interval)
        victims = sim.rng.sample([e for e in sim.engines_alive() if not e.cut_group], k)
        t0 = time.monotonic()
        sim.crash(victims)
        out["crash_converge_s"] = sim.converge(t0, limit)
        log(f"  [{n}] {k} crashed: converged in {out['crash_converge_s']} (expiry: member_ttl)")
        time.sleep(interval)
        t0 = time.monotonic()
        relay.cut()
        sim.partitioned = True
        out["partition_engines"] = sum(1 for e in sim.engines_alive() if e.cut_group)
        out["partition_converge_s"] = sim.converge(t0, limit)
        log(f"  [{n}] {out['partition_engines']} cut off: both sides converged in {out['partition_converge_s']} "
            f"{sim.health()}")
        time.sleep(interval)
        t0 = time.monotonic()
        relay.heal()
        sim.partitioned = False
        out["heal_converge_s"] = sim.converge(t0, limit)
        log(f"  [{n}] partition healed: converged in {out['heal_converge_s']} {sim.health()}")
        m_ev1, b_ev1 = sim.traffic()
        ev_dt = time.monotonic() - t_ev0
        live = len(sim.engines_alive())
        out["events_messages_per_engine_s"] = (m_ev1 - m_ev0) / live / ev_dt
        out["events_bytes_per_engine_s"] = (b_ev1 - b_ev0) / live / ev_dt
        time.sleep(interval)
        steady("steady_after")
        w = sim.workload
        # the trace comes in bursts (arrivals on a 3 s grid): a steady window can miss one
        dt = time.monotonic() - run_t0
        out["index_calls_per_shard_s"] = [(c - b) / dt for c, b in zip(_per_shard_calls(shards), run_calls)]
        ids = sim.engines_alive()[0].membership.view.ids
        calls, usec = _script_stats(shards)  # since the reset: the whole run, leases ahead included
        out["index_calls_per_request"] = calls / w.requests if w.requests else 0.0
        out["index_server_us_per_call"] = usec / calls if calls else 0.0
        sizes = [len(e.shard) for e in sim.engines_alive()]
        out.update(
            requests=w.requests, pages=w.pages, lookup_errors=w.errors,
            directory_hit_ratio=w.dir_hits / w.pages if w.pages else 0.0,
            index_hit_ratio=w.index_hits / w.pages if w.pages else 0.0,
            directory_lookup_s=percentiles(w.dir_lat), index_lookup_s=percentiles(w.index_lat),
            directory_entries_per_engine={"mean": statistics.fmean(sizes) if sizes else 0,
                                          "max": max(sizes, default=0)},
            requests_per_engine_s=rate)
    finally:
        if relay.is_cut:
            relay.heal()
        sim.close()
        for r in (*shards, registry_admin):
            r.close()
    # what re-homing pays per held page at a view change (two placements: old and new view),
    # measured with the engines stopped (their threads would share the core)
    from kvconnect.connectors.peer_rdma.placement import owners

    t = time.perf_counter()
    for k in range(2000):
        owners(f"p{k}", ids, 1 + DIRECTORY_REPLICAS)
    out["placement_us_per_key"] = (time.perf_counter() - t) / 2000 * 1e6
    return out


def trace_rows(limit: int) -> list[dict]:
    from kvconnect.benchmarks.serving.workloads import read_trace

    rows = []
    for row in read_trace():
        rows.append({"timestamp": row["timestamp"], "hash_ids": row["hash_ids"]})
        if len(rows) >= limit:
            break
    return rows


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reg = figures["registry"]
    mesh = figures["mesh"]
    ttl = figures["member_ttl"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = [r["engines"] for r in reg]
    a.plot(ns, [r["steady_messages_per_engine_s"] for r in reg], "o-", label="registry: messages/engine/s")
    a.plot([m["engines"] for m in mesh], [m["messages_per_engine_s"] for m in mesh], "s--",
           label="heartbeat mesh: messages/engine/s")
    a.plot(ns, [r["steady_bytes_per_engine_s"] / 1000 for r in reg], "o-", label="registry: kB/engine/s")
    a.plot([m["engines"] for m in mesh], [m["bytes_per_engine_s"] / 1000 for m in mesh], "s--",
           label="heartbeat mesh: kB/engine/s")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("engines")
    a.set_title("membership cost per engine (steady state)")
    a.legend(fontsize=8)
    for key, label in (("join_converge_s", "join (1 %)"), ("leave_converge_s", "leave (1 %)"),
                       ("crash_converge_s", "crash (1 %)"), ("heal_converge_s", "healed partition (10 %)")):
        b.plot(ns, [r[key] if r[key] is not None else float("nan") for r in reg], "o-", label=label)
    b.axhline(ttl, color="grey", linestyle=":", label=f"member_ttl = {ttl:g} s")
    b.set_xscale("log")
    b.set_xlabel("engines")
    b.set_ylabel("seconds until every view is the live set")
    b.set_title("convergence (registry membership)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 and 100 engines, 0.25 s interval (seconds)")
    p.add_argument("--engines", default="", help="comma-separated pool sizes (default 10,100,1000)")
    p.add_argument("--mesh-engines", default="", help="pool sizes for the heartbeat mesh (default 10,30,100)")
    p.add_argument("--interval", type=float, default=0.0, help="heartbeat_interval (default 1.0; --quick 0.25)")
    p.add_argument("--ttl", type=float, default=0.0, help="member_ttl (default 4 x interval)")
    p.add_argument("--rate", type=float, default=0.1, help="requests per engine per second (trace-driven)")
    p.add_argument("--window", type=float, default=0.0, help="steady window seconds (default 5; --quick 1.5)")
    p.add_argument("--shards", type=int, default=3, help="primaries of the index's Redis Cluster")
    p.add_argument("--out", default="", help="result JSON (default benchmarks/results/scale.json)")
    p.add_argument("--plot", default="", help="plot PNG (default next to the JSON, scale.png)")
    args = p.parse_args(argv)
    # a view change per engine per event is a log line each: thousands here
    for name in ("kvconnect.connectors.peer_rdma.membership", "kvconnect.connectors.peer_rdma.registry_membership"):
        logging.getLogger(name).setLevel(logging.WARNING)

    from kvconnect.connectors.testing.redis_cluster import RedisClusterSet, RedisProcess, free_port, redis_skip_reason
    from kvconnect.connectors.testing.relay import Relay

    why = redis_skip_reason()
    if why:
        print(f"kvconnect bench scale: {why}")
        return 2
    interval = args.interval or (0.25 if args.quick else 1.0)
    ttl = args.ttl or 4 * interval
    window = args.window or (1.5 if args.quick else 5.0)
    sizes = [int(x) for x in (args.engines or ("10,100" if args.quick else "10,100,1000")).split(",")]
    mesh_sizes = [int(x) for x in (args.mesh_engines or ("10,30" if args.quick else "10,30,100")).split(",")]
    rows = trace_rows(4000)
    gaps = [max(1e-3, (b["timestamp"] - a["timestamp"]) / 1000.0) for a, b in zip(rows, rows[1:])]

    load_at_start = os.getloadavg()
    res = BenchResult("scale", params={"loadavg_at_start": load_at_start, "engines": sizes, "mesh_engines": mesh_sizes,
                                       "heartbeat_interval": interval,
                                       "member_ttl": ttl, "requests_per_engine_s": args.rate,
                                       "steady_window_s": window, "directory_replicas": DIRECTORY_REPLICAS,
                                       "trace": "Mooncake conversation trace, first 4,000 rows",
                                       "registry": "RegistryMembership on one redis-server",
                                       "index": f"RedisMetadata on a Redis Cluster of {args.shards} primaries "
                                                f"(no replicas), {KEY_SPACES} key spaces",
                                       "quick": args.quick})
    figures: dict[str, Any] = {"member_ttl": ttl, "heartbeat_interval": interval, "registry": [], "mesh": []}
    with tempfile.TemporaryDirectory(prefix="kvc-scale-") as tmp:
        conf = {"maxclients": "10000", "save": "", "appendonly": "no"}
        server = RedisProcess("127.0.0.1", free_port(), Path(tmp) / "registry", extra=conf).start()
        index = RedisClusterSet(shards=args.shards, replicas=0, workdir=Path(tmp) / "index").start()
        relay = Relay(("127.0.0.1", server.port))
        try:
            for n in sizes:
                print(f"registry membership, {n} engines:", flush=True)
                figures["registry"].append(run_registry(n, redis_port=server.port, index_url=index.url,
                                                        index_nodes=[(x.host, x.port) for x in index.nodes[:args.shards]],
                                                        relay=relay,
                                                        interval=interval,
                                                        ttl=ttl, rate=args.rate, rows=rows, gaps=gaps,
                                                        window=window))
        finally:
            relay.close()
            server.terminate()
            index.close()
    for n in mesh_sizes:
        print(f"heartbeat mesh, {n} engines (in-process transport):", flush=True)
        figures["mesh"].append(run_mesh(n, interval))
        m = figures["mesh"][-1]
        print(f"  [{n}] {m['messages_per_engine_s']:.1f} msg/engine/s, {m['bytes_per_engine_s']:.0f} B/engine/s")
    res.figures = figures
    reg, mesh = figures["registry"], figures["mesh"]
    lo, hi = reg[0], reg[-1]
    res.ratio(f"registry_messages_per_engine_s_{hi['engines']}_vs_{lo['engines']}_lower_is_better",
              hi["steady_messages_per_engine_s"], lo["steady_messages_per_engine_s"],
              f"the same registry at {lo['engines']} engines", higher_is_better=False)
    res.ratio(f"registry_bytes_per_engine_s_{hi['engines']}_vs_{lo['engines']}_lower_is_better",
              hi["steady_bytes_per_engine_s"], lo["steady_bytes_per_engine_s"],
              f"the same registry at {lo['engines']} engines", higher_is_better=False)
    big = max(mesh, key=lambda m: m["engines"])
    same = next((r for r in reg if r["engines"] == big["engines"]), None)
    if same:
        res.ratio(f"messages_per_engine_s_at_{big['engines']}_lower_is_better", same["steady_messages_per_engine_s"],
                  big["messages_per_engine_s"], "heartbeat mesh (membership.py)", higher_is_better=False)
        res.ratio(f"bytes_per_engine_s_at_{big['engines']}_lower_is_better", same["steady_bytes_per_engine_s"],
                  big["bytes_per_engine_s"], "heartbeat mesh (membership.py)", higher_is_better=False)
    res.notes.append("mesh rounds are driven back to back in one process (not in real time): its per-second "
                     "figures are per round / heartbeat_interval; a 1,000-node mesh (1M calls a round) is not run")
    res.notes.append("directory calls are in-process function calls, counted as the gRPC calls they stand for; "
                     "directory lookup latency is placement + shard work, not a network round trip")
    out = res.finish(args.out or None)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(figures, png)
    print(f"plot written to {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
