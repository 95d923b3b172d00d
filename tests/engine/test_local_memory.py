"""LocalMemory.aux_row: a request's aux row read out of the rank's own aux buffers (what the control channel's
AuxData carries to a decode rank on the two-sided and same-host paths), exactly those bytes, nothing past a row."""

import numpy as np
import pytest

from sglang_p2p_backend.engine.copy.memory import Region
from sglang_p2p_backend.engine.transport.local_memory import LocalMemory


def _buffers():
    """Two aux buffers of 6 rows: 16 and 8 bytes a row, every byte its own value."""
    a = (np.arange(6 * 16) % 251).astype(np.uint8)
    b = (200 - np.arange(6 * 8) % 199).astype(np.uint8)
    return a, b, LocalMemory([], [], [Region(a.ctypes.data, a.nbytes, 16), Region(b.ctypes.data, b.nbytes, 8)])


def test_a_row_is_each_buffers_row_at_the_asked_length_and_a_copy_taken_at_the_call():
    a, b, local = _buffers()
    rows = local.aux_row(4, [16, 5])  # the peer's second buffer has 5-byte rows: the common prefix of each row
    assert rows == [a[64:80].tobytes(), b[32:37].tobytes()]
    assert all(type(r) is bytes for r in rows)
    a[64:80] = 0  # the slot reused after the message was built: what was read stays
    assert rows[0] == bytes(range(64, 80))
    assert local.aux_row(4, [16, 5])[0] == bytes(16)  # a later read sees the buffer as it is then
    assert local.aux_row(0, [3]) == [a[:3].tobytes()]  # a peer with fewer buffers: only as many rows


@pytest.mark.parametrize("index,lens,why", [(6, [16, 8], "aux row 6 (16 bytes) is outside an aux buffer of 96 bytes"),
                                            (-1, [16, 8], "aux row -1"),
                                            (1, [17, 8], "aux row 1 (17 bytes) is outside an aux buffer of 96")])
def test_a_row_outside_a_buffer_or_longer_than_its_rows_is_refused_naming_it(index, lens, why):
    _, _, local = _buffers()
    with pytest.raises(IndexError, match=why.replace("(", r"\(").replace(")", r"\)")):
        local.aux_row(index, lens)
