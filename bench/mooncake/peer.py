"""Decode side of the Mooncake microbenchmark, run as a child process: maps a shared file as the decode's KV
regions, registers them with a `MooncakeTransport`, prints its session and region bases as one JSON line, and
stays up until its stdin closes. The file is shared so the writer can verify the pages that landed."""

from __future__ import annotations

import json
import sys

import numpy as np

from sglang_p2p_backend.engine.transport.mooncake import MooncakeTransport


def main(path: str, regions: int, protocol: str, host: str, ib_device: str) -> None:
    mem = np.memmap(path, dtype=np.uint8, mode="r+")
    size = mem.size // regions
    bases = [mem.ctypes.data + i * size for i in range(regions)]
    with MooncakeTransport(protocol, host, ib_device=ib_device or None) as t:
        t.register([(b, size) for b in bases])
        print(json.dumps({"session": t.session_id(), "bases": bases}), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
