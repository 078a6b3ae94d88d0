"""Real Redis primaries, replicas and sentinels for tests, the benchmark and the docs' deployment.

* ``RedisProcess``: one ``redis-server`` (Debian's package; Valkey's ``valkey-server`` where
  installed) bound to one address, with the durability settings of a ``Durability``;
  ``kill9()``, ``stop()`` / ``cont()`` (SIGSTOP / SIGCONT), ``start()`` again.
* ``SentinelProcess``: one ``redis-sentinel`` watching the primary, tuned for fast failover
  (``SENTINEL_SETTINGS``: the values docs/hf3fs_ha.md documents).
* ``RedisHA``: a primary, replicas and three sentinels, either all on 127.0.0.1 (ports
  chosen free) or each node in a network namespace of a ``kvconnect.connectors.testing.netns.Bridge``
  (node 0: primary + sentinel, node 1: replica + sentinel, node 2: sentinel, node 3 and
  up: clients), so that a test can cut the primary off the network. ``url`` is the
  ``redis+sentinel://`` URL a store uses.
* ``RedisClusterSet``: a Redis Cluster (``redis-server --cluster-enabled yes``) of
  ``shards`` primaries (the 16384 hash slots split evenly) and ``replicas`` replicas per
  primary, every node on 127.0.0.1 on a free port, formed with ``CLUSTER MEET`` /
  ``ADDSLOTSRANGE`` / ``REPLICATE`` (so one shard works too, which ``redis-cli --cluster
  create`` refuses). Settings for a failover within a few seconds (``CLUSTER_SETTINGS``, as
  docs/hf3fs_ha.md documents). ``url`` is the ``redis+cluster://`` URL a store (or any
  client of the page index) uses; ``primary_for(key)`` / ``primary_of_slot(slot)`` name the
  node serving a key now, ``nodes[i].kill9()`` and ``nodes[i].start()`` crash and restart a
  node (it rejoins from its ``nodes.conf``, as a replica if it was failed over),
  ``wait_failover(old, slot)`` waits for another primary of a slot. Use::

      with RedisClusterSet(shards=3, replicas=1) as cluster:
          store_config["metadata_server_url"] = cluster.url

Nothing here listens on anything but loopback or addresses inside namespaces it made.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvconnect.connectors.testing.processes import stop as stop_process

SLOTS = 16384

MASTER = "kvc"

# Sentinel settings for a failover within a few seconds (documented in docs/hf3fs_ha.md):
# a primary silent for 1 s is subjectively down; two sentinels agreeing make it objectively
# down and elect a leader, which promotes the best replica. An election whose votes split
# (two sentinels left when the primary's node is cut off) is retried after twice the
# failover timeout: 6 s here, 20 s with Redis's default (seen: a 25 s failover).
SENTINEL_SETTINGS = {"down-after-milliseconds": 1000, "failover-timeout": 3000, "parallel-syncs": 1}


def server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


def sentinel_binary() -> str | None:
    return shutil.which("redis-sentinel") or shutil.which("valkey-sentinel")


def redis_skip_reason() -> str | None:
    """None if real servers can be started here, else why not."""
    if server_binary() is None or sentinel_binary() is None:
        return "redis-server / redis-sentinel not installed (Debian: apt-get install redis-server redis-sentinel)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis client is not installed (pip install 'kvconnect[redis]')"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Durability:
    """What a confirmed page survives (server settings plus the client's ``WAIT``)."""

    name: str
    appendonly: bool = True
    appendfsync: str = "everysec"  # always | everysec | no
    wait_replicas: int = 0  # the store's metadata_wait_replicas
    min_replicas_to_write: int = 0

    def server_conf(self) -> dict[str, str]:
        conf = {"appendonly": "yes" if self.appendonly else "no", "appendfsync": self.appendfsync}
        if self.min_replicas_to_write:
            conf.update({"min-replicas-to-write": str(self.min_replicas_to_write), "min-replicas-max-lag": "5"})
        return conf


DURABILITY = {
    "async": Durability("async"),  # AOF fsync every second, asynchronous replication
    "wait": Durability("wait", wait_replicas=1),  # + WAIT 1 replica on every confirm
}


def _ns_prefix(netns: str | None) -> list[str]:
    return ["ip", "netns", "exec", netns] if netns else []


class _Proc:
    """A child process with its own directory, started from a config file."""

    kind = "redis"

    def __init__(self, host: str, port: int, workdir: Path, netns: str | None = None, password: str | None = None):
        self.host = host
        self.port = port
        self.password = password
        self.dir = workdir
        self.netns = netns
        self.proc: subprocess.Popen | None = None
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 15.0) -> "_Proc":
        log = open(self.dir / f"{self.kind}.out", "ab")
        self.proc = subprocess.Popen(_ns_prefix(self.netns) + self._command(), cwd=self.dir, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} {self.addr} exited: {self.tail()}")
            try:
                if self._ready():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.kind} {self.addr} did not answer within {timeout:g} s: {self.tail()}")

    def _ready(self) -> bool:
        return self.command("PING") in (b"PONG", "PONG", True)

    def tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / f"{self.kind}.out").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def client(self, timeout: float = 2.0):
        import redis

        return redis.Redis(self.host, self.port, socket_timeout=timeout, socket_connect_timeout=timeout,
                           password=self.password, driver_info=None)

    def command(self, *args, timeout: float = 2.0):
        """One command over a fresh connection (from this process: loopback only, or a
        process in the node's namespace for namespaced nodes)."""
        if self.netns:
            auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
            out = subprocess.run(_ns_prefix(self.netns) + ["redis-cli", "-h", self.host, "-p", str(self.port), *auth,
                                                           *map(str, args)],
                                 capture_output=True, timeout=timeout + 5)
            return out.stdout.strip()
        c = self.client(timeout)
        try:
            return c.execute_command(*args)
        finally:
            c.close()

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGSTOP: a stall, not a crash (the kernel still accepts connections)."""
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def terminate(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            stop_process(self.proc, 10)


class RedisProcess(_Proc):
    kind = "redis"

    def __init__(self, host: str, port: int, workdir: Path, durability: Durability = DURABILITY["async"],
                 replica_of: tuple[str, int] | None = None, netns: str | None = None,
                 extra: dict[str, str] | None = None, password: str | None = None):
        super().__init__(host, port, workdir, netns, password)
        self.durability = durability
        self.replica_of = replica_of
        self.extra = dict(extra or {})

    def _ready(self) -> bool:
        if "tls-port" in self.extra:  # TLS only: a plain PING cannot be answered; the port listening will do
            with socket.create_connection((self.host, self.port), timeout=1):
                return True
        return super()._ready()

    def _command(self) -> list[str]:
        conf = {"port": str(self.port), "bind": self.host, "dir": str(self.dir), "daemonize": "no",
                "save": '""', "protected-mode": "no", "repl-diskless-sync": "yes",
                "repl-diskless-sync-delay": "0", "logfile": '""', **self.durability.server_conf(), **self.extra}
        if self.replica_of:
            conf["replicaof"] = f"{self.replica_of[0]} {self.replica_of[1]}"
        if self.password:  # what docs/hf3fs_ha.md deploys: one password, for clients and replication
            conf.update(requirepass=self.password, masterauth=self.password)
        path = self.dir / "redis.conf"
        path.write_text("".join(f"{k} {v}\n" for k, v in conf.items()))
        return [server_binary(), str(path)]


class SentinelProcess(_Proc):
    kind = "sentinel"

    def __init__(self, host: str, port: int, workdir: Path, primary: tuple[str, int], quorum: int = 2,
                 netns: str | None = None, settings: dict | None = None, password: str | None = None):
        super().__init__(host, port, workdir, netns, password)
        self.primary = primary
        self.quorum = quorum
        self.settings = {**SENTINEL_SETTINGS, **(settings or {})}

    def _command(self) -> list[str]:
        lines = [f"port {self.port}", f"bind {self.host}", f"dir {self.dir}", "daemonize no", 'logfile ""',
                 "protected-mode no", "sentinel resolve-hostnames no",
                 f"sentinel monitor {MASTER} {self.primary[0]} {self.primary[1]} {self.quorum}"]
        lines += [f"sentinel {k} {MASTER} {v}" for k, v in self.settings.items()]
        if self.password:  # the data nodes' password, and the sentinels' own (metadata_sentinel_auth)
            lines += [f"sentinel auth-pass {MASTER} {self.password}", f"requirepass {self.password}"]
        path = self.dir / "sentinel.conf"
        path.write_text("\n".join(lines) + "\n")
        return [sentinel_binary(), str(path)]


class _NodeGroup:
    """What ``RedisHA`` and ``RedisClusterSet`` share: their processes (``_processes``), a
    work directory they may own, a node by address, and the context manager."""

    def _own_workdir(self, prefix: str) -> None:
        self._own_dir = self.workdir is None
        self.workdir = Path(self.workdir or tempfile.mkdtemp(prefix=prefix))

    def _processes(self) -> list[_Proc]:
        raise NotImplementedError

    def node_at(self, addr: tuple[str, int]) -> RedisProcess:
        return next(n for n in self.nodes if (n.host, n.port) == addr)

    def close(self) -> None:
        for p in self._processes():
            p.terminate()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class RedisHA(_NodeGroup):
    """A primary, ``replicas`` replicas and three sentinels (see the module docstring).

    Args:
        durability: server settings of every data node.
        replicas: replicas of the primary (1 or more).
        bridge: a ``kvconnect.connectors.testing.netns.Bridge`` of at least 4 nodes to place the nodes in
            (None: everything on 127.0.0.1).
    """

    durability: Durability = field(default_factory=lambda: DURABILITY["async"])
    replicas: int = 1
    bridge: object | None = None
    workdir: Path | None = None
    sentinel_settings: dict | None = None
    password: str | None = None
    nodes: list[RedisProcess] = field(default_factory=list)
    sentinels: list[SentinelProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._own_workdir("kvc-redis-ha-")

    def _place(self, i: int) -> tuple[str, str | None]:
        """(address, namespace) of node ``i`` (data node i; sentinel i)."""
        if self.bridge is None:
            return "127.0.0.1", None
        return self.bridge.addrs[i], self.bridge.names[i]

    @property
    def client_netns(self) -> str | None:
        """Where clients run: the first node with no server (None: loopback, this namespace)."""
        return None if self.bridge is None else self.bridge.names[max(3, self.replicas + 1)]

    def _port(self, default: int) -> int:
        return default if self.bridge is not None else free_port()

    def start(self, timeout: float = 30.0) -> "RedisHA":
        try:
            host, ns = self._place(0)
            primary = RedisProcess(host, self._port(6379), self.workdir / "node0", self.durability, netns=ns,
                                   password=self.password)
            self.nodes.append(primary.start())
            for r in range(self.replicas):
                host, ns = self._place(r + 1)
                self.nodes.append(RedisProcess(host, self._port(6380 + r), self.workdir / f"node{r + 1}",
                                               self.durability, replica_of=(primary.host, primary.port),
                                               netns=ns, password=self.password).start())
            for i in range(3):
                host, ns = self._place(i)
                self.sentinels.append(SentinelProcess(host, self._port(26379 + i), self.workdir / f"sentinel{i}",
                                                      (primary.host, primary.port), netns=ns,
                                                      settings=self.sentinel_settings,
                                                      password=self.password).start())
            self.wait_ready(timeout)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def primary(self) -> RedisProcess:
        return self.nodes[0]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(s.addr for s in self.sentinels) + f"/{MASTER}"

    def _sentinel_state(self, s: SentinelProcess) -> dict:
        rep = s.command("SENTINEL", "MASTER", MASTER)
        if isinstance(rep, dict):  # parsed by the redis client
            dec = (lambda x: x.decode() if isinstance(x, bytes) else str(x))
            return {dec(k).replace("_", "-"): dec(v) for k, v in rep.items()}
        if isinstance(rep, (bytes, str)):  # redis-cli output: name\nvalue\n...
            items = (rep.decode() if isinstance(rep, bytes) else rep).split("\n")
        else:
            items = [x.decode() if isinstance(x, bytes) else str(x) for x in rep]
        return dict(zip(items[::2], items[1::2]))

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Every sentinel sees the primary, every replica and the two other sentinels, and
        every replica is in sync."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                ok = True
                for s in self.sentinels:
                    st = self._sentinel_state(s)
                    last = f"{s.addr}: {st.get('num-slaves')} replicas, {st.get('num-other-sentinels')} sentinels"
                    if int(st.get("num-slaves", 0)) < self.replicas or int(st.get("num-other-sentinels", 0)) < 2:
                        ok = False
                        break
                for r in self.nodes[1:]:
                    info = r.command("INFO", "replication")
                    if isinstance(info, dict):
                        info = "\n".join(f"{k}:{v}" for k, v in info.items())
                    text = info.decode() if isinstance(info, bytes) else info
                    if "master_link_status:up" not in text:
                        ok = False
                        last = f"{r.addr} not in sync"
                if ok:
                    return
            except Exception as e:  # noqa: BLE001 - not yet
                last = repr(e)
            time.sleep(0.1)
        raise TimeoutError(f"redis HA set did not settle within {timeout:g} s ({last})")

    def master_addr(self, via: int | None = None) -> tuple[str, int] | None:
        """The primary the sentinels name (the first one that answers, or sentinel ``via``)."""
        for s in ([self.sentinels[via]] if via is not None else self.sentinels):
            try:
                rep = s.command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER, timeout=0.5)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(rep, (bytes, str)):
                parts = (rep.decode() if isinstance(rep, bytes) else rep).split()
            else:
                parts = [x.decode() if isinstance(x, bytes) else str(x) for x in (rep or [])]
            if len(parts) == 2:
                return parts[0], int(parts[1])
        return None

    def wait_failover(self, old: tuple[str, int], timeout: float = 30.0, via: int | None = None) -> float:
        """Seconds until the sentinels name a primary other than ``old``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            addr = self.master_addr(via)
            if addr is not None and addr != old:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise TimeoutError(f"no failover away from {old} within {timeout:g} s")

    def _processes(self) -> list[_Proc]:
        return self.sentinels + self.nodes


