#!/usr/bin/env python3
"""TTFT driver (stdlib only) for SGLang servers started with --skip-tokenizer-init, HiCache and an L3 store.

Per measured item (a fresh random prompt of N tokens):
  cold -> GPU hit -> wait until L3 holds the prompt's pages -> POST /flush_cache -> L3 hit -> GPU hit again
Every request becomes one JSON line in --out with SGLang's meta_info (cached_tokens, cached_tokens_details,
e2e_latency) and, for kvconnect stores, the store's read counters scraped from its /metrics around the L3 hit
(seconds spent store -> host and bytes moved), so the L3 hit's time can be split.

Modes of waiting for the write-back to L3 (--wait):
  metrics:URL   kvconnect adapter's Prometheus endpoint: kvconnect_put_written_total grows by the pages
  files:DIR     SGLang's file backend: number of *.bin files grows by the pages
  tree:DIR      LMCache's fs L2 adapter: number of files under DIR (any depth, but *.tmp) grows by the chunks
  (--tokens-per-object: tokens per stored object, 64 for a HiCache page, 256 for an LMCache chunk)
  blocks:GLOB   SGLang's hf3fs backend (mock client): allocated bytes of its data files grow by the KV bytes

--lmcache-log PATH (lmcache_* stores): after each request, the lines the ``lmcache server`` logged for it
become an ``lmcache_breakdown`` event: its L2 -> L1 prefetch (keys found in L1 and in L2, milliseconds)
and its L1 -> GPU retrieve (tokens, seconds), so an LMCache hit's TTFT can be split.

Other commands:
  e2e_driver.py probe --url B --ids-from R --label L   replay a prompt recorded in R (cross-instance hit)
"""
import argparse
import glob
import json
import os
import random
import re
import time
import urllib.error
import urllib.request

PAGE = 64


