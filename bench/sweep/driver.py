"""One sweep: preflight, the tools' runs, the common rows, CSV/JSON and plots.

Output folder layout::

    OUT/sweep.csv, OUT/sweep.json        one row per tool x scenario x concurrency (records.COLUMNS)
    OUT/plots/*.png                      plots.plot_all
    OUT/raw/genai-bench/<n..>/           genai-bench's own output (run JSONs, xlsx, its plots)
    OUT/raw/evalscope/<scenario>/c<C>/   evalscope's own output (summary, percentiles, SQLite, html)
    OUT/logs/*.log                       each tool invocation's filtered output
"""
from __future__ import annotations

import datetime as dt
import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from . import evalscope_perf, genai_bench
from .errors import SweepError
from .make_tokenizer import build as build_tokenizer
from .preflight import check_target, check_tokenizer, find_tool
from .records import SweepRow, write_csv, write_json
from .scenarios import Scenario, requests_for
from .slo import Slo
from .tools import redact, run_tool

TOOLS = (genai_bench.TOOL, evalscope_perf.TOOL)


@dataclass
class SweepConfig:
    target: str
    out: Path
    tokenizer: str | None
    scenarios: list[Scenario]
    concurrency: list[int]
    tools: list[str] = field(default_factory=lambda: list(TOOLS))
    model: str | None = None
    api_key: str = "dummy"
    requests_per_user: int = 4
    min_requests: int = 16
    max_minutes_per_run: int = 10
    slo: Slo = field(default_factory=Slo)
    tools_bin: Path | None = None
    genai_bench_args: str = ""
    evalscope_args: str = ""
    dry_run: bool = False
    command: str = ""  # how the sweep was started, kept in sweep.json


def prepare_tokenizer(spec: str | None, out: Path) -> Path:
    """``local`` builds the offline tokenizer into OUT/tokenizer; anything else must be a local folder."""
    if spec == "local":
        return build_tokenizer(out / "tokenizer").resolve()
    return check_tokenizer(spec)


def _check_specs_unique(scenarios: Sequence[Scenario]) -> None:
    # genai-bench records only D(in,out): two names with one shape could not be told apart in its output
    specs = [s.genai_bench_spec for s in scenarios]
    if len(set(specs)) != len(specs):
        raise SweepError(f"two scenarios have the same shape: {specs}")


def run_genai_bench(cfg: SweepConfig, tok: Path, model: str, say: Callable[[str], None]) -> list[SweepRow]:
    exe = find_tool("genai-bench", cfg.tools_bin)
    base = cfg.out / "raw" / "genai-bench"
    for inv in genai_bench.plan(cfg.concurrency, cfg.requests_per_user, cfg.min_requests):
        cmd = genai_bench.command(
            exe, base_url=cfg.target, model=model, tokenizer=str(tok), api_key=cfg.api_key,
            scenarios=cfg.scenarios, inv=inv, max_minutes=cfg.max_minutes_per_run, base_dir=base,
            log_dir=cfg.out / "logs" / "genai-bench-internal", extra=shlex.split(cfg.genai_bench_args),
        )
        say(f"genai-bench: concurrency {list(inv.concurrencies)}, {inv.max_requests} requests per run")
        if cfg.dry_run:
            say("  " + redact(cmd, cfg.api_key))
            continue
        # generous wall limit: every (scenario, concurrency) run may take max_minutes, plus start-up
        limit = 60.0 * (cfg.max_minutes_per_run * len(cfg.scenarios) * len(inv.concurrencies) + 2)
        run_tool(cmd, cfg.out / "logs" / f"genai-bench_{inv.folder}.log", cfg.api_key, limit)
        genai_bench.scrub_api_key(base, cfg.api_key)
    return [] if cfg.dry_run else genai_bench.read_results(base, cfg.scenarios, cfg.slo)


