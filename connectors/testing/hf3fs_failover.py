"""Failover under load: several HF3FS stores writing and reading through a Redis page index
while its primary is killed, stalled, cut off, or replaced by a replica that lagged.

Used by tests/integration/test_hf3fs_redis_failover.py and ``kvconnect bench hf3fs_ha``.

``run_scenario(scenario, mode)`` starts a ``RedisHA`` set (loopback; network namespaces for
``partition`` and ``lagging``), then ``workers`` processes (``python -m kvconnect.connectors.testing.hf3fs_failover
worker``), each one ``HF3FSStore`` on one shared data file and the ``redis+sentinel://`` URL,
with a writer thread (batches of new keys, each page's bytes derived from its key) and a
reader thread (batches of confirmed keys; every hit's bytes compared with what was written).
Then the event:

* ``kill9``: SIGKILL of the primary;
* ``sigstop``: SIGSTOP of the primary for ``stall_s`` (longer than Sentinel's
  down-after), then SIGCONT: the old primary comes back and is demoted;
* ``partition``: the primary's node is cut off the network (packets vanish), healed at
  the end;
* ``lagging``: the replica is stopped while writes go on (``lag_s``), the primary is
  killed, the replica resumes and is promoted (network namespaces with small TCP buffers
  between the two, so that the stream the replica missed dies with the primary). The data file is small here, so the old
  primary evicted keys and gave their slots to new keys that the replica never heard of:
  the promoted replica maps old keys to slots holding other keys' pages. Writers pause at
  the kill (no eviction while losses are counted).
* ``double``: a double fault. The primary is killed; once Sentinel promoted the replica, the
  lost node is started again (as a primary: Sentinel re-attaches it as a replica of the new
  one); once it follows the new primary and ``gap_s`` more writes went on, the new primary
  is killed too and Sentinel promotes the re-attached node, the only data node left. With
  ``wait`` and one replica no page is confirmed while the promoted node is alone (those
  writes fail at once), and the re-attached node acknowledges every later confirm: nothing
  confirmed may be lost. Figures count from the second kill.

Figures (per scenario and durability mode): ``confirmed`` pages (``put_from`` said True),
``confirmed_lost`` (confirmed, then absent or not readable after the failover; ``lagging``:
among the ``num_pages // 4`` newest confirmed before the kill, which LRU eviction cannot
have removed), ``wrong_bytes`` (hits whose bytes differ, in the workers and in a final read
of every confirmed key: must be 0), ``seconds_to_first_hit`` (from the event to the first
correct hit of a get started after it, the slowest worker's), ``calls_over_bound`` (store
calls that took longer than ``bound_s``), ``stale_reads`` (pages the identity check turned
into misses), ``failover_s`` (until Sentinel named a new primary).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvconnect.connectors.testing.processes import wait_until  # noqa: F401 - the kit's tests import it here
from kvconnect.connectors.testing.redis_cluster import DURABILITY, RedisHA

SCENARIOS = ("kill9", "sigstop", "partition", "lagging", "double")
ROOT = Path(__file__).resolve().parent.parent.parent


def expected(key: str, nbytes: int) -> bytes:
    d = hashlib.blake2b(key.encode(), digest_size=32).digest()
    return (d * (nbytes // 32 + 1))[:nbytes]


def check_all(store, keys: list[str], batch: int = 16) -> None:
    """Every key a hit holding its own conformance page (``conformance.page_bytes``), read in
    batches; AssertionError on a miss, another key's bytes or a torn page."""
    from kvconnect.connectors.testing.conformance import PageStoreConformance, check_page

    t = PageStoreConformance()
    for i in range(0, len(keys), batch):
        part = keys[i:i + batch]
        ok, buf = t.read(store, part)
        assert ok == [True] * len(part), f"{ok.count(False)} of {len(part)} confirmed pages missing"
        for j, k in enumerate(part):
            check_page(k, buf.read(j))


def bound_s(client_timeout: float, retries: int) -> float:
    """How long a store call may take: two metadata calls in sequence (a write's reserve and
    confirm; after a failed call the next fails fast), each within ``client_timeout`` plus
    one connection set-up (Sentinel lookup + connect), plus the page I/O."""
    attempt = max(0.05, client_timeout / retries)
    setup = 3 * max(0.05, min(0.5, attempt / 3)) + attempt
    return 2 * (client_timeout + setup) + 0.5


# ---------------------------------------------------------------------------- worker process


