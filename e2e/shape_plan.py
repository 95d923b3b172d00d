"""What e2e/shapes.py starts for each miniature topology: the launcher's own commands and references beside them.

Pure: reads the topology through the launcher's loader and renderer, starts nothing. Every PD server and the LB
are started as an operator would (`python -m sglang_p2p_backend.launch node|lb --config ...`); the reference
(a non-PD server for the correctness check) runs the decode's rendered command with the PD flags taken out, on
ports of its own, so it has the decode's exact layout (TP, attention DP, EP) and flags. Where the prefill runs
another layout, a second reference runs the prefill's rendered command the same way.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from sglang_p2p_backend.launch.config import LaunchConfig, Node, load_config
from sglang_p2p_backend.launch.render import SGLANG_PROGRAM, server_command
from sglang_p2p_backend.launch.validate import validate

REPO = Path(__file__).resolve().parent.parent
TOPOLOGIES = REPO / "configs" / "topologies"
LAUNCHER = ("-m", "sglang_p2p_backend.launch")
# PD flags of a rendered server command with how many values each takes: the reference drops them
PD_FLAGS = {"--disaggregation-mode": 1, "--disaggregation-transfer-backend": 1, "--disaggregation-bootstrap-port": 1,
            "--disaggregation-ib-device": 1}
REF_PORT_OFFSET, REF_DIST_INIT_OFFSET = 80, 40  # from the decode's HTTP and dist-init ports


@dataclass(frozen=True)
class Shape:
    """One miniature: its topology, the model it serves, and where its reference runs."""

    topology: str
    model: str
    #: PD's prefill runs the decode's layout too, so PD must be bit-identical to the reference; otherwise the
    #: prefill computes the prompt's KV in another layout, and PD must agree within the layout tolerance with
    #: a reference of one of its two layouts
    same_layout: bool
    ref_gpu: int  # first GPU of the reference server (it shares GPUs with PD servers: small capped pools)
    why: str
    #: every KV page's bytes are whole on both sides (MLA at any TP; MHA/GQA at the same attention TP), so the
    #: test-only KV digests of each room (e2e/kv_digest.py) must be equal and decide the `kv` controls
    kv_digest: bool = False
    #: Python packages the host image lacks that this shape's servers import (installed by run_all.sh's
    #: deepep phase); such a shape is left out of e2e/shapes.py's default list
    needs: tuple[str, ...] = ()


SHAPES = {s.topology: s for s in (
    Shape("mini-a-2p-dpdecode", "deepseek-tiny", False, 0,
          "two TP-1 prefills into one TP-2 decode with attention DP 2 and EP 2 (MLA + MoE)", kv_digest=True),
    Shape("mini-b-dp-both", "deepseek-tiny", True, 0,
          "TP 2 + attention DP 2 + EP 2 on both sides (MLA + MoE)", kv_digest=True),
    # not in run_all.sh's default list: it needs DeepEP and DeepGEMM on the host (run_all.sh --phase deepep)
    Shape("mini-b-deepep", "deepseek-tiny", True, 0,
          "mini-b-dp-both with DeepEP (normal kernels) and DeepGEMM's bf16 experts on both sides (MLA + MoE)",
          kv_digest=True, needs=("deep_ep", "deep_gemm")),
    # the profile's DeepEP modes: normal kernels on the prefill, low-latency ones on the decode (hidden 2048 and up)
    Shape("mini-b-deepep-ll", "deepseek-wide", False, 0,
          "mini-b-deepep with the decode on DeepEP's low-latency kernels, as the (P3x3)D4 profile (MLA + MoE, hidden 2048)",
          kv_digest=True, needs=("deep_ep", "deep_gemm")),
    Shape("mini-c-tp1-tp2", "llama-tiny", False, 2, "GQA, prefill TP 1 -> decode TP 2"),
    Shape("mini-c-tp2-tp1", "llama-tiny", False, 3, "GQA, prefill TP 2 -> decode TP 1"),
    Shape("mini-c-tp1-tp4", "llama-tiny", False, 0,
          "GQA, prefill TP 1 -> decode TP 4 (more decode ranks than KV heads: SGLang replicates heads)"),
)}


#: what e2e/shapes.py checks when no --only is given: the shapes the host image can serve as it is
DEFAULT_SHAPES = tuple(name for name, s in SHAPES.items() if not s.needs)


@dataclass(frozen=True)
class Launch:
    """One process to start: its name, command, the port it serves, the GPU its start is staggered on."""

    name: str
    role: str  # prefill | decode | reference (decode's layout) | reference-prefill (prefill's layout) | lb
    argv: list[str]
    port: int
    gpu: int
    bootstrap_port: Optional[int] = None
    env: tuple[tuple[str, str], ...] = ()  # on top of the caller's (the launcher adds the topology's itself)


def topology_path(name: str) -> Path:
    return TOPOLOGIES / f"{name}.yaml"


def load(shape: Shape, model_dir: Path) -> LaunchConfig:
    return validate(load_config(topology_path(shape.topology), model_path=str(model_dir)))


def node_launch(shape: Shape, cfg: LaunchConfig, node: Node, model_dir: Path, python: str = sys.executable) -> Launch:
    argv = [python, *LAUNCHER, "node", "--config", str(topology_path(shape.topology)), "--rank", str(node.rank),
            "--model-path", str(model_dir)]
    return Launch(f"{shape.topology}-{node.role}{node.group}", node.role, argv, node.port, node.base_gpu_id or 0,
                  node.bootstrap_port if node.role == "prefill" else None)


def lb_launch(shape: Shape, cfg: LaunchConfig, model_dir: Path, lb_flags: list[str], name: str = "lb",
              port: Optional[int] = None, python: str = sys.executable) -> Launch:
    """The topology's LB (`launch lb`), with `lb_flags` appended (and another port when given)."""
    port = port or cfg.lb.port
    argv = [python, *LAUNCHER, "lb", "--config", str(topology_path(shape.topology)), "--model-path", str(model_dir),
            "--", *lb_flags, "--port", str(port)]
    return Launch(f"{shape.topology}-{name}", "lb", argv, port, -1)