def run_evalscope(cfg: SweepConfig, tok: Path, model: str, say: Callable[[str], None]) -> list[SweepRow]:
    exe = find_tool("evalscope", cfg.tools_bin)
    base = cfg.out / "raw" / "evalscope"
    for s in cfg.scenarios:
        for c in cfg.concurrency:
            n = requests_for(c, cfg.requests_per_user, cfg.min_requests)
            cmd = evalscope_perf.command(
                exe, base_url=cfg.target, model=model, tokenizer=str(tok), api_key=cfg.api_key, scenario=s,
                concurrency=c, number=n, base_dir=base, extra=shlex.split(cfg.evalscope_args),
            )
            say(f"evalscope: {s.name} concurrency {c}, {n} requests")
            if cfg.dry_run:
                say("  " + redact(cmd, cfg.api_key))
                continue
            run_tool(cmd, cfg.out / "logs" / f"evalscope_{s.name}_c{c}.log", cfg.api_key,
                     60.0 * (cfg.max_minutes_per_run + 2))
    return [] if cfg.dry_run else evalscope_perf.read_results(base, cfg.slo)


RUNNERS = {genai_bench.TOOL: run_genai_bench, evalscope_perf.TOOL: run_evalscope}


def finish(rows: list[SweepRow], meta: dict[str, Any], out: Path, slo: Slo) -> list[Path]:
    """Write sweep.csv, sweep.json and the plots; shared by a fresh sweep and a re-plot."""
    # matplotlib only when there is something to draw: the rest of the package imports without it
    from .plots import plot_all

    write_csv(rows, out / "sweep.csv")
    write_json(rows, meta, out / "sweep.json")
    return [out / "sweep.csv", out / "sweep.json", *plot_all(rows, slo, out / "plots")]


def run_sweep(cfg: SweepConfig, say: Callable[[str], None] = print) -> list[Path]:
    unknown = set(cfg.tools) - set(RUNNERS)
    if unknown:
        raise SweepError(f"unknown tool(s) {sorted(unknown)}; choose from {list(RUNNERS)}")
    _check_specs_unique(cfg.scenarios)
    if (cfg.out / "raw").exists() and any((cfg.out / "raw").iterdir()) and not cfg.dry_run:
        raise SweepError(f"{cfg.out} already holds a sweep; pick a new --out (tools refuse to overwrite runs)")
    models = [] if cfg.dry_run else check_target(cfg.target)
    model = cfg.model or (models[0] if models else "default")
    tok = prepare_tokenizer(cfg.tokenizer, cfg.out)
    for tool in cfg.tools:
        find_tool(tool, cfg.tools_bin)  # fail before the first run, not after an hour of the other tool
    rows: list[SweepRow] = []
    for tool in cfg.tools:
        rows += RUNNERS[tool](cfg, tok, model, say)
    if cfg.dry_run:
        return []
    meta = {
        "command": cfg.command, "target": cfg.target, "model": model, "tokenizer": str(tok),
        "scenarios": [asdict(s) for s in cfg.scenarios], "concurrency": cfg.concurrency,
        "tools": cfg.tools, "requests_per_user": cfg.requests_per_user, "min_requests": cfg.min_requests,
        "slo": {"ttft_s": cfg.slo.ttft_s, "itl_s": cfg.slo.itl_s},
        "finished_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return finish(rows, meta, cfg.out, cfg.slo)


def replot(out: Path, scenarios: Sequence[Scenario], slo: Slo) -> list[Path]:
    """Re-read OUT/raw (e.g. after changing the SLOs) and rewrite the CSV/JSON/plots."""
    rows: list[SweepRow] = []
    for tool, reader in ((genai_bench.TOOL, lambda b: genai_bench.read_results(b, scenarios, slo)),
                         (evalscope_perf.TOOL, lambda b: evalscope_perf.read_results(b, slo))):
        base = out / "raw" / tool
        if base.exists():
            rows += reader(base)
    if not rows:
        raise SweepError(f"no tool output under {out / 'raw'}")
    old = out / "sweep.json"
    meta = json.loads(old.read_text()).get("meta", {}) if old.exists() else {}
    meta["slo"] = {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}
    return finish(rows, meta, out, slo)
