#!/usr/bin/env bash
# FP8 linears on one GPU, in one command, for a GPU machine lent for a few minutes (one GPU, world 1
# on NCCL; ../shared/GPU.md says what those machines have):
#
#   1. tests/test_float8.py -k one_fp8: one FP8 linear against torchao's Float8Linear (on the CPU,
#      as in CI: a check that the machine's torch and torchao agree with the ones the suite ran on);
#   2. benchmarks/bench_gpu_float8.py: 100 steps of a small bf16 Llama with every linear FP8
#      (tensorwise, rowwise) against bf16 on the same batches: the loss curves' gap over the last
#      20 steps and the median step time of each.
#
# The machine has no torchao and no internet: bring its wheel in .whl/ beside pulp and highspy, e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl "torchao==0.18.0"
# (torchao declares no requirements; 0.18 is the version this branch was tested with, on torch 2.13.)
# Logs go to $OUT (default gpu_out/).
#
#   bash benchmarks/gpu_float8.sh [seconds for the benchmark, default 300]
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh

python3 -c "import torchao, torchao.float8; print('torchao', torchao.__version__)" 2>&1 | grep -v "Failed to load" | tee -a "$OUT/env.txt"

echo "== tests/test_float8.py -k one_fp8"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_float8.py -k one_fp8 -rA 2>&1 \
    | tee "$OUT/test_float8.log" | grep -E "PASS|FAIL|Error|passed|failed" | tail -8

echo "== benchmarks/bench_gpu_float8.py"
timeout "${1:-300}" python3 benchmarks/bench_gpu_float8.py --steps 100 2>&1 \
    | tee "$OUT/bench_gpu_float8.log" | grep -v "^Running\|^Includes\|loss_type\|Failed to load\|Warning\|warn("
echo "exit ${PIPESTATUS[0]}"
