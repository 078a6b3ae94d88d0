"""The L3 configurations compared side by side, on the same servers and the same GPU budget.

A configuration names the server profile it needs (how SGLang is launched), the HiCache storage
backend attached at run time (``PUT /hicache/storage-backend``) with its extra config per server,
the side services it needs (metadata service, ``mooncake_master`` + store process, a peer seed node),
and where its store counters are scraped. Each one is deployed the way its deployment guide does:
SGLang's ``hf3fs`` with the mock client and ``mini_3fs_metadata_server``, SGLang's ``mooncake`` with
a standalone store process, PeerCache 0.8.4 as the peer-pool guide configures it (TCP here), and
every kvconnect store through ``--hicache-storage-backend dynamic``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

# SGLang's dynamic loader imports kvconnect's HiCache adapter from this module.
KVC_HICACHE = {"backend_name": "kvconnect", "module_path": "kvconnect.connectors.engines.sglang_hicache",
               "class_name": "KVConnectStorage", "interface_v1": 1}


@dataclass
class Setup:
    """What configurations are built from: ports, the work directory, sizes."""
    workdir: Path
    ports: dict
    servers: int
    l3_bytes_per_server: str = "16gb"   # memory each server lends (peer pools) or keeps (memory store)
    l3_file_bytes: int = 32 << 30        # hf3fs file size (shared by every server)
    write_behind: str = "0"              # kvconnect's staging buffer per server ("0": write through, no buffer)

    def data(self, name: str) -> Path:
        p = Path(self.workdir) / "data" / name
        p.mkdir(parents=True, exist_ok=True)
        return p

    @property
    def hf3fs_ref_config(self) -> Path:
        """The JSON that SGLang's own hf3fs backend reads (SGLANG_HICACHE_HF3FS_CONFIG_PATH, set at launch).

        kvconnect's hf3fs store reads the same variable (so existing deployments work unchanged) and
        overrides the file's keys with its inline options; the file must exist for both.
        """
        return Path(self.workdir) / "sglang_hf3fs.json"

    @property
    def lmcache_mp_config(self) -> Path:
        """The ``--lmcache-config-file`` of SGLang --enable-lmcache: where its lmcache server listens."""
        return Path(self.workdir) / "lmcache_mp.yaml"

    def write_lmcache_mp_config(self) -> None:
        self.lmcache_mp_config.write_text(f"mp_host: 127.0.0.1\nmp_port: {self.ports['lmcache_mp']}\n")

    def write_hf3fs_ref_config(self) -> None:
        import json

        prefix = self.data("sglang_hf3fs") / "hicache"
        self.hf3fs_ref_config.write_text(json.dumps({
            "file_path_prefix": str(prefix), "file_size": self.l3_file_bytes, "numjobs": 16, "entries": 8,
            "metadata_server_url": f"http://127.0.0.1:{self.ports['mini_3fs_meta']}"}))


@dataclass
class PD:
    """A 1P1D deployment (SGLang's PD guide): a prefill server on the first GPU, a decode server on
    the second, ``sglang_router --pd-disaggregation`` in front; the transfer backend is the configuration."""
    backend: str                                           # --disaggregation-transfer-backend
    pd_config: Callable[[Setup], Optional[dict]] = lambda s: None   # KVCONNECT_PD_CONFIG (kvconnect only)
    env: dict = field(default_factory=dict)                # both servers' extra environment
    late: bool = False                                     # decode's /generate arrives Plan.pd_decode_delay_s late

    def key(self, setup: Setup) -> tuple:
        """What the servers are launched with (a change relaunches them; ``late`` only the router)."""
        import json

        return self.backend, json.dumps(self.pd_config(setup), sort_keys=True), tuple(sorted(self.env.items()))


@dataclass
class Config:
    name: str
    kind: str                                  # baseline | kvconnect | anchor
    description: str
    backend: Optional[str] = None              # None: no L3 attached
    extra: Callable[[Setup, int], dict] = lambda s, i: {}
    services: tuple = ()
    profile: str = "hicache"
    metrics_url: Callable[[Setup, int], Optional[str]] = lambda s, i: None
    prepare: Callable[[Setup], None] = lambda s: None
    counterpart: Optional[str] = None          # kvconnect: the alternative it replaces (run next to it)
    pd: Optional[PD] = None                    # a PD deployment instead of HiCache servers

    @property
    def services_live_with_servers(self) -> bool:
        """Its services start before the servers and stop with them (a PD relay's store, which the
        servers open at launch; the lmcache server SGLang --enable-lmcache connects to), not per pair."""
        return self.pd is not None or self.profile == "lmcache"

    @property
    def launch_services(self) -> tuple:
        """The services ``Cluster.ensure`` starts with the servers (the others start per pair)."""
        return self.services if self.services_live_with_servers else ()


def _kvc(store: str, **options) -> Callable[[Setup, int], dict]:
    def build(s: Setup, i: int) -> dict:
        opts = {k: (v(s, i) if callable(v) else v) for k, v in options.items()}
        return {**KVC_HICACHE, "store": store, **opts, "metrics_port": s.ports["kvc_metrics"] + i,
                "write_behind": s.write_behind}
    return build


def _kvc_metrics(s: Setup, i: int) -> str:
    return f"http://127.0.0.1:{s.ports['kvc_metrics'] + i}/metrics"


def _peercache(s: Setup, i: int) -> dict:
    # The peer-pool guide's extra config, TCP instead of RDMA and every listener on loopback.
    return {"backend_name": "peercache", "module_path": "peercache.store", "class_name": "PeerCacheStore",
            "interface_v1": 1, "discovery_addr": f"127.0.0.1:{s.ports['peercache_discovery']}", "protocol": "tcp",
            "local_hostname": "127.0.0.1", "rdma_bind_host": "127.0.0.1", "control_bind_host": "127.0.0.1",
            "meta_bind_host": "127.0.0.1", "metrics_bind_host": "127.0.0.1",
            "metrics_port": s.ports["peercache_metrics"] + i, "global_segment_size": s.l3_bytes_per_server,
            "disk_path": str(s.data(f"peercache{i}")) + "/", "disk_size": "16gb"}


CONFIGS: dict[str, Config] = {c.name: c for c in [
    Config("l2_only", "baseline", "HiCache with GPU + host memory, no L3 (the baseline)"),
    Config("no_hicache", "reference", "no hierarchical cache: the GPU radix cache only (servers relaunched)",
           profile="plain"),
    Config("sglang_file", "anchor", "SGLang's built-in file backend", backend="file",
           extra=lambda s, i: {"file_storage_path": str(s.data("sglang_file"))},
           prepare=lambda s: s.data("sglang_file")),
    Config("sglang_hf3fs", "anchor", "SGLang's built-in hf3fs backend (mock client) + mini_3fs_metadata_server",
           backend="hf3fs", extra=lambda s, i: {"use_mock_hf3fs_client": True}, services=("mini_3fs_meta",),
           prepare=Setup.write_hf3fs_ref_config),
    Config("sglang_mooncake", "anchor", "SGLang's built-in mooncake backend + a standalone store process",
           backend="mooncake", services=("mooncake_store",),
           extra=lambda s, i: {"master_server_address": f"127.0.0.1:{s.ports['mooncake_master']}",
                               "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1",
                               "protocol": "tcp", "global_segment_size": 0}),
    Config("peercache", "anchor", "PeerCache 0.8.4, each server lends memory (TCP transport)",
           backend="dynamic", extra=_peercache,
           metrics_url=lambda s, i: f"http://127.0.0.1:{s.ports['peercache_metrics'] + i}/metrics"),
    Config("kvc_hf3fs", "kvconnect", "kvconnect hf3fs store (POSIX files) + kvconnect metadata service",
           backend="dynamic", services=("kvc_meta",), metrics_url=_kvc_metrics,
           extra=_kvc("hf3fs", file_path_prefix=lambda s, i: str(s.data("kvc_hf3fs") / "hicache"),
                      file_size=lambda s, i: s.l3_file_bytes, numjobs=16, entries=16,
                      metadata_server_url=lambda s, i: f"http://127.0.0.1:{s.ports['kvc_meta']}"),
           counterpart="sglang_hf3fs"),
    Config("kvc_hf3fs_wt", "reference",
           "kvc_hf3fs with write_behind off whatever --write-behind says (SGLang waits for every file write)",
           backend="dynamic", services=("kvc_meta",), metrics_url=_kvc_metrics,
           extra=lambda s, i: {**CONFIGS["kvc_hf3fs"].extra(s, i), "write_behind": "0"}),
    Config("kvc_peer_rdma", "kvconnect", "kvconnect peer pool, each server lends memory (Transfer Engine, TCP)",
           backend="dynamic", services=("peer_seed",), metrics_url=_kvc_metrics,
           extra=_kvc("peer_rdma", discovery_addr=lambda s, i: f"127.0.0.1:{s.ports['peer_seed']}", protocol="tcp",
                      local_hostname="127.0.0.1", control_port=0,
                      global_segment_size=lambda s, i: s.l3_bytes_per_server), counterpart="peercache"),
    Config("kvc_peer_rdma_shm", "kvconnect",
           "kvconnect peer pool, each server lends memory from shared memory (same-host pages are copied)",
           backend="dynamic", services=("peer_seed",), metrics_url=_kvc_metrics,
           extra=lambda s, i: {**CONFIGS["kvc_peer_rdma"].extra(s, i), "shared_segment": True},
           counterpart="peercache"),
    Config("kvc_mooncake", "kvconnect", "kvconnect mooncake store + a standalone store process (Transfer Engine, TCP)",
           backend="dynamic", services=("mooncake_store",), metrics_url=_kvc_metrics,
           extra=_kvc("mooncake", master_server_address=lambda s, i: f"127.0.0.1:{s.ports['mooncake_master']}",
                      protocol="tcp", local_hostname="127.0.0.1", global_segment_size=0),
           counterpart="sglang_mooncake"),
    Config("kvc_mooncake_shm", "kvconnect",
           "kvconnect mooncake store, the store process lends its segment from shared memory (same host)",
           backend="dynamic", services=("mooncake_store_shm",), metrics_url=_kvc_metrics,
           extra=_kvc("mooncake", master_server_address=lambda s, i: f"127.0.0.1:{s.ports['mooncake_master']}",
                      protocol="tcp", local_hostname="127.0.0.1", global_segment_size=0),
           counterpart="sglang_mooncake"),
    Config("kvc_memory", "kvconnect", "kvconnect in-process memory store (not shared between servers)",
           backend="dynamic", metrics_url=_kvc_metrics,
           extra=_kvc("memory", capacity=lambda s, i: s.l3_bytes_per_server), counterpart="sglang_file"),
]}


# -- LMCache in front of SGLang (``--configs lmcache_kvc_hf3fs,lmcache_fs``) -----------------------
# SGLang --enable-lmcache (no HiCache) on every server, all of them clients of one standalone
# ``lmcache server`` (LMCache's MP mode: one server per node), whose L2 is the configuration. The
# lmcache server is one of the configuration's services; it starts before the SGLang servers and
# lives as long as them (``Config.services_live_with_servers``).


def _lmcache_plugin_metrics(s: Setup, i: int) -> Optional[str]:
    # one lmcache server for all SGLang servers: its plugin's counters are scraped once, under server 0
    return f"http://127.0.0.1:{s.ports['lmcache_kvc_metrics']}/metrics" if i == 0 else None


LMCACHE_CONFIGS: dict[str, Config] = {c.name: c for c in [
    Config("lmcache_fs", "lmcache_anchor", "SGLang --enable-lmcache, one lmcache server for every SGLang server, "
           "LMCache's own fs L2 (files)", profile="lmcache", services=("lmcache_fs",)),
    Config("lmcache_kvc_hf3fs", "lmcache_kvconnect", "SGLang --enable-lmcache, one lmcache server for every SGLang "
           "server, kvconnect's L2 plugin over the hf3fs store + kvconnect metadata service", profile="lmcache",
           services=("kvc_meta", "lmcache_kvc_hf3fs"), metrics_url=_lmcache_plugin_metrics,
           counterpart="lmcache_fs"),
]}
CONFIGS.update(LMCACHE_CONFIGS)   # named with --configs; the default run (HiCache stores) leaves them out



# -- PD disaggregation (``kvconnect bench serve --pd``) -------------------------------------------
# Both Transfer Engine data planes over TCP (no RDMA NIC is assumed), SGLang's as kvconnect's.
PD_TIMEOUT = {"timeout_s": 120, "workers": 4}


def _relay(store: Callable[[Setup], dict]) -> Callable[[Setup], dict]:
    return lambda s: {"transport": "relay", **PD_TIMEOUT, "store": store(s)}


def _relay_mooncake(s: Setup) -> dict:
    return {"store": "mooncake", "master_server_address": f"127.0.0.1:{s.ports['mooncake_master']}",
            "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1", "protocol": "tcp",
            "global_segment_size": 0, "local_buffer_size": 0}


def _relay_hf3fs(s: Setup) -> dict:
    return {"store": "hf3fs", "file_path_prefix": str(s.data("pd_hf3fs") / "relay"), "file_size": s.l3_file_bytes,
            "metadata_server_url": f"http://127.0.0.1:{s.ports['kvc_meta']}", "numjobs": 16, "entries": 16}


PD_MOONCAKE = PD("mooncake", env={"MC_FORCE_TCP": "1"})
PD_DIRECT = PD("kvconnect", lambda s: {"transport": "direct", "protocol": "tcp", **PD_TIMEOUT})
PD_RELAY_MOONCAKE = PD("kvconnect", _relay(_relay_mooncake))
PD_RELAY_HF3FS = PD("kvconnect", _relay(_relay_hf3fs))


PD_BASELINE = "pd_mooncake"     # the capacity probe runs on it; kvconnect's planes are compared with it
PD_REFERENCE = "no_pd"          # outputs of every PD pair are compared with this one's
_LATE = "decode's request reaches it --pd-decode-delay-s after prefill's (a delaying proxy before decode)"


def _plane(name: str, what: str, pd: PD, services: tuple = (), metrics: bool = False) -> list[Config]:
    """A kvconnect data plane and, right after it (the same servers: only the router and proxy are
    restarted between them), its late-decode variant, compared with the direct plane's."""
    url = {"metrics_url": _kvc_metrics} if metrics else {}
    late = PD(pd.backend, pd.pd_config, pd.env, late=True)
    return [Config(name, "pd_kvconnect", f"1P1D, kvconnect {what}", profile="pd", pd=pd, services=services,
                   counterpart=PD_BASELINE, **url),
            Config(f"{name}_late", "pd_late", f"{name}, {_LATE}", profile="pd", pd=late, services=services,
                   counterpart=None if name == "pd_kvc_direct" else "pd_kvc_direct_late", **url)]


PD_CONFIGS: dict[str, Config] = {c.name: c for c in [
    Config(PD_REFERENCE, "reference", "one non-disaggregated server on the first GPU, no HiCache (the output "
           "reference of the PD pairs)", profile="plain"),
    Config(PD_BASELINE, "pd_anchor", "1P1D, SGLang's own mooncake transfer backend (Transfer Engine over TCP)",
           profile="pd", pd=PD_MOONCAKE),
    *_plane("pd_kvc_direct", "direct plane (one-sided Transfer Engine writes, TCP)", PD_DIRECT),
    *_plane("pd_kvc_relay_mooncake", "relay through a Mooncake store (mooncake_master + a standalone segment "
            "holder)", PD_RELAY_MOONCAKE, ("mooncake_store",), metrics=True),
    *_plane("pd_kvc_relay_hf3fs", "relay through the hf3fs store (shared files + kvconnect metadata service; "
            "needs KV in host memory)", PD_RELAY_HF3FS, ("kvc_meta",), metrics=True),
]}
# each *_late next to its plane: the same servers, only the router and proxy are restarted between them
CONFIGS.update(PD_CONFIGS)   # one table for run.py; the default (non-PD) run leaves these out
HICACHE_NAMES = [n for n in CONFIGS if n not in PD_CONFIGS and n not in LMCACHE_CONFIGS]


def pd_refusal(cfg: Config, setup: Setup, kv_device: str) -> Optional[str]:
    """Why ``cfg``'s relay store cannot serve KV on ``kv_device`` (the manager's own capability check,
    made before any server is launched), or None."""
    conf = cfg.pd.pd_config(setup) if cfg.pd else None
    if not conf or conf.get("transport") != "relay":
        return None
    from kvconnect.connectors.context import EngineContext
    from kvconnect.connectors.engines.pd_transport import ENV_CONFIG, relay_requirements
    from kvconnect.connectors.errors import MissingCapability, MissingDependency
    from kvconnect.connectors.registry import check_capabilities, store_class

    opts = dict(conf["store"])
    name = opts.pop("store")
    need = relay_requirements(EngineContext(engine="sglang-pd", device=kv_device))
    try:
        cls = store_class(name)
        check_capabilities(cls, cls.config_from_options(opts), name, tuple(need), need, ENV_CONFIG)
    except (MissingCapability, MissingDependency) as e:
        return f"{type(e).__name__}: {e}"
    return None


ANCHORS = [n for n, c in CONFIGS.items() if c.kind == "anchor"]
BASELINE = "l2_only"


def by_information(pairs: list) -> list:
    """Pairs reordered so the most informative finish first when time runs out: every workload's
    baseline, then each kvconnect store followed at once by the alternative it replaces (in the
    order the stores were given, workload by workload), then the rest in their given order."""
    names = [c for _, c in pairs]
    tiers: list = [[c for c in names if c == BASELINE]]
    for c in dict.fromkeys(names):
        if CONFIGS[c].kind in ("kvconnect", "lmcache_kvconnect"):
            tiers.append([c] + ([CONFIGS[c].counterpart] if CONFIGS[c].counterpart in names else []))
    rank: dict = {}
    for t, tier in enumerate(tiers):
        for k, c in enumerate(tier):
            rank.setdefault(c, (t, k))
    order = {name: i for i, name in enumerate(dict.fromkeys(w.name for w, _ in pairs))}

    def key(pair):
        tier, k = rank.get(pair[1], (len(tiers), names.index(pair[1])))
        return tier, order[pair[0].name], k
    return sorted(pairs, key=key)


def parse_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"--configs: unknown {', '.join(unknown)}; accepted values: {', '.join(CONFIGS)}")
    return names


def default_ports(base: int = 0) -> dict:
    """Fixed loopback ports (offset by ``base`` to run two benchmarks on one host)."""
    p = {"server": 30000, "router": 31000, "kvc_meta": 18000, "mini_3fs_meta": 18010, "mooncake_master": 50051,
         "mooncake_metrics": 9003, "mooncake_store_metrics": 9310, "peer_seed": 31998, "kvc_metrics": 9400,
         "peercache_discovery": 32998, "peercache_metrics": 31900, "pd_bootstrap": 8998, "pd_proxy": 31100,
         "lmcache_mp": 18020, "lmcache_http": 18021, "lmcache_kvc_metrics": 9390}
    return {k: v + base for k, v in p.items()}

