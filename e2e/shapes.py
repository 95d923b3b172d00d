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

Where the layouts differ, rounding alone moved the two references up to 0.27 nats apart on the 4-GPU host, so
logprobs cannot tell exact KV from slightly wrong KV. The MLA shapes therefore prove the transfer byte for
byte: their servers log a digest of every room's KV pages on both sides (SGLANG_P2P_TEST_KV_DIGEST,
adapter/kv_digest.py), which must be equal for every room the check sent, and differ for every room the `kv`
control corrupted (e2e/kv_digest.py). With the bytes proven, an answer of such a shape also passes within the
largest gap measured between the two references.
"""
from __future__ import annotations

import asyncio
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from sglang_p2p_backend.launch.release import resolve_release

from . import check, client, compare, config, kv_digest, promparse, results as results_io
from .servers import Server, Stack, exit_on_sigterm, failure_report
from .shape_plan import DEFAULT_SHAPES, SHAPES, Launch, Shape, plan

CORRUPT_VAR = "SGLANG_P2P_TEST_CORRUPT_KV_FILE"
DIGEST_VAR = "SGLANG_P2P_TEST_KV_DIGEST"
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


def server_for(launch: Launch, flag_file: Path, digest: bool = False) -> Server:
    """`digest`: the PD servers log the test-only KV digest of every room (a synchronous hash on the GPU per
    room, so only for the correctness check, not for timed runs)."""
    env = {**config.COMMON_ENV, **SHARED_GPU_ENV, **dict(launch.env)}
    if launch.role == "decode":
        env[CORRUPT_VAR] = str(flag_file)
    if digest and launch.role in ("prefill", "decode"):
        env[DIGEST_VAR] = "1"
    mode = "null" if launch.role.startswith("reference") else launch.role
    return Server(launch.name, launch.port, mode, gpu=launch.gpu, bootstrap_port=launch.bootstrap_port,
                  argv=launch.argv, env=env)


def transfers_served(url: str) -> Optional[float]:
    """How many KV transfers a prefill server has made (its kv_transfer_latency_ms histogram count)."""
    text = promparse.fetch(url)
    if text is None:
        return None
    totals = promparse.histogram_totals(text, promparse.KV_TRANSFER_LATENCY)
    return totals.count if totals else 0.0


async def check_shape(shape: Shape, ref_urls: list[str], lb_url: str, flag_file: Path) -> dict[str, Any]:
    """`ref_urls`: the decode-layout reference, then (different layouts) the prefill-layout one."""
    import aiohttp

    tol = compare.DEFAULT_TOLERANCE if shape.same_layout else LAYOUT_TOLERANCE
    ties = not shape.same_layout
    asked: list[tuple[str, str, list[compare.Generation], compare.Generation]] = []
    layout_gaps: list[compare.CaseDiff] = []
    controls: list[dict[str, Any]] = []
    refs: dict[str, list[compare.Generation]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def ask(url: str, prompt: Any, stream: bool = False) -> compare.Generation:
            body = client.generate_payload(prompt, check.MAX_NEW_TOKENS, logprobs=True, stream=stream)
            return (await client.generate(s, url, body))[0]

        for name, prompt in check.cases():
            for stream in (False, True):
                mode = "stream" if stream else "nonstream"
                answers = [await ask(url, prompt, stream) for url in ref_urls]
                asked.append((name, mode, answers, await ask(lb_url, prompt, stream)))
                if len(answers) > 1:  # how far the two layouts themselves are apart
                    layout_gaps.append(compare.compare(name, mode, answers[0], answers[1], tol, ties))
                if not stream:
                    refs[name] = answers
        long_prompts = [(n, p) for n, p in check.cases() if isinstance(p, list) and len(p) >= CONTROL_MIN_TOKENS]
        for name, prompt in long_prompts:
            got = await ask(lb_url, check.perturbed(prompt, PERTURB_EVERY))
            controls.append(_control("prompt", judge(name, "nonstream", refs[name], got, tol, ties)))
        flag_file.touch()
        try:
            for name, prompt in long_prompts:
                got = await ask(lb_url, prompt)
                controls.append(_control("kv", judge(name, "nonstream", refs[name], got, tol, ties)))
        finally:
            flag_file.unlink(missing_ok=True)
    diffs = [judge(*a, tol, ties) for a in asked]
    summary = compare.summarize(diffs, tol)
    flagged = sum(c["flagged"] for c in controls)
    out = {"summary": summary, "cases": [d.to_dict() for d in diffs], "controls": controls,
           "controls_flagged": f"{flagged}/{len(controls)}", "all_controls_flagged": flagged == len(controls),
           "tolerance": tol, "ties_allowed": ties, "references": len(ref_urls)}
    if layout_gaps:
        gap_summary = compare.summarize(layout_gaps, tol)
        out["layout_gap"] = {"summary": gap_summary, "cases": [d.to_dict() for d in layout_gaps]}
        # the same answers judged within the largest gap between the two references (the layouts' own rounding)
        gap = max([tol] + [v for v in (gap_summary["max_abs_logprob_diff"], gap_summary["max_abs_top_logprob_diff"])
                           if v is not None])
        out["within_layout_gap"] = compare.summarize([judge(*a, gap, ties) for a in asked], gap)
    return out


def judge(name: str, mode: str, answers: list[compare.Generation], got: compare.Generation, tol: float,
          ties: bool) -> compare.CaseDiff:
    """Against the first reference that `got` agrees with; the decode-layout one when none does."""
    found = [compare.compare(name, mode, ref, got, tol, ties) for ref in answers]
    return next((d for d in found if d.passed), found[0])


def _control(kind: str, d: compare.CaseDiff) -> dict[str, Any]:
    return {"kind": kind, "case": d.case, "flagged": not d.passed, "first_mismatch": d.first_mismatch,
            "max_abs_logprob_diff": d.max_abs_logprob_diff}


def digest_check(entry: dict[str, Any], prefill_logs: dict[str, str], decode_logs: dict[str, str]) -> dict[str, Any]:
    """The KV digests of the shape's servers compared by room (e2e/kv_digest.py): `passed` when every room the
    check sent through the LB (but the `kv` controls) was compared and equal, and each `kv` control's room differs."""
    out = kv_digest.compare(prefill_logs, decode_logs)
    kv_controls = sum(c["kind"] == "kv" for c in entry.get("controls", []))
    out["rooms_required"] = len(entry.get("cases", [])) + len(entry.get("controls", [])) - kv_controls
    out["kv_controls_sent"] = kv_controls
    out["passed"] = kv_digest.passed(out, out["rooms_required"], kv_controls)
    return out


