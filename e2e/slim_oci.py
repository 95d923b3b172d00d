"""Cut the OCI SDK down to what genai-bench imports, for the GPU-host bundle (e2e/build_bundle.sh).

    python3 e2e/slim_oci.py PATH/TO/oci

genai-bench imports ``oci.config`` (and, for its OCI backends, two service clients) at start. The SDK is ~500 MB
unpacked, nearly all of it service clients that ``oci.__getattr__`` loads on first use. This removes every
service package that neither genai-bench nor the kept code imports, found by reading the SDK's own
``__init__.py`` (``__all__`` lists services and core modules; the core ones are imported at module level) and,
to a fixed point, the imports of the kept files.
"""
from __future__ import annotations

import ast
import re
import shutil
import sys
from pathlib import Path

GENAI_BENCH_SERVICES = {"generative_ai_inference", "object_storage"}
_IMPORT = re.compile(r"^\s*(?:from oci\.(\w+)|import oci\.(\w+)|from (?:oci|\.\.) import ([\w, ]+))", re.M)


def services(root: Path) -> set[str]:
    """Service package names: listed in __all__, not imported at module level of oci/__init__.py."""
    tree = ast.parse((root / "__init__.py").read_text())
    listed: set[str] = set()
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            listed |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    for node in tree.body:  # module level only: service imports sit in a branch for lazy loading turned off
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            imported |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return {n for n in listed - imported if (root / n).is_dir()}


def imported_names(text: str) -> set[str]:
    names: set[str] = set()
    for m in _IMPORT.finditer(text):
        names |= {m.group(1), m.group(2)} | {n.strip() for n in (m.group(3) or "").split(",")}
    return names - {None, ""}


def to_keep(root: Path, all_services: set[str], wanted: set[str]) -> set[str]:
    keep = set(wanted) & all_services
    while True:
        kept_files = (p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in all_services - keep)
        named: set[str] = set()
        for p in kept_files:
            named |= imported_names(p.read_text(errors="replace"))
        new = (named & all_services) - keep
        if not new:
            return keep
        keep |= new


def slim(root: Path, wanted: set[str] = GENAI_BENCH_SERVICES) -> set[str]:
    """Remove the service packages not needed; returns those kept."""
    found = services(root)
    keep = to_keep(root, found, wanted)
    for name in sorted(found - keep):
        shutil.rmtree(root / name)
    return keep


if __name__ == "__main__":
    print("oci services kept:", ", ".join(sorted(slim(Path(sys.argv[1])))))
