"""`--workers N`: N server processes on one SO_REUSEPORT port under a supervisor (processes.py), as real
processes on 127.0.0.1 in front of simulated workers: both serve, signals stop them all, a killed one is
restarted, the admin routes that would split the pools are refused, and the limits are split."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import orjson
import psutil
import pytest
import requests

from lb_harness import ADMIN, ADMIN_KEY, sim_process
from sglang_p2p_backend.testing.launch import free_port
from sglang_p2p_lb.cli import build_parser, config_from_args
from sglang_p2p_lb.processes import per_process

BODY = orjson.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 2}})


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[str, int, str]]:
    """One simulated prefill and decode, each a process, shared by the tests here: (prefill URL, bootstrap port, decode URL)."""
    with sim_process("prefill") as p, sim_process("decode", "--decode-ms-per-token", "1") as d:
        _wait(lambda: _up(p.url) and _up(d.url), 60, "simulated workers did not start")
        yield p.url, p.bootstrap_port, d.url


def _up(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def _wait(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(what)


@contextlib.contextmanager
def lb(sims, tmp_path: Path, *flags: str, workers: int = 2) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """`python -m sglang_p2p_lb --workers N` until it prints its listening line; (process, URL, its log)."""
    p_url, boot, d_url = sims
    port = free_port()
    log = tmp_path / f"lb-{port}.log"
    out = tmp_path / f"lb-{port}.out"
    cmd = [sys.executable, "-m", "sglang_p2p_lb", "--prefill", p_url, str(boot), "--decode", d_url, "--host", "127.0.0.1", "--port", str(port),
           "--workers", str(workers), "--admin-api-key", ADMIN_KEY, "--load-poll-interval-secs", "0", *flags]
    with open(log, "w") as err, open(out, "w") as so:
        proc = subprocess.Popen(cmd, stdout=so, stderr=err)
    try:
        _wait(lambda: "listening on" in out.read_text() or proc.poll() is not None, 60, "LB did not start")
        assert proc.poll() is None, log.read_text()
        assert f"listening on http://127.0.0.1:{port} ({workers} processes)" in out.read_text()
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        kids = _children(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        for k in kids:
            with contextlib.suppress(psutil.Error):
                psutil.Process(k).kill()


def _children(pid: int) -> list[int]:
    """The LB server processes under the supervisor (multiprocessing's resource tracker aside)."""
    try:
        kids = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [k.pid for k in kids if "resource_tracker" not in " ".join(_cmdline(k))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _fresh_get(url: str) -> dict:
    """A GET on a new connection, so that the kernel may hand it to any of the processes."""
    return requests.get(url, headers={"Connection": "close"}, timeout=5).json()


def _views(url: str, want: int, tries: int = 200) -> dict[int, dict]:
    """GET /workers on new connections until `want` different processes answered: pid -> its answer."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        doc = _fresh_get(url + "/workers")
        seen[doc["process"]["pid"]] = doc
        if len(seen) >= want:
            break
    return seen


def test_both_processes_serve_requests_through_the_one_port(sims, tmp_path):
    with lb(sims, tmp_path) as (proc, url, log):
        kids = _children(proc.pid)
        assert len(kids) == 2
        n = 40
        for _ in range(n):  # each on a new connection: SO_REUSEPORT spreads connections, not requests
            r = requests.post(url + "/generate", data=BODY, headers={"Connection": "close"}, timeout=10)
            assert r.status_code == 200, r.text
        views = _views(url, 2)
        assert sorted(views) == sorted(kids), "both server processes answer on the port"
        # each process counts only what it routed: both routed some, together all of them
        selected = {pid: next(w["selected"] for w in v["workers"] if w["role"] == "decode") for pid, v in views.items()}
        assert all(s > 0 for s in selected.values()) and sum(selected.values()) == n, selected
        assert {v["process"]["index"] for v in views.values()} == {0, 1} and all(v["process"]["of"] == 2 for v in views.values())
        # /metrics from either process sums every process's counters (prometheus_client multiprocess mode)
        metrics = requests.get(url + "/metrics", timeout=5).text
        assert f'sglang_p2p_lb_requests_total{{route="generate",status="200"}} {float(n)}' in metrics
        text = log.read_text()
        assert all(f"[pid {k}]" in text for k in kids), "every process's log lines name it"


def test_sigterm_to_the_supervisor_stops_every_process(sims, tmp_path):
    with lb(sims, tmp_path) as (proc, url, _):
        kids = _children(proc.pid)
        assert len(kids) == 2 and all(_alive(k) for k in kids)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        _wait(lambda: not any(_alive(k) for k in kids), 5, "a server process outlived the supervisor")
        assert time.monotonic() - t0 < 5
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0, "nothing listens any more"


def test_a_supervisor_killed_outright_leaves_no_orphan(sims, tmp_path):
    with lb(sims, tmp_path) as (proc, _, _):
        kids = _children(proc.pid)
        proc.kill()  # no chance to forward anything: the kernel's parent-death signal stops them
        proc.wait(5)
        _wait(lambda: not any(_alive(k) for k in kids), 10, "a server process outlived a SIGKILLed supervisor")


def test_a_killed_process_is_restarted_and_the_lb_keeps_serving(sims, tmp_path):
    with lb(sims, tmp_path) as (proc, url, log):
        kids = _children(proc.pid)
        victim = kids[0]
        psutil.Process(victim).kill()
        _wait(lambda: len(set(_children(proc.pid)) - set(kids)) == 1, 30, "the killed process was not replaced")
        assert proc.poll() is None, "the supervisor keeps running"
        _wait(lambda: "restarting it" in log.read_text(), 5, "no log line")
        assert f"(pid {victim}) killed by SIGKILL; restarting it" in log.read_text()
        new = (set(_children(proc.pid)) - set(kids)).pop()
        _wait(lambda: new in _views(url, 2, tries=20), 30, "the new process does not serve")
        for _ in range(10):
            assert requests.post(url + "/generate", data=BODY, headers={"Connection": "close"}, timeout=10).status_code == 200


def test_adding_or_removing_workers_is_refused_naming_workers_1(sims, tmp_path):
    p_url, _, d_url = sims
    with lb(sims, tmp_path) as (_, url, _):
        r = requests.post(url + "/workers", json={"url": "http://127.0.0.1:9", "role": "decode"}, headers=ADMIN, timeout=5)
        assert r.status_code == 409 and "--workers 1" in r.json()["error"]["message"], r.text
        r = requests.delete(url + "/workers", params={"url": d_url}, headers=ADMIN, timeout=5)
        assert r.status_code == 409 and "DELETE /workers is not available with --workers 2" in r.json()["error"]["message"]
        # still the admin key first: no key, no hint about the configuration
        assert requests.post(url + "/workers", json={}, timeout=5).status_code in (401, 403)
        # and no process's pool changed
        for view in _views(url, 2).values():
            assert sorted(w["url"] for w in view["workers"]) == sorted([p_url, d_url])


def test_a_taken_port_stops_the_supervisor_at_once(sims, tmp_path):
    p_url, boot, d_url = sims
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "sglang_p2p_lb", "--prefill", p_url, str(boot), "--decode", d_url, "--host", "127.0.0.1",
                            "--port", str(port), "--workers", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"cannot bind 127.0.0.1:{port}" in r.stderr


def test_lb_wide_limits_are_split_over_the_processes():
    args = build_parser().parse_args(["--prefill", "http://p:1", "--decode", "http://d:1", "--workers", "3",
                                      "--max-concurrent-requests", "100", "--queue-size", "10"])
    cfg = config_from_args(args)
    assert cfg.processes == 1 and cfg.proxy.max_concurrent == 100  # the LB's totals until the supervisor splits them
    child = per_process(cfg, 3, 2)
    assert (child.proxy.max_concurrent, child.proxy.queue_size, child.processes, child.process_index) == (34, 4, 3, 2)
    unbounded = per_process(config_from_args(build_parser().parse_args(["--prefill", "http://p:1", "--decode", "http://d:1",
                                                                        "--max-concurrent-requests", "0", "--queue-size", "0"])), 4, 0)
    assert (unbounded.proxy.max_concurrent, unbounded.proxy.queue_size) == (0, 0)
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        config_from_args(build_parser().parse_args(["--prefill", "http://p:1", "--decode", "http://d:1", "--workers", "0"]))
