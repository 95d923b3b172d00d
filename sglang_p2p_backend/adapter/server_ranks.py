"""The control endpoints of every rank of a prefill server, read from its bootstrap server.

SGLang's decode reads them per request once its checks of the prefill server passed. When those checks refuse
the server (page size, KV dtype), the decode still needs them once: to register with each rank anyway, so the
prefill refuses it too, naming both values, and fails its side of the requests instead of waiting for
SGLang's bootstrap timeout.

This runs on the decode's scheduler thread and the server's answer (its sizes) says how many ranks to look up,
so both the lookups and the time are bounded whatever it answers: at most `_MAX_ATTEMPTS` lookups of single
ranks (answered or not) and `_DEADLINE_S` seconds for all of them, each answer at most `_MAX_ANSWER` bytes. A
server of more ranks, or one too slow, is told through the ranks found by then, with a warning naming its sizes.
The lookups speak plain HTTP/1.0 over a socket whose every wait ends at the deadline: an HTTP client's timeouts
bound each wait, not a request, so a server sending a byte a second would hold it without end.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Optional

logger = logging.getLogger(__name__)

_MAX_ATTEMPTS = 256
_DEADLINE_S = 5.0
_TIMEOUT_S = 2.0  # one wait (connect, each read) at most
_MAX_ANSWER = 64 << 10  # SGLang's answers are a few hundred bytes
_MAX_SIZE = 1 << 16  # what the bootstrap server itself accepts for a size
_LOG_MISSING = 8  # missing ranks named one by one, then counted


class _OutOfTime(Exception):
    pass


def _address(bootstrap_addr: str) -> tuple[str, int]:
    host, sep, port = bootstrap_addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bootstrap address {bootstrap_addr!r} is not host:port")
    return (host[1:-1] if host.startswith("[") and host.endswith("]") else host), int(port)


def _get(addr: tuple[str, int], query: str, deadline: float) -> dict:
    """The JSON object a `GET /route?query` answers with 200; raises _OutOfTime at the deadline, OSError or
    ValueError for anything else."""

    def wait() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _OutOfTime()
        return min(_TIMEOUT_S, left)

    host, port = addr
    try:  # (a host name is resolved first, as SGLang's own lookups of the server do, outside the deadline)
        with socket.create_connection(addr, timeout=wait()) as sock:
            name = f"[{host}]" if ":" in host else host
            sock.sendall(f"GET /route?{query} HTTP/1.0\r\nHost: {name}:{port}\r\nAccept: application/json\r\n\r\n".encode())
            data = bytearray()
            while True:
                sock.settimeout(wait())
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
                if len(data) > _MAX_ANSWER:
                    raise ValueError(f"answer longer than {_MAX_ANSWER} bytes")
    except socket.timeout:
        if deadline - time.monotonic() <= 0:
            raise _OutOfTime() from None
        raise
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(status) < 2 or not status[0].startswith(b"HTTP/"):
        raise ValueError("not an HTTP answer")
    if status[1] != b"200":
        raise ValueError(f"HTTP {status[1].decode(errors='replace')}: {body[:120].decode(errors='replace')}")
    value = json.loads(body)
    if not isinstance(value, dict):
        raise ValueError(f"answered {type(value).__name__}, not an object")
    return value


def _sizes(info: dict) -> list[int]:
    """dp, cp, tp, pp from the server's answer, each an integer in 1..65536 (a missing or null one is 1)."""
    out = []
    for key in ("dp_size", "attn_cp_size", "attn_tp_size", "pp_size"):
        value = info.get(key)
        value = 1 if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_SIZE:
            raise ValueError(f"{key} {value!r:.40} is not an integer in 1..{_MAX_SIZE}")
        out.append(value)
    return out


def rank_endpoints(bootstrap_addr: str, deadline_s: Optional[float] = None) -> list[str]:
    """"ip:port" of the registered prefill ranks of the server at `bootstrap_addr` (empty when unreachable),
    within `_MAX_ATTEMPTS` lookups and `deadline_s` seconds (`_DEADLINE_S`)."""
    deadline = time.monotonic() + (_DEADLINE_S if deadline_s is None else deadline_s)
    try:
        addr = _address(bootstrap_addr)
        dp, cp, tp, pp = _sizes(_get(addr, "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
                                     deadline))
    except (OSError, ValueError, _OutOfTime) as e:
        logger.warning("p2pnccl: cannot read the ranks of prefill server %s: %s", bootstrap_addr,
                       "no answer within the deadline" if isinstance(e, _OutOfTime) else e)
        return []
    out: list[str] = []
    attempts = missing = 0
    total = dp * cp * tp * pp
    ranks = ((d, c, t, p) for d in range(dp) for c in range(cp) for t in range(tp) for p in range(pp))
    for d, c, t, p in ranks:
        if attempts >= _MAX_ATTEMPTS or time.monotonic() >= deadline:
            break
        attempts += 1
        try:
            rank = _get(addr, f"prefill_dp_rank={d}&prefill_cp_rank={c}&target_tp_rank={t}&target_pp_rank={p}", deadline)
            out.append(f"{_host(rank['rank_ip'])}:{_port(rank['rank_port'])}")
        except _OutOfTime:
            attempts -= 1  # not looked up
            break
        except (OSError, ValueError, TypeError, KeyError) as e:
            missing += 1
            if missing <= _LOG_MISSING:
                logger.warning("p2pnccl: prefill server %s has no rank dp%d cp%d tp%d pp%d: %s",
                               bootstrap_addr, d, c, t, p, e)
    if attempts < total:
        logger.warning("p2pnccl: prefill server %s reports dp %d cp %d tp %d pp %d (%d ranks); %d looked up within "
                       "%.0fs and %d lookups at most, %d found: telling those", bootstrap_addr, dp, cp, tp, pp, total,
                       attempts, _DEADLINE_S if deadline_s is None else deadline_s, _MAX_ATTEMPTS, len(out))
    if missing > _LOG_MISSING:
        logger.warning("p2pnccl: prefill server %s: %d ranks missing in all", bootstrap_addr, missing)
    return out


def _host(value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > 256 or any(ch in value for ch in "/ \r\n@?#"):
        raise ValueError(f"rank_ip {value!r:.60} is not a host")
    return value


def _port(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"rank_port {value!r:.40} is not a port")
    return value
