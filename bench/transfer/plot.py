"""PNG of a transfer benchmark JSON: GB/s by request size per layout and method, and the per-communicator
memory/bandwidth trade by channel cap.

    python -m bench.transfer.plot bench/results/transfer_<machine>.json
"""

from __future__ import annotations

import json
import sys

_STYLE = {"engine": "-o", "contiguous": "--", "per_page": ":x", "per_page_group": ":+"}


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r["layout"] for r in res.get("transfers", []) if "layout" in r})
    fig, axes = plt.subplots(1, len(layouts) + 1, figsize=(6 * (len(layouts) + 1), 4.8))
    axes = list(axes) if len(layouts) else [axes]
    for ax, lay in zip(axes, layouts):
        rows = [r for r in res["transfers"] if r.get("layout") == lay and r.get("cap") == 16]
        for mode in sorted({r.get("mode", "nonblocking") for r in rows}):
            for method, style in _STYLE.items():
                sel = [r for r in rows if r["method"] == method and r.get("mode", "nonblocking") == mode]
                for ps in sorted({r["page_size"] for r in sel}):
                    if method == "contiguous" and ps != min(r["page_size"] for r in sel):
                        continue  # same bytes for every page size: one line
                    pts = sorted((r["tokens"], r["gbps_p50"]) for r in sel if r["page_size"] == ps)
                    label = f"{method} ({mode})" + ("" if method == "contiguous" else f" page {ps}")
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label,
                            alpha=1.0 if mode == "split" else 0.6)
        ax.axhline(300, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("request tokens")
        ax.set_ylabel("GB/s (p50, send() to decode Success)")
        ax.set_title(f"{lay.upper()}, 16-channel communicator")
        ax.legend(fontsize=7)
    ax = axes[-1]
    for key, style, label in (("comm_cost", "-o", "cuMem on"), ("comm_cost_cumem0", "--s", "NCCL_CUMEM_ENABLE=0")):
        rows = res.get(key) or []
        if rows:
            xs = [str(r["cap"] or "default") for r in rows]
            ax.plot(xs, [r["mb_decode"] for r in rows], style, label=f"decode MB per extra comm ({label})")
            ax.plot(xs, [r["mb_prefill"] for r in rows], style, alpha=0.5, label=f"prefill MB ({label})")
    ax.set_ylabel("MB")
    ax.set_xlabel("channel cap")
    if res.get("comm_cost"):
        ax2 = ax.twinx()
        ax2.plot([str(r["cap"] or "default") for r in res["comm_cost"]], [r["gbps"] for r in res["comm_cost"]],
                 "-^", color="tab:red", label="GB/s (1 GiB send)")
        ax2.set_ylabel("GB/s")
        ax2.legend(loc="lower right", fontsize=7)
    ax.legend(loc="upper left", fontsize=7)
    m = res.get("machine", {})
    ax.set_title("per extra communicator")
    fig.suptitle(f"{m.get('gpu', '?')} x{m.get('gpus', '?')}, NCCL {m.get('nccl', '?')}, torch {m.get('torch', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    src = sys.argv[1]
    with open(src) as f:
        plot(json.load(f), src.rsplit(".", 1)[0] + ".png")
