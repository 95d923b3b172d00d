"""Prefix-aware scoring (prefix_policy.py, prefix_tree.py) and the simulator's radix-cache model: which
prefill wins for which prompts and loads."""

import random

import pytest

from lb_harness import cluster, run
from sglang_p2p_lb.policy import PairContext
from sglang_p2p_lb.policy_registry import make_policy
from sglang_p2p_lb.prefix_policy import CacheAwarePolicy, PrefixAwarePolicy, PrefixParams, imbalanced
from sglang_p2p_lb.prefix_tree import BLOCK_BYTES, PrefixTree, block_hashes
from sglang_p2p_lb.workers import Lease, Worker

SYSTEM = ("You are a careful assistant. " * 40).encode()  # ~1.1 kB shared prefix


def P(i):
    return Worker(f"http://10.0.0.{i}:30000", "prefill", 8998, node="n")


def D(i):
    return Worker(f"http://10.0.1.{i}:30000", "decode", node="n")


def ctx(prompt: bytes) -> PairContext:
    return PairContext(tokens=len(prompt) // 4, prompt=prompt)


def test_block_hashes_name_whole_prefixes():
    a, b = b"x" * 200, b"x" * 128 + b"y" * 72
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 200 // BLOCK_BYTES == 3
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    # the same block after a different prefix is a different node
    assert block_hashes(b"z" * 64 + b"x" * 64)[1] != ha[1]
    assert block_hashes([1, 2, 3, 4], 2) == block_hashes([1, 2, 3, 4, 5], 2)


def test_tree_match_insert_and_lru_evicts_leaves_first():
    t = PrefixTree(max_size=4)
    h = block_hashes(b"a" * 64 * 6)
    t.insert(h[:3], "w1")
    assert t.match(h, "w1") == 3 and t.match(h, "w2") == 0
    t.insert(h, "w1")  # 6 entries: above max_size, below the hard bound
    assert t.size("w1") == 6
    assert t.evict() == 2 and t.size("w1") == 4
    assert t.match(h, "w1") == 4  # the prefix survived, the two deepest blocks went
    t.retain(["w2"])
    assert t.tenants() == []
    for k in range(20):  # the hard bound holds without any evict() call
        t.insert(block_hashes(bytes([k]) * 64 * 3), "w3")
        assert t.size("w3") <= 8


def test_prefix_aware_follows_the_cached_prefix_when_loads_are_even():
    ps, ds = [P(1), P(2)], [D(1)]
    pol = PrefixAwarePolicy(rng=random.Random(0))
    first = pol.choose(ps, ds, ctx(SYSTEM + b"question one, which is about apples?"))
    again = [pol.choose(ps, ds, ctx(SYSTEM + f"another question number {k} about pears".encode())).prefill for k in range(5)]
    assert all(p is first.prefill for p in again)
    # the expected hit is what the lease puts on the prefill's books
    c = pol.choose(ps, ds, ctx(SYSTEM + b"third"))
    assert c.prefill_tokens is not None and c.prefill_tokens < ctx(SYSTEM + b"third").tokens // 4


def test_prefix_aware_spills_a_hot_prefix_when_its_holder_is_busy():
    ps, ds = [P(1), P(2)], [D(1)]
    pol = PrefixAwarePolicy(rng=random.Random(0))
    holder = pol.choose(ps, ds, ctx(SYSTEM + b"q0")).prefill
    other = ps[1] if holder is ps[0] else ps[0]
    prompt = SYSTEM + b"q1"
    tokens = ctx(prompt).tokens
    # queue on the holder smaller than the work the hit saves: stay
    Lease(holder, ds[0], 0, 0, tokens // 2, 1)
    assert pol.choose(ps, ds, ctx(prompt)).prefill is holder
    # queue beyond the saving: a cold server finishes first
    Lease(holder, ds[0], 0, 0, 3 * tokens, 1)
    assert pol.choose(ps, ds, ctx(prompt)).prefill is other


def test_cached_token_cost_spills_a_holder_that_sends_most_of_the_kv():
    """A hit still sends the whole prompt's KV from its holder: with --cached-token-cost the holder's hits count
    in its load and the prefix spills once that load passes a miss elsewhere; without it every hit stays."""
    prefix = SYSTEM * 4  # ~1.1k tokens, past the 256-token tolerance within which the longer hit wins
    placed = {}
    for cost in (0.0, 0.5):
        ps, ds = [P(1), P(2)], [D(1)]
        pol = PrefixAwarePolicy(PrefixParams(cached_cost=cost), rng=random.Random(0))
        holder = pol.choose(ps, ds, ctx(prefix + b"q")).prefill
        Lease(holder, ds[0], 0, 0, ctx(prefix + b"q").tokens, 1)
        first_hit = None  # (prefill work charged, prompt tokens) of the first hit on the holder
        for k in range(8):  # none finishes: each stays on its prefill's books
            c = ctx(prefix + f"question {k}".encode())
            choice = pol.choose(ps, ds, c)
            if first_hit is None and choice.prefill is holder and choice.prefill_tokens is not None:
                first_hit = (choice.prefill_tokens, c.tokens)
            Lease(choice.prefill, ds[0], 0, 0, c.tokens, 1, p_tokens=choice.prefill_tokens)
        placed[cost] = (holder.inflight_reqs[0], sum(p.inflight_reqs[0] for p in ps if p is not holder))
        if cost:  # a hit is charged its uncached tokens and half the cached ones
            work, tokens = first_hit
            assert tokens // 2 - 64 <= work <= tokens // 2 + 64, (work, tokens)
    assert placed[0.0] == (9, 0)  # the first request and all eight hits
    # the second prefill took a miss once the holder's charged hits passed it, then held the prefix too: shared
    held, other = placed[0.5]
    assert held + other == 9 and other >= 3 and abs(held - other) <= 1, placed
    with pytest.raises(ValueError, match="cached token cost"):
        PrefixParams(cached_cost=1.5)


def test_prefix_aware_ignores_short_matches_and_imbalance():
    ps, ds = [P(1), P(2)], [D(1)]
    pol = PrefixAwarePolicy(PrefixParams(cache_threshold=0.9, balance_abs_threshold=4, balance_rel_threshold=1.5), rng=random.Random(0))
    holder = pol.choose(ps, ds, ctx(SYSTEM)).prefill
    other = ps[1] if holder is ps[0] else ps[0]
    Lease(holder, ds[0], 0, 0, 300, 1)
    # the shared part is ~50% of this prompt, under the 0.9 threshold: pure load sends it elsewhere
    assert pol.choose(ps, ds, ctx(SYSTEM + b"u" * len(SYSTEM))).prefill is other
    assert imbalanced([10, 2], 4, 1.5) and not imbalanced([10, 7], 4, 1.5) and not imbalanced([5, 0], 8, 1.5)


def test_load_aware_ignores_the_prefix():
    ps, ds = [P(1), P(2)], [D(1)]
    pol = make_policy("load_aware", random.Random(0))
    picks = set()
    for k in range(6):
        c = pol.choose(ps, ds, ctx(SYSTEM + b"q"))
        picks.add(c.prefill.url)
        Lease(c.prefill, ds[0], 0, 0, ctx(SYSTEM).tokens, 1)  # never released: load alternates the choice
    assert len(picks) == 2


def test_cache_aware_baseline_picks_longest_match_or_smallest_tree():
    ps, ds = [P(1), P(2)], [D(1)]
    pol = CacheAwarePolicy(rng=random.Random(0))
    a = pol.choose(ps, ds, ctx(SYSTEM + b"x")).prefill
    assert pol.choose(ps, ds, ctx(SYSTEM + b"y")).prefill is a  # match share over 0.3
    b = pol.choose(ps, ds, ctx(b"unrelated text " * 20)).prefill
    assert b is not a  # no match: the smaller tree


def test_eviction_runs_on_the_interval():
    now = [0.0]
    pol = PrefixAwarePolicy(PrefixParams(eviction_interval=10, max_tree_size=2), clock=lambda: now[0])
    ps, ds = [P(1)], [D(1)]
    pol.choose(ps, ds, ctx(b"a" * 64 * 3))
    assert pol.tree.size((ps[0].url, 0)) == 3
    now[0] = 11.0
    pol.choose(ps, ds, ctx(b"b" * 10))
    assert pol.tree.size((ps[0].url, 0)) == 2
    # a worker gone from the routable set is forgotten at the next round
    now[0] = 22.0
    pol.choose([P(2)], ds, ctx(b"c" * 10))
    assert pol.tree.tenants() == []


def test_sim_radix_cache_reports_cached_tokens_and_speeds_up_prefill():
    async def body():
        sim = {"prefix_cache_tokens": 10_000, "page_tokens": 4}
        async with cluster(1, 1, sim=sim, policy="prefix_aware") as c:
            words = " ".join(f"w{i}" for i in range(40))
            _, _, first = await c.post("/generate", {"text": words + " end", "sampling_params": {"max_new_tokens": 1}})
            _, _, second = await c.post("/generate", {"text": words + " other ending", "sampling_params": {"max_new_tokens": 1}})
            assert first["meta_info"]["cached_tokens"] == 0
            assert second["meta_info"]["cached_tokens"] == 40  # ten full 4-token pages of the shared 40 words
            st = c.prefills[0].stats
            assert st.prompt_tokens == 41 + 42 and st.cached_tokens == 40

    run(body)
