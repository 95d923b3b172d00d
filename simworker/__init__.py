"""Simulated SGLang PD worker. It STANDS IN FOR GPU SERVERS in the LB's tests and benchmarks; it runs no model.

Test and benchmark support, not part of the shipped package: run it from the repository root as
`python -m simworker --role prefill|decode --port N ...` (cli.py), or in-process as `SimWorker(SimConfig(...))`.

One process plays one SGLang server in prefill or decode disaggregation mode and serves the HTTP surface
a router touches: `/generate` (text or input_ids, single or batch, streamed or not), `/v1/completions`,
`/v1/chat/completions` (OpenAI shapes, streaming with usage), `/v1/models`, `/health`, `/health_generate`,
`/get_server_info`, `/get_model_info`, `/get_load` (legacy list) and `/v1/loads` (SGLang 0.5.23 shape),
`/flush_cache`, plus `/stats` and `POST /admin` (fault injection) for tests.

Timing model (the knobs are command-line flags):
* prefill: each DP rank is a FIFO with `--prefill-concurrency` slots; a request holds a slot for
  `prefill_base_ms + prompt_tokens * prefill_ms_per_token` (compute bound, so a long prompt delays the
  requests queued behind it), then its KV is "transferred" (`transfer_ms`) and the prefill answers with
  one generated token, as SGLang's prefill does.
* decode: needs `bootstrap_host`, `bootstrap_port`, `bootstrap_room` (400 otherwise) and does what a real
  decode does with them: it asks the prefill's bootstrap server for the room. The prefill worker runs that
  bootstrap server on `--bootstrap-port` with one route, `GET /wait_room?room=R[&dp_rank=K]`, a long poll
  that answers 200 once the prefill with that room has transferred its KV, 500 when that prefill failed or
  was cancelled, 409 when `dp_rank` is not the rank holding the room, 408 after `--bootstrap-timeout`.
  Then it emits `max_new_tokens` tokens, one every `decode_ms_per_token * (1 + decode_slowdown *
  (running - 1))` ms, so decode speed falls with the requests running on that DP rank.
* DP attention (`--dp-size N`): the prefill rank is `routed_dp_rank` when given, else `bootstrap_room % N`
  (SGLang's `follow_bootstrap_room`); a `routed_dp_rank` that contradicts the room fails the request with
  400, as SGLang 0.5.23 does. A decode rank is `routed_dp_rank` when given, else round robin.

Radix cache (`--prefix-cache-tokens N`, off by default): each prefill DP rank models SGLang's radix cache
as an LRU prefix tree of `--page-tokens` pages (radix.py, on sglang_p2p_lb's prefix_tree) holding at most N tokens. When a request
gets its slot, the pages of its prompt already cached are skipped (prefill time counts only the uncached
tokens, at least one), and its pages are inserted after the prefill. The prefill reports
`num_waiting_uncached_tokens` accordingly, counts `prompt_tokens` / `cached_tokens` in `/stats`, and the
decode's answer carries the prefill's `meta_info.cached_tokens` (passed through the bootstrap server).

Token counting (prompts.py; deterministic, documented so tests can compute it): `input_ids` count one token per id;
text counts one token per whitespace-separated word (at least 1); a chat request counts its message texts
plus 4 tokens per message. Every generated token is the text " tok" with id 1000 + position.
"""

from .config import SimConfig
from .worker import SimWorker

__all__ = ["SimConfig", "SimWorker"]
