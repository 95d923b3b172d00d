"""Request validation and sizing (payload.py), bootstrap injection (bootstrap.py), CLI parsing (cli.py)."""


import pytest

from sglang_p2p_lb import cli, payload
from sglang_p2p_lb.bootstrap import ROOM_LIMIT, build_bodies, new_room
from sglang_p2p_lb.policy import Choice
from sglang_p2p_lb.workers import Worker


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
    ],
)
def test_parse_rejects_non_objects(raw, reason):
    with pytest.raises(payload.BadRequest, match=reason):
        payload.parse_json_object(raw)


@pytest.mark.parametrize(
    "body, reason",
    [
        ({}, "needs 'text', 'input_ids'"),
        ({"text": 3}, "'text' must be a string"),
        ({"text": []}, "'text' must be a string"),
        ({"text": ["a", 1]}, "'text' must be a string"),
        ({"input_ids": [[1], 2]}, "'input_ids' must be"),
        ({"input_ids": []}, "'input_ids' must be"),
    ],
)
def test_generate_body_errors(body, reason):
    with pytest.raises(payload.BadRequest, match=reason):
        payload.prompt_tokens(payload.GENERATE, body)


def test_batch_size_follows_mini_lb():
    assert payload.generate_batch_size({"text": "a"}) is None
    assert payload.generate_batch_size({"text": ["a", "b", "c"]}) == 3
    assert payload.generate_batch_size({"input_ids": [1, 2]}) is None
    assert payload.generate_batch_size({"input_ids": [[1], [2, 3]]}) == 2


def test_prompt_tokens_estimates():
    # 4 UTF-8 bytes per token, rounded up
    assert payload.prompt_tokens(payload.GENERATE, {"text": "x" * 9}) == 3
    assert payload.prompt_tokens(payload.GENERATE, {"text": ["abcd", "abcdefgh"]}) == 3
    assert payload.prompt_tokens(payload.GENERATE, {"input_ids": [[1, 2], [3, 4, 5]]}) == 5
    assert payload.prompt_tokens(payload.COMPLETIONS, {"prompt": [1, 2, 3]}) == 3
    assert payload.prompt_tokens(payload.CHAT, {"messages": [{"role": "user", "content": "abcdefgh"}]}) == 2 + payload.CHAT_TOKENS_PER_MESSAGE
    with pytest.raises(payload.BadRequest, match="'messages'"):
        payload.prompt_tokens(payload.CHAT, {"messages": "hi"})
    with pytest.raises(payload.BadRequest, match="'prompt'"):
        payload.prompt_tokens(payload.COMPLETIONS, {"prompt": {"a": 1}})
    with pytest.raises(payload.BadRequest, match="'stream' must be a boolean"):
        payload.is_stream({"stream": "yes"})


def _pair(p_dp=1, d_dp=1, p_rank=None, d_rank=None):
    p = Worker("http://10.0.0.5:30000", "prefill", 8998, dp_size=p_dp)
    d = Worker("http://10.0.0.9:30000", "decode", dp_size=d_dp)
    return Choice(p, d, p_rank, d_rank)


def test_bootstrap_single_same_body_both_sides():
    body = {"text": "hi", "stream": True}
    pb, db, rooms = build_bodies(body, _pair(), None, dp_fields=True)
    assert pb is db and body == {"text": "hi", "stream": True}
    assert pb == {"text": "hi", "stream": True, "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": rooms[0]}
    assert 0 <= rooms[0] < ROOM_LIMIT


def test_bootstrap_batch_lists_with_fresh_rooms():
    pb, db, rooms = build_bodies({"text": ["a", "b", "c"]}, _pair(), 3, dp_fields=True)
    assert pb["bootstrap_host"] == ["10.0.0.5"] * 3 and pb["bootstrap_port"] == [8998] * 3
    assert pb["bootstrap_room"] == rooms and len(set(rooms)) == 3


def test_bootstrap_dp_rank_fields():
    pb, db, rooms = build_bodies({"text": "a"}, _pair(p_dp=24, d_dp=32, p_rank=5, d_rank=17), None, dp_fields=True)
    assert rooms[0] % 24 == 5
    assert pb["routed_dp_rank"] == 5 and pb["disagg_prefill_dp_rank"] == 5
    assert db["routed_dp_rank"] == 17 and db["disagg_prefill_dp_rank"] == 5
    assert pb["bootstrap_room"] == db["bootstrap_room"]
    # a policy that names no rank (random, round_robin): the room's rank, told to both sides
    pb, db, rooms = build_bodies({"text": "a"}, _pair(p_dp=24, d_dp=1), None, dp_fields=True)
    assert pb["routed_dp_rank"] == pb["disagg_prefill_dp_rank"] == db["disagg_prefill_dp_rank"] == rooms[0] % 24
    assert "routed_dp_rank" not in db
    # a batch with no chosen rank: every item follows its own room, no rank field
    pb, db, rooms = build_bodies({"text": ["a", "b"]}, _pair(p_dp=24), 2, dp_fields=True)
    assert not {"routed_dp_rank", "disagg_prefill_dp_rank"} & (set(pb) | set(db))
    # with DP fields off, nothing but the three bootstrap fields is added
    pb, db, _ = build_bodies({"text": "a"}, _pair(p_dp=24, d_dp=32, p_rank=5, d_rank=17), None, dp_fields=False)
    assert set(pb) == set(db) == {"text", "bootstrap_host", "bootstrap_port", "bootstrap_room"}


def test_new_room_rank_and_range():
    for rank in (0, 7, 23):
        for _ in range(200):
            r = new_room(24, rank)
            assert r % 24 == rank and 0 <= r < ROOM_LIMIT


def test_ipv6_bootstrap_host():
    w = Worker("http://[fd00::1]:30000", "prefill", 8998)
    assert w.bootstrap_host == "[fd00::1]"


def test_cli_prefill_groups_both_styles():
    parse = cli.parse_prefill_groups
    assert parse([["http://a:1", "8998"], ["http://b:2"]]) == [("http://a:1", 8998), ("http://b:2", None)]
    assert parse([["http://a:1", "none"]]) == [("http://a:1", None)]
    assert parse([["http://a:1", "http://b:2"]]) == [("http://a:1", None), ("http://b:2", None)]
    with pytest.raises(ValueError, match="does not follow"):
        parse([["8998"]])
    with pytest.raises(ValueError, match="does not follow"):
        parse([["http://a:1", "1", "2"]])
    with pytest.raises(ValueError, match="http://host:port"):
        parse([["a:1"]])


def test_cli_config_and_errors(capsys):
    args = cli.build_parser().parse_args(
        ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "8998", "--decode", "http://127.0.0.1:2", "--port", "9", "--policy", "random", "--node", "http://127.0.0.1:2=n1"]
    )
    cfg = cli.config_from_args(args)
    assert cfg.prefills == [("http://127.0.0.1:1", 8998)] and cfg.decodes == ["http://127.0.0.1:2"]
    assert cfg.policy == "random" and cfg.port == 9 and cfg.nodes == {"http://127.0.0.1:2": "n1"}
    with pytest.raises(SystemExit):
        cli.main(["--prefill", "http://127.0.0.1:1"])
    assert "need at least one --prefill and one --decode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--prefill", "http://a:1", "--decode", "http://b:2", "--policy", "least_surprise"])
