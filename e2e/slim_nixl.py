"""Slim an unpacked nixl-cu13 wheel to what SGLang's NIXL backend uses on one host: the Python API and its
bindings, the UCX plugin and UCX's own transport modules, and the shared libraries they need (NEEDED, read
with readelf). Dropped: NIXL-EP (three 31 MB torch extensions), every other plugin (object stores, GDS,
libfabric, ...), telemetry exporters, UCX perftest and the EFA / GPUDirect-async UCX modules, headers and scripts. A 229 MiB tree becomes ~66 MiB.

    python3 -m e2e.slim_nixl DIR      (DIR: nixl_cu13 and nixl wheels unzipped into it)
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

_DROP_DIRS = ("nixl_ep", "nixl_ep_cu13", "nixl_cu13.scripts")
_PLUGIN_KEPT = "libplugin_UCX.so"
# UCX transports for hardware a GPU host without EFA or DOCA/GPUDirect-async NICs lacks (their libraries are
# not in the wheel either): UCX skips a module it cannot load, but the bundle check wants every NEEDED found
_UCX_DROPPED = ("libuct_ib_efa", "libuct_ib_mlx5_gda", "libuct_ib_mlx5_gdp")


def needed(so: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
    return re.findall(r"NEEDED.*\[(.*)\]", out)


def slim(root: Path) -> int:
    """Slim in place; returns the bytes left."""
    for d in _DROP_DIRS:
        shutil.rmtree(root / d, ignore_errors=True)
    for data in root.glob("nixl_cu13-*.data"):
        shutil.rmtree(data)
    for plugins in (root / "nixl_cu13.libs" / "nixl", root / ".nixl_cu13.mesonpy.libs" / "plugins"):
        for f in plugins.iterdir() if plugins.is_dir() else ():
            if f.name != _PLUGIN_KEPT:
                f.unlink()
    for f in (root / "nixl_cu13.libs" / "ucx").iterdir():
        if "perftest" in f.name or f.suffix == ".la" or f.name.startswith(_UCX_DROPPED):
            f.unlink()
    libdirs = [root / "nixl_cu13.libs", root / ".nixl_cu13.mesonpy.libs"]
    pool = {f.name: f for d in libdirs for f in d.iterdir() if f.is_file()}
    # roots: the Python extensions, the kept plugin and UCX's modules (loaded with dlopen, so nothing NEEDs them)
    todo = [f for f in root.rglob("*.so*") if f.is_file() and f.parent not in libdirs]
    keep: set[str] = set()
    while todo:
        for lib in needed(todo.pop()):
            if lib in pool and lib not in keep:
                keep.add(lib)
                todo.append(pool[lib])
    for name, f in pool.items():
        if name not in keep:
            f.unlink()
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


if __name__ == "__main__":
    left = slim(Path(sys.argv[1]))
    print(f"nixl slimmed to {left >> 20} MiB")
