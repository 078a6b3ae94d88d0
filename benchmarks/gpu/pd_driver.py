#!/usr/bin/env python3
"""PD-disaggregation driver (stdlib only): TTFT and throughput through one prefill and one decode server.

It is its own minimal router, as SGLang's mini load balancer does: every request goes to the
prefill server and to the decode server at once, both carrying the same ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` (the room pairs the two halves); the decode server's
streamed answer is the client's. TTFT = time from sending until decode's first streamed chunk.

  pd_driver.py --prefill URL --decode URL --bootstrap-port 8998 --tokens 8192 --levels 1,8,32 \
      --new-tokens 8 --out results.jsonl --tag pd:kvc_peer_rdma

Per level (concurrency c) it sends c fresh prompts at once (after one warm-up request) and
writes one JSON line per request (ttft, e2e, output_ids, prompt seed) and one per wave (wall
time, input tokens/s, output tokens/s). Prompts are derived from seeds, so every transport
sees the same prompts and the output tokens can be compared across transports.
"""
import argparse
import concurrent.futures
import http.client
import json
import random
import time
import urllib.parse


def prompt(seed, n, vocab=32000):
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def post(url, body, stream, timeout):
    """POST JSON; returns (status, first_chunk_time or None, chunks, end_time)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    first, chunks = None, []
    if stream:
        for line in r:  # server-sent events: "data: {...}" lines
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            if first is None:
                first = time.perf_counter()
            chunks.append(json.loads(data))
    else:
        chunks.append(json.loads(r.read() or b"{}"))
    end = time.perf_counter()
    conn.close()
    return r.status, first, chunks, end


def one(args, seed, room):
    ids = prompt(seed, args.tokens)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 0,
                                                  "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": args.bootstrap_port, "bootstrap_room": room}
    t0 = time.perf_counter()
    errors = []
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        pf = ex.submit(post, args.prefill + "/generate", dict(body, stream=False), False, args.timeout)
        df = ex.submit(post, args.decode + "/generate", dict(body, stream=True), True, args.timeout)
        # a refused connection or a timeout fails this request, not the wave (and the levels after it)
        p_status = d_status = first = None
        chunks, end = [], None
        try:
            p_status = pf.result()[0]
        except Exception as e:  # noqa: BLE001
            errors.append(f"prefill: {type(e).__name__}: {e}")
        try:
            d_status, first, chunks, end = df.result()
        except Exception as e:  # noqa: BLE001
            errors.append(f"decode: {type(e).__name__}: {e}")
    end = end or time.perf_counter()
    last = chunks[-1] if chunks else {}
    out_ids = last.get("output_ids") or []
    meta = last.get("meta_info") or {}
    rec = {"seed": seed, "room": room, "prefill_status": p_status, "decode_status": d_status,
           "ttft_s": round(first - t0, 4) if first else None, "e2e_s": round(end - t0, 4),
           "output_ids": out_ids[: args.new_tokens], "completion_tokens": meta.get("completion_tokens"),
           "prompt_tokens": meta.get("prompt_tokens")}
    if errors:
        rec["error"] = "; ".join(errors)[:1000]
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--bootstrap-port", type=int, default=8998)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--deadline", type=float, default=0, help="epoch seconds: skip waves after it")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    args = ap.parse_args()
    rooms = random.Random(time.time_ns()).getrandbits(40) << 16
    with open(args.out, "a") as out:
        def emit(rec):
            out.write(json.dumps(dict(rec, tag=args.tag)) + "\n")
            out.flush()
            print(json.dumps(dict(rec, tag=args.tag, output_ids=rec.get("output_ids", [])[:2])), flush=True)

        emit(dict(one(args, 1, rooms), event="pd_warmup"))
        for w, c in enumerate(int(x) for x in args.levels.split(",")):
            if args.deadline and time.time() > args.deadline:
                emit({"event": "pd_skip", "concurrency": c})
                continue
            seeds = [1000 * c + i for i in range(c)]  # same prompts for every transport
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(c) as ex:
                res = list(ex.map(lambda s: one(args, s[1], rooms + 1000 * (w + 1) + s[0]), enumerate(seeds)))
            wall = time.perf_counter() - t0
            for r in res:
                emit(dict(r, event="pd_req", concurrency=c))
            ok = [r for r in res if r["decode_status"] == 200 and r["prefill_status"] == 200 and r["ttft_s"]]
            ttfts = sorted(r["ttft_s"] for r in ok)
            emit({"event": "pd_wave", "concurrency": c, "ok": len(ok), "n": c, "wall_s": round(wall, 4),
                  "ttft_median_s": ttfts[len(ttfts) // 2] if ttfts else None,
                  "ttft_max_s": ttfts[-1] if ttfts else None,
                  "input_tok_s": round(len(ok) * args.tokens / wall, 1),
                  "output_tok_s": round(sum(r["completion_tokens"] or 0 for r in ok) / wall, 1)})


if __name__ == "__main__":
    main()
