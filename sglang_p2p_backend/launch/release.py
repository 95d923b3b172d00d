"""The SGLang releases the launcher renders for, and the few flag spellings that differ between them.

Kept in one place so that a new release means one table change, never branches scattered over the
renderer. Nothing here imports SGLang: the installed release is read from package metadata.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED = ("0.5.17", "0.5.23")
LATEST = SUPPORTED[-1]

# Old flags an operator is likely to copy from SGLang <= 0.4.x recipes, with what to write instead.
# Used to turn "unrecognized argument" into an actionable message.
RENAMED = {
    "enable-deepep-moe": "`moe-a2a-backend: deepep`",
    "cuda-graph-bs": "`cuda-graph-bs-decode: [...]` (and `cuda-graph-bs-prefill`)",
    "cuda-graph-max-bs": "`cuda-graph-max-bs-decode: N` (and `cuda-graph-max-bs-prefill`)",
    "disable-cuda-graph": "`cuda-graph-backend-decode: disabled` and `cuda-graph-backend-prefill: disabled`",
    "enable-dp-attention": "`attention_dp: true` in the model profile (the launcher renders the flags)",
    "enable-expert-distribution-metrics": "`expert-balancedness-report-mode: server_log`",
}


def attention_dp_flags(release: str, size: int) -> list[str]:
    """Attention data parallelism over `size` ranks, as the given release spells it."""
    if release == "0.5.17":
        # 0.5.17 has no --attn-dp-size: attention DP is --dp-size with --enable-dp-attention
        return ["--dp-size", str(size), "--enable-dp-attention"]
    # 0.5.23 deprecates --enable-dp-attention (removal after 2026-12-31) and --dp-size now means replicas
    return ["--attn-dp-size", str(size)]


def installed_release() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


class UnsupportedReleaseError(ValueError):
    pass


def resolve_release(requested: str | None) -> str:
    """The release to render for: the one asked for, else the installed one, else the latest supported."""
    release = requested or installed_release() or LATEST
    if release not in SUPPORTED:
        raise UnsupportedReleaseError(
            f"SGLang {release} is not supported by the launcher: supported are {', '.join(SUPPORTED)}; "
            f"install one of them or pass --sglang-version {LATEST} to render for the latest"
        )
    return release
