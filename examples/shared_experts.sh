#!/usr/bin/env bash
# Worked example of an experiment record: pre-register a claim about the MoE, train both arms on
# CPU, and write the report, whatever the verdict. About 15-25 minutes on two CPU cores.
#
#   examples/shared_experts.sh            # record -> runs/shared-experts/{shared,routed,unstable}
#                                         #        -> examples/lab/0001-.../report.md + PNGs
set -euo pipefail
cd "$(dirname "$0")/.."
export MOELAB_LAB_DIR=examples/lab
moelab() { .venv/bin/moelab "$@"; }
RUNS=runs/shared-experts

# 1. Pre-register (once): hypothesis, goal and the criteria that will decide it.
if ! ls examples/lab/0001-*.md >/dev/null 2>&1; then
  moelab lab new "Shared experts at equal active parameters" \
    --hypothesis "Routing every token through one shared expert next to the routed ones lowers \
held-out loss compared with routed experts alone, at equal active and total parameters: features \
every token needs are learned once instead of being copied into several experts." \
    --goal "Decide whether the tiny preset keeps its shared expert. Arm 'shared': 8 routed \
experts, top-2, plus 1 shared expert (the preset). Arm 'routed': 10 routed experts, top-4, no \
shared expert. Both have 0.92M active and 1.78M total parameters; same data, seed and schedule." \
    --criterion "eval/prose/loss last in shared - routed <= -0.01; falsified if >= 0" \
    --criterion "eval/code/loss last in shared - routed <= -0.01; falsified if >= 0" \
    --criterion "throughput/tokens_per_s median over steps 50-250 in shared / routed >= 0.9" \
    --criterion "moe/drop_fraction max <= 1%" \
    --min-steps 1000
fi

# 2. Both arms, attached to record 1 before they start (a failed run is reported too).
COMMON=(tiny data.batch_size=16 train.steps=250 train.eval_every=50 train.ckpt_every=250)
moelab train "${COMMON[@]}" --run-dir $RUNS/shared --record 1 --arm shared
moelab train "${COMMON[@]}" model.n_shared=0 model.n_experts=10 model.top_k=4 \
  --run-dir $RUNS/routed --record 1 --arm routed
# A third arm with a learning rate far too high, kept to show how a failed run is reported.
moelab train "${COMMON[@]}" optim.lr=1000 --run-dir $RUNS/unstable --record 1 --arm unstable \
  || echo "(the unstable arm failed, as expected)"

# 3. The report: verdicts, tables, plots, provenance, failed runs.
moelab lab report 1
