"""The p2pnccl bootstrap server (SGLang's class from its registry, over real HTTP on 127.0.0.1) counts only real
ranks towards readiness: a DP rank outside the server's DP size is refused naming the rank and the size, and a
rank registered twice counts once. Otherwise the server reports ready with a real rank missing, and decodes
looking that rank up get 404 (no such rank) where 503 (not ready yet, ask again) is the truth."""

import pytest
import requests

import test_bootstrap_server as bootstrap_tests
from sglang_p2p_backend.testing.launch import free_port

# the registration body and the fixture starting the class SGLang's registry hands out for p2pnccl
rank, server = bootstrap_tests.rank, bootstrap_tests.server

pytestmark = [pytest.mark.sglang]


def route(url: str, tp_rank: int, dp_rank: int = 0) -> requests.Response:
    return requests.get(f"{url}/route", params={"prefill_dp_rank": dp_rank, "prefill_cp_rank": 0,
                                                "target_tp_rank": tp_rank, "target_pp_rank": 0}, timeout=5)


def put(url: str, body: dict) -> requests.Response:
    return requests.put(f"{url}/route", json=body, timeout=5)


def test_a_dp_rank_outside_the_servers_dp_size_is_refused_naming_rank_and_size(server):
    url, srv = server()
    ports = free_port(), free_port()
    assert put(url, rank(ports[0], 0)).status_code == 200  # attention TP 2, DP 1
    r = put(url, rank(ports[1], 1, attn_dp_rank=9))
    assert r.status_code == 400 and "'attn_dp_rank' = 9 is outside 0..0 (attn_dp_size 1)" in r.text, r.text
    # with system DP, SGLang files the rank under system_dp_rank: that one is bounded by system_dp_size
    r = put(url, rank(ports[1], 1, system_dp_size=2, system_dp_rank=2))
    assert r.status_code == 400 and "'system_dp_rank' = 2 is outside 0..1 (system_dp_size 2)" in r.text, r.text
    # tp1 is still missing: not ready (ask again), not "no such rank"
    assert route(url, 1).status_code == 503 and route(url, 1, dp_rank=9).status_code == 503
    # SGLang's own DP-attention registration (a system DP rank with system_dp_size 1) is still taken
    assert put(url, rank(ports[1], 1, system_dp_rank=3)).status_code == 200
    assert route(url, 1).json() == {"rank_ip": "127.0.0.1", "rank_port": ports[1]}
    assert srv._registered_count == 2


def test_a_rank_registered_again_counts_once(server):
    url, srv = server()
    ports = free_port(), free_port()
    for _ in range(3):  # SGLang's retries, or anyone without the key
        assert put(url, rank(ports[0], 0)).status_code == 200
    assert srv._registered_count == 1
    r = route(url, 1)
    assert r.status_code == 503 and "(1 workers registered)" in r.text, r.text
    assert put(url, rank(ports[1], 1)).status_code == 200
    assert [route(url, tp).json()["rank_port"] for tp in (0, 1)] == list(ports)
    assert srv._registered_count == 2
