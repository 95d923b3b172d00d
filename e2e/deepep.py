"""DeepEP on the GPU host, as far as it goes: build it there, test it, then run mini-b with it.

    python3 -m e2e.deepep run --root E2E_ROOT --models DIR --out FILE --logs DIR [--gpus N] [--kind KIND]
                              [--shapes-out FILE] [--built-out FILE]
    python3 -m e2e.deepep check-bundle DIR      # the layout build_bundle.sh packs into deepep.tar.xz

The (P3x3)D4 profile (configs/models/deepseek-v3.yaml) runs its MoE layers over DeepEP: normal kernels on
prefill, low-latency kernels on decode. The GPU host image has nvcc (CUDA 13), torch 2.11.0+cu130 and the
nvidia-nvshmem-cu13 wheel (3.4.5, what torch 2.11.0 pins), but no DeepEP and no DeepGEMM, and it reaches no
network. deepep.tar.xz (e2e/build_bundle.sh) carries DeepEP's source at DEEPEP_COMMIT and the DeepGEMM that
SGLang 0.5.17 pins; `run` does, in order, each step once per machine (a later call on the same warm machine
keeps what an earlier one finished: $E2E_ROOT/state/deepep.json):

  host        what the build depends on: nvcc, CUDA_HOME, torch, NVSHMEM (the wheel's folder), NCCL, GPUs and
              their links, RDMA NICs (/sys/class/infiniband) and GDRCopy
  build       DeepEP for sm_90 against the wheel's NVSHMEM (setup.py build, NVSHMEM_DIR, TORCH_CUDA_ARCH_LIST=9.0,
              CUDA 13's CCCL headers, rdma-core's <infiniband/mlx5dv.h> that NVSHMEM's headers include (carried:
              the image may lack libibverbs-dev) and the pip CUDA libraries' headers on the host compiler's
              include path), its CPU timeout raised to 1000 s as SGLang's own image does; or a build an earlier
              call returned (deepep-built.tar.xz) instead
  import      deep_ep imports and has the API SGLang 0.5.17's DeepEP dispatcher calls
  intranode   DeepEP's own tests/test_intranode.py on GPUs 0-1 at deepseek-tiny's sizes (hidden 256, 8 experts,
              top 2): the normal kernels, byte-checked by the test itself
  deepgemm    DeepGEMM's bf16 grouped GEMM (what SGLang runs for an unquantized model under DeepEP) at
              deepseek-tiny's expert shapes against torch; it also fills DeepGEMM's JIT cache for the servers
  shapes      e2e/shapes.py --only mini-b-deepep: prefill and decode each TP 2 + attention DP 2 + EP 2 with
              --moe-a2a-backend deepep (normal) and --moe-runner-backend deep_gemm, against a non-PD server
              of the decode's layout (needs sglang.tar.xz unpacked and 4 GPUs)
  low_latency a probe, not required: tests/test_low_latency.py on GPUs 0-1. The host has NVLink and no RDMA
              NIC; DeepEP's low-latency dispatch asserts num_rc_per_pe >= num_local_experts (internode_ll.cu),
              which other hosts hit without NVSHMEM's IBGDA transport; on the 4 x H100 host it passed, NVSHMEM
              starting without IBGDA and carrying the tokens over NVLink (2026-11-27). The record says how

Each step is skipped when the time left is below what it needs, and the document names the first required
step that failed (`failed`) with the lines of its log that say why. Every process gets NVLink multicast off.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

from . import config, results as results_io

# deepseek-ai/DeepEP's last commit of the v1 line (before EPv2, 2026-02-03): setup.py builds against the
# nvidia-nvshmem wheel, Buffer takes allow_mnnvl/use_fabric as SGLang 0.5.17 passes them
DEEPEP_COMMIT = "567632dd59810d77b3cc05553df953cc0f779799"
# what SGLang 0.5.17 requires (its METADATA pins sgl-deep-gemm==0.1.5.post1 and apache-tvm-ffi==0.1.11)
DEEPGEMM_WHEELS = ("sgl-deep-gemm==0.1.5.post1", "apache-tvm-ffi==0.1.11")
SHAPE = "mini-b-deepep"
# the profile's modes (normal kernels on the prefill, low-latency ones on the decode) on a model they take
LL_SHAPE, LL_MODEL = "mini-b-deepep-ll", "deepseek-wide"
MULTICAST_OFF = {**config.MULTICAST_OFF, "NVSHMEM_DISABLE_MNNVL": "1"}
REQUIRED = ("host", "build", "import", "intranode", "deepgemm", "shapes")
STEPS = (*REQUIRED, "low_latency", "shapes_ll")
# seconds a step needs left before it starts (the build's own timeout is whatever is left then; the same build
# took ~40 s of compiling on 2 slow cores here: kernels ~20 s, deep_ep.cpp ~20 s)
NEEDS_S = {"host": 10, "build": 150, "import": 20, "intranode": 90, "deepgemm": 60, "shapes": 300,
           "low_latency": 60, "shapes_ll": 300}
TIMEOUT_S = {"host": 60, "import": 60, "intranode": 240, "deepgemm": 240, "low_latency": 150}
# DeepEP's tests at deepseek-tiny's sizes (intranode) and the smallest hidden the low-latency kernels take
INTRANODE_ARGS = ("--num-processes", "2", "--num-tokens", "512", "--hidden", "256", "--num-topk", "2",
                  "--num-experts", "8")
LOW_LATENCY_ARGS = ("--num-processes", "2", "--num-tokens", "64", "--hidden", "2048", "--num-topk", "2",
                    "--num-experts", "8")
# what the bundle must hold (check_bundle): rdma-core's headers NVSHMEM's device headers include, DeepEP's build
# inputs and tests, DeepGEMM and its tvm-ffi
BUNDLE_FILES = ("include/infiniband/mlx5dv.h", "include/infiniband/verbs.h", "include/rdma/ib_user_verbs.h",
                "src/COMMIT", "src/setup.py", "src/csrc/deep_ep.cpp", "src/csrc/kernels/configs.cuh",
                "src/csrc/kernels/intranode.cu", "src/csrc/kernels/internode_ll.cu", "src/deep_ep/buffer.py",
                "src/tests/test_intranode.py", "src/tests/test_low_latency.py", "src/tests/utils.py",
                "deepgemm/deep_gemm/__init__.py", "deepgemm/deep_gemm/_C.so", "deepgemm/tvm_ffi/__init__.py")
# the API of deep_ep that sglang/srt/layers/moe/token_dispatcher/deepep.py (0.5.17) calls
SGLANG_API = {
    "Buffer.__init__": ("group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                        "allow_mnnvl", "use_fabric"),
    "Buffer.low_latency_dispatch": ("use_fp8", "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"),
    "Buffer.low_latency_combine": ("x", "topk_idx", "topk_weights", "handle", "async_finish", "return_recv_hook"),
    "Buffer.dispatch": ("topk_idx", "topk_weights", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
                        "is_token_in_rank", "num_tokens_per_expert", "previous_event", "async_finish",
                        "allocate_on_comm_stream", "expert_alignment", "config"),
    "Buffer.combine": ("handle", "async_finish", "previous_event", "allocate_on_comm_stream", "config"),
    "Buffer.get_dispatch_layout": ("previous_event", "async_finish", "allocate_on_comm_stream"),
}
SGLANG_ATTRS = ("Buffer.num_sms", "Buffer.capture", "Buffer.get_dispatch_config", "Buffer.get_combine_config",
                "Buffer.get_low_latency_rdma_size_hint", "Buffer.clean_low_latency_buffer",
                "Config.get_nvl_buffer_size_hint", "Config.get_rdma_buffer_size_hint")
# log lines that say why a step failed, most telling first
CAUSES = (
    ("num_rc_per_pe", "no IBGDA transport: DeepEP's low-latency kernels assert num_rc_per_pe >= num_local_experts "
                      "(NVSHMEM's IBGDA needs an mlx5 RDMA NIC; this host has none)"),
    ("Unable to initialize any transports", "NVSHMEM could not initialize any transport"),
    ("init failed for transport", "an NVSHMEM transport failed to initialize"),
    ("Unsupported hidden", "the low-latency kernels were not compiled for this hidden size"),
    ("DeepEP timeout check failed", "a DeepEP kernel timed out waiting for a peer"),
    ("CUDA out of memory", "CUDA out of memory"),
    ("cannot open shared object file", "a shared library was not found at run time"),
    ("No such file or directory: 'nvcc'", "no nvcc"),
    ("fatal error:", "a header is missing"),
    ("cannot find -l", "a library is missing at link time"),
    ("error:", "compile error"),
    ("FAILED:", "a build step failed"),
    ("Error", "error"),
)


def check_bundle(root: Path) -> list[str]:
    """What an unpacked deepep.tar.xz lacks (empty when complete) and whether its source is the pinned commit."""
    problems = [f"missing {f}" for f in BUNDLE_FILES if not (root / f).is_file()]
    commit = (root / "src" / "COMMIT").read_text().strip() if (root / "src" / "COMMIT").is_file() else ""
    if commit and commit != DEEPEP_COMMIT and not os.environ.get("DEEPEP_COMMIT"):
        problems.append(f"src/COMMIT is {commit}, not the pinned {DEEPEP_COMMIT}")
    return problems


def source_digest(src: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(src.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(src)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def explain(text: str) -> Optional[str]:
    """The first known cause found in a log, with the line that shows it."""
    lines = text.splitlines()
    for needle, cause in CAUSES:
        for line in lines:
            if needle in line:
                return f"{cause}: {line.strip()[:300]}"
    return None


def tail(text: str, n: int = 30) -> str:
    return "\n".join(text.splitlines()[-n:])[-4000:]


def child_env(extra_path: list[Path] = (), **more: str) -> dict[str, str]:
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in extra_path), env.get("PYTHONPATH", "")]).strip(os.pathsep)
    env.update(MULTICAST_OFF)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(more)
    return env


def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str], cwd: Optional[Path] = None
               ) -> tuple[Optional[int], str, float]:
    """(exit code or None when killed at the timeout, the log's text, seconds). The command runs in a process
    group of its own, killed whole at the timeout (DeepEP's tests spawn one process per GPU)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            rc: Optional[int] = p.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
    text = log.read_text(errors="replace")
    return rc, text, round(time.monotonic() - t0, 1)


def outcome(rc: Optional[int], text: str, secs: float, timeout_s: float, **extra: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"ok": rc == 0, "exit": rc, "s": secs, **extra}
    if rc is None:
        rec["why"] = f"killed after {round(timeout_s)} s (timeout)"
    elif rc != 0:
        rec["why"] = explain(text) or f"exit {rc}"
        rec["log_tail"] = tail(text)
    return rec


def quiet(cmd: list[str]) -> str:
    """A command's output, or "" when it is not there or fails."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def nvshmem_dir() -> Optional[Path]:
    """The nvidia-nvshmem wheel's folder (include/, lib/), as DeepEP's setup.py finds it."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia.nvshmem")
        return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
    except (ImportError, ValueError):
        return None


def cuda_home() -> Optional[str]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent)
    return "/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").exists() else None