def _store(cfg: dict):
    from kvconnect.connectors.context import EngineContext
    from kvconnect.connectors.hf3fs.config import HF3FSConfig
    from kvconnect.connectors.hf3fs.store import HF3FSStore

    return HF3FSStore(HF3FSConfig(
        file_path_prefix=cfg["prefix"], file_size=cfg["num_pages"] * cfg["page"], numjobs=2, entries=8,
        metadata_server_url=cfg["url"], client_timeout=cfg["client_timeout"], meta_retries=cfg["retries"],
        metadata_wait_replicas=cfg["wait_replicas"], verify_pages=cfg["verify_pages"]),
        EngineContext(page_bytes=cfg["page"]))


def worker(cfg: dict) -> None:
    from kvconnect.connectors.buffers import HostBuffer

    ctl = Path(cfg["control"])
    wid = cfg["id"]
    page, batch = cfg["page"], cfg["batch"]
    bound = cfg["bound_s"]
    store = _store(cfg)
    wbuf, rbuf = HostBuffer(batch, page, 1), HostBuffer(batch, page, 1)
    confirmed: list[tuple[str, float]] = []
    stats = {"puts": 0, "gets": 0, "hits": 0, "misses": 0, "wrong_bytes": 0, "calls_over_bound": 0,
             "max_call_s": 0.0, "first_hit_after_event": None, "errors": 0}
    lock = threading.Lock()
    stop = threading.Event()
    event_at: list[float] = []

    def timed(fn, *a):
        t0 = time.time()
        try:
            out = fn(*a)
        except Exception as e:  # noqa: BLE001 - an exception into the engine is a failure we count
            with lock:
                stats["errors"] += 1
            print(f"worker {wid}: store call raised {e!r}", file=sys.stderr, flush=True)
            out = None
        t1 = time.time()
        with lock:
            stats["max_call_s"] = max(stats["max_call_s"], t1 - t0)
            if t1 - t0 > bound:
                stats["calls_over_bound"] += 1
        return t0, t1, out

    def writer():
        seq = 0
        while not stop.is_set():
            if (ctl / "pause").exists():
                time.sleep(0.02)
                continue
            keys = [f"w{wid}-{seq + i}-{cfg['salt']}" for i in range(batch)]
            seq += batch
            for i, k in enumerate(keys):
                ctypes.memmove(wbuf.page(i)[0][0], expected(k, page), page)
            _, t1, ok = timed(store.put_from, keys, [wbuf.page(i) for i in range(batch)])
            with lock:
                stats["puts"] += 1
                confirmed.extend((k, t1) for k, o in zip(keys, ok or []) if o)
            time.sleep(cfg["write_pause_s"])

    def reader():
        rng = random.Random(wid)
        while not stop.is_set():
            if not event_at and (ctl / "event").exists():
                try:
                    event_at.append(float((ctl / "event").read_text()))
                except ValueError:
                    pass
            with lock:
                n = len(confirmed)
                if n < batch:
                    pick = None
                else:
                    window = confirmed[-cfg["read_window"]:]
                    pick = [k for k, _ in rng.sample(window, batch // 2)]
                    pick += [k for k, _ in rng.sample(confirmed, batch - len(pick))]  # old keys too
            if pick is None:
                time.sleep(0.01)
                continue
            for i in range(batch):
                ctypes.memset(rbuf.page(i)[0][0], 0, page)
            t0, t1, ok = timed(store.get_into, pick, [rbuf.page(i) for i in range(batch)])
            ok = ok or [False] * batch
            good = 0
            with lock:
                stats["gets"] += 1
                for i, (k, o) in enumerate(zip(pick, ok)):
                    if not o:
                        stats["misses"] += 1
                        continue
                    if ctypes.string_at(rbuf.page(i)[0][0], page) != expected(k, page):
                        stats["wrong_bytes"] += 1
                        print(f"worker {wid}: WRONG BYTES for {k}", file=sys.stderr, flush=True)
                        continue
                    stats["hits"] += 1
                    good += 1
                if good and event_at and stats["first_hit_after_event"] is None and t0 > event_at[0]:
                    stats["first_hit_after_event"] = t1
                    (ctl / f"recovered-{wid}").write_text(str(t1))
            time.sleep(cfg["read_pause_s"])

    threads = [threading.Thread(target=writer, daemon=True), threading.Thread(target=reader, daemon=True)]
    for t in threads:
        t.start()
    (ctl / f"ready-{wid}").write_text("1")
    while not (ctl / "stop").exists():
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(30)
    stats["stale_reads"] = store.stale_reads
    store.close()
    Path(cfg["out"]).write_text(json.dumps({"stats": stats, "confirmed": confirmed}))


def verify(cfg: dict) -> None:
    """Read every key of ``cfg['keys']`` through a fresh store: lost (miss) and wrong bytes."""
    from kvconnect.connectors.buffers import HostBuffer

    store = _store(cfg)
    page, batch = cfg["page"], cfg["batch"]
    buf = HostBuffer(batch, page, 1)
    keys = cfg["keys"]
    lost, wrong = [], 0
    for a in range(0, len(keys), batch):
        part = keys[a:a + batch]
        ok = store.get_into(part, [buf.page(i) for i in range(len(part))])
        for i, (k, o) in enumerate(zip(part, ok)):
            if not o:
                lost.append(k)
            elif ctypes.string_at(buf.page(i)[0][0], page) != expected(k, page):
                wrong += 1
    out = {"lost": lost, "wrong_bytes": wrong, "stale_reads": store.stale_reads}
    store.close()
    Path(cfg["out"]).write_text(json.dumps(out))


# ---------------------------------------------------------------------------- the scenario


def _spawn(netns: str | None, mode: str, cfg: dict, path: Path) -> subprocess.Popen:
    path.write_text(json.dumps(cfg))
    cmd = (["ip", "netns", "exec", netns] if netns else []) + [
        sys.executable, "-m", "kvconnect.connectors.testing.hf3fs_failover", mode, str(path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(str(path) + ".err", "w"))


def _follows(node, primary: tuple[str, int]) -> bool:
    """``node`` is a replica of ``primary`` with its replication link up (its sync is done)."""
    c = node.client()
    try:
        info = c.info("replication")
    except Exception:  # noqa: BLE001 - still starting, or loading its AOF
        return False
    finally:
        c.close()
    return (info.get("role") == "slave" and info.get("master_port") == primary[1]
            and info.get("master_link_status") == "up")


def _wait_files(paths: list[Path], timeout: float, procs: list[subprocess.Popen] | None = None) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(p.exists() for p in paths):
            return True
        for pr in procs or []:
            if pr.poll() is not None and pr.returncode != 0:
                raise RuntimeError(f"worker exited with {pr.returncode}")
        time.sleep(0.05)
    return False


def run_scenario(scenario: str, mode: str = "async", *, workers: int = 3, verify_pages: str = "auto",
                 client_timeout: float = 1.0, retries: int = 3, page: int = 8192, batch: int = 8,
                 warm_s: float = 2.0, after_s: float = 1.0, stall_s: float = 4.0, lag_s: float = 2.0,
                 gap_s: float = 1.5, recover_timeout: float = 30.0, workdir: str | None = None) -> dict[str, Any]:
    """Run one scenario (``SCENARIOS``) in one durability mode (``DURABILITY``); the figures."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
    durability = DURABILITY[mode]
    tmp = Path(tempfile.mkdtemp(prefix=f"kvc-ha-{scenario}-", dir=workdir))
    ctl = tmp / "ctl"
    ctl.mkdir()
    bridge = None
    if scenario in ("partition", "lagging"):
        from kvconnect.connectors.testing.netns import Bridge

        bridge = Bridge(4).__enter__()
        if scenario == "lagging":
            # small TCP buffers between primary and replica: while the replica is stopped, the
            # replication stream waits in the primary's memory (lost with it), not in kernel
            # buffers that the replica would still drain after the primary died
            for ns in bridge.names[:2]:
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_rmem=4096 4096 4096",
                                "net.ipv4.tcp_wmem=4096 4096 4096"], check=True, timeout=20)
    ha = RedisHA(durability, bridge=bridge, workdir=tmp / "redis")
    procs: list[subprocess.Popen] = []
    fig: dict[str, Any] = {"scenario": scenario, "mode": mode, "verify_pages": verify_pages, "workers": workers,
                           "wait_replicas": durability.wait_replicas, "appendonly": durability.appendonly,
                           "appendfsync": durability.appendfsync}
    try:
        ha.start()
        lagging = scenario == "lagging"
        num_pages = 2048 if lagging else 1 << 16
        bound = bound_s(client_timeout, retries)
        base = {"url": ha.url, "prefix": str(tmp / "data" / "hicache"), "num_pages": num_pages, "page": page,
                "batch": batch, "client_timeout": client_timeout, "retries": retries,
                "wait_replicas": durability.wait_replicas, "verify_pages": verify_pages, "control": str(ctl),
                "bound_s": bound, "salt": os.urandom(3).hex(), "read_window": num_pages // 8,
                "write_pause_s": 0.01 if lagging else 0.02, "read_pause_s": 0.01}
        netns = ha.client_netns
        for w in range(workers):
            procs.append(_spawn(netns, "worker", {**base, "id": w, "out": str(tmp / f"w{w}.json")}, tmp / f"w{w}.cfg"))
        if not _wait_files([ctl / f"ready-{w}" for w in range(workers)], 60, procs):
            raise TimeoutError("workers did not start")
        time.sleep(warm_s + (3.0 if lagging else 0.0))  # lagging: fill the file, evictions under way
        old = ha.master_addr()
        old_node = ha.node_at(old)
        via = 1 if scenario == "partition" else None
        if scenario == "kill9":
            t_event = time.time()
            old_node.kill9()
        elif scenario == "sigstop":
            t_event = time.time()
            old_node.stop()
        elif scenario == "partition":
            t_event = time.time()
            bridge.cut(0)
        elif scenario == "double":
            old_node.kill9()
            ha.wait_failover(old, timeout=recover_timeout)
            first = old
            old = ha.master_addr()
            survivor = old_node
            old_node = ha.node_at(old)
            survivor.start()  # back as a primary of its own; Sentinel turns it into a replica of the new one
            fig["reattach_s"] = round(wait_until(lambda: _follows(survivor, old), recover_timeout,
                                                 f"{first} re-attached to {old}"), 3)
            time.sleep(gap_s)  # confirms now need the re-attached node's acknowledgement
            t_event = time.time()
            old_node.kill9()
        else:  # lagging
            replica = ha.nodes[1]
            replica.stop()
            time.sleep(lag_s)
            t_event = time.time()
            old_node.kill9()
            (ctl / "pause").write_text("1")
            replica.cont()
        (ctl / "event").write_text(repr(t_event))
        ha.wait_failover(old, timeout=recover_timeout, via=via)
        fig["failover_s"] = round(time.time() - t_event, 3)
        if scenario == "sigstop":
            time.sleep(max(0.0, stall_s - (time.time() - t_event)))
            old_node.cont()  # back, still believing it is the primary, until Sentinel demotes it
        recovered = _wait_files([ctl / f"recovered-{w}" for w in range(workers)],
                                max(1.0, recover_timeout - (time.time() - t_event)), procs)
        time.sleep(after_s)
        if bridge is not None:
            bridge.heal(0)
        (ctl / "stop").write_text("1")
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        results = []
        for w in range(workers):
            path = tmp / f"w{w}.json"
            if not path.exists():
                raise RuntimeError(f"worker {w} wrote no results: {(tmp / f'w{w}.cfg.err').read_text()[-2000:]}")
            results.append(json.loads(path.read_text()))
        confirmed = [(k, t) for r in results for k, t in r["confirmed"]]
        if lagging:
            before = sorted((c for c in confirmed if c[1] < t_event), key=lambda c: c[1])
            counted = [k for k, _ in before[-(num_pages // 4):]]
        else:
            counted = [k for k, _ in confirmed]
        # every confirmed key is read once more (wrong bytes), the counted ones decide losses
        vcfg = {**base, "keys": [k for k, _ in confirmed], "out": str(tmp / "verify.json")}
        vp = _spawn(netns, "verify", vcfg, tmp / "verify.cfg")
        vp.wait(300)
        ver = json.loads((tmp / "verify.json").read_text())
        lost_set = set(ver["lost"])
        firsts = [r["stats"]["first_hit_after_event"] for r in results]
        stats = [r["stats"] for r in results]
        fig.update({
            "confirmed": len(confirmed),
            "confirmed_counted": len(counted),
            "confirmed_lost": sum(1 for k in counted if k in lost_set),
            "wrong_bytes": sum(s["wrong_bytes"] for s in stats) + ver["wrong_bytes"],
            "seconds_to_first_hit": (round(max(firsts) - t_event, 3) if recovered and all(firsts) else None),
            "seconds_to_first_hit_min": (round(min(f for f in firsts if f) - t_event, 3) if any(firsts) else None),
            "calls_over_bound": sum(s["calls_over_bound"] for s in stats),
            "bound_s": round(bound, 3),
            "max_call_s": round(max(s["max_call_s"] for s in stats), 3),
            "exceptions": sum(s["errors"] for s in stats),
            "stale_reads": sum(s["stale_reads"] for s in stats) + ver["stale_reads"],
            "gets": sum(s["gets"] for s in stats), "hits": sum(s["hits"] for s in stats),
            "puts": sum(s["puts"] for s in stats),
        })
        return fig
    finally:
        (ctl / "stop").write_text("1")
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        ha.close()
        if bridge is not None:
            bridge.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvconnect.connectors.testing.hf3fs_failover")
    ap.add_argument("mode", choices=("worker", "verify"))
    ap.add_argument("config", help="JSON file")
    args = ap.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())
    (worker if args.mode == "worker" else verify)(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
