"""The three loads, as token-id prompts with arrival times (open loop) or chat sessions (closed loop).

- W1 ``shared_prefix``: what ``python -m sglang.bench_serving --dataset-name generated-shared-prefix``
  builds (the peer-pool deployment guide's load): ``groups`` system prompts of ``system_len`` random
  tokens, ``per_group`` questions of ``question_len`` tokens each, shuffled, Poisson arrivals at
  ``rate`` requests/s, ``output_len`` tokens out.
- W2 ``multi_turn``: the HF3FS deployment guide's multi-turn load (SGLang's ``bench_multiturn``
  shape): ``clients`` chats of ``rounds`` turns; each turn sends the previous prompt, the previous
  answer and ``request_len`` new tokens; at most ``max_parallel`` chats in flight.
- W3 ``trace``: a replay of the Mooncake conversation trace (``data/``): every 512-token block id
  becomes a fixed block of ``block_tokens`` token ids, so requests that share block ids share exact
  token prefixes; arrivals follow the trace's timestamps divided by ``time_scale``; a sample of the
  conversations (by their first own block) keeps whole conversations, so their reuse stays.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from .model import PROMPT_VOCAB

TRACE_PATH = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"
TRACE_BLOCK_TOKENS = 512


@dataclass
class Request:
    """One open-loop request: ``prompt`` token ids sent ``at`` seconds after the run starts."""
    rid: str
    at: float
    prompt: list[int]
    max_new_tokens: int
    group: str = ""


@dataclass
class Session:
    """One closed-loop chat: ``turns`` new-token chunks, each answered before the next is sent."""
    sid: str
    turns: list[list[int]]
    max_new_tokens: int


@dataclass
class Workload:
    name: str
    params: dict
    requests: list[Request] = field(default_factory=list)   # open loop (W1, W3)
    sessions: list[Session] = field(default_factory=list)   # closed loop (W2)
    max_parallel: int = 0                                    # sessions in flight (W2)
    rate: float = 0.0                                        # W2: turns/s across the load (0: unpaced)

    def turn_arrivals(self) -> list[float]:
        """Earliest send times of a chat load's turns, in the order turns become ready (Poisson)."""
        if not self.rate:
            return []
        return _poisson_times(random.Random(self.params.get("seed", 0) + 17), self.size, self.rate)

    @property
    def prompt_tokens_mean(self) -> float:
        """Mean prompt length a request of this load sends (a chat turn carries its history and answers)."""
        if self.requests:
            return sum(len(r.prompt) for r in self.requests) / len(self.requests)
        lens = []
        for s in self.sessions:
            history = 0
            for turn in s.turns:
                history += len(turn)
                lens.append(history)
                history += s.max_new_tokens
        return sum(lens) / len(lens) if lens else 0.0

    @property
    def size(self) -> int:
        return len(self.requests) or sum(len(s.turns) for s in self.sessions)

    def sample(self, n: int) -> list[list[int]]:
        """Up to ``n`` prompts spread over the workload, for the output-equality check."""
        if self.requests:
            prompts = [r.prompt for r in sorted(self.requests, key=lambda r: r.rid)]
        else:
            prompts = [[t for turn in s.turns[:1] for t in turn] for s in self.sessions]
        step = max(1, len(prompts) // max(1, n))
        return prompts[::step][:n]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, PROMPT_VOCAB) for _ in range(n)]


def _poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if rate > 0 and math.isfinite(rate) else 0.0
    return out


def shared_prefix(groups: int = 64, per_group: int = 16, system_len: int = 2048, question_len: int = 128,
                  output_len: int = 256, rate: float = 8.0, prefetch_policy: str = "", seed: int = 1) -> Workload:
    rng = random.Random(seed)
    systems = [_tokens(rng, system_len) for _ in range(groups)]
    rows = [(g, p, systems[g] + _tokens(rng, question_len)) for g in range(groups) for p in range(per_group)]
    rng.shuffle(rows)
    times = _poisson_times(rng, len(rows), rate)
    reqs = [Request(f"w1-g{g:03d}-p{p:03d}", at, prompt, output_len, group=f"g{g}")
            for (g, p, prompt), at in zip(rows, times)]
    return Workload("w1", dict(groups=groups, per_group=per_group, system_len=system_len,
                               question_len=question_len, output_len=output_len, rate=rate,
                               prefetch_policy=prefetch_policy, seed=seed),
                    requests=reqs)


def multi_turn(clients: int = 20, rounds: int = 10, request_len: int = 2048, output_len: int = 16,
               max_parallel: int = 4, rate: float = 20.0, prefetch_policy: str = "wait_complete",
               seed: int = 2) -> Workload:
    """Defaults: Mooncake's published ``bench_multiturn`` flags for the HF3FS guide's load
    (``--output-length 16 --request-length 2048 --num-clients 20 --num-rounds 10 --max-parallel 4
    --request-rate 20``), servers prefetching with ``wait_complete``."""
    rng = random.Random(seed)
    sessions = [Session(f"w2-c{c:03d}", [_tokens(rng, request_len) for _ in range(rounds)], output_len)
                for c in range(clients)]
    return Workload("w2", dict(clients=clients, rounds=rounds, request_len=request_len, output_len=output_len,
                               max_parallel=max_parallel, rate=rate, prefetch_policy=prefetch_policy, seed=seed),
                    sessions=sessions, max_parallel=max_parallel, rate=rate)


