"""A dict that keeps only its newest entries: the prefill's tables that a stranger's messages can add to."""

from __future__ import annotations

from collections import OrderedDict


class Bounded(OrderedDict):
    """A dict that keeps its newest `limit` entries (setting a key makes it the newest)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)
