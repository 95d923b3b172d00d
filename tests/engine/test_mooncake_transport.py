"""The `mooncake` one-sided transport over real Mooncake Transfer Engine (tcp, 127.0.0.1), two processes.

This process is the prefill: it owns source regions and writes. A child process (this file run as a script)
is the decode: it maps a shared file, registers slices of it as its regions and idles until its stdin
closes. Because the mapping is shared, this process can read the decode's memory and check every byte: the
target pages hold the source pages, and nothing else changed.
Layouts follow SGLang's pools: MLA one region per layer; MHA K of all layers then V of all layers; an aux
region with its own row size.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")

from sglang_p2p_backend.engine.copy.plan import copy_descriptors  # noqa: E402
from sglang_p2p_backend.engine.transport import mooncake  # noqa: E402
from sglang_p2p_backend.engine.transport.base import TransportError  # noqa: E402
from sglang_p2p_backend.engine.transport.mooncake import MAX_BATCH_DESCRIPTORS, MooncakeTransport  # noqa: E402

pytestmark = [pytest.mark.timeout(90), pytest.mark.serial]  # frozen and dead peers: bounds in seconds

PAGES = 256  # pages per region on both sides
MLA = dict(regions=6, item_len=4 * 1152)  # page 4 x (kv_lora 512 + rope 64) x bf16
MHA = dict(layers=3, item_len=16 * 2 * 64 * 2)  # page 16 x 2 heads x head_dim 64 x bf16; K then V
AUX_ROWS, AUX_ROW = 32, 64 * 4


def layout() -> list[int]:
    """Region sizes in the shared file, in order: MLA layers, MHA K layers, MHA V layers, aux."""
    return (
        [PAGES * MLA["item_len"]] * MLA["regions"]
        + [PAGES * MHA["item_len"]] * (2 * MHA["layers"])
        + [AUX_ROWS * AUX_ROW]
    )


# ---------------------------------------------------------------------------------------------- decode child


def peer_main(path: str, sizes: list[int]) -> None:
    """Decode side: map `path`, register its slices, print session and region bases, wait for stdin EOF."""
    mem = np.memmap(path, dtype=np.uint8, mode="r+")
    base = mem.ctypes.data
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    with MooncakeTransport("tcp", "127.0.0.1") as t:
        t.register([(base + o, n) for o, n in zip(offsets, sizes)])
        print(json.dumps({"session": t.session_id(), "bases": [base + o for o in offsets]}), flush=True)
        sys.stdin.read()


@dataclass
class Peer:
    proc: subprocess.Popen
    session: str
    bases: list[int]
    mem: np.memmap  # this process's view of the decode memory (same file, MAP_SHARED)
    offsets: list[int]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def start_peer(tmp: Path) -> Peer:
    sizes = layout()
    path = tmp / "decode.mem"
    rng = np.random.default_rng(1)
    # decode memory starts as noise, so a stray write of any byte is visible
    rng.integers(0, 256, sum(sizes), dtype=np.uint8).tofile(path)
    env = dict(os.environ, GLOG_minloglevel="2")  # Mooncake's per-init INFO/ERROR chatter
    proc = subprocess.Popen(
        [sys.executable, __file__, str(path), json.dumps(sizes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"decode peer exited with {proc.wait(timeout=5)} before registering")
    info = json.loads(line)
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    return Peer(proc, info["session"], info["bases"], np.memmap(path, dtype=np.uint8, mode="r"), offsets)


@pytest.fixture(scope="module")
def prefill() -> Iterator[tuple[MooncakeTransport, np.ndarray, list[int]]]:
    """Prefill transport and its source memory: same layout as the decode, different noise."""
    sizes = layout()
    src = np.random.default_rng(2).integers(0, 256, sum(sizes), dtype=np.uint8)
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    bases = [src.ctypes.data + o for o in offsets]
    t = MooncakeTransport("tcp", "127.0.0.1", transfer_timeout_s=5)
    t.register([(b, n) for b, n in zip(bases, sizes)])
    yield t, src, bases
    t.close()


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    p = start_peer(tmp_path_factory.mktemp("mc"))
    yield p
    p.stop()


@pytest.fixture
def lone_peer(tmp_path: Path) -> Iterator[Peer]:
    """A decode peer of its own, for tests that kill or freeze it."""
    p = start_peer(tmp_path)
    yield p
    if p.proc.poll() is None:
        os.kill(p.proc.pid, signal.SIGCONT)
        p.proc.kill()
        p.proc.wait(timeout=5)


# ------------------------------------------------------------------------------------------------- helpers


def scattered_runs(rng: np.random.Generator, n_runs: int, max_len: int) -> list[tuple[int, int, int]]:
    """Page runs (src, dst, n) with disjoint destination ranges in random places, sources anywhere."""
    lens = rng.integers(1, max_len + 1, n_runs)
    gaps = rng.integers(1, 4, n_runs)  # at least one untouched page between destination runs
    if int(lens.sum() + gaps.sum()) > PAGES:
        raise ValueError("runs do not fit")
    runs, dst = [], int(rng.integers(0, PAGES - int(lens.sum() + gaps.sum()) + 1))
    for n, gap in zip(lens.tolist(), gaps.tolist()):
        runs.append((int(rng.integers(0, PAGES - n + 1)), dst, n))
        dst += n + gap
    order = rng.permutation(len(runs))  # pages of a request need not come in address order
    return [runs[i] for i in order]


def expected_after(before: np.ndarray, src: np.ndarray, copies: list[tuple[int, int, int]]) -> np.ndarray:
    """Decode memory after copying (src_offset, dst_offset, len) byte ranges, computed in numpy."""
    out = before.copy()
    for s, d, n in copies:
        out[d : d + n] = src[s : s + n]
    return out


def write_and_check(prefill, peer: Peer, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
    """Write the descriptors through Mooncake and check the whole decode memory byte for byte."""
    t, src, _ = prefill
    before = np.array(peer.mem)
    t.write(peer.session, srcs, dsts, lens)
    src_base, dst_base = src.ctypes.data, peer.bases[0] - peer.offsets[0]
    want = expected_after(before, src, [(s - src_base, d - dst_base, n) for s, d, n in zip(srcs, dsts, lens)])
    got = np.array(peer.mem)
    changed = np.flatnonzero(got != want)
    assert changed.size == 0, f"{changed.size} bytes differ, first at offsets {changed[:5].tolist()}"
    assert not np.array_equal(got, before), "nothing was written"


@dataclass(frozen=True)
class Layout:
    """A run of regions (same index on both sides) sharing one item_len, as plan.copy_descriptors takes them."""

    first: int
    count: int
    item_len: int

    def descriptors(self, prefill, peer: Peer, runs: list[tuple[int, int, int]]) -> tuple[list, list, list]:
        src_ptrs = prefill[2][self.first : self.first + self.count]
        dst_ptrs = peer.bases[self.first : self.first + self.count]
        src_ids = np.concatenate([np.arange(s, s + n) for s, _, n in runs])
        dst_ids = np.concatenate([np.arange(d, d + n) for _, d, n in runs])
        out = copy_descriptors(src_ptrs, dst_ptrs, [self.item_len] * self.count, src_ids, dst_ids)
        return tuple(a.tolist() for a in out)


MLA_KV = Layout(0, MLA["regions"], MLA["item_len"])
MHA_KV = Layout(MLA["regions"], 2 * MHA["layers"], MHA["item_len"])
AUX = Layout(MLA["regions"] + 2 * MHA["layers"], 1, AUX_ROW)


# --------------------------------------------------------------------------------------------------- tests


def test_mla_scattered_runs_land_exactly(prefill, peer: Peer) -> None:
    runs = scattered_runs(np.random.default_rng(10), 12, 3)
    write_and_check(prefill, peer, *MLA_KV.descriptors(prefill, peer, runs))


def test_empty_write_and_zero_length_descriptors_move_nothing(prefill, peer: Peer) -> None:
    t, _, bases = prefill
    before = np.array(peer.mem)
    t.write(peer.session, [], [], [])
    t.write(peer.session, [bases[0], bases[1]], [peer.bases[0], peer.bases[1]], [0, 0])
    np.testing.assert_array_equal(np.array(peer.mem), before)


def test_mha_k_then_v_and_aux_row_in_one_write(prefill, peer: Peer) -> None:
    """K and V regions of every layer plus the request's aux row (its own row size), as one chunk's write."""
    kv = MHA_KV.descriptors(prefill, peer, scattered_runs(np.random.default_rng(11), 8, 4))
    aux = AUX.descriptors(prefill, peer, [(5, 17, 1)])  # prefill aux slot 5 -> decode aux slot 17
    write_and_check(prefill, peer, kv[0] + aux[0], kv[1] + aux[1], kv[2] + aux[2])


def test_batch_over_1024_descriptors_is_split(prefill, peer: Peer) -> None:
    """6 regions x 200 single-page runs = 1200 descriptors in one write: more than Mooncake's tcp queue takes."""
    rng = np.random.default_rng(12)
    # destinations in random order, so plan.page_runs merges none of them
    runs = [(int(rng.integers(0, PAGES)), int(p), 1) for p in rng.permutation(PAGES)[:200]]
    srcs, dsts, lens = MLA_KV.descriptors(prefill, peer, runs)
    assert len(srcs) > MAX_BATCH_DESCRIPTORS
    t = prefill[0]
    engine, sizes = t._engine, []

    class CountingEngine:  # the real engine, with the size of every batch it is handed recorded
        def batch_transfer_sync_write(self, session, s, d, n):
            sizes.append(len(s))
            return engine.batch_transfer_sync_write(session, s, d, n)

    t._engine = CountingEngine()
    try:
        write_and_check(prefill, peer, srcs, dsts, lens)
    finally:
        t._engine = engine
    assert sizes == [MAX_BATCH_DESCRIPTORS, len(srcs) - MAX_BATCH_DESCRIPTORS]
    # the session is still healthy afterwards (an oversized batch would have poisoned the peer's queue)
    write_and_check(prefill, peer, *MLA_KV.descriptors(prefill, peer, [(0, 3, 2)]))


