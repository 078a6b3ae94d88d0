"""One "engine" of the one-machine example: SGLang's HiCache storage path over a real CPU
host pool, with kvconnect's SGLang adapter and the ``peer_rdma`` store.

It serves the requests the router hands it (JSON lines on stdin) the way SGLang's cache
controller does (``kvconnect.connectors.workload.serve_request``: exists, load the hit prefix, verify
every byte, prefill and write back the rest) and answers with the totals. No GPU and no
model weights are needed: the "prefill" writes bytes derived from the page hash.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--store-options", required=True, help="JSON: the peer_rdma options of this node")
    p.add_argument("--workload", required=True, help="JSON: Workload(...) arguments")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--model-shape", default="tiny")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kvconnect.connectors.workload import (SHAPES, PageContent, SGLangPath, Totals, Workload, page_hasher,
                                                   serve_request)

        shape = SHAPES[a.model_shape]
        wl = Workload(**json.loads(a.workload))
        hasher, _ = page_hasher(True)
        max_pages = len(wl.prompt(0, wl.rounds - 1)) // a.page_size
        opts = json.loads(a.store_options)
        path = SGLangPath(shape, "page_first", a.page_size, a.threads * max_pages + 1, "peer_rdma", opts)
    content = PageContent(path.max_segment)
    node = path.backend.store.node
    print(json.dumps({"ready": node.node_id}), flush=True)
    pool = ThreadPoolExecutor(a.threads)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "round" in cmd:
            r = cmd["round"]
            # the router's round robin: conversation c goes to node (c + r) % nodes in round r,
            # so every turn lands on a different node than the turn before
            mine = [c for c in range(wl.clients) if (c + r) % a.nodes == a.index]

            def one(c: int) -> Totals:
                toks = wl.prompt(c, r)
                return serve_request(path, content, hasher(toks, a.page_size), len(toks), f"node{a.index}")

            total = Totals()
            for t in pool.map(one, mine):
                total.add(t)
            print(json.dumps({"requests": total.requests, "pages": total.pages_looked_up,
                              "loaded": total.pages_loaded, "verified": total.pages_verified,
                              "stored": total.pages_stored}), flush=True)
        elif "metrics" in cmd:
            url = f"http://{opts['metrics_host']}:{opts['metrics_port']}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            print(json.dumps({"metrics": text}), flush=True)
        else:
            break
    pool.shutdown()
    path.close()


if __name__ == "__main__":
    main()
