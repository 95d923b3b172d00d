"""Host time of one launch of the same-host page kernel at each level of Triton's launcher, on one GPU.

    python -m bench.transfer.launch_cost [--out PATH] [--machine NAME] [--launches 3000]

Every same-host write and every NCCL-path gather and scatter launches a Triton kernel. This times, on the host,
back to back, a launch of `span_copy._copy_pages` (with nothing to copy, so the host is all that is timed):
through the JIT (`jit`), through the compiled kernel (`compiled`: `CompiledKernel[grid](*args, stream=)`),
through its launcher (`launcher`: `CompiledKernel.run`, what the JIT's call ends with), through
`engine/copy/triton_launch.DirectLaunch` (`direct`, what the copies use: the launcher, after a check for launch
hooks), and for scale through the launcher's C function (`c_launch`, Triton 3.5 and 3.6 only) and a ctypes runtime
call.
Each level: the median of 5 rounds of `--launches` launches. Then a launch through DirectLaunch that moves pages is
compared byte for byte.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

try:
    from bench.transfer.gpu_names import cuda_torch
except ImportError:  # run as a script from bench/transfer
    from gpu_names import cuda_torch  # type: ignore[no-redef]


def per_launch_us(fn: Callable[[], None], launches: int, sync: Callable[[], None]) -> list[float]:
    """Host us per call of `fn`, 5 rounds of `launches` calls after 200 warm ones, sorted."""
    for _ in range(200):
        fn()
    sync()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(launches):
            fn()
        rounds.append((time.perf_counter() - t) / launches * 1e6)
        sync()
    return sorted(rounds)


def run(machine: str, launches: int) -> dict:
    import torch
    import triton

    from sglang_p2p_backend.engine.copy import span_copy
    from sglang_p2p_backend.engine.copy.triton_launch import DirectLaunch
    from sglang_p2p_backend.engine.transport.cuda_ipc import backend

    dev = torch.device("cuda:0")
    stream = torch.cuda.Stream(dev)
    handle = stream.cuda_stream
    buf = torch.zeros(1024, dtype=torch.int64, device=dev)
    like = torch.empty(1, dtype=torch.int64, device=dev)
    with torch.cuda.stream(stream):
        compiled = span_copy._copy_pages[(132,)](buf, 0, buf[16:], 61, like, BLOCK=1024)
    torch.cuda.synchronize()
    base = buf.data_ptr()
    args = (base, 0, base + 128, 61, like.data_ptr(), 1024)  # 0 pages: the kernel returns at once
    direct = DirectLaunch(compiled)
    launcher = compiled.run
    rt, cur = backend().rt, ctypes.c_int()

    def jit() -> None:
        span_copy._copy_pages[(132,)](buf, 0, buf[16:], 61, like, BLOCK=1024)

    levels: dict[str, Callable[[], None]] = {
        "compiled": lambda: compiled[(132, 1, 1)](*args, stream=handle),
        "launcher": lambda: launcher(132, 1, 1, handle, compiled.function, compiled.packed_metadata, None, None,
                                     None, *args),
        "direct": lambda: direct.launch((132, 1, 1), handle, *args),
        "ctypes_cudaGetDevice": lambda: rt.cudaGetDevice(ctypes.byref(cur)),
    }
    if callable(getattr(launcher, "launch", None)) and triton.__version__.startswith(("3.5.", "3.6.")):
        # one level further down, for scale: the launcher's C function (this argument order is 3.5's and 3.6's
        # only, so nothing here calls it)
        fixed = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                 compiled.packed_metadata, None, None, None)
        levels["c_launch"] = lambda: launcher.launch(132, 1, 1, handle, *fixed, *args)
    result: dict = {"machine": machine, "torch": torch.__version__, "triton": triton.__version__,
                    "direct_path": direct.direct, "launches": launches, "us": {}}
    with torch.cuda.stream(stream):
        result["us"]["jit"] = per_launch_us(jit, launches, torch.cuda.synchronize)
    for name, fn in levels.items():
        result["us"][name] = per_launch_us(fn, launches, torch.cuda.synchronize)
    # one launch through DirectLaunch that moves pages 0 <-> 1 of four regions
    src = torch.randint(0, 1 << 40, (4, 2, 128), dtype=torch.int64, device=dev)
    dst = torch.zeros_like(src)
    table = span_copy.page_table([src[r].data_ptr() for r in range(4)], [dst[r].data_ptr() for r in range(4)],
                                 [1024] * 4, 8)
    ids = torch.tensor(np.concatenate([[0, 1], [1, 0], table.reshape(-1)]), dtype=torch.int64, device=dev)
    direct.launch((8, 1, 1), handle, ids.data_ptr(), 2, ids.data_ptr() + 32, 4, like.data_ptr(), 1024)
    stream.synchronize()
    result["bytes_ok"] = bool(torch.equal(dst[:, 1], src[:, 0]) and torch.equal(dst[:, 0], src[:, 1]))
    return result


def report(result: dict) -> str:
    lines = [f"triton {result['triton']}, direct path {'on' if result['direct_path'] else 'off'}; host us a launch "
             f"(median of 5 rounds of {result['launches']}):"]
    for name, rounds in result["us"].items():
        lines.append(f"  {name:22s} {rounds[2]:7.2f} us (rounds {rounds[0]:.2f}-{rounds[-1]:.2f})")
    lines.append(f"bytes through the direct launch: {'right' if result['bytes_ok'] else 'WRONG'}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/launch_cost.json"))
    ap.add_argument("--machine", default="unknown")
    ap.add_argument("--launches", type=int, default=3000)
    args = ap.parse_args(argv)
    torch = cuda_torch("launch_cost")
    if torch is None:
        return 0
    result = run(args.machine, args.launches)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0 if result["bytes_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
