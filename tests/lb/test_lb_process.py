"""The entry points as processes: the simulated workers (`python -m simworker`) and the shipped `python -m sglang_p2p_lb`."""

import signal
import socket
import subprocess
import sys
import time

import orjson
import requests
from sglang_p2p_backend.testing.launch import free_port


def _wait_http(url: str, timeout: float = 60.0) -> None:  # a start-up wait (polled): room for a loaded machine
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            requests.get(url, timeout=0.5)
            return
        except requests.ConnectionError:
            time.sleep(0.05)
    raise TimeoutError(url)


def test_cli_processes_serve_a_pd_request():
    pp, bp, dp, lp = (free_port() for _ in range(4))
    py = sys.executable
    procs = [
        subprocess.Popen([py, "-m", "simworker", "--role", "prefill", "--host", "127.0.0.1", "--port", str(pp), "--bootstrap-port", str(bp)]),
        subprocess.Popen([py, "-m", "simworker", "--role", "decode", "--host", "127.0.0.1", "--port", str(dp), "--decode-ms-per-token", "1"]),
        subprocess.Popen(
            [py, "-m", "sglang_p2p_lb", "--prefill", f"http://127.0.0.1:{pp}", str(bp), "--decode", f"http://127.0.0.1:{dp}", "--host", "127.0.0.1", "--port", str(lp), "--policy", "power_of_two", "--log-level", "warning"],
            stdout=subprocess.PIPE,
            text=True,
        ),
    ]
    try:
        for port in (pp, dp, lp):
            _wait_http(f"http://127.0.0.1:{port}/health")
        r = requests.post(f"http://127.0.0.1:{lp}/v1/chat/completions", data=orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}), timeout=10)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == " tok tok tok"
        stats = requests.get(f"http://127.0.0.1:{dp}/stats", timeout=5).json()
        assert stats["bodies"][0]["bootstrap_port"] == bp and stats["bootstrap_failures"] == 0
        # the LB bound only where told
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", lp)) == 0
        lb = procs[2]
        lb.send_signal(signal.SIGTERM)
        assert lb.wait(timeout=10) == 0
        assert "listening on http://127.0.0.1:%d" % lp in lb.stdout.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
