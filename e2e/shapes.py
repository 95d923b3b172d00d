"""The DeepSeek deployment in miniature on one 4-GPU host: each shape started from its launch config and checked
against a non-PD server, with negative controls that must all be flagged.

    python3 -m e2e.shapes --models DIR --out shapes.json --logs DIR [--only mini-a-2p-dpdecode,...]

The shapes are the topologies of e2e/shape_plan.py (configs/topologies/mini-*.yaml). Every server is started by
the launcher from its topology (which validates it and checks each command with SGLang's parser first), the LB
with `launch lb` plus `--policy round_robin`, so requests sent one at a time reach every prefill; the
reference is a non-PD server with the decode's own rendered flags. All shapes start together (small capped
pools share the GPUs) and are checked side by side, each one request at a time, as e2e/check.py does:
greedy ids and per-token logprobs, streaming and not, chunked prefill of 64 tokens a rank.

Negative controls, each compared with the reference's answer to the unchanged prompt, must all fail:
* `prompt`: one prompt token in every PERTURB_EVERY changed (at least one), sent through the LB;
* `kv`: the prompt as it is, while the decode zeroes an eighth of every arriving room's pages (the test-only
  fault SGLANG_P2P_TEST_CORRUPT_KV_FILE, adapter/kv_fault.py).
Where PD's prefill runs another layout than its decode (TP 1 prefill into a TP 2 / DP / EP decode, hetero TP),
no one server computes what PD computes, and two layouts differ by rounding: a second reference then runs the
prefill's layout, and an answer passes when it agrees within LAYOUT_TOLERANCE with either reference (a differing
id only where that reference's two best candidates are closer than the tolerance: a tie); a control is flagged
only when it fails against both. Where the layouts match, PD must be bit-identical to the one reference.
"""
from __future__ import annotations

import asyncio
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any, Optional

from sglang_p2p_backend.launch.release import resolve_release

from . import check, client, compare, config, promparse, results as results_io
from .servers import Server, Stack, exit_on_sigterm, failure_report
from .shape_plan import SHAPES, Launch, Shape, plan

CORRUPT_VAR = "SGLANG_P2P_TEST_CORRUPT_KV_FILE"
# all shapes start together, so TP servers see GPUs that other servers already use: SGLang's check that every
# rank of a TP group has the same free memory would refuse them (it logs a warning instead)
SHARED_GPU_ENV = {"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0"}
# two TP layouts of llama-tiny / deepseek-tiny differed by up to 0.05 nats on the 4-GPU host (TP 2 -> 1 against
# a TP-1 reference); the negative controls must move the answer further than this to count as flagged
LAYOUT_TOLERANCE = 0.06
# a prompt control changes one token per this many prompt tokens (at least one), spread evenly: a single token
# of a 2,500-token prompt moved the logprobs by only ~0.03 nats
PERTURB_EVERY = 256
CHECK_LB_FLAGS = ["--policy", "round_robin", "--log-level", "warning"]
CONTROL_MIN_TOKENS = 64
CHECK_RESERVE_S = 120  # what the checks of every shape need after the launch


def server_for(launch: Launch, flag_file: Path) -> Server:
    env = {**config.COMMON_ENV, **SHARED_GPU_ENV, **dict(launch.env)}
    if launch.role == "decode":
        env[CORRUPT_VAR] = str(flag_file)
    mode = "null" if launch.role.startswith("reference") else launch.role
    return Server(launch.name, launch.port, mode, gpu=launch.gpu, bootstrap_port=launch.bootstrap_port,
                  argv=launch.argv, env=env)