def pip_cuda_includes() -> list[Path]:
    """Header folders of the CUDA libraries torch's wheels install (nvidia/cu13/include: cublas, cusparse,
    cusolver, ...), which torch's ATen/cuda headers include; a toolkit assembled from wheels may lack them."""
    found: list[Path] = []
    for entry in sys.path:
        for d in sorted(Path(entry or ".").glob("nvidia/*/include")):
            if d.is_dir() and d not in found and d.parent.name != "nvshmem":
                found.append(d)
    return found


LINK_NAMES = {  # what torch's CUDAExtension and DeepEP link with -l, and where a host may keep it instead
    "libcudart.so": ("{cuda}/lib64/libcudart.so", "{cuda}/lib64/libcudart.so.13", "{pip}/libcudart.so.13"),
    "libcuda.so": ("{cuda}/lib64/stubs/libcuda.so", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1",
                   "/usr/local/nvidia/lib64/libcuda.so.1"),
}


def link_dir(work: Path, cuda: str) -> Path:
    """A folder of libcudart.so / libcuda.so links for the linker's LIBRARY_PATH (searched after the -L folders,
    so a toolkit that has them wins): a toolkit assembled from wheels has only the versioned names."""
    d = work / "link"
    d.mkdir(parents=True, exist_ok=True)
    pip = next((str(p.parent / "lib") for p in pip_cuda_includes() if (p.parent / "lib").is_dir()), "/nonexistent")
    for name, candidates in LINK_NAMES.items():
        target = next((Path(c.format(cuda=cuda, pip=pip)) for c in candidates
                       if Path(c.format(cuda=cuda, pip=pip)).exists()), None)
        if target is not None and not (d / name).exists():
            (d / name).symlink_to(target)
    return d


