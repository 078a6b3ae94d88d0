"""The four-node peer-pool demo on one machine: four network namespaces, one bridge.

Each namespace holds one "engine" (``engine.py``: SGLang's HiCache storage path over a real
CPU host pool, kvconnect's SGLang adapter, the ``peer_rdma`` store; no GPU or model needed)
with its own address 10.77.0.<i>. This script is the router: each round it hands every
conversation of a generated-shared-prefix workload (groups sharing a long system prompt)
to a different node than the round before, so nodes must load each other's prefix KV from
the pool. At the end it prints the counters the peer-pool deployment guide checks, per node, from each
node's Prometheus endpoint, and removes the namespaces.

    sudo .venv/bin/python examples/peer_rdma/one_machine.py [--rounds 4] [--passes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvconnect.connectors.testing.netns import Bridge, netns_available  # noqa: E402

SERIES = ("members", "write_requests", "read_requests", "read_hits", "read_remote_hits", "bytes_read",
          "pool_keys", "read_timeouts", "read_failures")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--groups", type=int, default=4, help="--gsp-num-groups")
    p.add_argument("--clients", type=int, default=16, help="conversations (prompts per round)")
    p.add_argument("--prefix-tokens", type=int, default=2048, help="--gsp-system-prompt-len")
    p.add_argument("--turn-tokens", type=int, default=128, help="--gsp-question-len")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=2, help="run the same workload again (cluster-warm)")
    p.add_argument("--segment", default="512mb", help="global_segment_size per node")
    args = p.parse_args(argv)
    why = netns_available()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    token = os.urandom(8).hex()
    workload = json.dumps({"groups": args.groups, "clients": args.clients, "rounds": args.rounds,
                           "prefix_tokens": args.prefix_tokens, "turn_tokens": args.turn_tokens})
    procs = []
    with Bridge(args.nodes, net=0) as net:
        try:
            seeds = ",".join(f"{a}:31998" for a in net.addrs[:2])
            for i, (ns, addr) in enumerate(zip(net.names, net.addrs)):
                opts = {"discovery_addr": seeds, "protocol": "rdma", "local_hostname": addr, "bind_host": addr,
                        "global_segment_size": args.segment, "auth_token": token,
                        "metrics_port": 31997, "metrics_host": addr}
                env = dict(os.environ, PYTHONPATH=str(ROOT), GLOG_minloglevel="2", LMCACHE_TRACK_USAGE="false")
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).with_name("engine.py")),
                     "--index", str(i), "--nodes", str(args.nodes), "--store-options", json.dumps(opts),
                     "--workload", workload], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env=env, bufsize=1))
            for i, pr in enumerate(procs):
                line = pr.stdout.readline()
                if not line:
                    raise RuntimeError(f"node {i} failed to start")
                print(f"node {i + 1} up: {json.loads(line)['ready']}")
            time.sleep(2)  # heartbeats: let every node see all four
            for ps in range(args.passes):
                for r in range(args.rounds):
                    for pr in procs:
                        pr.stdin.write(json.dumps({"round": r}) + "\n")
                    reps = [json.loads(pr.stdout.readline()) for pr in procs]
                    pages = sum(x["pages"] for x in reps)
                    loaded = sum(x["loaded"] for x in reps)
                    print(f"pass {ps + 1} round {r + 1}: {sum(x['requests'] for x in reps)} requests, "
                          f"{loaded}/{pages} pages loaded from the pool ({100 * loaded / max(pages, 1):.0f}%), "
                          f"all verified byte-exact, {sum(x['stored'] for x in reps)} written")
            print()
            print(f"{'node':<14}" + "".join(f"{s:>18}" for s in SERIES))
            for i, pr in enumerate(procs):
                pr.stdin.write(json.dumps({"metrics": True}) + "\n")
                text = json.loads(pr.stdout.readline())["metrics"]
                row = []
                for s in SERIES:
                    suffix = "" if s in ("members", "pool_keys") else "_total"
                    m = re.search(rf"^kvconnect_peer_{s}{suffix}{{[^}}]*}} (\S+)$", text, re.M)
                    row.append(f"{float(m.group(1)):>18.0f}" if m else f"{'-':>18}")
                print(f"{net.addrs[i]:<14}" + "".join(row))
        finally:
            for pr in procs:
                try:
                    pr.stdin.write("{}\n")
                    pr.stdin.close()
                    pr.wait(30)
                except Exception:  # noqa: BLE001
                    pr.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
