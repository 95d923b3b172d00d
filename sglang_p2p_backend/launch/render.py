"""Turns a validated LaunchConfig into command lines: every node's SGLang server and the load balancer.

Pure: no I/O, no SGLang import, so every rendering rule is testable on its own. The launcher owns the
flags that follow from the topology (mode, backend, addresses, sizes); the model profile owns the rest.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .config import PER_RANK_KEY, LaunchConfig, Node
from .release import attention_dp_flags

TRANSFER_BACKEND = "p2pnccl"
SGLANG_PROGRAM = ("-m", "sglang.launch_server")  # loads plugins before it parses, in 0.5.17 and 0.5.23
LB_PROGRAM = ("-m", "sglang_p2p_lb")


@dataclass(frozen=True)
class Command:
    label: str
    host: str | None
    env: Mapping[str, str]
    program: tuple[str, ...]  # interpreter and module
    args: tuple[str, ...]  # what the program's argument parser sees

    @property
    def argv(self) -> list[str]:
        return [*self.program, *self.args]

    def shell(self) -> str:
        """Copy-pasteable: `env`, one K=V per line, the program, then one flag (with its values) per line."""
        lines: list[str] = []
        if self.env:
            lines += ["env", *(f"{k}={shlex.quote(v)}" for k, v in self.env.items())]
        lines.append(shlex.join(self.program))
        current: list[str] = []
        for token in self.args:
            if token.startswith("--") and current:
                lines.append(shlex.join(current))
                current = []
            current.append(token)
        if current:
            lines.append(shlex.join(current))
        return " \\\n  ".join(lines)


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def attn_dp_size(cfg: LaunchConfig, role: str) -> int:
    """Attention-DP ranks of the role's servers: one per TP rank with `attention_dp`; a TP-1 server has plain
    attention (DP attention over one rank would only add its gathers)."""
    return cfg.role(role).tp if cfg.attention_dp else 1


def _value_tokens(value: Any, attn_dp: int) -> list[str] | None:
    """None: leave the flag out; []: bare flag; else its values."""
    if value is None or value is False:
        return None
    if value is True:
        return []
    if isinstance(value, dict):  # {per_attn_dp_rank: N}: SGLang divides the total by the attention-DP size
        return [str(value[PER_RANK_KEY] * attn_dp)]
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value)]


def flag_tokens(args: Mapping[str, Any], attn_dp: int) -> list[str]:
    out: list[str] = []
    for name, value in args.items():
        values = _value_tokens(value, attn_dp)
        if values is not None:
            out += [f"--{name}", *values]
    return out


def server_args(
    cfg: LaunchConfig, role: str, release: str, *, bind_host: str, dist_init_addr: str, node_rank: str,
    base_gpu_id: int | None, port: int, bootstrap_port: int,
) -> list[str]:
    """One server's flags. The caller supplies what depends on where it runs: on a host list these are
    literal values (the node's GPUs and ports), in a Kubernetes pod $(VAR) references the kubelet fills in."""
    spec = cfg.role(role)
    attn_dp = attn_dp_size(cfg, role)
    args = [
        "--model-path", cfg.model_path,
        "--host", bind_host,
        "--port", str(port),
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", TRANSFER_BACKEND,
    ]
    if role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    if cfg.ib_devices:
        args += ["--disaggregation-ib-device", cfg.ib_devices]
    args += [
        "--dist-init-addr", dist_init_addr,
        "--nnodes", str(spec.nodes),
        "--node-rank", node_rank,
        "--tp-size", str(spec.tp),
    ]
    if attn_dp > 1:
        args += attention_dp_flags(release, attn_dp)
    if base_gpu_id is not None:
        args += ["--base-gpu-id", str(base_gpu_id)]
    return args + flag_tokens(spec.args, attn_dp)


def server_command(cfg: LaunchConfig, node: Node, release: str) -> Command:
    spec = cfg.role(node.role)
    master = cfg.group_nodes(node.role, node.group)[0]
    args = server_args(
        cfg, node.role, release, bind_host=cfg.bind_host,
        dist_init_addr=host_port(master.host or "", master.dist_init_port),
        node_rank=str(node.node_rank), base_gpu_id=node.base_gpu_id, port=node.port,
        bootstrap_port=node.bootstrap_port,
    )
    return Command(
        label=f"{node.label} on {node.host}",
        host=node.host,
        env=dict(spec.env),
        program=(cfg.python, *SGLANG_PROGRAM),
        args=tuple(args),
    )


def lb_args(cfg: LaunchConfig, master: Callable[[str, int], Node], bind_host: str) -> list[str]:
    """mini_lb / sgl-router flags: each prefill group's master with its bootstrap port, each decode's master.
    `master(role, group)` is the node the LB dials: on a host list the group's node 0, in Kubernetes one
    addressed by its Service's DNS name."""
    args: list[str] = []
    for role in ("prefill", "decode"):
        for group in range(cfg.role(role).groups):
            node = master(role, group)
            args += [f"--{role}", f"http://{host_port(node.host or '', node.port)}"]
            if role == "prefill":
                args.append(str(node.bootstrap_port))
    args += ["--host", bind_host, "--port", str(cfg.lb.port)]
    if cfg.lb.policy:
        args += ["--policy", cfg.lb.policy]
    return args + flag_tokens(cfg.lb.args, 1)


def lb_command(cfg: LaunchConfig) -> Command:
    args = lb_args(cfg, lambda role, group: cfg.group_nodes(role, group)[0], cfg.bind_host)
    host = cfg.lb_host()
    return Command(label=f"load balancer on {host}", host=host, env={}, program=(cfg.python, *LB_PROGRAM), args=tuple(args))


def topology_commands(cfg: LaunchConfig, release: str) -> list[Command]:
    return [*(server_command(cfg, n, release) for n in cfg.nodes()), lb_command(cfg)]


def dry_run_text(cfg: LaunchConfig, release: str) -> str:
    header = (
        f"# topology {cfg.name} ({cfg.source}): {cfg.total_nodes} nodes, SGLang {release} flags, "
        f"transfer backend {TRANSFER_BACKEND}"
    )
    blocks = [header] + [f"# === {c.label}\n{c.shell()}" for c in topology_commands(cfg, release)]
    return "\n\n".join(blocks) + "\n"
