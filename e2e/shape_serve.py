"""Serving figures of a 4-GPU miniature: p2pnccl next to SGLang's NIXL and Mooncake backends on the same servers.

    python3 -m e2e.shape_serve --models DIR --out FILE --logs DIR [--shape mini-a-serve] [--backends ...]
                               [--cells 1024x1,...] [--reps 3] [--rounds 2] [--machine NAME]

The shape is a serving topology (configs/topologies/mini-{a,b}-serve.yaml: deepseek-anchor, DeepSeek-V3's KV
shape, decode CUDA graphs). p2pnccl's servers are started by the launcher from it; each other backend runs the
very same rendered commands with `--disaggregation-transfer-backend` swapped and its ports moved by
PORT_STEP (plus the backend's environment, e2e/serve.py's BACKEND_ENV). Every backend gets the same LB (ours,
default policy) in front. All backends' servers run at once, sharing the GPUs, and are loaded one at a time:
e2e/serve.py's warm-up and measurement (cells x repetitions, the backends of a cell in an order rotated by
repetition; TTFT p50/p99, TPOT p50, E2E p50, output tok/s, KV transfer time summed over the prefills, the
decode's step time by running batch).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from sglang_p2p_backend.launch.config import LaunchConfig
from sglang_p2p_backend.launch.release import resolve_release
from sglang_p2p_backend.engine.transport.cuda_ipc import ROUTE_LOG
from sglang_p2p_backend.launch.render import SGLANG_PROGRAM, server_command

from . import config, results, serve
from .servers import Server, exit_on_sigterm, Stack
from .shape_plan import Shape, load, node_launch, rewrite_flags, with_port
from .shapes import SHARED_GPU_ENV, server_for

SHAPES = {s.topology: s for s in (
    Shape("mini-a-serve", "deepseek-anchor", False, 0, "two TP-1 prefills into a TP-2 / DP-2 / EP-2 decode"),
    Shape("mini-b-serve", "deepseek-anchor", True, 0, "TP 2 + attention DP 2 + EP 2 on both sides"),
)}
BACKENDS = ("p2pnccl", "nixl", "mooncake")
PORT_STEP = 1000  # backend k's HTTP, bootstrap, dist-init and LB ports: the topology's + k * PORT_STEP
MODE = "graph"  # as deployed: decode CUDA graphs (the profile's flags)
TALLY = ROUTE_LOG + " routes so far"  # engine/transport/route_tally.py's summary lines


class Deployment:
    """One backend's servers of the shape and our LB in front: what e2e/serve.py measures (a `Pair`'s face)."""

    def __init__(self, backend: str, prefills: list[Server], decode: Server, lb: Server):
        self.backend, self.prefills, self.prefill = backend, prefills, prefills[0]
        self.decode, self.lb = {MODE: decode}, {MODE: lb}

    def servers(self) -> list[Server]:
        return [*self.prefills, self.decode[MODE]]


def moved_command(cfg: LaunchConfig, node: Any, release: str, backend: str, step: int) -> list[str]:
    """The node's rendered server command for another transfer backend, its ports moved by `step`."""
    cmd = server_command(cfg, node, release)
    shift = lambda v: str(int(v) + step)  # noqa: E731
    args = rewrite_flags(cmd.args, {"--disaggregation-transfer-backend": lambda _: backend, "--port": shift,
                                    "--disaggregation-bootstrap-port": shift,
                                    "--dist-init-addr": with_port(node.dist_init_port + step)})
    return [sys.executable, *SGLANG_PROGRAM, *args]


def deployment(shape: Shape, cfg: LaunchConfig, model: Path, release: str, backend: str, k: int) -> Deployment:
    step = k * PORT_STEP
    env = {**config.COMMON_ENV, **SHARED_GPU_ENV}
    servers = []
    for node in cfg.nodes():
        if backend == "p2pnccl":  # the launcher itself, as an operator starts it
            s = server_for(node_launch(shape, cfg, node, model), config.e2e_root() / "state" / "no-corruption")
            s.env.update(serve.BACKEND_ENV[backend])
        else:  # a peer backend, or a variant of ours (serve.TRANSFER_BACKEND: the same backend, other knobs)
            transfer = serve.TRANSFER_BACKEND.get(backend, backend)
            s = Server(f"{shape.topology}-{backend}-{node.role}{node.group}", node.port + step, node.role,
                       gpu=node.base_gpu_id or 0, bootstrap_port=node.bootstrap_port + step,
                       argv=moved_command(cfg, node, release, transfer, step), env={**env, **dict(server_command(
                           cfg, node, release).env), **serve.BACKEND_ENV[backend]})
        servers.append(s)
    prefills = [s for s in servers if s.mode == "prefill"]
    decode = next(s for s in servers if s.mode == "decode")
    lb_argv = [sys.executable, "-m", "sglang_p2p_lb", *(a for p in prefills for a in ("--prefill", p.url,
                                                                                     str(p.bootstrap_port))),
               "--decode", decode.url, "--host", "127.0.0.1", "--port", str(cfg.lb.port + step),
               "--log-level", "warning"]
    lb = Server(f"{shape.topology}-{backend}-lb", cfg.lb.port + step, "lb", argv=lb_argv)
    return Deployment(backend, prefills, decode, lb)


