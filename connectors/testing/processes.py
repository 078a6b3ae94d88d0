"""Child processes of tests and benchmarks: how they import kvconnect, how they stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

QUIET_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
MOONCAKE_QUIET_ENV = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
"""Mooncake's logging down to errors (peer-pool processes). Not for every child: a segment
holder started with these failed most of an 8192-segment batch (TRANSFER_FAIL) that it
serves without them."""


def import_root() -> str:
    """The folder that makes ``import kvconnect`` work: the repository root of a checkout,
    the site-packages folder of an installed kvconnect."""
    import kvconnect

    return str(Path(kvconnect.__file__).resolve().parents[1])


def child_env(extra: Mapping[str, str] | None = None, **env: str) -> dict[str, str]:
    """This process's environment for a child: the kvconnect import root first on
    ``PYTHONPATH``, telemetry off, then ``extra`` / ``env``."""
    out = {**os.environ, **QUIET_ENV}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (import_root(), os.environ.get("PYTHONPATH")) if p)
    out.update(extra or {})
    out.update(env)
    return out


def python() -> str:
    """The interpreter children run with (the one running now)."""
    return sys.executable


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM (a clean exit), then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.25) -> Any:
    """Poll ``predicate`` until it returns something true or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_until(cond, timeout: float, what: str) -> float:
    """Seconds until ``cond()`` is true, polled every 50 ms; AssertionError naming ``what``
    after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JsonWorker:
    """A child process driven by JSON lines: a request per line on its stdin, an answer per
    line on its stdout (lines not starting with ``{`` are ignored); its stderr goes to a log.
    The child's side is ``serve_json_lines``."""

    def __init__(self, argv: list[str], *, name: str, log_dir: Path | None = None,
                 prefix: list[str] | None = None, env: Mapping[str, str] | None = None, ready_timeout: float = 300):
        self.name = name
        self.log = open((log_dir or Path("/tmp")) / f"{name}-{os.getpid()}.log", "w")
        self.proc = subprocess.Popen([*(prefix or []), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1, env=child_env(env))
        self.ready = self._recv(ready_timeout)
        if "error" in self.ready:
            raise RuntimeError(f"worker {name} did not start: {self.ready['error']}\n{self.ready.get('trace', '')}")

    def _recv(self, timeout: float) -> dict:
        import json
        import select

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if r:
                line = self.proc.stdout.readline()  # type: ignore[union-attr]
                if not line:
                    break
                if line.startswith("{"):
                    return json.loads(line)
        raise RuntimeError(f"worker {self.name} did not answer (rc={self.proc.poll()}); log: {self.log.name}")

    def call(self, op: str, timeout: float = 120, **args: Any) -> dict:
        import json

        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        rep = self._recv(timeout)
        if "error" in rep:
            raise RuntimeError(f"worker {self.name} {op}: {rep['error']}\n{rep.get('trace', '')}")
        return rep

    def kill9(self) -> None:
        # a worker under `ip netns exec` was exec'ed: the pid is the python process
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        import json

        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        stop(self.proc)
        self.log.close()


def serve_json_lines(ready: Callable[[], dict], handlers: Mapping[str, Callable[..., dict]],
                     on_exit: Callable[[], None] = lambda: None) -> None:
    """The child's side of ``JsonWorker``: ``ready()``'s answer first (an error if it
    raises), then one answer per request line until ``{"op": "exit"}`` or stdin closes."""
    import json
    import traceback

    def out(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        out(ready())
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        return
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op = req.pop("op")
            if op == "exit":
                on_exit()
                out({"bye": True})
                return
            out(handlers[op](**req))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})


# ---------------------------------------------------------------------------------
# Connection floods (bounded: each helper opens at most ``n`` sockets, to loopback)
# ---------------------------------------------------------------------------------


def open_file_limit(n: int) -> Callable[[], None]:
    """A ``preexec_fn`` that starts a child with ``n`` as both its soft and hard open-file limit
    (it cannot raise it: the limit an operator's unit file may set)."""

    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return apply


def own_open_file_limit(need: int, why: str) -> Callable[[], None]:
    """Raise this process's soft open-file limit to its hard limit (a test that holds
    thousands of sockets) and return what restores it; skips the test where the hard limit is
    below ``need``."""
    import resource

    import pytest

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"{why}: needs an open-file hard limit >= {need} (have {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def hold_connections(port: int, n: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """Open up to ``n`` TCP connections to ``host:port`` that never send a byte; those the
    kernel refuses are skipped. The caller closes them. Needs about ``n`` free descriptors."""
    held = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            continue
        held.append(s)
    return held


def still_open(socks: list[socket.socket], within: float) -> list[socket.socket]:
    """The sockets the other side has not closed (EOF or reset) within ``within`` seconds."""
    import selectors

    deadline = time.monotonic() + within
    left = set(socks)
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while left and (wait := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(wait):
                s = key.fileobj
                try:
                    closed = s.recv(4096) == b""  # bytes the server sent (its HTTP/2 settings) are read past
                except ConnectionResetError:
                    closed = True
                except OSError:
                    closed = False
                if closed:
                    sel.unregister(s)
                    left.discard(s)
    return [s for s in socks if s in left]
