"""The p2pnccl bootstrap server (SGLang's, guarded) over real HTTP on 127.0.0.1: malformed requests get a 4xx
naming the field, a stranger cannot re-point a live prefill rank, and with a key every write must be signed.
SGLang's own routes and answers are unchanged for well-formed requests."""

import socket
import time

import pytest
import requests

from sglang_p2p_backend.testing.launch import free_port

pytestmark = [pytest.mark.sglang]

KEY = "0123456789abcdef-bootstrap-key"


def rank(port: int, tp_rank: int = 0, ip: str = "127.0.0.1", **kw) -> dict:
    return {"attn_tp_size": 2, "attn_tp_rank": tp_rank, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
            "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": ip, "rank_port": port, "page_size": 16, "kv_cache_dtype": "bfloat16", **kw}


@pytest.fixture
def server(monkeypatch):
    """Start the class SGLang's registry hands out for p2pnccl; yields (base url, server, start) ."""
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins import load_plugins

    from sglang_p2p_backend import plugin

    load_plugins()
    plugin.load()  # what the plugin entry point does in a server process
    started = []

    def start(key=None):
        if key:
            monkeypatch.setenv("SGLANG_P2P_AUTH_KEY", key)
        else:
            monkeypatch.delenv("SGLANG_P2P_AUTH_KEY", raising=False)
        port = free_port()
        cls = utils.get_kv_class(utils.TransferBackend("p2pnccl"), utils.KVClassType.BOOTSTRAP_SERVER)
        srv = cls(host="127.0.0.1", port=port)
        started.append(srv)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                requests.get(f"{url}/health", timeout=1)
                return url, srv
            except requests.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("bootstrap server did not start")

    yield start
    for srv in started:
        srv.close()


@pytest.fixture
def live_rank():
    """A listening socket standing for a live prefill rank's control socket."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def lookup(url: str, tp_rank: int) -> dict:
    r = requests.get(f"{url}/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": tp_rank,
                                             "target_pp_rank": 0}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("method,path,body,needle", [
    ("PUT", "/route", b"not json", "not JSON"),
    ("PUT", "/route", b"[1, 2]", "JSON object"),
    ("PUT", "/route", {k: v for k, v in rank(5000).items() if k != "rank_port"}, "'rank_port' is missing"),
    ("PUT", "/route", rank("5000"), "'rank_port' must be an integer"),
    ("PUT", "/route", rank(5000, tp_rank=2), "'attn_tp_rank' = 2 is outside 0..1"),
    ("PUT", "/route", rank(5000, ip="bad host!"), "'rank_ip'"),
    ("PUT", "/route", rank(5000, page_size=0), "'page_size' = 0"),
    ("GET", "/route?prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", None, "'prefill_dp_rank'"),
    ("POST", "/register_dp_rank", {"bootstrap_room": "abc", "dp_rank": 0}, "'bootstrap_room' must be an integer"),
    ("POST", "/register_dp_rank", {"bootstrap_room": 1}, "'dp_rank' is missing"),
    ("POST", "/query_dp_ranks", {"bootstrap_rooms": "12"}, "'bootstrap_rooms'"),
    ("POST", "/query_dp_ranks", {"bootstrap_rooms": [{"x": 1}]}, "'bootstrap_rooms'"),
])
def test_malformed_requests_get_400_naming_the_field(server, method, path, body, needle):
    url, _ = server()
    kw = {"json": body} if isinstance(body, (dict, list)) else {"data": body}
    r = requests.request(method, url + path, timeout=5, **kw)
    assert r.status_code == 400 and needle in r.text, (r.status_code, r.text)


def test_well_formed_requests_get_sglangs_answers(server, live_rank):
    url, _ = server()
    port = live_rank.getsockname()[1]
    for tp in (0, 1):
        assert requests.put(f"{url}/route", json=rank(port, tp), timeout=5).status_code == 200
    assert lookup(url, 1) == {"rank_ip": "127.0.0.1", "rank_port": port}
    assert requests.post(f"{url}/register_dp_rank", json={"bootstrap_room": 7, "dp_rank": 0}, timeout=5).status_code == 200
    assert requests.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [7, 8]}, timeout=5).json() == {"7": 0}


def test_a_stranger_cannot_repoint_a_live_rank(server, live_rank):
    url, srv = server()
    port = live_rank.getsockname()[1]
    assert requests.put(f"{url}/route", json=rank(port, 0), timeout=5).status_code == 200
    # another address for the same rank while its prefill answers: refused, the route unchanged
    r = requests.put(f"{url}/route", json=rank(free_port(), 0), timeout=5)
    assert r.status_code == 409 and "which is alive" in r.text, r.text
    # sizes other than the server's: refused
    r = requests.put(f"{url}/route", json={**rank(free_port(), 1), "attn_tp_size": 4}, timeout=5)
    assert r.status_code == 409 and "attn_tp_size 4 differs" in r.text, r.text
    assert requests.put(f"{url}/route", json=rank(port, 1), timeout=5).status_code == 200
    assert lookup(url, 0)["rank_port"] == port
    # the prefill is gone (its socket closed): a restarted rank at another address registers
    live_rank.close()
    moved = free_port()
    assert requests.put(f"{url}/route", json=rank(moved, 0), timeout=5).status_code == 200
    assert lookup(url, 0)["rank_port"] == moved


def test_with_a_key_every_write_must_be_signed(server, live_rank):
    from sglang.srt.disaggregation.common import conn as common_conn

    from sglang_p2p_backend.adapter.bootstrap import SIGNATURE_HEADER, signed_writes

    url, _ = server(KEY)
    port = live_rank.getsockname()[1]
    for path, body in (("/route", rank(port, 0)), ("/register_dp_rank", {"bootstrap_room": 7, "dp_rank": 0})):
        method = "PUT" if path == "/route" else "POST"
        r = requests.request(method, url + path, json=body, timeout=5)
        assert r.status_code == 401 and "SGLANG_P2P_AUTH_KEY" in r.text, r.text
        forged = requests.request(method, url + path, json=body, headers={SIGNATURE_HEADER: f"{int(time.time())}:00"}, timeout=5)
        assert forged.status_code == 401
    r = requests.get(f"{url}/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0, "target_tp_rank": 0,
                                             "target_pp_rank": 0}, timeout=5)
    assert r.status_code == 503, r.text  # nothing registered: the unsigned PUT changed nothing
    # what the prefill's SGLang code sends (module-level requests.put / post) is signed within signed_writes
    with signed_writes(KEY.encode()):
        assert common_conn.requests.put(f"{url}/route", json=rank(port, 0), timeout=5).status_code == 200
        assert common_conn.requests.put(f"{url}/route", json=rank(port, 1), timeout=5).status_code == 200
        assert common_conn.requests.post(f"{url}/register_dp_rank", json={"bootstrap_room": 7, "dp_rank": 0},
                                         timeout=5).status_code == 200
    assert common_conn.requests is requests
    assert lookup(url, 1)["rank_port"] == port
    # a signature made with another key is refused
    with signed_writes(b"another-key-0123456789"):
        assert common_conn.requests.put(f"{url}/route", json=rank(free_port(), 0), timeout=5).status_code == 401
