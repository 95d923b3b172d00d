"""The token-for-token / logprob comparison that decides whether PD answered like the reference."""
import math

from e2e.compare import Generation, compare, first_mismatch, sensitivity, summarize


def gen(ids, lps, tops=None):
    return Generation(output_ids=list(ids), logprobs=list(lps), top_logprobs=tops or [])


REF = gen([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], [{5: -0.1, 9: -2.0}, {6: -0.2}, {7: -0.3}, {8: -0.4}])


def test_identical_answers_pass_bit_identical():
    d = compare("ids7", "stream", REF, gen(REF.output_ids, REF.logprobs, REF.top_logprobs))
    assert d.passed and d.ids_equal and d.first_mismatch is None
    assert d.max_abs_logprob_diff == 0 and d.max_abs_top_logprob_diff == 0
    s = summarize([d])
    assert s["verdict"] == "pass" and s["bit_identical"] is True


def test_small_logprob_noise_passes_but_is_not_bit_identical():
    d = compare("c", "nonstream", REF, gen(REF.output_ids, [-0.1, -0.2, -0.305, -0.4]))
    assert d.passed and math.isclose(d.max_abs_logprob_diff, 0.005, abs_tol=1e-9)
    assert summarize([d])["bit_identical"] is False


def test_logprob_shift_above_tolerance_fails_even_with_equal_ids():
    # what corrupted KV looks like on the sharpened models: same greedy ids, logprobs moved by ~0.35 nats
    d = compare("c", "nonstream", REF, gen(REF.output_ids, [-0.1, -0.55, -0.3, -0.4]))
    assert d.ids_equal and not d.passed
    assert summarize([d])["verdict"] == "fail"


def test_top_logprob_difference_is_checked_on_tokens_both_report():
    tops = [{5: -0.1, 9: -2.5}, {6: -0.2}, {7: -0.3}, {8: -0.4}]  # runner-up moved by 0.5
    d = compare("c", "stream", REF, gen(REF.output_ids, REF.logprobs, tops))
    assert d.max_abs_logprob_diff == 0 and math.isclose(d.max_abs_top_logprob_diff, 0.5)
    assert not d.passed


def test_differing_ids_fail_and_logprobs_compare_up_to_the_first_difference():
    got = gen([5, 6, 1, 2], [-0.1, -0.2, -0.31, -9.0])
    d = compare("c", "stream", REF, got)
    assert not d.ids_equal and d.first_mismatch == 2 and not d.passed
    # position 3 (after the split) is ignored; position 2 (same prefix) is compared
    assert math.isclose(d.max_abs_logprob_diff, 0.01, abs_tol=1e-9)


def test_shorter_answer_is_a_mismatch_at_its_end():
    assert first_mismatch([1, 2, 3], [1, 2]) == 2
    assert first_mismatch([1, 2], [1, 2]) is None
    assert not compare("c", "stream", REF, gen([5, 6], [-0.1, -0.2])).passed


def test_empty_answers_never_pass():
    d = compare("c", "stream", gen([], []), gen([], []))
    assert not d.passed
    assert summarize([]) ["verdict"] == "fail"


def test_summary_counts():
    good = compare("a", "stream", REF, gen(REF.output_ids, REF.logprobs))
    bad = compare("b", "stream", REF, gen([9], [-1.0]))
    s = summarize([good, bad])
    assert (s["cases"], s["ids_equal"], s["passed"], s["verdict"]) == (2, 1, 1, "fail")


def test_sensitivity_is_the_logprob_move_or_inf_when_the_first_token_changes():
    assert math.isclose(sensitivity(REF, gen(REF.output_ids, [-0.1, -0.6, -0.3, -0.4])), 0.4)
    assert sensitivity(REF, gen([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4])) == float("inf")