def read_trace(path: Path = TRACE_PATH) -> Iterator[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def conversation_of(row: dict) -> int:
    """The block id that names a request's conversation: its first block after the shared first one."""
    ids = row["hash_ids"]
    return ids[1] if len(ids) > 1 else ids[0]


def trace(sample_every: int = 80, block_tokens: int = 128, time_scale: float = 60.0, max_output: int = 64,
          limit: int = 0, path: Optional[Path] = None, seed: int = 3) -> Workload:
    """Replay the trace: conversations with ``crc32(id) % sample_every == 0``, time / ``time_scale``."""
    blocks: dict[int, list[int]] = {}

    def block(bid: int) -> list[int]:
        if bid not in blocks:
            blocks[bid] = _tokens(random.Random(seed * 1_000_003 + bid), block_tokens)
        return blocks[bid]

    reqs: list[Request] = []
    t0 = None
    for n, row in enumerate(read_trace(path or TRACE_PATH)):
        if zlib.crc32(str(conversation_of(row)).encode()) % sample_every:
            continue
        t0 = row["timestamp"] if t0 is None else t0
        length = max(1, math.ceil(row["input_length"] * block_tokens / TRACE_BLOCK_TOKENS))
        prompt = [t for b in row["hash_ids"] for t in block(b)][:length]
        reqs.append(Request(f"w3-{n:05d}", (row["timestamp"] - t0) / 1000.0 / time_scale, prompt,
                            max(1, min(int(row["output_length"]), max_output)),
                            group=f"c{conversation_of(row)}"))
        if limit and len(reqs) >= limit:
            break
    return Workload("w3", dict(sample_every=sample_every, block_tokens=block_tokens, time_scale=time_scale,
                               max_output=max_output, limit=limit, seed=seed,
                               source="Mooncake FAST'25 conversation trace (Apache-2.0)"),
                    requests=reqs)


def prefix_reuse(workload: Workload, page: int = 64) -> float:
    """Share of prompt pages an unbounded prefix cache could serve (the most any cache can save)."""
    return prefix_hits(workload, page)[0]


def prefix_hits(workload: Workload, page: int = 64, servers: int = 1, cache_tokens: int = 0) -> tuple:
    """(ceiling, kept): the share of prompt pages an unbounded shared cache could serve, and the share
    that ``servers`` caches of ``cache_tokens`` each (LRU, requests round-robin in arrival order, as
    the router sends them) would keep: a model of the baseline's GPU + host caches, so ``ceiling -
    kept`` is the room a shared L3 has on this load. Open-loop loads only (a chat's prompts depend on
    its answers)."""
    from collections import OrderedDict

    seen: set = set()
    caches = [OrderedDict() for _ in range(max(1, servers))]
    limit = cache_tokens // page if cache_tokens else 0
    hit = kept = total = 0
    for n, r in enumerate(sorted(workload.requests, key=lambda r: r.at)):
        cache = caches[n % len(caches)]
        key, shared, local = 0, True, True
        for i in range(len(r.prompt) // page):
            key = hash((key, tuple(r.prompt[i * page: (i + 1) * page])))  # chained, like SGLang's page keys
            shared = shared and key in seen
            local = local and key in cache
            hit += shared
            kept += local
            seen.add(key)
            cache[key] = True
            cache.move_to_end(key)
        while limit and len(cache) > limit:
            cache.popitem(last=False)
        total += len(r.prompt) // page
    return (hit / total, kept / total) if total else (0.0, 0.0)


def capacity_sample(workload: Workload, requests: int) -> Workload:
    """What the capacity probe sends: the first ``requests`` requests of an open-loop load all at
    once (a saturating burst), or the first chats of a chat load unpaced (closed loop at its own
    ``max_parallel``); the servers' served prompt tokens/s under it is their capacity for this load."""
    if workload.requests:
        reqs = [Request(r.rid, 0.0, r.prompt, r.max_new_tokens, r.group) for r in workload.requests[:requests]]
        return Workload(workload.name, {**workload.params, "capacity_probe": True}, requests=reqs)
    sessions, turns = [], 0
    for s in workload.sessions:
        if turns >= requests and len(sessions) >= workload.max_parallel:
            break
        sessions.append(s)
        turns += len(s.turns)
    return Workload(workload.name, {**workload.params, "capacity_probe": True}, sessions=sessions,
                    max_parallel=workload.max_parallel)


def at_load(workload: Workload, input_tps: float) -> Workload:
    """The same load (same prompts, same order) offered at ``input_tps`` prompt tokens/s."""
    rate = input_tps / workload.prompt_tokens_mean
    return from_params(workload.name, {**workload.params, "rate": round(rate, 4)})


def from_params(name: str, params: dict) -> Workload:
    """Rebuild a workload from the ``params`` a run recorded (loads are deterministic)."""
    import inspect

    build = {"w1": shared_prefix, "w2": multi_turn, "w3": trace}[name]
    accepted = inspect.signature(build).parameters
    return build(**{k: v for k, v in params.items() if k in accepted})
