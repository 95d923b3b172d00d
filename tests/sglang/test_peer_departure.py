"""A decode rank declared dead while a worker holds one of its chunks: the worker that finds it gone fails the room
with the reason it was declared dead (it stopped answering), never a bare "not registered".

The interleavings are forced: the live-peer table runs the worker's step at the moment the liveness thread removes
the peer, before that thread fails the peer's rooms; or the liveness step right after the worker found it live."""

import types

import numpy as np
import pytest

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_p2p_backend.adapter.bounded import Bounded
from sglang_p2p_backend.adapter.prefill import PrefillKVManager
from sglang_p2p_backend.adapter.transfer_workers import TransferTask, TransferWorkers

pytestmark = pytest.mark.sglang

ROOM, PEER = 91, "127.0.0.1:46693"
REASON = f"peer {PEER} stopped answering: no message for 8.1s (SGLANG_P2P_PEER_TIMEOUT=8)"


class Interleaved(dict):
    """The live-peer table: removing PEER (`on="pop"`) or finding it live (`on="in"`) runs `step` right after."""

    def __init__(self, on: str, **items):
        super().__init__(**items)
        self.on, self.step = on, None

    def _then(self, key, value):
        if key == PEER and self.step is not None:
            step, self.step = self.step, None
            step()
        return value

    def pop(self, key, *default):
        return self._then(key, super().pop(key, *default)) if self.on == "pop" else super().pop(key, *default)

    def __contains__(self, key) -> bool:
        return self._then(key, super().__contains__(key)) if self.on == "in" else super().__contains__(key)


def workers(peers: dict, departed: dict, destinations: dict, failed: list) -> TransferWorkers:
    """The worker's checks on the manager's tables; no transports (the peer is gone before one is chosen)."""
    return TransferWorkers(
        count=1, spawn=lambda step, name: None, request_status={ROOM: KVPoll.Transferring},
        destinations=destinations, peers=peers, rejected=Bounded(4), departed=departed, heads={}, state={},
        route=lambda s: "nccl", channels=None, same_host=None, released=lambda: None, one_sided=None, release=None,
        control=None, session="127.0.0.1:1", prefill_rank=0, local=None,
        fail_room=lambda room, reason: failed.append((room, reason)), succeed=lambda room: None)


def chunk() -> TransferTask:
    return TransferTask(room=ROOM, kv_indices=np.arange(4, dtype=np.int32), index_slice=slice(0, 4), is_last=True,
                        aux_index=None, state_indices=None)


@pytest.mark.parametrize("worker_sees", ["gone", "live, then gone"])
def test_a_chunk_that_finds_its_dead_peer_gone_names_why(worker_sees):
    failed: list = []
    destinations = {ROOM: {PEER: types.SimpleNamespace(is_dummy=False, session=PEER, room=ROOM, dst_aux_index=-1,
                                                       dst_kv_indices=np.arange(4, dtype=np.int32))}}
    peers = Interleaved("pop" if worker_sees == "gone" else "in", **{PEER: object()})
    manager = types.SimpleNamespace(  # the prefill's liveness step on tables of its own (no sockets, no threads)
        decode_peers=peers, departed_peers=Bounded(4), transfer_infos=destinations,
        _fail_room=lambda room, reason, **kw: failed.append((room, reason)), _forget_peer=lambda *a: None)
    pool = workers(peers, manager.departed_peers, destinations, failed)
    if worker_sees == "gone":
        peers.step = lambda: pool._process(chunk())
        PrefillKVManager._peer_dead(manager, PEER, REASON)
        assert failed[0] == (ROOM, f"decode rank {PEER} cannot receive: {REASON}"), failed
    else:
        peers.step = lambda: PrefillKVManager._peer_dead(manager, PEER, REASON)
        pool._process(chunk())
        assert (ROOM, f"KV transfer to decode rank {PEER} failed: {REASON}") in failed, failed
    assert len(failed) == 2 and all("stopped answering" in reason for _, reason in failed), failed


def test_a_chunk_for_a_peer_that_never_registered_says_so():
    failed: list = []
    destinations = {ROOM: {PEER: types.SimpleNamespace(is_dummy=False)}}
    workers({}, Bounded(4), destinations, failed)._process(chunk())
    assert failed == [(ROOM, f"decode rank {PEER} cannot receive: it is not registered")], failed


@pytest.mark.parametrize("how", ["declared dead", "forgotten"])
def test_a_departed_decode_ranks_mooncake_session_is_forgotten_by_the_transport(how):
    """The one-sided transport keeps a failure mark per Mooncake session, which a restarted decode rank never
    reuses: the prefill tells it when the rank leaves, both when liveness removed the registration first and when
    the rank is forgotten directly (released, re-registered)."""
    from unittest import mock

    reg = types.SimpleNamespace(mooncake_session="10.0.0.7:17777")
    manager = mock.MagicMock(decode_peers={PEER: reg}, departed_peers={}, transfer_infos={})
    manager._forget_peer = lambda *a: PrefillKVManager._forget_peer(manager, *a)
    if how == "declared dead":
        PrefillKVManager._peer_dead(manager, PEER, REASON)
    else:
        PrefillKVManager._forget_peer(manager, PEER, REASON)
    manager.one_sided.forget_peer.assert_called_once_with("10.0.0.7:17777")
    assert PEER not in manager.decode_peers and manager.departed_peers[PEER] == REASON
