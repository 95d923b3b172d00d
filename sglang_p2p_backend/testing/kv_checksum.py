"""SGLang 0.5.23's KV checksum (--disaggregation-enable-kv-checksum) as the driver processes run it on CPU.

The prefill scheduler digests the pages it sends and writes (digest, layout signature) into the request's
`kv_checksum` aux row (`MetadataBuffers.set_kv_checksum`); the decode scheduler reads the row after the transfer,
digests its own pages and aborts the request on a mismatch, unless the signatures differ or the backend's
`should_verify_kv_checksum` says the digest does not cover its bytes (`_verify_kv_checksums`). SGLang's digest
kernel needs CUDA, so `digest` here is zlib's Adler-32 over the same bytes (every KV region's pages, then the
state slot): what the backend must carry, the row, is SGLang's own.
"""

from __future__ import annotations

import types
import zlib
from typing import Any, Optional

import numpy as np
import torch

from sglang_p2p_backend.testing.pools import HostPools


def digest(pools: HostPools, pages: np.ndarray, state_ids: Optional[list] = None) -> int:
    """Adler-32 of the pages' bytes in every KV region, then the state items'; never 0 (SGLang's "no digest")."""
    idx = torch.from_numpy(pages.astype(np.int64)).to(pools.spec.device)
    value = 1
    for t in [t[idx].cpu() for t in pools.kv] + (pools.state_bytes(state_ids) if state_ids else []):
        value = zlib.adler32(t.numpy().tobytes(), value)
    return value or 1


def signature(kv_args: Any) -> int:
    """SGLang's layout signature of this rank's KVArgs (what the decode compares before it verifies)."""
    from sglang.srt.disaggregation.utils import kv_layout_signature

    return kv_layout_signature(kv_args)


def write(meta: Any, aux: int, value: int, sig: int) -> None:
    """The prefill's write of the row (`set_kv_checksum` takes the request only for its aux row index)."""
    meta.set_kv_checksum(types.SimpleNamespace(metadata_buffer_index=aux), value, sig)


def mismatch(meta: Any, aux: int, room: int, actual: int, own_sig: int, comparable: bool) -> Optional[str]:
    """The decode scheduler's verdict on a landed room: SGLang's abort message on a mismatch it would verify,
    else None (also when it skips: no digest, another layout signature, or the backend says not comparable)."""
    expected, sig = meta.get_kv_checksum(aux)
    if expected == 0 or sig != own_sig or not comparable or actual == expected:
        return None
    return f"KV checksum mismatch bootstrap_room={room} expected={expected:#x} got={actual:#x}"
