"""Peer pool benchmark: kvconnect ``peer_rdma`` vs PeerCache 0.8.4 vs raw Transfer Engine.

Two processes per system, in one run, inside a loopback-only network namespace made for
the run (Mooncake TE and PeerCache listen on every interface; nothing leaves the namespace):

* kvconnect: a memory-only node (``kvconnect peer serve``) lends its segment; the bench
  process is a node lending nothing (``global_segment_size=0``, ``placement=owner``), so
  every write is a one-sided remote write (Alloc RPC, TE write, Commit RPC) and every read
  a directory lookup plus a one-sided TE read into registered memory, checksum-validated.
  A second pass with ``placement=local`` (the default: pages stay in the writer's segment)
  measures the write path PeerCache uses, with the reads done by the other node.
* PeerCache 0.8.4 (p2p mode, TCP fallback, every bind host 127.0.0.1): process A
  ``batch_set_v1``s the pages into its published pool, process B ``batch_get_v1``s them.
* raw TE: ``batch_transfer_sync_read`` of the same bytes (the slots the directory points
  at, same batches of 128, same destination), in the bench process, interleaved with our
  reads: the floor our reads are measured against.
* same host: the ``placement=local`` pass again with ``shared_segment`` on both nodes (their
  segments are files in /dev/shm): the reader copies the writer's pages out of its file and
  checksums them, no Transfer Engine transfer; measured against the TCP pass just before.
* "read after exists": SGLang's pattern (``batch_exists`` then ``batch_get``): the read
  reuses the locations the lookup found; only the read is timed.

Pages of 64 KiB and 2 MiB, batches of 128. Every read is checked byte-exact once before
timing. Results: benchmarks/results/peer_rdma.json (ratios ours/reference).

    .venv/bin/python -m kvconnect.benchmarks.peer_rdma [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a script: benchmarks/mooncake.py would shadow the mooncake package
sys.path.insert(0, str(ROOT))

from kvconnect.benchmarks.harness import BenchResult, gib_per_s  # noqa: E402

BATCH = 128
KiB, MiB = 1 << 10, 1 << 20


def _buffer(nbytes: int):
    import mmap

    m = mmap.mmap(-1, nbytes)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def _fill(addr: int, nbytes: int, seed: int) -> None:
    """Distinct bytes per page (cheap: one random block, rotated per page)."""
    import numpy as np

    arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
    rng = np.random.default_rng(seed)
    arr[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)


def _emit(obj: dict) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


def _wait_file(path: str, proc: subprocess.Popen, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[-3:]} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {path}")
        time.sleep(0.05)
    time.sleep(0.05)
    return open(path).read()


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ----------------------------------------------------------------------------- roles
def role_ours_bench(args) -> None:
    """The bench node: remote writes then remote reads (placement owner), then local-placement
    writes whose pages a second process reads (``role_ours_reader``)."""
    from kvconnect.connectors.registry import create_store

    page, n = args.page, args.pages
    common = {"discovery_addr": args.seed, "control_port": 0, "protocol": "tcp", "heartbeat_interval": 1.0,
              "location_cache_ttl": 30}
    store = create_store("peer_rdma", {**common, "global_segment_size": 0, "placement": "owner"})
    deadline = time.monotonic() + 10
    while len(store.node.view.members) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    src_m, src = _buffer(n * page)
    dst_m, dst = _buffer(BATCH * page)
    _fill(src, n * page, 1)
    store.register_memory(src, n * page)
    store.register_memory(dst, BATCH * page)
    keys = [f"bench-{page}-{i}" for i in range(n)]
    batches = [list(range(s, min(n, s + BATCH))) for s in range(0, n, BATCH)]
    tag = [0]

    def write_all():  # fresh keys every pass: a write of a present key is a no-op
        tag[0] += 1
        for b in batches:
            ok = store.put_from([f"{keys[i]}-{tag[0]}" for i in b], [[(src + i * page, page)] for i in b])
            assert all(ok), "remote write failed"

    t_write = _timed(write_all, args.repeats)
    final = [f"{k}-{tag[0]}" for k in keys]

    def read_all():
        for b in batches:
            ok = store.get_into([final[i] for i in b], [[(dst + j * page, page)] for j in range(len(b))])
            assert all(ok), (f"remote read missed {ok.count(False)} pages: "
                             f"{ {k: v for k, v in store.node.metrics().items() if 'read' in k or 'rpc' in k} }")

    read_all()
    for j, i in enumerate(batches[-1]):  # byte-exact check of the last batch
        assert ctypes.string_at(dst + j * page, page) == ctypes.string_at(src + i * page, page)

    # raw Transfer Engine, same process, same connection, same remote bytes (the slots the
    # directory points at), same destination: the floor of a one-sided batched read
    node = store.node
    entries = node.reader.locate(final, time.monotonic() + 30)
    holder = node.view.members[entries[0][0]]
    remote = [holder.seg_base + e[2] for e in entries]
    te = node.transport.engine

    def te_all():
        for b in batches:
            rc = te.batch_transfer_sync_read(holder.te_name, [dst + j * page for j in range(len(b))],
                                             [remote[i] for i in b], [page] * len(b))
            assert rc == 0, rc

    te_all()

    def te_write_all():  # the same bytes back into the same slots: the stored pages stay valid
        for b in batches:
            rc = te.batch_transfer_sync_write(holder.te_name, [src + i * page for i in b], [remote[i] for i in b],
                                              [page] * len(b))
            assert rc == 0, rc

    t_te_write = _timed(te_write_all, args.repeats)

    def cached_read_all():  # SGLang's pattern: batch_exists first, then the read reuses its locations
        t = 0.0
        for b in batches:
            ks = [final[i] for i in b]
            assert all(store.exists(ks))
            t0 = time.perf_counter()
            assert all(store.get_into(ks, [[(dst + j * page, page)] for j in range(len(b))]))
            t += time.perf_counter() - t0
        return t

    # interleaved, best of N: the machine is shared, load comes and goes
    t_read = t_te = t_cached = float("inf")
    for _ in range(args.repeats):
        for which in ("ours", "te", "cached"):
            t0 = time.perf_counter()
            if which == "ours":
                read_all()
                t_read = min(t_read, time.perf_counter() - t0)
            elif which == "te":
                te_all()
                t_te = min(t_te, time.perf_counter() - t0)
            else:
                t_cached = min(t_cached, cached_read_all())
    m = store.node.metrics()
    assert m["read_remote_hits"] > 0 and m["read_local_hits"] == 0
    store.close()
    _emit({"write_s": t_write, "read_s": t_read, "te_read_s": t_te, "cached_read_s": t_cached, "bytes": n * page,
           "te_write_s": t_te_write,
           "read_stale": m["read_stale"], "read_failures": m["read_failures"]})


def role_ours_local(args) -> None:
    """A writer with the default local placement; waits for the reader, then exits."""
    from kvconnect.connectors.registry import create_store

    page, n = args.page, args.pages
    store = create_store("peer_rdma", {"discovery_addr": args.seed, "control_port": 0, "protocol": "tcp",
                                       "global_segment_size": 2 * n * page + 64 * MiB, "placement": "local",
                                       **_shared(args)})
    src_m, src = _buffer(n * page)
    _fill(src, n * page, 2)
    batches = [list(range(s, min(n, s + BATCH))) for s in range(0, n, BATCH)]
    tag = [0]

    def write_all():
        tag[0] += 1
        for b in batches:
            assert all(store.put_from([f"local-{page}-{i}-{tag[0]}" for i in b], [[(src + i * page, page)] for i in b]))

    t_write = _timed(write_all, args.repeats)
    Path(args.ready).write_text(json.dumps({"tag": tag[0], "node": store.node.node_id}))
    _emit({"write_s": t_write, "bytes": n * page})
    sys.stdin.read()  # until the reader is done
    store.close()


def _shared(args) -> dict:
    """The same-host pass: segments in shared memory, same-host pages copied."""
    return {"shared_segment": True, "shared_segment_dir": args.shm} if args.shm else {}


def role_ours_reader(args) -> None:
    from kvconnect.connectors.registry import create_store

    page, n = args.page, args.pages
    info = json.loads(args.info)
    store = create_store("peer_rdma", {"discovery_addr": args.seed, "control_port": 0, "protocol": "tcp",
                                       "global_segment_size": 0, "location_cache_ttl": 0, **_shared(args)})
    deadline = time.monotonic() + 10
    while len(store.node.view.members) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    dst_m, dst = _buffer(BATCH * page)
    store.register_memory(dst, BATCH * page)
    keys = [f"local-{page}-{i}-{info['tag']}" for i in range(n)]
    batches = [keys[s:s + BATCH] for s in range(0, n, BATCH)]

    def read_all():
        for b in batches:
            ok = store.get_into(b, [[(dst + j * page, page)] for j in range(len(b))])
            assert all(ok), f"read missed {ok.count(False)}"

    read_all()  # once untimed: the last batch must be the writer's bytes (role_ours_local fills seed 2)
    ref_m, ref = _buffer(n * page)
    _fill(ref, n * page, 2)
    first = n - len(batches[-1])
    assert ctypes.string_at(dst, len(batches[-1]) * page) == ctypes.string_at(ref + first * page, len(batches[-1]) * page)
    t_read = _timed(read_all, args.repeats)
    shared = store.node.metrics()["shared_reads"]
    store.close()
    _emit({"read_s": t_read, "bytes": n * page, "shared_reads": shared})


def _pc_store(seed: str, node_id: str, seg: int):
    from types import SimpleNamespace

    from peercache.store import PeerCacheStore

    cfg = SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=True, extra_config={
        "discovery_addr": seed, "protocol": "tcp", "local_hostname": "127.0.0.1", "node_id": node_id,
        "rdma_bind_host": "127.0.0.1", "control_bind_host": "127.0.0.1", "meta_bind_host": "127.0.0.1",
        "metrics_bind_host": "127.0.0.1", "metrics_enabled": False, "disk_enabled": False,
        "global_segment_size": seg, "heartbeat_interval": 1.0, "member_ttl": 30.0})
    return PeerCacheStore(cfg)


class _PcHostPool:
    """What PeerCacheStore reads from a host pool (as in its own microbenchmark)."""

    def __init__(self, page: int, n: int, seed: int):
        self.page_bytes = page
        self.mem, self.base = _buffer(page * n)
        _fill(self.base, page * n, seed)
        self.kv_buffer = self

    def data_ptr(self):
        return self.base

    def numel(self):
        return len(self.mem)

    def element_size(self):
        return 1

    def get_page_buffer_meta(self, host_indices):
        return [self.base + int(i) * self.page_bytes for i in host_indices], [self.page_bytes] * len(host_indices)


def role_pc_writer(args) -> None:
    page, n = args.page, args.pages
    store = _pc_store(args.seed, "A", 2 * n * page + 64 * MiB)
    host = _PcHostPool(page, n, 2)
    store.register_mem_pool_host(host)
    batches = [list(range(s, min(n, s + BATCH))) for s in range(0, n, BATCH)]
    tag = [0]

    def write_all():
        tag[0] += 1
        for b in batches:
            ok = store.batch_set_v1([f"pc-{page}-{i}-{tag[0]}" for i in b], b)
            assert all(ok), "peercache write failed"

    t_write = _timed(write_all, args.repeats)
    Path(args.ready).write_text(json.dumps({"tag": tag[0]}))
    _emit({"write_s": t_write, "bytes": n * page})
    sys.stdin.read()
    store.close()


def role_pc_reader(args) -> None:
    page, n = args.page, args.pages
    info = json.loads(args.info)
    store = _pc_store(args.seed, "B", 64 * MiB)
    deadline = time.monotonic() + 15
    while len(store.runtime.ring) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    host = _PcHostPool(page, BATCH, 3)
    store.register_mem_pool_host(host)
    keys = [f"pc-{page}-{i}-{info['tag']}" for i in range(n)]
    batches = [keys[s:s + BATCH] for s in range(0, n, BATCH)]
    ref_m, ref = _buffer(n * page)
    _fill(ref, n * page, 2)

    def read_all():
        for b in batches:
            ok = store.batch_get_v1(b, list(range(len(b))))
            assert all(ok), f"peercache read missed {ok.count(False)}"

    for attempt in range(20):  # its directory and ring settle asynchronously
        ok = store.batch_get_v1(batches[0], list(range(len(batches[0]))))
        print(f"peercache warm-up read {attempt}: {sum(ok)}/{len(ok)} hits", file=sys.stderr, flush=True)
        if all(ok):
            break
        time.sleep(0.5)
    read_all()
    last = batches[-1]
    first = n - len(last)
    assert ctypes.string_at(host.base, len(last) * page) == ctypes.string_at(ref + first * page, len(last) * page)
    t_read = _timed(read_all, args.repeats)
    store.close()
    _emit({"read_s": t_read, "bytes": n * page})


ROLES = {"ours-bench": role_ours_bench, "ours-local": role_ours_local, "ours-reader": role_ours_reader,
         "pc-writer": role_pc_writer, "pc-reader": role_pc_reader}


# ----------------------------------------------------------------------------- orchestration
class Runner:
    def __init__(self, ns: str | None, tmp: str):
        self.ns, self.tmp = ns, tmp
        self.procs: list[subprocess.Popen] = []

    def spawn(self, argv: list[str], stdin=None) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_minloglevel="2", MC_LOG_LEVEL="ERROR")
        prefix = ["ip", "netns", "exec", self.ns] if self.ns else []
        p = subprocess.Popen(prefix + argv, cwd=str(ROOT), env=env, stdin=stdin, stdout=subprocess.PIPE,
                             stderr=open(os.path.join(self.tmp, f"log{len(self.procs)}.txt"), "w"), text=True)
        self.procs.append(p)
        return p

    def role(self, name: str, page: int, pages: int, repeats: int, stdin=None, **kw) -> subprocess.Popen:
        argv = [sys.executable, str(Path(__file__).resolve()), "--role", name, "--page", str(page),
                "--pages", str(pages), "--repeats", str(repeats)]
        for k, v in kw.items():
            argv += [f"--{k}", str(v)]
        return self.spawn(argv, stdin=stdin)

    @staticmethod
    def result(p: subprocess.Popen, timeout: float = 300) -> dict:
        # a process that reads stdin until EOF (a holder) is released by closing it here
        out, _ = p.communicate(input="" if p.stdin else None, timeout=timeout)
        for line in out.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"{p.args[-8:]} failed (rc={p.returncode})")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def measure_size(r: Runner, page: int, pages: int, repeats: int, port: int) -> dict:
    fig: dict = {"page_bytes": page, "pages": pages, "batch": BATCH}
    seed = f"127.0.0.1:{port}"
    tmp = r.tmp
    # kvconnect: memory node + bench node (remote writes, remote reads)
    ready = os.path.join(tmp, f"mem{page}")
    mem = r.spawn([sys.executable, "-m", "kvconnect.connectors.cli", "--log-level", "WARNING", "peer", "serve",
                   "--discovery-addr", seed, "--global-segment-size", str(4 * pages * page + 64 * MiB),
                   "--protocol", "tcp", "--ready-file", ready])
    _wait_file(ready, mem)
    ours = r.result(r.role("ours-bench", page, pages, repeats, seed=seed))
    # kvconnect local placement: writer keeps pages, a third node reads them
    ready_l = os.path.join(tmp, f"local{page}")
    writer = r.role("ours-local", page, pages, repeats, stdin=subprocess.PIPE, seed=seed, ready=ready_l)
    info = _wait_file(ready_l, writer, 300)
    reader = r.result(r.role("ours-reader", page, pages, repeats, seed=seed, info=info))
    local_w = r.result(writer)
    # the same, both nodes lending from shared memory: the reader copies from the writer's file
    shm = tempfile.mkdtemp(prefix="kvp-bench-", dir="/dev/shm")
    try:
        ready_s = os.path.join(tmp, f"shm{page}")
        writer = r.role("ours-local", page, pages, repeats, stdin=subprocess.PIPE, seed=seed, ready=ready_s, shm=shm)
        info = _wait_file(ready_s, writer, 300)
        same_host = r.result(r.role("ours-reader", page, pages, repeats, seed=seed, info=info, shm=shm))
        r.result(writer)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert same_host["shared_reads"] > 0, "the same-host pass moved no page through shared memory"
    mem.terminate()
    mem.wait(15)
    # PeerCache
    pc_port = port + 1
    ready_p = os.path.join(tmp, f"pc{page}")
    pcw = r.role("pc-writer", page, pages, repeats, stdin=subprocess.PIPE, seed=f"127.0.0.1:{pc_port}",
                 ready=ready_p)
    info = _wait_file(ready_p, pcw, 300)
    pcr = r.result(r.role("pc-reader", page, pages, repeats, seed=f"127.0.0.1:{pc_port}", info=info))
    pc_w = r.result(pcw)
    nbytes = pages * page
    fig.update({
        "ours_remote_read_gib_s": gib_per_s(nbytes, ours["read_s"]),
        "ours_remote_write_gib_s": gib_per_s(nbytes, ours["write_s"]),
        "ours_local_placement_write_gib_s": gib_per_s(nbytes, local_w["write_s"]),
        "ours_local_placement_remote_read_gib_s": gib_per_s(nbytes, reader["read_s"]),
        "ours_same_host_read_gib_s": gib_per_s(nbytes, same_host["read_s"]),
        "peercache_read_gib_s": gib_per_s(nbytes, pcr["read_s"]),
        "peercache_write_gib_s": gib_per_s(nbytes, pc_w["write_s"]),
        "te_batch_read_gib_s": gib_per_s(nbytes, ours["te_read_s"]),
        "te_batch_write_gib_s": gib_per_s(nbytes, ours["te_write_s"]),
        "ours_read_after_exists_gib_s": gib_per_s(nbytes, ours["cached_read_s"]),
        "ours_read_stale": ours["read_stale"], "ours_read_failures": ours["read_failures"],
    })
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer pages and repeats (tests)")
    p.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    p.add_argument("--page", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--pages", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--seed", default="", help=argparse.SUPPRESS)
    p.add_argument("--ready", default="", help=argparse.SUPPRESS)
    p.add_argument("--info", default="", help=argparse.SUPPRESS)
    p.add_argument("--shm", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="results path (default benchmarks/results/peer_rdma.json)")
    args = p.parse_args(argv)
    if args.role:
        ROLES[args.role](args)
        return 0

    sizes = [(64 * KiB, 512 if args.quick else 1024), (2 * MiB, 128 if args.quick else 256)]
    repeats = 1 if args.quick else 3
    res = BenchResult("peer_rdma", params={"batch": BATCH, "sizes": [s for s, _ in sizes], "quick": args.quick,
                                           "repeats": repeats, "transport": "tcp (no RDMA NIC here)"})
    res.notes.append("two processes per system in one loopback-only network namespace; "
                     "throughput = best of repeats; the machine is shared (see machine.loadavg)")
    tmp = tempfile.mkdtemp(prefix="kvp-bench-")
    ns = None
    if os.geteuid() == 0 and subprocess.run(["which", "ip"], capture_output=True).returncode == 0:
        ns = f"kvpbench{os.getpid() % 100000}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    else:
        res.notes.append("not root: ran in the host network namespace (TE listens on all interfaces)")
    r = Runner(ns, tmp)
    ok = False
    try:
        for k, (page, pages) in enumerate(sizes):
            fig = measure_size(r, page, pages, repeats, 32100 + 10 * k)
            label = f"{page // KiB}KiB" if page < MiB else f"{page // MiB}MiB"
            res.figures[label] = fig
            res.ratio(f"read_gib_s_{label}_vs_peercache", fig["ours_remote_read_gib_s"],
                      fig["peercache_read_gib_s"], "PeerCache 0.8.4 batch_get_v1 (TCP fallback)")
            res.ratio(f"read_gib_s_{label}_vs_raw_te", fig["ours_remote_read_gib_s"], fig["te_batch_read_gib_s"],
                      "Mooncake TE batch_transfer_sync_read, same bytes")
            res.ratio(f"remote_write_gib_s_{label}_vs_raw_te_write", fig["ours_remote_write_gib_s"],
                      fig["te_batch_write_gib_s"], "Mooncake TE batch_transfer_sync_write, same bytes")
            res.ratio(f"remote_write_gib_s_{label}_vs_peercache_write", fig["ours_remote_write_gib_s"],
                      fig["peercache_write_gib_s"], "PeerCache 0.8.4 batch_set_v1 (local pool + directory)")
            res.ratio(f"same_host_read_gib_s_{label}_vs_te_read", fig["ours_same_host_read_gib_s"],
                      fig["ours_local_placement_remote_read_gib_s"],
                      "kvconnect peer_rdma, the same reads through the Transfer Engine (TCP), same run")
            res.ratio(f"same_host_read_gib_s_{label}_vs_peercache", fig["ours_same_host_read_gib_s"],
                      fig["peercache_read_gib_s"], "PeerCache 0.8.4 batch_get_v1 (TCP fallback)")
            res.ratio(f"local_placement_write_gib_s_{label}_vs_peercache_write",
                      fig["ours_local_placement_write_gib_s"], fig["peercache_write_gib_s"],
                      "PeerCache 0.8.4 batch_set_v1 (local pool + directory)")
        ok = True
    finally:
        r.close()
        if ns:
            from kvconnect.connectors.testing.netns import delete_namespace

            delete_namespace(ns)
    if ok:  # keep the process logs only when something failed
        shutil.rmtree(tmp, ignore_errors=True)
    res.finish(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
