"""Correctness step: PD with p2pnccl through our LB against a non-disaggregated server, token for token.

    python3 -m e2e.check --models DIR --out results.json --logs DIR [--only llama-tiny,mla-tiny,swa-tiny]

For each model: a reference server, a prefill (GPU 0) + decode (GPU 1) pair with
``--disaggregation-transfer-backend p2pnccl`` and our LB, all with the same flags (``--gpus 1``: every server on
GPU 0 and p2pnccl on its Mooncake tcp transport, see config.py) (config.CHECK_FLAGS: chunked
prefill of 64 tokens, radix cache off, fp32 lm_head). Every prompt goes once to the reference and once through
the LB, one request at a time (batching alone moves logprobs), non-streaming and streaming. A sensitivity probe
(one prompt token changed, sent to the reference) shows how far a wrong context would move the logprobs, i.e.
that the comparison is sharp.

E2E_CHECK_RELEASE=1: after the comparison, the prefill and the decode release their KV memory and resume it
(SGLang's `/release_memory_occupation`, `/resume_memory_occupation`, tag kv_cache; p2pnccl's memory hooks), and
every prompt is compared again (`after_resume`). E2E_CHECK_MEMORY_SAVER=1 starts the prefill and the decode with
`--enable-memory-saver` (torch_memory_saver: the release unmaps the pools).
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import client, compare, config, results as results_io
from .servers import Server, Stack, exit_on_sigterm, failure_report

MODELS = {"llama-tiny": 0, "mla-tiny": 1}  # model -> GPU of its reference server (spreads the launches)
# checked only when named (--only / E2E_CHECK_ONLY): swa-tiny, the hybrid sliding-window model (GPT-OSS)
ON_REQUEST = {"swa-tiny": 0}
BASE_PORT = {"llama-tiny": 31000, "mla-tiny": 31100, "swa-tiny": 31200}
PROMPT_LENGTHS = (1, 7, 63, 64, 65, 200, 777, 2500)  # around the 64-token chunk edge, and many chunks
MAX_NEW_TOKENS = 24
TEXT_PROMPT = "The quick brown fox jumps over the lazy dog, and then it"
RELEASE = os.environ.get("E2E_CHECK_RELEASE", "0") == "1"
MEMORY_SAVER = os.environ.get("E2E_CHECK_MEMORY_SAVER", "0") == "1"


def cases(seed: int = 7) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [(f"ids{n}", client.random_prompts(1, n, seed + n)[0]) for n in PROMPT_LENGTHS]
    return out + [("text", TEXT_PROMPT)]


def perturbed(prompt: list[int], every: int = 0) -> list[int]:
    """The same prompt with its middle token changed; with `every`, one token per `every` (at least one), each
    in the middle of one of that many equal parts."""
    q = list(prompt)
    n = max(1, len(q) // every) if every else 1
    for k in range(n):
        i = (2 * k + 1) * len(q) // (2 * n)
        q[i] = 3 + (q[i] - 3 + 1) % (4096 - 3)
    return q


async def compare_model(ref_url: str, lb_url: str, tolerance: float) -> dict[str, Any]:
    import aiohttp

    diffs: list[compare.CaseDiff] = []
    probes: dict[str, Any] = {}
    # tiny models answer in well under a second: a request still open after 60 s is a hang, not slowness
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for name, prompt in cases():
            for stream in (False, True):
                body = client.generate_payload(prompt, MAX_NEW_TOKENS, logprobs=True, stream=stream)
                ref, _, _ = await client.generate(s, ref_url, body)
                got, _, _ = await client.generate(s, lb_url, body)
                diffs.append(compare.compare(name, "stream" if stream else "nonstream", ref, got, tolerance))
            if isinstance(prompt, list) and len(prompt) >= 64:
                base_body = client.generate_payload(prompt, MAX_NEW_TOKENS, logprobs=True, stream=False)
                pert_body = client.generate_payload(perturbed(prompt), MAX_NEW_TOKENS, logprobs=True, stream=False)
                base, _, _ = await client.generate(s, ref_url, base_body)
                pert, _, _ = await client.generate(s, ref_url, pert_body)
                probes[name] = compare.sensitivity(base, pert)
    finite = [v for v in probes.values() if v is not None]
    return {"summary": compare.summarize(diffs, tolerance), "cases": [d.to_dict() for d in diffs],
            "sensitivity": {"per_prompt": probes, "min": min(finite) if finite else None,
                            "note": "largest logprob change from one changed prompt token (reference server); "
                                    "inf = the first output token changed"}}


def gpu_memory_used_mib() -> list[int] | None:
    """Memory in use on each GPU (nvidia-smi), None without one: what a release gave back shows here."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(x) for x in out.split()]


