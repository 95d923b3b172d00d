"""The bootstrap HTTP server of a p2pnccl prefill: SGLang's `CommonKVBootstrapServer`, with its input checked and
its writes guarded. Routes and answers are SGLang's; in front of them one middleware

- answers a malformed request with 400 naming the field (SGLang's handlers would raise: a 500);
- with SGLANG_P2P_AUTH_KEY (or _FILE), accepts a write (`PUT /route`, `POST /register_dp_rank`) only with a valid
  `X-P2P-Signature` header: `<unix time>:<hex HMAC-SHA256(key, method, path, time, body)>`, within five minutes
  of the server's clock. The prefill's own writes are signed (`signed_writes`); the key never travels;
- with or without the key, never lets `PUT /route` move a rank whose registered address still accepts
  connections (its prefill is alive) to another address (409), nor register a rank outside the server's sizes;
  a rank registered again counts once towards the server's readiness.

Without the key anyone who reaches the port can still register a rank nobody has registered yet, or re-point a
rank whose prefill is gone (the README's threat model says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import re
import time
from hashlib import sha256
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

import requests
from aiohttp import web

from sglang.srt.disaggregation.common import conn as common_conn
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from sglang_p2p_backend.engine.wire.auth import key_from_env

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-P2P-Signature"
_SKEW_S = 300
_LIVE_CHECK_S = 1.0
_MAX_ROOMS = 4096
_WRITES = {("PUT", "/route"), ("POST", "/register_dp_rank")}
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


class BadRequest(ValueError):
    """A request field that is missing, of the wrong type or out of bounds (the message names it)."""


def signature(key: bytes, method: str, path: str, body: bytes, now: Optional[float] = None) -> str:
    stamp = str(int(time.time() if now is None else now))
    mac = hmac.new(key, f"{method}\n{path}\n{stamp}\n".encode() + body, sha256).hexdigest()
    return f"{stamp}:{mac}"


def signature_ok(key: bytes, method: str, path: str, body: bytes, header: str, now: Optional[float] = None) -> bool:
    stamp, _, _ = (header or "").partition(":")
    if not stamp.isdigit() or abs(int(stamp) - (time.time() if now is None else now)) > _SKEW_S:
        return False
    return hmac.compare_digest(signature(key, method, path, body, int(stamp)), header)


# ------------------------------------------------------------------ field checks (pure)
def _int(data: dict, name: str, lo: int, hi: int, optional: bool = False) -> Optional[int]:
    value = data.get(name)
    if value is None and optional:
        return None
    if name not in data:
        raise BadRequest(f"field {name!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"field {name!r} must be an integer, got {value!r:.60}")
    if not lo <= value <= hi:
        raise BadRequest(f"field {name!r} = {value} is outside {lo}..{hi}")
    return value


def _str(data: dict, name: str, limit: int = 256, optional: bool = False) -> Optional[str]:
    value = data.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > limit:
        raise BadRequest(f"field {name!r} must be a non-empty string of at most {limit} characters, got {value!r:.60}")
    return value


def _host(value: str) -> str:
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        if _HOST.match(value):
            return value
    raise BadRequest(f"field 'rank_ip' = {value!r:.60} is neither an IP address nor a host name")


def _object(body: bytes) -> dict:
    try:
        data = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}")
    return data


def route_put(data: dict) -> dict:
    """The fields of a `PUT /route` (one prefill rank's registration) checked; raises BadRequest naming one."""
    sizes = {n: _int(data, n, 1, 1 << 16) for n in ("attn_tp_size", "attn_cp_size", "attn_dp_size", "pp_size", "system_dp_size")}
    for rank, size in (("attn_tp_rank", "attn_tp_size"), ("attn_cp_rank", "attn_cp_size"), ("pp_rank", "pp_size")):
        _int(data, rank, 0, sizes[size] - 1)
    # the DP rank SGLang's server files the rank under (its "DP group") lies within the DP size it counts, as
    # every other rank lies within its size: a group outside it is never looked up, and the server would count
    # it towards readiness in place of a real one. The other DP rank is not bounded by its size: SGLang sends a
    # system DP rank with system_dp_size 1 under DP attention, and its server reads only the group
    group, size = ("attn_dp_rank", "attn_dp_size") if sizes["system_dp_size"] == 1 else ("system_dp_rank", "system_dp_size")
    value = _int(data, group, 0, (1 << 16) - 1)
    if value >= sizes[size]:
        raise BadRequest(f"field {group!r} = {value} is outside 0..{sizes[size] - 1} ({size} {sizes[size]})")
    other = "system_dp_rank" if group == "attn_dp_rank" else "attn_dp_rank"
    _int(data, other, 0, (1 << 16) - 1)
    _host(_str(data, "rank_ip"))
    _int(data, "rank_port", 1, 65535)
    _int(data, "page_size", 1, 1 << 20)
    _str(data, "kv_cache_dtype", 64)
    _int(data, "prefill_http_port", 1, 65535, optional=True)
    for name in ("kv_layout", "load_balance_method", "decode_allocation_policy"):
        _str(data, name, 64, optional=True)
    for name in ("enable_dsa_cache_layer_split", "enable_kv_cache_sharding"):
        if data.get(name) is not None and not isinstance(data[name], bool):
            raise BadRequest(f"field {name!r} must be true or false, got {data[name]!r:.60}")
    if data.get("dsv41_spec_layout") is not None and not isinstance(data["dsv41_spec_layout"], dict):
        raise BadRequest("field 'dsv41_spec_layout' must be an object or null")
    return data


def route_get(query: Any) -> None:
    for name in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"):
        raw = query.get(name)
        if raw is None or raw == "":
            raise BadRequest(f"query parameter {name!r} is missing")
        try:
            value = int(raw)
        except ValueError:
            raise BadRequest(f"query parameter {name!r} = {raw!r:.60} is not an integer") from None
        if not -1 <= value < 1 << 16:
            raise BadRequest(f"query parameter {name!r} = {value} is outside -1..65535")


def register_dp_rank(data: dict) -> None:
    _int(data, "bootstrap_room", 0, (1 << 63) - 1)
    _int(data, "dp_rank", 0, (1 << 16) - 1)


def query_dp_ranks(data: dict) -> None:
    rooms = data.get("bootstrap_rooms")
    if not isinstance(rooms, list) or len(rooms) > _MAX_ROOMS:
        raise BadRequest(f"field 'bootstrap_rooms' must be a list of at most {_MAX_ROOMS} room ids")
    for room in rooms:
        if isinstance(room, bool) or not isinstance(room, (int, str)) or not str(room).lstrip("-").isdigit():
            raise BadRequest(f"field 'bootstrap_rooms' holds {room!r:.60}, not a room id")


# ------------------------------------------------------------------ the server
async def _answers(ip: str, port: int) -> bool:
    """Whether something accepts connections at ip:port (a live prefill rank's control socket)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), _LIVE_CHECK_S)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


def _bad(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text)


def _leaves(table: Any) -> int:
    """Ranks in SGLang's nested dp -> cp -> tp -> pp table."""
    return sum(_leaves(v) for v in table.values()) if isinstance(table, dict) else 1


class P2pNcclKVBootstrapServer(CommonKVBootstrapServer):
    @property
    def _registered_count(self) -> int:
        """The ranks registered, each once. SGLang's server adds one per `PUT /route`, so a rank registering twice
        (a retry, a restart, anyone without the key) would make it report ready with a real rank missing; here
        the count is what its table holds, and its own assignments are ignored."""
        return _leaves(getattr(self, "prefill_port_table", None) or {})

    @_registered_count.setter
    def _registered_count(self, _value: int) -> None:
        pass

    def __init__(self, host: str, port: int, *args: Any, **kwargs: Any):
        self._key = key_from_env()  # before the server starts answering
        self.rejected: dict[str, int] = {}  # why requests were refused, by status (tests, logs)
        super().__init__(host, port, *args, **kwargs)

    def _setup_routes(self) -> None:
        super()._setup_routes()
        self.app.middlewares.append(self._guard_middleware())

    def _guard_middleware(self):
        @web.middleware
        async def guard(request: web.Request, handler):
            body = await request.read()  # cached: SGLang's handler reads it again
            try:
                refusal = await self._refusal(request, body)
            except BadRequest as e:
                refusal = _bad(400, f"malformed request to {request.path}: {e}")
            if refusal is not None:
                self.rejected[str(refusal.status)] = self.rejected.get(str(refusal.status), 0) + 1
                if self.rejected[str(refusal.status)] <= 20:
                    logger.warning("p2pnccl bootstrap: %s %s refused (%d): %s", request.method, request.path,
                                   refusal.status, refusal.text)
                return refusal
            try:
                return await handler(request)
            except (KeyError, ValueError, TypeError) as e:  # a field SGLang reads that we do not check
                return _bad(400, f"malformed request to {request.path}: {type(e).__name__}: {e}")

        return guard

    async def _refusal(self, request: web.Request, body: bytes) -> Optional[web.Response]:
        method, path = request.method, request.path
        if (method, path) in _WRITES and self._key is not None:
            if not signature_ok(self._key, method, path, body, request.headers.get(SIGNATURE_HEADER, "")):
                return _bad(401, f"{method} {path} needs a valid {SIGNATURE_HEADER} header: this bootstrap server "
                                 f"requires SGLANG_P2P_AUTH_KEY (the same on every prefill and decode)")
        if path == "/route" and method == "GET":
            route_get(request.query)
        elif path == "/route" and method == "PUT":
            return await self._route_conflict(route_put(_object(body)))
        elif path == "/register_dp_rank" and method == "POST":
            register_dp_rank(_object(body))
        elif path == "/query_dp_ranks" and method == "POST":
            query_dp_ranks(_object(body))
        return None

    async def _route_conflict(self, data: dict) -> Optional[web.Response]:
        """A registration that must not take effect: sizes other than the server's, or another address for a
        rank whose registered prefill still answers."""
        dp = data["attn_dp_size"] if data["system_dp_size"] == 1 else data["system_dp_size"]
        for name, mine, theirs in (("attn_tp_size", self.attn_tp_size, data["attn_tp_size"]),
                                   ("attn_cp_size", self.attn_cp_size, data["attn_cp_size"]),
                                   ("pp_size", self.pp_size, data["pp_size"]), ("dp size", self.dp_size, dp)):
            if mine is not None and mine != theirs:
                return _bad(409, f"{name} {theirs} differs from this prefill server's {mine}")
        group = data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]
        keys = (group, data["attn_cp_rank"], data["attn_tp_rank"], data["pp_rank"])
        table: Any = self.prefill_port_table
        for k in keys:
            table = table.get(k) if isinstance(table, dict) else None
        if table is None or (table.rank_ip, int(table.rank_port)) == (data["rank_ip"], int(data["rank_port"])):
            return None
        if await _answers(table.rank_ip, int(table.rank_port)):
            return _bad(409, f"prefill rank dp{keys[0]} cp{keys[1]} tp{keys[2]} pp{keys[3]} is registered at "
                             f"{table.rank_ip}:{table.rank_port}, which is alive; a restarted rank registers once "
                             f"the old one stopped")
        return None


