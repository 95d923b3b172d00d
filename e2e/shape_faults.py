"""kill -9 under load in the two-prefill miniature (mini-a-2p-dpdecode), behind our LB's default policy.

    python3 -m e2e.shape_faults --models DIR --out shape_faults.json --logs DIR [--shape mini-a-2p-dpdecode]

The shape's servers and LB are started from its topology as e2e/shapes.py does (no reference). A closed loop of
CONCURRENCY requests runs throughout. First one of the two prefills is killed (SIGKILL of its process group) and
started again with the same launcher command while the load goes on; then the decode. For each fault the
results split the client errors by when their request was sent: in flight when the server died, sent while no
server of that role was left (only the decode: there is one), or other (every other error is a defect: the LB
should have sent it elsewhere or retried it); and how long after the restarted server answered its health check
it got traffic again (the prefill's KV transfer count grows; for the decode the first success).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from sglang_p2p_backend.launch.release import resolve_release

from . import config, results as results_io
from .client import random_prompts
from .faults import generate
from .servers import Server, Stack, exit_on_sigterm, failure_report, http_ok
from .shape_plan import SHAPES, lb_launch, load, node_launch
from .shapes import server_for, transfers_served

CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 16, 300, 32
KILL_AFTER_S, SETTLE_S, BACK_WITHIN_S = 5.0, 3.0, 5.0
LB_FLAGS = ["--log-level", "warning"]  # the default policy (load_aware), as deployed


class Load:
    """A closed loop through the LB: each worker sends its next request when the last is answered."""

    def __init__(self, url: str, seed: int):
        self.url, self.seed = url, seed
        self.records: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(CONCURRENCY)]

    def _worker(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            prompt = random_prompts(1, PROMPT_TOKENS, self.seed + 1000 * i + n)[0]
            t0 = time.monotonic()
            rec = generate(self.url, prompt, OUTPUT_TOKENS, timeout=120)
            rec["start"] = t0
            self.records.append(rec)
            n += 1
            if not rec["ok"]:
                time.sleep(0.2)  # a refused request comes back at once: no busy loop while a role is down

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(130)


def classify(records: list[dict[str, Any]], killed_at: float, healthy_at: Optional[float],
             role_left_empty: bool) -> dict[str, Any]:
    """Client errors by when their request was sent; pure, on the load's records."""
    errors = [r for r in records if not r.get("ok")]
    in_flight = [r for r in errors if r["start"] <= killed_at]
    after = [r for r in errors if r["start"] > killed_at]
    none_left = [r for r in after if role_left_empty and (healthy_at is None or r["start"] <= healthy_at)]
    other = [r for r in after if r not in none_left]
    return {
        "requests": len(records), "ok": len(records) - len(errors),
        "errors_in_flight": len(in_flight), "errors_no_server_of_role_left": len(none_left), "errors_other": len(other),
        "in_flight_at_kill": sum(1 for r in records if r["start"] <= killed_at <= r["end"]),
        "error_samples": sorted({f"{r.get('status')}: {r.get('detail', '')[:120]}" for r in errors})[:6],
    }


def fault(stack: Stack, lb: Server, victim: Server, role_left_empty: bool, seed: int,
          back: Callable[[float], Optional[float]]) -> dict[str, Any]:
    """Kill `victim` under load, start it again, and time its return (`back(deadline)`: when traffic came back)."""
    with Load(lb.url, seed) as load_run:
        time.sleep(KILL_AFTER_S)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        victim.proc.wait(30)
        stack.servers.remove(victim)
        up = stack.launch([victim], timeout_s=300)
        healthy_at = time.monotonic() if up else None
        back_at = back(time.monotonic() + 60) if up else None
        time.sleep(SETTLE_S)
    out = classify(load_run.records, killed_at, healthy_at, role_left_empty)
    out.update(victim=victim.name, restart_s=None if healthy_at is None else round(healthy_at - killed_at, 1),
               back_in_rotation_s=None if back_at is None or healthy_at is None else round(back_at - healthy_at, 2))
    if not up:
        out["restart_error"] = failure_report([victim])
    out["pass"] = (bool(up) and out["errors_other"] == 0 and out["back_in_rotation_s"] is not None
                   and out["back_in_rotation_s"] <= BACK_WITHIN_S)
    return out


def prefill_back(prefill: Server) -> Callable[[float], Optional[float]]:
    def wait(deadline: float) -> Optional[float]:
        start = transfers_served(prefill.url) or 0.0
        while time.monotonic() < deadline:
            if (transfers_served(prefill.url) or 0.0) > start:
                return time.monotonic()
            time.sleep(0.1)
        return None
    return wait


def decode_back(lb: Server) -> Callable[[float], Optional[float]]:
    def wait(deadline: float) -> Optional[float]:
        while time.monotonic() < deadline:
            if generate(lb.url, random_prompts(1, 16, 7)[0], 2, timeout=10).get("ok"):
                return time.monotonic()
            time.sleep(0.1)
        return None
    return wait


def run(models: Path, logs: Path, shape_name: str, res: dict[str, Any]) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    model = models / shape.model
    cfg = load(shape, model)
    flag = config.e2e_root() / "state" / "no-corruption"  # never created: the fault stays off
    servers = [server_for(node_launch(shape, cfg, n, model), flag) for n in cfg.nodes()]
    lb = server_for(lb_launch(shape, cfg, model, LB_FLAGS, name="lb-faults", port=cfg.lb.port + 1), flag)
    res.update(shape=shape_name, release=resolve_release(None), lb_flags=LB_FLAGS,
               load={"concurrency": CONCURRENCY, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS},
               faults=[])
    with Stack(logs) as stack:
        if len(stack.launch(servers, timeout_s=300, lanes=4)) != len(servers) or not stack.launch_lb(lb):
            res["error"] = failure_report([*servers, lb]) or {lb.name: lb.log_tail()}
            return res
        prefill = next(s for s in servers if s.mode == "prefill")
        decode = next(s for s in servers if s.mode == "decode")
        for victim, left_empty, back in ((prefill, False, prefill_back(prefill)), (decode, True, decode_back(lb))):
            if not all(http_ok(s.url + "/health") for s in servers):
                res["faults"].append({"victim": victim.name, "not_run": "a server was not healthy before the fault"})
                continue
            res["faults"].append(fault(stack, lb, victim, left_empty, seed=len(res["faults"]) * 100000, back=back))
            print(res["faults"][-1], flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = config.step_parser(__doc__)
    ap.add_argument("--shape", default="mini-a-2p-dpdecode")
    a = ap.parse_args(argv)
    exit_on_sigterm()
    res: dict[str, Any] = {}
    try:
        run(a.models, a.logs, a.shape, res)
    finally:
        results_io.write_json(a.out, res)
    return 0 if res.get("faults") and all(f.get("pass") for f in res["faults"]) else 1


if __name__ == "__main__":
    sys.exit(main())
