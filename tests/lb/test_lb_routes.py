"""End to end through real HTTP on 127.0.0.1: LB in front of simulated SGLang workers (simworker)."""

import asyncio


from lb_harness import ADMIN, ADMIN_KEY, cluster, run, wait_until
from sglang_p2p_lb.auth import AuthConfig
from sglang_p2p_lb import sse


def _rid_of_stream(raw: bytes) -> str:
    first = sse.event_payload(raw.split(b"\n\n", 1)[0])
    return first["meta_info"]["id"] if "meta_info" in first else first["id"]


def test_stream_passes_decode_bytes_unchanged():
    async def body():
        async with cluster() as c:
            for path, req in [
                ("/generate", {"text": "a b c", "sampling_params": {"max_new_tokens": 5}, "stream": True}),
                ("/v1/completions", {"model": "m", "prompt": "hello there", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
                ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}),
            ]:
                status, raw, _ = await c.post(path, req)
                assert status == 200
                sent = bytes(c.decodes[0].outputs[_rid_of_stream(raw)])
                assert raw == sent, path
                assert raw.endswith(b"data: [DONE]\n\n")
            # non-streamed answers are the decode's bytes too
            status, raw, obj = await c.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
            assert status == 200 and raw == bytes(c.decodes[0].outputs[obj["meta_info"]["id"]])
            assert obj["text"] == " tok tok" and obj["meta_info"]["prompt_tokens"] == 3

    run(body)


def test_bootstrap_fields_reach_both_workers():
    async def body():
        async with cluster() as c:
            for _ in range(3):
                status, _, _ = await c.post("/generate", {"text": "x y", "sampling_params": {"max_new_tokens": 1}})
                assert status == 200
            p, d = c.prefills[0], c.decodes[0]
            for pb, db in zip(p.stats.bodies, d.stats.bodies):
                assert pb == db  # the same body goes to both sides
                assert db["bootstrap_host"] == "127.0.0.1" and db["bootstrap_port"] == p.cfg.bootstrap_port
                assert isinstance(db["bootstrap_room"], int) and 0 <= db["bootstrap_room"] < 2**63
            assert len({b["bootstrap_room"] for b in d.stats.bodies}) == 3
            assert d.stats.missing_bootstrap == d.stats.bootstrap_failures == 0

    run(body)


