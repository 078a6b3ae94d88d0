"""The HF3FS metadata service as a process: ``kvconnect hf3fs-meta serve`` on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvconnect.connectors.testing.processes import child_env, free_port, stop as stop_process


class MetaProcess:
    """``kvconnect hf3fs-meta serve`` as a child process (bound to 127.0.0.1), started in the
    current network namespace or under ``exec_prefix`` (e.g. a ``Netns``'s)."""

    def __init__(self, data_dir: Path, token_file: Path | None = None, port: int | None = None,
                 fsync: str = "interval", *, exec_prefix: list[str] | None = None, workers: int | None = None,
                 log_path: Path | None = None, host: str = "127.0.0.1", args: list[str] | None = None,
                 nofile: int | None = None, nofile_hard: bool = False):
        """``args``: more ``serve`` flags; ``nofile``: the service's open-file soft limit at start
        (``nofile_hard``: its hard limit too, which the service then cannot raise)."""
        self.data_dir = Path(data_dir)
        self.token_file = token_file
        self.port = port or free_port()
        self.fsync = fsync
        self.exec_prefix = list(exec_prefix or [])
        self.workers = workers
        self.log_path = log_path
        self.host = host
        self.args = list(args or [])
        self.nofile = nofile
        self.nofile_hard = nofile_hard
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0
        self.recovery: dict = {}
        self.identity: str | None = None  # the index's identity (data file stamps name it), once started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> "MetaProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ready = self.data_dir.parent / f"ready-{self.port}.json"
        ready.unlink(missing_ok=True)
        cmd = self.exec_prefix + [
            sys.executable, "-m", "kvconnect", "--log-level", "WARNING", "hf3fs-meta", "serve", "--host", self.host,
            "--port", str(self.port), "--data-dir", str(self.data_dir), "--fsync", self.fsync,
            "--ready-file", str(ready)]
        if self.token_file:
            cmd += ["--token-file", str(self.token_file)]
        if self.workers:
            cmd += ["--workers", str(self.workers)]
        cmd += self.args
        err = open(self.log_path, "w") if self.log_path else subprocess.PIPE
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True, preexec_fn=self._limits if self.nofile else None)
        finally:
            if self.log_path:
                err.close()  # type: ignore[union-attr]
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"hf3fs-meta exited: {self._stderr()}")
            if time.monotonic() - t0 > timeout:
                self.kill9()
                raise TimeoutError(f"hf3fs-meta did not start: {self._stderr()}")
            time.sleep(0.02)
        self.started_s = time.monotonic() - t0
        doc = json.loads(ready.read_text())
        self.recovery, self.identity = doc["recovery"], doc.get("identity")
        return self

    def _limits(self) -> None:
        import resource

        hard = self.nofile if self.nofile_hard else resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, hard))

    def _stderr(self) -> str:
        if self.log_path:
            return Path(self.log_path).read_text()[-2000:]
        return self.proc.stderr.read().decode()[-2000:] if self.proc and self.proc.stderr else ""

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc, 15)
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()
