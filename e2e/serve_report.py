"""Tables and a plot from serve-phase results (e2e/serve.py): median and spread per cell, backends side by side.

    python -m e2e.serve_report RESULTS.json [MORE.json ...] [--plot out.png] [--markdown]

Several files (e.g. a no-graph and a graph run of one lease) are read as one. Per (CUDA-graph mode, prompt,
concurrency): each backend's median of TTFT p50/p99, TPOT p50, E2E p50, output tokens/s and KV transfer time
over its repetitions, with min-max, and p2pnccl's ratio to NIXL (tok/s higher is better; the rest lower); each
backend's tok/s over NIXL's paired by repetition (`paired`: the run-to-run spread of one cell is ~10%, larger than
the differences sought, and a repetition runs every backend back to back); with several prefills, the busiest
one's share of the requests and the slowest and fastest forward stage; and the py-spy profiles runs carry
(`--profile-cells`).
With `--markdown`, a second table gives SGLang's stage times a run's requests spent (prefill queue, bootstrap,
forward and transfer, the decode's wait after the transfer) with their min-max, so a slow run's stage stands out.
The decode's step time at a running batch size both backends reached is printed per cell too, and
p2pnccl's step time over each other backend's, and each backend's over NIXL's, at equal running batch over every
size both logged (`step_ratio`).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional

from . import room_times
from .results import load as load_result

COLORS = {"p2pnccl": "tab:green", "nixl": "tab:orange", "mooncake": "tab:blue", "p2pnccl-gil5": "tab:olive",
          "p2pnccl-kernel": "tab:purple", "p2pnccl-ce": "tab:cyan", "p2pnccl-grid132": "tab:brown",
          "p2pnccl-spans1024": "tab:pink", "p2pnccl-grid32": "tab:gray",
          "p2pnccl-split": "tab:red", "p2pnccl-auto": "black"}
METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "kv_ms")


def load(paths: list[Path]) -> tuple[list[str], list[dict[str, Any]]]:
    """Every file's cells, the repetitions of one (backend, mode, prompt, concurrency) pooled across files."""
    machines: list[str] = []
    cells: dict[tuple, dict[str, Any]] = {}
    for i, p in enumerate(paths):
        doc = load_result(p)
        machines.append(doc.get("machine", "?"))
        for c in doc.get("cells", []):
            key = (c["backend"], c["cuda_graph"], c["input_len"], c["concurrency"])
            # each repetition keeps where it came from (file, position): `paired` matches runs of one repetition
            cells.setdefault(key, {**c, "reps": []})["reps"] += [
                {**r, "_pair": (i, j)} for j, r in enumerate(c.get("reps", []))]
    return sorted(set(machines)), [c for c in cells.values() if c["reps"]]


def med(c: dict[str, Any], key: str) -> tuple[Optional[float], Optional[float], Optional[float]]:
    xs = [r[key] for r in c["reps"] if r.get(key) is not None]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)


def steps(c: dict[str, Any]) -> dict[int, float]:
    """Running batch size -> median step time (ms) over every repetition's logged intervals."""
    return {n: statistics.median(v) for n, v in _intervals(c).items()}


#: a batch size where one backend's median step is this many times the other's (either way) is a wait in a log
#: (the decode idle between requests, or its last request waiting for KV), not a step: left out of `step_ratio`.
#: At equal batch the steps of the 2 x H200 runs differed by 0-25% where both logged several intervals
IDLE_GAP_RATIO = 2.0


