"""``RateLimitedLog``: one line per distinct problem per interval, with a count of what was
suppressed in between. Stores and engine glue both use it: a dead index or peer fails every
call, and one WARNING per call would flood the engine's log."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("kvconnect")


class RateLimitedLog:
    """Log each distinct ``key`` at most once per ``interval_s`` seconds.

    The next line logged for a key says how many were suppressed in between.
    """

    def __init__(self, logger: logging.Logger | None = None, interval_s: float = 30.0):
        self.logger = logger or log
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args: Any, exc_info: Any = None) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg += f" ({suppressed} similar messages suppressed in the last {self.interval_s:.0f}s)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, msg: str, *args: Any, exc_info: Any = None) -> bool:
        return self.log(logging.WARNING, key, msg, *args, exc_info=exc_info)

    def error(self, key: str, msg: str, *args: Any, exc_info: Any = None) -> bool:
        return self.log(logging.ERROR, key, msg, *args, exc_info=exc_info)
