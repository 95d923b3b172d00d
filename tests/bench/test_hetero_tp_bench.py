"""bench.hetero_tp on a small request: the engine's two-sided path over tcp with head slices (one prefill rank
into two decode ranks, two into one) lands every decode head byte-exact, in chunks as large as whole pages fill."""

from bench.hetero_tp.__main__ import model_kv, run_case
from sglang_p2p_backend.engine.transport.tcp import TcpTransport


def test_head_slices_move_in_the_same_chunks_as_whole_pages_and_land_exactly():
    kv = model_kv(24)
    transport = TcpTransport(io_timeout=30)
    try:
        rows = {(s, d): run_case(s, d, 24, kv, transport) for s, d in [(1, 1), (1, 2), (2, 1)]}
    finally:
        transport.close()
    assert all(r["byte_exact"] for r in rows.values()), rows
    assert len({r["bytes"] for r in rows.values()}) == 1  # the same KV bytes cross in every case
    # full staging slots (4 MiB) but for each pair's last chunk: never per-page or per-head messages
    assert all(r["mean_chunk_mb"] >= 2 for r in rows.values()), rows