def test_unregistered_destination_is_rejected_and_nothing_lands(prefill, peer: Peer) -> None:
    t, src, bases = prefill
    before = np.array(peer.mem)
    end = peer.bases[-1] + AUX_ROWS * AUX_ROW  # first byte past the decode's registered memory
    with pytest.raises(TransportError, match=peer.session):
        t.write(peer.session, [bases[0], bases[1]], [peer.bases[0], end + 4096], [4096, 4096])
    # in-range descriptors of the same batch may or may not have landed; bytes elsewhere must not change
    after = np.array(peer.mem)
    outside = np.ones(after.size, dtype=bool)
    outside[:4096] = False
    np.testing.assert_array_equal(after[outside], before[outside])
    assert peer.session in t.failed_sessions()
    t.peer_registered(peer.session)  # the decode registers again: writes to it resume
    write_and_check(prefill, peer, *MLA_KV.descriptors(prefill, peer, [(7, 9, 1)]))


def test_a_live_peer_whose_write_failed_is_written_again_after_retry_after(prefill, peer: Peer, monkeypatch) -> None:
    """A real Mooncake session that failed once (a write outside the decode's registration) and is still there:
    skipped at first, tried once `retry_after_s` passed (the marks' clock moved by hand), and the write lands
    byte-exact without the decode registering again (the same process never would, e.g. after SGLang's
    release/resume)."""
    t, _, bases = prefill
    end = peer.bases[-1] + AUX_ROWS * AUX_ROW
    clock = [1000.0]
    monkeypatch.setattr(mooncake, "_now", lambda: clock[0])
    try:
        with pytest.raises(TransportError, match=peer.session):
            t.write(peer.session, [bases[0]], [end + 4096], [4096])
        descs = MLA_KV.descriptors(prefill, peer, [(11, 12, 1)])
        with pytest.raises(TransportError, match="skipped until the peer registers again or for"):
            t.write(peer.session, *descs)
        clock[0] += t.retry_after_s
        write_and_check(prefill, peer, *descs)
        assert peer.session not in t.failed_sessions()
    finally:
        t.peer_registered(peer.session)  # the module's peer is never left marked


