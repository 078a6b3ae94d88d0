"""The CPU stand-in for ``sglang.launch_server`` (``launch_server``) as a test process, and the small
pieces the GPU scripts' CPU tests share: free port ranges, POSTs that may be refused."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from kvconnect.connectors.testing.processes import child_env, wait_for

MODULE = "kvconnect.connectors.testing.launch_server"
PAGE = 64  # run_e2e.sh's --page-size


def free_offset(ports: list[int], seed: int) -> int:
    """An offset that makes every one of ``ports`` free on 127.0.0.1 (below 65536)."""
    rnd = random.Random(seed * 7919 + os.getpid())
    for _ in range(200):
        off = rnd.randrange(1000, 65535 - max(ports), 10)
        socks = []
        try:
            for p in ports:
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p + off))
                socks.append(s)
            return off
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def cached(n: int, page: int = PAGE) -> int:
    """Tokens SGLang caches of an n-token prompt: full pages of all tokens but the last."""
    return (n - 1) // page * page


def start(tmp_path: Path, port: int, *args: str, env: dict | None = None) -> subprocess.Popen:
    """The stand-in on ``port`` (log in ``tmp_path``), once it answers ``/health``."""
    log_path = tmp_path / f"standin-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", MODULE, "--port", str(port), "--page-size", str(PAGE), *args],
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=child_env(env or {}),
                            start_new_session=True)

    def up():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
    assert wait_for(up, 120, 0.3), "stand-in server did not come up"
    return proc


def post_ok(req) -> bool:
    """Whether a request is answered 200 (False where it is refused or nothing listens)."""
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False
