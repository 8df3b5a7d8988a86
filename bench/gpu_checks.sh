#!/usr/bin/env bash
# Issue 40's checks on a machine with one CUDA GPU, as one script (the session's device tool runs it; so can anyone):
#
#   bench/gpu_checks.sh [OUT]        logs and JSON figures into OUT (default $OUT, else /tmp/gpu-checks)
#
# 1. The tests that need CUDA: the GPU's tables equal the CPU's within 1e-4 (float32) and bfloat16 on the GPU equals float32
#    on the CPU within the stated tolerances (tests/core/model/test_precision_and_placement.py); every analyzer on a model
#    spread over two devices (layers on the GPU and on the CPU, through accelerate) gives the one-device table
#    (tests/core/test_contract.py::test_a_model_spread_over_two_devices_gives_the_same_table).
# 2. bench/large_models.py with --device cuda --dtype bfloat16: the Llama shape 32 x 32 heads (8 kv, hidden 1024) at 1,024
#    tokens (4 passages) and 4,096 tokens (2 passages), and 8 x 16 heads (4 kv, hidden 512) at 8,192 tokens (1 passage):
#    analyze's pass against a bare eager forward, its peak GPU memory against a bare SDPA forward's.
#
# Python packages the machine lacks travel as wheels in .whl/ (installed into /tmp/site), the book as
# BOOK (default .gpu/pg1342.txt, else ../shared/data/gutenberg/pg1342.txt).
set -uo pipefail
OUT=${1:-${OUT:-/tmp/gpu-checks}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p /tmp/site/bin
printf '#!/usr/bin/env python3\nimport sys\nfrom bertology.cli import main\nsys.exit(main())\n' >/tmp/site/bin/bertology
chmod +x /tmp/site/bin/bertology
export PATH="/tmp/site/bin:$PATH"
BOOK=${BOOK:-.gpu/pg1342.txt}
[ -f "$BOOK" ] || BOOK=../shared/data/gutenberg/pg1342.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/device.txt"

status=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/core/model/test_precision_and_placement.py \
    "tests/core/test_contract.py::test_a_model_spread_over_two_devices_gives_the_same_table" 2>&1 | tee "$OUT/tests.txt" | grep -E "first diff|^FAILED|passed|failed" || status=1

bench() {
    local name=$1; shift
    timeout "${BENCH_TIMEOUT:-110}" python3 bench/large_models.py --device cuda --dtype bfloat16 --threads 8 --book "$BOOK" "$@" >"$OUT/$name.log" 2>&1 || status=1
    grep -v "^{" "$OUT/$name.log" | grep -v "it/s\]" | tail -12
    grep "^{" "$OUT/$name.log" >"$OUT/$name.json"
}
bench llama32x32-1024 --layers 32 --heads 32 --kv-heads 8 --hidden 1024 --tokens 1024 --passages 4
bench llama32x32-4096 --layers 32 --heads 32 --kv-heads 8 --hidden 1024 --tokens 4096 --passages 2 --analyze-args "--attention-budget 67108864"
bench llama8x16-8192 --layers 8 --heads 16 --kv-heads 4 --hidden 512 --tokens 8192 --passages 1 --analyze-args "--attention-budget 67108864"
exit $status