# Redis Cluster settings for a failover within a few seconds (documented in docs/hf3fs_ha.md):
# a primary silent for 1 s is failing; once most primaries agree, its replica is elected
# (~0.5-1.5 s more). ``replica-validity-factor 0``: a replica always stands, however long its
# link was down (else a shard can stay without a primary). ``require-full-coverage no``: the
# other shards keep serving while one shard has no primary. No replica migration: the
# test's shards keep their own replica.
CLUSTER_SETTINGS = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf", "cluster-node-timeout": "1000",
                    "cluster-replica-validity-factor": "0", "cluster-require-full-coverage": "no",
                    "cluster-allow-replica-migration": "no"}


def _text(rep) -> str:
    return rep.decode() if isinstance(rep, bytes) else str(rep)


@dataclass
class RedisClusterSet(_NodeGroup):
    """A Redis Cluster on 127.0.0.1 (see the module docstring).

    Args:
        shards: primaries, each serving an even share of the hash slots.
        replicas: replicas per primary (0: none; a shard then cannot fail over).
        durability: server settings of every node.
        settings: ``CLUSTER_SETTINGS`` overrides.
        password: ``requirepass`` / ``masterauth`` of every node.
        extra: more server settings of every node (e.g. ``io-threads``).
    """

    shards: int = 3
    replicas: int = 1
    durability: Durability = field(default_factory=lambda: DURABILITY["async"])
    workdir: Path | None = None
    settings: dict | None = None
    password: str | None = None
    extra: dict | None = None
    nodes: list[RedisProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.shards < 1 or self.replicas < 0:
            raise ValueError(f"shards must be >= 1 and replicas >= 0, got {self.shards}, {self.replicas}")
        self._own_workdir("kvc-redis-cluster-")

    def start(self, timeout: float = 30.0) -> "RedisClusterSet":
        """Start the nodes (primaries first: node ``i < shards`` is shard ``i``'s primary,
        node ``shards * (1 + r) + i`` its replica ``r``) and form the cluster."""
        conf = {**CLUSTER_SETTINGS, **(self.settings or {}), **(self.extra or {})}
        try:
            for i in range(self.shards * (1 + self.replicas)):
                # the bus port named, not the default (port + 10000: above 65535 for a high free port)
                self.nodes.append(RedisProcess("127.0.0.1", free_port(), self.workdir / f"node{i}", self.durability,
                                               extra={**conf, "cluster-port": str(free_port())},
                                               password=self.password).start())
            first = self.nodes[0]
            for n in self.nodes[1:]:
                n.command("CLUSTER", "MEET", first.host, first.port, first.extra["cluster-port"])
            for i in range(self.shards):
                lo, hi = i * SLOTS // self.shards, (i + 1) * SLOTS // self.shards - 1
                self.nodes[i].command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            self._wait(lambda: all(len(self._node_lines(n)) == len(self.nodes) for n in self.nodes), timeout,
                       "every node to know every other")
            for j, n in enumerate(self.nodes[self.shards:]):
                n.command("CLUSTER", "REPLICATE", self.node_id(self.nodes[j % self.shards]))
            self.wait_ready(timeout)
        except BaseException:
            self.close()
            raise
        return self

    # -- what the cluster says ----------------------------------------------------------
    def _node_lines(self, node: RedisProcess) -> list[list[str]]:
        """``CLUSTER NODES`` as split lines (id, addr, flags, master, ..., slots)."""
        return [line.split() for line in _text(node.command("CLUSTER", "NODES")).splitlines() if line.strip()]

    def node_id(self, node: RedisProcess) -> str:
        return _text(node.command("CLUSTER", "MYID"))

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                if ok():
                    return
            except Exception as e:  # noqa: BLE001 - not yet
                last = f" ({e!r})"
            time.sleep(0.05)
        raise TimeoutError(f"redis cluster: no {what} within {timeout:g} s{last}")

    def wait_ready(self, timeout: float = 30.0, nodes: list[RedisProcess] | None = None) -> None:
        """Every live node (or those of ``nodes``) says ``cluster_state:ok`` with all slots
        served, and every replica's link to its primary is up."""
        def ready() -> bool:
            live = [n for n in self.nodes if n.proc and n.proc.poll() is None]
            for n in nodes or live:
                if len(live) == len(self.nodes):  # all up: every node knows every node's role, none failing
                    flags = [line[2] for line in self._node_lines(n)]
                    if sum("slave" in f for f in flags) != self.shards * self.replicas or any(
                            x in f for f in flags for x in ("fail", "handshake", "noaddr")):
                        return False
                info = _text(n.command("CLUSTER", "INFO"))
                if "cluster_state:ok" not in info or f"cluster_slots_ok:{SLOTS}" not in info:
                    return False
                repl = n.command("INFO", "replication")  # parsed into a dict by the client
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return False
            return True

        self._wait(ready, timeout, "settled cluster")

    def slots(self, via: RedisProcess | None = None) -> list[tuple[int, int, tuple[str, int]]]:
        """(first slot, last slot, primary address) per slot range, as a live node says."""
        for n in [via] if via else [n for n in self.nodes if n.proc and n.proc.poll() is None]:
            try:
                rep = n.command("CLUSTER", "SLOTS", timeout=0.5)
            except Exception:  # noqa: BLE001 - that node is down: ask another
                continue
            return [(int(r[0]), int(r[1]), (_text(r[2][0]) or n.host, int(r[2][1]))) for r in rep]
        raise RuntimeError("no live node answers CLUSTER SLOTS")

    @staticmethod
    def slot_of(key: str | bytes) -> int:
        from redis.crc import key_slot

        return key_slot(key.encode() if isinstance(key, str) else key)

    def primary_of_slot(self, slot: int, via: RedisProcess | None = None) -> RedisProcess | None:
        for lo, hi, addr in self.slots(via):
            if lo <= slot <= hi:
                return self.node_at(addr)
        return None

    def primary_for(self, key: str | bytes) -> RedisProcess | None:
        """The node serving ``key`` now (None: no primary for its slot)."""
        return self.primary_of_slot(self.slot_of(key))

    def primaries(self) -> list[RedisProcess]:
        return [self.node_at(addr) for _, _, addr in self.slots()]

    def wait_failover(self, old: RedisProcess, slot: int, timeout: float = 30.0) -> float:
        """Seconds until a live node names a primary other than ``old`` for ``slot``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                now = self.primary_of_slot(slot)
            except RuntimeError:
                now = None
            if now is not None and now is not old:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise TimeoutError(f"no failover of slot {slot} away from {old.addr} within {timeout:g} s")

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed (any one that answers will do)."""
        return "redis+cluster://" + ",".join(n.addr for n in self.nodes)

    def _processes(self) -> list[_Proc]:
        return self.nodes
