"""Launching a compiled Triton kernel again with the least host work: Triton's own C launcher called straight.

The copies here launch a kernel per chunk, and after its first launch through the JIT they keep the compiled
kernel (`CompiledKernel`) and call it on a stream handle (span_copy, gather_cuda). That call still goes through
two Python layers before the C launcher: a closure that asks for launch metadata, and the launcher object's
`__call__`, which allocates the global and profile scratch buffers a kernel may need. For kernels that need none
(all of ours) both layers do nothing useful: on an H200 host one launch took 7.4 us through `kernel[grid](...)`
and 4.2 us through the C function (bench/transfer/launch_cost.py; docs/bench.md). `DirectLaunch` calls the C
function where the Triton release's argument order is known (3.5 and 3.6 share it; 3.4 had no profile scratch,
3.9 reordered it), the kernel needs no scratch and no launch hook is set (a profiler's hooks must see every
launch); anywhere else it calls the compiled kernel as before.
"""

from __future__ import annotations

from typing import Any, Optional

try:  # CUDA builds of torch bring Triton; CPU-only installs never launch
    import triton
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

#: Triton releases whose C launcher takes (grid x, y, z, stream, function, cooperative, pdl, global scratch,
#: profile scratch, metadata, launch metadata, enter hook, exit hook, *kernel arguments)
KNOWN_LAYOUTS = ("3.5.", "3.6.")


try:  # where launch hooks live (Triton 3.4 on)
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - CPU-only installs, older releases: never the direct path
    _knobs = None


def _set(hook: Any) -> bool:
    """Whether a hook slot holds a hook: None or an empty chain (3.6's `HookChain`, which its own launch path
    calls every time even when empty) holds none."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def _hooks_set() -> bool:
    """Whether a launch hook is set (a profiler sets them): such launches take the full path."""
    if _knobs is None:
        return True
    rt = _knobs.runtime
    return _set(rt.launch_enter_hook) or _set(rt.launch_exit_hook)


class DirectLaunch:
    """One compiled kernel's launches: `launch(grid3, stream, *args)` with `args` as the kernel takes them
    (constexprs included, as `CompiledKernel[grid](*args, stream=)` takes them)."""

    def __init__(self, compiled: Any, version: Optional[str] = None):
        self.compiled = compiled
        #: the C launcher and what it is called with before the kernel's arguments; None: the compiled kernel
        self._c = None
        self._fixed: tuple = ()
        version = version if version is not None else getattr(triton, "__version__", "")
        run = getattr(compiled, "run", None)
        if (version.startswith(KNOWN_LAYOUTS) and run is not None and callable(getattr(run, "launch", None))
                and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0):
            self._c = run.launch
            self._fixed = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                           compiled.packed_metadata, None, None, None)

    @property
    def direct(self) -> bool:
        """Whether launches go straight to the C launcher (else through the compiled kernel)."""
        return self._c is not None

    def launch(self, grid3: tuple[int, int, int], stream: int, *args: Any) -> None:
        c = self._c
        if c is not None and not _hooks_set():
            c(grid3[0], grid3[1], grid3[2], stream, *self._fixed, *args)
        else:
            self.compiled[grid3](*args, stream=stream)
