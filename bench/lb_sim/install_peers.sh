#!/usr/bin/env bash
# Install the peer routers the LB benchmark compares against, each in its own virtualenv (they are not
# dependencies of this project and must not land in .venv). Prints the flags to pass to run_bench.py.
set -euo pipefail
DIR=${LB_PEERS_DIR:-$HOME/.cache/sglang-p2p-lb-peers}
mkdir -p "$DIR"
[ -x "$DIR/sglr/bin/python" ] || python3 -m venv "$DIR/sglr"
"$DIR/sglr/bin/pip" install -q sglang-router==0.3.2
[ -x "$DIR/smg/bin/smg" ] || python3 -m venv "$DIR/smg"
"$DIR/smg/bin/pip" install -q smg==1.13.0
echo "--sglang-router-python $DIR/sglr/bin/python --smg-bin $DIR/smg/bin/smg"
