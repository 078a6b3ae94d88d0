"""Redis ``wait`` mode without the replicas it waits for: real ``redis-server`` /
``redis-sentinel`` processes on 127.0.0.1 (``kvconnect.connectors.testing.redis_cluster``).

* one replica (the smallest layout), the replica killed: every ``put_from`` fails at once
  (no ``WAIT`` timeout on the engine's thread), counted (``index_no_replica_writes``) and
  logged once; pages confirmed before stay byte-exact; writes are confirmed again once the
  replica is back;
* one replica stalled (SIGSTOP): once its last acknowledgement is older than
  ``REPLICA_MAX_LAG_S`` it no longer counts, and writes fail at once as well;
* one replica, the primary killed: the promoted replica has none, and writes through it fail
  at once the same way, while the earlier pages read back byte-exact;
* two replicas with ``WAIT 1`` (the layout docs/hf3fs_ha.md recommends): a replica killed,
  writes keep being confirmed; then the primary killed for good, writes are confirmed again
  within 10 s, and nothing confirmed before is lost.
"""

from __future__ import annotations

import logging
import os
import time

import pytest

from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.hf3fs.config import HF3FSConfig
from kvconnect.connectors.hf3fs.redis_index import REPLICA_MAX_LAG_S, REPLICAS_TRUSTED_S
from kvconnect.connectors.hf3fs.store import HF3FSStore
from kvconnect.connectors.testing.conformance import PAGE, PageStoreConformance
from kvconnect.connectors.testing.hf3fs_failover import check_all, wait_until
from kvconnect.connectors.testing.redis_cluster import DURABILITY, RedisHA, redis_skip_reason

SKIP = redis_skip_reason()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=SKIP or ""), pytest.mark.failure_injection]

FAST_S = 0.2  # a write that fails for want of replicas returns within this (measured: a few ms)
T = PageStoreConformance()


@pytest.fixture
def ha_factory(tmp_path):
    made = []

    def make(replicas: int) -> RedisHA:
        ha = RedisHA(durability=DURABILITY["wait"], replicas=replicas, workdir=tmp_path / f"ha{len(made)}",
                     password="kvc-" + os.urandom(6).hex())
        made.append(ha)
        ha.start()
        (tmp_path / "pw").write_text(ha.password)
        return ha

    yield make
    for ha in made:
        ha.close()


def store(ha: RedisHA, tmp_path) -> HF3FSStore:
    return HF3FSStore(HF3FSConfig(
        file_path_prefix=str(tmp_path / "hicache"), file_size=1024 * PAGE, numjobs=2, entries=4,
        metadata_server_url=ha.url, metadata_key_prefix=f"kvc-{os.urandom(4).hex()}", metadata_wait_replicas=1,
        metadata_wait_timeout=0.5, client_timeout=2.0, auth_token_file=str(tmp_path / "pw"),
        metadata_sentinel_auth=True), EngineContext())


def attached(node) -> int:
    info = node.command("INFO", "replication")
    return int(info["connected_slaves"]) if isinstance(info, dict) else -1


def timed_writes(s: HF3FSStore, n: int, tag: str) -> tuple[list[list[bool]], list[float], list[str]]:
    oks, times, written = [], [], []
    for i in range(n):
        ks = T.keys(4, f"{tag}{i}")
        t0 = time.monotonic()
        oks.append(T.write(s, ks))  # one put_from of 4 pages
        times.append(time.monotonic() - t0)
        written += ks
    return oks, times, written


def no_replica_writes(s: HF3FSStore) -> int:
    return s.stats().extra["index_no_replica_writes"]


def test_only_replica_lost_writes_fail_at_once_counted_and_logged(ha_factory, tmp_path, caplog):
    ha = ha_factory(1)
    s = store(ha, tmp_path)
    early = T.keys(64, "early")
    assert T.write(s, early[:32]) == [True] * 32 and T.write(s, early[32:]) == [True] * 32
    assert "index_no_replica_writes" in s.metric_counters

    ha.nodes[1].kill9()
    wait_until(lambda: attached(ha.primary) == 0, 10, "the primary notices its replica is gone")
    time.sleep(REPLICAS_TRUSTED_S + 0.1)  # past the count the client trusts
    caplog.set_level(logging.WARNING, logger="kvconnect.hf3fs")
    oks, times, _ = timed_writes(s, 25, "lonely")
    print(f"failed-at-once writes: max {max(times) * 1000:.1f} ms, mean {sum(times) / len(times) * 1000:.1f} ms")
    assert all(ok == [False] * 4 for ok in oks), oks
    assert max(times) < FAST_S, times
    assert no_replica_writes(s) >= 25
    assert s.stats().put_failed >= 100
    warned = [r for r in caplog.records if "replica(s) attached" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]  # rate-limited: one per 10 s
    check_all(s, early)  # what was confirmed before reads back byte-exact

    ha.nodes[1].start()  # the replica back: writes confirmed again
    back = []

    def confirmed():
        ks = T.keys(4, "back")
        if T.write(s, ks) == [True] * 4:
            back.extend(ks)
            return True
        return False

    print(f"confirmed again {wait_until(confirmed, 15, 'writes confirmed after the replica returned'):.2f} s "
          "after the replica's restart")
    check_all(s, early + back)
    s.close()


