"""Command line of the launcher: `python -m sglang_p2p_backend.launch {node,lb,check,k8s} --config FILE ...`.

node   renders this node's SGLang server command and replaces this process with it
lb     renders the load balancer's command and replaces this process with it
check  validates the topology and every rendered command with SGLang's parser, starts nothing
k8s    renders the topology as Kubernetes objects (LeaderWorkerSets or a RoleBasedGroup, Services, the LB) as YAML
--dry-run (node, lb) prints every command of the whole topology and starts nothing.

Every path validates the whole topology before anything starts, so a broken config stops on every node
with the same message instead of leaving half a cluster running.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Mapping, Sequence

from .config import ROLES, ConfigError, LaunchConfig, load_config
from .identity import resolve_node
from . import k8s, rbg
from .k8s import checked
from .pod_commands import server_pod_commands
from .k8s_output import stream_text, write_folder
from .k8s_profile import kube_spec
from .release import SUPPORTED, UnsupportedReleaseError, installed_release, resolve_release
from .render import Command, dry_run_text, lb_command, server_command, topology_commands
from .validate import validate

EXIT_CONFIG = 2
WORKLOADS = {"lws": k8s.render_files, "rbg": rbg.render_files}


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", required=True, help="topology YAML, e.g. configs/topologies/p3x3-d4.yaml")
    common.add_argument("--hostfile", help="one address per node in rank order; replaces the topology's hosts:")
    common.add_argument("--model-path", help="replaces the model profile's model_path")
    common.add_argument(
        "--sglang-version", choices=SUPPORTED, help="render flags for this release (default: the installed one)"
    )
    common.add_argument("--no-check", action="store_true", help="skip the check with SGLang's own parser")
    p = argparse.ArgumentParser(prog="python -m sglang_p2p_backend.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    node = sub.add_parser("node", parents=[common], help="run this node's SGLang server")
    node.add_argument("--role", choices=ROLES)
    node.add_argument("--group", type=int, help="group index within the role (default 0)")
    node.add_argument("--node-rank", type=int, help="node index within the group (default 0)")
    node.add_argument("--rank", type=int, help="global node rank (prefill groups first); default from RANK/SLURM_PROCID")
    lb = sub.add_parser("lb", parents=[common], help="run the load balancer")
    lb.add_argument("lb_flags", nargs=argparse.REMAINDER, metavar="-- LB_FLAGS",
                    help="after --: flags appended to the rendered LB command (e.g. -- --policy round_robin)")
    for s in (node, lb):
        s.add_argument("--dry-run", action="store_true", help="print every command of the topology, start nothing")
        s.add_argument("--print-only", action="store_true", help="print this command, start nothing")
    sub.add_parser("check", parents=[common], help="validate the topology and every command, start nothing")
    kube = sub.add_parser("k8s", parents=[common], help="render Kubernetes objects (LeaderWorkerSet or RoleBasedGroup) as YAML")
    kube.add_argument("--workload", choices=WORKLOADS, default="lws",
                      help="lws: one LeaderWorkerSet per group (default); rbg: one RoleBasedGroup (sgl-project/rbg)")
    kube.add_argument("--out", help="write the YAML files here, one per group and one for the LB with lws (default: stdout)")
    kube.add_argument("--namespace", help="replaces the cluster profile's kubernetes.namespace")
    kube.add_argument("--image", help="replaces kubernetes.image: REGISTRY/sglang-p2p-backend:RELEASE built from launch/Dockerfile")
    kube.add_argument("--tuning-dir", help="replaces kubernetes.tuning_dir: the folder holding the EPLB/DeepEP files the model profile names")
    return p


def _check_with_sglang(
    cfg: LaunchConfig, release: str, required: bool, servers: list[Command] | None = None
) -> str:
    """Runs SGLang's parser over every server command (default: the node launches'); returns a note."""
    installed = installed_release()
    if installed is None:
        if required:
            raise ConfigError(cfg.source, ["SGLang is not installed here, so commands cannot be checked: "
                                           "run on a node with SGLang, or pass --no-check"])
        return "# not checked with SGLang's parser: SGLang is not installed here"
    if installed != release:
        if required:
            raise ConfigError(cfg.source, [f"rendered for SGLang {release} but {installed} is installed: "
                                           f"drop --sglang-version or install {release}"])
        return f"# not checked with SGLang's parser: rendered for {release}, {installed} is installed"
    from .sglang_parser import checker  # imports SGLang: seconds, so only when checking

    if servers is None:
        servers = [c for c in topology_commands(cfg, release) if c.program[-1] != "sglang_p2p_lb"]
    checker().check(servers, cfg.source)
    return f"# every server command was accepted by SGLang {release}'s parser with the p2pnccl plugin loaded"


def _render_k8s(args: argparse.Namespace, cfg: LaunchConfig, release: str) -> int:
    kube = kube_spec(cfg, release, namespace=args.namespace, image=args.image, tuning_dir=args.tuning_dir)
    files = WORKLOADS[args.workload](checked(cfg), kube, release)
    note = "" if args.no_check else _check_with_sglang(cfg, release, False, server_pod_commands(files)) + "\n"
    header = f"rendered from {cfg.source} for SGLang {release} by `python -m sglang_p2p_backend.launch k8s`"
    if args.out:
        sys.stdout.write(write_folder(files, args.out, header) + note)
    else:
        sys.stdout.write(stream_text(files, header) + note)  # the note is a YAML comment
    return 0


def _exec(cmd: Command) -> None:
    print(f"# launching {cmd.label}\n{cmd.shell()}", file=sys.stderr, flush=True)
    os.execvpe(cmd.program[0], cmd.argv, {**os.environ, **cmd.env})


def run(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, hostfile=args.hostfile, model_path=args.model_path)
        release = resolve_release(args.sglang_version)
        if args.command == "k8s":  # pods instead of hosts: validated as placed there
            return _render_k8s(args, cfg, release)
        validate(cfg)
        if args.command == "check":
            print(_check_with_sglang(cfg, release, required=True))
            return 0
        if args.dry_run:
            note = "" if args.no_check else _check_with_sglang(cfg, release, required=False) + "\n"
            sys.stdout.write(dry_run_text(cfg, release) + ("\n" + note if note else ""))
            return 0
        if args.command == "node":
            node = resolve_node(cfg, environ, args.role, args.group, args.node_rank, args.rank)
            if not args.no_check:
                _check_with_sglang(cfg, release, required=not args.print_only)
            cmd = server_command(cfg, node, release)
        else:
            cmd = lb_command(cfg)
            extra = args.lb_flags[1:] if args.lb_flags[:1] == ["--"] else args.lb_flags
            cmd = replace(cmd, args=(*cmd.args, *extra))
    except (ConfigError, UnsupportedReleaseError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_only:
        print(f"# {cmd.label}\n{cmd.shell()}")
        return 0
    _exec(cmd)
    return 0  # not reached: exec replaced the process


def main() -> None:
    sys.exit(run(sys.argv[1:], os.environ))
