"""``"store": "peer_rdma"`` through kvconnect's SGLang HiCache adapter.

In a loopback network namespace: a memory-only node (``kvconnect peer serve``), then two
``kvconnect demo`` runs, each an engine process whose HiCache storage is built by SGLang's
own ``StorageBackendFactory`` ("dynamic" backend, ``KVConnectStorage``) over a real CPU host
pool, with the peer pool's option names. The engine nodes lend nothing
(``placement=owner``), so every page goes to and comes from the memory node one-sidedly;
the second engine loads the first one's pages and the demo checks every loaded byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from kvconnect.connectors.testing.netns import loopback_ns
from kvconnect.connectors.testing.peer import exec_in, skip_reason
from kvconnect.connectors.testing.processes import python, stop


def test_sglang_adapter_over_the_peer_pool(tmp_path):
    why = skip_reason("grpc", "mooncake", "sglang", "torch")
    if why:
        pytest.skip(why)
    tmp = str(tmp_path)
    with loopback_ns() as ns:
        ready = os.path.join(tmp, "ready")
        node = exec_in(ns, [python(), "-m", "kvconnect", "--log-level", "WARNING", "peer", "serve",
                            "--discovery-addr", "127.0.0.1:31998", "--global-segment-size", "256mb",
                            "--protocol", "rdma", "--auth-token", "t0k"],
                       stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "node.log"), "w"))
        try:
            deadline = time.monotonic() + 60
            while subprocess.run(ns.exec_prefix() + [python(), "-m", "kvconnect", "peer", "status",
                                  "127.0.0.1:31998", "--token", "t0k"], capture_output=True).returncode:
                assert node.poll() is None and time.monotonic() < deadline, open(os.path.join(tmp, "node.log")).read()
                time.sleep(0.5)
            # the peer-pool deployment guide's option names, as SGLang's extra config carries them
            opts = {"discovery_addr": "127.0.0.1:31998", "protocol": "rdma", "device_name": "",
                    "local_hostname": "127.0.0.1", "global_segment_size": "0", "placement": "owner",
                    "control_port": 0, "auth_token": "t0k"}
            figs = []
            for run in range(2):
                p = exec_in(ns, [python(), "-m", "kvconnect", "demo", "--store", "peer_rdma", "--store-options",
                                 json.dumps(opts), "--clients", "4", "--rounds", "2", "--groups", "2",
                                 "--prefix-tokens", "512", "--turn-tokens", "128", "--threads", "2", "--json",
                                 "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                out, err = p.communicate(timeout=240)
                assert p.returncode == 0, (out + err)[-3000:]
                figs.append(json.loads(out[out.index("{"):]))
            first, second = figs
            assert first["path"] == "sglang" and "KVConnectStorage" in first["description"]
            assert first["pages_stored"] > 0 and first["pages_store_failed"] == 0
            # the second engine finds every page of the first (all the same prompts) in the pool
            assert second["pages_loaded"] == second["pages_looked_up"] > 0
            assert second["pages_verified"] == second["pages_loaded"]
            st = second["store_stats"]["store"]
            assert st["extra"]["read_remote_hits"] >= second["pages_loaded"] and st["extra"]["members"] == 2
            assert second["store_stats"]["adapter_errors"] == {}
            status = json.loads(subprocess.run(ns.exec_prefix() + [python(), "-m", "kvconnect", "peer",
                                                "status", "127.0.0.1:31998", "--token", "t0k"],
                                               capture_output=True, text=True).stdout)
            assert status["pool_keys"] == first["pages_stored"]
        finally:
            stop(node)
