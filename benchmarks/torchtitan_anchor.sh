#!/usr/bin/env bash
# torchtitan's own Llama-3 8B recipe, the issue-37 anchor, run on this machine beside scale.py.
# Published figure: Llama-3.1-8B on 8 H100s, FSDP, bf16, seq 8192, local batch 2, selective
# activation checkpointing: 5,762 tok/s per GPU, 6,667 with torch.compile.
#
# Run ON THE GPU MACHINE from the repo root (.tt/ carried: run(carry=[".tt"])):
#     bash benchmarks/torchtitan_anchor.sh            # writes into $OUT (flat: the device tool
#                                                     # may not bring back subfolders)
#     MODES=eager bash ...; MODES=compile bash ...   # one call each (10-minute limit a call)
#
# .tt/ (ignored by git, ~3 MB; build it on a networked machine, one package a call):
#     for p in torchtitan==0.3.0 torchtitan==0.2.2 tyro==1.0.17 docstring-parser==0.18.0 \
#         typeguard==4.6.1 typing-extensions==4.16.0 torchdata==0.11.0 spmd-types==0.2.3 \
#         datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; do
#       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#         --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         --platform manylinux1_x86_64 -d .tt "$p"; done
# These are what the training path imports and the image lacks (0.2.2 needs no spmd-types);
# wandb and torch_checkpointing, declared by 0.3.0, are never imported on this path;
# tensorboard, tokenizers, einops, pillow and triton are in the image. datasets 5.2.0 despite
# 0.3.0's datasets<4.8 pin: only load_dataset(local json) and split_dataset_by_node are used.
#
# Which torchtitan: 0.3.0 needs torch >= 2.14 (on torch 2.11 it fails at import:
# torch.distributed.fsdp.DataParallelMeshDims; on 2.13 its default spmd_types backend fails in
# fully_shard). The image has torch 2.11, so the script falls back to torchtitan 0.2.2 (February
# 2026, torch 2.11's cycle), whose llama3 "8B" flavour is the same model (8,030,261,248
# parameters) with SDPA causal attention, as in the published run. TT_VERSION=0.3.0|0.2.2 forces.
#
# What it runs, per mode (MODES="eager compile"): torchrun over all GPUs, torchtitan's trainer:
#   llama3 8B, random init (no checkpoint), FSDP2 over all GPUs (data_parallel_shard_degree -1),
#   bf16 as in the recipe (bf16 params/compute via FSDP mixed precision, fp32 master weights and
#   reduce), seq 8192, local batch 2, selective AC (per-op policy), AdamW lr 3e-4, STEPS=10 steps,
#   log every step; compile mode adds --compile.enable (model and loss). No validation, no
#   profiler, no tensorboard, no checkpoints; collective timeout after step 1 raised from 100 s to
#   600 s (a slow compile on one rank must not kill the run). 0.3.0 only: CUDA graphs off (its new default is on;
#   the anchor and scale.py have none; TT_CUDA_GRAPHS=1 keeps them), FSDP symmetric memory off.
# Data: a WordLevel tokenizer over the 128,256 ids and random documents of exactly seq+1 tokens
# made here with `tokenizers`, read by torchtitan's own text loader (dataset c4_test, local path),
# so every sample is one whole document (0.3.0's block-causal flex mask is then plain causal)
# and token ids are uniform over the vocabulary, like scale.py's random tokens.
# Result: $OUT/torchtitan_<mode>.log (all ranks) and torchtitan_anchor.json: per GPU the median
# "tps" over the steps after WARMUP=3 (torchtitan's tokens/s per device), the largest "memory"
# (torchtitan's peak reserved GiB per step; scale.py reports peak allocated), losses, commands.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
TT_DIR=${TT_DIR:-.tt}
OUTDIR=${OUTDIR:-${OUT:-/tmp/out}}
MODES=${MODES:-eager compile}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
SEQ=${SEQ:-8192}
BATCH=${BATCH:-2}
TT_ENTRY=${TT_ENTRY:--m torchtitan.train}   # a script path here for CPU plumbing tests
mkdir -p "$OUTDIR" /tmp/tt_run
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=/tmp/tt_run/hf TOKENIZERS_PARALLELISM=false
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
[ "$NGPU" -gt 0 ] || NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
TORCH=$($PY -c 'import torch; print(torch.__version__)')
if [ -z "${TT_VERSION:-}" ]; then
    TT_VERSION=$($PY -c 'import torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); print("0.3.0" if v >= (2, 14) else "0.2.2")')
