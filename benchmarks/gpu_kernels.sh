#!/usr/bin/env bash
# The fused kernels' GPU checks in one command, for a GPU machine lent for a few minutes (one GPU, world 1
# on NCCL; ../shared/GPU.md says what those machines have):
#
#   1. benchmarks/bench_kernels.py: each fused kernel against eager and torch.compile at Llama-3-8B
#      and GPT-2 shapes, and the fused cross-entropy's peak memory against eager's;
#   2. tests/test_one_device.py -k "fused or compile": GPT-2, Llama and the PaLM-style model in bf16
#      with every kernel substituted by the automatic plan on CUDA (Triton) train as eager does;
#      the generated module under torch.compile (Inductor) matches eager;
#   3. the kernels' own CUDA tests: compiled Triton against the torch fallbacks and eager.
#
# Logs and results go to $OUT (default gpu_out/). pulp travels as a wheel in .whl/ (carried).
#
#   bash benchmarks/gpu_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0
source benchmarks/gpu_setup.sh

echo "== benchmarks/bench_kernels.py"
timeout "${BENCH_S:-260}" python3 benchmarks/bench_kernels.py --repeats 10 --out "$OUT/bench_kernels.json" 2>&1 \
    | tee "$OUT/bench_kernels.log" | grep -v "^W\|Warning\|warn"

echo "== tests/test_one_device.py (fused kernels, torch.compile) on CUDA"
timeout "${PLAN_S:-170}" python3 -m pytest -q -p no:cacheprovider tests/test_one_device.py -k "cuda and (fused or compile)" -rA \
    2>&1 | tee "$OUT/test_one_device.log" | grep -E "PASS|FAIL|Error|passed|failed" | tail -12

echo "== kernel tests, compiled Triton on CUDA tensors"
timeout "${TESTS_S:-110}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_cross_entropy.py \
    -k cuda -rA 2>&1 | tee "$OUT/test_kernels.log" | grep -E "PASS|FAIL|Error|passed|failed" | tail -14
