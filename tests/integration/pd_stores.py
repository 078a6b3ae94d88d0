"""Store services for the PD relay transports (tests and ``benchmarks/pd.py``).

* ``mooncake``: a real ``mooncake_master`` plus a segment-holder process (the seed's
  standalone store service) inside a loopback-only network namespace
  (``kvconnect.connectors.mooncake.testing.MooncakeCluster``); PD processes are clients that
  contribute no memory.
* ``hf3fs``: the real kvconnect HF3FS metadata service (``kvconnect hf3fs-meta serve``,
  gRPC) in the same namespace, data files in a temporary directory (POSIX client: there is
  no 3FS mount here).

``store_service(name, ...)`` yields ``(netns, store_options, outage)``: ``outage()`` kills the
backend (master / metadata service) for the store-outage tests.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class StoreUnavailable(Exception):
    """The store's service cannot run here (reason in the message)."""


@contextlib.contextmanager
def mooncake_service(segment: str = "1gb") -> Iterator[tuple[object, dict, Callable[[], None]]]:
    try:
        from kvconnect.connectors.mooncake.testing import MooncakeCluster, netns_supported
    except ImportError as e:
        raise StoreUnavailable(f"kvconnect.connectors.mooncake.testing: {e}") from e
    ok, why = netns_supported()
    if not ok:
        raise StoreUnavailable(why)
    cluster = MooncakeCluster(lease_ttl_ms=2000)  # reads on a loaded 2-core machine can take a while
    try:
        cluster.start_holder(segment)
        opts = {"master_server_address": cluster.master.address, "protocol": "tcp",
                "local_hostname": "127.0.0.1", "global_segment_size": 0, "local_buffer_size": 0,
                "setup_timeout": 10, "op_timeout": 5, "lease_wait": 0.5}

        def outage() -> None:
            cluster.master.kill()
            for p in cluster.holders:
                with contextlib.suppress(Exception):
                    p.kill()

        yield cluster.netns, opts, outage
    finally:
        cluster.close()


@contextlib.contextmanager
def hf3fs_service(workdir: str, ns: object | None = None,
                  file_size: str = "1gb") -> Iterator[tuple[object, dict, Callable[[], None]]]:
    from kvconnect.connectors.engines.sglang_pd_testing import loopback_netns

    with contextlib.ExitStack() as stack:
        ns = ns or stack.enter_context(loopback_netns())
        data = os.path.join(workdir, "hf3fs")
        os.makedirs(os.path.join(data, "meta"), exist_ok=True)
        ready = os.path.join(data, "ready")
        port = 18000 + os.getpid() % 1000
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        cmd = ns.exec_prefix() + [sys.executable, "-m", "kvconnect.connectors.cli", "hf3fs-meta", "serve", "--host", "127.0.0.1",
                                  "--port", str(port), "--data-dir", os.path.join(data, "meta"), "--ready-file", ready,
                                  "--workers", "4"]
        log = open(os.path.join(data, "meta.log"), "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(ready):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise StoreUnavailable("hf3fs metadata service did not start: "
                                           + open(os.path.join(data, "meta.log")).read()[-2000:])
                time.sleep(0.1)
            opts = {"file_path_prefix": os.path.join(data, "pd"), "file_size": file_size, "numjobs": 2, "entries": 16,
                    "metadata_server_url": f"127.0.0.1:{port}", "client": "posix", "client_timeout": 5,
                    "meta_retries": 2}

            def outage() -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(10)

            yield ns, opts, outage
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(10)
            log.close()


@contextlib.contextmanager
def store_service(name: str, workdir: str, ns: object | None = None, segment: str = "1gb"):
    if name == "mooncake":
        with mooncake_service(segment) as out:
            yield out
    elif name == "hf3fs":
        with hf3fs_service(workdir, ns, file_size=segment) as out:
            yield out
    else:
        raise ValueError(f"no store service for {name!r}")
