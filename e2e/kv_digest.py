"""The test-only KV digests of a shape's servers compared by room: proof, independent of the model's numerics, that
every page a prefill sent arrived byte for byte.

With SGLANG_P2P_TEST_KV_DIGEST=1 every prefill rank logs a digest of the pages it sent for a room, every decode
rank one of the pages it holds at the room's Success (adapter/kv_digest.py `format_line`). Pure: `compare` takes
the servers' log texts. A room is logged once by each prefill rank that sent it KV and once by each decode rank
that received it. MLA pages are whole on every rank, so all of a room's digests must be equal (one prefill rank
feeding two decode ranks, or the one of several that the decode picked). MHA/GQA pages are whole only at the same
attention TP and page size: then decode rank r pairs with prefill rank r; otherwise the room is not comparable.
Rooms the decode corrupted on purpose (the `kv` control: the fault's log line names them) must differ instead.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

_LINE = re.compile(r"p2p kv digest (?P<role>prefill|decode) room=(?P<room>\d+) rank=(?P<rank>\d+) "
                   r"attn_tp=(?P<tp_rank>\d+)/(?P<tp_size>\d+) mla=(?P<mla>[01]) page=(?P<page>\d+) "
                   r"pages=(?P<pages>\d+) digest=(?P<digest>[0-9a-f]+)")
# adapter/kv_fault.py's warning: the room it zeroed pages of
_FAULT = re.compile(r"test fault \(.*?\): zeroed \d+ pages of room (\d+)")
#: mismatches and one-sided rooms listed at most (their counts are complete)
LISTED = 20


@dataclass(frozen=True)
class Digest:
    """One logged digest line; `server`: whose log it came from."""

    role: str
    room: int
    rank: int
    attn_tp_rank: int
    attn_tp_size: int
    mla: bool
    page_size: int
    pages: int
    digest: str
    server: str = ""


def parse(text: str, server: str = "") -> list[Digest]:
    """Every digest line in a server's log."""
    return [Digest(m["role"], int(m["room"]), int(m["rank"]), int(m["tp_rank"]), int(m["tp_size"]), m["mla"] == "1",
                   int(m["page"]), int(m["pages"]), m["digest"], server) for m in _LINE.finditer(text)]


def corrupted_rooms(text: str) -> set[int]:
    """Rooms a decode zeroed pages of (the test-only fault, while its flag file existed)."""
    return {int(m.group(1)) for m in _FAULT.finditer(text)}


def judge_room(prefill: list[Digest], decode: list[Digest]) -> str:
    """`equal`, `mismatch`, `missing_side` or `not_comparable` for one room's lines."""
    if not prefill or not decode:
        return "missing_side"
    lines = prefill + decode
    if all(d.mla for d in lines):
        return "equal" if len({d.digest for d in lines}) == 1 else "mismatch"
    if any(d.mla for d in lines) or len({(d.attn_tp_size, d.page_size) for d in lines}) != 1:
        return "not_comparable"  # MHA/GQA at another attention TP or page size: each rank holds other bytes
    by_rank: dict[int, set[str]] = {}
    for d in prefill:
        by_rank.setdefault(d.attn_tp_rank, set()).add(d.digest)
    return "equal" if all(by_rank.get(d.attn_tp_rank) == {d.digest} for d in decode) else "mismatch"


def compare(prefill_logs: Mapping[str, str], decode_logs: Mapping[str, str]) -> dict[str, Any]:
    """Digests of the prefill servers' and decode servers' logs (server name -> text) compared by room. Rooms
    a decode's log names as corrupted on purpose are the controls: counted apart, each must mismatch."""
    lines = [d for name, text in prefill_logs.items() for d in parse(text, name)]
    lines += [d for name, text in decode_logs.items() for d in parse(text, name)]
    controls = set().union(*(corrupted_rooms(t) for t in decode_logs.values())) if decode_logs else set()
    return summarize(lines, controls)


def summarize(lines: Iterable[Digest], controls: set[int]) -> dict[str, Any]:
    """The comparison of parsed lines; `controls`: rooms expected to mismatch."""
    rooms: dict[int, tuple[list[Digest], list[Digest]]] = {}
    for d in lines:
        rooms.setdefault(d.room, ([], []))[d.role == "decode"].append(d)
    out: dict[str, Any] = {"rooms_compared": 0, "rooms_equal": 0, "mismatched": 0, "mismatches": [],
                           "rooms_missing_a_side": 0, "missing": [], "rooms_not_comparable": 0,
                           "control_rooms": len(controls), "controls_flagged_by_digest": 0, "controls_not_flagged": []}
    for room, (prefill, decode) in sorted(rooms.items()):
        verdict = judge_room(prefill, decode)
        detail = {"room": room, "prefill": [_brief(d) for d in prefill], "decode": [_brief(d) for d in decode]}
        if room in controls:
            if verdict == "mismatch":
                out["controls_flagged_by_digest"] += 1
            else:
                out["controls_not_flagged"].append({**detail, "verdict": verdict})
        elif verdict == "missing_side":
            out["rooms_missing_a_side"] += 1
            _listed(out["missing"], detail)
        elif verdict == "not_comparable":
            out["rooms_not_comparable"] += 1
        else:
            out["rooms_compared"] += 1
            out["rooms_equal"] += verdict == "equal"
            if verdict == "mismatch":
                out["mismatched"] += 1
                _listed(out["mismatches"], detail)
    return out


def passed(summary: dict[str, Any], min_rooms: int, kv_controls: int) -> bool:
    """At least `min_rooms` rooms compared, all equal; at least `kv_controls` corrupted rooms, each a mismatch."""
    return (summary["rooms_compared"] >= min_rooms and summary["rooms_equal"] == summary["rooms_compared"]
            and summary["control_rooms"] >= kv_controls
            and summary["controls_flagged_by_digest"] == summary["control_rooms"])


def _brief(d: Digest) -> dict[str, Any]:
    out = asdict(d)
    del out["room"], out["role"]
    return out


def _listed(into: list, item: dict[str, Any]) -> None:
    if len(into) < LISTED:
        into.append(item)
