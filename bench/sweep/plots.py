"""PNG plots of a sweep from its rows (no I/O besides writing the PNGs).

One column per tool, one colour per scenario, x = concurrency on a log2 axis:
* ``throughput_vs_concurrency.png``: output tok/s (solid) and input tok/s (dashed);
* ``ttft_vs_concurrency.png``: TTFT p50 (solid) and p99 (dashed), SLO as a red line;
* ``itl_tpot_vs_concurrency.png``: ITL and TPOT p50/p99, ITL SLO as a red line;
* ``goodput_vs_concurrency.png``: goodput tok/s under the SLOs (solid) against all output tok/s (faint),
  and the share of requests that met the SLOs.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import matplotlib

matplotlib.use("Agg")  # headless: CI and GPU login nodes have no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator  # noqa: E402

from .records import SweepRow  # noqa: E402
from .slo import Slo  # noqa: E402

Series = dict[str, list[SweepRow]]  # scenario -> rows sorted by concurrency
Getter = Callable[[SweepRow], float]


def _by_tool(rows: Sequence[SweepRow]) -> dict[str, Series]:
    out: dict[str, Series] = defaultdict(lambda: defaultdict(list))
    for r in sorted(rows, key=lambda r: r.concurrency):
        out[r.tool][r.scenario].append(r)
    return out


def _colors(rows: Sequence[SweepRow]) -> dict[str, str]:
    names = sorted({r.scenario for r in rows})
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {n: cycle[i % len(cycle)] for i, n in enumerate(names)}


def _conc_axis(ax: Axes, rows: Sequence[SweepRow]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted({r.concurrency for r in rows})
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    if len(ticks) == 1:  # a single point needs some room either side
        ax.set_xlim(ticks[0] / 1.5, ticks[0] * 1.5)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.grid(True, which="major", alpha=0.3)


def _lines(ax: Axes, series: Series, colors: dict[str, str],
           curves: Sequence[tuple[str, Getter, dict]]) -> None:
    for scenario, rs in sorted(series.items()):
        xs = [r.concurrency for r in rs]
        for label, get, style in curves:
            ys = [get(r) for r in rs]
            if all(math.isnan(y) for y in ys):
                continue
            ax.plot(xs, ys, marker="o", markersize=4, color=colors[scenario],
                    label=f"{scenario} {label}".strip(), **style)


def _figure(rows: Sequence[SweepRow], nrows: int, title: str) -> tuple[plt.Figure, list[list[Axes]], list[str]]:
    tools = sorted({r.tool for r in rows})
    fig, axes = plt.subplots(nrows, len(tools), figsize=(6.4 * len(tools), 4.2 * nrows), squeeze=False)
    fig.suptitle(title, fontsize=13)
    return fig, axes, tools


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _slo_line(ax: Axes, y: float, label: str) -> None:
    ax.axhline(y, color="red", linestyle=":", linewidth=1.5, label=label)


SOLID, DASHED, FAINT = {"linestyle": "-"}, {"linestyle": "--"}, {"linestyle": "--", "alpha": 0.35}


def plot_throughput(rows: Sequence[SweepRow], path: Path) -> Path:
    fig, axes, tools = _figure(rows, 1, "Throughput vs concurrency (solid: output, dashed: input)")
    colors, data = _colors(rows), _by_tool(rows)
    for j, tool in enumerate(tools):
        ax = axes[0][j]
        _lines(ax, data[tool], colors, [("output", lambda r: r.output_throughput, SOLID),
                                        ("input", lambda r: r.input_throughput, DASHED)])
        ax.set_title(tool)
        ax.set_ylabel("tokens / s (whole server)")
        ax.set_ylim(bottom=0)
        _conc_axis(ax, rows)
        ax.legend(fontsize=8, handlelength=3.5)
    return _save(fig, path)


def plot_ttft(rows: Sequence[SweepRow], slo: Slo, path: Path) -> Path:
    fig, axes, tools = _figure(rows, 1, "Time to first token vs concurrency (solid: p50, dashed: p99)")
    colors, data = _colors(rows), _by_tool(rows)
    for j, tool in enumerate(tools):
        ax = axes[0][j]
        _lines(ax, data[tool], colors, [("p50", lambda r: r.ttft_ms_p50, SOLID),
                                        ("p99", lambda r: r.ttft_ms_p99, DASHED)])
        _slo_line(ax, slo.ttft_s * 1e3, f"SLO {slo.ttft_s:g} s")
        ax.set_yscale("log")
        ax.set_title(tool)
        ax.set_ylabel("TTFT (ms, log scale)")
        _conc_axis(ax, rows)
        ax.legend(fontsize=8, handlelength=3.5)
    return _save(fig, path)


def plot_itl_tpot(rows: Sequence[SweepRow], slo: Slo, path: Path) -> Path:
    fig, axes, tools = _figure(rows, 2, "Inter-token latency and TPOT vs concurrency (solid: p50, dashed: p99)")
    colors, data = _colors(rows), _by_tool(rows)
    panels = [
        ("ITL (ms)", lambda r: r.itl_ms_p50, lambda r: r.itl_ms_p99),
        ("TPOT (ms)", lambda r: r.tpot_ms_p50, lambda r: r.tpot_ms_p99),
    ]
    for j, tool in enumerate(tools):
        for i, (label, p50, p99) in enumerate(panels):
            ax = axes[i][j]
            _lines(ax, data[tool], colors, [("p50", p50, SOLID), ("p99", p99, DASHED)])
            _slo_line(ax, slo.itl_s * 1e3, f"ITL SLO {slo.itl_s * 1e3:g} ms")
            note = " (genai-bench: per-request mean ITL = TPOT)" if tool == "genai-bench" and i == 0 else ""
            ax.set_title(f"{tool}: {label.split()[0]}{note}", fontsize=10)
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            _conc_axis(ax, rows)
            ax.legend(fontsize=8, handlelength=3.5)
    return _save(fig, path)


def plot_goodput(rows: Sequence[SweepRow], slo: Slo, path: Path) -> Path:
    title = f"Goodput under SLOs (TTFT <= {slo.ttft_s:g} s, ITL <= {slo.itl_s * 1e3:g} ms)"
    fig, axes, tools = _figure(rows, 2, title)
    colors, data = _colors(rows), _by_tool(rows)
    for j, tool in enumerate(tools):
        ax = axes[0][j]
        _lines(ax, data[tool], colors, [("goodput", lambda r: r.goodput_tok_s, SOLID),
                                        ("all output", lambda r: r.output_throughput, FAINT)])
        ax.set_title(f"{tool}: output tok/s of requests meeting the SLOs", fontsize=10)
        ax.set_ylabel("tokens / s")
        ax.set_ylim(bottom=0)
        _conc_axis(ax, rows)
        ax.legend(fontsize=8, handlelength=3.5)
        ax = axes[1][j]
        _lines(ax, data[tool], colors, [("", lambda r: 100.0 * r.slo_attainment, SOLID)])
        ax.set_title(f"{tool}: share of requests meeting the SLOs", fontsize=10)
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(-3, 103)
        _conc_axis(ax, rows)
        ax.legend(fontsize=8, handlelength=3.5)
    return _save(fig, path)


def plot_all(rows: Sequence[SweepRow], slo: Slo, out_dir: Path) -> list[Path]:
    if not rows:
        raise ValueError("no rows to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_throughput(rows, out_dir / "throughput_vs_concurrency.png"),
        plot_ttft(rows, slo, out_dir / "ttft_vs_concurrency.png"),
        plot_itl_tpot(rows, slo, out_dir / "itl_tpot_vs_concurrency.png"),
        plot_goodput(rows, slo, out_dir / "goodput_vs_concurrency.png"),
    ]
