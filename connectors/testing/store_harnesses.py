"""The harnesses of the built-in stores with services: ``hf3fs``, ``mooncake``, ``peer_rdma``.

(``memory``'s is in ``harness``, with the base class.) Each is named by its store's registry
entry. Where the test process runs inside a namespace made for it (``in_harness_namespace``),
services start right here; otherwise a store whose clients must be fenced (Mooncake's
listeners bind every interface) gets a loopback-only namespace of its own, and its clients
run under ``exec_prefix()``.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from kvconnect.connectors.testing.harness import StoreHarness, inside_harness_namespace
from kvconnect.connectors.testing.processes import child_env, free_port, stop, wait_for


class HF3FSHarness(StoreHarness):
    """``hf3fs`` on POSIX files (no 3FS mount here).

    Variants: ``""`` the in-process page index (the cheapest real configuration: each
    instance indexes its own files), ``"service"`` the durable ``kvconnect hf3fs-meta serve``
    index that every instance shares; ``restart()`` kills it with SIGKILL and starts it again
    on its journal."""

    store = "hf3fs"
    variants = ("", "service")
    restart_keeps = "the metadata service (SIGKILL, then started again on its journal)"

    @classmethod
    def skip_reason(cls) -> str | None:
        import importlib.util

        return "the metadata service needs grpcio" if importlib.util.find_spec("grpc") is None else None

    def _start(self) -> None:
        self.meta = None
        if self.variant == "service":
            from kvconnect.connectors.testing.hf3fs import MetaProcess

            self.meta = self._meta().start(timeout=60)

    def _meta(self, port: int | None = None):
        from kvconnect.connectors.testing.hf3fs import MetaProcess

        # 4 workers: a PD relay's concurrent rooms keep more than one busy on a loaded box
        return MetaProcess(self.workdir / "meta", port=port, exec_prefix=self.exec_prefix(), workers=4,
                           log_path=self.workdir / "meta.log")

    def _stop(self) -> None:
        if getattr(self, "meta", None) is not None:
            self.meta.stop()

    def outage(self) -> None:
        if self.meta is not None:
            self.meta.kill9()

    def options(self, instance: int = 0) -> dict[str, Any]:
        opts = {"store": "hf3fs", "file_size": self.capacity or "64mb", "numjobs": 2, "entries": 8,
                "client": "posix"}
        if self.meta is None:  # an index per process: each instance its own files
            return {**opts, "file_path_prefix": str(self.workdir / f"files{instance}" / "kv")}
        return {**opts, "file_path_prefix": str(self.workdir / "files" / "kv"), "metadata_server_url": self.meta.url}

    def sized_options(self, nbytes: int) -> dict[str, Any] | None:
        """A data file of ``nbytes`` (the index evicts when its pages are all taken)."""
        return {**self.options(0), "file_size": nbytes,
                "file_path_prefix": str(self.workdir / f"bounded-{nbytes}" / "kv")}

    def restart(self) -> None:
        if self.meta is None:
            return
        self.meta.kill9()
        self.meta = self._meta(self.meta.port).start(timeout=60)


class _Fenced(StoreHarness):
    """A store whose clients run in a loopback-only namespace: this one (inside the namespace
    run) or one made here."""

    needs_namespace = True

    @classmethod
    def skip_reason(cls) -> str | None:
        from kvconnect.connectors.testing.peer import skip_reason

        return skip_reason("grpc", "mooncake")

    def _fence(self) -> None:
        self._own_netns = self.netns is None and not inside_harness_namespace()
        if self._own_netns:
            from kvconnect.connectors.testing.netns import Netns

            self.netns = Netns(f"kvc-{self.store[:4]}")

    def _unfence(self) -> None:
        if getattr(self, "_own_netns", False) and self.netns is not None:
            self.netns.delete()
            self.netns = None

class MooncakeHarness(_Fenced):
    """``mooncake``: a real ``mooncake_master`` (500 ms leases) and a segment-holder process
    that lends the memory; engine instances are clients lending none (so pages outlive the
    instance that wrote them: ``durable``). The master keeps its metadata in memory: there
    is no service restart that keeps pages, so ``restart()`` restarts nothing."""

    store = "mooncake"
    restart_keeps = "nothing (mooncake_master keeps metadata in memory; pages outlive their writer in the holder)"

    @classmethod
    def skip_reason(cls) -> str | None:
        from kvconnect.connectors.testing.mooncake import mooncake_skip_reason

        return mooncake_skip_reason()

    def _start(self) -> None:
        from kvconnect.connectors.testing.mooncake import LEASE_TTL_MS, MooncakeCluster

        self.cluster = MooncakeCluster(lease_ttl_ms=LEASE_TTL_MS, log_dir=self.workdir, netns=self.netns,
                                       inside_current=self.netns is None and inside_harness_namespace())
        self.netns = self.cluster.netns
        self.cluster.start_holder(str(self.capacity or "128mb"))

    def _stop(self) -> None:
        if getattr(self, "cluster", None) is not None:
            self.cluster.close()
            self.cluster = None

    def outage(self) -> None:
        self.cluster.master.kill()
        for p in self.cluster.holders:
            p.kill()

    def options(self, instance: int = 0) -> dict[str, Any]:
        from kvconnect.connectors.testing.mooncake import store_options

        return {"store": "mooncake", **store_options(self.cluster, global_segment_size=0, local_buffer_size="16mb")}

    def sized_options(self, nbytes: int) -> dict[str, Any] | None:
        """The instance lends ``nbytes`` itself (the holder's segment is fixed at start)."""
        return {**self.options(0), "global_segment_size": nbytes}


class PeerRdmaHarness(_Fenced):
    """``peer_rdma`` over TCP: a memory-only seed node (``kvconnect peer serve``) that every
    engine instance joins as a node lending a segment of its own (pages live while the nodes
    that hold them do)."""

    store = "peer_rdma"
    restart_keeps = "nothing (pages live in the nodes' memory)"

    def _start(self) -> None:
        self._fence()
        self.port = free_port() if self.netns is None else 31998 if self._own_netns else self.netns.run(free_port)
        ready = self.workdir / "seed.ready"
        ready.unlink(missing_ok=True)
        self.log = open(self.workdir / "seed.log", "w")
        self.seed = subprocess.Popen(self.exec_prefix() + [
            sys.executable, "-m", "kvconnect", "--log-level", "WARNING", "peer", "serve", "--discovery-addr",
            f"127.0.0.1:{self.port}", "--global-segment-size", str(self.capacity or "32mb"), "--protocol", "tcp",
            "--set",
            "heartbeat_interval=0.5", "--set", "member_ttl=3", "--ready-file", str(ready)],
            env=child_env(), stdout=subprocess.DEVNULL, stderr=self.log)

        def up() -> bool:
            if self.seed.poll() is not None:
                raise RuntimeError(f"peer seed exited: {(self.workdir / 'seed.log').read_text()[-2000:]}")
            return ready.exists()

        if not wait_for(up, 60, 0.1):
            raise TimeoutError(f"peer seed did not start in 60 s: {(self.workdir / 'seed.log').read_text()[-2000:]}")

    def _stop(self) -> None:
        if getattr(self, "seed", None) is not None:
            stop(self.seed)
            self.seed = None
            self.log.close()
        self._unfence()

    def outage(self) -> None:
        self.seed.kill()
        self.seed.wait(10)

    def options(self, instance: int = 0) -> dict[str, Any]:
        return {"store": "peer_rdma", "discovery_addr": f"127.0.0.1:{self.port}", "protocol": "tcp",
                "local_hostname": "127.0.0.1", "control_port": 0, "global_segment_size": "8mb",
                "heartbeat_interval": 0.5, "member_ttl": 3, "join_timeout": 10}

    def sized_options(self, nbytes: int) -> dict[str, Any] | None:
        return {**self.options(0), "global_segment_size": nbytes}