def build_env(cuda: str, ib_headers: Optional[Path] = None, system_include: Path = Path("/usr/include"),
              link: Optional[Path] = None) -> dict[str, str]:
    """setup.py's environment: sm_90 only; NVSHMEM found by setup.py itself as the nvidia-nvshmem wheel (with
    NVSHMEM_DIR set it would link -l:libnvshmem_host.so, a name the wheel lacks; found, it links
    -l:libnvshmem_host.so.3 with an rpath to the wheel); for the host compiler (nvcc preprocesses with it too)
    CUDA 13's CCCL headers, rdma-core's verbs/mlx5dv headers where the system has none (NVSHMEM's
    nvshmem_common_ibgda.h includes <infiniband/mlx5dv.h>; the bundle carries Debian's), then the pip CUDA
    libraries' headers. CPLUS_INCLUDE_PATH comes after torch's -I$CUDA_HOME/include, so it only fills gaps."""
    extra = {"TORCH_CUDA_ARCH_LIST": "9.0", "DISABLE_SM90_FEATURES": "0", "MAX_JOBS": str(os.cpu_count() or 8),
             "CUDA_HOME": cuda}
    dirs = [Path(cuda) / "include" / "cccl"]
    if ib_headers is not None and not (system_include / "infiniband" / "mlx5dv.h").exists():
        dirs.append(ib_headers)
    dirs += pip_cuda_includes()
    extra["CPLUS_INCLUDE_PATH"] = os.pathsep.join(
        [str(d) for d in dirs if d.is_dir()] + ([os.environ["CPLUS_INCLUDE_PATH"]] if os.environ.get("CPLUS_INCLUDE_PATH") else []))
    if link is not None:
        extra["LIBRARY_PATH"] = os.pathsep.join(filter(None, [os.environ.get("LIBRARY_PATH"), str(link)]))
    env = child_env(**extra)
    env.pop("NVSHMEM_DIR", None)
    return env


