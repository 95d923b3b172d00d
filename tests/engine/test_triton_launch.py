"""engine/copy/triton_launch.py: which launches go straight to a compiled kernel's launcher and with what
arguments, against a stand-in of a compiled kernel (the launches themselves are checked on GPUs:
tests/gpu/test_page_kernel.py, tests/gpu/test_gather_cuda.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_p2p_backend.engine.copy import triton_launch
from sglang_p2p_backend.engine.copy.triton_launch import DirectLaunch


class _Compiled:
    """A compiled kernel as Triton 3 has it: `run` (its launcher), `function`, `packed_metadata`, and
    `[grid](*args, stream=)`."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.function, self.packed_metadata = 0xF00, ("meta",)
        self.run = lambda *a: self.calls.append(("run",) + a)

    def __getitem__(self, grid):
        return lambda *args, stream: self.calls.append(("compiled", grid, stream) + args)


def test_a_launch_calls_the_launcher_as_the_jit_does_without_metadata_or_hooks(monkeypatch):
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    k = _Compiled()
    d = DirectLaunch(k)
    assert d.direct
    d.launch((7, 2, 1), 1234, 11, 22, "x")
    # grid, stream, function, packed metadata, launch metadata, enter hook, exit hook, the kernel's arguments
    assert k.calls == [("run", 7, 2, 1, 1234, 0xF00, ("meta",), None, None, None, 11, 22, "x")]


def test_jits_own_launcher_call_has_the_arguments_direct_launch_passes():
    """The installed Triton's CompiledKernel ends its launch with the call DirectLaunch makes (read from its
    source: a Triton that changed it would be caught here, not by a wrong launch on a GPU)."""
    compiler = pytest.importorskip("triton.compiler.compiler")
    import inspect

    src = inspect.getsource(compiler.CompiledKernel.__getitem__)
    assert "self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata," in src
    assert "launch_exit_hook, *args)" in src


def test_an_object_without_a_launcher_goes_through_the_compiled_kernel(monkeypatch):
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    k = _Compiled()
    del k.packed_metadata
    d = DirectLaunch(k)
    assert not d.direct
    d.launch((3, 1, 1), 99, 5, 6)
    assert k.calls == [("compiled", (3, 1, 1), 99, 5, 6)]


def test_a_launch_hook_sends_launches_through_the_compiled_kernel_so_a_profiler_sees_them(monkeypatch):
    k = _Compiled()
    d = DirectLaunch(k)
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: True)
    d.launch((1, 1, 1), 5, 8)
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    d.launch((1, 1, 1), 5, 8)
    assert [c[0] for c in k.calls] == ["compiled", "run"]


def test_hooks_are_read_from_tritons_knobs_an_empty_chain_being_none(monkeypatch):
    pytest.importorskip("triton")
    rt = triton_launch._knobs.runtime  # noqa: SLF001
    monkeypatch.setattr(rt, "launch_enter_hook", None)
    monkeypatch.setattr(rt, "launch_exit_hook", SimpleNamespace(calls=[]))  # Triton 3.6's HookChain, empty
    assert triton_launch._hooks_set() is False  # noqa: SLF001
    monkeypatch.setattr(rt, "launch_exit_hook", SimpleNamespace(calls=[print]))
    assert triton_launch._hooks_set() is True  # noqa: SLF001
    monkeypatch.setattr(rt, "launch_exit_hook", None)
    monkeypatch.setattr(rt, "launch_enter_hook", lambda *a: None)  # a release whose slot holds the hook itself
    assert triton_launch._hooks_set() is True  # noqa: SLF001
