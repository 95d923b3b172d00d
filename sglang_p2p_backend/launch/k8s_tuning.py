"""Tuning files the model profile names as flag values (EPLB expert placement, DeepEP kernel config):
read from a local folder at render time and shipped in a ConfigMap that every server pod mounts at the
path the flag names. A file the render cannot find stops the render naming it, so a pod never starts
on a path that is missing on its node (one crash-looping pod makes LWS recreate its group forever).

Pure apart from reading the files; the ConfigMap and the mounts are built in k8s_pod.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ROLES, LaunchConfig

# SGLang flags whose value may be a file path; "trivial" or inline JSON ("{...}") are left alone
FILE_FLAGS = ("init-expert-location", "deepep-config")
CONFIGMAP_MAX_BYTES = 1024 * 1024  # the API server's limit for one ConfigMap's data


@dataclass(frozen=True)
class TuningFile:
    role: str
    flag: str
    path: str  # where the flag points inside the container
    key: str  # the ConfigMap key (the file's base name)
    text: str


def _is_path(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("/")


def _fix(role: str, flag: str) -> str:
    return (f"or write `{flag}: null` under `{role}.args` in the topology to start without it "
            f"(SGLang then uses its defaults: trivial expert placement, DeepEP's built-in config)")


def tuning_files(cfg: LaunchConfig, tuning_dir: Path | None) -> tuple[list[TuningFile], list[str]]:
    """Every file flag of every role with its content, and the problems (one per unusable file)."""
    files: list[TuningFile] = []
    found: list[str] = []
    for role in ROLES:
        for flag in FILE_FLAGS:
            value = cfg.role(role).args.get(flag)
            if not _is_path(value):
                continue
            key = Path(value).name
            where = f"`--{flag} {value}` ({role})"
            if tuning_dir is None:
                found.append(f"{where} names a file the pods would need on every node: put {key} in a folder "
                             f"and pass --tuning-dir DIR (or set `kubernetes.tuning_dir`), {_fix(role, flag)}")
                continue
            local = tuning_dir / key
            try:
                text = local.read_text()
            except OSError as exc:
                found.append(f"{where}: {local} cannot be read ({exc.strerror}): record or copy the file "
                             f"there, {_fix(role, flag)}")
                continue
            try:
                json.loads(text)
            except ValueError as exc:
                found.append(f"{where}: {local} is not valid JSON ({exc}): SGLang would fail at startup")
                continue
            clash = next((f for f in files if f.key == key and f.text != text), None)
            if clash is not None:
                found.append(f"{where} and `--{clash.flag} {clash.path}` ({clash.role}) share the base name "
                             f"{key} with different contents: rename one")
                continue
            files.append(TuningFile(role, flag, value, key, text))
    size = sum(len(f.text.encode()) for f in {f.key: f for f in files}.values())
    if size > CONFIGMAP_MAX_BYTES:
        found.append(f"the tuning files hold {size} bytes, more than a ConfigMap's {CONFIGMAP_MAX_BYTES}: "
                     f"leave the largest out (`<flag>: null`) or record smaller statistics")
    return files, found