def patch_source(src: Path) -> list[str]:
    """SGLang's image raises DeepEP's CPU-side timeout (a rank JIT-compiling DeepGEMM kernels keeps its peers
    waiting); the same edit here."""
    cfg = src / "csrc" / "kernels" / "configs.cuh"
    text = cfg.read_text()
    new = text.replace("#define NUM_CPU_TIMEOUT_SECS 100\n", "#define NUM_CPU_TIMEOUT_SECS 1000\n")
    cfg.write_text(new)
    return ["csrc/kernels/configs.cuh: NUM_CPU_TIMEOUT_SECS 100 -> 1000"] if new != text else []


API_PROBE = r"""
import inspect, json, sys
import deep_ep
api, attrs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def get(path):
    obj = deep_ep
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
missing = []
for fn, params in api.items():
    have = inspect.signature(get(fn)).parameters
    missing += [f"{fn}({p})" for p in params if p not in have]
for a in attrs:
    try:
        get(a)
    except AttributeError:
        missing.append(a)
print(json.dumps({"file": deep_ep.__file__, "missing": missing}))
sys.exit(1 if missing else 0)
"""

GEMM_PROBE = r"""
import json, time, torch, deep_gemm
torch.manual_seed(0)
out = []
for n, k in ((256, 256), (256, 128)):  # deepseek-tiny's experts: w13 (2 x 128 intermediate, hidden 256), w2
    for per_group in (128, 256, 512):
        g = 4  # 8 routed experts over EP 2
        a = torch.randn(g * per_group, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
        d = torch.empty(g * per_group, n, device="cuda", dtype=torch.bfloat16)
        m_indices = torch.arange(g, device="cuda", dtype=torch.int32).repeat_interleave(per_group)
        t0 = time.time()
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)
        torch.cuda.synchronize()
        ref = torch.cat([a[i * per_group:(i + 1) * per_group].float() @ b[i].float().T for i in range(g)])
        err = ((d.float() - ref).abs().max() / ref.abs().max()).item()
        out.append({"n": n, "k": k, "m": g * per_group, "rel_err": err, "first_call_s": round(time.time() - t0, 2)})
print(json.dumps(out))
assert all(o["rel_err"] < 2e-2 for o in out), out
"""