def step_ratio(c: dict[str, Any], other: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The decode's step time of `c` over `other`'s at equal running batch: the geometric mean over every batch
    size both logged, each weighted by the fewer of its intervals (sizes where an idle gap shows are left out,
    IDLE_GAP_RATIO); with the sizes and intervals it rests on, and (`without_one`, where both sides have two runs
    or more) the lowest and highest ratio with one run of each side left out, every pair in turn. A cell of a few
    intervals a size can move far on one run: session 34's 1k x 16 gave 1.172 over all four runs a side and
    1.021-1.377 without one. None where they share no size."""
    got = _step_ratio(_intervals(c), _intervals(other))
    if got is None:
        return None
    mine, theirs = c["reps"], other["reps"]
    if len(mine) > 1 and len(theirs) > 1:
        ratios = [r["ratio"] for i in range(len(mine)) for j in range(len(theirs))
                  if (r := _step_ratio(_intervals({"reps": mine[:i] + mine[i + 1:]}),
                                       _intervals({"reps": theirs[:j] + theirs[j + 1:]}))) is not None]
        if ratios:
            got["without_one"] = (min(ratios), max(ratios))
    return got


def _step_ratio(mine: dict[int, list[float]], theirs: dict[int, list[float]]) -> Optional[dict[str, Any]]:
    """`step_ratio` of two cells' intervals by batch size (`_intervals`)."""
    logs, weights = [], []
    for n in sorted(set(mine) & set(theirs)):
        r = statistics.median(mine[n]) / statistics.median(theirs[n])
        if 1 / IDLE_GAP_RATIO < r < IDLE_GAP_RATIO:
            logs.append(math.log(r))
            weights.append(min(len(mine[n]), len(theirs[n])))
    if not weights:
        return None
    mean = sum(x * w for x, w in zip(logs, weights)) / sum(weights)
    return {"ratio": round(math.exp(mean), 3), "sizes": len(weights), "intervals": sum(weights)}


def paired(c: dict[str, Any], ref: dict[str, Any], key: str = "output_tok_s") -> Optional[dict[str, Any]]:
    """`c`'s `key` over `ref`'s within each repetition both ran (same file, same position: serve.py runs every
    backend of a repetition back to back, in an order rotated by repetition): the geometric mean of those ratios,
    the number of pairs and in how many `c` was the higher. None where they share no repetition."""
    theirs = {r["_pair"]: r.get(key) for r in ref["reps"] if "_pair" in r}
    ratios = [r[key] / theirs[r["_pair"]] for r in c["reps"]
              if r.get(key) and theirs.get(r.get("_pair"))]
    if not ratios:
        return None
    return {"ratio": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3), "pairs": len(ratios),
            "higher": sum(x > 1 for x in ratios)}


