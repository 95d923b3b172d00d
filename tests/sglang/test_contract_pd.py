"""SGLang 0.5.23's wider contract between a prefill and a decode process (driver processes on 127.0.0.1, CPU
transports): layout labels both roles must share, and what travels in the aux buffers."""

import pytest
from test_pd_transfer import FAST_FAILURE_ENV, failed_reason

from sglang_p2p_backend.testing.launch import run_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

POOL = {"layout": "mla", "num_layers": 4, "page_size": 1, "num_pages": 300}


# prefill layout, decode layout, both as p2pnccl names them, and what SGLang's own check of the prefill server
# (0.5.23, on the decode) names when both are set; with one unset it checks nothing and p2pnccl's agreement does
LAYOUTS = [
    pytest.param("flashmla", "fp8_ds_mla", "prefill 'flashmla', decode 'fp8_ds_mla'",
                 "prefill server has kv_layout=flashmla, but decode server has kv_layout=fp8_ds_mla", id="both-set"),
    pytest.param(None, "fp8_ds_mla", "prefill none, decode 'fp8_ds_mla'", None, id="prefill-unset"),
]


def sglang_checks_kv_layout() -> bool:
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    return hasattr(CommonKVManager, "kv_layout")


@pytest.mark.parametrize("prefill_layout,decode_layout,both,sglang_names", LAYOUTS)
def test_kv_layout_mismatch_is_refused_on_both_sides_naming_both_layouts(prefill_layout, decode_layout, both,
                                                                        sglang_names):
    plan = {
        "pool": POOL,
        "requests": [{"room": 401, "tokens": 40, "chunk_pages": 8}, {"room": 402, "tokens": 9}],
        "kv_layout": {"prefill": prefill_layout, "decode": decode_layout},
        "deadline_s": 40,
    }
    result = run_pair(plan, env=FAST_FAILURE_ENV)
    assert result["returncodes"] == {"prefill": 0, "decode": 0}, result["workdir"]
    ours = (f"KV byte layout (KVArgs.kv_layout) differs: {both}; launch both with the same --dsv4-attn-backend and "
            f"SGLANG_DSV4_KV_LAYOUT")
    for room in (401, 402):
        prefill, decode = failed_reason(result["prefill"], room), failed_reason(result["decode"], room)
        assert ours in prefill, prefill
        assert (sglang_names if sglang_names and sglang_checks_kv_layout() else ours) in decode, decode
        assert result["decode"]["requests"][str(room)]["seconds"] < 5, "refusal must not wait for a timeout"
