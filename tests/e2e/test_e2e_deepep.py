"""DeepEP on the GPU host (e2e/deepep.py, run_all.sh --phase deepep, build_bundle.sh deepep, the mini-b-deepep
topology), checked on CPU: what the shape renders and SGLang accepts, what the bundle holds, how the phase
refuses without it, and how the step runner records, skips and resumes."""
import json
import os
import shutil
import subprocess
import tarfile
import zipfile
from argparse import Namespace
from pathlib import Path

import pytest

from e2e import deepep
from e2e.shape_plan import DEFAULT_SHAPES, SHAPES, plan
from sglang_p2p_backend.launch.config import load_config
from sglang_p2p_backend.launch.render import server_command
from sglang_p2p_backend.launch.validate import validate
from test_e2e_shapes import flags

REPO = Path(__file__).resolve().parents[2]
TOPO = REPO / "configs" / "topologies"



def rendered(name, release="0.5.17"):
    cfg = validate(load_config(TOPO / f"{name}.yaml", model_path="/m"))
    return {n.role: server_command(cfg, n, release) for n in cfg.nodes()}


@pytest.mark.parametrize("release", ["0.5.17", "0.5.23"])
def test_mini_b_deepep_is_mini_b_dp_both_with_deepep_on_both_sides(release):
    ours, base = rendered("mini-b-deepep", release), rendered("mini-b-dp-both", release)
    for role in ("prefill", "decode"):
        f, b = flags(ours[role].args), flags(base[role].args)
        assert f["--moe-a2a-backend"] == ["deepep"] and f["--deepep-mode"] == ["normal"]
        assert f["--moe-runner-backend"] == ["deep_gemm"] and f["--ep-size"] == ["2"]
        added = {"--moe-a2a-backend", "--deepep-mode", "--moe-runner-backend"}
        ports = {"--port", "--dist-init-addr", "--disaggregation-bootstrap-port"}
        assert {k: v for k, v in f.items() if k not in added | ports} == {k: v for k, v in b.items() if k not in ports}
        env = ours[role].env
        assert env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "0"
        assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")


