"""Control-plane figures on CPU: time from a peer's SIGSTOP to its rooms' failure at default settings, and
what authentication (SGLANG_P2P_AUTH_KEY) adds per message and to a 128-token transfer.

    python bench/control/control_bench.py --out bench/results/control_cpu-2core-dev.json

Runs the project's driver (SGLang's real classes, one process per role, tcp transport on 127.0.0.1).
Targets (issue "The control plane trusts nothing"): SIGSTOP -> failure <= 10 s at defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from sglang_p2p_backend.engine.wire import messages as wire
from sglang_p2p_backend.engine.wire.auth import Authenticator
from sglang_p2p_backend.testing.launch import PairRun, run_pair

POOL = {"layout": "mla", "num_layers": 61, "head_dim": 576, "page_size": 1, "num_pages": 4200}


def per_message_us(n: int = 20000) -> dict:
    """Seal + open of one ChunkHeader carrying 128 page ids (what a 128-token chunk announces)."""
    seg = wire.ChunkSegment(0, 0, 61, np.arange(128, dtype=np.int32).tobytes())
    frames = wire.encode(wire.ChunkHeader("127.0.0.1:7000", 1, 9, 0, 0, 128 * 61 * 1152, [seg]))
    a, b = Authenticator(b"k" * 32, "127.0.0.1:7000", 1), Authenticator(b"k" * 32, "127.0.0.1:7001", 1)
    t0 = time.perf_counter()
    for i in range(n):
        b.open(a.seal(frames, i + 1))
    return {"seal_open_us": (time.perf_counter() - t0) / n * 1e6, "frame_bytes": sum(map(len, frames))}


def transfer_128(keyed: bool, rooms: int = 30) -> dict:
    """p50 / p90 of first send() -> prefill Success for requests of 128 tokens (MLA, 61 layers), one at a time."""
    plan = {"pool": POOL, "requests": [{"room": 10 + i, "tokens": 128} for i in range(rooms)], "deadline_s": 120,
            "serial": True}
    env = {"SGLANG_P2P_AUTH_KEY": "bench-key-0123456789"} if keyed else {}
    result = run_pair(plan, env=env, timeout=180)
    secs = sorted(r["transfer_s"] * 1e3 for r in result["prefill"]["requests"].values() if r["status"] == "Success")
    return {"rooms": len(secs), "p50_ms": statistics.median(secs), "p90_ms": secs[int(0.9 * (len(secs) - 1))]}


def sigstop(stopped: str) -> float:
    faults = {"prefill": {"chunk_delay_s": 0.3}}
    faults[stopped] = {**faults.get(stopped, {}), **({"stop_after_s": 0.5} if stopped == "decode" else {"stop_after_chunks": 2})}
    plan = {"pool": {**POOL, "num_layers": 4, "head_dim": 576}, "requests": [{"room": 601, "tokens": 700, "chunk_pages": 10}],
            "faults": faults, "deadline_s": 60}
    run = PairRun(plan)
    survivor = "prefill" if stopped == "decode" else "decode"
    result = run.wait(90, roles=(survivor,))
    stopped_at = float(open(os.path.join(run.workdir, f"{stopped}.stopped_at")).read())
    r = result[survivor]["requests"]["601"]
    assert r["status"] == "Failed", r
    return r["ended_at"] - stopped_at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--machine", default=f"{platform.node()} ({os.cpu_count()} CPU cores, CPU only)")
    ns = ap.parse_args()
    out = {
        "machine": ns.machine,
        "transport": "tcp on 127.0.0.1 (CPU)",
        "auth_per_message": per_message_us(),
        "transfer_128_tokens_no_key": transfer_128(False),
        "transfer_128_tokens_key": transfer_128(True),
        "sigstop_to_failure_s": {"decode_stopped": sigstop("decode"), "prefill_stopped": sigstop("prefill")},
        "peer_timeout_s": 8.0,
        "target_s": 10.0,
    }
    print(json.dumps(out, indent=1))
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
