"""Triton's kernel cache between device sessions: pack the GPU host's `TRITON_CACHE_DIR` into one archive that a
later call carries back as `.bundle/triton-cache.tar.xz` (run_all.sh unpacks it before any server starts).

    python3 -m e2e.triton_cache pack CACHE_DIR OUT.tar.xz [--max-mib 32]

A fresh GPU machine compiles every Triton kernel SGLang and the transfer engine use on first launch: a decode's
CUDA graph capture took 69 s on 2 x H200, most of it the first batch size. Triton keys each entry by the kernel's
source, its specialisation, the Triton version and the GPU's architecture, so a cache made on the same image
(torch, Triton, sm_90) is reused as is and entries that do not match are simply not found.
"""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path
from typing import Optional

#: run_all.sh's unpack marker, not part of the cache
MARKER = ".unpacked"
#: what one device call can carry beside the repository (~10 MiB) and serve.tar.xz (17 MiB): 64 MiB in all
MAX_MIB = 32.0


def cache_files(cache: Path) -> list[Path]:
    """Every file of the cache (sorted, so two packs of one cache are the same archive), the marker left out."""
    return sorted(p for p in cache.rglob("*") if p.is_file() and p.name != MARKER)


def pack(cache: Path, out: Path, max_mib: float = MAX_MIB) -> Optional[str]:
    """Write `out` (xz) with the cache's files under their paths relative to it; the reason it did not, if not
    (an empty or missing cache, or an archive larger than `max_mib`, which is then removed)."""
    files = cache_files(cache) if cache.is_dir() else []
    if not files:
        return f"nothing to pack: {cache} holds no files"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(cache)), recursive=False)
    mib = out.stat().st_size / 2**20
    if mib > max_mib:
        out.unlink()
        return f"{out.name} would be {mib:.1f} MiB, more than the {max_mib:.0f} MiB a call can carry beside the rest"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack CACHE_DIR into OUT (.tar.xz)")
    p.add_argument("cache", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--max-mib", type=float, default=MAX_MIB)
    args = ap.parse_args(argv)
    why = pack(args.cache, args.out, args.max_mib)
    if why:
        print(f"triton_cache: {why}")
        return 1
    print(f"triton_cache: {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB, "
          f"{len(cache_files(args.cache))} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
