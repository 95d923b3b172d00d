"""End-to-end check of the p2pnccl backend with real SGLang on a 2-GPU host (issue 8).

Entry point: ``bash e2e/run_all.sh`` (see docs/e2e.md). The Python modules here are run from the repository
root as ``python3 -m e2e.<module>``; only ``compare``, ``stats``, ``promparse``, ``results`` and ``report`` are
free of I/O and are unit-tested on CPU in tests/e2e/.
"""
