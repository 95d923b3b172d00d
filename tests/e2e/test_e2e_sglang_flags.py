"""Every SGLang command the GPU check renders is accepted by SGLang's own parser with the p2pnccl plugin loaded
(run against each supported release; the GPU host runs 0.5.17)."""
from pathlib import Path

import pytest

from e2e import config, sglang_tests
from sglang_p2p_backend.launch.render import Command
from sglang_p2p_backend.launch.sglang_parser import checker

pytestmark = pytest.mark.sglang


def _servers():
    model = Path("/models/llama-tiny")
    for flags in (config.CHECK_FLAGS, config.PERF_FLAGS):
        yield config.reference("m", model, 40010, 0, flags)
        for backend in ("p2pnccl", "mooncake"):
            yield from config.pd_pair("m", model, backend, 40000, flags)[:2]
    # run_all.sh --gpus 1: the perf flags for an H200 and for an 80 GB H100
    for mib in (143771, 81559):
        for backend in ("p2pnccl", "mooncake"):
            yield from config.pd_pair("m", model, backend, 40000, config.perf_flags(1, mib), gpus=1)[:2]
    # the hybrid SWA model (E2E_CHECK_ONLY=swa-tiny): its own flags on the reference and the pair
    swa = Path("/models/swa-tiny")
    yield config.reference("swa-tiny", swa, 40110, 0, config.check_flags("swa-tiny"))
    yield from config.pd_pair("swa-tiny", swa, "p2pnccl", 40100, config.check_flags("swa-tiny"), gpus=1)[:2]


@pytest.mark.parametrize("server", list(_servers()), ids=lambda s: f"{s.name}-{len(s.args)}")
def test_rendered_server_commands_parse(server):
    argv = server.command()
    cmd = Command(label=server.name, host=None, env={}, program=tuple(argv[:3]), args=tuple(argv[3:]))
    assert checker().problems(cmd) == []


def test_extra_args_for_sglangs_own_tests_parse():
    args = ("--model-path", "/m", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "p2pnccl",
            *sglang_tests.EXTRA_ARGS)
    assert checker().problems(Command(label="t", host=None, env={}, program=("python3",), args=args)) == []


def test_one_gpu_extra_args_parse_and_move_the_fixtures_decode_to_gpu0():
    """SGLang's PD fixture passes --base-gpu-id 1 to the decode; the appended single-GPU args must win."""
    fixture_decode = ("--model-path", "/m", "--disaggregation-mode", "decode", "--base-gpu-id", "1",
                      "--disaggregation-transfer-backend", "p2pnccl")
    args = (*fixture_decode, *sglang_tests.extra_args(1))
    assert checker().problems(Command(label="t", host=None, env={}, program=("python3",), args=args)) == []
    ns = checker().parser.parse_args(list(args))
    assert ns.base_gpu_id == 0 and ns.max_total_tokens == 131072 and ns.mem_fraction_static == 0.3
    assert checker().parser.parse_args(list(fixture_decode) + sglang_tests.extra_args(2)).base_gpu_id == 1


def test_sglangs_pd_tests_collect_with_the_plugin_and_use_the_local_model(tmp_path):
    """The plugin must act before SGLang's test modules bind the model names they import."""
    import os
    import subprocess
    import sys

    import sglang

    tests = Path(sglang.__file__).parent / "test/manual/disaggregation"
    files = [str(tests / Path(rel).name) for rel, _ in sglang_tests.TEST_FILES]
    code = (
        "import sys, pytest\n"
        f"rc = pytest.main(['-p', 'e2e.sglang_pd_plugin', '-p', 'no:cacheprovider', '--collect-only', '-q', *{files!r}])\n"
        "mods = [m for n, m in sys.modules.items() if n.startswith('test_disaggregation_')]\n"
        "print('MODELS', {getattr(m, 'DEFAULT_SMALL_MODEL_NAME_FOR_TEST', None) or m.DEFAULT_MODEL_NAME_FOR_TEST for m in mods})\n"
        "sys.exit(rc)\n")
    env = {**os.environ, "E2E_TEST_MODEL": str(tmp_path / "llama-tiny"), "E2E_TEST_EXTRA_ARGS": "--attention-backend triton"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3 tests collected" in p.stdout
    assert f"MODELS {{'{tmp_path / 'llama-tiny'}'}}" in p.stdout


def test_each_server_gets_an_nccl_port_of_its_own_unless_its_flags_name_one():
    """SGLang's default --nccl-port is one the OS found free a moment before; two servers started at once can
    draw the same one. Every rendered SGLang server names its own, from its HTTP port."""
    from e2e.servers import nccl_port

    p, d, lb = config.pd_pair("m", Path("/models/llama-tiny"), "p2pnccl", 31000, config.CHECK_FLAGS, gpus=1)
    ports = {s.name: s.command()[s.command().index("--nccl-port") + 1] for s in (p, d)}
    assert ports == {p.name: "51000", d.name: "51001"}
    assert "--nccl-port" not in lb.command()
    mine = config.reference("m", Path("/models/llama-tiny"), 31010, 0, [*config.CHECK_FLAGS, "--nccl-port", "40001"])
    assert mine.command().count("--nccl-port") == 1 and mine.command()[-1] == "40001"
    assert nccl_port(50000) == 30000 and len({nccl_port(q) for q in range(30000, 36000)}) == 6000
