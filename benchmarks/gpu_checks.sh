#!/usr/bin/env bash
# The runtime's GPU checks in one command, for a GPU machine lent for a few minutes (one GPU,
# world 1 on NCCL; ../shared/GPU.md says what those machines have):
#
#   1. tests/test_one_device.py: GPT-2, Llama and the PaLM-style model in bf16 train as eager PyTorch does;
#      a meta-device Llama loaded from a save_pretrained folder trains as the saved model;
#   2. README.md's "On GPUs" example, as written there, under torchrun;
#   3. benchmarks/bench_gpu.py: eager vs autopar step time and peak memory, predicted vs measured.
#
# Logs go to $OUT (default gpu_out/). Packages the machine lacks (pulp, highspy) travel as wheels in
# .whl/ (see the device tool's README); the project installs editable, without its dependencies.
#
#   bash benchmarks/gpu_checks.sh [seconds for the benchmark, default 200]
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_setup.sh

echo "== tests/test_one_device.py"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_one_device.py -rA 2>&1 | tee "$OUT/test_gpu.log" | tail -15

echo "== README On GPUs example"
awk '/^# train_gpu.py/{on=1} on&&/^```$/{exit} on' README.md >/tmp/train_gpu.py
timeout 180 torchrun --standalone --nproc-per-node 1 /tmp/train_gpu.py >"$OUT/readme.log" 2>&1
echo "exit $?"; grep -v "^    " "$OUT/readme.log" | tail -12

echo "== benchmarks/bench_gpu.py"
timeout "${1:-200}" python3 benchmarks/bench_gpu.py --size medium --profile "$OUT/profile.txt" 2>&1 | tee "$OUT/bench_gpu.log" | grep -v "^Running\|^Includes\|loss_type"
