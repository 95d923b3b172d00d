"""Finds what would stop a topology after it started: missing addresses, parallel sizes that do not fit
the GPUs, expert counts that do not split over the EP ranks, flags the launcher owns, settings that stall
attention-DP servers, clashing ports and shared GPUs. Pure: every check reads the LaunchConfig only, and every
message names the fix.

Flags unknown to SGLang are found by `sglang_parser`, which needs SGLang itself.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .config import DIST_INIT_PORT_SPAN, ConfigError, LaunchConfig, Node
from .render import attn_dp_size

# Flags the launcher renders from the topology (aliases included), with where to set them instead.
LAUNCHER_FLAGS = {
    **dict.fromkeys(("model-path", "model"), "`model_path:` in the model profile or --model-path"),
    **dict.fromkeys(("host", "port"), "`bind_host` in the cluster profile / `port:` of the role"),
    "disaggregation-mode": "the role section the group is in",
    "disaggregation-transfer-backend": "nothing: the launcher always uses p2pnccl",
    "disaggregation-bootstrap-port": "`bootstrap_port:` of the prefill role or `ports.bootstrap` of the cluster",
    "disaggregation-ib-device": "`ib_devices:` in the cluster profile",
    **dict.fromkeys(("dist-init-addr", "nccl-init-addr"), "`hosts:`/--hostfile and `dist_init_port:`"),
    **dict.fromkeys(("nnodes", "node-rank"), "`nodes:` of the role; the node rank comes from --rank/RANK"),
    **dict.fromkeys(("tp-size", "tp", "tensor-parallel-size"), "`tp:` of the role"),
    **dict.fromkeys(
        ("dp-size", "dp", "data-parallel-size", "attn-dp-size", "attention-data-parallel-size", "enable-dp-attention"),
        "`attention_dp:` in the model profile",
    ),
    "base-gpu-id": "`base_gpu_id:` of the role",
}


@dataclass(frozen=True)
class _Claim:
    first: int
    last: int
    owner: str

    def describe(self) -> str:
        span = f"port {self.first}" if self.first == self.last else f"ports {self.first}-{self.last}"
        return f"{span} ({self.owner})"


def _address_problems(cfg: LaunchConfig) -> list[str]:
    need = cfg.total_nodes
    problems = [
        f"missing address: {n.label} has no host: list {need} addresses in rank order (prefill groups, "
        f"then decode groups) under `hosts:` or pass --hostfile"
        for n in cfg.nodes()
        if n.host is None
    ]
    if len(cfg.hosts) > need:
        problems.append(
            f"{cfg.hosts_source} lists {len(cfg.hosts)} hosts but the topology has {need} nodes: "
            f"remove the extra hosts or add nodes/groups"
        )
    return problems


def _size_problems(cfg: LaunchConfig) -> list[str]:
    problems = []
    for spec in (cfg.prefill, cfg.decode):
        group_gpus = spec.nodes * spec.gpus
        shape = f"{spec.nodes} node{'s' if spec.nodes > 1 else ''} x {spec.gpus} GPUs"
        first = max((n.base_gpu_id or 0 for n in cfg.nodes() if n.role == spec.role), default=0)
        if spec.gpus + first > cfg.gpus_per_node:
            packed = " (its groups share a host side by side)" if first != (spec.base_gpu_id or 0) else ""
            problems.append(
                f"{spec.role}: {spec.gpus} GPUs from GPU {first} do not fit a node of {cfg.gpus_per_node} "
                f"GPUs{packed}: lower `gpus`/`base_gpu_id`, give the groups hosts of their own, or fix "
                f"`gpus_per_node` in the cluster profile"
            )
        if group_gpus % spec.tp:
            divisors = [d for d in range(1, group_gpus + 1) if group_gpus % d == 0]
            problems.append(
                f"{spec.role}: tp {spec.tp} does not divide the group's {group_gpus} GPUs ({shape}): "
                f"set `tp` to {group_gpus} (one server over the whole group); divisors are {divisors}"
            )
        elif spec.tp != group_gpus:
            problems.append(
                f"{spec.role}: tp {spec.tp} leaves GPUs of the group's {group_gpus} ({shape}) idle: one SGLang "
                f"server spans the whole group, so set `tp: {group_gpus}` or lower `nodes`/`gpus`"
            )
        if spec.tp != group_gpus:  # the expert split below would only repeat the size problem
            continue
        redundant = spec.args.get("ep-num-redundant-experts") or 0
        a2a = spec.args.get("moe-a2a-backend")
        if cfg.num_routed_experts and a2a and a2a != "none" and isinstance(redundant, int):
            physical = cfg.num_routed_experts + redundant
            if physical % spec.tp:
                problems.append(
                    f"{spec.role}: {cfg.num_routed_experts} routed + {redundant} redundant experts = {physical} "
                    f"do not split over EP {spec.tp} (EP = TP with {a2a}): pick `ep-num-redundant-experts` so "
                    f"the sum is a multiple of {spec.tp}"
                )
    return problems


def _flag_problems(cfg: LaunchConfig) -> list[str]:
    return [
        f"{spec.role}: `{name}` in args is set by the launcher: remove it and use {where}"
        for spec in (cfg.prefill, cfg.decode)
        for name, where in LAUNCHER_FLAGS.items()
        if name in spec.args
    ]


def _idle_sleep_problems(cfg: LaunchConfig) -> list[str]:
    """`sleep-on-idle` on a server with attention DP: each DP rank's scheduler then waits up to 1 s on its own
    sockets when it has nothing, and a request on another rank needs it in the DP ranks' sync of every step,
    so that request waits for it to wake. Seen as time to first token quantized to 1.0 and 2.0 s at
    concurrency 1, whatever the KV backend (mini-a-serve on 4 x H200, docs/serving.md)."""
    return [
        f"{spec.role}: `sleep-on-idle` with attention DP over {attn_dp_size(cfg, spec.role)} ranks stalls requests "
        f"up to 1 s each (an idle DP rank sleeps in its socket poll while the rank with the request waits for it "
        f"in their sync): remove `sleep-on-idle` from the profile"
        for spec in (cfg.prefill, cfg.decode)
        if spec.args.get("sleep-on-idle") and attn_dp_size(cfg, spec.role) > 1
    ]


def _claims(cfg: LaunchConfig) -> dict[str, list[_Claim]]:
    """Ports each host must have free, by who takes them."""
    by_host: dict[str, list[_Claim]] = defaultdict(list)
    for node in cfg.nodes():
        if node.host is None:
            continue
        where = f"{node.role} group {node.group} node {node.node_rank}"
        # nodes > 0 of a multi-node group serve a health endpoint on the same HTTP port
        by_host[node.host].append(_Claim(node.port, node.port, f"{where} HTTP"))
        if node.node_rank == 0:
            last = node.dist_init_port + DIST_INIT_PORT_SPAN - 1
            by_host[node.host].append(_Claim(node.dist_init_port, last, f"{where} dist-init and derived ports"))
            if node.role == "prefill":
                by_host[node.host].append(
                    _Claim(node.bootstrap_port, node.bootstrap_port, f"{where} bootstrap server")
                )
    lb_host = cfg.lb_host()
    if lb_host:
        by_host[lb_host].append(_Claim(cfg.lb.port, cfg.lb.port, "load balancer"))
    return by_host


def _port_problems(cfg: LaunchConfig) -> list[str]:
    problems = []
    for host, claims in _claims(cfg).items():
        for c in claims:
            if c.last > 65535:
                problems.append(f"{host}: {c.describe()} goes past 65535: choose a lower port")
        for i, a in enumerate(claims):
            for b in claims[i + 1:]:
                if a.first <= b.last and b.first <= a.last:
                    problems.append(
                        f"port clash on {host}: {a.describe()} overlaps {b.describe()}: give one of them "
                        f"another port (`port`, `bootstrap_port`, `dist_init_port` of the role, or `lb.port`)"
                    )
    return problems


def _gpu_problems(cfg: LaunchConfig) -> list[str]:
    if cfg.shared_gpus:
        return []
    used: dict[str, list[tuple[range, Node]]] = defaultdict(list)
    problems = []
    for node in cfg.nodes():
        if node.host is None:
            continue
        first = node.base_gpu_id or 0
        gpus = range(first, first + cfg.role(node.role).gpus)
        for other_gpus, other in used[node.host]:
            if set(gpus) & set(other_gpus):
                problems.append(
                    f"GPU clash on {node.host}: {node.label} uses GPUs {first}-{gpus[-1]} and {other.label} "
                    f"uses {other_gpus[0]}-{other_gpus[-1]}: set `base_gpu_id` so they do not overlap"
                )
        used[node.host].append((gpus, node))
    return problems


def problems(cfg: LaunchConfig) -> list[str]:
    return [
        *_address_problems(cfg),
        *_size_problems(cfg),
        *_flag_problems(cfg),
        *_idle_sleep_problems(cfg),
        *_port_problems(cfg),
        *_gpu_problems(cfg),
    ]


def validate(cfg: LaunchConfig) -> LaunchConfig:
    found = problems(cfg)
    if found:
        raise ConfigError(cfg.source, found)
    return cfg