def copy_routes(servers: list[Server]) -> dict[str, list[str]]:
    """The same-host copy routes each server's log says it took (the line of each route's first use, from
    ROUTE_LOG on, and the last of the periodic tallies of chunks and bytes a route), so a variant's result shows
    whether its knob took effect, and on what share of the chunks."""
    out = {}
    for s in servers:
        text = s.log.read_text(errors="replace") if s.log and s.log.exists() else ""
        lines = [line[line.index(ROUTE_LOG):] for line in text.splitlines() if ROUTE_LOG in line]
        tallies = [line for line in lines if line.startswith(TALLY)]
        out[s.name] = [line for line in lines if not line.startswith(TALLY)] + tallies[-1:]
    return out


def run(models: Path, logs: Path, out: Path, shape_name: str, backends: list[str], cells: list[tuple[int, int]],
        reps: int, machine: str, deadline: float, rounds: int = 2, pyspy: Optional[str] = None,
        profiled: frozenset[tuple[int, int]] = frozenset()) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    model = models / shape.model
    cfg = load(shape, model)
    release = resolve_release(None)
    res: dict[str, Any] = {"machine": machine, "shape": shape_name, "why": shape.why, "model": shape.model,
                           "release": release, "backend_env": {b: serve.BACKEND_ENV[b] for b in backends},
                           "output_tokens": serve.OUTPUT_TOKENS,
                           "requests": {str(c): serve.requests_for(c, rounds) for _, c in cells},
                           "lb": "sglang_p2p_lb, default policy, the same for every backend",
                           "cells": [], "profile": [], "servers": {}}
    save = lambda: results.write_json(out, res)  # noqa: E731
    deps = {b: deployment(shape, cfg, model, release, b, k) for k, b in enumerate(backends)}
    res["commands"] = {b: {s.name: " ".join(s.command()) for s in [*d.servers(), d.lb[MODE]]} for b, d in deps.items()}
    with Stack(logs) as stack:
        ready = serve.start(stack, deps, res, save)
        serve.warm_up(ready, [MODE], cells)
        serve.measure(ready, [MODE], cells, backends, {}, reps, res, save, pyspy, deadline, rounds,
                      record=(logs if pyspy else None, profiled))
        res["copy_routes"] = {b: copy_routes(d.prefills) for b, d in deps.items() if b.startswith("p2pnccl")}
        save()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = config.step_parser(__doc__)
    ap.add_argument("--shape", default="mini-a-serve", choices=sorted(SHAPES))
    ap.add_argument("--backends", default=",".join(BACKENDS), help="of " + ", ".join(serve.BACKEND_ENV) + " (the "
                    "p2pnccl-* variants run our backend with other knobs: e2e/serve.py's BACKEND_ENV)")
    ap.add_argument("--cells", default=serve.DEFAULT_CELLS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="closed-loop rounds of users a run (requests = rounds x "
                    "concurrency): 2 is mostly the arrival burst, more steadies the medians")
    ap.add_argument("--machine", default="unknown")
    ap.add_argument("--pyspy", default="", help="py-spy executable: thread names, and the profiles --profile-cells asks")
    ap.add_argument("--profile-cells", default="", help="cells (e.g. 1024x16) whose first repetition profiles each "
                    "backend's first prefill scheduler with py-spy for a few seconds (`pyspy_prefill` in the run)")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.backends.split(",")) - set(serve.BACKEND_ENV))
    if unknown:
        ap.error(f"--backends: {', '.join(unknown)} not one of {', '.join(serve.BACKEND_ENV)}")
    exit_on_sigterm()
    a.logs.mkdir(parents=True, exist_ok=True)
    res = run(a.models, a.logs, a.out, a.shape, a.backends.split(","), serve.parse_cells(a.cells), a.reps, a.machine,
              config.deadline_from_env(), a.rounds, a.pyspy or None, frozenset(serve.parse_cells(a.profile_cells)))
    bad = [b for b, s in res["servers"].items() if s.get("status") != "ok"]
    return 1 if bad or res.get("stopped") else 0


if __name__ == "__main__":
    sys.exit(main())
