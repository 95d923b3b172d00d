"""Writes rendered Kubernetes objects as YAML: all of them to stdout as one multi-document stream, or one
file per group and one for the LB into a folder, so `kubectl apply -f DIR` applies the topology and
`kubectl delete -f DIR/<group>.yaml` removes one group.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from .k8s import KubeFile

_WIDTH = 1 << 16  # never fold a long flag value over lines


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:  # a label map used twice is written twice, not as &id001
        return True


def file_text(f: KubeFile, header: str) -> str:
    docs = [yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=_WIDTH) for obj in f.objects]
    return f"# {f.name}: {header}\n---\n" + "---\n".join(docs)


def stream_text(files: list[KubeFile], header: str) -> str:
    return "".join(file_text(f, header) for f in files)


def write_folder(files: list[KubeFile], out: str | Path, header: str) -> str:
    """Writes the files; returns what was written and which YAML files already there are not part of this
    topology any more (a removed group): `kubectl apply -f` would keep those objects alive."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        (folder / f.name).write_text(file_text(f, header))
    lines = [f"# wrote {folder / f.name}" for f in files]
    written = {f.name for f in files}
    stale = sorted(p.name for p in folder.glob("*.yaml") if p.name not in written)
    lines += [
        f"# not part of this topology: {folder / name}: `kubectl delete -f` it, then remove the file"
        for name in stale
    ]
    return "\n".join(lines) + "\n"
