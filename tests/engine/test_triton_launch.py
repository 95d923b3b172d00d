"""engine/copy/triton_launch.py: which launches go straight to Triton's C launcher and in what argument order,
against a stand-in of a compiled kernel (the launches themselves are checked on GPUs: tests/gpu/test_page_kernel.py,
tests/gpu/test_gather_cuda.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_p2p_backend.engine.copy import triton_launch
from sglang_p2p_backend.engine.copy.triton_launch import DirectLaunch


class _Compiled:
    """A compiled kernel as Triton 3.5/3.6 has it: `run` (the launcher object, with its C function `launch`),
    `function`, `packed_metadata`, and `[grid](*args, stream=)`."""

    def __init__(self, global_scratch: int = 0, profile_scratch: int = 0):
        self.calls: list[tuple] = []
        self.function, self.packed_metadata = 0xF00, ("meta",)
        self.run = SimpleNamespace(launch=lambda *a: self.calls.append(("c",) + a), global_scratch_size=global_scratch,
                                   profile_scratch_size=profile_scratch, launch_cooperative_grid=False,
                                   launch_pdl=True)

    def __getitem__(self, grid):
        return lambda *args, stream: self.calls.append(("compiled", grid, stream) + args)


def test_a_known_release_calls_the_c_launcher_with_its_argument_order(monkeypatch):
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    k = _Compiled()
    d = DirectLaunch(k, version="3.6.0")
    assert d.direct
    d.launch((7, 2, 1), 1234, 11, 22, "x")
    # grid, stream, function, cooperative, pdl, global and profile scratch, metadata, launch metadata, hooks, args
    assert k.calls == [("c", 7, 2, 1, 1234, 0xF00, False, True, None, None, ("meta",), None, None, None, 11, 22, "x")]


@pytest.mark.parametrize("version, scratch", [("3.4.0", (0, 0)), ("3.9.0", (0, 0)), ("", (0, 0)),
                                              ("3.6.0", (256, 0)), ("3.5.1", (0, 64))],
                         ids=["3.4-no-profile-scratch", "3.9-reordered", "no-triton", "global-scratch",
                              "profile-scratch"])
def test_an_unknown_order_or_a_kernel_needing_scratch_goes_through_the_compiled_kernel(monkeypatch, version, scratch):
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    k = _Compiled(*scratch)
    d = DirectLaunch(k, version=version)
    assert not d.direct
    d.launch((3, 1, 1), 99, 5, 6)
    assert k.calls == [("compiled", (3, 1, 1), 99, 5, 6)]


def test_a_launch_hook_sends_launches_through_the_compiled_kernel_so_a_profiler_sees_them(monkeypatch):
    k = _Compiled()
    d = DirectLaunch(k, version="3.6.0")
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: True)
    d.launch((1, 1, 1), 5, 8)
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    d.launch((1, 1, 1), 5, 8)
    assert [c[0] for c in k.calls] == ["compiled", "c"]


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
