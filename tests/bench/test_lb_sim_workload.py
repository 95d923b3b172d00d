"""bench/lb_sim/workload.py's shared-prefix chats: seeded, Poisson conversations whose turns resend the history."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "lb_sim"))

from workload import SharedPrefixSpec, mean_shared_prefix_prompt, shared_prefix  # noqa: E402


def test_shared_prefix_turns_extend_their_history():
    spec = SharedPrefixSpec(duration=30.0, n_prefixes=4, prefix_words=50, turns=3, question_words=5, answer_words=3, turn_gap=2.0)
    a = shared_prefix(spec, 2.0, seed=7)
    assert a == shared_prefix(spec, 2.0, seed=7) and [r.at for r in a] == sorted(r.at for r in a)
    assert 100 < len(a) < 200  # ~2 conversations/s x 3 turns over 30 s, less the turns cut by the end
    heads = {" ".join(r.text.split()[:50]) for r in a}
    assert len(heads) <= 4
    by_conv: dict[int, list] = {}
    for r in a:
        by_conv.setdefault(r.conversation, []).append(r)
    for turns in by_conv.values():
        turns.sort(key=lambda r: r.turn)
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.text.startswith(prev.text) and abs(nxt.at - prev.at - 2.0) < 1e-9
            assert len(nxt.text.split()) == len(prev.text.split()) + 8
    assert mean_shared_prefix_prompt(spec) == 50 + 5 + 8 * 2 / 2
