"""Pair secrets: what binds a prefill-decode pair to the two processes that registered, with or without a key.

Each side draws a random secret per registration and hands it to the other one: the decode in PeerRegister, the
prefill in PeerAnswer. From then on every frame list a rank sends to that peer, ours and SGLang's own (ABORT,
ABORT_ACK), travels as

    [PAIR_MAGIC, secret, *frames]

where `secret` is the one the *receiver* issued. A receiver therefore knows who sent a frame list from the secret
alone (it issued each one to one peer) and drops anything that claims a session without the secret it issued to
that session. To carry the prefill's secret a decode must have received the prefill's answer at the address it
registered from, and to carry the decode's a prefill must have received that registration, so a sender elsewhere
on the network can neither forge a pair's messages nor complete a registration from an address it does not own.
It does not stop a sender that reads the pair's traffic: that takes SGLANG_P2P_AUTH_KEY (auth.py), which wraps
these frame lists in its authenticated envelope.
"""

from __future__ import annotations

import hmac
import secrets
import threading
from collections import OrderedDict
from typing import Optional

PAIR_MAGIC = b"P2PS"
SECRET_BYTES = 16


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def seal(frames: list[bytes], secret: Optional[bytes]) -> list[bytes]:
    """`frames` for a peer that issued `secret` (as they are when it has issued none yet)."""
    return frames if not secret else [PAIR_MAGIC, secret, *frames]


def open_frames(frames: list[bytes]) -> tuple[Optional[bytes], list[bytes]]:
    """(the secret carried, or None, inner frames)."""
    if len(frames) >= 3 and frames[0] == PAIR_MAGIC:
        return frames[1], frames[2:]
    return None, frames


class IssuedSecrets:
    """The secrets this rank issued, one per peer session; bounded (the oldest are forgotten). Thread-safe."""

    def __init__(self, limit: int):
        self._limit = limit
        self._by_session: "OrderedDict[str, bytes]" = OrderedDict()
        self._lock = threading.Lock()

    def issue(self, session: str) -> bytes:
        """A new secret for `session` (replaces any earlier one: a new registration)."""
        secret = new_secret()
        self.adopt(session, secret)
        return secret

    def adopt(self, session: str, secret: Optional[bytes]) -> None:
        """Keep `secret` (issued elsewhere: an answered registration that became live) for `session`."""
        if not secret:
            return
        with self._lock:
            self._by_session[session] = secret
            self._by_session.move_to_end(session)
            while len(self._by_session) > self._limit:
                self._by_session.popitem(last=False)

    def get(self, session: str) -> Optional[bytes]:
        with self._lock:
            return self._by_session.get(session)

    def matches(self, session: str, secret: Optional[bytes]) -> bool:
        """Whether `secret` is the one issued to `session` (constant-time)."""
        expected = self.get(session)
        return expected is not None and secret is not None and hmac.compare_digest(expected, secret)

    def owner(self, secret: Optional[bytes]) -> Optional[str]:
        """The session `secret` was issued to, if any (for frames that name no session: SGLang's)."""
        if not secret:
            return None
        with self._lock:
            items = list(self._by_session.items())
        found = None
        for session, s in items:  # every entry compared: no timing hint of which one matched
            if hmac.compare_digest(s, secret):
                found = session
        return found

    def forget(self, session: str) -> None:
        with self._lock:
            self._by_session.pop(session, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_session)
