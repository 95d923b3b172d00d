"""Faults under load in real SGLang: kill -9 and SIGSTOP of the decode and of the prefill behind our LB.

    python3 -m e2e.faults --models DIR --out faults.json --logs DIR [--gpus 1|2]

One p2pnccl pair (llama-tiny; on one GPU over real NCCL through its socket transport, each server its own
NCCL_HOSTID) behind `sglang_p2p_lb`. For each fault: 24 concurrent requests (1,000-token prompts, 200 output
tokens), the fault 2 s in, then the time until every request has an answer (success or error, as the client
sees it), how many failed; then the struck server is killed (a stopped one too) and started again on the same
ports, and 8 requests through the LB must succeed. The results name what each request got.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from . import config, results
from .client import random_prompts
from .servers import Server, Stack, exit_on_sigterm
from .sglang_tests import extra_args

FAULTS = (("decode", "kill"), ("decode", "stop"), ("prefill", "kill"), ("prefill", "stop"))
LOAD, PROMPT_TOKENS, OUTPUT_TOKENS, FAULT_AT_S, CLIENT_TIMEOUT_S = 24, 1000, 200, 2.0, 150.0


def generate(url: str, prompt: list[int], max_new_tokens: int, timeout: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    body = json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                               "ignore_eos": True}}).encode()
    t0 = time.monotonic()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
            reason = (out.get("meta_info") or {}).get("finish_reason") or {}
            ok = reason.get("type") != "abort"
            return {"ok": ok, "status": r.status, "detail": "" if ok else str(reason)[:200], "end": time.monotonic(),
                    "seconds": time.monotonic() - t0}
    except urllib.error.HTTPError as e:
        return {"ok": False, "status": e.code, "detail": e.read()[:200].decode(errors="replace"), "end": time.monotonic(),
                "seconds": time.monotonic() - t0}
    except Exception as e:  # connection reset, client timeout
        return {"ok": False, "status": None, "detail": repr(e)[:200], "end": time.monotonic(), "seconds": time.monotonic() - t0}


def strike(server: Server, how: str) -> None:
    os.killpg(server.proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def one_fault(stack: Stack, servers: dict[str, Server], lb: Server, role: str, how: str, seed: int) -> dict[str, Any]:
    prompts = random_prompts(LOAD, PROMPT_TOKENS, seed)
    answers: list[dict[str, Any]] = [{} for _ in prompts]

    def worker(i: int) -> None:
        answers[i] = generate(lb.url, prompts[i], OUTPUT_TOKENS)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(LOAD)]
    for t in threads:
        t.start()
    time.sleep(FAULT_AT_S)
    struck = servers[role]
    strike(struck, how)
    fault_at = time.monotonic()
    for t in threads:
        t.join(CLIENT_TIMEOUT_S + 10)
    last = max(a.get("end", fault_at) for a in answers)
    out: dict[str, Any] = {
        "fault": f"{how} {role}", "requests": LOAD,
        "ok": sum(a.get("ok", False) for a in answers),
        "failed": sum(not a.get("ok", False) for a in answers),
        "all_answered_s_after_fault": round(last - fault_at, 2),
        "client_timeouts": sum("timed out" in a.get("detail", "") for a in answers),
        "errors": sorted({f"{a.get('status')}: {a.get('detail', '')[:120]}" for a in answers if not a.get("ok")})[:6],
    }
    # the struck server goes away (a stopped one too) and comes back on the same ports
    os.killpg(struck.proc.pid, signal.SIGKILL)
    struck.proc.wait(30)
    t0 = time.monotonic()
    up = stack.launch([struck], timeout_s=240)
    out["restart_s"] = round(time.monotonic() - t0, 1)
    if not up:
        out["after_restart"] = {"error": struck.error, "log_tail": struck.log_tail(15)}
        return out
    after = []
    deadline = time.monotonic() + 90
    while len(after) < 8 and time.monotonic() < deadline:  # the LB takes the worker back on its next health check
        a = generate(lb.url, random_prompts(1, 200, seed + 100 + len(after))[0], 16, timeout=60)
        if a["ok"] or after:
            after.append(a)
        else:
            time.sleep(1.0)
    out["after_restart"] = {"sent": len(after), "ok": sum(a["ok"] for a in after),
                            "first_ok_s_after_restart": round(after[0]["end"] - t0 - out["restart_s"], 1) if after else None}
    return out


def run(models: Path, logs: Path, deadline: float, gpus: int, only: tuple = FAULTS) -> dict[str, Any]:
    flags = [*extra_args(gpus), "--chunked-prefill-size", "256"]
    p, d, lb = config.pd_pair("faults", models / "llama-tiny", "p2pnccl", 31000, flags, gpus, "check")
    res: dict[str, Any] = {"model": "llama-tiny", "gpus": gpus, "transport": config.transport_info("p2pnccl", gpus, "check"),
                           "load": {"concurrent": LOAD, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                                    "fault_at_s": FAULT_AT_S, "client_timeout_s": CLIENT_TIMEOUT_S},
                           "server_flags": flags, "faults": []}
    with Stack(logs) as stack:
        if len(stack.launch([p, d], timeout_s=300)) != 2 or not stack.launch_lb(lb):
            res["error"] = {s.name: s.error or s.log_tail(10) for s in (p, d, lb)}
            return res
        for i, (role, how) in enumerate(FAULTS):
            if (role, how) not in only:
                continue
            if deadline - time.monotonic() < 200:
                res["faults"].append({"fault": f"{how} {role}", "not_run": "no time left in this call"})
                continue
            res["faults"].append(one_fault(stack, {"prefill": p, "decode": d}, lb, role, how, seed=10 * i))
            print(json.dumps(res["faults"][-1]), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = config.step_parser(__doc__)
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=None)
    ap.add_argument("--only", default="", help="comma list of faults to run, e.g. 'stop prefill' (default: all)")
    a = ap.parse_args(argv)
    exit_on_sigterm()
    only = tuple(f for f in FAULTS if f"{f[1]} {f[0]}" in a.only.split(",")) if a.only else FAULTS
    res = run(a.models, a.logs, config.deadline_from_env(), a.gpus or config.gpus_from_env(), only)
    results.write_json(a.out, res)
    return 0 if res["faults"] and "error" not in res else 1


if __name__ == "__main__":
    raise SystemExit(main())
