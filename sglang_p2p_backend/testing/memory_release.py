"""Plan `memory_release`: a rank releases and then resumes its KV memory mid-run, as SGLang does for
`release_memory_occupation` / `resume_memory_occupation` (--enable-memory-saver).

The calls are SGLang's own queue methods (`PrefillBootstrapQueue`, `DecodePreallocQueue`), which reach the
manager only through their `hasattr(kv_manager, "deregister_buffer_to_engine")` test; they run on a stand-in
holding the queue state they touch (empty, as SGLang releases an idle server only). While released, the rank
records whether any byte of its pools changed and how much memory its one-sided transport kept registered.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

from sglang_p2p_backend.testing.plan import ready, touch


def _queue_class(prefill: bool) -> type:
    if prefill:
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        return PrefillBootstrapQueue
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    return DecodePreallocQueue


def _idle_queue(kv_manager: Any) -> SimpleNamespace:
    """What SGLang's release/resume methods read of their queue, for an idle server (both releases' methods)."""
    return SimpleNamespace(kv_manager=kv_manager, queue=[], retracted_queue=[],
                           _cancel_prefill_dp_rank_queries=lambda: None)


class MemoryRelease:
    """One rank's release (once `release_after` names are ready) and resume (once `resume_after` are); it marks
    `<role>-<rank>-released` and `<role>-<rank>-resumed` for the plan's later requests to wait for."""

    def __init__(self, role: Any, spec: dict):
        self.role = role
        self.release_after = list(spec.get("release_after", ()))
        self.resume_after = list(spec.get("resume_after", ()))
        self.state = "serving"
        self._snapshot: Optional[list[torch.Tensor]] = None
        self.out: dict = {}

    def _pool_tensors(self) -> list[torch.Tensor]:
        pools = self.role.pools
        return list(pools.kv) + [t for comp in pools.states for t in comp.regions]

    def _call(self, method: str) -> None:
        cls = _queue_class(self.role.role == "prefill")
        getattr(cls, method)(_idle_queue(self.role.mgr))

    def step(self) -> None:
        name = f"{self.role.role}-{self.role.rank}"
        if self.state == "serving" and ready(self.role.plan, self.release_after):
            self._call("release_memory_occupation")
            self._snapshot = [t.clone() for t in self._pool_tensors()]
            one_sided = self.role.mgr.one_sided
            self.out["registered_while_released"] = (
                len(getattr(one_sided, "_registered", {})) if one_sided is not None else None)
            # how long a session whose write failed (on the old registration, say) is skipped
            self.out["retry_after_s"] = getattr(one_sided, "retry_after_s", None)
            self.state = "released"
            touch(self.role.plan, f"{name}-released")
        elif self.state == "released" and ready(self.role.plan, self.resume_after):
            now = self._pool_tensors()
            self.out["changed_while_released"] = not all(torch.equal(a, b) for a, b in zip(self._snapshot, now))
            self._snapshot = None
            self._call("resume_memory_occupation")
            self.state = "resumed"
            touch(self.role.plan, f"{name}-resumed")

    def report(self) -> dict:
        return {"state": self.state, **self.out}