def verdict(shape: Shape, entry: dict[str, Any]) -> str:
    """pass: every case passed (bit-identical where the layouts match; else within the layout tolerance, or, with
    the KV proven by the digests, within the references' own gap), every control flagged (a shape with digests:
    `kv` controls by the digest), every prefill used."""
    s = entry.get("summary", {})
    digests = entry.get("kv_digest") if shape.kv_digest else None
    answers = s.get("verdict") == "pass" and (s.get("bit_identical") or not shape.same_layout)
    if not answers and not shape.same_layout and digests is not None:
        answers = entry.get("within_layout_gap", {}).get("verdict") == "pass"
    if shape.kv_digest:
        controls = all(c["flagged"] for c in entry.get("controls", []) if c["kind"] != "kv")
        controls = controls and bool(digests and digests.get("passed"))
    else:
        controls = bool(entry.get("all_controls_flagged"))
    ok = answers and controls and all((n or 0) > 0 for n in entry.get("prefill_transfers", {}).values())
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
        servers = {name: [server_for(l, flags[name], digest=True) for l in ls] for name, ls in launches.items()}
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
            entry["kv_digest"] = digest_check(entry, _logs(servers[name], "prefill"), _logs(servers[name], "decode"))
            entry["verdict"] = verdict(SHAPES[name], entry)
            d = entry["kv_digest"]
            print(f"shape {name}: {entry['verdict']} {entry['summary']} controls {entry['controls_flagged']} "
                  f"prefill transfers {entry['prefill_transfers']} kv digests: {d['rooms_equal']}/{d['rooms_compared']} "
                  f"rooms equal ({d['rooms_not_comparable']} not comparable), controls flagged by digest "
                  f"{d['controls_flagged_by_digest']}/{d['control_rooms']}", flush=True)
    return results


def _logs(servers: list[Server], mode: str) -> dict[str, str]:
    """{server name: its log} of the shape's servers of `mode` (prefill, decode)."""
    return {s.name: s.log.read_text(errors="replace") if s.log and s.log.exists() else ""
            for s in servers if s.mode == mode}


def _delta(before: Optional[float], after: Optional[float]) -> Optional[float]:
    return None if before is None or after is None else after - before


def main(argv: list[str] | None = None) -> int:
    ap = config.step_parser(__doc__)
    ap.add_argument("--only", default=",".join(DEFAULT_SHAPES))
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
