"""The Redis page index's configuration (URL forms, its keys, what is refused) and the page
identity sidecar, without servers."""

import os

import pytest

from kvconnect.connectors.base import ConfigError
from kvconnect.connectors.config import parse_config
from kvconnect.connectors.hf3fs.config import HF3FSConfig
from kvconnect.connectors.hf3fs.pageid import REC, ZERO, PageIds, ident, key_digest, key_digests
from kvconnect.connectors.hf3fs.redis_index import is_redis_url, parse_redis_url

BASE = {"file_path_prefix": "/tmp/kvc-unit/hicache", "file_size": "1mb", "numjobs": 1, "entries": 1}


def cfg(**kw):
    return parse_config(HF3FSConfig, {**BASE, **kw}, where="store 'hf3fs'")


@pytest.mark.parametrize("url, want", [
    ("redis://10.0.0.5:6379", dict(tls=False, sentinel=False, hosts=(("10.0.0.5", 6379),), master=None, db=0)),
    ("redis://kvc@meta.local/3", dict(hosts=(("meta.local", 6379),), username="kvc", db=3)),
    ("rediss://kvc@10.0.0.5:6380", dict(tls=True, username="kvc")),
    ("redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3/kvc",
     dict(sentinel=True, master="kvc", hosts=(("10.0.0.1", 26379), ("10.0.0.2", 26379), ("10.0.0.3", 26379)))),
    ("rediss+sentinel://u@[::1]:26379/kvc/2", dict(tls=True, sentinel=True, hosts=(("::1", 26379),), db=2,
                                                     username="u")),
    ("redis+cluster://kvc@10.0.0.1:7000,10.0.0.2:7001,10.0.0.3", dict(
        cluster=True, sentinel=False, master=None, db=0, username="kvc",
        hosts=(("10.0.0.1", 7000), ("10.0.0.2", 7001), ("10.0.0.3", 6379)))),
    ("redis+cluster://10.0.0.1:7000/", dict(cluster=True, hosts=(("10.0.0.1", 7000),))),
])
def test_redis_urls(url, want):
    assert is_redis_url(url)
    u = parse_redis_url(url)
    for k, v in want.items():
        assert getattr(u, k) == v, k
    assert cfg(metadata_server_url=url).metadata_server_url == url


@pytest.mark.parametrize("url, match", [
    ("redis://kvc:secret@h:6379", "password in the URL"),
    ("redis+sentinel://h:26379", "master"),
    ("redis://h1:6379,h2:6379", "several hosts"),
    ("redis://h:99999", "bad port"),
    ("redis://h:6379/db0", "database number"),
    ("redis://h:6379?ssl=1", "query"),
    ("redis://", "no host"),
    ("redis+cluster://h1:7000,h2:7000/3", "one database"),
    ("redis+cluster://h1:7000/kvc", "nothing may follow"),
    ("redis+cluster://h1:7000,,h2:7000", "no host"),
    ("redis+cluster://kvc:pw@h1:7000", "password in the URL"),
    ("rediss+cluster://h1:7000", "TLS to a Redis Cluster"),
])
def test_bad_redis_urls_name_the_key_and_the_forms(url, match):
    with pytest.raises(ConfigError, match=match) as e:
        cfg(metadata_server_url=url)
    assert e.value.key == "metadata_server_url"
    assert "redis+sentinel://" in str(e.value)  # the accepted forms


def test_kvconnect_service_urls_still_accepted():
    assert not is_redis_url("http://10.0.0.5:18000")
    assert cfg(metadata_server_url="http://10.0.0.5:18000").metadata_server_url


