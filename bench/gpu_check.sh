#!/usr/bin/env bash
# One pass on a CUDA machine, in the order that matters: the environment, the CUDA tests
# (float64 references and the crafted samples of tests/privacy/test_cuda_under_attack.py, TF32 off
# and on), the benchmark of ViT-B/16 and ResNet-18 under bf16 autocast, and a profile of a ViT-B
# step (kernels per step, device busy time, host-device syncs).
#
#   bash bench/gpu_check.sh [OUT_DIR]      # logs, ratios and the benchmark's markdown in OUT_DIR
#
# Uses the machine's python3 with this checkout on PYTHONPATH (no install); wheels in .whl/
# (e.g. opacus) are installed to a scratch folder first. PE_COMMIT names the commit measured when
# the checkout has no .git. Each part has its own time limit, so one slow part cannot hide the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/pe_site .whl/*.whl && export PYTHONPATH=/tmp/pe_site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD

{
    echo "commit: ${PE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, timm, opacus; print('torch', torch.__version__, 'cuda',
torch.version.cuda, torch.cuda.get_device_name(), 'timm', timm.__version__, 'opacus',
opacus.__version__)"
    nproc
} 2>&1 | tee "$OUT_DIR/env.txt"

echo "== pytest -m cuda =="
PE_RATIO_LOG="$OUT_DIR/ratios.tsv" timeout "${PE_TEST_TIMEOUT:-200}" \
    python3 -m pytest -q -m cuda -p no:cacheprovider -o addopts="" -rfE \
    --continue-on-collection-errors \
    tests/test_cuda.py tests/optim tests/heads tests/privacy \
    > "$OUT_DIR/pytest_cuda.log" 2>&1
echo "pytest exit $?"
tail -n 25 "$OUT_DIR/pytest_cuda.log"
if [ -f "$OUT_DIR/ratios.tsv" ]; then
    echo "crafted samples on CUDA: $(wc -l < "$OUT_DIR/ratios.tsv") pairs; largest ratios:"
    sort -t$'\t' -k4 -g "$OUT_DIR/ratios.tsv" | grep -v None | tail -n 4
fi

echo "== benchmark =="
timeout "${PE_BENCH_TIMEOUT:-140}" python3 bench/bench_clipping.py --device cuda \
    --models vit_base_patch16_224 --amp bf16 --batch-size 128 --methods nondp bk_mixed bk \
    --steps 10 --warmup 3 --markdown "$OUT_DIR/bench_vitb.md" --plot "$OUT_DIR/bench_vitb.png" \
    > "$OUT_DIR/bench_vitb.log" 2>&1
echo "bench ViT-B exit $?"; grep -E "^\|" "$OUT_DIR/bench_vitb.log" | head -n 12
timeout "${PE_BENCH_TIMEOUT:-90}" python3 bench/bench_clipping.py --device cuda \
    --models resnet18 --amp bf16 --batch-size 64 --methods nondp bk_mixed \
    --steps 10 --warmup 3 --markdown "$OUT_DIR/bench_resnet18.md" \
    --plot "$OUT_DIR/bench_resnet18.png" > "$OUT_DIR/bench_resnet18.log" 2>&1
echo "bench ResNet-18 exit $?"; grep -E "^\|" "$OUT_DIR/bench_resnet18.log" | head -n 8

echo "== profile =="
timeout "${PE_PROFILE_TIMEOUT:-70}" python3 bench/investigate/profile_step.py --device cuda \
    --model vit_base_patch16_224 --amp bf16 --batch-size 32 --methods nondp bk_mixed \
    --steps 3 --rows 25 > "$OUT_DIR/profile_vitb.log" 2>&1
echo "profile exit $?"; grep "^==" "$OUT_DIR/profile_vitb.log"
