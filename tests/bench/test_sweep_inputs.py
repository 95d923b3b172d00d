"""Scenario / concurrency parsing, SLO goodput, and the tools' command lines."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sweep import evalscope_perf, genai_bench
from bench.sweep.scenarios import NAMED, Scenario, parse_concurrency, parse_scenarios, requests_for
from bench.sweep.slo import RequestSample, Slo, goodput, is_good
from bench.sweep.tools import redact, tool_env


def test_named_and_custom_scenarios() -> None:
    got = parse_scenarios("short, long,chat=D(300,75),D(10,2)")
    assert [s.name for s in got] == ["short", "long", "chat", "D10_2"]
    assert got[0] == NAMED["short"] and got[0].input_tokens < 128
    assert got[2] == Scenario("chat", 300, 75)
    assert got[2].genai_bench_spec == "D(300,75)"
    # the source material's workloads keep input:output = 4:1
    assert all(s.input_tokens == 4 * s.output_tokens for s in NAMED.values())


@pytest.mark.parametrize("bad", ["huge", "x=D(0,5)", "N(480,240)/(300,150)", "short,short", ""])
def test_bad_scenarios_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_scenarios(bad)


def test_concurrency_lists_and_ranges() -> None:
    assert parse_concurrency("1-256") == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert parse_concurrency("8,1,3-12") == [1, 3, 6, 8, 12]
    for bad in ("0", "4-2", "", "a"):
        with pytest.raises(ValueError):
            parse_concurrency(bad)
    assert requests_for(1, 4, 16) == 16 and requests_for(64, 4, 16) == 256


def test_goodput_counts_only_requests_within_both_slos() -> None:
    slo = Slo(ttft_s=2.0, itl_s=0.05)
    samples = [
        RequestSample(True, 0.5, 0.02, 100),   # good
        RequestSample(True, 2.5, 0.02, 100),   # TTFT too slow
        RequestSample(True, 0.5, 0.08, 100),   # ITL too slow
        RequestSample(False, 0.1, 0.01, 100),  # failed
        RequestSample(True, 1.0, None, 1),     # single token: only TTFT applies
        RequestSample(True, None, 0.01, 50),   # no first token recorded
    ]
    assert [is_good(s, slo) for s in samples] == [True, False, False, False, True, False]
    g = goodput(samples, duration_s=2.0, slo=slo)
    assert g.attainment == pytest.approx(2 / 6)
    assert g.requests_per_s == pytest.approx(1.0)
    assert g.output_tokens_per_s == pytest.approx(101 / 2)
    assert goodput([], 1.0, slo).attainment == 0.0


def test_genai_bench_plan_groups_concurrencies_with_equal_request_counts() -> None:
    plan = genai_bench.plan([1, 2, 4, 8, 16], requests_per_user=4, min_requests=16)
    assert [(p.concurrencies, p.max_requests) for p in plan] == [((1, 2, 4), 16), ((8,), 32), ((16,), 64)]
    assert len({p.folder for p in plan}) == len(plan)


def test_genai_bench_command(tmp_path: Path) -> None:
    inv = genai_bench.Invocation("n16_c1-2", (1, 2), 16)
    cmd = genai_bench.command(
        "genai-bench", base_url="http://h:8000", model="m", tokenizer="/tok", api_key="k",
        scenarios=[NAMED["short"], NAMED["long"]], inv=inv, max_minutes=3, base_dir=tmp_path, log_dir=tmp_path,
    )
    # genai-bench rejects --api-key unless --api-backend came first
    assert cmd.index("--api-backend") < cmd.index("--api-key")
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--num-concurrency"] == ["1", "2"]
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--traffic-scenario"] == ["D(100,25)", "D(2000,500)"]
    assert cmd[cmd.index("--max-requests-per-run") + 1] == "16"
    assert cmd[cmd.index("--model-tokenizer") + 1] == "/tok"


def test_evalscope_command(tmp_path: Path) -> None:
    cmd = evalscope_perf.command(
        "evalscope", base_url="http://h:8000", model="m", tokenizer="/tok", api_key="k",
        scenario=NAMED["mid"], concurrency=32, number=128, base_dir=tmp_path,
    )
    arg = lambda k: cmd[cmd.index(k) + 1]  # noqa: E731
    assert arg("--url") == "http://h:8000/v1/chat/completions"
    assert (arg("--min-prompt-length"), arg("--max-prompt-length"), arg("--max-tokens")) == ("512", "512", "128")
    assert (arg("--parallel"), arg("--number"), arg("--warmup-num")) == ("32", "128", "32")
    assert arg("--dataset") == "random"  # never the default dataset, which downloads
    assert json.loads(arg("--extra-args")) == {"ignore_eos": True}
    assert arg("--outputs-dir") == str(tmp_path / "mid") and arg("--name") == "c32"


def test_tool_env_is_offline_and_isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/.deps/sglang-0.5.23")
    env = tool_env("secret")
    assert "PYTHONPATH" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and env["ENABLE_UI"] == "false"
    assert "secret" not in redact(["x", "--api-key", "secret"], "secret")
