"""Loads a topology YAML, and the model and cluster profiles it names, into immutable typed objects.

Only the shape is checked here (known keys, value types) so that a typo fails loudly instead of being
ignored; whether the topology can actually run (addresses, TP sizes, ports) is `validate`'s job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml

ROLES = ("prefill", "decode")
PER_RANK_KEY = "per_attn_dp_rank"

_TOPOLOGY_KEYS = {"name", "model", "cluster", "prefill", "decode", "lb", "hosts", "env", "shared_gpus"}
_ROLE_KEYS = {"groups", "nodes", "gpus", "tp", "base_gpu_id", "port", "bootstrap_port", "dist_init_port", "args", "env"}
_PROFILE_KEYS = {"model_path", "num_routed_experts", "attention_dp", "common", *ROLES}
_SECTION_KEYS = {"args", "env"}
_CLUSTER_KEYS = {"gpus_per_node", "ib_devices", "python", "bind_host", "ports", "env", "kubernetes"}
_PORT_KEYS = {"http", "bootstrap", "dist_init", "lb"}
_LB_KEYS = {"host", "port", "policy", "args"}
_FLAG_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_DEFAULT_PORTS = {"http": 30000, "bootstrap": 8998, "dist_init": 5757, "lb": 8000}
# SGLang binds dist_init_port and the next 6 ports on a group's node 0 when attention DP is on
# (PortArgs.init_new: port_base = dist_init_port + 1, then +1..+5); reserve them all.
DIST_INIT_PORT_SPAN = 7


class ConfigError(Exception):
    """A config that cannot run; carries every problem found, each naming what is wrong and the fix."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = list(problems)
        super().__init__(str(self))

    def __str__(self) -> str:
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"{self.source}: {n} problem{'s' if n != 1 else ''}, nothing was started:\n{lines}"


@dataclass(frozen=True)
class RoleSpec:
    """One role (prefill or decode): how many groups, their shape, ports and the merged SGLang args/env."""

    role: str
    groups: int
    nodes: int
    gpus: int
    tp: int
    base_gpu_id: int | None
    port: int
    bootstrap_port: int
    dist_init_port: int
    args: Mapping[str, Any]
    env: Mapping[str, str]


@dataclass(frozen=True)
class LBSpec:
    host: str | None  # None: the first host of the topology
    port: int
    policy: str | None
    args: Mapping[str, Any]


@dataclass(frozen=True)
class Node:
    """One node of a group, where it runs and what it takes there.

    Groups of one role whose node 0 shares a host (several small servers on one multi-GPU host) sit side by
    side: the k-th such group (its `slot`) takes the role's GPUs and ports shifted by k groups, so one
    topology entry describes them all without a port or GPU clash."""

    rank: int  # global: prefill groups first, then decode groups
    role: str
    group: int
    node_rank: int  # within its group
    host: str | None
    slot: int = 0  # groups of this role placed on the same host before this one
    base_gpu_id: int | None = None
    port: int = 0
    bootstrap_port: int = 0
    dist_init_port: int = 0

    @property
    def label(self) -> str:
        return f"{self.role} group {self.group} node {self.node_rank} (rank {self.rank})"


@dataclass(frozen=True)
class LaunchConfig:
    name: str
    source: str
    model_path: str
    attention_dp: bool
    num_routed_experts: int | None
    gpus_per_node: int
    ib_devices: str | None
    python: str
    bind_host: str
    prefill: RoleSpec
    decode: RoleSpec
    lb: LBSpec
    hosts: tuple[str, ...]
    hosts_source: str = field(default="hosts:")
    # the cluster profile's `kubernetes:` section, as written: only `k8s_profile` reads it, so a launch on
    # hosts never depends on it
    kubernetes: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    cluster_source: str = ""
    # servers may share GPUs (small test models, each with a capped pool): the GPU-clash check is off
    shared_gpus: bool = False

    def role(self, name: str) -> RoleSpec:
        return self.prefill if name == "prefill" else self.decode

    @property
    def total_nodes(self) -> int:
        return sum(r.groups * r.nodes for r in (self.prefill, self.decode))

    def nodes(self) -> list[Node]:
        out: list[Node] = []
        for spec in (self.prefill, self.decode):
            slots: dict[str, int] = {}  # master host -> groups of this role already placed there
            for group in range(spec.groups):
                master = self._host(len(out))
                slot = slots.get(master, 0) if master else 0
                if master:
                    slots[master] = slot + 1
                base_gpu = spec.base_gpu_id if slot == 0 else (spec.base_gpu_id or 0) + slot * spec.gpus
                for node_rank in range(spec.nodes):
                    out.append(Node(
                        len(out), spec.role, group, node_rank, self._host(len(out)), slot, base_gpu,
                        port=spec.port + slot, bootstrap_port=spec.bootstrap_port + slot,
                        dist_init_port=spec.dist_init_port + slot * DIST_INIT_PORT_SPAN,
                    ))
        return out

    def _host(self, rank: int) -> str | None:
        return self.hosts[rank] if rank < len(self.hosts) and self.hosts[rank] else None

    def group_nodes(self, role: str, group: int) -> list[Node]:
        return [n for n in self.nodes() if n.role == role and n.group == group]

    def lb_host(self) -> str | None:
        return self.lb.host or (self.hosts[0] if self.hosts else None)


