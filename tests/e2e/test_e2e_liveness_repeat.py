"""The GPU liveness run's pieces that need no GPU: the module that repeats SGLang's liveness test against one
P/D launch, the environment each backend gets on one GPU, and the plugin's per-server NCCL host id."""
import importlib.util
import os
import unittest

from e2e import config, sglang_tests
from sglang_p2p_backend import plugin


def test_repeated_module_has_n_numbered_copies_and_not_the_original(tmp_path):
    src = tmp_path / "root" / sglang_tests.LIVENESS
    src.parent.mkdir(parents=True)
    src.write_text(
        "import unittest\n"
        "class TestDisaggregationPeerLivenessAbort(unittest.TestCase):\n"
        "    calls = []\n"
        "    def test_peer_failures_abort_without_hanging(self):\n"
        "        type(self).calls.append(self._testMethodName)\n"
        "class TestDisaggregationPeerLivenessCleanRecovery(unittest.TestCase):\n"
        "    def test_clean_generate_and_explicit_abort_by_rid(self):\n"
        "        pass\n"
    )
    path = sglang_tests.repeated_liveness_file(tmp_path / "root", tmp_path, 3)
    spec = importlib.util.spec_from_file_location("rep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tests = sorted(n for n in dir(mod.TestRepeated) if n.startswith("test") and callable(getattr(mod.TestRepeated, n)))
    assert tests == ["test_run_00", "test_run_01", "test_run_02"]
    for name in tests:
        mod.TestRepeated(name).run()
    assert mod.TestRepeated.calls == tests
    # pytest collects every TestCase subclass bound in the module: only ours, never SGLang's original
    cases = sorted(n for n, v in vars(mod).items() if isinstance(v, type) and issubclass(v, unittest.TestCase))
    assert cases == ["TestCleanRecovery", "TestRepeated"]


def test_sglangs_tests_run_p2pnccl_over_nccl_or_mooncake_on_one_gpu(monkeypatch):
    monkeypatch.setenv("E2E_P2P_1GPU", "nccl")
    env = config.backend_env("p2pnccl", 1, "sglang_tests")
    assert env["SGLANG_P2P_TRANSPORT"] == "nccl" and env["SGLANG_P2P_ONE_GPU_NCCL"] == "1"
    assert "NCCL_HOSTID" not in env  # each server takes its own when it loads the plugin
    assert config.backend_env("mooncake", 1, "sglang_tests") == {"MC_FORCE_TCP": "1"}
    monkeypatch.delenv("E2E_P2P_1GPU")
    assert config.backend_env("p2pnccl", 1, "sglang_tests")["SGLANG_P2P_TRANSPORT"] == "mooncake"


def test_one_gpu_nccl_gives_each_server_process_its_own_host_id(monkeypatch):
    for name in ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME"):  # recorded first, so both are put back as they were
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    plugin._one_gpu_nccl()
    assert "NCCL_HOSTID" not in os.environ  # off unless asked
    monkeypatch.setenv("SGLANG_P2P_ONE_GPU_NCCL", "1")
    plugin._one_gpu_nccl()
    assert os.environ["NCCL_HOSTID"] == f"p2p-one-gpu-{os.getpid()}" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("NCCL_HOSTID", "inherited")  # a scheduler keeps its server's id
    plugin._one_gpu_nccl()
    assert os.environ["NCCL_HOSTID"] == "inherited"
