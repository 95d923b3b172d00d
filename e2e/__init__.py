"""End-to-end check of the p2pnccl backend with real SGLang on a 2-GPU host.

Entry point: ``bash e2e/run_all.sh`` (see docs/e2e.md); archives from ``bash e2e/build_bundle.sh``. The Python
modules run from the repository root as ``python3 -m e2e.<module>``. Steps: ``check`` (PD vs a non-PD server),
``sglang_tests`` (SGLang's own PD tests), ``perf`` (p2pnccl vs Mooncake); ``results`` merges them and ``report``
renders the tables. ``compare``, ``stats``, ``promparse``, ``results``, ``report``, ``distinfo`` and ``slim_oci``
do no network or GPU work and are unit-tested on CPU in tests/e2e/, the rest against fake servers there.
"""
