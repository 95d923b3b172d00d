"""Concurrency sweeps of an OpenAI-compatible LB or server with genai-bench and evalscope perf.

Run ``python -m bench.sweep --help`` (or ``bash bench/sweep/run.sh``, which also builds the tools' own
venv).  Modules: ``scenarios`` (named workloads), ``slo`` (goodput), ``records`` (the common row schema and
CSV/JSON output), ``genai_bench`` / ``evalscope_perf`` (command lines, runs and result readers),
``plots``, ``preflight`` (target / tokenizer / tool checks), ``make_tokenizer`` (offline tokenizer),
``local_stack`` (simulated P/D workers + LB on loopback), ``cli``.
"""
