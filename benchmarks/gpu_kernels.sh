#!/usr/bin/env bash
# Issue 25's GPU checks in one command, for a GPU machine lent for a few minutes (one GPU, world 1
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
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    echo "install failed"; tail -20 "$OUT/install.log"; exit 1
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"

echo "== benchmarks/bench_kernels.py"
timeout "${BENCH_S:-260}" python3 benchmarks/bench_kernels.py --repeats 10 --out "$OUT/bench_kernels.json" 2>&1 \
    | tee "$OUT/bench_kernels.log" | grep -v "^W\|Warning\|warn"

echo "== tests/test_one_device.py (fused kernels, torch.compile) on CUDA"
timeout "${PLAN_S:-170}" python3 -m pytest -q -p no:cacheprovider tests/test_one_device.py -k "cuda and (fused or compile)" -rA \
    2>&1 | tee "$OUT/test_one_device.log" | grep -E "PASS|FAIL|Error|passed|failed" | tail -12

echo "== kernel tests, compiled Triton on CUDA tensors"
timeout "${TESTS_S:-110}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_cross_entropy.py \
    -k cuda -rA 2>&1 | tee "$OUT/test_kernels.log" | grep -E "PASS|FAIL|Error|passed|failed" | tail -14
