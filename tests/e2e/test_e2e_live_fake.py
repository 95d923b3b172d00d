"""The e2e orchestration against fake SGLang servers on 127.0.0.1: launching, health, stopping, the
token-for-token comparison over real HTTP (streaming and not) and a timed load run with /metrics deltas."""
import asyncio
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

from e2e import check, perf  # noqa: E402
from e2e.servers import Server, Stack, failure_report  # noqa: E402
from sglang_p2p_backend.testing.launch import free_port  # noqa: E402

FAKE = Path(__file__).with_name("fake_sglang.py")


class FakeServer(Server):
    def __init__(self, name, gpu=0, *fake_args):
        super().__init__(name, free_port(), "null", gpu=gpu)
        self.fake_args = list(fake_args)

    def command(self):
        return [sys.executable, str(FAKE), "--port", str(self.port), *self.fake_args]


def test_servers_on_one_gpu_start_in_turn_and_all_stop(tmp_path):
    a = FakeServer("a", 0, "--delay-pool", "1.5")
    b = FakeServer("b", 0)
    c = FakeServer("c", 1)
    with Stack(tmp_path) as stack:
        t0 = time.monotonic()
        up = stack.launch([a, b, c], timeout_s=60)
        assert {s.name for s in up} == {"a", "b", "c"}
        assert time.monotonic() - t0 >= 1.5  # b waited for a's "Memory pool end"
        procs = [s.proc for s in (a, b, c)]
    assert all(p.poll() is not None for p in procs)


class LauncherWithStubbornChild(Server):
    """A launcher that exits at SIGTERM while its child, in the same process group, ignores SIGTERM and holds a
    listening port (as SGLang's scheduler can outlive `launch_server`). Its socket is a server's: SO_REUSEADDR, as
    uvicorn's, so a connection of the test's left closing (LAST_ACK) does not hold the port once the child is gone."""

    CODE = ("import os, signal, socket, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, socket, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); s = socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((\"127.0.0.1\", %d)); "
            "s.listen(); time.sleep(600)'])\n"
            "time.sleep(600)\n")

    def __init__(self, name, port):
        super().__init__(name, port, "null")

    def command(self):
        return [sys.executable, "-c", self.CODE % self.port]


def test_stop_ends_a_group_whose_launcher_went_first_and_frees_its_port(tmp_path):
    import socket

    port = free_port()
    s = LauncherWithStubbornChild("stubborn", port)
    stack = Stack(tmp_path)
    stack.start(s)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the child listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        pytest.fail("the child never listened")
    t0 = time.monotonic()
    stack.stop(grace_s=1.0)
    assert time.monotonic() - t0 < 8 and s.proc.poll() is not None
    probe = socket.socket()  # the next server on the port, as uvicorn binds: refused only while a listener is left
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("127.0.0.1", port))  # the child's listening socket is gone with it
        probe.listen()
    finally:
        probe.close()


def test_a_server_that_dies_is_reported_with_its_log(tmp_path):
    bad = FakeServer("bad", 0, "--no-such-flag")
    with Stack(tmp_path) as stack:
        assert stack.launch([bad], timeout_s=30) == []
    report = failure_report([bad])
    assert "exited with 2" in report["bad"] and "unrecognized arguments" in report["bad"]


def _two(tmp_path, shift):
    ref, pd = FakeServer("ref", 0), FakeServer("pd", 1, "--shift", str(shift))
    stack = Stack(tmp_path)
    assert len(stack.launch([ref, pd], timeout_s=60)) == 2
    return stack, ref, pd


def test_check_passes_when_pd_answers_like_the_reference(tmp_path):
    stack, ref, pd = _two(tmp_path, 0.0)
    with stack:
        res = asyncio.run(check.compare_model(ref.url, pd.url, tolerance=0.02))
    s = res["summary"]
    assert s["verdict"] == "pass" and s["bit_identical"] and s["cases"] == 2 * len(check.cases())
    assert {c["mode"] for c in res["cases"]} == {"stream", "nonstream"}


