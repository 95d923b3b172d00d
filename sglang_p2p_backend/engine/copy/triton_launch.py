"""Launching a compiled Triton kernel again with the least host work: Triton's launcher called straight.

The copies here launch a kernel per chunk, and after its first launch through the JIT they keep the compiled
kernel (`CompiledKernel`) and call it on a stream handle (span_copy, gather_cuda). `kernel[grid](*args, stream=)`
still builds a closure and launch metadata for the launch hooks, which Triton 3.6 calls even when no hook is set
(its hook slots hold empty chains). `DirectLaunch` calls the kernel's launcher (`CompiledKernel.run`) itself, as
that closure ends, with no metadata and no hooks when none is set (a profiler's hooks must see every launch, so
then it takes the full call). The launcher's arguments are the same from Triton 3.0 to 3.9 (the JIT's own call);
it still allocates any scratch memory a kernel needs. On H200 hosts one launch took 7.4-10.5 us through
`kernel[grid](...)` and 4.9-6.9 us through the launcher (bench/transfer/launch_cost.py; docs/bench.md).
"""

from __future__ import annotations

from typing import Any

try:  # where launch hooks live (Triton 3.4 on); earlier releases: always the full call
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - CPU-only installs, older releases
    _knobs = None


def _set(hook: Any) -> bool:
    """Whether a hook slot holds a hook: None or an empty chain (3.6's `HookChain`) holds none."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def _hooks_set() -> bool:
    """Whether a launch hook is set (a profiler sets them): such launches take the full call."""
    if _knobs is None:
        return True
    rt = _knobs.runtime
    return _set(rt.launch_enter_hook) or _set(rt.launch_exit_hook)


class DirectLaunch:
    """One compiled kernel's launches: `launch(grid3, stream, *args)` with `args` as the kernel takes them
    (constexprs included, as `CompiledKernel[grid](*args, stream=)` takes them)."""

    def __init__(self, compiled: Any):
        self.compiled = compiled
        #: the kernel's launcher and what it takes before the kernel's arguments; None: the full call
        self._run = None
        self._fixed: tuple = ()
        run = getattr(compiled, "run", None)  # loads the kernel's module where the JIT has not yet
        if callable(run) and hasattr(compiled, "function") and hasattr(compiled, "packed_metadata"):
            self._run = run
            # function, packed metadata, launch metadata (only hooks read it), enter hook, exit hook
            self._fixed = (compiled.function, compiled.packed_metadata, None, None, None)

    @property
    def direct(self) -> bool:
        """Whether launches go straight to the launcher (else through the compiled kernel's full call)."""
        return self._run is not None

    def launch(self, grid3: tuple[int, int, int], stream: int, *args: Any) -> None:
        run = self._run
        if run is not None and not _hooks_set():
            run(grid3[0], grid3[1], grid3[2], stream, *self._fixed, *args)
        else:
            self.compiled[grid3](*args, stream=stream)
