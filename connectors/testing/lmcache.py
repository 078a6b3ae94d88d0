"""Real ``lmcache server`` processes with the kvconnect L2 plugin, and LMCache's own engine
client (``lmcache bench server``'s), for tests and benchmarks.

Also runnable inside a network namespace (Mooncake listens on every interface, so its
servers live in a loopback-only namespace the test made, where the test process cannot
reach them): ``python -m kvconnect.connectors.testing.lmcache share --params JSON --out FILE``
starts two servers on one store, stores on the first, retrieves from the second (then,
with ``--fill N``, both write past the store's capacity) and writes what it saw as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from kvconnect.connectors.testing.processes import child_env, free_port

LMCACHE_BIN = str(Path(sys.executable).with_name("lmcache"))
MODULE = "kvconnect.connectors.engines.lmcache_l2"


def plugin_json(params: dict) -> str:
    return json.dumps({"type": "plugin", "module_path": MODULE, "class_name": "KVConnectL2Adapter",
                       "adapter_params": params})


class Server:
    """``lmcache server`` on 127.0.0.1 (random free ports) with one kvconnect L2 adapter."""

    def __init__(self, params: dict | None, log_path: Path, *extra: str, l1_size_gb: float = 0.25):
        """``params``: the adapter's (None: LMCache's own L1 only, no kvconnect adapter)."""
        self.port, self.http_port = free_port(), free_port()
        self.log_path = log_path
        self._interrupted = False
        l2 = ["--l2-adapter", plugin_json(params)] if params is not None else []
        cmd = [LMCACHE_BIN, "server", "--host", "127.0.0.1", "--port", str(self.port), "--l1-size-gb", str(l1_size_gb),
               "--eviction-policy", "LRU", "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
               "--disable-metrics", *l2, *extra]
        self.proc = subprocess.Popen(cmd, env=child_env(LMCACHE_DISABLE_BANNER="1"), stdout=open(log_path, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def rpc_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def status(self, timeout: float = 10) -> dict:
        with urllib.request.urlopen(f"{self.http_url}/status", timeout=timeout) as r:
            return json.load(r)

    def adapter_status(self) -> dict:
        (adapter,) = self.status()["storage_manager"]["l2_adapters"]
        return adapter

    def wait_healthy(self, timeout: float = 150) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"lmcache server exited:\n{self.log()[-4000:]}"
            try:
                st = self.status(timeout=2)
                if st.get("is_healthy"):
                    return st
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"lmcache server not healthy in {timeout}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def describe(self) -> str:
        """What ``lmcache describe kvcache`` prints for this server (its L2's "Used X / Y (P%)")."""
        p = subprocess.run([LMCACHE_BIN, "describe", "kvcache", "--url", self.http_url], env=child_env(),
                           capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise AssertionError(f"lmcache describe exited {p.returncode}: {(p.stdout + p.stderr)[-3000:]}")
        return p.stdout

    def interrupt(self) -> None:
        """SIGINT once (LMCache's clean shutdown); a second one would cut it short."""
        if self.proc.poll() is None and not self._interrupted:
            self._interrupted = True
            self.proc.send_signal(signal.SIGINT)

    def stop(self, timeout: float = 30) -> int | None:
        self.interrupt()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                return None
        return self.proc.returncode


class Endpoint(NamedTuple):
    """Where an ``lmcache server`` answers: its request socket and its HTTP API."""

    rpc_url: str
    http_url: str


class EngineClient:
    """LMCache's own engine-side client (``lmcache bench server``'s), CPU KV tensors shared
    with the server over POSIX SHM: LOOKUP, STORE, RETRIEVE, END_SESSION."""

    SHAPE = "(2,64,16,2,64):float16:4"  # 4 layers, 64 blocks of 16 tokens: 512 KiB per 256-token chunk

    def __init__(self, server: Server | Endpoint, num_tokens: int = 512, shape: str = SHAPE,
                 instance_id: int | None = None):
        """``server``: a ``Server`` or the ``Endpoint`` of one started elsewhere. ``instance_id``: the
        engine instance it registers its KV as (LMCache's bench client always takes 1000, so two
        processes on one server would replace each other's KV buffers: give each its own)."""
        from lmcache.cli.commands.bench.server_bench import helpers
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        cfg = BenchConfig(rpc_url=server.rpc_url, http_url=server.http_url, mode="cpu",
                          transfer_mode="lmcache_driven", tp_size=1, use_mla=False, num_tokens=num_tokens,
                          kvcache_shape_spec=shape, num_blocks=64, block_size=16)
        self.client = ServerBenchClient(cfg, log=lambda msg: None)
        base = helpers._INSTANCE_ID_BASE
        if instance_id is not None:  # start() reads the module's base (+ rank) when it registers
            helpers._INSTANCE_ID_BASE = instance_id
        try:
            self.client.start()
        finally:
            helpers._INSTANCE_ID_BASE = base

    def request(self, seq: int, tag: str):
        return self.client.create_request(seq, request_id=f"req-{seq}-{tag}-{time.monotonic_ns()}",
                                          request_kind=tag)

    @property
    def chunk_size(self) -> int:
        return self.client._chunk_size

    def request_for(self, token_ids: list[int], tag: str):
        """A request for the full chunks of ``token_ids`` that fit the KV tensors (LMCache keys
        them by these tokens, like an engine's prompt), in blocks from 0; None if not one chunk."""
        from lmcache.cli.commands.bench.server_bench.client import RequestContext

        c = self.client
        n = min(len(token_ids), c._num_blocks * c._block_size) // c._chunk_size * c._chunk_size
        if n == 0:
            return None
        return RequestContext(sequence_id=0, request_id=f"req-{tag}-{time.monotonic_ns()}", request_kind=tag,
                              token_ids=tuple(token_ids[:n]), num_full_tokens=n, total_chunks=n // c._chunk_size,
                              chunk_size=c._chunk_size, block_offset=0, num_blocks=n // c._block_size)

    def kv_checksums(self, req, start: int, count: int) -> list[str]:
        """One digest per chunk of ``req``'s KV from token ``start`` on, hashed here, over the
        memory the server writes (what ``compute_checksums`` does in engine-driven mode; in this
        mode it asks the server's HTTP API, which an engine's MP config does not name)."""
        from lmcache.cli.commands.bench.server_bench.helpers import _compute_client_checksums

        c = self.client
        (worker,) = c._workers
        return _compute_client_checksums(list(worker.kv_caches.values()), req.block_offset + start // c._block_size,
                                         count // c._block_size, c._block_size, c._chunk_size)

    def chunk_views(self, req, chunk: int) -> list:
        """Each layer's KV (shared with the server) of ``req``'s ``chunk``-th chunk."""
        c = self.client
        per_chunk = c._chunk_size // c._block_size
        (worker,) = c._workers
        return [t.narrow(1, req.block_offset + chunk * per_chunk, per_chunk) for t in worker.kv_caches.values()]

    def store_sequence(self, seq: int) -> list[str]:
        """Cold path: lookup (must miss), checksum the KV, STORE it; returns the checksums."""
        req = self.request(seq, "cold")
        res = self.client.lookup(req)
        assert res.succeeded and res.hit_chunks == 0, res
        sums = self.client.compute_checksums(req, 0, req.num_full_tokens)
        stored = self.client.store(req, 0, req.num_full_tokens)
        assert stored is not None and stored.succeeded, stored
        self.client.end_session(req)
        return sums

    def hit_chunks(self, seq: int) -> tuple[int, int]:
        req = self.request(seq, "probe")
        res = self.client.lookup(req)
        self.client.end_session(req)
        assert res.succeeded, res
        return res.hit_chunks, res.total_chunks

    def lookup_timed(self, req, poll_s: float = 0.001) -> tuple[int, float]:
        """The LOOKUP RPC and QUERY_PREFETCH_STATUS polls of LMCache's bench client, polled
        every ``poll_s`` (that client sleeps 50 ms between polls, so its lookups read in steps
        of ~50 ms): hit chunks, and seconds from the LOOKUP to the answer that the prompt's
        hits are in L1."""
        from lmcache.cli.commands.bench.server_bench.helpers import _make_key, _poll_prefetch_status, _send_lookup

        rc = self.client._require_started()
        key = _make_key(req.token_ids, req.request_id, start=0, end=req.num_full_tokens,
                        world_size=self.client._kv_world_size)
        t0 = time.perf_counter()
        assert _send_lookup(rc, key, tp_size=len(self.client._workers)), "LOOKUP timed out"
        hit = _poll_prefetch_status(rc, key.request_id, max_polls=int(5 / poll_s), poll_interval=poll_s)
        return hit or 0, time.perf_counter() - t0

    def hit_chunks_timed(self, seq: int, poll_s: float = 0.001) -> tuple[int, int, float]:
        """``hit_chunks`` through ``lookup_timed``: hit chunks, total chunks, seconds."""
        req = self.request(seq, "probe")
        hit, elapsed = self.lookup_timed(req, poll_s)
        self.client.end_session(req)
        return hit, req.total_chunks, elapsed

    def retrieve_sequence(self, seq: int, poll_s: float | None = None) -> list[str]:
        """Warm path: lookup (must fully hit; ``poll_s``: through ``lookup_timed``), zero the
        KV, RETRIEVE, checksum what arrived."""
        req = self.request(seq, "warm")
        if poll_s is None:
            res = self.client.lookup(req)
            assert res.is_full_hit, res
        else:
            hit, _ = self.lookup_timed(req, poll_s)
            assert hit == req.total_chunks, (hit, req.total_chunks)
        self.client.zero_destination(req, 0, req.num_full_tokens)
        got = self.client.retrieve(req, 0, req.num_full_tokens)
        assert got is not None and got.succeeded, got
        sums = self.client.compute_checksums(req, 0, req.num_full_tokens)
        self.client.end_session(req)
        return sums

    def close(self) -> None:
        self.client.close()


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def l2_writes(server: Server) -> int:
    """Chunks the server's L2 stored or failed to store (its store tasks that finished)."""
    st = server.adapter_status()["store_stats"]
    return st["put_written"] + st["put_failed"]


def fill(a: Server, b: Server, ca: EngineClient, cb: EngineClient, seqs: int, first: int = 1000) -> dict:
    """A and B each store ``seqs`` more sequences of their own (``first``..., alternating),
    meant to go past the store's capacity; the store's bytes as A's adapter reports them are
    sampled after every pair. Then the figures once every L2 write finished, both servers'
    ``lmcache describe``, and whether B still finds A's newest and A B's newest sequence."""
    base = {s: l2_writes(s) for s in (a, b)}
    samples = []
    for i in range(seqs):
        ca.store_sequence(first + 2 * i)
        cb.store_sequence(first + 2 * i + 1)
        samples.append(a.adapter_status()["current_size_bytes"])
    for s in (a, b):
        wait_for(lambda s=s: l2_writes(s) >= base[s] + 2 * seqs, 60, "the fill's L2 writes")
    last = first + 2 * (seqs - 1)
    return {"samples": samples, "a_status": a.adapter_status(), "b_status": b.adapter_status(),
            "describe": [a.describe(), b.describe()],
            "newest_hits": [list(cb.hit_chunks(last)), list(ca.hit_chunks(last + 1))]}


USED = re.compile(r"([\d.]+) (B|KB|MB|GB) / ([\d.]+) (B|KB|MB|GB) \(")
UNIT = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def described(text: str) -> tuple[float, float]:
    """(used, capacity) bytes from ``lmcache describe kvcache``'s "Used X / Y (P%)" line."""
    m = USED.search(text)
    if not m:
        raise AssertionError(f"no 'X / Y (P%)' figures in lmcache describe:\n{text}")
    return float(m[1]) * UNIT[m[2]], float(m[3]) * UNIT[m[4]]


def check_fill(doc: dict, capacity: int, lowest: int, seqs: int) -> None:
    """What ``fill`` saw, against a shared store of ``capacity`` bytes that evicts by itself:
    its bytes never above ``capacity``, once full at least ``lowest`` (capacity less one
    eviction batch), on both servers and in both ``lmcache describe``s; no failed L2 write;
    the newest sequences kept."""
    samples = doc["samples"]
    assert len(samples) == seqs and max(samples) <= capacity, (samples, capacity)
    for st in (doc["a_status"], doc["b_status"]):
        assert st["max_capacity_bytes"] == capacity, (st, capacity)
        assert lowest <= st["current_size_bytes"] <= capacity, (st["current_size_bytes"], lowest, capacity)
        assert st["usage"]["bytes_used_from"] == "store" and st["usage"]["capacity_from"] == "store", st["usage"]
        assert st["usage"]["eviction_by"] == "store" and not st["usage"]["global_eviction"], st["usage"]
        assert st["store_stats"]["put_failed"] == 0 and st["errors"] == {}, st
    for text in doc["describe"]:
        used, shown = described(text)  # two decimals of MB
        assert abs(shown - capacity) < 0.01 * (1 << 20) and lowest - 0.01 * (1 << 20) <= used <= capacity, text
    assert doc["newest_hits"] == [[2, 2], [2, 2]]  # the store evicted older chunks, not the newest


def share(params: dict, workdir: Path, seqs: int = 2, fill_seqs: int = 0) -> dict:
    """Server A (``skip_l1``) stores ``seqs`` sequences; server B, another process over the
    same store, retrieves them. Returns checksums and both adapters' status (``a_empty``:
    A's before any store, with its ``lmcache describe``). ``fill_seqs``: then ``fill``."""
    a = Server(params, workdir / "a.log", "--l2-store-policy", "skip_l1")
    b = Server(params, workdir / "b.log")
    out: dict = {"seconds": {}}
    ca = cb = None
    t0 = time.monotonic()
    try:
        a.wait_healthy()
        b.wait_healthy()
        out["seconds"]["start"] = round(time.monotonic() - t0, 2)
        # both see the whole store (a pool node joins the others' views within heartbeats)
        wait_for(lambda: a.adapter_status()["max_capacity_bytes"] == b.adapter_status()["max_capacity_bytes"], 20,
                 "the same capacity on both servers")
        out["a_empty"], out["describe_empty"] = a.adapter_status(), a.describe()
        ca, cb = EngineClient(a), EngineClient(b)
        out["stored"] = {seq: ca.store_sequence(seq) for seq in range(seqs)}
        wait_for(lambda: a.adapter_status()["store_stats"]["put_written"] >= 2 * seqs, 30, "A's L2 stores")
        out["b_hits"] = {seq: list(cb.hit_chunks(seq)) for seq in range(seqs)}
        out["retrieved"] = {seq: cb.retrieve_sequence(seq) for seq in range(seqs)}
        # A's writes show in B's figures within a second or so (each figure is reused for a while)
        wait_for(lambda: a.adapter_status()["current_size_bytes"] == b.adapter_status()["current_size_bytes"], 5,
                 "B's figures to show A's writes")
        out["a_status"], out["b_status"] = a.adapter_status(), b.adapter_status()
        out["seconds"]["share"] = round(time.monotonic() - t0, 2)
        if fill_seqs:
            out["fill"] = fill(a, b, ca, cb, fill_seqs)
            out["seconds"]["fill"] = round(time.monotonic() - t0, 2)
    finally:
        for c in (ca, cb):
            if c is not None:
                c.close()
        for s in (a, b):
            s.interrupt()
        out["exit_codes"] = [a.stop(), b.stop()]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    sh = sub.add_parser("share")
    sh.add_argument("--params", required=True, help="adapter_params JSON")
    sh.add_argument("--out", required=True)
    sh.add_argument("--fill", type=int, default=0, help="then sequences each server stores past capacity")
    args = p.parse_args(argv)
    out_path = Path(args.out)
    try:
        result = share(json.loads(args.params), out_path.parent, fill_seqs=args.fill)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}"}
    out_path.write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