class Runner:
    def __init__(self, a: argparse.Namespace):
        self.root: Path = a.root
        self.bundle = self.root / "deepep"
        self.built = self.root / "deepep-built"
        self.site = self.bundle / "site"
        self.work = self.root / "deepep-work"
        self.logs: Path = a.logs
        self.a = a
        self.deadline = config.deadline_from_env()
        self.state_file = self.root / "state" / "deepep.json"
        try:
            self.state: dict[str, Any] = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            self.state = {}
        if self.state.get("deepep_commit") != DEEPEP_COMMIT:
            self.state = {}
        self.state.update(deepep_commit=DEEPEP_COMMIT, deepgemm=DEEPGEMM_WHEELS[0], shape=SHAPE)
        self.steps: dict[str, Any] = self.state.setdefault("steps", {})
        if self.steps.get("build", {}).get("ok") and not (self.site / "deep_ep").is_dir():
            # a newly carried deepep.tar.xz replaced the folder the build was in: everything after `host` again
            self.steps = self.state["steps"] = {k: v for k, v in self.steps.items() if k == "host"}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def required(self) -> tuple[str, ...]:
        """The steps the verdict needs: DeepEP's own and the shape steps this call asked for (shapes_ll only
        where DeepEP's low-latency test passed on this host: elsewhere it cannot run, which is a finding)."""
        shapes = [s for s in ("shapes", "shapes_ll") if s in self.a.shape_steps
                  and (s == "shapes" or self.steps.get("low_latency", {}).get("ok"))]
        return (*REQUIRED[:-1], *shapes)

    def save(self) -> None:
        required = self.required()
        failed = next((s for s in required if s in self.steps and not self.steps[s].get("ok")
                       and not self.steps[s].get("pending")), None)
        self.state["failed"] = failed and {"step": failed, "why": self.steps[failed].get("why")}
        done = all(self.steps.get(s, {}).get("ok") for s in required)
        self.state["verdict"] = "fail" if failed else "pass" if done else "incomplete"
        self.state["not_run"] = [s for s in required if s not in self.steps or self.steps[s].get("pending")]
        results_io.write_json(self.state_file, self.state)
        results_io.write_json(self.a.out, self.state)

    def do(self, name: str, fn: Callable[[], dict[str, Any]], rerun_failed: bool = True) -> bool:
        prior = self.steps.get(name)
        if prior and prior.get("pending"):  # what it waited for (SGLang, 4 GPUs) may be here now
            prior = None
        if prior and (prior.get("ok") or not rerun_failed):
            print(f"deepep {name}: {'ok' if prior.get('ok') else 'failed'} in an earlier call", flush=True)
            return bool(prior.get("ok"))
        if self.left() < NEEDS_S[name]:
            print(f"deepep {name}: not started, {round(self.left())} s left (needs {NEEDS_S[name]})", flush=True)
            return False
        print(f"deepep {name}: start ({round(self.left())} s left)", flush=True)
        try:
            rec = fn()
        except Exception as e:  # a step's own bug or a missing piece: recorded, the phase goes on
            rec = {"ok": False, "why": f"{type(e).__name__}: {e}"}
        self.steps[name] = rec
        self.save()
        print(f"deepep {name}: {'ok' if rec.get('ok') else 'FAILED: ' + str(rec.get('why'))} ({rec.get('s', '-')} s)",
              flush=True)
        return bool(rec.get("ok"))

    # --- steps ---------------------------------------------------------------------------------------------
    def host(self) -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                                "torch_cuda": torch.version.cuda, "cuda_home": cuda_home(),
                                "nvcc": shutil.which("nvcc") or None}
        if info["cuda_home"] and Path(info["cuda_home"], "bin", "nvcc").exists():
            out = quiet([str(Path(info["cuda_home"], "bin", "nvcc")), "--version"])
            info["nvcc_version"] = out.splitlines()[-1] if out else None
        nv = nvshmem_dir()
        info["nvshmem_dir"] = str(nv) if nv else None
        for dist in ("nvidia-nvshmem-cu13", "nvidia-nccl-cu13", "setuptools", "ninja", "nvidia-ml-py"):
            try:
                info[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                info[dist] = None
        if nv:
            info["nvshmem_libs"] = sorted(p.name for p in (nv / "lib").glob("*nvshmem*"))
            info["nvshmem_headers"] = (nv / "include" / "nvshmem.h").exists()
        info["gpus"] = torch.cuda.device_count()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
        ib = Path("/sys/class/infiniband")
        info["rdma_nics"] = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
        info["gdrdrv"] = Path("/dev/gdrdrv").exists()
        topo = quiet(["nvidia-smi", "topo", "-m"])
        info["nvlink"] = "NV" in topo
        info["topology"] = topo
        info["multicast_off"] = {k: os.environ.get(k) for k in MULTICAST_OFF}
        why = [w for w, bad in (("no nvcc (CUDA_HOME/bin/nvcc)", not info.get("nvcc_version")),
                                ("nvidia-nvshmem-cu13 is not installed", nv is None),
                                ("the NVSHMEM wheel has no headers or libnvshmem_device.a",
                                 nv is not None and not (info.get("nvshmem_headers")
                                                         and "libnvshmem_device.a" in info.get("nvshmem_libs", []))),
                                ("fewer than 2 GPUs", info["gpus"] < 2)) if bad]
        return {"ok": not why, "why": "; ".join(why) or None, "s": 0, **info}

    def build(self) -> dict[str, Any]:
        if (self.built / "deep_ep").is_dir():  # a build an earlier call returned, carried back in
            commit = (self.built / "COMMIT").read_text().strip() if (self.built / "COMMIT").exists() else ""
            if commit != DEEPEP_COMMIT:
                return {"ok": False, "why": f"deepep-built.tar.xz was built from {commit or 'an unknown commit'}"}
            shutil.rmtree(self.site, ignore_errors=True)
            shutil.copytree(self.built, self.site)
            return {"ok": True, "s": 0, "from": "deepep-built.tar.xz (an earlier call's build)"}
        src = self.bundle / "src"
        if not src.is_dir():
            return {"ok": False, "why": "no DeepEP source: carry .bundle/deepep.tar.xz"}
        digest = source_digest(src)
        prior = self.state.get("build_failed_for")
        if prior == digest:
            return {"ok": False, "why": "the same source failed to build in an earlier call on this machine"}
        nv, cuda = nvshmem_dir(), cuda_home()
        if nv is None or cuda is None:
            return {"ok": False, "why": "no NVSHMEM wheel" if nv is None else "no CUDA toolkit"}
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.copytree(src, self.work)
        patches = patch_source(self.work)
        env = build_env(cuda, self.bundle / "include", link=link_dir(self.work, cuda))
        timeout = self.left() - 20
        rc, text, secs = run_logged([sys.executable, "setup.py", "build"], self.logs / "build.log", timeout, env,
                                    cwd=self.work)
        summary = [ln.strip() for ln in text.splitlines() if ln.startswith(" > ")]
        rec = outcome(rc, text, secs, timeout, patches=patches, nvshmem_dir=str(nv), summary=summary,
                      arch=env["TORCH_CUDA_ARCH_LIST"], max_jobs=env["MAX_JOBS"],
                      cplus_include_path=env.get("CPLUS_INCLUDE_PATH"), library_path=env.get("LIBRARY_PATH"))
        if rc == 0 and "All internode and low-latency features are disabled" in text:
            rec["nvshmem"] = "not found by setup.py: built without it (normal kernels only)"
        if rc == 0:
            libs = list((self.work / "build").glob("lib.*"))
            if not libs:
                return {**rec, "ok": False, "why": "setup.py build left no build/lib.* folder"}
            shutil.rmtree(self.site, ignore_errors=True)
            shutil.copytree(libs[0], self.site)
            (self.site / "COMMIT").write_text(DEEPEP_COMMIT + "\n")
            so = sorted(self.site.glob("deep_ep_cpp*.so"))
            rec["extension"] = {p.name: p.stat().st_size for p in so}
            if not so:
                rec.update(ok=False, why="no deep_ep_cpp*.so in the build")
        elif rc is not None:
            self.state["build_failed_for"] = digest
        return rec

    def pack_built(self) -> None:
        """The build as deepep-built.tar.xz under $OUT, for a later call to carry instead of building again."""
        if not self.a.built_out or not (self.site / "deep_ep").is_dir():
            return
        import tarfile

        with tarfile.open(self.a.built_out, "w:xz") as t:
            for p in sorted(self.site.iterdir()):
                if p.name != "__pycache__":
                    t.add(p, arcname=p.name, filter=lambda ti: None if "__pycache__" in ti.name else ti)
        size = self.a.built_out.stat().st_size
        if size > 15 * 1024 * 1024:  # what one file back from a device call may weigh
            self.a.built_out.unlink()
        self.state["built_archive_bytes"] = size

    def api(self) -> dict[str, Any]:
        rc, text, secs = run_logged([sys.executable, "-c", API_PROBE, json.dumps(SGLANG_API), json.dumps(SGLANG_ATTRS)],
                                    self.logs / "import.log", TIMEOUT_S["import"], child_env([self.site]))
        rec = outcome(rc, text, secs, TIMEOUT_S["import"])
        last = text.strip().splitlines()[-1] if text.strip() else ""
        if last.startswith("{"):
            rec.update(json.loads(last))
            if rec.get("missing"):
                rec["why"] = "deep_ep lacks what SGLang 0.5.17 calls: " + ", ".join(rec["missing"])
        return rec

    def deepep_test(self, name: str, script: str, args: tuple[str, ...]) -> dict[str, Any]:
        cmd = [sys.executable, f"tests/{script}", *args]
        rc, text, secs = run_logged(cmd, self.logs / f"{name}.log", TIMEOUT_S[name],
                                    child_env([self.site], MASTER_ADDR="127.0.0.1", MASTER_PORT="8361"),
                                    cwd=self.work if self.work.is_dir() else self.bundle / "src")
        return outcome(rc, text, secs, TIMEOUT_S[name], args=" ".join(args))

    def deepgemm(self) -> dict[str, Any]:
        rc, text, secs = run_logged([sys.executable, "-c", GEMM_PROBE], self.logs / "deepgemm.log",
                                    TIMEOUT_S["deepgemm"], child_env([self.bundle / "deepgemm"], **dg_cache_env()))
        rec = outcome(rc, text, secs, TIMEOUT_S["deepgemm"])
        lines = [ln for ln in text.splitlines() if ln.startswith("[")]
        if lines:
            rec["gemms"] = json.loads(lines[-1])
        return rec

    def shapes(self, shape: str = SHAPE, model: str = "deepseek-tiny") -> dict[str, Any]:
        if not (self.root / "sglang" / ".unpacked").exists():
            return {"ok": False, "pending": True, "why": "no SGLang bundle on this machine yet: carry .bundle/sglang.tar.xz "
                                                         "in the next call (warm machine)"}
        if self.a.gpus < 4:
            return {"ok": False, "pending": True,
                    "why": f"{shape} needs 4 GPUs (run_all.sh --gpus 4), this run has {self.a.gpus}"}
        env = child_env([self.site, self.bundle / "deepgemm"], **dg_cache_env())
        # site and deepgemm go after SGLang's bundle on the path (its tvm_ffi is the same version)
        env["PYTHONPATH"] = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(self.site),
                                             str(self.bundle / "deepgemm")]).strip(os.pathsep)
        rc, text, secs = run_logged([sys.executable, "-m", "e2e.make_tiny_models", str(self.a.models),
                                     "--only", model], self.logs / f"models_{model}.log", 300, env)
        if rc != 0:
            return outcome(rc, text, secs, 300, what="make_tiny_models")
        out = shapes_out(self.a.shapes_out, shape)
        timeout = self.left() - 15
        rc, text, secs = run_logged([sys.executable, "-m", "e2e.shapes", "--models", str(self.a.models), "--out",
                                     str(out), "--logs", str(self.logs / shape), "--only", shape],
                                    self.logs / f"{shape}.log", timeout, env)
        rec = outcome(rc, text, secs, timeout)
        try:
            entry = json.loads(out.read_text())["shapes"][shape]
        except (OSError, ValueError, KeyError):
            return rec
        rec.update(verdict=entry.get("verdict"), status=entry.get("status"), summary=entry.get("summary"),
                   controls_flagged=entry.get("controls_flagged"))
        if entry.get("verdict") != "pass":
            errors = entry.get("errors") or {}
            rec["errors"] = {k: tail(str(v), 20) for k, v in errors.items()}
            rec["why"] = (f"{shape}: {entry.get('status')}; "
                          + (explain("\n".join(map(str, errors.values()))) or "see errors")) if errors else \
                f"{shape}: verdict {entry.get('verdict')} ({entry.get('status')})"
        return rec

    def run(self) -> int:
        self.save()
        if not self.do("host", self.host):
            return self.finish()
        fresh = "build" not in self.steps or not self.steps["build"].get("ok")
        built = self.do("build", self.build)
        if built and fresh and not self.steps["build"].get("from"):  # built in this call: send it back
            self.pack_built()
        if built:  # also a build carried from an earlier call: its extension must load here
            built = self.do("import", self.api)
        if built:
            self.do("intranode", lambda: self.deepep_test("intranode", "test_intranode.py", INTRANODE_ARGS))
        if built or (self.bundle / "deepgemm").is_dir():
            self.do("deepgemm", self.deepgemm)
        ready = built and all(self.steps.get(s, {}).get("ok") for s in ("intranode", "deepgemm"))
        if ready and "shapes" in self.a.shape_steps:
            self.do("shapes", self.shapes)
        if built:  # a probe: once per machine, whatever it found
            self.do("low_latency", lambda: self.deepep_test("low_latency", "test_low_latency.py", LOW_LATENCY_ARGS),
                    rerun_failed=False)
        if ready and "shapes_ll" in self.a.shape_steps and self.steps.get("low_latency", {}).get("ok"):
            # not required: the profile's decode mode, where the kernels ran on this host
            self.do("shapes_ll", lambda: self.shapes(LL_SHAPE, LL_MODEL), rerun_failed=False)
        return self.finish()

    def finish(self) -> int:
        self.save()
        print(json.dumps({k: self.state.get(k) for k in ("verdict", "failed", "not_run")}), flush=True)
        return 0 if self.state.get("verdict") == "pass" else 1


