"""RoomIds: a receiver's one upload of each room's published KV ids, sliced for every chunk's scatter. What a CPU
can check of it: which list and stream an upload serves, the slices it hands out, the bound on what it keeps and
when a room leaves it. The bytes a scatter writes from such slices are checked on a GPU (tests/gpu)."""

import numpy as np
import pytest
import torch

from sglang_p2p_backend.engine.copy.copier import PageCopier
from sglang_p2p_backend.engine.copy.room_ids import RoomIds


class HostUploads(PageCopier):
    """The real copier and its range checks over CPU pools, with `device_ids` answering as on a GPU (a CPU
    copier takes host ids and answers None); what it was asked to upload is recorded."""

    def __init__(self, pages: int):
        super().__init__([[torch.zeros(pages, 8, dtype=torch.uint8)]])
        self.asked: list[list[int]] = []

    def device_ids(self, ids):
        self.asked.append([int(i) for i in ids[0]])
        return [torch.from_numpy(np.asarray(part, dtype=np.int64)) for part in ids]


class Stream:
    def __init__(self, handle: int):
        self.cuda_stream = handle


def test_a_rooms_list_goes_up_once_a_stream_and_each_run_is_its_slice():
    copier = HostUploads(64)
    ids, side = RoomIds(copier), Stream(7)
    room = np.array([5, 9, 2, 40, 41, 42, 3], dtype=np.int32)
    assert ids.run(room, 0, 3, side).tolist() == [5, 9, 2]
    assert ids.run(room, 3, 2, side).tolist() == [40, 41]
    assert copier.asked == [room.tolist()] and len(ids) == 1
    assert ids.run(room, 3, 2, Stream(8)).tolist() == [40, 41]  # another stream: its own upload
    assert ids.uploads == 2
    assert ids.run(room, 5, 2, side).tolist() == [42, 3]  # the run that ends the list: the room leaves
    assert len(ids) == 1 and ids.uploads == 2
    again = room.copy()  # a retried room publishes a new list, even with the same pages
    assert ids.run(again, 0, 1, side).tolist() == [5] and ids.uploads == 3


def test_a_run_outside_the_list_is_refused_and_a_list_outside_the_pools_not_uploaded():
    copier = HostUploads(16)
    ids, side = RoomIds(copier), Stream(1)
    room = np.array([1, 2, 3], dtype=np.int32)
    with pytest.raises(IndexError, match="run 2..4 outside the room's 3 published KV ids"):
        ids.run(room, 2, 2, side)
    assert ids.run(np.array([1, 16], dtype=np.int32), 0, 1, side) is None  # 16: one past the pool
    assert copier.asked == [] and ids.uploads == 0


def test_what_it_keeps_is_bounded_the_least_recently_used_room_first():
    copier = HostUploads(64)
    ids, side = RoomIds(copier, capacity=2), Stream(1)
    rooms = [np.arange(i, i + 4, dtype=np.int32) for i in range(3)]
    ids.run(rooms[0], 0, 1, side)
    ids.run(rooms[1], 0, 1, side)
    ids.run(rooms[0], 1, 1, side)  # room 0 used last: room 1 is the one to go
    ids.run(rooms[2], 0, 1, side)
    assert len(ids) == 2 and ids.uploads == 3
    ids.run(rooms[0], 2, 1, side)
    assert ids.uploads == 3  # still kept
    ids.run(rooms[1], 1, 1, side)
    assert ids.uploads == 4  # gone, uploaded again
    ids.clear()
    assert len(ids) == 0


def test_on_cpu_the_scatter_takes_host_ids():
    copier = PageCopier([[torch.zeros(8, 8, dtype=torch.uint8)]])
    ids = RoomIds(copier)
    assert ids.run(np.array([1, 2], dtype=np.int32), 0, 1, None) is None and ids.uploads == 0