def _intervals(c: dict[str, Any]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in c["reps"]:
        for s in r.get("decode_steps", []):
            out.setdefault(s["running"], []).extend([s["step_ms_p50"]] * s["intervals"])
    return out


def _stage_values(c: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Role -> stage -> each repetition's mean ms (serve.py's `stages_ms`; empty for results taken before it was
    recorded)."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in c["reps"]:
        for role, per in (r.get("stages_ms") or {}).items():
            for stage, ms in per.items():
                out.setdefault(role, {}).setdefault(stage, []).append(ms)
    return out


def stages(c: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Role -> stage -> median over the repetitions of the stage's mean ms."""
    return {role: {k: round(statistics.median(v), 3) for k, v in sorted(per.items())}
            for role, per in _stage_values(c).items()}


#: SGLang's stage times the stage table shows (role, stage, heading): where a slow run's first tokens waited
STAGE_COLUMNS = (("prefill", "queue_time", "prefill queue"), ("prefill", "prefill_bootstrap", "prefill bootstrap"),
                 ("prefill", "prefill_forward", "prefill forward"),
                 ("prefill", "prefill_transfer_kv_cache", "prefill transfer"),
                 ("decode", "decode_transferred", "decode transferred"))


def stage_spread(c: dict[str, Any]) -> dict[str, tuple]:
    """Heading -> (median, min, max) over the repetitions of each STAGE_COLUMNS stage's mean ms, so one run's
    outlier stage shows beside the others (empty for results taken before stages were recorded)."""
    values, out = _stage_values(c), {}
    for role, stage, heading in STAGE_COLUMNS:
        xs = values.get(role, {}).get(stage)
        if xs:
            out[heading] = (round(statistics.median(xs), 3), round(min(xs), 3), round(max(xs), 3))
    return out


def running_batch(c: dict[str, Any]) -> Optional[dict[str, float]]:
    """The decode's running batch over every logged interval of the cell's runs (mean and median): a backend
    whose requests reach the decode sooner runs larger batches, and its TPOT is then longer at the same step
    time (`step_ratio` compares the steps at equal batch). None where no run logged one."""
    xs = [n for n, v in _intervals(c).items() for _ in v]
    if not xs:
        return None
    return {"mean": round(sum(xs) / len(xs), 1), "median": statistics.median(xs), "intervals": len(xs)}


#: the prefill's room steps the batch table shows (e2e/room_times.py's gaps, SGLANG_P2P_ROOM_TIMES)
ROOM_GAPS = ("queued->last_queued", "last_queued->picked", "picked->ready", "ready->planned", "planned->launched",
             "ready->launched", "launched->written", "ready->written", "written->concluded", "concluded->seen")


def _median(xs: list[float]) -> Optional[float]:
    """The median of `xs` to three places (ms in these tables), None for none."""
    return round(statistics.median(xs), 3) if xs else None


def room_steps(c: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Over the runs that timed their rooms (`room_times_ms`): the rooms, and the median over the runs of each
    step's median gap (ms), of the copy's device time and the span from its end to its end seen (where copies
    were timed), and of the whole span to Success seen. None where no run did."""
    runs = [r["room_times_ms"] for r in c["reps"] if r.get("room_times_ms")]
    if not runs:
        return None
    return {"rooms": sum(r["rooms"] for r in runs),
            "gaps": {g: _median([r["gaps"][g] for r in runs if g in r["gaps"]]) for g in ROOM_GAPS},
            **{k: _median([r[k] for r in runs if k in r])
               for k in ("cpu_launched", "runq_written", "gpu_copy", "copy_end->written")},
            "host_steps": {g: {k: _median([r["host_steps"][g][k] for r in runs if g in r.get("host_steps", {})])
                               for k in ("wall", "cpu")}
                           for g in {g for r in runs for g in r.get("host_steps", {})}},
            "seen": _median([r["at"]["seen"] for r in runs if "seen" in r["at"]]),
            "concluded_by": _concluded_by([r["concluded_by"] for r in runs if r.get("concluded_by")])}


def _concluded_by(runs: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Over the runs where SGLang's poll concluded rooms (e2e/room_times.py's `concluders`): per concluder, its
    rooms and the median over the runs of their median Success seen (ms), and where any run has them of the poll's
    last look at a running copy, and of the copy's end, to the copy seen done (ms); None where no run had any."""
    if not runs:
        return None
    out = {}
    for who in ("poll", "worker"):
        out[who] = {"rooms": sum(r[who]["rooms"] for r in runs),
                    "seen": _median([r[who]["seen"] for r in runs if r[who]["seen"] is not None])}
        for span in ("looked->written", "copy_end->written"):
            xs = [r[who][span] for r in runs if r[who].get(span) is not None]
            if xs:
                out[who][span] = _median(xs)
    return out


def prefill_spread(c: dict[str, Any]) -> dict[str, Optional[float]]:
    """Over the repetitions (medians): the busiest prefill's share of a run's requests, and the slowest and
    fastest prefill's forward stage (serve.py's `prefills`; empty for results taken before it was recorded)."""
    share, slow, fast = [], [], []
    for r in c["reps"]:
        per = [p for p in r.get("prefills") or [] if p.get("requests") is not None]
        total = sum(p["requests"] for p in per)
        if total:
            share.append(max(p["requests"] for p in per) / total)
        fwd = [p["stages_ms"]["prefill_forward"] for p in per if "prefill_forward" in p.get("stages_ms", {})]
        if fwd:
            slow.append(max(fwd))
            fast.append(min(fwd))
    return {} if not share else {"busiest_share": _median(share), "forward_max_ms": _median(slow),
                                 "forward_min_ms": _median(fast)}


def profiles(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run that carries a py-spy profile of its first prefill (`pyspy_prefill`): per thread, its samples
    and those inside each module serve.py counts (the scheduler thread's share in our plugin against a peer's)."""
    out = []
    for c in cells:
        for i, r in enumerate(c["reps"]):
            prof = r.get("pyspy_prefill")
            if prof is None:
                continue
            row = {"backend": c["backend"], "input_len": c["input_len"], "concurrency": c["concurrency"], "rep": i,
                   "gil": bool(r.get("pyspy_prefill_gil"))}
            out.append(row | ({"error": prof["error"]} if isinstance(prof, dict) else {"threads": [
                {"thread": t["thread"], "samples": t["samples"], "within": t.get("within", {})} for t in prof]}))
    return out


def table(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_key: dict[tuple, dict[str, dict]] = {}
    for c in cells:
        by_key.setdefault((c["cuda_graph"], c["input_len"], c["concurrency"]), {})[c["backend"]] = c
    rows = []
    for (graph, plen, conc), per in sorted(by_key.items()):
        row: dict[str, Any] = {"cuda_graph": graph, "input_len": plen, "concurrency": conc, "backends": {}}
        for b, c in sorted(per.items()):
            row["backends"][b] = {m: med(c, m) for m in METRICS} | {"reps": len(c["reps"]), "stages_ms": stages(c),
                                                                   "stage_spread": stage_spread(c),
                                                                   "prefills": prefill_spread(c),
                                                                   "running_batch": running_batch(c),
                                                                   "room_steps": room_steps(c)}
        p, n = per.get("p2pnccl"), per.get("nixl")
        if p and n:
            ratio = {}
            for m in METRICS:
                a, b = med(p, m)[0], med(n, m)[0]
                ratio[m] = None if a is None or not b else round(a / b, 3)
            row["p2pnccl_over_nixl"] = ratio
            sp, sn = steps(p), steps(n)
            common = sorted(set(sp) & set(sn))
            row["step_ms_same_batch"] = {k: (round(sp[k], 2), round(sn[k], 2)) for k in common[-3:]}
        if p:
            row["p2pnccl_step_ratio"] = {b: step_ratio(p, c) for b, c in sorted(per.items()) if b != "p2pnccl"}
        if n:
            row["over_nixl"] = {b: {"paired_tok_s": paired(c, n), "step": step_ratio(c, n)}
                                for b, c in sorted(per.items()) if b != "nixl"}
        rows.append(row)
    return rows


def _fmt(t: tuple) -> str:
    m, lo, hi = t
    if m is None:
        return "-"
    return f"{m:.1f} ({lo:.1f}-{hi:.1f})" if lo != hi else f"{m:.1f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| graphs | prompt | conc. | backend | reps | tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | E2E p50 ms | KV ms "
           "| tok/s over NIXL's, paired by repetition (higher in) | decode step over NIXL's at equal batch (intervals; "
           "range without one run a side) | p2pnccl's decode step over this one's at equal batch (intervals; range) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for b, v in r["backends"].items():
            vs = (r.get("over_nixl") or {}).get(b) or {}
            pair = vs.get("paired_tok_s")
            cols = [f"{pair['ratio']:.3f} ({pair['higher']} of {pair['pairs']})" if pair else "-",
                    _step(vs.get("step")), _step((r.get("p2pnccl_step_ratio") or {}).get(b))]
            out.append(f"| {'yes' if r['cuda_graph'] else 'no'} | {r['input_len']} | {r['concurrency']} | {b} | {v['reps']} | "
                       + " | ".join([_fmt(v[m]) for m in METRICS] + cols) + " |")
    return "\n".join(out)


def stages_markdown(rows: list[dict[str, Any]]) -> str:
    """SGLang's stage times per cell and backend (median of the runs' means, min-max), or "" where no result
    recorded them."""
    heads = [h for _, _, h in STAGE_COLUMNS]
    out = ["| graphs | prompt | conc. | backend | " + " | ".join(f"{h} ms" for h in heads) + " |",
           "| --- | --- | --- | --- | " + " | ".join("---" for _ in heads) + " |"]
    for r in rows:
        for b, v in r["backends"].items():
            spread = v.get("stage_spread") or {}
            if spread:
                out.append(f"| {'yes' if r['cuda_graph'] else 'no'} | {r['input_len']} | {r['concurrency']} | {b} | "
                           + " | ".join(_fmt(spread.get(h, (None, None, None))) for h in heads) + " |")
    return "\n".join(out) if len(out) > 2 else ""


def batch_markdown(rows: list[dict[str, Any]]) -> str:
    """Per cell and backend: the decode's running batch (mean and median over the logged intervals) and, where
    the prefill timed its rooms, each step's median gap and the span from a room's first chunk queued to its
    Success seen by SGLang's poll; "" where no result holds either."""
    out = ["| graphs | prompt | conc. | backend | decode batch mean (median) | rooms timed | "
           + " | ".join(f"{g} ms" for g in ROOM_GAPS) + " | worker CPU ready->launched ms | worker run-queue wait ready->written ms | "
           "queued->seen ms | rooms concluded by the poll / its workers (queued->seen ms) |",
           "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in ROOM_GAPS) + " | ---" * 4 + " |"]
    for r in rows:
        for b, v in r["backends"].items():
            batch, rooms = v.get("running_batch"), v.get("room_steps")
            if not batch and not rooms:
                continue
            cols = [f"{batch['mean']:.1f} ({batch['median']:g})" if batch else "-", str(rooms["rooms"]) if rooms else "-"]
            cols += [_ms((rooms or {}).get("gaps", {}).get(g)) for g in ROOM_GAPS]
            cols += [_ms((rooms or {}).get(k)) for k in ("cpu_launched", "runq_written", "seen")]
            by = (rooms or {}).get("concluded_by")
            cols.append(" / ".join(f"{by[w]['rooms']} ({_ms(by[w]['seen'])})" for w in ("poll", "worker"))
                        if by else "-")
            out.append(f"| {'yes' if r['cuda_graph'] else 'no'} | {r['input_len']} | {r['concurrency']} | {b} | "
                       + " | ".join(cols) + " |")
    return "\n".join(out) if len(out) > 2 else ""


def host_steps_markdown(rows: list[dict[str, Any]]) -> str:
    """Per cell and backend that timed its rooms' writes step by step: each host step's wall and CPU ms on the
    thread that queued the copy (medians over the runs of the runs' medians); "" where none did."""
    gaps = [f"{a}->{b}" for a, b in zip(room_times.HOST_STEPS, room_times.HOST_STEPS[1:])]
    out = ["| graphs | prompt | conc. | backend | " + " | ".join(f"{g} wall / CPU ms" for g in gaps) + " |",
           "| --- | --- | --- | --- | " + " | ".join("---" for _ in gaps) + " |"]
    for r in rows:
        for b, v in r["backends"].items():
            host = (v.get("room_steps") or {}).get("host_steps")
            if not host:
                continue
            cols = [f"{_ms(host[g]['wall'])} / {_ms(host[g]['cpu'])}" if g in host else "-" for g in gaps]
            out.append(f"| {'yes' if r['cuda_graph'] else 'no'} | {r['input_len']} | {r['concurrency']} | {b} | "
                       + " | ".join(cols) + " |")
    return "\n".join(out) if len(out) > 2 else ""


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def _step(s: Optional[dict[str, Any]]) -> str:
    if not s:
        return "-"
    spread = s.get("without_one")
    return f"{s['ratio']:.3f} ({s['intervals']}" + (f"; {spread[0]:.3f}-{spread[1]:.3f})" if spread else ")")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_tok_s", "output tok/s"), ("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"),
              ("kv_ms", "KV transfer (ms)")]
    modes = sorted({r["cuda_graph"] for r in rows})
    fig, axes = plt.subplots(len(modes), len(panels), figsize=(4.2 * len(panels), 3.4 * len(modes)), squeeze=False)
    for i, graph in enumerate(modes):
        sub = [r for r in rows if r["cuda_graph"] == graph]
        labels = [f"{r['input_len'] // 1024}k/{r['concurrency']}" for r in sub]
        backends = sorted({b for r in sub for b in r["backends"]})
        width = 0.8 / max(1, len(backends))
        for j, (metric, title) in enumerate(panels):
            ax = axes[i][j]
            for k, b in enumerate(backends):
                xs, ys, lo, hi = [], [], [], []
                for x, r in enumerate(sub):
                    m, mn, mx = r["backends"].get(b, {}).get(metric, (None, None, None))
                    if m is not None:
                        xs.append(x + (k - (len(backends) - 1) / 2) * width)
                        ys.append(m)
                        lo.append(m - mn)
                        hi.append(mx - m)
                ax.bar(xs, ys, width, yerr=[lo, hi], label=b, capsize=2, color=COLORS.get(b))
            ax.set_xticks(range(len(sub)), labels, fontsize=8)
            ax.set_title(f"{title}, {'decode graphs' if graph else 'no graphs'}", fontsize=9)
            if metric != "output_tok_s":
                ax.set_yscale("log")
        axes[i][0].legend(fontsize=8)
    fig.supxlabel("prompt tokens / concurrency; bars: median of repetitions, whiskers: min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    machines, cells = load(a.results)
    rows = table(cells)
    if a.markdown:
        print(f"Machine: {', '.join(machines)}\n")
        print(markdown(rows))
        stage_table = stages_markdown(rows)
        if stage_table:
            print(f"\nSGLang's stage times (median of the runs' means, min-max):\n\n{stage_table}")
        batch_table = batch_markdown(rows)
        if batch_table:
            print(f"\nThe decode's running batch, and the prefill's room steps where it timed them (medians over the "
                  f"runs):\n\n{batch_table}")
        host_table = host_steps_markdown(rows)
        if host_table:
            print(f"\nThe write's host steps on the thread that queued the copy (wall / CPU, medians over the runs):"
                  f"\n\n{host_table}")
        for p in profiles(cells):
            what = "the GIL's holder, first prefill" if p["gil"] else "first prefill"
            print(f"\npy-spy, {what} of {p['backend']} {p['input_len']}x{p['concurrency']} (repetition "
                  f"{p['rep']}): " + (p.get("error") or "; ".join(
                      f"{t['thread']} {t['samples']} samples, " + ", ".join(f"{k} {v}" for k, v in t["within"].items())
                      for t in p["threads"])))
    else:
        print(json.dumps({"machines": machines, "rows": rows, "profiles": profiles(cells)}, indent=1))
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