class _Reader:
    """Collects shape problems of one YAML file instead of stopping at the first."""

    def __init__(self, path: Path):
        self.path = path
        self.problems: list[str] = []

    def mapping(self, value: Any, where: str, allowed: set[str] | None) -> dict[str, Any]:
        """`allowed` None: any key (environment sections)."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.problems.append(f"{self.path}: `{where}` must be a mapping, got {type(value).__name__}")
            return {}
        for key in value:
            if allowed is not None and key not in allowed:
                self.problems.append(
                    f"{self.path}: unknown key `{key}` in `{where}`: known keys are {', '.join(sorted(allowed))}"
                )
        return value

    def integer(self, value: Any, where: str, default: int | None, minimum: int = 0) -> int | None:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.problems.append(f"{self.path}: `{where}` must be an integer >= {minimum}, got {value!r}")
            return default
        return value

    def text(self, value: Any, where: str, default: str | None) -> str | None:
        if value is None:
            return default
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            self.problems.append(f"{self.path}: `{where}` must be a string, got {value!r}")
            return default
        return str(value)

    def args(self, value: Any, where: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if value is None:
            return out
        if not isinstance(value, dict):
            self.problems.append(f"{self.path}: `{where}` must map SGLang flag names to values")
            return out
        for raw, v in value.items():
            name = str(raw)[2:] if str(raw).startswith("--") else str(raw)
            if not _FLAG_NAME.match(name):
                self.problems.append(f"{self.path}: `{where}.{raw}` is not a flag name (write e.g. `page-size: 1`)")
                continue
            if isinstance(v, dict) and (set(v) != {PER_RANK_KEY} or not _positive_int(v[PER_RANK_KEY])):
                self.problems.append(
                    f"{self.path}: `{where}.{name}`: the only mapping value allowed is {{{PER_RANK_KEY}: N}} with N > 0"
                )
                continue
            out[name] = v
        return out

    def env(self, value: Any, where: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for k, v in self.mapping(value, where, None).items():
            if isinstance(v, (dict, list)) or v is None:
                self.problems.append(f"{self.path}: `{where}.{k}` must be a scalar, got {v!r}")
                continue
            # YAML booleans: "1"/"0" is what every SGLang/NCCL boolean switch accepts
            out[str(k)] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _read_yaml(path: Path, problems: list[str]) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        problems.append(f"{path}: file not found")
        return {}
    except yaml.YAMLError as exc:
        problems.append(f"{path}: not valid YAML: {exc}")
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path}: expected a mapping at the top level")
        return {}
    return data


def read_hostfile(path: str | Path) -> tuple[str, ...]:
    """One host per line in rank order; blank lines and `#` comments ignored (`scontrol show hostnames` output)."""
    lines = Path(path).read_text().splitlines()
    return tuple(h for h in (line.split("#", 1)[0].strip() for line in lines) if h)


def load_config(
    path: str | Path, hostfile: str | Path | None = None, model_path: str | None = None
) -> LaunchConfig:
    """Loads a topology file; `hostfile` replaces its `hosts:`, `model_path` the profile's model path."""
    topo_path = Path(path)
    problems: list[str] = []
    topo = _read_yaml(topo_path, problems)
    if problems:
        raise ConfigError(str(topo_path), problems)
    r = _Reader(topo_path)
    r.mapping(topo, "topology", _TOPOLOGY_KEYS)
    profile_ref = r.text(topo.get("model"), "model", None)
    cluster_ref = r.text(topo.get("cluster"), "cluster", None)
    if profile_ref is None:
        r.problems.append(f"{topo_path}: `model:` is missing: name a model profile, e.g. ../models/deepseek-v3.yaml")
    if cluster_ref is None:
        r.problems.append(f"{topo_path}: `cluster:` is missing: name a cluster profile, e.g. ../clusters/h800x8-ib.yaml")
    if r.problems:
        raise ConfigError(str(topo_path), r.problems)

    base = topo_path.parent
    profile_path, cluster_path = base / profile_ref, base / cluster_ref
    profile = _read_yaml(profile_path, problems)
    cluster = _read_yaml(cluster_path, problems)
    if problems:
        raise ConfigError(str(topo_path), problems)
    rp, rc = _Reader(profile_path), _Reader(cluster_path)

    rp.mapping(profile, "profile", _PROFILE_KEYS)
    common = rp.mapping(profile.get("common"), "common", _SECTION_KEYS)
    rc.mapping(cluster, "cluster", _CLUSTER_KEYS)
    ports = {**_DEFAULT_PORTS, **rc.mapping(cluster.get("ports"), "ports", _PORT_KEYS)}
    gpus_per_node = rc.integer(cluster.get("gpus_per_node"), "gpus_per_node", 8, minimum=1)
    base_env = {**rc.env(cluster.get("env"), "env"), **rp.env(common.get("env"), "common.env"), **r.env(topo.get("env"), "env")}

    roles: dict[str, RoleSpec] = {}
    for role in ROLES:
        t = r.mapping(topo.get(role), role, _ROLE_KEYS)
        p = rp.mapping(profile.get(role), role, _SECTION_KEYS)
        if role not in topo:
            r.problems.append(f"{topo_path}: `{role}:` is missing: give at least `{role}: {{groups: 1, nodes: 1}}`")
        gpus = r.integer(t.get("gpus"), f"{role}.gpus", gpus_per_node, minimum=1)
        nodes = r.integer(t.get("nodes"), f"{role}.nodes", 1, minimum=1)
        roles[role] = RoleSpec(
            role=role,
            groups=r.integer(t.get("groups"), f"{role}.groups", 1, minimum=1),
            nodes=nodes,
            gpus=gpus,
            tp=r.integer(t.get("tp"), f"{role}.tp", nodes * gpus, minimum=1),
            base_gpu_id=r.integer(t.get("base_gpu_id"), f"{role}.base_gpu_id", None),
            port=r.integer(t.get("port"), f"{role}.port", rc.integer(ports["http"], "ports.http", 30000, 1), 1),
            bootstrap_port=r.integer(
                t.get("bootstrap_port"), f"{role}.bootstrap_port",
                rc.integer(ports["bootstrap"], "ports.bootstrap", 8998, 1), 1,
            ),
            dist_init_port=r.integer(
                t.get("dist_init_port"), f"{role}.dist_init_port",
                rc.integer(ports["dist_init"], "ports.dist_init", 5757, 1), 1,
            ),
            args=MappingProxyType(
                {**rp.args(common.get("args"), "common.args"), **rp.args(p.get("args"), f"{role}.args"),
                 **r.args(t.get("args"), f"{role}.args")}
            ),
            env=MappingProxyType({**base_env, **rp.env(p.get("env"), f"{role}.env"), **r.env(t.get("env"), f"{role}.env")}),
        )

    lb = r.mapping(topo.get("lb"), "lb", _LB_KEYS)
    hosts_source = f"`hosts:` in {topo_path}"
    if hostfile is not None:
        hosts_source = f"hostfile {hostfile}"
        try:
            hosts = read_hostfile(hostfile)
        except OSError as exc:
            r.problems.append(f"{hosts_source} cannot be read ({exc.strerror}): pass a file with one address per node")
            hosts = ()
    else:
        raw_hosts = topo.get("hosts") or []
        if not isinstance(raw_hosts, list):
            r.problems.append(f"{topo_path}: `hosts` must be a list of addresses in rank order")
            raw_hosts = []
        hosts = tuple("" if h is None else str(h).strip() for h in raw_hosts)

    shared_gpus = topo.get("shared_gpus", False)
    if not isinstance(shared_gpus, bool):
        r.problems.append(f"{topo_path}: `shared_gpus` must be true or false")
    attention_dp = profile.get("attention_dp", False)
    if not isinstance(attention_dp, bool):
        rp.problems.append(f"{profile_path}: `attention_dp` must be true or false")
    model = model_path or rp.text(profile.get("model_path"), "model_path", None)
    if not model:
        rp.problems.append(f"{profile_path}: `model_path:` is missing: set it or pass --model-path")
    num_routed_experts = rp.integer(profile.get("num_routed_experts"), "num_routed_experts", None, 1)
    lb_spec = LBSpec(
        host=r.text(lb.get("host"), "lb.host", None),
        port=r.integer(lb.get("port"), "lb.port", rc.integer(ports["lb"], "ports.lb", 8000, 1), 1),
        policy=r.text(lb.get("policy"), "lb.policy", None),
        args=MappingProxyType(r.args(lb.get("args"), "lb.args")),
    )
    ib_devices = rc.text(cluster.get("ib_devices"), "ib_devices", None)
    kubernetes = rc.mapping(cluster.get("kubernetes"), "kubernetes", None)
    python = rc.text(cluster.get("python"), "python", "python3") or "python3"
    bind_host = rc.text(cluster.get("bind_host"), "bind_host", "0.0.0.0") or "0.0.0.0"
    name = r.text(topo.get("name"), "name", topo_path.stem) or topo_path.stem
    all_problems = r.problems + rp.problems + rc.problems
    if all_problems:
        raise ConfigError(str(topo_path), all_problems)
    return LaunchConfig(
        name=name,
        source=str(topo_path),
        model_path=str(model),
        attention_dp=bool(attention_dp),
        num_routed_experts=num_routed_experts,
        gpus_per_node=gpus_per_node or 8,
        ib_devices=ib_devices,
        python=python,
        bind_host=bind_host,
        prefill=roles["prefill"],
        decode=roles["decode"],
        lb=lb_spec,
        hosts=hosts,
        hosts_source=hosts_source,
        kubernetes=MappingProxyType(dict(kubernetes)),
        cluster_source=str(cluster_path),
        shared_gpus=bool(shared_gpus),
    )
