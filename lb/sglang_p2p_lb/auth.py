"""Who may call what: the admin key for routes that change where prompts go, the client key for the rest.

Admin routes (adding or removing workers, flushing caches) are refused with 403 unless an admin key is
configured, and with 401 unless the request presents one (`Authorization: Bearer <key>`). The optional
client key (sgl-router / smg `--api-key`) gates every other route except `/health` and `/metrics`, which
probes and scrapers call without credentials. Keys are compared as SHA-256 digests in constant time.
Pure functions plus one aiohttp middleware; the keys come from the command line or the environment.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, Sequence

from aiohttp import web

log = logging.getLogger(__name__)

ADMIN_ROUTES = frozenset({("POST", "/workers"), ("DELETE", "/workers"), ("POST", "/flush_cache")})
OPEN_PATHS = frozenset({"/health", "/metrics"})
ADMIN_KEY_ENV = "SGLANG_P2P_LB_ADMIN_KEY"
API_KEY_ENV = "SGLANG_P2P_LB_API_KEY"
SMG_CONTROL_PLANE_ENV = "CONTROL_PLANE_API_KEYS"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_control_plane_keys(items: Iterable[str]) -> list[str]:
    """Admin keys from smg's `--control-plane-api-keys id:name:role:key` (a bare key counts as admin).

    Keys of role `user` are skipped: in smg they never reach the control plane either.
    """
    keys = []
    for item in items:
        for entry in (e.strip() for e in item.split(",")):
            if not entry:
                continue
            parts = entry.split(":", 3)
            if len(parts) == 1:
                keys.append(entry)
            elif len(parts) == 4 and parts[3]:
                if parts[2].lower() == "admin":
                    keys.append(parts[3])
            else:
                raise ValueError(f"--control-plane-api-keys expects id:name:role:key, got {entry.split(':', 1)[0]}:...")
    return keys


@dataclass(frozen=True)
class AuthConfig:
    admin_keys: tuple[bytes, ...] = ()  # SHA-256 digests
    api_key: bytes | None = None  # SHA-256 digest

    @classmethod
    def from_keys(cls, admin_keys: Sequence[str], api_key: str | None) -> "AuthConfig":
        return cls(tuple(_digest(k) for k in admin_keys if k), _digest(api_key) if api_key else None)


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _matches(token: str | None, digests: Iterable[bytes]) -> bool:
    if token is None:
        return False
    d = _digest(token)
    ok = False
    for k in digests:  # no early exit: every key is compared
        ok |= hmac.compare_digest(d, k)
    return ok


def verdict(cfg: AuthConfig, method: str, path: str, authorization: str | None) -> tuple[int, str] | None:
    """None when the request may proceed, else (status, reason)."""
    token = bearer(authorization)
    if (method, path) in ADMIN_ROUTES:
        if not cfg.admin_keys:
            return 403, f"admin route {method} {path} is disabled: start the LB with --admin-api-key (or ${ADMIN_KEY_ENV}, or smg's --control-plane-api-keys)"
        if not _matches(token, cfg.admin_keys):
            return 401, f"admin route {method} {path} needs 'Authorization: Bearer <admin key>'"
        return None
    if cfg.api_key is None or path in OPEN_PATHS:
        return None
    # the admin key also opens data routes, so one operator credential does everything
    if not _matches(token, (cfg.api_key, *cfg.admin_keys)):
        return 401, "this load balancer needs 'Authorization: Bearer <api key>' (--api-key)"
    return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(cfg: AuthConfig, error: Callable[[int, str], web.Response]):
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        v = verdict(cfg, request.method, request.path, request.headers.get("Authorization"))
        if v is None:
            return await handler(request)
        resp = error(*v)
        if v[0] == 401:
            resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    return check


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def startup_warnings(cfg: AuthConfig, host: str) -> list[str]:
    """What to warn about when the LB is reachable beyond this machine."""
    if is_loopback(host):
        return []
    out = []
    if not cfg.admin_keys:
        out.append(f"listening on {host} without an admin key: worker add/remove and /flush_cache are refused (set --admin-api-key or ${ADMIN_KEY_ENV} to use them)")
    if cfg.api_key is None:
        out.append(f"listening on {host} without --api-key: anyone who reaches this port can send generation requests")
    return out