def transfers_served(url: str) -> Optional[float]:
    """How many KV transfers a prefill server has made (its kv_transfer_latency_ms histogram count)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            totals = promparse.histogram_totals(r.read().decode(), promparse.KV_TRANSFER_LATENCY)
    except OSError:
        return None
    return totals.count if totals else 0.0


async def check_shape(shape: Shape, ref_urls: list[str], lb_url: str, flag_file: Path) -> dict[str, Any]:
    """`ref_urls`: the decode-layout reference, then (different layouts) the prefill-layout one."""
    import aiohttp

    tol = compare.DEFAULT_TOLERANCE if shape.same_layout else LAYOUT_TOLERANCE
    ties = not shape.same_layout
    diffs: list[compare.CaseDiff] = []
    layout_gaps: list[compare.CaseDiff] = []
    controls: list[dict[str, Any]] = []
    refs: dict[str, list[compare.Generation]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def ask(url: str, prompt: Any, stream: bool = False) -> compare.Generation:
            body = client.generate_payload(prompt, check.MAX_NEW_TOKENS, logprobs=True, stream=stream)
            return (await client.generate(s, url, body))[0]

        def judge(name: str, mode: str, answers: list[compare.Generation], got: compare.Generation) -> compare.CaseDiff:
            """Against the first reference that `got` agrees with; the decode-layout one when none does."""
            found = [compare.compare(name, mode, ref, got, tol, ties) for ref in answers]
            return next((d for d in found if d.passed), found[0])

        for name, prompt in check.cases():
            for stream in (False, True):
                mode = "stream" if stream else "nonstream"
                answers = [await ask(url, prompt, stream) for url in ref_urls]
                diffs.append(judge(name, mode, answers, await ask(lb_url, prompt, stream)))
                if len(answers) > 1:  # how far the two layouts themselves are apart
                    layout_gaps.append(compare.compare(name, mode, answers[0], answers[1], tol, ties))
                if not stream:
                    refs[name] = answers
        long_prompts = [(n, p) for n, p in check.cases() if isinstance(p, list) and len(p) >= CONTROL_MIN_TOKENS]
        for name, prompt in long_prompts:
            got = await ask(lb_url, check.perturbed(prompt, PERTURB_EVERY))
            controls.append(_control("prompt", judge(name, "nonstream", refs[name], got)))
        flag_file.touch()
        try:
            for name, prompt in long_prompts:
                controls.append(_control("kv", judge(name, "nonstream", refs[name], await ask(lb_url, prompt))))
        finally:
            flag_file.unlink(missing_ok=True)
    summary = compare.summarize(diffs, tol)
    flagged = sum(c["flagged"] for c in controls)
    out = {"summary": summary, "cases": [d.to_dict() for d in diffs], "controls": controls,
           "controls_flagged": f"{flagged}/{len(controls)}", "all_controls_flagged": flagged == len(controls),
           "tolerance": tol, "ties_allowed": ties, "references": len(ref_urls)}
    if layout_gaps:
        out["layout_gap"] = {"summary": compare.summarize(layout_gaps, tol), "cases": [d.to_dict() for d in layout_gaps]}
    return out


def _control(kind: str, d: compare.CaseDiff) -> dict[str, Any]:
    return {"kind": kind, "case": d.case, "flagged": not d.passed, "first_mismatch": d.first_mismatch,
            "max_abs_logprob_diff": d.max_abs_logprob_diff}


def verdict(shape: Shape, entry: dict[str, Any]) -> str:
    """pass: every case passed, every control flagged, bit-identical where the layouts match, every prefill used."""
    s = entry.get("summary", {})
    ok = (s.get("verdict") == "pass" and entry.get("all_controls_flagged")
          and (s.get("bit_identical") or not shape.same_layout)
          and all((n or 0) > 0 for n in entry.get("prefill_transfers", {}).values()))
    return "pass" if ok else "fail"


def run(models: Path, logs: Path, only: list[str], deadline: float, results: dict[str, Any]) -> dict[str, Any]:
    release = resolve_release(None)
    state = config.e2e_root() / "state"
    state.mkdir(parents=True, exist_ok=True)
    results.update(release=release, lb_flags=CHECK_LB_FLAGS, layout_tolerance=LAYOUT_TOLERANCE, shapes={})
    launches = {name: plan(SHAPES[name], models / SHAPES[name].model, release, CHECK_LB_FLAGS) for name in only}
    flags = {name: state / f"corrupt-{name}" for name in only}
    for f in flags.values():
        f.unlink(missing_ok=True)
    with Stack(logs) as stack:
        servers = {name: [server_for(l, flags[name]) for l in ls] for name, ls in launches.items()}
        sglang = [s for ss in servers.values() for s in ss if s.mode != "lb"]
        t0 = time.monotonic()
        # the checks take about a minute; servers not up by then are reported with their log tails
        results["launch_timeout_s"] = round(max(60.0, min(420.0, deadline - time.monotonic() - CHECK_RESERVE_S)))
        stack.launch(sglang, timeout_s=results["launch_timeout_s"], lanes=4)
        results["launch_s"] = round(time.monotonic() - t0, 1)
        ready: dict[str, tuple[list[Server], Server, list[Server]]] = {}
        for name, ss in servers.items():
            entry: dict[str, Any] = {"why": SHAPES[name].why, "model": SHAPES[name].model,
                                     "same_layout": SHAPES[name].same_layout,
                                     "commands": {s.name: " ".join(s.argv or []) for s in ss}}
            results["shapes"][name] = entry
            refs = [s for s in ss if s.mode == "null"]  # decode layout first (plan's order)
            lb = next(s for s in ss if s.mode == "lb")
            failed = failure_report([s for s in ss if s.mode != "lb"])
            if failed:
                entry.update(status="servers_failed", errors=failed, verdict="fail")
            elif not stack.launch_lb(lb):
                entry.update(status="lb_failed", errors=failure_report([lb]) or {lb.name: lb.log_tail()}, verdict="fail")
            else:
                ready[name] = (refs, lb, [s for s in ss if s.mode == "prefill"])
        before = {name: {p.name: transfers_served(p.url) for p in ps} for name, (_, _, ps) in ready.items()}

        async def all_checks() -> list[Any]:
            return await asyncio.gather(*(check_shape(SHAPES[n], [r.url for r in refs], lb.url, flags[n])
                                          for n, (refs, lb, _) in ready.items()), return_exceptions=True)

        for name, got in zip(ready, asyncio.run(all_checks())):
            entry = results["shapes"][name]
            if isinstance(got, BaseException):
                entry.update(status="error", verdict="fail",
                             errors={"client": "".join(traceback.format_exception(got))[-2000:]})
                continue
            entry.update(got, status="ok")
            entry["prefill_transfers"] = {p.name: _delta(before[name][p.name], transfers_served(p.url))
                                          for p in ready[name][2]}
            entry["verdict"] = verdict(SHAPES[name], entry)
            print(f"shape {name}: {entry['verdict']} {entry['summary']} controls {entry['controls_flagged']} "
                  f"prefill transfers {entry['prefill_transfers']}", flush=True)
    return results


def _delta(before: Optional[float], after: Optional[float]) -> Optional[float]:
    return None if before is None or after is None else after - before


def main(argv: list[str] | None = None) -> int:
    ap = config.step_parser(__doc__)
    ap.add_argument("--only", default=",".join(SHAPES))
    a = ap.parse_args(argv)
    exit_on_sigterm()
    res: dict[str, Any] = {}
    try:
        run(a.models, a.logs, a.only.split(","), config.deadline_from_env(), res)
    finally:
        results_io.write_json(a.out, res)
    return 0 if res.get("shapes") and all(e.get("verdict") == "pass" for e in res["shapes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
