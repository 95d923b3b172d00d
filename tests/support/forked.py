"""A main function for tests/sglang/test_forkserver.py to fork: it reports what the forked process sees."""

import json
import os
import sys


def report(argv: list[str]) -> int:
    """Write this process's environment, pid and whether SGLang was preloaded to argv[0]; exit with argv[1]."""
    print("forked child writes to its log")
    with open(argv[0], "w") as f:
        json.dump({"env": dict(os.environ), "pid": os.getpid(),
                   "sglang_preloaded": "sglang.srt.server_args" in sys.modules}, f)
    if len(argv) > 2:  # wait to be killed
        import time

        time.sleep(float(argv[2]))
    return int(argv[1])


def sglang_setting(argv: list[str]) -> int:
    """Write the value SGLang's own settings object reads for one variable to argv[0]."""
    from sglang.srt.environ import envs

    with open(argv[0], "w") as f:
        json.dump({"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()}, f)
    return 0
