"""The control endpoints of every rank of a prefill server, read from its bootstrap server.

SGLang's decode reads them per request once its checks of the prefill server passed. When those checks refuse
the server (page size, KV dtype), the decode still needs them once: to register with each rank anyway, so the
prefill refuses it too, naming both values, and fails its side of the requests instead of waiting for
SGLang's bootstrap timeout. Bounded: a server of more ranks than `_MAX_RANKS` is told through its first ones.
"""

from __future__ import annotations

import logging

import requests

logger = logging.getLogger(__name__)

_MAX_RANKS = 256
_TIMEOUT_S = 2.0


def _get(url: str) -> dict:
    response = requests.get(url, timeout=_TIMEOUT_S)
    response.raise_for_status()
    data = response.json()
    if not isinstance(data, dict):
        raise ValueError(f"{url} answered {type(data).__name__}, not an object")
    return data


def rank_endpoints(bootstrap_addr: str) -> list[str]:
    """"ip:port" of every registered prefill rank of the server at `bootstrap_addr` (empty when unreachable)."""
    base = f"http://{bootstrap_addr}/route"
    try:
        info = _get(f"{base}?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
        sizes = [int(info.get(k) or 1) for k in ("dp_size", "attn_cp_size", "attn_tp_size", "pp_size")]
    except (requests.RequestException, ValueError, TypeError) as e:
        logger.warning("p2pnccl: cannot read the ranks of prefill server %s: %s", bootstrap_addr, e)
        return []
    out: list[str] = []
    dp, cp, tp, pp = sizes
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                for p in range(pp):
                    if len(out) >= _MAX_RANKS:
                        return out
                    try:
                        rank = _get(f"{base}?prefill_dp_rank={d}&prefill_cp_rank={c}&target_tp_rank={t}&target_pp_rank={p}")
                        out.append(f"{rank['rank_ip']}:{int(rank['rank_port'])}")
                    except (requests.RequestException, ValueError, TypeError, KeyError) as e:
                        logger.warning("p2pnccl: prefill server %s has no rank dp%d cp%d tp%d pp%d: %s",
                                       bootstrap_addr, d, c, t, p, e)
    return out
