"""The decode's lookup of a refused prefill server's ranks (adapter/server_ranks.py) runs on its scheduler thread,
and the server's answer says how many ranks there are: whatever a bootstrap server answers (huge sizes, no
answer, a byte at a time) the lookup ends within its attempts and its deadline, naming the sizes it was told.
Bootstrap servers here are stand-ins on 127.0.0.1."""

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from sglang_p2p_backend.adapter import server_ranks

DEADLINE = 1.5  # seconds; the module's own is a few seconds


class Bootstrap:
    """A stand-in bootstrap server: `sizes` for the -1 lookup; each rank answered by `rank(query)`, which
    returns (status, object) or None to hang; `trickle` sends every answer a byte every 0.2 s."""

    def __init__(self, sizes, rank=None, trickle=False):
        self.sizes, self.rank, self.trickle = sizes, rank, trickle
        self.lookups, self.stop = 0, threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.lookups += 1
                query = {k: int(v[0]) for k, v in parse_qs(urlsplit(self.path).query).items()}
                answer = (200, owner.sizes) if query["target_tp_rank"] == -1 else owner.rank(query)
                if answer is None:
                    owner.stop.wait(30)  # hangs: accepted, never answered
                    return
                body = json.dumps(answer[1]).encode()
                head = f"HTTP/1.0 {answer[0]} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                data = head.encode() + body
                if not owner.trickle:
                    self.wfile.write(data)
                    return
                for i in range(len(data)):
                    if owner.stop.wait(0.2):
                        return
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.addr = f"127.0.0.1:{self.http.server_address[1]}"

    def close(self):
        self.stop.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def bootstrap(monkeypatch):
    monkeypatch.setattr(server_ranks, "_DEADLINE_S", DEADLINE, raising=False)
    servers = []

    def start(*args, **kw):
        servers.append(Bootstrap(*args, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def sizes(dp=1, cp=1, tp=1, pp=1):
    return {"dp_size": dp, "attn_cp_size": cp, "attn_tp_size": tp, "pp_size": pp}


def timed(addr):
    t0 = time.monotonic()
    out = server_ranks.rank_endpoints(addr)
    return out, time.monotonic() - t0


def test_a_real_answer_gives_every_rank(bootstrap):
    srv = bootstrap(sizes(tp=2, pp=2), lambda q: (200, {"rank_ip": "10.0.0.1", "rank_port": 5000 + 2 * q["target_tp_rank"]
                                                        + q["target_pp_rank"]}))
    assert server_ranks.rank_endpoints(srv.addr) == ["10.0.0.1:5000", "10.0.0.1:5001", "10.0.0.1:5002", "10.0.0.1:5003"]


def test_huge_sizes_cost_a_bounded_number_of_lookups_named_in_the_warning(bootstrap, caplog):
    # every rank answers at once, "not found": only the number of attempts bounds the loop
    srv = bootstrap(sizes(dp=3, tp=400), lambda q: (404, "Bootstrap info not found"))
    with caplog.at_level(logging.WARNING, logger=server_ranks.__name__):
        out, took = timed(srv.addr)
    assert out == [] and took < DEADLINE + 1
    assert srv.lookups <= 1 + 256, srv.lookups
    assert "reports dp 3 cp 1 tp 400 pp 1 (1200 ranks)" in caplog.text


def test_a_hanging_server_costs_at_most_the_deadline(bootstrap, caplog):
    srv = bootstrap(sizes(tp=8), lambda q: None)  # the ranks' lookups never answer
    with caplog.at_level(logging.WARNING, logger=server_ranks.__name__):
        out, took = timed(srv.addr)
    assert out == [] and took < DEADLINE + 1, took
    assert "reports dp 1 cp 1 tp 8 pp 1 (8 ranks)" in caplog.text


def test_a_server_answering_a_byte_at_a_time_costs_at_most_the_deadline(bootstrap):
    srv = bootstrap(sizes(tp=2), lambda q: (200, {"rank_ip": "10.0.0.1", "rank_port": 5000}), trickle=True)
    out, took = timed(srv.addr)
    assert out == [] and took < DEADLINE + 1, took


@pytest.mark.parametrize("answer", [sizes(tp=-3), sizes(tp="8"), sizes(tp=True), sizes(dp=1 << 40), [1, 2]])
def test_malformed_sizes_are_refused_without_a_lookup(bootstrap, answer):
    srv = bootstrap(answer, lambda q: (200, {"rank_ip": "10.0.0.1", "rank_port": 5000}))
    assert server_ranks.rank_endpoints(srv.addr) == [] and srv.lookups == 1