fi

# Install the carried wheels this version needs into $SITE, skipping those already there.
for w in "$TT_DIR"/*.whl; do
    b=$(basename "$w"); name=${b%%-*}; ver=${b#*-}; ver=${ver%%-*}
    case "$name" in torchtitan) [ "$ver" = "$TT_VERSION" ] || continue ;; esac
    case "$name" in spmd_types) [ "$TT_VERSION" = 0.3.0 ] || continue ;; esac
    [ -d "$SITE/$name-$ver.dist-info" ] || todo="${todo:-} $w"
done
if [ -n "${todo:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" $todo || exit 1
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# Tokenizer and data (vocabulary 128,256 = the model's; one document = seq+1 tokens).
VOCAB=${VOCAB:-128256}
$PY - "$VOCAB" "$SEQ" $((NGPU * BATCH * (STEPS + 2))) /tmp/tt_run/assets /tmp/tt_run/data <<'EOF' || exit 1
import json, os, random, sys
from tokenizers import Tokenizer, models, pre_tokenizers
vocab, seq, ndocs, assets, data = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:]
os.makedirs(assets, exist_ok=True)
os.makedirs(data, exist_ok=True)
tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(os.path.join(assets, "tokenizer.json"))
rng = random.Random(0)
with open(os.path.join(data, "data.jsonl"), "w") as f:
    for _ in range(ndocs):
        f.write(json.dumps({"text": " ".join(f"t{rng.randrange(vocab)}" for _ in range(seq + 1))}) + "\n")
EOF

if [ "$TT_VERSION" = 0.3.0 ]; then
    ARGS="--module llama3 --config llama3_8b --hf-assets-path /tmp/tt_run/assets
      --dataloader.dataset c4_test --dataloader.dataset-path /tmp/tt_run/data
      --training.local-batch-size $BATCH --training.seq-len $SEQ --training.steps $STEPS
      --lr-scheduler.warmup-steps 2 --metrics.log-freq 1 --metrics.disable-color-printing
      --metrics.no-enable-tensorboard --profiler.no-enable-profiling --checkpoint.no-enable
      --validator.no-enable --parallelism.no-enable-fsdp-symm-mem --debug.seed 0
      --comm.train-timeout-seconds 600"
    [ "${TT_CUDA_GRAPHS:-0}" = 1 ] || ARGS="$ARGS --training.disable-cuda-graphs"
    COMPILE="--compile.enable"
else
    ARGS="--model.name llama3 --model.flavor 8B --model.hf_assets_path /tmp/tt_run/assets
      --training.dataset c4_test --training.dataset_path /tmp/tt_run/data
      --training.local_batch_size $BATCH --training.seq_len $SEQ --training.steps $STEPS
      --optimizer.lr 3e-4 --lr_scheduler.warmup_steps 2
      --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op
      --metrics.log_freq 1 --metrics.disable_color_printing --debug.seed 0
      --comm.train_timeout_seconds 600"
    COMPILE="--compile.enable"
fi

summarize() {  # parses $OUTDIR/torchtitan_$1.log into torchtitan_anchor.json (kept across calls)
$PY - "$OUTDIR" "$TT_VERSION" "$TORCH" "$NGPU" "$WARMUP" "$1" "$2" <<'EOF'
import json, os, re, statistics, sys
out, ttv, torch_v, ngpu, warmup, mode, cmd = sys.argv[1:]
warmup = int(warmup)
# torchtitan's per-step line (components/metrics.py), prefixed "[defaultN]:" by torchrun --tee:
#   step:  5  loss:  12.1  grad_norm: ...  memory: 61.20GiB(43.60%)  tps: 6,123  tflops: ...  mfu: ...%
pat = re.compile(r"\[default(\d+)\]:.*step:\s*(\d+)\s+loss:\s*([-\d.eE+naif]+).*?memory:\s*([-\d.]+)GiB"
                 r"\(([-\d.]+)%\)\s+tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*([\d.]+|N/A)")
path = f"{out}/torchtitan_anchor.json"
res = json.load(open(path)) if os.path.exists(path) else {"runs": {}}
res.update(torchtitan=ttv, torch=torch_v, gpus=int(ngpu), warmup_steps_excluded=warmup,
           anchor_8xH100_tok_s_per_gpu={"eager": 5762, "compile": 6667})
text = open(f"{out}/torchtitan_{mode}.log", errors="replace").read()
rc = re.findall(r"^rc=(\d+)", text, re.M)
steps = {}
for m in pat.finditer(text):
    r, s = int(m[1]), int(m[2])
    steps.setdefault(r, {})[s] = dict(loss=float(m[3]), mem_gib=float(m[4]), mem_pct=float(m[5]),
                                      tps=int(m[6].replace(",", "")), tflops=float(m[7].replace(",", "")),
                                      mfu=None if m[8] == "N/A" else float(m[8]))
run = {"command": cmd, "rc": int(rc[-1]) if rc else None}
if steps:  # per rank: median tps over the steps after warmup; memory: the largest of any step
    timed = {r: [v for s, v in st.items() if s > warmup] or list(st.values()) for r, st in steps.items()}
    tps = {r: statistics.median(v["tps"] for v in t) for r, t in sorted(timed.items())}
    mem = {r: max(v["mem_gib"] for v in st.values()) for r, st in sorted(steps.items())}
    r0 = min(steps)
    run.update(tokens_per_s_per_gpu=round(statistics.mean(tps.values())), tokens_per_s_by_rank=tps,
               peak_reserved_gib_per_gpu=max(mem.values()), peak_reserved_gib_by_rank=mem,
               tflops_per_gpu=statistics.median(v["tflops"] for v in timed[r0]),
               mfu_pct=statistics.median(v["mfu"] or 0 for v in timed[r0]),
               losses=[steps[r0][s]["loss"] for s in sorted(steps[r0])], steps_logged=len(steps[r0]))
res["runs"][mode] = run
print(mode, {k: run.get(k) for k in ("rc", "tokens_per_s_per_gpu", "peak_reserved_gib_per_gpu", "steps_logged")})
json.dump(res, open(path, "w"), indent=1)
EOF
}

for mode in $MODES; do
    extra=""; [ "$mode" = compile ] && extra="$COMPILE"
    DUMP=--dump-folder; [ "$TT_VERSION" = 0.2.2 ] && DUMP=--job.dump_folder
    cmd="$PY -m torch.distributed.run --standalone --nproc_per_node $NGPU --tee 3 $TT_ENTRY
      $ARGS $extra $DUMP /tmp/tt_run/$mode ${TT_EXTRA:-}"
    cmd=$(echo $cmd)
    echo "== torchtitan $TT_VERSION, torch $TORCH, $NGPU GPUs, $mode: $cmd"
    timeout "${TT_TIMEOUT:-480}" $cmd > "$OUTDIR/torchtitan_$mode.log" 2>&1
    echo "rc=$?" >> "$OUTDIR/torchtitan_$mode.log"
    tail -n 3 "$OUTDIR/torchtitan_$mode.log"
    summarize "$mode" "$cmd"
done

