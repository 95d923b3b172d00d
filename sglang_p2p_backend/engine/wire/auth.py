"""Authenticated control frames: an HMAC-SHA256 envelope with the sender's session and a per-pair counter.

With a shared key (`SGLANG_P2P_AUTH_KEY`, or `SGLANG_P2P_AUTH_KEY_FILE` naming a file that holds it) every
frame list a rank sends on the control channel, ours and SGLang's own (ABORT, ABORT_ACK), travels as

    [AUTH_MAGIC, header, tag, *frames]   header = msgpack([session, incarnation, counter])

where `tag` = HMAC(key, header + every frame, length-prefixed). The receiver drops (and counts) any frame
list without a valid tag, and any replay: per sender session it keeps the newest incarnation (the sending
process's start time) and the last counter seen from it, and accepts only a newer incarnation or a higher
counter of the same one. A sender numbers all its frame lists in one sequence and sends each peer's in order.
The standard library's `hmac` is used: no extra dependency, constant-time comparison.

What the key protects, and what it does not (README "Failures and security"): without the key nobody can
register a decode, announce chunks, report a room's status, or take channel budget; the KV bytes on the
pair channels (NCCL, tcp, Mooncake) are not encrypted or authenticated, and a peer holding the key is trusted.
"""

from __future__ import annotations

import hmac
import os
import struct
import threading
from collections import OrderedDict
from hashlib import sha256
from typing import Optional

import msgspec

AUTH_MAGIC = b"P2PA"
_MAX_SENDERS = 4096  # replay state kept per sender session; oldest dropped beyond (they hold the key)


class AuthError(ValueError):
    """A frame list that must be dropped: unauthenticated, wrong key, malformed envelope, or a replay. `kind`
    says which key problem it shows: "none" (the sender has no key), "other" (a different key), "" (neither)."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


def key_from_env(environ: Optional[dict] = None) -> Optional[bytes]:
    env = os.environ if environ is None else environ
    raw = env.get("SGLANG_P2P_AUTH_KEY", "")
    path = env.get("SGLANG_P2P_AUTH_KEY_FILE", "")
    if raw and path:
        raise ValueError("set SGLANG_P2P_AUTH_KEY or SGLANG_P2P_AUTH_KEY_FILE, not both")
    if path:
        try:
            with open(path, "rb") as f:
                raw = f.read().strip().decode()
        except OSError as e:
            raise ValueError(f"SGLANG_P2P_AUTH_KEY_FILE={path!r} cannot be read: {e}") from None
    if not raw:
        return None
    if len(raw) < 16:
        raise ValueError("SGLANG_P2P_AUTH_KEY must be at least 16 characters (e.g. `openssl rand -hex 32`)")
    return raw.encode()


def _tag(key: bytes, header: bytes, frames: list[bytes]) -> bytes:
    mac = hmac.new(key, digestmod=sha256)
    for part in (header, *frames):
        mac.update(struct.pack("<Q", len(part)))
        mac.update(part)
    return mac.digest()


class Authenticator:
    """Seals outgoing frame lists and opens incoming ones for one rank. Thread-safe."""

    def __init__(self, key: bytes, session: str, incarnation: int):
        self._key = key
        self.session = session
        self.incarnation = incarnation
        self._seen: "OrderedDict[str, tuple[int, int]]" = OrderedDict()  # session -> (incarnation, counter)
        self._lock = threading.Lock()
        self._counter = 0
        self.dropped = 0

    def seal(self, frames: list[bytes], counter: Optional[int] = None) -> list[bytes]:
        """Seal with `counter`, by default this rank's next one: one sequence for every peer, so the counters a
        peer sees only grow (call under the lock that orders the sends to that peer)."""
        if counter is None:
            with self._lock:
                self._counter += 1
                counter = self._counter
        header = msgspec.msgpack.encode([self.session, self.incarnation, counter])
        return [AUTH_MAGIC, header, _tag(self._key, header, frames), *frames]

    def open(self, frames: list[bytes]) -> tuple[str, list[bytes]]:
        """(sender session, inner frames) of an authentic, fresh envelope; raises AuthError otherwise."""
        try:
            if len(frames) < 4 or frames[0] != AUTH_MAGIC:
                raise AuthError("unauthenticated control message (this rank requires SGLANG_P2P_AUTH_KEY)", "none")
            header, tag, inner = frames[1], frames[2], frames[3:]
            if not hmac.compare_digest(tag, _tag(self._key, header, inner)):
                raise AuthError("control message with a wrong authentication tag (different SGLANG_P2P_AUTH_KEY?)", "other")
            try:
                session, incarnation, counter = msgspec.msgpack.decode(header, type=tuple[str, int, int])
            except msgspec.DecodeError:
                raise AuthError("authenticated control message with a malformed header") from None
            with self._lock:
                last = self._seen.get(session)
                if last is not None and (incarnation, counter) <= last:
                    raise AuthError(f"replayed control message from {session} (counter {counter})")
                self._seen[session] = (incarnation, counter)
                self._seen.move_to_end(session)
                while len(self._seen) > _MAX_SENDERS:
                    self._seen.popitem(last=False)
            return session, inner
        except AuthError:
            with self._lock:
                self.dropped += 1
            raise