def test_dead_peer_fails_fast_then_is_skipped_until_it_registers(prefill, lone_peer: Peer) -> None:
    t, _, _ = prefill
    descs = MLA_KV.descriptors(prefill, lone_peer, [(0, 0, 4)])
    t.write(lone_peer.session, *descs)  # connected and healthy first
    lone_peer.proc.kill()
    lone_peer.proc.wait(timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=f"write to {lone_peer.session} failed.*peer dead or unreachable"):
        t.write(lone_peer.session, *descs)
    assert time.monotonic() - t0 < t.transfer_timeout_s + 5
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="skipped until the peer registers again"):
        t.write(lone_peer.session, *descs)
    assert time.monotonic() - t0 < 0.5  # skipped without touching the network
    t.peer_registered(lone_peer.session)
    assert lone_peer.session not in t.failed_sessions()
    with pytest.raises(TransportError, match="failed"):  # tried again, still dead
        t.write(lone_peer.session, *descs)


def test_frozen_peer_times_out_within_the_transfer_timeout(prefill, lone_peer: Peer) -> None:
    """A peer that stops answering (SIGSTOP) must not hang the writer beyond the transfer timeout."""
    t, _, _ = prefill
    descs = MLA_KV.descriptors(prefill, lone_peer, [(0, 0, 1)])
    from support import stopped  # here: the peer process runs this module without tests/ on its path

    t.write(lone_peer.session, *descs)
    stopped.stop(lone_peer.proc.pid)  # stopped for sure before the write that must time out
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=f"timeout \\({t.transfer_timeout_s}s\\)"):
        t.write(lone_peer.session, *descs)
    assert time.monotonic() - t0 < t.transfer_timeout_s + 5


def test_unknown_session_fails_with_its_name(prefill) -> None:
    t, _, bases = prefill
    with pytest.raises(TransportError, match="127.0.0.1:1 failed"):
        t.write("127.0.0.1:1", [bases[0]], [bases[0]], [64])


def test_close_deregisters_and_later_calls_fail_clearly() -> None:
    buf = np.zeros(1 << 16, dtype=np.uint8)
    t = MooncakeTransport("tcp", "127.0.0.1")
    t.register([(buf.ctypes.data, buf.nbytes), (buf.ctypes.data, buf.nbytes), (buf.ctypes.data + 100, 0)])
    assert t._registered == {buf.ctypes.data: buf.nbytes}  # duplicates and empty regions skipped
    t.close()
    assert t._registered == {}
    t.close()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        t.write("127.0.0.1:1", [buf.ctypes.data], [0], [1])
    with pytest.raises(TransportError, match="closed"):
        t.register([(buf.ctypes.data, 1)])


if __name__ == "__main__":
    peer_main(sys.argv[1], json.loads(sys.argv[2]))