def http(url, body=None, timeout=300, method=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def scrape(url):
    """Sum of kvconnect counters at a /metrics URL: {name: value}."""
    try:
        _, raw = http(url, timeout=10)
    except Exception:
        return {}
    out = {}
    for line in raw.decode().splitlines():
        m = re.match(r"^(kvconnect_[a-z_]+?)(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


PREFETCH = re.compile(r"Prefetch request completed \(L1\+L2\): (\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\) "
                      r"in ([0-9.]+) ms")
RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([0-9.]+) seconds")


class LMCacheLog:
    """What an ``lmcache server`` log gained since the last look: its prefetch and retrieve lines."""

    def __init__(self, path):
        self.path = path
        self.offset = os.path.getsize(path) if path and os.path.exists(path) else 0

    def new(self):
        if not self.path or not os.path.exists(self.path):
            return None
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            text = f.read().decode(errors="replace")
            self.offset = f.tell()
        pre = [m.groups() for m in PREFETCH.finditer(text)]
        ret = [m.groups() for m in RETRIEVED.finditer(text)]
        return {"prefetch_ms": [float(p[4]) for p in pre], "prefetch_keys_l1": sum(int(p[2]) for p in pre),
                "prefetch_keys_l2": sum(int(p[3]) for p in pre),
                "retrieved_tokens": sum(int(r[0]) for r in ret), "retrieve_s": [float(r[1]) for r in ret]}


class Driver:
    def __init__(self, a):
        self.a = a
        self.base = a.url.rstrip("/")
        self.lmcache_log = LMCacheLog(a.lmcache_log)

    def emit(self, obj):
        obj.setdefault("wall", round(time.time(), 3))
        obj.setdefault("tag", self.a.tag)
        line = json.dumps(obj)
        print(line[:400], flush=True)
        with open(self.a.out, "a") as f:
            f.write(line + "\n")

    def gen(self, label, ids, n, seed, extra=None):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        t0 = time.perf_counter()
        try:
            st, raw = http(self.base + "/generate", body)
            dt = time.perf_counter() - t0
            res = json.loads(raw)
            mi = res.get("meta_info", {}) if isinstance(res, dict) else {}
            keep = {k: mi.get(k) for k in ("prompt_tokens", "cached_tokens", "cached_tokens_details",
                                           "e2e_latency") if k in mi}
            rec = {"event": "gen", "label": label, "n": n, "seed": seed, "status": st,
                   "e2e_client_s": round(dt, 4), "meta": keep, "output_ids": res.get("output_ids")}
            rec.update(extra or {})
            self.emit(rec)
            self.emit_lmcache(label)
            return rec
        except urllib.error.HTTPError as e:
            self.emit({"event": "gen", "label": label, "n": n, "status": e.code, "error": e.read().decode()[:1000]})
        except Exception as e:  # noqa: BLE001
            self.emit({"event": "gen", "label": label, "n": n, "error": f"{type(e).__name__}: {e}"})
        return None

    def emit_lmcache(self, label):
        if not self.a.lmcache_log:
            return
        time.sleep(0.2)  # the server logs a retrieve after answering it
        got = self.lmcache_log.new()
        if got is not None:
            self.emit({"event": "lmcache_breakdown", "label": label, **got})

    def flush(self):
        # SGLang answers 400 while write-backs are still in flight: retry for up to ~40 s
        for attempt in range(40):
            try:
                st, raw = http(self.base + "/flush_cache", method="POST", timeout=60)
                if st == 200:
                    self.emit({"event": "flush", "status": st, "attempt": attempt})
                    return True
            except Exception as e:  # noqa: BLE001
                if attempt % 10 == 0:
                    self.emit({"event": "flush", "error": f"{type(e).__name__}: {e}", "attempt": attempt})
            time.sleep(1)
        return False

    # -- L3 progress -------------------------------------------------------------------
    def l3_progress(self):
        kind, _, arg = self.a.wait.partition(":")
        if kind == "metrics":
            return int(scrape(arg).get("kvconnect_put_written", 0))
        if kind == "files":
            return len(glob.glob(os.path.join(arg, "*.bin")))
        if kind == "tree":
            return sum(1 for _, _, names in os.walk(arg) for f in names if not f.endswith(".tmp"))
        if kind == "blocks":
            return sum(os.stat(f).st_blocks * 512 for f in glob.glob(arg)) // max(1, self.a.page_bytes)
        return 0

    def wait_l3(self, before, npages, timeout):
        t0 = time.time()
        prev, stable, now = None, 0, before
        while time.time() - t0 < timeout:
            now = self.l3_progress()
            stable = stable + 1 if now == prev else 0
            prev = now
            if now >= before + npages and stable >= 2:
                break
            time.sleep(0.25)
        ok = now >= before + npages
        self.emit({"event": "wait_l3", "before": before, "now": now, "want_new": npages,
                   "after_s": round(time.time() - t0, 2), "ok": ok})
        return ok

    def cycle(self, n, seed, prefix):
        rnd = random.Random(seed)
        ids = [rnd.randrange(1, self.a.vmax) for _ in range(n)]
        if self.a.record:
            with open(self.a.record, "a") as f:
                f.write(json.dumps({"prefix": prefix, "n": n, "seed": seed, "ids": ids}) + "\n")
        before = self.l3_progress()
        self.gen(f"{prefix}_1_cold", ids, n, seed)
        self.gen(f"{prefix}_2_gpu_hit", ids, n, seed)
        pages = (n - 1) // self.a.tokens_per_object
        # hf3fs ref stores K and V as separate objects: twice the objects of the page count
        want = pages * self.a.objects_per_page
        ok = self.wait_l3(before, want, self.a.wait_timeout * max(1.0, n / 8192))
        if not ok:
            self.emit({"event": "note", "msg": f"{prefix}: L3 write-back incomplete; flushing anyway"})
        if not self.flush():
            return
        time.sleep(1)
        m0 = scrape(self.a.metrics) if self.a.metrics else {}
        rec = self.gen(f"{prefix}_3_L3_hit", ids, n, seed)
        m1 = scrape(self.a.metrics) if self.a.metrics else {}
        if rec and m0 and m1:
            rec2 = {"event": "l3_breakdown", "label": f"{prefix}_3_L3_hit",
                    "store_get_s": round(m1.get("kvconnect_get_seconds", 0) - m0.get("kvconnect_get_seconds", 0), 4),
                    "store_get_bytes": m1.get("kvconnect_get_bytes", 0) - m0.get("kvconnect_get_bytes", 0),
                    "store_get_pages": m1.get("kvconnect_get_hits", 0) - m0.get("kvconnect_get_hits", 0)}
            self.emit(rec2)
        self.gen(f"{prefix}_4_gpu_hit_again", ids, n, seed)


def cmd_run(a):
    d = Driver(a)
    reps = {}
    for i, item in enumerate(x.strip() for x in a.plan.split(",")):
        if not item:
            continue
        if time.time() > a.deadline - (20 if int(item.lstrip("w")) <= 8192 else 35):
            d.emit({"event": "skip", "item": item, "left_s": round(a.deadline - time.time(), 1)})
            continue
        warm = item.startswith("w")
        n = int(item.lstrip("w"))
        seed = a.seed_base + 17 * i + n
        if warm:
            prefix = f"warmup_{n}"
            rnd = random.Random(seed)
            ids = [rnd.randrange(1, a.vmax) for _ in range(n)]
            d.gen(f"{prefix}_1_cold", ids, n, seed)
            continue
        reps[n] = reps.get(n, 0) + 1
        d.cycle(n, seed, f"{n}_r{reps[n]}")
    d.emit({"event": "driver_end"})


def cmd_replay(a):
    """Send prompts recorded by another server's run (cross-instance or after-restart L3 hits)."""
    d = Driver(a)
    with open(a.ids_from) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # fresh prompts first: the first requests after a start pay one-time costs a replayed hit should not
    for i in range(a.cold_first if rows else 0):
        n, seed = rows[0]["n"], -1 - i   # negative: no recorded prompt's seed
        rnd = random.Random(seed)
        d.gen(f"{n}_{a.label}_cold_first_{i + 1}", [rnd.randrange(1, a.vmax) for _ in range(n)], n, seed)
    for r in rows:
        if time.time() > a.deadline - 15:
            d.emit({"event": "skip", "item": r["prefix"]})
            continue
        m0 = scrape(a.metrics) if a.metrics else {}
        rec = d.gen(f"{r['n']}_{a.label}", r["ids"], r["n"], r["seed"])
        m1 = scrape(a.metrics) if a.metrics else {}
        if rec and m0 and m1:
            d.emit({"event": "l3_breakdown", "label": f"{r['n']}_{a.label}",
                    "store_get_s": round(m1.get("kvconnect_get_seconds", 0) - m0.get("kvconnect_get_seconds", 0), 4),
                    "store_get_bytes": m1.get("kvconnect_get_bytes", 0) - m0.get("kvconnect_get_bytes", 0)})
        d.gen(f"{r['n']}_{a.label}_gpu_hit", r["ids"], r["n"], r["seed"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "replay"):
        s = sub.add_parser(name)
        s.add_argument("--url", default="http://127.0.0.1:30000")
        s.add_argument("--out", required=True)
        s.add_argument("--tag", required=True, help="store/model/phase tag kept on every line")
        s.add_argument("--deadline", type=float, required=True, help="epoch seconds")
        s.add_argument("--metrics", default="", help="kvconnect /metrics URL for the L3 time breakdown")
        s.add_argument("--lmcache-log", default="", help="the lmcache server's log, for its per-request breakdown")
        s.add_argument("--vmax", type=int, default=120000)
        if name == "run":
            s.add_argument("--plan", required=True, help="e.g. w8192,8192,16384")
            s.add_argument("--wait", default="none", help="metrics:URL | files:DIR | tree:DIR | blocks:GLOB")
            s.add_argument("--tokens-per-object", type=int, default=PAGE,
                           help="tokens per object the wait counts (64: a HiCache page; 256: an LMCache chunk)")
            s.add_argument("--page-bytes", type=int, default=1, help="for blocks: bytes per stored object")
            s.add_argument("--objects-per-page", type=int, default=1)
            s.add_argument("--wait-timeout", type=float, default=30.0, help="seconds for 8k tokens")
            s.add_argument("--seed-base", type=int, default=1000)
            s.add_argument("--record", default="", help="append the measured prompts' ids here")
        else:
            s.add_argument("--ids-from", required=True)
            s.add_argument("--label", required=True)
            s.add_argument("--cold-first", type=int, default=0,
                           help="send this many fresh prompts (of the first recorded length) before replaying")
    a = p.parse_args()
    (cmd_run if a.cmd == "run" else cmd_replay)(a)


if __name__ == "__main__":
    main()