def test_check_fails_when_pd_logprobs_move(tmp_path):
    stack, ref, pd = _two(tmp_path, 0.35)
    with stack:
        res = asyncio.run(check.compare_model(ref.url, pd.url, tolerance=0.02))
    s = res["summary"]
    assert s["verdict"] == "fail" and s["ids_equal"] == s["cases"]
    assert abs(s["max_abs_logprob_diff"] - 0.35) < 1e-6


def test_release_and_resume_reach_every_server_in_order_and_a_refusal_stops_the_check(tmp_path):
    import aiohttp

    async def calls(url):
        async with aiohttp.ClientSession() as s, s.get(f"{url}/memory_calls") as r:
            return await r.json()

    p, d, busy = FakeServer("p", 0), FakeServer("d", 0), FakeServer("busy", 0, "--refuse-memory")
    with Stack(tmp_path) as stack:
        stack.launch([p, d, busy])
        out = asyncio.run(check.release_and_resume([p.url, d.url]))
        steps = [k.split()[0] for k in out if not k.startswith("gpu_mib")]
        assert steps == ["release", "release", "resume", "resume"]
        assert {k for k in out if k.startswith("gpu_mib")} == {"gpu_mib_before", "gpu_mib_after_release",
                                                               "gpu_mib_after_resume"}
        for server in (p, d):  # KV memory only: weights and graphs stay
            assert asyncio.run(calls(server.url)) == [["/release_memory_occupation", ["kv_cache"]],
                                                      ["/resume_memory_occupation", ["kv_cache"]]]
        with pytest.raises(RuntimeError, match="release_memory_occupation on .*HTTP 400.*only when server is idle"):
            asyncio.run(check.release_and_resume([busy.url]))


def test_load_run_reports_ttft_throughput_and_kv_transfer_time(tmp_path, monkeypatch):
    monkeypatch.setattr(perf, "PROMPT_TOKENS", (16,))
    monkeypatch.setattr(perf, "CONCURRENCY", (1, 4))
    monkeypatch.setattr(perf, "OUTPUT_TOKENS", 8)
    srv = FakeServer("p", 0)
    with Stack(tmp_path) as stack:
        stack.launch([srv], timeout_s=60)
        rows = perf.load_runs("fake", srv, srv, deadline=time.monotonic() + 60)
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["num_failed"] == 0 and r["num_requests"] == perf.requests_for(r["concurrency"])
        assert r["kv_transfer_ms_mean"] == 2.0 and r["output_tokens"] == 8 * r["num_requests"]
        assert r["ttft_ms_p50"] > 0 and r["output_throughput"] > 0


def test_sigterm_to_a_step_still_stops_its_servers_and_pids_are_recorded(tmp_path):
    """run_all.sh's per-step timeout sends SIGTERM: the servers (own sessions) must not outlive the step."""
    import os
    import signal
    import subprocess

    pidfile = tmp_path / "pids"
    script = (
        "import sys, time; sys.path[:0] = [%r, %r]\n"
        "from test_e2e_live_fake import FakeServer\n"
        "from e2e.servers import Stack, exit_on_sigterm\n"
        "exit_on_sigterm()\n"
        "with Stack(__import__('pathlib').Path(%r)) as st:\n"
        "    st.launch([FakeServer('s', 0)], timeout_s=60)\n"
        "    print('up', flush=True)\n"
        "    time.sleep(60)\n" % (str(Path(__file__).parent), str(Path(__file__).parents[2]), str(tmp_path / "logs")))
    env = {**os.environ, "E2E_PIDFILE": str(pidfile)}
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "up"
    server_pid = int(pidfile.read_text().split()[0])
    os.kill(server_pid, 0)  # alive while the step runs
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError("server outlived its step")


def digest_logs(entry, corrupted, wrong_room=None):
    """What the servers of a shape with digests logged for `entry`'s requests, one room each (the `kv` controls'
    last): the decode's digests equal the prefill's, but those of the rooms it corrupted (`corrupted`: it named
    them in its fault line) and `wrong_room`."""
    from sglang_p2p_backend.adapter.kv_digest import DigestLabel, format_line

    n, kv = len(entry["cases"]) + len(entry["controls"]), sum(c["kind"] == "kv" for c in entry["controls"])
    prefill, decode = [], []
    for room in range(n):
        zeroed = corrupted and room >= n - kv
        prefill.append(format_line(DigestLabel("prefill", 0, 0, 1, True, 1), room, 4, room))
        if zeroed:
            decode.append(f"test fault (/s/corrupt exists): zeroed 1 pages of room {room} from page 2 in 3 KV regions")
        decode.append(format_line(DigestLabel("decode", 0, 0, 1, True, 1), room, 4, room + (zeroed or room == wrong_room)))
    return {"prefill": "\n".join(prefill)}, {"decode": "\n".join(decode)}


