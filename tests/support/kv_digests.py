"""The test-only KV digests (SGLANG_P2P_TEST_KV_DIGEST=1) a driver run's ranks logged, compared by room with the
end-to-end checks' own comparer (e2e/kv_digest.py), so the CPU tests prove the line both sides write is the one
the 4-GPU check reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from e2e import kv_digest

ENV = {"SGLANG_P2P_TEST_KV_DIGEST": "1"}


def logs(result: dict, role: str) -> dict[str, str]:
    """{log name: text} of every rank of `role` in a run (testing/launch.py writes `<role>-<rank>.log`)."""
    return {p.name: p.read_text(errors="replace") for p in sorted(Path(result["workdir"]).glob(f"{role}-*.log"))}


def compare_run(result: dict) -> dict[str, Any]:
    return kv_digest.compare(logs(result, "prefill"), logs(result, "decode"))


def lines(result: dict, role: str) -> list[kv_digest.Digest]:
    return [d for name, text in logs(result, role).items() for d in kv_digest.parse(text, name)]