async def release_and_resume(urls: list[str]) -> dict[str, Any]:
    """Each server releases its KV memory, then each resumes it (an idle server: SGLang asserts it); the GPUs'
    memory in use before, after the releases and after the resumes (`gpu_mib_*`)."""
    import aiohttp

    out: dict[str, Any] = {"gpu_mib_before": gpu_memory_used_mib()}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        for step in ("release", "resume"):
            for url in urls:
                t0 = time.monotonic()
                async with s.post(f"{url}/{step}_memory_occupation", json={"tags": ["kv_cache"]}) as r:
                    body = await r.text()
                    out[f"{step} {url}"] = {"status": r.status, "s": round(time.monotonic() - t0, 2), "body": body[:300]}
                    if r.status != 200:
                        raise RuntimeError(f"{step}_memory_occupation on {url}: HTTP {r.status} {body[:300]}")
            out[f"gpu_mib_after_{step}"] = gpu_memory_used_mib()
    return out


def run(models_dir: Path, logs: Path, only: list[str], tolerance: float,
        results: dict[str, Any] | None = None, gpus: int = 2) -> dict[str, Any]:
    """Fills ``results`` in place as it goes (the caller writes it even if the step is stopped)."""
    results = {} if results is None else results
    results.update(memory_release=RELEASE, memory_saver=MEMORY_SAVER, flags=config.CHECK_FLAGS, flags_by_model={m: config.check_flags(m) for m in only},
                   backend="p2pnccl", gpus=gpus,
                   transport=config.transport_info("p2pnccl", gpus), models={})
    if gpus == 1:
        results["note"] = config.SINGLE_GPU_NOTE
    with Stack(logs) as stack:
        plan: dict[str, tuple[Server, Server, Server, Server]] = {}
        for m in only:
            flags = config.check_flags(m)
            gpu = {**MODELS, **ON_REQUEST}[m] if gpus > 1 else 0
            ref = config.reference(m, models_dir / m, BASE_PORT[m] + 10, gpu, flags)
            pd_flags = [*flags, "--enable-memory-saver"] if MEMORY_SAVER else flags
            p, d, lb = config.pd_pair(m, models_dir / m, "p2pnccl", BASE_PORT[m], pd_flags, gpus)
            plan[m] = (ref, p, d, lb)
        # decode and prefill first on each GPU: if GPU memory runs short, the references are the ones to fail
        order = [s for m in only for s in plan[m][1:3]] + [plan[m][0] for m in only]
        t0 = time.monotonic()
        stack.launch(order, lanes=config.CHECK_LANES_1GPU if gpus == 1 else 1)
        results["launch_s"] = round(time.monotonic() - t0, 1)
        for m in only:
            ref, p, d, lb = plan[m]
            entry: dict[str, Any] = {}
            failed = failure_report([ref, p, d])
            if failed:
                entry.update(status="servers_failed", errors=failed)
            elif not stack.launch_lb(lb):
                entry.update(status="lb_failed", errors=failure_report([lb]) or {lb.name: lb.log_tail()})
            else:
                try:
                    entry.update(asyncio.run(compare_model(ref.url, lb.url, tolerance)))
                    if RELEASE:
                        entry["memory_release"] = asyncio.run(release_and_resume([p.url, d.url]))
                        entry["after_resume"] = asyncio.run(compare_model(ref.url, lb.url, tolerance))
                    entry["status"] = "ok"
                except Exception as e:
                    entry.update(status="error", errors={"client": f"{e}\n{traceback.format_exc()[-2000:]}"},
                                 server_logs=failure_report([p, d]) or {p.name: p.log_tail(15), d.name: d.log_tail(15)})
            results["models"][m] = entry
            print(f"check {m}: {entry.get('status')} {entry.get('summary', '')}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = config.step_parser(__doc__)
    ap.add_argument("--only", default=",".join(MODELS), help=f"also: {', '.join(ON_REQUEST)}")
    ap.add_argument("--tolerance", type=float, default=compare.DEFAULT_TOLERANCE)
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=None, help="default: E2E_GPUS, else 2")
    a = ap.parse_args(argv)
    exit_on_sigterm()
    res: dict[str, Any] = {}
    try:
        run(a.models, a.logs, a.only.split(","), a.tolerance, res, a.gpus or config.gpus_from_env())
    finally:
        results_io.write_json(a.out, res)
    ok = all(m.get("summary", {}).get("verdict") == "pass"
             and (not RELEASE or m.get("after_resume", {}).get("summary", {}).get("verdict") == "pass")
             for m in res["models"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
