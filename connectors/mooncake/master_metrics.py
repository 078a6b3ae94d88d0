"""The Mooncake cluster's used and capacity bytes, from ``mooncake_master``'s metrics endpoint.

The Mooncake client has no call that says how full the store is; the master does, on its
HTTP metrics endpoint (``--metrics_port``, 9003 by default): ``master_allocated_bytes`` (bytes
allocated in all mounted memory segments), ``master_total_capacity_bytes`` (the segments'
size) and ``master_key_count``. ``MasterMetrics.read()`` returns those figures (the whole
cluster's: every client, every tenant), reused for ``ttl`` seconds; after a failed read it
returns None and does not ask again for ``retry_after`` seconds, so a master without a
metrics endpoint costs one short timeout now and then, never one per ``stats()``.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_PORT = 9003  # mooncake_master --metrics_port default
FIGURES = {"master_allocated_bytes": "bytes_used", "master_total_capacity_bytes": "capacity_bytes",
           "master_key_count": "keys"}


@dataclass(frozen=True)
class ClusterUsage:
    bytes_used: int
    capacity_bytes: int
    keys: int


def metrics_url(setting: str, master_server_address: str) -> str:
    """The URL that ``master_metrics`` names ('' when it is off)."""
    setting = setting.strip()
    if not setting:
        return ""
    if setting == "auto":
        host = master_server_address.rpartition(":")[0] or "127.0.0.1"
        return f"http://{host}:{DEFAULT_PORT}/metrics"
    if "://" in setting:
        return setting
    return f"http://{setting}/metrics"


def parse(text: str) -> ClusterUsage | None:
    """The three figures from Prometheus text, unlabelled series only (None unless all three
    are there, or if the text does not parse)."""
    from prometheus_client.parser import text_string_to_metric_families

    got: dict[str, int] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in FIGURES and not sample.labels:
                    got[FIGURES[sample.name]] = int(sample.value)
    except ValueError:
        return None
    return ClusterUsage(**got) if len(got) == len(FIGURES) else None


class MasterMetrics:
    def __init__(self, url: str, *, timeout: float = 1.0, ttl: float = 1.0, retry_after: float = 10.0):
        self.url = url
        self.timeout = timeout
        self.ttl = ttl
        self.retry_after = retry_after
        self.error = ""  # why the latest read failed ("" after a good one)
        self._lock = threading.Lock()
        self._at = -1e18
        self._last: ClusterUsage | None = None

    def forget(self) -> None:
        """The next ``read`` asks the master (after this process's own writes and deletes),
        unless the last read failed and ``retry_after`` has not passed."""
        with self._lock:
            if self._last is not None:
                self._at = -1e18

    def read(self) -> ClusterUsage | None:
        if not self.url:
            return None
        with self._lock:
            wait = self.ttl if self._last is not None else self.retry_after
            if time.monotonic() - self._at < wait:
                return self._last
            self._at = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=self.timeout) as r:
                    usage = parse(r.read().decode("utf-8", "replace"))
                self.error = "" if usage is not None else "no master_allocated_bytes / capacity figures"
            except Exception as e:  # noqa: BLE001 - figures are best effort
                usage, self.error = None, f"{type(e).__name__}: {e}"
            if usage is None:
                log.debug("mooncake: master metrics %s: %s", self.url, self.error)
            self._last = usage
            return usage
