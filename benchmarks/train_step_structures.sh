#!/usr/bin/env bash
# Issue 33 part 1: every input structure a user feeds (no mask, a mask of ones, masked prompts,
# right- and left-padded, packed through position_ids and through cu_seq_lens_*), Llama ~1B and
# Qwen3-MoE-shaped, surgery eager and compiled against compiled transformers, on a machine of two
# GPUs in two calls of the device tool (each under its 10-minute limit: compiled transformers'
# Qwen3-MoE worker alone takes ~400 s, one compilation per structure).
#
# On the GPU machine, from the repo root (nothing to carry):
#     bash benchmarks/train_step_structures.sh 1   # GPU 0: Llama's three contenders;
#                                                  # GPU 1: Qwen3-MoE's compiled transformers
#     bash benchmarks/train_step_structures.sh 2   # GPU 0: Qwen3-MoE's compiled surgery;
#                                                  # GPU 1: Qwen3-MoE's eager surgery
# Each writes train_step-<model>.json (and a log) flat into $OUT; here, merge the four files:
#     python3 benchmarks/train_step.py --merge A/train_step-llama.json \
#         A/train_step-qwen3_moe.json B/train_step-qwen3_moe*.json --out DIR
# (call 2's two workers write one file each: train_step-qwen3_moe.json and, renamed by this script,
# train_step-qwen3_moe-eager.json). Quick mode; the first scenario of each process takes
# FIRST_SCENARIO_WARMUP more warm-up steps (train_step.py). Results of 4bfae6c:
# results/train_step-structures-4bfae6c.{json,png,_log.txt}.
set -o pipefail
export PYTHONUNBUFFERED=1
STAGE=${1:?stage 1 or 2}
OUT=${OUT:?set OUT}
S=plain2,ones2,prompts2,padded2,leftpadded2,packed2,packedcu2
RUN="python3 benchmarks/train_step.py --scenarios $S --quick --skip-max-seq"
LIMITS="--time-budget-s 480 --worker-timeout-s 300 --compiled-worker-timeout-s 540"
if [ "$STAGE" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout 570 $RUN --models llama \
        --contenders surgery,surgery_compiled,unpatched_compiled $LIMITS --out "$OUT" \
        > "$OUT/structures_llama_log.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 570 $RUN --models qwen3_moe --contenders unpatched_compiled \
        $LIMITS --out "$OUT" > "$OUT/structures_qwen3_moe_transformers_log.txt" 2>&1 &
    wait
else
    mkdir -p "$OUT/eager"
    CUDA_VISIBLE_DEVICES=0 timeout 570 $RUN --models qwen3_moe --contenders surgery_compiled \
        $LIMITS --out "$OUT" > "$OUT/structures_qwen3_moe_surgery_log.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 570 $RUN --models qwen3_moe --contenders surgery \
        $LIMITS --out "$OUT/eager" > "$OUT/structures_qwen3_moe_eager_log.txt" 2>&1 &
    wait
    mv "$OUT/eager/train_step-qwen3_moe.json" "$OUT/train_step-qwen3_moe-eager.json"
    rm -rf "$OUT/eager"
fi
grep -hE "tok/s|error|skipped" "$OUT"/structures_*_log.txt | tail -30
