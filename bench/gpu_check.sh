#!/usr/bin/env bash
# One pass on a CUDA machine, in the order that matters: the environment, the CUDA tests
# (float64 references and the crafted samples of tests/privacy/test_cuda_under_attack.py, TF32 off
# and on), the benchmark of ViT-B/16 under bf16 autocast (and of another checkout's private_engine
# in the same call, for an A/B on one machine), and a profile of a ViT-B step (kernels per step,
# device busy time, host-device syncs).
#
#   bash bench/gpu_check.sh [OUT_DIR]
#
# Environment: PE_BASE=DIR (a folder holding another private_engine package, labelled
# PE_BASE_COMMIT: its ViT-B benchmark runs too, through PE_ENGINE_DIR, before and after this
# checkout's, since the second of two runs in one call can read slower), PE_RESNET=1 (also ResNet-18), PE_COMMIT (the commit measured when the checkout has no
# .git), PE_METHODS (methods of this checkout's ViT-B benchmark; default "nondp bk_mixed"),
# PE_MAX_BATCH=1 (that benchmark also finds each method's maximum batch, within 3 %),
# PE_*_TIMEOUT (seconds per part). Uses the machine's python3 with this checkout on
# PYTHONPATH (no install); wheels in .whl/ (e.g. opacus) are installed to a scratch folder first.
# Writes at most 8 files to OUT_DIR (summary.txt last lines are printed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/pe_site .whl/*.whl && SITE=/tmp/pe_site
fi
export PYTHONPATH=${SITE:+$SITE:}$PWD
SUMMARY="$OUT_DIR/summary.txt"
{
    echo "commit: ${PE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, timm, opacus; print('torch', torch.__version__, 'cuda',
torch.version.cuda, torch.cuda.get_device_name(), 'timm', timm.__version__, 'opacus',
opacus.__version__)"
} > "$SUMMARY" 2>&1

echo "== pytest -m cuda ==" >> "$SUMMARY"
PE_RATIO_LOG="$OUT_DIR/ratios.tsv" timeout "${PE_TEST_TIMEOUT:-200}" \
    python3 -m pytest -q -m cuda -p no:cacheprovider -o addopts="" -rfE \
    --continue-on-collection-errors \
    tests/test_cuda.py tests/optim tests/heads tests/privacy \
    > "$OUT_DIR/pytest_cuda.log" 2>&1
echo "pytest exit $?" >> "$SUMMARY"
grep -E "passed|failed|^FAILED|^ERROR" "$OUT_DIR/pytest_cuda.log" | tail -n 12 >> "$SUMMARY"
if [ -f "$OUT_DIR/ratios.tsv" ]; then
    echo "crafted samples on CUDA: $(wc -l < "$OUT_DIR/ratios.tsv") pairs; largest ratios:" \
        >> "$SUMMARY"
    sort -t$'\t' -k4 -g "$OUT_DIR/ratios.tsv" | grep -v None | tail -n 3 >> "$SUMMARY"
fi

bench_vitb() {  # $1: output name, $2: PE_ENGINE_DIR (or ""), $3: timeout, then options
    local name=$1 engine=$2 limit=$3
    shift 3
    PE_ENGINE_DIR="$engine" PE_ENGINE_COMMIT="${PE_BASE_COMMIT:-}" timeout "$limit" \
        python3 bench/bench_clipping.py \
        --device cuda --models vit_base_patch16_224 --amp bf16 --batch-size 128 \
        --steps 10 --warmup 3 --markdown "$OUT_DIR/$name.md" "$@" > "$OUT_DIR/$name.log" 2>&1
    echo "bench $name exit $?" >> "$SUMMARY"
    grep -E "^\| [a-z_]+ \|" "$OUT_DIR/$name.md" >> "$SUMMARY" 2>/dev/null \
        || tail -n 5 "$OUT_DIR/$name.log" >> "$SUMMARY"
    rm -f "$OUT_DIR"/*.png
}
echo "== benchmark ==" >> "$SUMMARY"
if [ -n "${PE_BASE:-}" ]; then
    bench_vitb bench_vitb_base "$PWD/$PE_BASE" "${PE_BASE_TIMEOUT:-90}" --methods nondp bk_mixed
fi
# shellcheck disable=SC2086 # PE_METHODS is a list of words
bench_vitb bench_vitb "" "${PE_BENCH_TIMEOUT:-150}" --methods ${PE_METHODS:-nondp bk_mixed} \
    ${PE_MAX_BATCH:+--max-batch --max-batch-tolerance 0.03}
if [ -n "${PE_BASE:-}" ]; then
    bench_vitb bench_vitb_base2 "$PWD/$PE_BASE" "${PE_BASE_TIMEOUT:-90}" --methods nondp bk_mixed
fi
if [ -n "${PE_RESNET:-}" ]; then
    timeout "${PE_BENCH_TIMEOUT:-90}" python3 bench/bench_clipping.py --device cuda \
        --models resnet18 --amp bf16 --batch-size 64 --methods nondp bk_mixed --steps 10 \
        --warmup 3 --markdown "$OUT_DIR/bench_resnet18.md" > /dev/null 2>&1
    echo "bench resnet18 exit $?" >> "$SUMMARY"
    rm -f "$OUT_DIR"/*.png
fi

echo "== profile ==" >> "$SUMMARY"
timeout "${PE_PROFILE_TIMEOUT:-70}" python3 bench/investigate/profile_step.py --device cuda \
    --model vit_base_patch16_224 --amp bf16 --batch-size 32 --methods nondp bk_mixed \
    --steps 3 --rows 25 > "$OUT_DIR/profile_vitb.log" 2>&1
echo "profile exit $?" >> "$SUMMARY"
grep "^==" "$OUT_DIR/profile_vitb.log" >> "$SUMMARY"
cat "$SUMMARY"
