"""Works out which node of the topology this process is: from --role/--group/--node-rank, from --rank,
or from the launcher environment (RANK/WORLD_SIZE, Slurm's SLURM_PROCID/SLURM_NTASKS, Open MPI's).

One launcher process runs per node, so these ranks count nodes, not GPUs: start it with one task per
node (`srun --ntasks-per-node=1`, `mpirun -N 1`, torchrun's `--nproc-per-node 1`).
"""

from __future__ import annotations

from typing import Mapping

from .config import ConfigError, LaunchConfig, Node

# (rank variable, world-size variable), first match wins
RANK_ENV = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))


def _env_rank(environ: Mapping[str, str], problems: list[str]) -> tuple[int | None, int | None, str]:
    for rank_var, size_var in RANK_ENV:
        if rank_var in environ:
            try:
                rank = int(environ[rank_var])
                size = int(environ[size_var]) if size_var in environ else None
            except ValueError:
                problems.append(f"{rank_var}/{size_var} must be integers, got {environ.get(rank_var)!r}/{environ.get(size_var)!r}")
                return None, None, rank_var
            return rank, size, rank_var
    return None, None, ""


def resolve_node(
    cfg: LaunchConfig,
    environ: Mapping[str, str],
    role: str | None = None,
    group: int | None = None,
    node_rank: int | None = None,
    rank: int | None = None,
) -> Node:
    nodes = cfg.nodes()
    problems: list[str] = []
    if role is not None:
        if rank is not None:
            problems.append("give either --rank or --role/--group/--node-rank, not both")
        match = [n for n in nodes if n.role == role and n.group == (group or 0) and n.node_rank == (node_rank or 0)]
        if not match and not problems:
            spec = cfg.role(role)
            problems.append(
                f"{role} group {group or 0} node {node_rank or 0} is not in the topology: {role} has "
                f"groups 0-{spec.groups - 1} of nodes 0-{spec.nodes - 1}"
            )
        if problems:
            raise ConfigError(cfg.source, problems)
        return match[0]
    source = "--rank"
    size = None
    if rank is None:
        rank, size, source = _env_rank(environ, problems)
    if rank is None and not problems:
        problems.append(
            "which node is this? pass --role/--group/--node-rank or --rank, or set RANK and WORLD_SIZE "
            "(Slurm sets SLURM_PROCID/SLURM_NTASKS)"
        )
    if size is not None and size != len(nodes):
        problems.append(
            f"the launch has {size} tasks ({source} world size) but the topology has {len(nodes)} nodes: "
            f"start exactly one task per node"
        )
    if rank is not None and not 0 <= rank < len(nodes):
        problems.append(f"{source}={rank} is outside the topology's ranks 0-{len(nodes) - 1}")
    if problems:
        raise ConfigError(cfg.source, problems)
    return nodes[rank]
