#!/usr/bin/env bash
# One prepared accelerator check: training MFU and peak memory of the GPU path (bf16 compute,
# the default blocks MoE kernel) for `small` and the d768 ladder rung, against the measured bf16
# matmul peak.
# Results: bench/results/gpu_*.json (copied to $OUT when set).
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
python3 -c "import jax, optax; print('jax', jax.__version__, 'optax', optax.__version__, jax.devices())"
run() { timeout "$1" python3 bench/train_throughput.py "${@:2}" || echo "FAILED ($?): ${*:2}"; }
run 150 --name gpu_small --presets small --steps 10 model.compute_dtype=bfloat16 \
    data.seq_len=2048 data.batch_size=32
run 200 --name gpu_d768 --presets d768 --steps 5 data.batch_size=4
[ -n "${OUT:-}" ] && cp bench/results/gpu_*.json "$OUT"/ 2>/dev/null
exit 0
