"""Asyncio load driver: streams SGLang's ``/generate`` (directly or through ``sglang_router``).

TTFT is the time from sending a request to the first streamed chunk that carries an output token,
as ``sglang.bench_serving`` measures it. Every request becomes a ``Result`` with SGLang's own
``meta_info`` counts (prompt, cached, and where cached tokens came from: device, host, storage).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from .model import ids_to_text, text_to_ids
from .workloads import Workload


@dataclass
class Result:
    rid: str
    sent: float = 0.0                 # seconds after the run started
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_from: dict = field(default_factory=dict)   # device / host / storage tokens
    output: str = ""

    def row(self, keep_output: bool = False) -> dict:
        d = asdict(self)
        if not keep_output:
            d.pop("output")
        return d


def _cached_from(meta: dict) -> dict:
    details = meta.get("cached_tokens_details") or {}
    return {k: int(details[k]) for k in ("device", "host", "storage") if isinstance(details.get(k), (int, float))}


async def generate(session, url: str, prompt: list[int], max_new_tokens: int, rid: str,
                   timeout_s: float = 600.0) -> Result:
    """One streamed request; any failure is recorded in the Result, never raised."""
    import aiohttp

    res = Result(rid)
    body = {"text": ids_to_text(prompt), "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    t0 = time.perf_counter()
    last: Optional[dict] = None
    try:
        async with session.post(f"{url}/generate", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = event.strip()
                    if not data.startswith(b"data:"):
                        continue
                    data = data[5:].strip()
                    if data == b"[DONE]":
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = str(obj["error"])[:200]
                        return res
                    meta = obj.get("meta_info") or {}
                    if not res.ttft and (meta.get("completion_tokens", 0) >= 1 or obj.get("text")):
                        res.ttft = time.perf_counter() - t0
                    last = obj
    except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.latency = time.perf_counter() - t0
    if last is None:
        res.error = "empty stream"
        return res
    meta = last.get("meta_info") or {}
    res.prompt_tokens = int(meta.get("prompt_tokens", len(prompt)))
    res.completion_tokens = int(meta.get("completion_tokens", 0))
    res.cached_tokens = int(meta.get("cached_tokens", 0))
    res.cached_from = _cached_from(meta)
    res.output = (last.get("text") or "").strip()
    res.ok = res.completion_tokens >= 1 and res.ttft > 0
    if not res.ok:
        res.error = f"no output token (completion_tokens={res.completion_tokens})"
    return res


async def _drive(url: str, workload: Workload, progress: Optional[Callable[[], None]], timeout_s: float,
                 connections: int) -> list[Result]:
    import aiohttp

    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as session:
        start = loop.time()

        async def sent(res: Result, t: float) -> Result:
            res.sent = t - start
            if progress:
                progress()
            return res

        async def one(r) -> Result:
            delay = start + r.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            t = loop.time()
            return await sent(await generate(session, url, r.prompt, r.max_new_tokens, r.rid, timeout_s), t)

        async def chat(s, gate: asyncio.Semaphore) -> list[Result]:
            out, history = [], []
            async with gate:
                for k, turn in enumerate(s.turns):
                    prompt = history + turn
                    delay = start + next(arrivals, 0.0) - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    t = loop.time()
                    res = await sent(await generate(session, url, prompt, s.max_new_tokens, f"{s.sid}-t{k}",
                                                    timeout_s), t)
                    out.append(res)
                    history = prompt + text_to_ids(res.output)
            return out

        if workload.requests:
            return list(await asyncio.gather(*(one(r) for r in workload.requests)))
        gate = asyncio.Semaphore(max(1, workload.max_parallel))
        # a rate on a chat load paces its turns: turn i of the whole load goes no earlier than the
        # i-th arrival of a Poisson stream at ``rate``, and never before its chat's previous answer
        arrivals = iter(workload.turn_arrivals())
        chats = await asyncio.gather(*(chat(s, gate) for s in workload.sessions))
        return [r for c in chats for r in c]


def run(url: str, workload: Workload, desc: str = "", timeout_s: float = 600.0,
        connections: int = 2048) -> tuple[list[Result], float]:
    """Drive ``workload`` against ``url``; returns the results and the wall time of the run."""
    from tqdm import tqdm

    bar = tqdm(total=workload.size, desc=desc or workload.name, unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()
    try:
        results = asyncio.run(_drive(url, workload, lambda: bar.update(1), timeout_s, connections))
    finally:
        bar.close()
    return results, time.perf_counter() - t0


def probe(urls: list[str], prompts: list[list[int]], max_new_tokens: int = 16,
          timeout_s: float = 300.0) -> list[Result]:
    """Send ``prompts`` one at a time, alternating over ``urls``: an idle server, so outputs are exact."""
    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as session:
            return [await generate(session, urls[i % len(urls)], p, max_new_tokens, f"probe-{i}", timeout_s)
                    for i, p in enumerate(prompts)]
    return asyncio.run(go())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def offered(results) -> dict:
    """The load as sent: the arrival span and the prompt tokens per second it offered.

    An open-loop run cannot take in more than it is offered, so ``offered_input_tps`` over the
    baseline's ``input_tps`` bounds every configuration's throughput ratio.
    """
    rows = [r if isinstance(r, dict) else asdict(r) for r in results]
    span = max((r["sent"] for r in rows), default=0.0)
    tokens = sum(r["prompt_tokens"] for r in rows if r["ok"])
    return {"arrival_span_s": span, "offered_input_tps": tokens / span if span > 0 else 0.0}


# Where a request's prefix came from, by SGLang's own per-request counts (``cached_tokens_details``):
# any page from L3 makes it an L3 hit, else any from the host pool a host (L2) hit, else any on the GPU.
SOURCES = ("gpu", "host", "l3", "recomputed")


def source_of(cached_from: dict) -> str:
    if cached_from.get("storage", 0) > 0:
        return "l3"
    if cached_from.get("host", 0) > 0:
        return "host"
    return "gpu" if cached_from.get("device", 0) > 0 else "recomputed"


def ttft_by_source(results) -> dict:
    """TTFT of the successful requests split by where their prefix came from (``SOURCES``)."""
    rows = [r if isinstance(r, dict) else asdict(r) for r in results]
    groups: dict = {}
    for r in rows:
        if r["ok"]:
            groups.setdefault(source_of(r.get("cached_from") or {}), []).append(r)
    out = {}
    for src in SOURCES:
        g = groups.get(src, [])
        if g:
            t = [r["ttft"] for r in g]
            out[src] = {"requests": len(g), "ttft_p50_s": percentile(t, 50), "ttft_p90_s": percentile(t, 90),
                        "ttft_mean_s": statistics.fmean(t),
                        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in g),
                        "cached_tokens_mean": statistics.fmean(r["cached_tokens"] for r in g)}
    return out


def summarize(results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    span = max((r.sent + r.latency for r in ok), default=wall_s)
    cached = {k: sum(r.cached_from.get(k, 0) for r in ok) for k in ("device", "host", "storage")}
    return {**offered(results),
        "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99), "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "latency_p50_s": percentile([r.latency for r in ok], 50),
        "duration_s": span, "input_tokens": prompt,
        "input_tps": prompt / span if span > 0 else 0.0,
        "output_tps": sum(r.completion_tokens for r in ok) / span if span > 0 else 0.0,
        "cached_tokens": sum(r.cached_tokens for r in ok), "cached_from": cached,
        "storage_hit_share": cached["storage"] / prompt if prompt else 0.0,
        "ttft_by_source": ttft_by_source(results),
    }