def test_batch_generate_one_room_per_item():
    async def body():
        async with cluster() as c:
            status, _, out = await c.post("/generate", {"text": ["a", "b c", "d e f"], "sampling_params": {"max_new_tokens": 2}})
            assert status == 200 and [o["meta_info"]["prompt_tokens"] for o in out] == [1, 2, 3]
            db = c.decodes[0].stats.bodies[0]
            assert db["bootstrap_host"] == ["127.0.0.1"] * 3 and len(set(db["bootstrap_room"])) == 3
            # streamed batch: chunks carry their index
            status, raw, _ = await c.post("/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}, "stream": True})
            events = [sse.event_payload(e) for e in raw.split(b"\n\n") if e.strip()]
            assert status == 200 and sorted({e["index"] for e in events if e}) == [0, 1]

    run(body)


def test_logprobs_merged_like_mini_lb():
    async def body():
        async with cluster() as c:
            req = {"text": "a b", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
            status, _, out = await c.post("/generate", req)
            # prefill's two input logprobs, then the decode's own (the simulator's single [-0.25, 7])
            assert status == 200 and out["meta_info"]["input_token_logprobs"] == [[-1.0, 100, None], [-1.0, 101, None], [-0.25, 7, None]]
            status, raw, _ = await c.post("/generate", {**req, "stream": True})
            events = [sse.event_payload(e) for e in raw.split(b"\n\n") if e.strip()]
            assert status == 200 and events[-1] is None and raw.endswith(b"data: [DONE]\n\n")
            assert all(e["meta_info"]["input_token_logprobs"][:2] == [[-1.0, 100, None], [-1.0, 101, None]] for e in events[:-1])

    run(body)


def test_dp_attention_rank_fields_are_consistent():
    async def body():
        async with cluster(2, 1, prefill_sim=[{"dp_size": 4}, {"dp_size": 4}], decode_sim=[{"dp_size": 2}]) as c:
            assert [w.dp_size for w in c.lb.pool] == [4, 4, 2]  # read from /get_server_info
            results = await asyncio.gather(*(c.post("/generate", {"text": "w " * 1000, "sampling_params": {"max_new_tokens": 2}}) for _ in range(8)))
            assert all(s == 200 for s, _, _ in results)
            for p in c.prefills:
                for b in p.stats.bodies:
                    assert b["routed_dp_rank"] == b["bootstrap_room"] % 4
            dbs = c.decodes[0].stats.bodies
            assert all("routed_dp_rank" in b and b["disagg_prefill_dp_rank"] == b["bootstrap_room"] % 4 for b in dbs)
            # concurrent 500-token prompts (beyond the closeness tolerance) were spread over all 8 prefill DP ranks
            ranks = {(p.url, b["routed_dp_rank"]) for p in c.prefills for b in p.stats.bodies}
            assert len(ranks) == 8
            assert sum(p.stats.dp_mismatch for p in c.prefills) == 0 and c.decodes[0].stats.bootstrap_failures == 0

    run(body)


def test_load_aware_sends_short_prompts_away_from_a_long_prefill():
    async def body():
        sim = {"prefill_ms_per_token": 0.5}
        async with cluster(2, 1, sim=sim) as c:
            long = asyncio.create_task(c.post("/generate", {"input_ids": list(range(2000)), "sampling_params": {"max_new_tokens": 1}}))
            assert await wait_until(lambda: sum(p.stats.requests for p in c.prefills) == 1)
            busy = next(p for p in c.prefills if p.stats.requests == 1)
            shorts = await asyncio.gather(*(c.post("/generate", {"input_ids": [1] * 20, "sampling_params": {"max_new_tokens": 1}}) for _ in range(5)))
            assert all(s == 200 for s, _, _ in shorts)
            assert busy.stats.requests == 1  # all five short prompts went to the idle prefill
            assert (await long)[0] == 200

    run(body)


def test_random_policy_works_and_info_routes():
    async def body():
        async with cluster(2, 2, policy="random", auth=AuthConfig.from_keys([ADMIN_KEY], None)) as c:
            for _ in range(4):
                assert (await c.post("/generate", {"text": "q", "sampling_params": {"max_new_tokens": 1}}))[0] == 200
            status, info = await c.get("/get_server_info")
            assert status == 200 and len(info["prefill"]) == 2 and len(info["decode"]) == 2 and info["internal_states"]
            assert all(x["disaggregation_mode"] == "prefill" for x in info["prefill"])
            assert (await c.get("/get_model_info")) == (200, {"model_path": "sim-model", "tokenizer_path": "sim-model", "is_generation": True})
            status, models = await c.get("/v1/models")
            assert status == 200 and models["data"][0]["id"] == "sim-model"
            status, _, out = await c.post("/flush_cache", None, raw=b"", headers=ADMIN)
            assert status == 200 and out == {"status": "ok", "flushed": 4}
            assert all(w.stats.flushes == 1 for w in c.prefills + c.decodes)
            assert (await c.get("/health")) == (200, {"status": "ok", "healthy_prefill": 2, "degraded_prefill": 0, "healthy_decode": 2, "degraded_decode": 0})
            status, _ = await c.get("/health_generate")
            assert status == 200 and sum(d.stats.completed for d in c.decodes) == 5
            status, text = await c.get("/metrics")
            text = text.decode()
            assert 'sglang_p2p_lb_requests_total{route="generate",status="200"} 5.0' in text
            assert "sglang_p2p_lb_worker_healthy{" in text

    run(body)


def test_workers_added_and_removed_at_run_time():
    async def body():
        async with cluster(1, 1, auth=AuthConfig.from_keys([ADMIN_KEY], None)) as c:
            extra = c.prefills[0].__class__(c.prefills[0].cfg.__class__(role="prefill", record_output=True))
            await extra.start()
            try:
                new = {"url": extra.url, "role": "prefill", "bootstrap_port": extra.cfg.bootstrap_port}
                status, _, out = await c.post("/workers", new, headers=ADMIN)
                assert status == 200 and out["worker"]["healthy"] is True
                assert (await c.post("/workers", new, headers=ADMIN))[0] == 409
                assert (await c.post("/workers", {"url": "nope", "role": "prefill"}, headers=ADMIN))[0] == 400
                assert (await c.post("/workers", {"url": extra.url, "role": "router"}, headers=ADMIN))[0] == 400
                status, listing = await c.get("/workers")
                assert [w["url"] for w in listing["workers"] if w["role"] == "prefill"] == [c.prefills[0].url, extra.url]
                # remove the original prefill: all traffic goes to the new one
                async with c.http.delete(c.url + "/workers", params={"url": c.prefills[0].url}, headers=ADMIN) as r:
                    assert r.status == 200
                for _ in range(3):
                    assert (await c.post("/generate", {"text": "z", "sampling_params": {"max_new_tokens": 1}}))[0] == 200
                assert c.prefills[0].stats.requests == 0 and extra.stats.requests == 3
                async with c.http.delete(c.url + "/workers", params={"url": c.prefills[0].url}, headers=ADMIN) as r:
                    assert r.status == 404
            finally:
                await extra.stop()

    run(body)
