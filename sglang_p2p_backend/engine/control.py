"""Outbound control channel: one ZMQ PUSH socket per peer endpoint, sends serialised per endpoint.

Inbound traffic arrives on the PULL socket SGLang's manager already binds; this is the other direction.
Sends are bounded by SNDTIMEO, so a dead peer makes a send fail (ControlError) instead of blocking a worker.
"""

from __future__ import annotations

import threading

import zmq

from . import messages


class ControlError(RuntimeError):
    pass


class ControlChannel:
    def __init__(self, send_timeout_s: float = 5.0):
        self._ctx = zmq.Context.instance()
        self._send_timeout_ms = int(send_timeout_s * 1000)
        self._sockets: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._lock = threading.Lock()

    def _socket(self, endpoint: str) -> tuple[zmq.Socket, threading.Lock]:
        with self._lock:
            entry = self._sockets.get(endpoint)
            if entry is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
                if endpoint.startswith("["):
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(f"tcp://{endpoint}")
                entry = self._sockets[endpoint] = (sock, threading.Lock())
            return entry

    def send(self, endpoint: str, msg: messages.Message) -> None:
        self.send_frames(endpoint, messages.encode(msg))

    def send_frames(self, endpoint: str, frames: list[bytes]) -> None:
        sock, lock = self._socket(endpoint)
        try:
            with lock:
                sock.send_multipart(frames)
        except zmq.ZMQError as e:
            raise ControlError(f"control message to {endpoint} not delivered: {e}") from e

    def forget(self, endpoint: str) -> None:
        with self._lock:
            entry = self._sockets.pop(endpoint, None)
        if entry is not None:
            with entry[1]:
                entry[0].close()

    def close(self) -> None:
        with self._lock:
            entries, self._sockets = list(self._sockets.values()), {}
        for sock, lock in entries:
            with lock:
                sock.close()
