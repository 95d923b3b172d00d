"""Named workloads of a sweep and their translation into each tool's arguments.

A scenario is a fixed input/output token count pair, so genai-bench (``D(in,out)``) and evalscope perf
(``--min/--max-prompt-length``, ``--max-tokens`` with ``ignore_eos``) send the same shapes and their
results can be compared line for line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    name: str
    input_tokens: int
    output_tokens: int

    @property
    def genai_bench_spec(self) -> str:
        """genai-bench's deterministic traffic scenario syntax."""
        return f"D({self.input_tokens},{self.output_tokens})"


# The source material judges a PD deployment on short queries (< 128 prompt tokens, up to 128 concurrency),
# long queries and an input:output ratio of 4:1; every named scenario keeps that 4:1 ratio.
NAMED: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("short", 100, 25),
        Scenario("mid", 512, 128),
        Scenario("long", 2000, 500),
        # tiny shapes for the CI smoke sweep on a 2-core machine
        Scenario("smoke", 32, 8),
    )
}

_SPEC = re.compile(r"^D\((\d+),(\d+)\)$")


def parse_scenario(text: str) -> Scenario:
    """``short`` | ``NAME=D(in,out)`` | ``D(in,out)`` -> Scenario; ValueError with the accepted forms."""
    text = text.strip().replace(" ", "")
    if text in NAMED:
        return NAMED[text]
    name, _, spec = text.rpartition("=")
    m = _SPEC.match(spec)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(
            f"unknown scenario {text!r}: use one of {', '.join(NAMED)} or NAME=D(input_tokens,output_tokens)"
        )
    inp, out = int(m.group(1)), int(m.group(2))
    return Scenario(name or f"D{inp}_{out}", inp, out)


def parse_scenarios(text: str) -> list[Scenario]:
    """Comma-separated list; commas inside ``D(a,b)`` are kept together."""
    parts = re.findall(r"[^,(]+(?:\([^)]*\))?", text)
    scenarios = [parse_scenario(p) for p in parts if p.strip()]
    names = [s.name for s in scenarios]
    if len(set(names)) != len(names):
        raise ValueError(f"scenario names must be unique: {names}")
    if not scenarios:
        raise ValueError("no scenario given")
    return scenarios


def scenario_from_genai_bench(spec: str, known: list[Scenario]) -> str:
    """Map genai-bench's scenario string back to our name (it only records the D(...) spec)."""
    for s in known:
        if s.genai_bench_spec == spec.replace(" ", ""):
            return s.name
    return spec


def parse_concurrency(text: str) -> list[int]:
    """``1,2,4`` or a power-of-two range ``1-256``; sorted, unique, all >= 1."""
    values: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            if lo < 1 or hi < lo:
                raise ValueError(f"bad concurrency range {part!r}")
            c = lo
            while c <= hi:
                values.add(c)
                c *= 2
        else:
            values.add(int(part))
    if not values or min(values) < 1:
        raise ValueError(f"concurrency must be integers >= 1, got {text!r}")
    return sorted(values)


def requests_for(concurrency: int, requests_per_user: int, min_requests: int) -> int:
    """Requests of one run: enough that every concurrent user sends several and the tail is measurable."""
    return max(min_requests, requests_per_user * concurrency)