def shapes_out(first: Path, shape: str) -> Path:
    """Where a shape's result goes: `first` (--shapes-out, mini-b-deepep's) with the shape's name in its place."""
    return first if shape == SHAPE else first.with_name(first.name.replace(SHAPE, shape))


def dg_cache_env() -> dict[str, str]:
    """DeepGEMM's JIT cache where SGLang points it (SGLANG_DG_CACHE_DIR, default ~/.cache/deep_gemm), so the
    kernels the probe compiles are there for the servers; CUDA_HOME for its nvcc."""
    env = {"DG_JIT_CACHE_DIR": os.environ.get("SGLANG_DG_CACHE_DIR", str(Path.home() / ".cache" / "deep_gemm"))}
    home = cuda_home()
    if home:
        env["CUDA_HOME"] = home
    return env


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", type=Path, default=config.e2e_root())
    r.add_argument("--models", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--logs", type=Path, required=True)
    r.add_argument("--gpus", type=int, default=int(os.environ.get("E2E_GPUS", "2")))
    r.add_argument("--shapes-out", type=Path, default=None)
    r.add_argument("--built-out", type=Path, default=None)
    r.add_argument("--shape-steps", type=lambda v: tuple(x for x in v.split(",") if x), default=("shapes", "shapes_ll"),
                   help="which shapes to run: shapes (mini-b-deepep), shapes_ll (mini-b-deepep-ll), comma-separated")
    c = sub.add_parser("check-bundle")
    c.add_argument("dir", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "check-bundle":
        problems = check_bundle(a.dir)
        for p in problems:
            print(f"deepep bundle: {p}", file=sys.stderr)
        return 1 if problems else 0
    if a.shapes_out is None:
        a.shapes_out = a.out.with_name(f"shapes_{SHAPE}.json")
    return Runner(a).run()


if __name__ == "__main__":
    sys.exit(main())
