#!/usr/bin/env bash
# Golden tables: small, fast CPU runs of every bertology command, whose tables are kept for a byte-for-byte
# comparison of two checkouts (e.g. before and after a refactor that must not change a number).
#
#   bench/golden_tables.sh OUTDIR [CHECKOUT]     run every command with CHECKOUT's code, tables into OUTDIR/<run>/
#   bench/golden_tables.sh --compare A B         compare two such folders (= python bench/golden_compare.py A B)
#
# CHECKOUT (default: the repository this script is in) is used through PYTHONPATH=CHECKOUT/src with the venv's
# python (PYTHON, default CHECKOUT/.venv/bin/python, else the .venv of this script's repository); the script stops
# unless `import bertology` resolves inside CHECKOUT/src. Every command runs in a fixed work folder (GOLDEN_WORK,
# default /tmp/bertology-golden-work, emptied first) with relative --out paths, so that no table depends on where
# the checkout or OUTDIR is. One bertology process at a time, --device cpu --seed 0 --quiet, hub offline,
# OMP/MKL/OpenBLAS threads fixed (GOLDEN_THREADS, default 1: float results can depend on the thread count, and on
# this 2-core machine one thread is as fast for the model passes and 3-4x faster for the sklearn layer probes, which
# crawl when their BLAS threads share the cores with anything else), PYTHONHASHSEED=0 (GOLDEN_HASHSEED), a private XDG_CACHE_HOME
# (weight digests). OUTDIR/settings.txt records the threads and hash seed and is compared like the tables.
#
# Inputs (copied into the work folder; their sha256 go into OUTDIR/inputs.sha256, which is compared too) come from
# ../shared/data beside this script's repository (GOLDEN_SHARED_DATA to point elsewhere):
#   gutenberg/pg11.txt (first 2,000 lines) for pretrain; glue/SST-2 (first 1,000 train and 200 dev rows) for the
#   task commands; ud_english_ewt/en_ewt-ud-test.conllu (first 200 sentences) for the runs with trees; the bundled
#   frames_example.jsonl (found anywhere under CHECKOUT/src) for frames.
#
# Captured: every *.csv and *.json of each run folder (see golden_compare.py --capture for what is left out:
# manifest.json, model-folder files, track's parts/, and JSON keys/CSV columns that are times, dates, versions or
# paths), plus weights.sha256 of every saved model. OUTDIR/_meta/ (logs, timings.tsv, env.txt) is not compared.
# Exit status: 0 when every command succeeded, 1 otherwise (the tables of the others are still captured).
set -uo pipefail

SELF_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
COMPARE_PY="$SELF_REPO/bench/golden_compare.py"

