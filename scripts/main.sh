#!/usr/bin/env bash
# The main job: set up, build, check every option against the float64 reference,
# then run the headline shape (65536 tokens, D=1536, 16 blocks + partial, bf16) and
# phase 1 of the two-phase schedule at the 48-block model's shape (6 queries over 9
# blocks, D=2304, 16384 tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
./build/attnres check
./build/attnres run --tokens 65536 --dim 1536 --blocks 16 --partial --dtype bf16
./build/attnres run --tokens 16384 --dim 2304 --blocks 9 --queries 6 --dtype bf16