def test_stalled_replica_stops_counting_after_its_lag(ha_factory, tmp_path):
    """A replica that is attached but silent (SIGSTOP) counts only while its last
    acknowledgement is at most REPLICA_MAX_LAG_S old: then writes fail at once too."""
    ha = ha_factory(1)
    s = store(ha, tmp_path)
    early = T.keys(32, "early")
    assert T.write(s, early) == [True] * 32
    ha.nodes[1].stop()
    try:
        time.sleep(REPLICA_MAX_LAG_S + 1.5 + REPLICAS_TRUSTED_S)  # its lag past the bound, the trusted count stale
        assert T.write(s, T.keys(4, "probe")) == [False] * 4  # at most one WAIT timeout here
        oks, times, _ = timed_writes(s, 10, "stalled")
        assert all(ok == [False] * 4 for ok in oks), oks
        assert max(times) < FAST_S, times
        assert no_replica_writes(s) >= 10
        check_all(s, early)
    finally:
        ha.nodes[1].cont()
    s.close()


def test_primary_lost_promoted_replica_alone_writes_fail_at_once(ha_factory, tmp_path):
    """The audit's case: one replica, the primary killed (and never back): the promoted
    replica has no replica; each write used to block ``metadata_wait_timeout`` for nothing."""
    ha = ha_factory(1)
    s = store(ha, tmp_path)
    early = T.keys(64, "early")
    assert T.write(s, early[:32]) == [True] * 32 and T.write(s, early[32:]) == [True] * 32
    old = (ha.primary.host, ha.primary.port)
    ha.primary.kill9()
    ha.wait_failover(old, timeout=30)
    before = no_replica_writes(s)

    def through_new_primary():
        assert T.write(s, T.keys(4, "probe")) == [False] * 4
        return no_replica_writes(s) > before

    wait_until(through_new_primary, 15, "the store writes through the promoted replica")
    oks, times, _ = timed_writes(s, 25, "alone")
    print(f"failed-at-once writes after the failover: max {max(times) * 1000:.1f} ms")
    assert all(ok == [False] * 4 for ok in oks), oks
    assert max(times) < FAST_S, times
    assert no_replica_writes(s) >= before + 26
    check_all(s, early)
    s.close()


def test_two_replicas_keep_writing_after_one_loss_then_after_a_primary_loss(ha_factory, tmp_path):
    ha = ha_factory(2)
    s = store(ha, tmp_path)
    early = T.keys(64, "early")
    assert T.write(s, early[:32]) == [True] * 32 and T.write(s, early[32:]) == [True] * 32

    ha.nodes[2].kill9()  # one replica lost: WAIT 1 is still answered by the other
    wait_until(lambda: attached(ha.primary) == 1, 10, "the primary notices one replica is gone")
    oks, times, more = timed_writes(s, 25, "one-lost")
    print(f"writes with one of two replicas lost: max {max(times) * 1000:.1f} ms")
    assert all(ok == [True] * 4 for ok in oks), oks
    assert max(times) < FAST_S, times
    extra = s.stats().extra
    assert extra["index_no_replica_writes"] == 0 and extra["index_wait_shortfalls"] == 0, extra

    ha.nodes[2].start()
    ha.wait_ready(30)
    old = (ha.primary.host, ha.primary.port)
    ha.primary.kill9()  # the primary lost for good: one replica promoted, the other follows it
    t0 = time.monotonic()
    ha.wait_failover(old, timeout=30)
    last = []

    def confirmed():
        ks = T.keys(4, "after")
        if T.write(s, ks) == [True] * 4:
            last.extend(ks)
            return True
        return False

    wait_until(confirmed, 10 - (time.monotonic() - t0), "writes confirmed within 10 s of the primary loss")
    print(f"writes confirmed again {time.monotonic() - t0:.2f} s after the primary's kill -9")
    check_all(s, early + more + last)  # nothing confirmed was lost
    s.close()
