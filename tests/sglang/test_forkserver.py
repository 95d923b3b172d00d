"""The drivers' fork server (testing/forkserver.py): a forked process runs with exactly the environment it was
given (not the fork server's), its output goes to its log, and its exit code and death reach the test as from a
subprocess."""

import json
import os
import signal
import subprocess

import pytest

from sglang_p2p_backend.testing import forkserver

pytestmark = pytest.mark.sglang


def test_a_forked_process_sees_its_own_environment_and_exit_code(tmp_path, monkeypatch):
    monkeypatch.setenv("P2P_FORK_PARENT_ONLY", "1")  # the fork server may have started with this set
    env = {"PATH": os.environ["PATH"], "P2P_FORK_CHILD": "yes", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "7"}
    out, log = tmp_path / "child.json", tmp_path / "child.log"
    child = forkserver.start("support.forked:report", [str(out), "3"], env, str(log))
    assert child.wait(120) == 3 and child.returncode == 3
    seen = json.loads(out.read_text())
    assert seen["env"] == env  # exactly: nothing of the parent's or the fork server's environment
    assert seen["pid"] == child.pid and seen["sglang_preloaded"]
    assert "forked child writes to its log" in log.read_text()


def test_a_forked_process_reads_sglang_settings_from_its_environment(tmp_path):
    """SGLang's settings are read when used, so a child's value wins over what the fork server imported with."""
    out = tmp_path / "child.json"
    env = {**os.environ, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "7"}
    child = forkserver.start("support.forked:sglang_setting", [str(out)], env, str(tmp_path / "child.log"))
    assert child.wait(120) == 0
    assert json.loads(out.read_text()) == {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": 7}


def test_a_killed_forked_process_reports_the_signal_as_a_subprocess_would(tmp_path):
    child = forkserver.start("support.forked:report", [str(tmp_path / "c.json"), "0", "60"], dict(os.environ),
                             str(tmp_path / "c.log"))
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)
    assert child.poll() is None
    child.kill()
    assert child.wait(30) == -signal.SIGKILL


def test_the_setting_forces_either_way_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("P2P_TEST_FORKSERVER", "0")
    assert not forkserver.enabled()
    monkeypatch.setenv("P2P_TEST_FORKSERVER", "1")
    assert forkserver.enabled()
    monkeypatch.setenv("P2P_TEST_FORKSERVER", "yes")
    with pytest.raises(ValueError, match="P2P_TEST_FORKSERVER='yes': use 1"):
        forkserver.enabled()
