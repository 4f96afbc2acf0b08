#!/usr/bin/env bash
# Issue 37's runs on four GPUs (or on every GPU there is), split into calls that each fit the
# device tool's 10-minute limit and its 8 files back, the GPU machine kept warm between them.
#
# Here, before: our wheel and Liger's in .whl (benchmarks/gpu_prelude.sh says how); .tt/ for
# stages 4 and 5 (benchmarks/torchtitan_anchor.sh says how). Then, on nvidia-h200-x4, one call a
# stage, in this order (the most wanted results first; each stage writes its json as it goes, so a
# call cut short keeps what finished):
#   run(kind="nvidia-h200-x4", carry=[".whl"], command="bash benchmarks/scale_x4.sh 1")
#   run(carry=[".whl"], command="bash benchmarks/scale_x4.sh 2")    ... 3
#   run(carry=[".whl", ".tt"], command="bash benchmarks/scale_x4.sh 4")   ... 5
#   run(carry=[".whl"], command="bash benchmarks/scale_x4.sh 6")
#
# 1: Llama-3-8B shape, FSDP2 and accelerate's FSDP2 plugin: transformers, Liger, surgery (every
#    layer checkpointed) and surgery without checkpointing, new tokens every step, then the
#    longest sequence each fits (two doublings from 8192).
# 2: the Qwen3-30B-A3B shape under FSDP2, the same contenders, one doubling (6: through
#    accelerate; last, as its unpatched steps are slow: transformers loops over 128 experts).
# 3: tensor parallelism on the 8B shape: torchtitan's plan by hand (TP 2 x FSDP2 2, with torch's
#    loss_parallel beside it), transformers' tp_plan over 4 ranks, and tp_plan 2 x FSDP2 2.
# 4, 5: torchtitan's own Llama-3 8B recipe, eager (4) and compiled (5), and scale.py's batch-2
#    surgery runs beside it (4), so the anchor is side by side on the same machine.
#
# Results: $OUT/<stage folder>/scale.json and scale.png per scale.py run, $OUT/run_log.txt with
# every command and its table. CPU plumbing: NPROC=2 EXTRA="--cpu --tiny" OUT=/tmp/x4 bash
# benchmarks/scale_x4.sh 1 (no wheels needed; Liger reports itself unavailable).
set -u -o pipefail
STAGE=${1:?stage 1-6}
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:?OUT: where results go}
EXTRA=${EXTRA:-}
if [ -z "${NPROC:-}" ]; then
    NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
fi
[ "$NPROC" -gt 0 ] || { echo "no GPU: set NPROC (and EXTRA=\"--cpu --tiny\")"; exit 1; }
if [ -d .whl ] && [ -z "$EXTRA" ]; then
    # shellcheck source=/dev/null
    source benchmarks/gpu_prelude.sh || exit 1  # Liger's wheel on PYTHONPATH; ours is not used
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
LOG=$OUT/run_log.txt
mkdir -p "$OUT"
echo "stage $STAGE, $NPROC processes, $(date -u +%FT%TZ), tree $(git rev-parse --short HEAD 2>/dev/null)" >> "$LOG"

scale() {  # scale(folder, seconds, scale.py arguments...): one torchrun, its table into the log
    local name=$1 limit=$2 dir=$OUT/$1
    shift 2
    mkdir -p "$dir"
    echo "+ torchrun --nproc_per_node $NPROC benchmarks/scale.py --out \$OUT/$name $* $EXTRA" >> "$LOG"
    timeout "$limit" torchrun --standalone --nproc_per_node "$NPROC" benchmarks/scale.py \
        --out "$dir" "$@" $EXTRA 2>&1 | tee "$dir/stdout.txt" | grep --line-buffered -E '^\[[0-9]+s\]'
    echo "exit status ${PIPESTATUS[0]}" >> "$LOG"
    sed -n '/^model /,$p' "$dir/stdout.txt" >> "$LOG"
    rm -f "$dir/stdout.txt"  # the table is in the log; the rest is warnings
}

CONTENDERS="--contenders unpatched,liger,surgery,surgery_noac"
case "$STAGE" in
1) scale llama 560 --models llama3_8b $CONTENDERS --engines fsdp2,accelerate --fresh-batches \
       --max-seq-doublings 2 ;;
2) scale qwen 560 --models qwen3_30b_a3b $CONTENDERS --engines fsdp2 --fresh-batches \
       --max-seq-doublings 1 ;;
3)
    scale tp 200 --models llama3_8b --engines tp --tp 2 \
        --contenders unpatched,surgery,surgery_noac,loss_parallel --max-seq-doublings 0
    scale tp_plan4 180 --models llama3_8b --engines tp_plan --tp "$NPROC" \
        --contenders unpatched,surgery,surgery_noac --max-seq-doublings 0
    scale tp_plan2 180 --models llama3_8b --engines tp_plan --tp 2 \
        --contenders unpatched,surgery,surgery_noac --max-seq-doublings 0
    ;;
4)
    scale batch2 200 --models llama3_8b --engines fsdp2,accelerate --contenders surgery_noac \
        --batch 2 --fresh-batches --max-seq-doublings 0
    OUTDIR=$OUT/torchtitan MODES=eager TT_TIMEOUT=330 bash benchmarks/torchtitan_anchor.sh \
        >> "$LOG" 2>&1
    ;;
5) OUTDIR=$OUT/torchtitan MODES=compile TT_TIMEOUT=540 bash benchmarks/torchtitan_anchor.sh \
        >> "$LOG" 2>&1 ;;
6) scale qwen_accelerate 560 --models qwen3_30b_a3b $CONTENDERS --engines accelerate \
       --fresh-batches --max-seq-doublings 0 ;;
*) echo "stage 1-6"; exit 1 ;;
esac
echo "=== $LOG"
tail -n 40 "$LOG"
