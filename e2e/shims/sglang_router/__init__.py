"""Stand-in for sglang-router on the GPU host, for SGLang's own PD tests only (e2e/sglang_tests.py).

SGLang 0.5.17's PD test fixture starts ``python3 -m sglang_router.launch_router --pd-disaggregation --mini-lb
--prefill URL --decode URL --host H --port P``. sglang-router's wheel carries a 92 MB Rust module we cannot
ship, and our LB takes the same flags, so this package runs our LB under that name: SGLang's tests then drive
p2pnccl through the LB this project delivers.
"""
