"""pytest plugin (``-p e2e.sglang_pd_plugin``) that lets SGLang's own PD tests run on the lent GPU host.

What it changes, and why, before the test modules are imported:
* the test model names (``meta-llama/...``, a download) -> the local tiny model in ``E2E_TEST_MODEL``;
* every server the PD fixture launches gets ``E2E_TEST_EXTRA_ARGS`` appended (triton attention, pytorch
  sampling, no CUDA graphs: the bundle's slim sglang-kernel has no FlashAttention-3 library, which SGLang would
  pick by default on Hopper). argparse keeps the last value, so these win over nothing the tests set themselves.
* if ``datasets`` does not import on the host, a stand-in: ``sglang.test.test_utils`` imports
  ``sglang.benchmark`` (an MMMU loader does ``from datasets import load_dataset``) at module level, and the PD
  tests never load a dataset. The bundle carries the real package; the stand-in only covers a host whose
  pyarrow/fsspec it does not import with, and says so on stderr.
The transfer backend comes from SGLang's own switch, ``SGLANG_TEST_PD_DISAGG_BACKEND`` (set by the runner).
"""
from __future__ import annotations

import os
import shlex
import sys
import types


def _datasets_stand_in() -> None:
    try:
        import datasets  # noqa: F401
    except Exception as e:  # ImportError, or a version check of its dependencies
        mod = types.ModuleType("datasets")
        why = f"{type(e).__name__}: {e}"  # `e` is unbound once the except block ends

        def load_dataset(*args, **kwargs):
            raise RuntimeError(f"e2e stand-in: the real `datasets` did not import here ({why})")

        mod.load_dataset = load_dataset
        sys.modules["datasets"] = mod
        print(f"e2e.sglang_pd_plugin: `datasets` stand-in in use ({why})", file=sys.stderr)


def _patch() -> None:
    _datasets_stand_in()
    from sglang.test import test_utils
    from sglang.test.server_fixtures import disaggregation_fixture as fx

    model = os.environ["E2E_TEST_MODEL"]
    for name in ("DEFAULT_MODEL_NAME_FOR_TEST", "DEFAULT_SMALL_MODEL_NAME_FOR_TEST"):
        setattr(test_utils, name, model)
    extra = shlex.split(os.environ.get("E2E_TEST_EXTRA_ARGS", ""))
    original = fx.popen_launch_pd_server

    def launch(model: str, base_url: str, timeout: float, *args, other_args=(), **kwargs):
        return original(model, base_url, timeout, *args, other_args=[*other_args, *extra], **kwargs)

    fx.popen_launch_pd_server = launch


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest hook signature
    _patch()
