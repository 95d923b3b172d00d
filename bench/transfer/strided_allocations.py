"""Whether one strided copy (`cudaMemcpy2DAsync`), or one plain copy, may reach across allocations.

ce_lanes.py's strided rows (`2d`, `3d`) copy regions carved out of ONE allocation with a gap between them, and
moved a chunk across NVLink at the speed of one copy of its bytes with one call. SGLang allocates every layer
of a KV pool as a tensor of its own, each its own `cudaMalloc` at real pool sizes, so a strided copy of a
chunk's regions would take its rows from as many allocations. This asks the runtime, in one process on one
GPU: rows within one allocation on each side, rows in separate allocations of 64 MiB (evenly spaced where the
allocator placed them so), and a mix; then one `cudaMemcpyAsync` whose source or destination runs from the end
of one allocation into the next one adjacent to it (what joining two regions' spans that continue each other
would ask for). It prints the call's return code for each (0: queued; 1: invalid argument) and checks the bytes
of those that were queued.

    python bench/transfer/strided_allocations.py [--out PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from typing import Optional

MIB = 1 << 20
WIDTH = MIB  # bytes a row
MEMCPY_DEFAULT = 4


def _runtime(torch):
    rt = ctypes.CDLL("libcudart.so." + torch.version.cuda.split(".")[0])
    fn = rt.cudaMemcpy2DAsync
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                   ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    rt.cudaGetLastError.restype = ctypes.c_int
    return rt


def _case(torch, rt, name: str, src: list, dst: list) -> dict:
    """One strided copy of len(src) rows from the tensors' starts in `src` to those in `dst`, if both step
    evenly in one direction; its return code and, where queued, whether every row landed."""
    sp = [t.data_ptr() for t in src]
    dp = [t.data_ptr() for t in dst]
    steps_s = {b - a for a, b in zip(sp, sp[1:])}
    steps_d = {b - a for a, b in zip(dp, dp[1:])}
    row: dict = {"case": name, "rows": len(sp), "src_steps": sorted(steps_s), "dst_steps": sorted(steps_d)}
    if len(steps_s) != 1 or len(steps_d) != 1 or (min(steps_s) > 0) != (min(steps_d) > 0):
        row["skipped"] = "the allocator did not place these rows evenly in one direction"
        return row
    order = range(len(sp)) if min(steps_s) > 0 else range(len(sp) - 1, -1, -1)
    first = next(iter(order))
    for i, t in enumerate(src):
        t[:WIDTH].fill_(i + 1)
    for t in dst:
        t[:WIDTH].zero_()
    torch.cuda.synchronize()
    code = rt.cudaMemcpy2DAsync(dp[first], abs(min(steps_d)), sp[first], abs(min(steps_s)), WIDTH, len(sp),
                                MEMCPY_DEFAULT, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    rt.cudaGetLastError()  # a refused call leaves its error for the next kernel otherwise
    row["code"] = int(code)
    if code == 0:
        row["bytes_ok"] = all(bool((t[:WIDTH] == i + 1).all()) for i, t in enumerate(dst))
    return row


def _across(torch, rt, side: str) -> dict:
    """One cudaMemcpyAsync of 2 MiB whose `side` ("source" or "destination") starts 1 MiB before the end of an
    allocation and ends in the allocation right after it."""
    fn = rt.cudaMemcpyAsync
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    blocks = [torch.full((64 * MIB,), i + 1, dtype=torch.uint8, device="cuda") for i in range(3)]
    other = torch.zeros(4 * MIB, dtype=torch.uint8, device="cuda")
    ptrs = [t.data_ptr() for t in blocks]
    pair = next(((i, j) for i in range(3) for j in range(3) if ptrs[j] == ptrs[i] + 64 * MIB), None)
    row: dict = {"case": f"one copy, its {side} across two adjacent allocations"}
    if pair is None:
        row["skipped"] = "the allocator placed no two of them back to back"
        return row
    edge = ptrs[pair[0]] + 63 * MIB
    dst, src = (other.data_ptr(), edge) if side == "source" else (edge, other.data_ptr())
    torch.cuda.synchronize()
    row["code"] = int(fn(dst, src, 2 * MIB, MEMCPY_DEFAULT, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)))
    torch.cuda.synchronize()
    rt.cudaGetLastError()
    return row


def run(torch) -> list[dict]:
    rt = _runtime(torch)
    one_s = torch.zeros(8 * 4 * WIDTH, dtype=torch.uint8, device="cuda")
    one_d = torch.zeros_like(one_s)
    # rows 4 widths apart inside one allocation on each side
    rows_s = [one_s[i * 4 * WIDTH:(i + 1) * 4 * WIDTH] for i in range(8)]
    rows_d = [one_d[i * 4 * WIDTH:(i + 1) * 4 * WIDTH] for i in range(8)]
    sep_s = [torch.zeros(64 * MIB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    sep_d = [torch.zeros(64 * MIB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    return [_case(torch, rt, "one allocation each side", rows_s, rows_d),
            _case(torch, rt, "separate allocations each side", sep_s, sep_d),
            _case(torch, rt, "separate allocations, one allocation", sep_s, rows_d[:2]),
            _case(torch, rt, "one allocation, separate allocations", rows_s[:2], sep_d),
            _across(torch, rt, "source"), _across(torch, rt, "destination")]


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("strided_allocations: no CUDA device, nothing measured")
        return 0
    rows = run(torch)
    for r in rows:
        print(json.dumps(r))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
