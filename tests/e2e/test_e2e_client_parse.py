"""Reading SGLang's /generate answers (non-streaming, streamed cumulatively or per chunk) into Generations."""
from e2e.client import generate_payload, generation_from_meta, merge_stream_items, random_prompts


def meta(ids, lps, completion=None):
    return {"output_token_logprobs": [[lp, i, None] for i, lp in zip(ids, lps)],
            "output_top_logprobs": [[[lp, i, None], [lp - 1, i + 1, None]] for i, lp in zip(ids, lps)],
            "completion_tokens": len(ids) if completion is None else completion, "finish_reason": {"type": "length"}}


def test_generation_from_meta_reads_ids_logprobs_and_top_k():
    g = generation_from_meta(meta([7, 8], [-0.5, -0.25]), "ab")
    assert g.output_ids == [7, 8] and g.logprobs == [-0.5, -0.25] and g.text == "ab"
    assert g.top_logprobs == [{7: -0.5, 8: -1.5}, {8: -0.25, 9: -1.25}]
    assert g.completion_tokens == 2


def test_stream_with_cumulative_lists_uses_the_last_chunk():
    chunks = [{"text": "a", "meta_info": meta([7], [-0.5], 1)},
              {"text": "ab", "meta_info": meta([7, 8], [-0.5, -0.25], 2)}]
    g = merge_stream_items(chunks)
    assert g.output_ids == [7, 8] and g.text == "ab"


def test_stream_with_per_chunk_lists_concatenates_them():
    chunks = [{"text": "a", "meta_info": meta([7], [-0.5], 1)},
              {"text": "b", "meta_info": meta([8], [-0.25], 2)}]
    g = merge_stream_items(chunks)
    assert g.output_ids == [7, 8] and g.logprobs == [-0.5, -0.25] and g.text == "ab"
    assert len(g.top_logprobs) == 2


def test_payloads_for_ids_and_text_prompts():
    p = generate_payload([1, 2, 3], 8, logprobs=True, stream=True)
    assert p["input_ids"] == [1, 2, 3] and p["stream"] is True and p["return_logprob"] is True
    assert p["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    t = generate_payload("hi", 4, logprobs=False, stream=False)
    assert t["text"] == "hi" and "return_logprob" not in t


def test_random_prompts_are_reproducible_distinct_and_avoid_special_ids():
    a, b = random_prompts(2, 50, seed=3), random_prompts(2, 50, seed=3)
    assert a == b and a[0] != a[1] and all(3 <= t < 4096 for p in a for t in p)
