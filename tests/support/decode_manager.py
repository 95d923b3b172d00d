"""A decode rank's KV manager without SGLang's server behind it: the state its `_init_role` reads set by hand, then
its own `_init_role` (no transports and no threads unless a test names them). Tests of the decode's control path
start from it and name only what their case adds (`state`)."""

import threading
from collections import Counter
from typing import Any

from sglang_p2p_backend.adapter.decode import DecodeKVManager
from sglang_p2p_backend.engine.config import EngineConfig


def bare_decode_manager(**state: Any) -> DecodeKVManager:
    """A DecodeKVManager wired by `_init_role` over `state` (attribute -> value) on top of the defaults here: no
    transports, one empty view, no heartbeat thread, SGLang's empty room tables, no failures."""
    mgr = DecodeKVManager.__new__(DecodeKVManager)
    mgr.config = EngineConfig()
    mgr.two_sided = mgr.one_sided = mgr.ipc = None
    mgr.views, mgr.device = [None], None
    mgr._start_heartbeat_checker_thread = lambda: None
    mgr.request_status, mgr.required_prefill_response_num_table, mgr.prefill_response_tracker = {}, {}, {}
    mgr.failure_lock, mgr.failure_records, mgr.dropped = threading.Lock(), {}, Counter()
    for name, value in state.items():
        setattr(mgr, name, value)
    mgr._init_role()
    return mgr
