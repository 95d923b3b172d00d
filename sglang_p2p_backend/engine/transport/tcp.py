"""The CPU two-sided transport: the NCCL protocol over one TCP connection per pair, for hosts without GPUs.

It follows the NCCL transport step for step (unique id made by the prefill and carried on the control
channel, both ranks join, ordered send/recv of whole staging buffers), so CI exercises the ordering, staging
and failure paths NCCL uses. Written on the standard library's sockets rather than ZMQ or gloo because it
needs exactly three things they make awkward: `recv_into` a preallocated staging buffer (ZMQ allocates a
frame per message), a peer's death surfacing as an error on the next call (ZMQ reconnects silently), and a
per-pair channel that comes and goes without a process-group rendezvous (gloo).
"""

from __future__ import annotations

import secrets
import socket
import threading
from typing import Optional

import torch

from sglang_p2p_backend.engine.config import EngineConfig
from sglang_p2p_backend.engine.transport.base import Completion, DoneCompletion, PairComm, TransportError, TwoSidedTransport

_TOKEN_LEN = 16


class TcpPairComm(PairComm):
    def __init__(self, sock: socket.socket, io_timeout: float, peer: str):
        self.device = torch.device("cpu")
        self.stream = None
        self._sock = sock
        self._peer = peer
        self._closed = False
        sock.settimeout(io_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _view(self, buf: torch.Tensor) -> memoryview:
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise TransportError("tcp transport moves contiguous uint8 host buffers only")
        return memoryview(buf.numpy()).cast("B")

    def send(self, buf: torch.Tensor) -> Completion:
        try:
            self._sock.sendall(self._view(buf))
        except (OSError, ValueError) as e:
            raise TransportError(f"send to {self._peer} failed: {e!r} (peer gone or stalled)") from e
        return DoneCompletion()

    def recv(self, buf: torch.Tensor) -> Completion:
        view = self._view(buf)
        got = 0
        try:
            while got < len(view):
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    raise TransportError(f"{self._peer} closed the pair channel after {got} of {len(view)} bytes")
                got += n
        except (OSError, ValueError) as e:
            raise TransportError(f"receive from {self._peer} failed after {got} of {len(view)} bytes: {e!r}") from e
        return DoneCompletion()

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class TcpTransport(TwoSidedTransport):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", io_timeout: float = EngineConfig.io_timeout):
        self.host = host
        self.io_timeout = io_timeout
        self._listeners: dict[bytes, socket.socket] = {}
        self._lock = threading.Lock()

    def new_unique_id(self, max_ctas: Optional[int] = -1) -> bytes:
        del max_ctas  # one TCP stream has no channels to cap
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.bind((self.host, 0))
        lsock.listen(1)
        token = secrets.token_bytes(_TOKEN_LEN)
        uid = f"{self.host}:{lsock.getsockname()[1]}:".encode() + token.hex().encode()
        with self._lock:
            self._listeners[uid] = lsock
        return uid

    def connect(self, unique_id: bytes, rank: int, timeout: float) -> PairComm:
        host, port, token_hex = unique_id.decode().split(":")
        token = bytes.fromhex(token_hex)
        if rank == 0:
            with self._lock:
                lsock = self._listeners.pop(unique_id, None)
            if lsock is None:
                raise TransportError(f"unknown pair id {unique_id!r} on this rank")
            try:
                lsock.settimeout(timeout)
                try:
                    sock, addr = lsock.accept()
                except OSError as e:
                    raise TransportError(f"decode rank did not join pair channel {host}:{port} within {timeout:.0f}s") from e
            finally:
                lsock.close()
            sock.settimeout(timeout)
            try:
                got = _recv_exact(sock, _TOKEN_LEN)
            except OSError as e:
                sock.close()
                raise TransportError(f"pair channel handshake from {addr} failed: {e!r}") from e
            if got != token:
                sock.close()
                raise TransportError(f"pair channel {host}:{port}: wrong token from {addr}")
            return TcpPairComm(sock, self.io_timeout, f"decode {addr[0]}:{addr[1]}")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
            sock.sendall(token)
        except OSError as e:
            raise TransportError(f"cannot join pair channel {host}:{port}: {e!r}") from e
        return TcpPairComm(sock, self.io_timeout, f"prefill {host}:{port}")

    def alloc_staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def close(self) -> None:
        with self._lock:
            listeners, self._listeners = list(self._listeners.values()), {}
        for s in listeners:
            s.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise OSError("connection closed during handshake")
        buf += part
    return bytes(buf)
