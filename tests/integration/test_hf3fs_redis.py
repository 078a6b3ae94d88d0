"""The HF3FS store on a Redis page index: real ``redis-server`` processes on 127.0.0.1.

* the conformance suite, through ``redis://`` (one server) and ``redis+sentinel://`` (a
  primary, a replica and three sentinels);
* the index's semantics straight on ``RedisMetadata``: reserve -> confirm, in-flight and
  duplicate keys, expired reservations, read leases against eviction, LRU order,
  validate / delete / forget, a 128-key batch in one script call;
* fail-closed reads: an index entry pointing at a slot that holds another key's page is a
  miss (and is dropped), never those bytes;
* TLS with an ACL user whose password comes from a file; wrong credentials are a
  ``ConfigError`` at start; a dead index is a miss within the bound, never a hang.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from kvconnect.connectors.base import BackendUnavailable, ConfigError
from kvconnect.connectors.hf3fs.config import HF3FSConfig
from kvconnect.connectors.testing.hf3fs_failover import bound_s
from kvconnect.connectors.hf3fs.index import EXISTS, INFLIGHT, NEW, NOSPACE
from kvconnect.connectors.hf3fs.redis_index import key_digests
from kvconnect.connectors.testing.redis_cluster import Durability, RedisProcess, free_port
from kvconnect.connectors.hf3fs.store import HF3FSStore
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.testing.conformance import PAGE, PageStoreConformance, check_page
from kvconnect.connectors.testing.redis_cluster import redis_skip_reason

SKIP = redis_skip_reason()
CAPACITY_PAGES = 64

pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

NS = "0:kv"


def rm(url: str, prefix: str, **kw):
    """A client on the Reserve / Commit path (``lease_ahead=0``) unless told otherwise."""
    from kvconnect.connectors.hf3fs.redis_index import RedisMetadata

    return RedisMetadata(url, key_prefix=prefix, timeout=kw.pop("timeout", 3.0), lease_ahead=kw.pop("lease_ahead", 0),
                         **kw)


def keys(n: int, tag: str = "k") -> list[bytes]:
    salt = os.urandom(4).hex()
    return [f"{tag}-{salt}-{i}".encode() for i in range(n)]


def confirm(c, ns, batch, crc=0):
    st, sl, gn = c.reserve(ns, batch)
    new = [i for i, s in enumerate(st) if s == NEW]
    ok = c.commit(ns, [batch[i] for i in new], [sl[i] for i in new], [gn[i] for i in new], [crc] * len(new),
                  b"\x01" * len(new))
    assert ok == b"\x01" * len(new)
    return st, sl, gn


# ----------------------------------------------------------------------------- conformance


class TestHF3FSRedisIndex(PageStoreConformance):
    """The whole conformance suite with the page index on one Redis server."""

    store_name = "hf3fs"
    capacity_bytes = CAPACITY_PAGES * PAGE

    @pytest.fixture(autouse=True)
    def _redis(self, redis_url, tmp_path):
        self.url, self.prefix = redis_url
        self.dir = tmp_path

    def store_options(self):
        return {"file_path_prefix": str(self.dir / "hicache"), "file_size": self.capacity_bytes, "numjobs": 4,
                "entries": 4, "metadata_server_url": self.url, "metadata_key_prefix": self.prefix,
                "client_timeout": 5}

    def make_store(self):
        return HF3FSStore(HF3FSConfig(**self.store_options()))


class TestHF3FSRedisSentinel(PageStoreConformance):
    """The suite through Sentinel (primary + replica + 3 sentinels, all with a password, as
    docs/hf3fs_ha.md deploys them), with WAIT 1 on every confirm."""

    store_name = "hf3fs"
    capacity_bytes = CAPACITY_PAGES * PAGE

    @pytest.fixture(autouse=True)
    def _ha(self, redis_ha, tmp_path):
        self.ha, self.dir, self.prefix = redis_ha, tmp_path, f"kvc-{os.urandom(4).hex()}"
        (tmp_path / "pw").write_text(redis_ha.password)

    def store_options(self):
        return {"file_path_prefix": str(self.dir / "hicache"), "file_size": self.capacity_bytes, "numjobs": 2,
                "entries": 4, "metadata_server_url": self.ha.url, "metadata_wait_replicas": 1,
                "metadata_key_prefix": self.prefix, "client_timeout": 5,
                "auth_token_file": str(self.dir / "pw"), "metadata_sentinel_auth": True}

    def make_store(self):
        return HF3FSStore(HF3FSConfig(**self.store_options()), EngineContext())

    # the suite's eviction test runs on the single server above (it evicts under 2 s read leases)
    test_eviction_under_capacity_pressure = None


# ----------------------------------------------------------------------------- index semantics


def test_reserve_confirm_inflight_and_duplicates(redis_url):  # noqa: F811
    c = rm(*redis_url)
    c.initialize(NS, 1024, 4096)
    a, b = keys(2)
    st, sl, gn = c.reserve(NS, [a, b, a])
    assert list(st) == [NEW, NEW, INFLIGHT] and sl[0] != sl[1] and gn[0] == gn[1] > 0
    st2, _, _ = c.reserve(NS, [a])  # another writer while a's write is in flight
    assert list(st2) == [INFLIGHT]
    assert c.exists(NS, [a, b]) == b"\x00\x00"  # not visible before confirm
    assert c.commit(NS, [a, b], sl[:2], gn[:2], [5, 6], b"\x01\x00") == b"\x01\x01"  # b's write failed: released
    assert c.exists(NS, [a, b]) == b"\x01\x00"
    assert c.commit(NS, [a], sl[:1], gn[:1], [5], b"\x01") == b"\x01"  # a retried confirm is ok
    assert c.commit(NS, [a], sl[:1], [gn[0] + 9], [5], b"\x01") == b"\x00"  # not this writer's generation
    st3, sl3, _ = c.reserve(NS, [a, b])
    assert list(st3) == [EXISTS, NEW] and sl3[0] == sl[0]
    s, g, crc = c.get(NS, [a, b"absent"])
    assert s == [sl[0], -1] and g[0] == gn[0] and crc[0] == 5
    assert c.validate_keys(NS, [a, a], [sl[0], sl[0]], [gn[0], gn[0] + 1]) == b"\x01\x00"
    assert c.validate(NS, sl[:1], gn[:1]) == b"\x00"  # without keys: changed, to be safe
    c.close()


def test_write_leases_one_put_per_batch(redis_url):  # noqa: F811
    """The one-call write path (as the kvconnect service's): slots leased ahead, one put per
    batch; a key another writer stored first is PUT_DUP and its slot goes back; leases taken
    ahead and not used go back on close."""
    url, prefix = redis_url
    c1, c2 = rm(url, prefix, lease_ahead=64), rm(url, prefix, lease_ahead=64)
    c1.initialize(NS, 16384, 4096)
    batch = keys(16)
    st, sl, gn = c1.reserve(NS, batch)
    assert list(st) == [NEW] * 16 and c1.usage(NS)["leased"] == 16 + 64  # this batch and the lease ahead
    st2, sl2, gn2 = c2.reserve(NS, batch[:4])  # another writer of the same keys (leases do not see keys)
    assert not set(sl2) & set(sl)
    assert c1.commit(NS, batch, sl, gn, [1] * 16, b"" * 16) == b"" * 16
    assert c2.commit(NS, batch[:4], sl2, gn2, [2] * 4, b"" * 4) == b"" * 4  # stored already: ok
    s, g, crc = c1.get(NS, batch)
    assert s == sl and crc == [1] * 16  # the first writer's pages
    st3, _, _ = c2.reserve(NS, batch[:4])  # after meeting stored keys: through reserve, which knows them
    assert list(st3) == [EXISTS] * 4
    assert c1.put(NS, batch[:1], sl[:1], gn[:1], [1]) == bytes([1])  # a retried put: ok
    assert c1.put(NS, keys(1), sl[1:2], [gn[1] + 7], [0]) == b"\x00"  # not a lease of this writer: lost
    many_slots, many_gens = c1.lease(NS, 9000)  # far past Lua's unpack limit, given back in one call
    assert len(many_slots) == 9000 and c1.unlease(NS, many_slots, many_gens) == b"\x01" * 9000
    c1.close()
    c2.close()
    c = rm(url, prefix)
    u = c.usage(NS)
    assert u["leased"] == 0 and u["keys"] == 16 and u["free"] == 16384 - 16  # every unused lease came back
    c.close()


def test_expired_reservations_free_their_slots(redis_url):  # noqa: F811
    c = rm(*redis_url, write_lease_s=0.3)
    c.initialize(NS, 4, 4096)
    first = keys(4, "dead")
    st, sl, _ = c.reserve(NS, first)  # a writer that dies before confirming
    assert list(st) == [NEW] * 4
    assert list(c.reserve(NS, keys(1, "x"))[0]) == [NOSPACE]  # all reserved, none evictable
    time.sleep(1.3)  # past the lease and the sweep interval
    st2, sl2, _ = c.reserve(NS, keys(4, "live"))
    assert list(st2) == [NEW] * 4 and sorted(sl2) == sorted(sl)
    assert c.usage(NS)["expired"] == 4
    c.close()


def test_read_lease_blocks_eviction_then_lru_order(redis_url):  # noqa: F811
    c = rm(*redis_url, read_lease_s=0.6)
    c.initialize(NS, 8, 4096)
    old = keys(8, "old")
    _, slots, _ = confirm(c, NS, old)
    c.get(NS, old)  # every page under a read lease
    assert list(c.reserve(NS, keys(1, "new"))[0]) == [NOSPACE]
    time.sleep(0.8)
    c.get(NS, old[4:])  # the last four are read again: leased, and most recently used
    st, sl, _ = confirm(c, NS, keys(4, "new"))
    assert list(st) == [NEW] * 4 and sorted(sl) == sorted(slots[:4])  # the four least recently used went
    assert c.exists(NS, old) == b"\x00" * 4 + b"\x01" * 4
    u = c.usage(NS)
    assert u["evictions"] == 4 and u["keys"] == 8 and u["free"] == 0
    c.close()


def test_delete_forget_clear_and_spaces(redis_url):  # noqa: F811
    c = rm(*redis_url)
    c.initialize(NS, 64, 4096)
    c.initialize("0:kv:p8192", 64, 8192)
    ks = keys(6)
    _, sl, gn = confirm(c, NS, ks)
    assert c.delete(NS, [ks[0], ks[0], b"absent"]) == b"\x01\x00\x00"
    assert c.forget(NS, [ks[1]], [sl[1]], [gn[1] + 1]) == b"\x00"  # not the page that was read: kept
    assert c.forget(NS, [ks[1]], [sl[1]], [gn[1]]) == b"\x01"
    assert c.validate_keys(NS, ks[:3], sl[:3], gn[:3]) == b"\x00\x00\x01"
    assert c.clear(NS) == 4 and c.exists(NS, ks) == b"\x00" * 6
    assert c.spaces("0:kv") == [["0:kv", 64, 4096], ["0:kv:p8192", 64, 8192]]
    with pytest.raises(ConfigError, match="page_bytes"):
        c.initialize(NS, 64, 1024)  # another geometry in the same file
    c.close()


def test_a_128_key_batch_is_one_script_call(redis_url, redis_server):  # noqa: F811
    c = rm(*redis_url)
    c.initialize(NS, 4096, 4096)
    ks = keys(128)
    confirm(c, NS, ks)
    admin = redis_server.client()
    admin.config_resetstat()
    c.get(NS, ks)
    c.exists(NS, ks)
    confirm(c, NS, keys(128, "more"))
    stats = admin.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 4  # get, exists, reserve, commit
    assert sum(v["calls"] for k, v in stats.items() if k != "cmdstat_evalsha" and "config" not in k) >= 4
    admin.close()
    c.close()


# ----------------------------------------------------------------------------- the store


def store(url, prefix, tmp_path, **kw):
    return HF3FSStore(HF3FSConfig(file_path_prefix=str(tmp_path / "hicache"), file_size=64 * PAGE, numjobs=2,
                                  entries=4, metadata_server_url=url, metadata_key_prefix=prefix,
                                  **{"client_timeout": 2, **kw}), EngineContext())


def test_stale_entry_is_a_miss_never_another_keys_bytes(redis_url, tmp_path):  # noqa: F811
    """What a promoted replica that was behind looks like: key A mapped to the slot where B's
    page now lies. The read is a miss, the stale entry is dropped, A can be written again."""
    url, prefix = redis_url
    s = store(url, prefix, tmp_path)
    t = PageStoreConformance()
    a, b = t.keys(1, "a")[0], t.keys(1, "b")[0]
    assert t.write(s, [a, b]) == [True, True]
    c = rm(url, prefix)
    (sa, sb), (ga, gb), _ = c.get(s.ns, [a.encode(), b.encode()])
    # rewrite A's index entry to name B's slot and generation, and then B's slot with A's generation
    kname = c._ns_keys(s.ns)[1]
    import struct

    for slot, gen in ((sb, gb), (sb, ga)):
        c._r.hset(kname, key_digests([a.encode()]), struct.pack("<qqI", slot, gen, 0))
        ok, buf = t.read(s, [a, b])
        assert ok == [False, True], (slot, gen)
        check_page(b, buf.read(1))
        assert s.exists([a]) == [False]  # dropped by the read
    assert s.stale_reads == 2 and s.stats().extra["verify_pages"] is True
    assert t.write(s, [a]) == [True]
    ok, buf = t.read(s, [a])
    assert ok == [True]
    check_page(a, buf.read(0))
    c.close()
    s.close()


def test_verify_pages_off_shows_why_it_is_on(redis_url, tmp_path):  # noqa: F811
    url, prefix = redis_url
    s = store(url, prefix, tmp_path, verify_pages="off")
    t = PageStoreConformance()
    a, b = t.keys(1, "a")[0], t.keys(1, "b")[0]
    t.write(s, [a, b])
    c = rm(url, prefix)
    _, _, _ = c.get(s.ns, [a.encode()])
    (sb,), (gb,), _ = c.get(s.ns, [b.encode()])
    import struct

    c._r.hset(c._ns_keys(s.ns)[1], key_digests([a.encode()]), struct.pack("<qqI", sb, gb, 0))
    ok, buf = t.read(s, [a])
    assert ok == [True]  # without the check: B's bytes handed out as A's
    with pytest.raises(AssertionError, match="another key"):
        check_page(a, buf.read(0))
    c.close()
    s.close()


def test_dead_index_is_a_bounded_miss(tmp_path):
    srv = RedisProcess("127.0.0.1", free_port(), tmp_path / "r", Durability("volatile", appendonly=False)).start()
    s = store(f"redis://127.0.0.1:{srv.port}", "kvc-dead", tmp_path, client_timeout=1.0)
    t = PageStoreConformance()
    ks = t.keys(4)
    assert t.write(s, ks) == [True] * 4
    srv.stop()  # SIGSTOP: connections hang, they are not refused
    try:
        bound = bound_s(1.0, 3)
        for op in (lambda: t.read(s, ks)[0], lambda: t.write(s, t.keys(4)), lambda: s.exists(ks)):
            t0 = time.monotonic()
            assert op() == [False] * 4
            assert time.monotonic() - t0 < bound
    finally:
        srv.cont()
        srv.terminate()
    assert s.stats().errors > 0
    s.close()


def test_unreachable_index_fails_the_start(tmp_path):
    with pytest.raises(BackendUnavailable, match="metadata_server_url"):
        store(f"redis://127.0.0.1:{free_port()}", "kvc", tmp_path, client_timeout=0.5)


# ----------------------------------------------------------------------------- TLS + ACL


@pytest.fixture
def tls_server(tmp_path):
    d = tmp_path / "tls"
    d.mkdir()

    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=kvc-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "srv.crt",
        "-days", "2", "-extfile", "ext")
    port = free_port()
    srv = RedisProcess("127.0.0.1", port, tmp_path / "r", Durability("volatile", appendonly=False), extra={
        "port": "0", "tls-port": str(port), "tls-cert-file": str(d / "srv.crt"), "tls-key-file": str(d / "srv.key"),
        "tls-ca-cert-file": str(d / "ca.crt"), "tls-auth-clients": "no",
        "user": "default off\nuser kvc on >s3cret-pw ~kvc:* +@all"})
    srv.start()
    yield srv, d
    srv.terminate()


def test_tls_with_acl_user_and_password_file(tls_server, tmp_path):
    srv, d = tls_server
    (tmp_path / "pw").write_text("s3cret-pw\n")
    url = f"rediss://kvc@127.0.0.1:{srv.port}"
    s = store(url, "kvc:tls", tmp_path, auth_token_file=str(tmp_path / "pw"), metadata_tls_ca_file=str(d / "ca.crt"))
    t = PageStoreConformance()
    ks = t.keys(8)
    assert t.write(s, ks) == [True] * 8
    ok, buf = t.read(s, ks)
    assert ok == [True] * 8
    for i, k in enumerate(ks):
        check_page(k, buf.read(i))
    s.close()
    (tmp_path / "bad").write_text("wrong")
    with pytest.raises(ConfigError, match="auth_token"):
        store(url, "kvc:tls", tmp_path, auth_token_file=str(tmp_path / "bad"), metadata_tls_ca_file=str(d / "ca.crt"))
    with pytest.raises((BackendUnavailable, ConfigError)):  # no trust in the server's certificate
        store(url, "kvc:tls", tmp_path, auth_token_file=str(tmp_path / "pw"), client_timeout=1)
