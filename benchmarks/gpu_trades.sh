#!/usr/bin/env bash
# The memory-for-time trades' GPU checks in one command, for a GPU machine lent for a few minutes (one GPU, world 1
# on NCCL; ../shared/GPU.md says what those machines have):
#
#   1. tests/test_one_device.py -k trades: recomputation with micro-batches, ZeRO-3 over the one
#      device, and optimizer offload (state in pinned host memory) train as eager PyTorch does;
#   2. benchmarks/bench_gpu_trades.py: each trade's measured step time and peak device memory
#      against the plan's prediction, and its losses against the untraded plan's.
#
# Logs go to $OUT (default gpu_out/). pulp and highspy travel as wheels in .whl/ (carried).
#
#   bash benchmarks/gpu_trades.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0  # Triton compiled on the GPU (tests/conftest.py defaults to the interpreter)
source benchmarks/gpu_setup.sh

echo "== tests/test_one_device.py -k trades"
timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_one_device.py -k trades -rA 2>&1 \
    | tee "$OUT/test_trades.log" | grep -E "PASS|FAIL|Error|passed|failed" | tail -12

echo "== benchmarks/bench_gpu_trades.py"
timeout "${BENCH_S:-300}" python3 benchmarks/bench_gpu_trades.py --size medium --steps 10 2>&1 \
    | tee "$OUT/bench_gpu_trades.log" | grep -v "^Running\|^Includes\|loss_type\|Warning\|warn("
