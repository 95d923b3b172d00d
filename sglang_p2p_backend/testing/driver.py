"""Drive the p2pnccl backend through SGLang's own classes the way SGLang's schedulers do, one process per rank.

`python -m sglang_p2p_backend.testing.driver --role prefill|decode --rank N --plan PLAN.json --out RESULT.json`

The plan (shared by every process of the run, testing/plan.py) names the pool layout, the requests (room,
prompt tokens, chunking, decode prefix) and optional faults (testing/faults.py). Each process builds its
manager with `get_kv_class(TransferBackend("p2pnccl"), ...)` after SGLang's plugin loader ran, then polls all
its requests in one loop with the scheduler's state machine: the prefill's in testing/prefill_role.py (which
also runs the bootstrap server, as SGLang's prefill main process does), the decode's in
testing/decode_role.py (which checks what landed). Both report their results and leftovers (rooms, staging,
sockets, threads) to RESULT.json after the run.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
from typing import Optional

from sglang_p2p_backend.adapter import room_times
from sglang_p2p_backend.testing.decode_role import DecodeRole
from sglang_p2p_backend.testing.launch import one_gpu_env
from sglang_p2p_backend.testing.plan import dp_rank_of, requests, touch, wait_for
from sglang_p2p_backend.testing.prefill_role import PrefillRole

ROLES = {"prefill": PrefillRole, "decode": DecodeRole}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=tuple(ROLES), required=True)
    ap.add_argument("--rank", type=int, default=0, help="TP rank of this process in its server")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args(argv)
    with open(ns.plan) as f:
        plan = json.load(f)
    # a role still running past its deadline prints every thread's stack (then its parent may kill it)
    faulthandler.dump_traceback_later(float(plan.get("deadline_s", 60)) + 20, exit=False)
    if plan.get("share_gpu"):  # both roles on one GPU over NCCL: before anything starts NCCL
        os.environ.update(one_gpu_env(f"{ns.role}{ns.rank}"))
    os.environ.update(plan.get("env", {}).get(ns.role, {}))  # per-role settings (mismatch tests)
    if os.environ.get("SGLANG_P2P_ROOM_TIMES") == "1":  # INFO lines, shown as a server at --log-level info shows them
        logging.basicConfig(format="%(message)s")
        logging.getLogger(room_times.__name__).setLevel(logging.INFO)
    role = ROLES[ns.role](plan, ns.rank)
    with open(os.path.join(plan["workdir"], f"{ns.role}-{ns.rank}.session"), "w") as f:
        f.write(role.mgr.session)  # where a test's hostile sender finds this rank's control socket
    touch(plan, f"{ns.role}-{ns.rank}")
    # a server's ranks come up together: none starts its requests before every rank of its role is set up (a rank
    # 0 whose rooms end at once would otherwise exit and take the process groups' store from a rank still joining)
    wait_for(plan, [f"{ns.role}-{r}" for r in range(role.tp * role.replicas)])
    if ns.role == "decode":
        prefill = int(plan.get("tp", {}).get("prefill", 1)) * int(plan.get("dp", {}).get("prefill", 1))
        wait_for(plan, [f"prefill-{r}" for r in range(prefill)])
    if ns.role == "prefill" and role.faults.get("stop_self"):
        os.kill(os.getpid(), signal.SIGSTOP)  # a prefill that registered, then never answers
    reqs = requests(plan, ns.role)
    if role.num_dp > 1:  # each side's DP controller hands the request to one DP rank
        reqs = [r for r in reqs if dp_rank_of(plan, ns.role, r.room, role.num_dp) == role.dp_rank]
    result = role.run(reqs, float(plan.get("deadline_s", 60)))
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