def rewrite_flags(args: Sequence[str], values: Mapping[str, Callable[[str], str]], drop: Mapping[str, int] = {},
                  add: Mapping[str, str] = {}) -> list[str]:
    """`args` with the flags in `drop` (name -> how many values) left out, each flag in `values` given
    values[flag](its value), then the flags of `add` that were not there."""
    out: list[str] = []
    seen = set()
    args = list(args)
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in drop:
            i += 1 + drop[flag]
        elif flag in values:
            out += [flag, values[flag](args[i + 1])]
            seen.add(flag)
            i += 2
        else:
            out.append(flag)
            i += 1
    return out + [tok for flag, value in add.items() if flag not in seen for tok in (flag, value)]


def with_port(port: int) -> Callable[[str], str]:
    """A --dist-init-addr value's host with another port."""
    return lambda addr: f"{addr.rsplit(':', 1)[0]}:{port}"


def reference_args(decode_args: tuple[str, ...], port: int, dist_init_port: int, base_gpu: int) -> list[str]:
    """The decode's rendered flags without the PD ones, on other ports and GPUs."""
    return rewrite_flags(decode_args, {"--port": lambda _: str(port), "--base-gpu-id": lambda _: str(base_gpu),
                                       "--dist-init-addr": with_port(dist_init_port)},
                         drop=PD_FLAGS, add={"--base-gpu-id": str(base_gpu)})


def reference_launch(shape: Shape, cfg: LaunchConfig, release: str, layout: str = "decode",
                     python: str = sys.executable) -> Launch:
    """A non-PD server with the `layout` role's rendered flags (its first group's node 0)."""
    node = next(n for n in cfg.nodes() if n.role == layout)
    cmd = server_command(cfg, node, release)
    port = node.port + REF_PORT_OFFSET
    gpu = min(shape.ref_gpu, cfg.gpus_per_node - cfg.role(layout).gpus)  # the layout's GPUs fit from there
    args = reference_args(cmd.args, port, node.dist_init_port + REF_DIST_INIT_OFFSET, gpu)
    role = "reference" if layout == "decode" else "reference-prefill"
    return Launch(f"{shape.topology}-{role}", role, [python, *SGLANG_PROGRAM, *args], port, gpu,
                  env=tuple(cmd.env.items()))


def plan(shape: Shape, model_dir: Path, release: str, lb_flags: list[str]) -> list[Launch]:
    """Every PD server (rank order), the reference(s), then the LB."""
    cfg = load(shape, model_dir)
    servers = [node_launch(shape, cfg, n, model_dir) for n in cfg.nodes()]
    refs = [reference_launch(shape, cfg, release)]
    if not shape.same_layout:
        refs.append(reference_launch(shape, cfg, release, "prefill"))
    return [*servers, *refs, lb_launch(shape, cfg, model_dir, lb_flags)]
