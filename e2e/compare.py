"""Token-for-token and logprob comparison of a PD answer with the non-disaggregated reference.

Greedy decoding of the same prompt on the same model with identical server flags must give the same output
ids; with one request at a time it also gives the same per-token logprobs (PD against the reference was
bit-identical with Mooncake on the 2-GPU host). Logprobs are compared only up to the first differing id: after
that the two answers condition on different text and their numbers mean different things.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Sequence

# corrupted or missing KV moved logprobs by >= 0.35 nats on the sharpened models; bf16 noise is far below this
DEFAULT_TOLERANCE = 0.02


@dataclass
class Generation:
    """What one /generate answer says about its output tokens."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per position: token id -> logprob
    text: str = ""
    finish_reason: Any = None
    completion_tokens: Optional[int] = None  # the server's own count (present without return_logprob too)


@dataclass
class CaseDiff:
    case: str
    mode: str  # "stream" or "nonstream"
    n_ref: int
    n_got: int
    ids_equal: bool
    first_mismatch: Optional[int]
    max_abs_logprob_diff: Optional[float]  # over the common prefix; None when nothing comparable
    max_abs_top_logprob_diff: Optional[float]
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing position (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _max_abs(pairs: Iterable[tuple[float, float]]) -> Optional[float]:
    diffs = [abs(x - y) for x, y in pairs if x is not None and y is not None]
    return max(diffs) if diffs else None


def _top_pairs(ref: list[dict[int, float]], got: list[dict[int, float]], n: int) -> Iterable[tuple[float, float]]:
    for r, g in zip(ref[:n], got[:n]):
        for tok in r.keys() & g.keys():
            yield r[tok], g[tok]


def top_margin(gen: Generation, pos: int) -> Optional[float]:
    """How far the best candidate at `pos` leads the second (from the top logprobs), None when unknown."""
    if pos >= len(gen.top_logprobs) or len(gen.top_logprobs[pos]) < 2:
        return None
    first, second = sorted(gen.top_logprobs[pos].values(), reverse=True)[:2]
    return first - second


def compare(case: str, mode: str, ref: Generation, got: Generation,
            tolerance: float = DEFAULT_TOLERANCE, allow_ties: bool = False) -> CaseDiff:
    """`allow_ties`: where PD and the reference run different layouts (their numbers differ by rounding), a
    differing id counts as a tie, not a failure, when the reference's two best candidates there are within
    `tolerance` of each other; the comparison ends at that position either way."""
    mm = first_mismatch(ref.output_ids, got.output_ids)
    # the logprob at the first differing position is still comparable (both conditioned on the same prefix)
    upto = len(ref.output_ids) if mm is None else mm + 1
    lp = _max_abs(zip(ref.logprobs[:upto], got.logprobs[:upto]))
    top = _max_abs(_top_pairs(ref.top_logprobs, got.top_logprobs, upto))
    within = all(d is None or d <= tolerance for d in (lp, top))
    margin = top_margin(ref, mm) if mm is not None and mm < len(ref.output_ids) else None
    tie = allow_ties and margin is not None and margin <= tolerance and len(got.output_ids) == len(ref.output_ids)
    return CaseDiff(case=case, mode=mode, n_ref=len(ref.output_ids), n_got=len(got.output_ids),
                    ids_equal=mm is None, first_mismatch=mm, max_abs_logprob_diff=lp,
                    max_abs_top_logprob_diff=top, passed=(mm is None or tie) and within and len(ref.output_ids) > 0)


def summarize(diffs: Sequence[CaseDiff], tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """One verdict for a model: every case equal in ids and within tolerance; bit_identical when all diffs are 0."""
    lps = [d.max_abs_logprob_diff for d in diffs if d.max_abs_logprob_diff is not None]
    tops = [d.max_abs_top_logprob_diff for d in diffs if d.max_abs_top_logprob_diff is not None]
    return {
        "cases": len(diffs),
        "ids_equal": sum(d.ids_equal for d in diffs),
        "passed": sum(d.passed for d in diffs),
        "max_abs_logprob_diff": max(lps) if lps else None,
        "max_abs_top_logprob_diff": max(tops) if tops else None,
        "bit_identical": bool(diffs) and all(d.ids_equal for d in diffs) and not any(lps) and not any(tops),
        "tolerance": tolerance,
        "verdict": "pass" if diffs and all(d.passed for d in diffs) else "fail",
    }


def sensitivity(base: Generation, perturbed: Generation) -> Optional[float]:
    """How far one changed prompt token moves the reference's answer: the largest logprob change over the
    common prefix, or +inf when the very first output token already differs (any change is then visible).
    A sharp check needs this to be far above the tolerance."""
    mm = first_mismatch(base.output_ids, perturbed.output_ids)
    upto = len(base.output_ids) if mm is None else mm + 1
    d = _max_abs(zip(base.logprobs[:upto], perturbed.logprobs[:upto]))
    if mm == 0 and (d is None or d == 0):
        return float("inf")
    return d