usage() { sed -n '2,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

if [[ ${1:-} == --compare ]]; then
    [[ $# -eq 3 ]] || usage
    PY=${PYTHON:-$SELF_REPO/.venv/bin/python}
    [[ -x $PY ]] || PY=python3
    exec "$PY" "$COMPARE_PY" "$2" "$3"
fi
[[ $# -ge 1 && $# -le 2 && ${1:-} != -* ]] || usage

OUTDIR=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "error: cannot create $1" >&2; exit 2; }
if [[ -n $(ls -A "$OUTDIR") ]]; then
    echo "error: $OUTDIR is not empty (give a new or empty folder)" >&2
    exit 2
fi
CHECKOUT=$(cd "${2:-$SELF_REPO}" && pwd) || exit 2
[[ -d $CHECKOUT/src/bertology ]] || { echo "error: $CHECKOUT/src/bertology: not a bertology checkout" >&2; exit 2; }
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=$CHECKOUT/.venv/bin/python
    [[ -x $PYTHON ]] || PYTHON=$SELF_REPO/.venv/bin/python
fi
[[ -x $PYTHON ]] || { echo "error: no python at $PYTHON (set PYTHON)" >&2; exit 2; }
SHARED=${GOLDEN_SHARED_DATA:-$SELF_REPO/../shared/data}
WORK=${GOLDEN_WORK:-/tmp/bertology-golden-work}

# The environment every command runs in.
export PYTHONPATH="$CHECKOUT/src"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export PYTHONHASHSEED=${GOLDEN_HASHSEED:-0}  # "random" to look for hash-order dependence
THREADS=${GOLDEN_THREADS:-1}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS
export XDG_CACHE_HOME="$WORK/.cache" MPLCONFIGDIR="$WORK/.matplotlib"
export PYTHONWARNINGS=ignore

# The work folder: emptied only if it is ours (a .golden-work marker) or empty.
if [[ -e $WORK ]]; then
    if [[ -e $WORK/.golden-work || -z $(ls -A "$WORK") ]]; then
        rm -rf -- "$WORK"
    else
        echo "error: $WORK exists and is not a golden work folder (set GOLDEN_WORK)" >&2
        exit 2
    fi
fi
mkdir -p "$WORK/data" "$OUTDIR/_meta/logs" && touch "$WORK/.golden-work"
cd "$WORK" || exit 2

IMPORTED=$("$PYTHON" -c 'import bertology; print(bertology.__file__)') || { echo "error: cannot import bertology" >&2; exit 2; }
case $IMPORTED in
    "$CHECKOUT/src/"*) ;;
    *) echo "error: bertology imports from $IMPORTED, not from $CHECKOUT/src" >&2; exit 2 ;;
esac
{
    echo "checkout: $CHECKOUT"
    echo "commit: $(git -C "$CHECKOUT" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "uncommitted changes: $(git -C "$CHECKOUT" status --porcelain 2>/dev/null | wc -l) paths"
    echo "python: $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])'))"
    echo "bertology imported from: $IMPORTED"
    echo "torch: $("$PYTHON" -c 'import torch; print(torch.__version__, torch.get_num_threads(), "threads")' 2>/dev/null)"
    echo "threads: OMP_NUM_THREADS=$OMP_NUM_THREADS; work folder: $WORK; shared data: $SHARED"
    echo "date: $(date -u +%FT%TZ)"
} > "$OUTDIR/_meta/env.txt"
printf 'threads=%s\nPYTHONHASHSEED=%s\n' "$THREADS" "$PYTHONHASHSEED" > "$OUTDIR/settings.txt"
cat "$OUTDIR/_meta/env.txt"

# ---- inputs ----
for needed in gutenberg/pg11.txt glue/SST-2/train.tsv glue/SST-2/dev.tsv ud_english_ewt/en_ewt-ud-test.conllu; do
    [[ -f $SHARED/$needed ]] || { echo "error: $SHARED/$needed is missing (set GOLDEN_SHARED_DATA)" >&2; exit 2; }
done
FRAMES=$(find "$CHECKOUT/src" -name frames_example.jsonl -print -quit)
[[ -n $FRAMES ]] || { echo "error: no frames_example.jsonl under $CHECKOUT/src" >&2; exit 2; }
head -n 2000 "$SHARED/gutenberg/pg11.txt" > data/pretrain.txt
mkdir -p data/SST-2
head -n 1001 "$SHARED/glue/SST-2/train.tsv" > data/SST-2/train.tsv
head -n 201 "$SHARED/glue/SST-2/dev.tsv" > data/SST-2/dev.tsv
awk 'BEGIN { RS = ""; ORS = "\n\n" } NR <= 200' "$SHARED/ud_english_ewt/en_ewt-ud-test.conllu" > data/ewt.conllu
cp "$FRAMES" data/frames.jsonl
(cd data && sha256sum pretrain.txt SST-2/train.tsv SST-2/dev.tsv ewt.conllu frames.jsonl) > "$OUTDIR/inputs.sha256"

# ---- the runs ----
COMMON=(--seed 0 --device cpu --quiet)
FAILED=()
printf 'run\tseconds\tstatus\n' > "$OUTDIR/_meta/timings.tsv"

# run NAME ARGS...: `bertology ARGS` (its run folder is runs/NAME), timed, logged, its tables captured.
run() {
    local name=$1; shift
    local log="$OUTDIR/_meta/logs/$name.log" start end seconds status=ok
    printf '%-18s' "$name"
    echo "\$ bertology $*" > "$log"
    start=$(date +%s.%N)
    "$PYTHON" -c 'import sys; from bertology.cli import main; sys.argv[0] = "bertology"; main()' "$@" >> "$log" 2>&1 || status=failed
    end=$(date +%s.%N)
    seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
    if [[ -d runs/$name ]]; then
        "$PYTHON" "$COMPARE_PY" --capture "runs/$name" "$OUTDIR/$name" > "$OUTDIR/_meta/logs/$name.captured" 2>&1 || status="$status, capture failed"
    else
        [[ $status == ok ]] && status="ok, but no run folder"
    fi
    [[ $status == ok ]] || FAILED+=("$name")
    printf '%s\t%s\t%s\n' "$name" "$seconds" "$status" >> "$OUTDIR/_meta/timings.tsv"
    printf '%6s s  %s (%s tables)\n' "$seconds" "$status" "$(cat "$OUTDIR/_meta/logs/$name.captured" 2>/dev/null | wc -l)"
}

TOTAL_START=$(date +%s)
TASK=data/SST-2
# The sample run: the bundled corpus and model, every default.
run analyze        analyze --out runs/analyze "${COMMON[@]}"
# Every analysis family on trees (syntax, classes, layer probes too), and the frames family.
run analyze-ewt    analyze --corpus data/ewt.conllu --out runs/analyze-ewt --profile --roles --patterns --syntax --classes --layers \
                   --rollout --mixing --class nouns=upos:NOUN --bootstrap 200 --probe-folds 2 --probe-epochs 5 --probe-bootstrap 200 "${COMMON[@]}"
run analyze-frames analyze --corpus data/frames.jsonl --out runs/analyze-frames --frames "${COMMON[@]}"
# A tiny BERT pre-trained from scratch (3 checkpoints: steps 0, 10, 40).
run pretrain       pretrain data/pretrain.txt --out runs/pretrain --vocab-size 500 --layers 2 --heads 2 --hidden 32 --max-length 64 \
                   --batch-size 16 --steps 40 --checkpoints 3 "${COMMON[@]}"
# The bundled model fine-tuned on 256 SST-2 examples, 1 epoch (16 steps).
run finetune       finetune "$TASK" --out runs/finetune --max-train-examples 256 --epochs 1 --batch-size 16 --max-length 64 "${COMMON[@]}"
# Checkpoints as arguments with --steps (bundled model -> fine-tuned), and as a pretrain folder.
run track          track default runs/finetune --steps 0,16 --out runs/track --limit 40 --bootstrap 200 "${COMMON[@]}"
run track-checkpoints track --checkpoints runs/pretrain --out runs/track-checkpoints --limit 40 --bootstrap 200 "${COMMON[@]}"
# The bundled model against its fine-tuned self: on the sample corpus, and on trees (with the layer probes).
run compare        compare default runs/finetune --out runs/compare --limit 40 "${COMMON[@]}"
run compare-ewt    compare default runs/finetune --corpus data/ewt.conllu --out runs/compare-ewt --limit 100 --probe-sentences 100 "${COMMON[@]}"
# Head studies of the fine-tuned model on (subsets of) the SST-2 dev rows.
run ablate         ablate "$TASK" --model runs/finetune --out runs/ablate --max-examples 64 --max-length 64 --bootstrap 1000 "${COMMON[@]}"
run importance     importance "$TASK" --model runs/finetune --out runs/importance --importance-examples 64 --max-length 64 "${COMMON[@]}"
run prune          prune "$TASK" --model runs/finetune --out runs/prune --step 0.25 --prune-to 36 --importance-examples 64 --max-examples 64 \
                   --max-length 64 "${COMMON[@]}"
run restore        restore "$TASK" --model runs/finetune --out runs/restore --max-dev-examples 64 --bootstrap 1000 --max-length 64 "${COMMON[@]}"
# [SEP] gradients: the masked-LM loss of the pre-trained tiny BERT on the sample corpus, and the classifier's loss on the task.
run gradients      gradients --model runs/pretrain/checkpoints/step-000040 --out runs/gradients --limit 64 "${COMMON[@]}"
run gradients-task gradients --model runs/finetune --task "$TASK" --out runs/gradients-task "${COMMON[@]}"
TOTAL=$(( $(date +%s) - TOTAL_START ))

(cd "$OUTDIR" && find . -path ./_meta -prune -o -type f -print | sed 's|^\./||' | LC_ALL=C sort) > "$OUTDIR/_meta/files.txt"
echo "total: ${TOTAL} s; $(wc -l < "$OUTDIR/_meta/files.txt") files captured in $OUTDIR (list: $OUTDIR/_meta/files.txt)"
printf 'total\t%s\t\n' "$TOTAL" >> "$OUTDIR/_meta/timings.tsv"
if (( ${#FAILED[@]} )); then
    echo "${FAILED[*]}" > "$OUTDIR/_meta/FAILED"
    echo "FAILED: ${FAILED[*]} (logs in $OUTDIR/_meta/logs/)" >&2
    exit 1
fi