def test_the_shape_runs_only_when_asked_and_its_reference_carries_deepep():
    shape = SHAPES["mini-b-deepep"]
    assert shape.same_layout and shape.kv_digest and shape.needs == ("deep_ep", "deep_gemm")
    assert "mini-b-deepep" not in DEFAULT_SHAPES and "mini-b-dp-both" in DEFAULT_SHAPES
    launches = plan(shape, Path("/m/deepseek-tiny"), "0.5.17", ["--policy", "round_robin"])
    assert [l.role for l in launches] == ["prefill", "decode", "reference", "lb"]
    ref = flags(tuple(launches[2].argv[3:]))
    assert ref["--moe-a2a-backend"] == ["deepep"] and ref["--base-gpu-id"] == ["0"] and ref["--port"] == ["30890"]
    assert dict(launches[2].env)["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "0"
    run_all = (REPO / "e2e" / "run_all.sh").read_text()
    assert "mini-b-deepep" not in run_all.split("run_shapes() {")[1].split("}")[0]  # not in the shapes phase


@pytest.mark.parametrize("release", ["0.5.17", "0.5.23"])
def test_the_low_latency_shape_is_mini_b_deepep_with_the_profiles_decode_mode(release):
    ours, base = rendered("mini-b-deepep-ll", release), rendered("mini-b-deepep", release)
    ports = {"--port", "--dist-init-addr", "--disaggregation-bootstrap-port"}

    def no_ports(cmd):
        return {k: v for k, v in flags(cmd.args).items() if k not in ports}

    assert no_ports(ours["prefill"]) == no_ports(base["prefill"])
    f, b = no_ports(ours["decode"]), no_ports(base["decode"])
    assert f.pop("--deepep-mode") == ["low_latency"] and b.pop("--deepep-mode") == ["normal"] and f == b
    shape = SHAPES["mini-b-deepep-ll"]
    assert (shape.model, shape.same_layout, shape.kv_digest) == ("deepseek-wide", False, True)
    assert "mini-b-deepep-ll" not in DEFAULT_SHAPES
    launches = plan(shape, Path("/m/deepseek-wide"), release, [])
    assert [l.role for l in launches] == ["prefill", "decode", "reference", "reference-prefill", "lb"]
    modes = {l.role: flags(tuple(l.argv[3:]))["--deepep-mode"] for l in launches if l.role.startswith("reference")}
    assert modes == {"reference": ["low_latency"], "reference-prefill": ["normal"]}  # both layouts' references


def test_deepseek_wide_is_deepseek_tiny_at_a_hidden_size_the_low_latency_kernels_take():
    from e2e import make_tiny_models as mtm

    ids = {"bos": 1, "eos": 2, "pad": 0}
    wide, tiny = mtm.specs(ids)["deepseek-wide"].config, mtm.specs(ids)["deepseek-tiny"].config
    assert wide["hidden_size"] == 2048  # DeepEP's SWITCH_HIDDEN: 2048 to 8192
    assert {k: v for k, v in wide.items() if k not in ("hidden_size", "intermediate_size")} == \
        {k: v for k, v in tiny.items() if k not in ("hidden_size", "intermediate_size")}


@pytest.mark.sglang
def test_sglangs_parser_accepts_the_deepep_commands():
    from sglang_p2p_backend.launch.sglang_parser import checker

    chk = checker()
    launches = plan(SHAPES["mini-b-deepep"], Path("/m/deepseek-tiny"), chk.release, [])
    for cmd in rendered("mini-b-deepep", chk.release).values():
        assert chk.problems(cmd) == []
        ns = chk.parser.parse_args(list(cmd.args))
        assert (ns.moe_a2a_backend, ns.deepep_mode, ns.moe_runner_backend, ns.ep_size) == ("deepep", "normal", "deep_gemm", 2)
    for role, cmd in rendered("mini-b-deepep-ll", chk.release).items():
        assert chk.problems(cmd) == []
        assert chk.parser.parse_args(list(cmd.args)).deepep_mode == ("low_latency" if role == "decode" else "normal")
    ref = launches[2].argv[3:]
    ns = chk.parser.parse_args(ref)
    assert ns.moe_a2a_backend == "deepep" and ns.disaggregation_mode == "null"


@pytest.mark.sglang
def test_the_bundle_carries_the_deepgemm_sglang_pins():
    from importlib import metadata

    if metadata.version("sglang") != "0.5.17":
        pytest.skip("the GPU host runs SGLang 0.5.17")
    pins = {r.split(";")[0].replace(" ", "") for r in metadata.requires("sglang") or []}
    assert set(deepep.DEEPGEMM_WHEELS) <= pins


def test_sglangs_deepep_dispatcher_calls_only_what_the_probe_checks():
    """Every keyword SGLang 0.5.17's dispatcher passes to deep_ep is in the import probe's list."""
    src = REPO / ".deps" / "sglang-0.5.17" / "sglang" / "srt" / "layers" / "moe" / "token_dispatcher" / "deepep.py"
    if not src.exists():
        pytest.skip("SGLang 0.5.17's source is not unpacked here (.deps)")
    text = src.read_text()
    for fn in ("low_latency_dispatch", "low_latency_combine", "get_dispatch_layout", "get_low_latency_rdma_size_hint",
               "clean_low_latency_buffer", "get_dispatch_config", "get_combine_config"):
        assert f".{fn}(" in text and any(fn in k for k in (*deepep.SGLANG_API, *deepep.SGLANG_ATTRS))
    for kw in ("low_latency_mode", "num_qps_per_rank", "allow_mnnvl", "use_fabric", "round_scale", "use_ue8m0",
               "return_recv_hook", "expert_alignment", "allocate_on_comm_stream"):
        assert kw in text and any(kw in ps for ps in deepep.SGLANG_API.values())


def test_pinned_deepep_has_the_api_sglang_calls():
    """Against the pinned source, where a built bundle is here (.bundle/deepep.tar.xz; CI has none)."""
    import ast

    archive = REPO / ".bundle" / "deepep.tar.xz"
    if not archive.exists():
        pytest.skip("no .bundle/deepep.tar.xz (bash e2e/build_bundle.sh .bundle deepep)")
    with tarfile.open(archive) as t:
        buffer_py = t.extractfile("./src/deep_ep/buffer.py").read().decode()
        commit = t.extractfile("./src/COMMIT").read().decode().strip()
    assert commit == deepep.DEEPEP_COMMIT
    cls = next(n for n in ast.parse(buffer_py).body if isinstance(n, ast.ClassDef) and n.name == "Buffer")
    methods = {f.name: {a.arg for a in f.args.args + f.args.kwonlyargs} for f in cls.body if isinstance(f, ast.FunctionDef)}
    for fn, params in deepep.SGLANG_API.items():
        name = fn.split(".")[1]
        assert set(params) <= methods[name], (fn, set(params) - methods[name])
    for attr in deepep.SGLANG_ATTRS:
        if attr.startswith("Buffer."):
            assert attr.split(".")[1] in methods or f"{attr.split('.')[1]}:" in buffer_py


# --- the bundle ----------------------------------------------------------------------------------------------
def fake_deepep_repo(tmp_path: Path) -> tuple[Path, str]:
    repo = tmp_path / "DeepEP"
    for f in ("setup.py", "csrc/deep_ep.cpp", "csrc/kernels/intranode.cu", "csrc/kernels/internode_ll.cu",
              "deep_ep/buffer.py", "tests/test_intranode.py", "tests/test_low_latency.py", "tests/utils.py",
              "LICENSE", "README.md", "figures/normal.png"):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text(f"# {f}\n")
    (repo / "csrc/kernels/configs.cuh").write_text("#define NUM_CPU_TIMEOUT_SECS 100\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    return repo, sha


def fake_wheels(tmp_path: Path) -> Path:
    d = tmp_path / "wheels"
    d.mkdir()
    for name, files in (("sgl_deep_gemm-0.1.5.post1-py3-none-manylinux2014_x86_64.whl",
                         ("deep_gemm/__init__.py", "deep_gemm/_C.so")),
                        ("apache_tvm_ffi-0.1.11-cp312-abi3-manylinux_2_28_x86_64.whl", ("tvm_ffi/__init__.py",))):
        with zipfile.ZipFile(d / name, "w") as z:
            for f in files:
                z.writestr(f, "x")
    return d


def fake_debs(tmp_path: Path) -> Path:
    """libibverbs-dev and linux-libc-dev as dpkg-deb builds them, holding only the headers the bundle takes."""
    d = tmp_path / "debs"
    d.mkdir()
    for pkg, headers in (("libibverbs-dev", ("infiniband/mlx5dv.h", "infiniband/verbs.h", "infiniband/mlx5_api.h")),
                         ("linux-libc-dev", ("rdma/ib_user_verbs.h", "linux/types.h"))):
        root = tmp_path / f"deb-{pkg}"
        (root / "DEBIAN").mkdir(parents=True)
        (root / "DEBIAN" / "control").write_text(f"Package: {pkg}\nVersion: 1.0\nArchitecture: amd64\n"
                                                 f"Maintainer: t <t@t>\nDescription: t\n")
        for h in headers:
            (root / "usr/include" / h).parent.mkdir(parents=True, exist_ok=True)
            (root / "usr/include" / h).write_text(f"/* {h} */\n")
        subprocess.run(["dpkg-deb", "-b", "-Zgzip", str(root), str(d / f"{pkg}_1.0_amd64.deb")], check=True,
                       capture_output=True)
    return d


def offline_env(tmp_path: Path, repo: Path, sha: str) -> dict[str, str]:
    return {**os.environ, "DEEPEP_GIT": str(repo), "DEEPEP_COMMIT": sha, "DEEPEP_WHEELS": str(fake_wheels(tmp_path)),
            "DEEPEP_DEBS": str(fake_debs(tmp_path)), "XZ_THREADS": "1"}


def test_build_bundle_deepep_packs_the_source_at_the_commit_and_deepgemm(tmp_path):
    if not shutil.which("dpkg-deb"):
        pytest.skip("no dpkg-deb")
    repo, sha = fake_deepep_repo(tmp_path)
    env = offline_env(tmp_path, repo, sha)
    p = subprocess.run(["bash", str(REPO / "e2e/build_bundle.sh"), str(tmp_path / "out"), "deepep"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    with tarfile.open(tmp_path / "out" / "deepep.tar.xz") as t:
        names = {n.lstrip("./") for n in t.getnames()}
        assert t.extractfile("./src/COMMIT").read().decode().strip() == sha
    assert {f for f in deepep.BUNDLE_FILES} <= names and "include/infiniband/mlx5_api.h" in names
    assert not any(n.startswith(("src/figures", "include/linux")) for n in names)  # only what is read there


def test_build_bundle_deepep_refuses_an_incomplete_source(tmp_path):
    if not shutil.which("dpkg-deb"):
        pytest.skip("no dpkg-deb")
    repo, _ = fake_deepep_repo(tmp_path)
    subprocess.run(["git", "-C", str(repo), "rm", "-q", "tests/utils.py"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "y"],
                   check=True)
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = offline_env(tmp_path, repo, sha)
    p = subprocess.run(["bash", str(REPO / "e2e/build_bundle.sh"), str(tmp_path / "out"), "deepep"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode != 0 and "missing src/tests/utils.py" in p.stderr
    assert not (tmp_path / "out" / "deepep.tar.xz").exists()


def test_check_bundle_names_what_is_missing_and_a_foreign_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPEP_COMMIT", raising=False)
    for f in deepep.BUNDLE_FILES:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")
    (tmp_path / "src/COMMIT").write_text(deepep.DEEPEP_COMMIT + "\n")
    assert deepep.check_bundle(tmp_path) == []
    (tmp_path / "deepgemm/deep_gemm/_C.so").unlink()
    (tmp_path / "src/COMMIT").write_text("0" * 40)
    assert deepep.check_bundle(tmp_path) == ["missing deepgemm/deep_gemm/_C.so",
                                             f"src/COMMIT is {'0' * 40}, not the pinned {deepep.DEEPEP_COMMIT}"]


# --- run_all.sh --------------------------------------------------------------------------------------------------
def test_run_all_deepep_without_the_bundle_says_what_to_carry(tmp_path):
    env = {**os.environ, "E2E_ROOT": str(tmp_path / "root"), "E2E_BUNDLE": str(tmp_path / "none"),
           "OUT": str(tmp_path / "out")}
    p = subprocess.run(["bash", str(REPO / "e2e/run_all.sh"), "--gpus", "4", "--phase", "deepep"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode == 3 and "carry .bundle/deepep.tar.xz" in p.stderr
    assert not (tmp_path / "root" / "deepep").exists() and not list((tmp_path / "out").glob("deepep*"))
    p = subprocess.run(["bash", str(REPO / "e2e/run_all.sh"), "--phase", "nope"], capture_output=True, text=True)
    assert p.returncode == 2 and "deepep" in p.stderr


def test_run_all_deepep_runs_without_sglang_and_records_why_it_stopped(tmp_path):
    """With the bundle and no SGLang, on a machine without nvcc or GPUs the phase ends at `host` and says why."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU machine would really build")
    bundle = tmp_path / "bundle"
    stage = tmp_path / "stage"
    for f in deepep.BUNDLE_FILES:
        (stage / f).parent.mkdir(parents=True, exist_ok=True)
        (stage / f).write_text("x")
    (stage / "src/COMMIT").write_text(deepep.DEEPEP_COMMIT + "\n")
    bundle.mkdir()
    with tarfile.open(bundle / "deepep.tar.xz", "w:xz") as t:
        t.add(stage, arcname=".")
    import sys

    env = {**os.environ, "E2E_ROOT": str(tmp_path / "root"), "E2E_BUNDLE": str(bundle), "OUT": str(tmp_path / "out"),
           "E2E_KIND": "cpu-test", "CUDA_HOME": str(tmp_path / "no-cuda"),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])}
    p = subprocess.run(["bash", str(REPO / "e2e/run_all.sh"), "--gpus", "4", "--phase", "deepep", "--budget-s", "120"],
                       capture_output=True, text=True, env=env, timeout=120)
    doc = json.loads((tmp_path / "out" / "deepep_cpu-test.json").read_text())
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert doc["deepep_commit"] == deepep.DEEPEP_COMMIT and doc["verdict"] == "fail"
    assert doc["failed"]["step"] == "host" and "no nvcc" in doc["failed"]["why"]
    assert (tmp_path / "root" / "deepep" / "src" / "setup.py").exists()


# --- the step runner -----------------------------------------------------------------------------------------
def make_runner(tmp_path, monkeypatch, left_s=500.0, gpus=4):
    import time

    monkeypatch.setenv("E2E_DEADLINE_EPOCH", str(time.time() + left_s))
    a = Namespace(root=tmp_path / "root", models=tmp_path / "models", out=tmp_path / "out" / "deepep.json",
                  logs=tmp_path / "logs", gpus=gpus, shapes_out=tmp_path / "out" / "shapes_mini-b-deepep_x4.json",
                  built_out=None, shape_steps=("shapes", "shapes_ll"))
    r = deepep.Runner(a)
    calls = []

    def fake(name, ok=True, **more):
        def fn():
            calls.append(name)
            return {"ok": ok, "s": 0, **({} if ok else {"why": f"{name} broke"}), **more}
        return fn

    return r, calls, fake


def test_runner_resumes_keeps_what_passed_and_waits_for_sglang(tmp_path, monkeypatch):
    r, calls, fake = make_runner(tmp_path, monkeypatch)
    monkeypatch.setattr(r, "host", fake("host"))
    monkeypatch.setattr(r, "build", fake("build"))
    monkeypatch.setattr(r, "api", fake("import"))
    monkeypatch.setattr(r, "deepgemm", fake("deepgemm"))
    monkeypatch.setattr(r, "deepep_test", lambda name, *a: fake(name, ok=name == "intranode")())
    (r.site / "deep_ep").mkdir(parents=True)
    assert r.run() == 1  # no SGLang yet: the shape waits, nothing failed
    doc = json.loads(r.a.out.read_text())
    assert doc["verdict"] == "incomplete" and doc["failed"] is None and doc["not_run"] == ["shapes"]
    assert doc["steps"]["shapes"]["pending"] and not doc["steps"]["low_latency"]["ok"]
    assert calls == ["host", "build", "import", "intranode", "deepgemm", "low_latency"]

    (r.root / "sglang").mkdir(parents=True)
    (r.root / "sglang" / ".unpacked").write_text("x")
    r2, calls2, fake2 = make_runner(tmp_path, monkeypatch)
    monkeypatch.setattr(r2, "shapes", fake2("shapes"))
    assert r2.run() == 0
    doc = json.loads(r2.a.out.read_text())
    assert calls2 == ["shapes"] and doc["verdict"] == "pass"  # the low-latency probe is not run twice


def test_the_low_latency_shape_follows_where_the_kernels_ran(tmp_path, monkeypatch):
    """mini-b-deepep-ll (deepseek-wide) runs after mini-b-deepep once DeepEP's low-latency test passed, into a
    result file of its own; E2E_DEEPEP_SHAPES=shapes_ll (--shape-steps) runs it alone, and the verdict is then
    over the steps asked for."""
    for i, (steps, expected) in enumerate(((("shapes", "shapes_ll"), [("mini-b-deepep", "deepseek-tiny"), ("mini-b-deepep-ll", "deepseek-wide")]),
                                           (("shapes_ll",), [("mini-b-deepep-ll", "deepseek-wide")]))):
        machine = tmp_path / str(i)  # a fresh machine each time
        (machine / "root" / "sglang").mkdir(parents=True)
        (machine / "root" / "sglang" / ".unpacked").write_text("x")
        r, calls, fake = make_runner(machine, monkeypatch)
        r.a.shape_steps = steps
        for step in ("host", "build", "api", "deepgemm"):
            monkeypatch.setattr(r, step, fake(step))
        monkeypatch.setattr(r, "deepep_test", lambda name, *a: fake(name)())
        (r.site / "deep_ep").mkdir(parents=True, exist_ok=True)
        shapes = []
        monkeypatch.setattr(r, "shapes", lambda shape=deepep.SHAPE, model="deepseek-tiny": shapes.append((shape, model)) or {"ok": True})
        r.run()
        doc = json.loads(r.a.out.read_text())
        assert shapes == expected
        assert doc["verdict"] == "pass" and doc["not_run"] == []
    assert deepep.shapes_out(r.a.shapes_out, "mini-b-deepep-ll").name == "shapes_mini-b-deepep-ll_x4.json"
    assert deepep.shapes_out(r.a.shapes_out, "mini-b-deepep") == r.a.shapes_out


def test_a_carried_build_is_imported_and_a_failed_low_latency_shape_fails_the_verdict(tmp_path, monkeypatch):
    """A build carried from an earlier call (deepep-built.tar.xz) still has its extension loaded here before
    anything uses it; the low-latency shape, once asked for and runnable, counts in the verdict."""
    (tmp_path / "root" / "sglang").mkdir(parents=True)
    (tmp_path / "root" / "sglang" / ".unpacked").write_text("x")
    r, calls, fake = make_runner(tmp_path, monkeypatch)
    r.a.shape_steps = ("shapes_ll",)
    monkeypatch.setattr(r, "host", fake("host"))
    monkeypatch.setattr(r, "build", fake("build", **{"from": "deepep-built.tar.xz"}))
    monkeypatch.setattr(r, "api", fake("import"))
    monkeypatch.setattr(r, "deepgemm", fake("deepgemm"))
    monkeypatch.setattr(r, "deepep_test", lambda name, *a: fake(name)())
    monkeypatch.setattr(r, "shapes", lambda *a: calls.append("shapes_ll") or {"ok": False, "why": "logprobs off"})
    (r.site / "deep_ep").mkdir(parents=True)
    assert r.run() == 1
    doc = json.loads(r.a.out.read_text())
    assert calls == ["host", "build", "import", "intranode", "deepgemm", "low_latency", "shapes_ll"]
    assert doc["verdict"] == "fail" and doc["failed"] == {"step": "shapes_ll", "why": "logprobs off"}


def test_runner_names_the_first_failed_step_and_skips_what_does_not_fit(tmp_path, monkeypatch):
    r, calls, fake = make_runner(tmp_path, monkeypatch, left_s=100)
    monkeypatch.setattr(r, "host", fake("host"))
    monkeypatch.setattr(r, "build", fake("build"))
    assert r.run() == 1
    doc = json.loads(r.a.out.read_text())
    assert calls == ["host"] and doc["verdict"] == "incomplete" and "build" in doc["not_run"]

    r, calls, fake = make_runner(tmp_path, monkeypatch)
    monkeypatch.setattr(r, "build", fake("build", ok=False))
    assert r.run() == 1
    doc = json.loads(r.a.out.read_text())
    assert calls == ["build"] and doc["failed"] == {"step": "build", "why": "build broke"}


def test_a_newly_carried_bundle_forgets_the_old_build(tmp_path, monkeypatch):
    r, _, _ = make_runner(tmp_path, monkeypatch)
    r.steps.update(host={"ok": True}, build={"ok": True}, intranode={"ok": True})
    r.save()
    r2, _, _ = make_runner(tmp_path, monkeypatch)  # site/deep_ep is not there (run_all.sh unpacked anew)
    assert set(r2.steps) == {"host"}


def test_build_env_and_source_patch(tmp_path, monkeypatch):
    cuda, ib, site = tmp_path / "cuda", tmp_path / "bundle-include", tmp_path / "site"
    for d in (cuda / "include" / "cccl", ib, site / "nvidia" / "cu13" / "include", site / "nvidia" / "nvshmem" / "include"):
        d.mkdir(parents=True)
    monkeypatch.setattr("sys.path", [str(site)])
    monkeypatch.delenv("CPLUS_INCLUDE_PATH", raising=False)
    monkeypatch.setenv("NVSHMEM_DIR", "/somewhere")
    env = deepep.build_env(str(cuda), ib, system_include=tmp_path / "no-system-headers", link=tmp_path / "link")
    # setup.py finds the wheel itself (NVSHMEM_DIR would make it link a libnvshmem_host.so the wheel lacks)
    assert "NVSHMEM_DIR" not in env and env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert env["LIBRARY_PATH"].split(os.pathsep)[-1] == str(tmp_path / "link")
    assert env["CPLUS_INCLUDE_PATH"].split(os.pathsep) == [str(cuda / "include" / "cccl"), str(ib),
                                                           str(site / "nvidia" / "cu13" / "include")]
    (tmp_path / "sys" / "infiniband").mkdir(parents=True)
    (tmp_path / "sys" / "infiniband" / "mlx5dv.h").write_text("")
    env = deepep.build_env(str(cuda), ib, system_include=tmp_path / "sys")
    assert str(ib) not in env["CPLUS_INCLUDE_PATH"].split(os.pathsep)  # the system's own headers win
    assert (env["NCCL_NVLS_ENABLE"], env["NVSHMEM_DISABLE_NVLS"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"]) == ("0", "1", "1")
    (tmp_path / "src/csrc/kernels").mkdir(parents=True)
    cfg = tmp_path / "src/csrc/kernels/configs.cuh"
    cfg.write_text("#ifndef X\n#define NUM_CPU_TIMEOUT_SECS 100\n#else\n#define NUM_CPU_TIMEOUT_SECS 10\n#endif\n")
    assert deepep.patch_source(tmp_path / "src") == ["csrc/kernels/configs.cuh: NUM_CPU_TIMEOUT_SECS 100 -> 1000"]
    assert "NUM_CPU_TIMEOUT_SECS 1000\n" in cfg.read_text() and "NUM_CPU_TIMEOUT_SECS 10\n" in cfg.read_text()


def test_link_dir_gives_the_linker_unversioned_names_a_wheel_toolkit_lacks(tmp_path, monkeypatch):
    cuda, site = tmp_path / "cuda", tmp_path / "site"
    (cuda / "lib64").mkdir(parents=True)
    (cuda / "lib64" / "libcudart.so.13").write_text("")
    (site / "nvidia" / "cu13" / "include").mkdir(parents=True)
    monkeypatch.setattr("sys.path", [str(site)])
    d = deepep.link_dir(tmp_path / "work", str(cuda))
    assert (d / "libcudart.so").resolve() == (cuda / "lib64" / "libcudart.so.13").resolve()
    (cuda / "lib64" / "stubs").mkdir()
    (cuda / "lib64" / "stubs" / "libcuda.so").write_text("")
    assert (deepep.link_dir(tmp_path / "work", str(cuda)) / "libcuda.so").resolve() == cuda / "lib64" / "stubs" / "libcuda.so"


def test_explain_reads_the_known_failures():
    ll = "Allocating buffer\nAssertion failed: csrc/kernels/internode_ll.cu:285, condition: ibgda_get_state()->num_rc_per_pe >= num_local_experts\n"
    assert deepep.explain(ll).startswith("no IBGDA transport")
    assert deepep.explain("csrc/x.cu(3): error: identifier \"foo\" is undefined").startswith("compile error")
    assert deepep.explain("all good") is None


def test_run_logged_kills_the_whole_process_group_at_the_timeout(tmp_path):
    import sys
    import time

    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    t0 = time.monotonic()
    rc, text, secs = deepep.run_logged([sys.executable, "-c", code], tmp_path / "x.log", 1.5, dict(os.environ))
    assert rc is None and time.monotonic() - t0 < 20
    rec = deepep.outcome(rc, text, secs, 1.5)
    assert not rec["ok"] and rec["why"].startswith("killed after")
