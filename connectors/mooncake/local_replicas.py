"""The Mooncake store's replicas on this host: the segment this process lends (and, with
``shared_segment``, publishes for same-host readers), and reads of pages whose replica lies
there or in a same-host store process's shared segment, by copy (``local_copy``; why it
reads the bytes Mooncake's get would: ``kvconnect.connectors.mooncake.local_copy``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvconnect.connectors.base import BackendUnavailable, Page, page_nbytes
from kvconnect.connectors.buffers import scatter_many
from kvconnect.connectors.mooncake.local_copy import PROBE_BYTES, find_own_endpoint, mapping_base, memory_replicas
from kvconnect.connectors.shared_memory import SameHostSegments, SharedSegmentFile

log = logging.getLogger("kvconnect.mooncake")


class LocalReplicas:
    """This process's segment and same-host shared segments, and copies out of them."""

    def __init__(self, store, replicate_config: type):  # the MooncakeStore this is part of
        self.store = store
        self.config = store.config
        self.session = store.session
        self._replicate_config = replicate_config
        self.shared_file: SharedSegmentFile | None = None  # the segment this process lends (shared_segment)
        self.same_host: SameHostSegments | None = None  # same-host store processes' segments (local_copy)
        self.own_endpoint: str | None = None  # the transport endpoint of this process's segment

    def start(self) -> None:
        """Once the session is set up; what it mounted is let go by ``close``."""
        c = self.config
        if c.shared_segment:
            self.shared_file = self._mount_shared_segment()
        self.own_endpoint = self._find_own_endpoint(self._replicate_config) \
            if (c.local_copy or c.shared_segment) and c.global_segment_size > 0 else None
        if self.shared_file is not None:
            self._publish_shared_segment()
        self.same_host = SameHostSegments(c.shared_segment_dir, "mooncake") if c.local_copy else None

    def _mount_shared_segment(self) -> SharedSegmentFile:
        """Lend the segment from a shared-memory file (``shared_segment``)."""
        c = self.config
        try:
            shared = SharedSegmentFile(c.shared_segment_dir, c.global_segment_size, "mooncake")
        except OSError as e:
            raise BackendUnavailable("mooncake", f"shared_segment: {e}") from e
        result = self.session.call("mount_segment", self.session.client.mount_segment, shared.path,
                                   c.global_segment_size)
        if not result or result.get("ret") != 0:
            shared.close()
            raise BackendUnavailable("mooncake", f"shared_segment: mount_segment({shared.path}) "
                                                 f"returned {result}")
        return shared

    def _publish_shared_segment(self) -> None:
        shared = self.shared_file
        assert shared is not None
        base = mapping_base(shared.path, shared.nbytes)
        if self.own_endpoint is None or base is None:
            log.warning("mooncake: shared segment %s not published (endpoint %s, mapped at %s): "
                        "same-host readers use the Transfer Engine", shared.path, self.own_endpoint, base)
            return
        shared.publish(self.own_endpoint, base)
        log.info("mooncake: shared segment %s (%d bytes) published for same-host readers at %s",
                 shared.path, shared.nbytes, self.own_endpoint)

    def _find_own_endpoint(self, ReplicateConfig: Any) -> str | None:
        """The transport endpoint of this process's segment (``local_copy``), else None."""
        client = self.session.client
        staging = self.store.transfers.staging
        probe = ReplicateConfig()
        probe.replica_num = 1
        probe.preferred_segment = client.get_hostname()
        addr = staging.acquire(PROBE_BYTES, time.monotonic() + self.config.op_timeout)
        found = None
        if addr is not None:
            release = staging.releaser(addr)  # once the probe can no longer touch the extent
            found = self.session.call("local copy probe", find_own_endpoint, client, probe, addr,
                                      on_abandoned_done=release)
            if found is not None:
                release(None)
        endpoint, why = found or (None, "no answer within op_timeout")
        if endpoint is None:
            log.warning("mooncake: local_copy off: %s; own-segment pages are read through Mooncake", why)
        else:
            log.info("mooncake: pages in this process's segment (%s) are read with a parallel copy", endpoint)
        return endpoint

    def get(self, keys: list[str], pages: list[Page]) -> tuple[list[bool], list[int]] | None:
        """Copy the pages whose replica lies in this process's segment or in a same-host
        shared segment. Returns (hits, indices of pages stored elsewhere, for Mooncake to
        read), or None when there is nothing here to copy from."""
        same_host = self.same_host if self.same_host is not None and self.same_host.present() else None
        own = self.own_endpoint
        if own is None and same_host is None:
            return None
        figures = self.store.figures
        out = [False] * len(keys)
        leased_at = time.monotonic()  # before the query: the lease starts no earlier
        replicas = self.session.call("batch_get_replica_desc", self.session.client.batch_get_replica_desc, keys)
        if replicas is None:
            return out, []  # store unavailable: misses
        if not replicas and time.monotonic() - leased_at >= self.config.op_timeout / 2:
            # the query reports no error codes: an empty answer this slow is a master that
            # did not answer (inline mode's RPC timeout is op_timeout / 2), not misses
            figures.add(unavailable=1)
            self.session.mark_unhealthy(f"batch_get_replica_desc: nothing for {len(keys)} keys after "
                                        f"{time.monotonic() - leased_at:.1f}s")
            return out, []
        local, sources, holders, elsewhere = [], [], [], []
        for i, key in enumerate(keys):
            found = replicas.get(key)
            source = holder = None
            nbytes = page_nbytes(pages[i])
            for endpoint, address in memory_replicas(found, nbytes) if found else ():
                if endpoint == own:
                    source = address
                    break
                if same_host is not None:
                    source = same_host.source(endpoint, address, nbytes)
                    if source is not None:
                        holder = endpoint
                        break
            if source is None:
                # another host's segment, another size, or no answer for the key (a miss
                # or an error: the query does not say which): Mooncake's own get decides
                elsewhere.append(i)
            else:
                local.append(i)
                sources.append(source)
                holders.append(holder)
        if local:
            scatter_many(sources, [pages[i] for i in local])
            late = time.monotonic() - leased_at > self.config.lease_ttl / 2
            # a holder still alive after the copy owned its endpoint the whole time: every
            # replica reported there was its own, in the memory just copied
            gone = {h for h in set(holders) if h is not None and not same_host.alive(h)}  # type: ignore[union-attr]
            if late:
                figures.add(local_copy_late=len(local))
            else:
                shared = sum(1 for h in holders if h is not None and h not in gone)
                dropped = sum(1 for h in holders if h in gone)
                figures.add(shared_copy_pages=shared, shared_copy_holder_gone=dropped,
                            local_copy_pages=len(local) - shared - dropped)
            if late:  # the lease may have lapsed mid-copy: the bytes are not trusted
                log.warning("mooncake: local copy of %d pages outlasted lease_ttl/2=%gs; misses",
                            len(local), self.config.lease_ttl / 2)
            else:
                for i, holder in zip(local, holders):
                    out[i] = holder is None or holder not in gone
        return out, elsewhere

    def close(self) -> None:
        """After the client let go of the segment."""
        if self.same_host is not None:
            self.same_host.close()
        if self.shared_file is not None:
            self.shared_file.close()

    def usage(self) -> dict[str, Any]:
        return {"local_copy_endpoint": self.own_endpoint,
                "shared_segment": self.shared_file.path if self.shared_file else None,
                "shared_segments_mapped": self.same_host.mapped if self.same_host else 0}