@pytest.mark.parametrize("honours_fault,verdict,flagged", [(True, "pass", "10/10"), (False, "fail", "5/10")])
def test_shape_check_needs_every_negative_control_flagged(tmp_path, honours_fault, verdict, flagged):
    from e2e import shapes
    from e2e.shape_plan import SHAPES

    flag = tmp_path / "corrupt"
    ref = FakeServer("ref", 0)
    pd = FakeServer("pd", 1, *(["--corrupt-file", str(flag)] if honours_fault else []))
    shape = SHAPES["mini-b-dp-both"]
    with Stack(tmp_path) as stack:
        assert len(stack.launch([ref, pd], timeout_s=60)) == 2
        entry = asyncio.run(shapes.check_shape(shape, [ref.url], pd.url, flag))
    assert entry["summary"]["verdict"] == "pass" and entry["summary"]["bit_identical"]
    assert entry["controls_flagged"] == flagged and not flag.exists()
    assert {c["kind"] for c in entry["controls"]} == {"prompt", "kv"}
    assert shapes.verdict(shape, entry) == "fail"  # an MLA shape without its digests
    entry["kv_digest"] = shapes.digest_check(entry, *digest_logs(entry, corrupted=honours_fault))
    assert entry["kv_digest"]["rooms_required"] == len(entry["cases"]) + 5 and entry["kv_digest"]["kv_controls_sent"] == 5
    assert shapes.verdict(shape, entry) == verdict
    # one room whose KV differs fails the shape, however well its answers agreed
    entry["kv_digest"] = shapes.digest_check(entry, *digest_logs(entry, corrupted=honours_fault, wrong_room=3))
    assert entry["kv_digest"]["mismatched"] == 1 and shapes.verdict(shape, entry) == "fail"


def test_a_mixed_layout_shape_passes_when_pd_agrees_with_either_layouts_reference(tmp_path):
    """PD of a TP-1 prefill into a DP/EP decode agrees with the prefill-layout reference, not the decode-layout
    one: it passes, the gap between the two references is reported, and the controls still fail against both.
    PD between the two references, further than the tolerance from both, passes only within their gap and with
    the KV proven equal by the digests."""
    from e2e import shapes
    from e2e.shape_plan import SHAPES

    flag = tmp_path / "corrupt"
    decode_layout, prefill_layout = FakeServer("ref", 0, "--shift", "0.3"), FakeServer("ref-p", 0)
    pd = FakeServer("pd", 1, "--corrupt-file", str(flag))
    between = FakeServer("pd-between", 1, "--shift", "0.15", "--corrupt-file", str(flag))
    shape = SHAPES["mini-a-2p-dpdecode"]
    with Stack(tmp_path) as stack:
        assert len(stack.launch([decode_layout, prefill_layout, pd, between], timeout_s=60)) == 4
        refs = [decode_layout.url, prefill_layout.url]
        entry = asyncio.run(shapes.check_shape(shape, refs, pd.url, flag))
        alone = asyncio.run(shapes.check_shape(shape, [decode_layout.url], pd.url, flag))
        mid = asyncio.run(shapes.check_shape(shape, refs, between.url, flag))
    assert entry["summary"]["verdict"] == "pass" and entry["controls_flagged"] == "10/10"
    assert abs(entry["layout_gap"]["summary"]["max_abs_logprob_diff"] - 0.3) < 1e-6
    assert alone["summary"]["verdict"] == "fail" and "layout_gap" not in alone
    assert mid["summary"]["verdict"] == "fail" and mid["within_layout_gap"]["verdict"] == "pass"
    assert shapes.verdict(shape, mid) == "fail"  # no digests: the gap does not count
    mid["kv_digest"] = shapes.digest_check(mid, *digest_logs(mid, corrupted=True))
    assert shapes.verdict(shape, mid) == "pass"
