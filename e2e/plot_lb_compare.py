"""Plot an e2e/lb_compare.py result: per workload, each LB's TTFT p50 and p99 (median over the repetitions,
whiskers from min to max), E2E p99 and output tok/s, with the cache hit rate over the bars; then the servers'
side: the prefill imbalance (busiest prefill's mean queue + running over the prefills' mean, 1 = even), the
largest prefill queue seen, the decode imbalance and the requests waiting in the decodes' PD queues (empty for
results from before lb_compare sampled them); last, TTFT p99 by second of the run (the median over the
repetitions of each second's p99, by when the requests were sent), where a run's slow requests were.

    python3 -m e2e.plot_lb_compare RESULT.json [OUT.png]     (default: RESULT.png)
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Optional

try:
    from e2e.results import load as load_result
except ImportError:  # run as a script from e2e/
    from results import load as load_result  # type: ignore[no-redef]

PANELS = (("ttft_ms_p50", "TTFT p50 (ms)"), ("ttft_ms_p99", "TTFT p99 (ms)"), ("e2e_ms_p99", "E2E p99 (ms)"), ("output_throughput", "output tok/s"),
          ("prefill_imbalance", "prefill imbalance (max/mean)"), ("prefill_queue_max", "max prefill queue"),
          ("decode_imbalance", "decode imbalance (max/mean)"), ("decode_pd_queue_mean", "waiting in decodes' PD queues"))


def bars(agg: dict[str, Any], workload: str, figure: str) -> tuple[list[str], list[float], list[tuple[float, float]]]:
    """LB names, medians and (below, above) whisker lengths of one figure of one workload."""
    names, med, err = [], [], []
    for name, by_wl in agg.items():
        cell: Optional[dict] = (by_wl.get(workload) or {}).get(figure)
        if cell is None:
            continue
        names.append(name)
        med.append(cell["median"])
        err.append((cell["median"] - cell["min"], cell["max"] - cell["median"]))
    return names, med, err


def timelines(doc: dict[str, Any], workload: str) -> dict[str, tuple[list[float], list[float]]]:
    """Per LB: the seconds of its runs and, for each, the median over the repetitions of that second's TTFT p99
    (`ttft_timeline` of each run; none in results from before lb_compare recorded it)."""
    out = {}
    for name, by_wl in (doc.get("runs") or {}).items():
        per_sec: dict[float, list[float]] = {}
        for run in by_wl.get(workload) or []:
            for sec, _n, _p50, p99 in run.get("ttft_timeline") or []:
                per_sec.setdefault(sec, []).append(p99)
        if per_sec:
            secs = sorted(per_sec)
            out[name] = (secs, [statistics.median(per_sec[t]) for t in secs])
    return out


def plot(doc: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = doc.get("aggregate") or {}
    workloads = list((doc.get("plan") or {}).get("workloads") or [])
    if not agg or not workloads:
        raise SystemExit("no aggregate figures in this result (did the comparison run?)")
    fig, axes = plt.subplots(len(workloads), len(PANELS) + 1, figsize=(4.2 * (len(PANELS) + 1), 3.2 * len(workloads)),
                             squeeze=False)
    for r, wl in enumerate(workloads):
        for c, (key, label) in enumerate(PANELS):
            ax = axes[r][c]
            names, med, err = bars(agg, wl, key)
            colors = ["tab:blue" if n.startswith("ours:") else "tab:gray" for n in names]
            ax.bar(range(len(names)), med, yerr=list(zip(*err)) if err else None, color=colors, capsize=3)
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
            ax.set_title(f"{wl}: {label}", fontsize=9)
            if c == 0:
                hits = dict(zip(*bars(agg, wl, "cache_hit_rate")[:2]))
                for i, n in enumerate(names):
                    if hits.get(n) is not None:
                        ax.annotate(f"hit {hits[n]:.2f}", (i, med[i]), ha="center", va="bottom", fontsize=6)
        ax = axes[r][len(PANELS)]
        for name, (secs, p99) in timelines(doc, wl).items():
            ax.plot(secs, p99, label=name, lw=1.6 if name.startswith("ours:") else 1.0)
        ax.set_title(f"{wl}: TTFT p99 (ms) by second sent", fontsize=9)
        ax.set_xlabel("second of the run", fontsize=7)
        if ax.lines:
            ax.legend(fontsize=6)
    reps = "/".join(str(n) for n in sorted(set((doc.get("reps_compared") or {}).values()))) or (doc.get("plan") or {}).get("reps")
    fig.suptitle(f"LB comparison, {doc.get('topology')} ({doc.get('servers', '')}), median of {reps} runs of {(doc.get('plan') or {}).get('run_s')} s, whiskers min-max", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    _palette(out)


def _palette(path: Path) -> None:
    """Re-save as a 128-colour palette PNG (a third of the size, the same chart): the committed results travel
    with every device call, whose 64 MiB the SGLang archive nearly fills (docs/e2e.md). Pillow comes with
    matplotlib."""
    from PIL import Image

    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=128)
    small.save(path, optimize=True)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    src = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else Path(str(src).removesuffix(".gz")).with_suffix(".png")
    plot(load_result(src), out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
