"""e2e/triton_cache.py and run_all.sh's use of it: the GPU host's Triton cache packed into one archive, and carried
back unpacked where every server of a later call finds it (TRITON_CACHE_DIR)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from e2e import triton_cache

REPO = Path(__file__).resolve().parents[2]


def _cache(root: Path) -> dict[str, bytes]:
    files = {"0f3a/_copy_pages.cubin": os.urandom(4096), "0f3a/_copy_pages.json": b'{"name": "_copy_pages"}',
             "9b21/__grp___copy_tiles.json": b"{}"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / triton_cache.MARKER).write_text("123 456\n")  # run_all.sh's unpack marker: not part of the cache
    return files


def test_a_packed_cache_unpacks_where_run_all_puts_it_byte_for_byte(tmp_path):
    files = _cache(tmp_path / "cache")
    out = tmp_path / "out" / "triton-cache.tar.xz"
    assert triton_cache.pack(tmp_path / "cache", out) is None
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    out.rename(bundle / "triton-cache.tar.xz")
    env = {**os.environ, "E2E_ROOT": str(tmp_path / "root"), "E2E_BUNDLE": str(bundle), "OUT": str(tmp_path / "o")}
    p = subprocess.run(["bash", str(REPO / "e2e/run_all.sh"), "--phase", "unpack"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    dest = tmp_path / "root" / "triton-cache"
    assert "unpack: triton-cache is in" in p.stdout
    got = {str(f.relative_to(dest)): f.read_bytes() for f in dest.rglob("*") if f.is_file() and f.name != triton_cache.MARKER}
    assert got == files
    # the script points every process it starts at that folder
    assert 'export TRITON_CACHE_DIR=$E2E_ROOT/triton-cache' in (REPO / "e2e/run_all.sh").read_text()


def test_nothing_to_pack_or_too_large_writes_no_archive_and_says_why(tmp_path, capsys):
    out = tmp_path / "t.tar.xz"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / triton_cache.MARKER).write_text("x")
    assert "holds no files" in triton_cache.pack(tmp_path / "empty", out) and not out.exists()
    assert "holds no files" in triton_cache.pack(tmp_path / "missing", out)
    _cache(tmp_path / "cache")
    why = triton_cache.pack(tmp_path / "cache", out, max_mib=0.001)
    assert "more than the" in why and "MiB" in why and not out.exists()
    assert triton_cache.main(["pack", str(tmp_path / "cache"), str(out)]) == 0 and out.exists()
    assert "3 files" in capsys.readouterr().out