@pytest.mark.parametrize("opts, key", [
    ({"metadata_server_url": "http://h:18000", "metadata_wait_replicas": 1}, "metadata_wait_replicas"),
    ({"metadata_wait_replicas": 1}, "metadata_wait_replicas"),  # no URL: in-process index
    ({"metadata_server_url": "redis://h:6379", "metadata_wait_replicas": -1}, "metadata_wait_replicas"),
    ({"metadata_server_url": "redis://h:6379", "metadata_wait_replicas": 1, "metadata_wait_timeout": 9},
     "metadata_wait_timeout"),
    ({"metadata_server_url": "redis://h:6379", "metadata_wait_timeout": 0}, "metadata_wait_timeout"),
    ({"metadata_server_url": "redis://h:6379", "metadata_key_prefix": "a{b}"}, "metadata_key_prefix"),
    ({"metadata_server_url": "redis://h:6379", "metadata_tls_ca_file": __file__}, "metadata_tls_ca_file"),
    ({"metadata_server_url": "rediss://h:6379", "metadata_tls_ca_file": "/nonexistent/ca.pem"},
     "metadata_tls_ca_file"),
    ({"metadata_server_url": "rediss://h:6379", "metadata_tls_cert_file": __file__}, "metadata_tls_key_file"),
    ({"metadata_server_url": "redis://h:6379", "verify_pages": "sometimes"}, "verify_pages"),
    ({"metadata_server_url": "redis+cluster://h:7000", "metadata_sentinel_auth": True}, "metadata_sentinel_auth"),
])
def test_bad_redis_keys_name_the_key(opts, key):
    with pytest.raises(ConfigError) as e:
        cfg(**opts)
    assert e.value.key == key, str(e.value)


@pytest.mark.parametrize("mapped", [False, True])
def test_identity_records(tmp_path, mapped):
    a, b = ident(b"key-a", 7), ident(b"key-b", 7)
    assert len(a) == REC and a != b and a != ident(b"key-a", 8) and a != ZERO
    hexkey = os.urandom(32).hex().encode()
    assert key_digest(hexkey) == bytes.fromhex(hexkey[:32].decode())  # SGLang's keys: read, not hashed
    assert key_digests([hexkey, b"other"]) == key_digest(hexkey) + key_digest(b"other")
    ids = PageIds(str(tmp_path / "f.bin.ids"), 16, mapped=mapped)
    assert os.path.getsize(tmp_path / "f.bin.ids") == 16 * REC
    slots = [3, 4, 5, 9, 4]  # a run, a gap, a repeat
    assert ids.read(slots) == [ZERO] * 5
    ids.publish([3, 4, 5, 9], [a, b, a, b])
    assert ids.read(slots) == [a, b, a, b, b]
    assert ids.checked_read([3, 4, 5], [a, b, a], lambda: [True, True, False]) == [True, True, False]
    assert ids.checked_read([3, 4, 9], [a, a, b], lambda: [True, True, True]) == [True, None, True]  # 4 holds b

    def rewritten():  # slot 5 is given to another page while it is read
        ids.clear([5])
        ids.publish([5], [b])
        return [True, True]

    assert ids.checked_read([4, 5], [b, a], rewritten) == [True, None]
    ids.clear([4, 9])  # being rewritten
    assert ids.read([3, 4, 9]) == [a, ZERO, ZERO]
    assert ids.read([40]) == [ZERO]  # beyond the file: no record
    ids.close()
    assert PageIds(str(tmp_path / "f.bin.ids"), 16).read([3, 5]) == [a, b]  # on disk for the next process


def test_batch_identity_records_equal_one_at_a_time():
    """``idents`` (one buffer for a batch) gives what ``ident`` gives key by key: hex keys,
    other keys, a digest that starts with eight zero bytes (never an all-zero record), a
    generation too large for the fast path, an empty batch."""
    from kvconnect.connectors.hf3fs.pageid import _runs, idents

    hexkeys = [os.urandom(32).hex().encode() for _ in range(130)]
    for keys in (hexkeys, [f"key-{i}".encode() for i in range(130)], [b"0" * 64, hexkeys[0]], []):
        gens = [i * 7 + 1 for i in range(len(keys))]
        assert idents(keys, gens) == [ident(k, g) for k, g in zip(keys, gens)]
    assert idents([b"0" * 64], [3])[0][:1] == b"\x01"
    assert idents([b"k"], [1 << 70]) == [ident(b"k", 1 << 70)]
    # runs of slots: the one-run shortcut and the general case agree
    assert _runs([5, 6, 7]) == [(5, [0, 1, 2])]
    assert _runs([7, 5, 6, 9, 6]) == [(5, [1, 2, 4, 0]), (9, [3])]