class _SigningRequests:
    """SGLang's `requests` as its prefill code uses it, with PUT and POST signed for the bootstrap server."""

    def __init__(self, key: bytes):
        self._key = key

    def __getattr__(self, name: str) -> Any:
        return getattr(requests, name)

    def put(self, url: str, json: Any = None, **kwargs: Any):
        return self._send("PUT", url, json, kwargs)

    def post(self, url: str, json: Any = None, **kwargs: Any):
        return self._send("POST", url, json, kwargs)

    def _send(self, method: str, url: str, payload: Any, kwargs: dict):
        body = json.dumps(payload).encode()
        headers = {**(kwargs.pop("headers", None) or {}), "Content-Type": "application/json",
                   SIGNATURE_HEADER: signature(self._key, method, urlsplit(url).path, body)}
        return requests.request(method, url, data=body, headers=headers, **kwargs)


@contextlib.contextmanager
def signed_writes(key: Optional[bytes]) -> Iterator[None]:
    """Within: SGLang's writes to the bootstrap server (its prefill's `PUT /route`, `POST /register_dp_rank`) carry
    the signature a keyed server requires. They run on the scheduler thread, at start and per request."""
    if key is None:
        yield
        return
    saved = common_conn.requests
    common_conn.requests = _SigningRequests(key)
    try:
        yield
    finally:
        common_conn.requests = saved
