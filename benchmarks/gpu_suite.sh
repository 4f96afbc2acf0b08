# The whole `pytest -m gpu` suite on the GPU machine, in two back-to-back calls of one warm
# machine (flash-linear-attention's wheels travel in two halves: benchmarks/gpu_fla.sh).
#
# Here, before: our wheel and the peers' in .whl (benchmarks/gpu_prelude.sh), .fla1/.fla2
# (benchmarks/gpu_fla.sh; put the last run's tilelang_cache.tar.gz into .fla2: it saves minutes;
# with the two large wheels xz-compressed, it fits beside them).
# No GPU test needs DeepSpeed (its tests run on CPU), and beside .fla2 its wheels no longer fit in
# one call's 64 MiB. Then, within 30 s of each other (the machine keeps /tmp while it stays warm):
#   run(carry=[".whl", ".fla1"], command="bash benchmarks/gpu_suite.sh 1")
#   run(carry=[".fla2"], command="bash benchmarks/gpu_suite.sh 2")
# Everything lands flat in $OUT (the device tool may not bring back subfolders). With two GPUs the
# compile tests run on the second beside the rest (about 170 s for call 1 on an H200 x2, against
# about 270 s on one), and call 2 splits the fla tests over both (about 390 s with the cache).
# On one GPU the fla tests take longer than a call: run their two halves as stages 2a and 2b,
# each a call of its own (carry [".fla2"] both times), right after call 1.
# Call 1 also runs what needs two GPUs (test_device_map_gpu.py) where there are two.
# Call 1 reruns alone any test that ran out of GPU memory beside the other run's workers
# (benchmarks/oom_reruns.py reads the runs' JUnit reports): suite_oom_rerun.txt.
set -o pipefail
export PYTHONUNBUFFERED=1
STAGE=${1:?stage 1, 2 (or 2a and 2b)}
NGPU=$(nvidia-smi -L | grep -c '^GPU')
LAST=$((NGPU - 1))
FLA='qwen3_5 or qwen3_next or fla'
if [ "$STAGE" = 1 ]; then
    source benchmarks/gpu_fla.sh 1 || echo "fla part 1 copy failed"
    source benchmarks/gpu_prelude.sh || exit 1
    git rev-parse --short HEAD 2>/dev/null | tee "$OUT/suite_commit.txt"
    cd /tmp/w || exit 1
    ( CUDA_VISIBLE_DEVICES=$LAST timeout 420 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider \
        --junitxml="$OUT/suite_compile.xml" tests/surgery/test_compile.py > "$OUT/suite_compile.txt" 2>&1
      echo "exit status $?" >> "$OUT/suite_compile.txt" ) &
    timeout 420 python3 -m pytest -m gpu -q -rfEsxX -n 6 -p no:cacheprovider tests \
        --junitxml="$OUT/suite_rest.xml" --ignore=tests/surgery/test_compile.py \
        --ignore=tests/benchmarks > "$OUT/suite_rest.txt" 2>&1
    echo "exit status $?" >> "$OUT/suite_rest.txt"
    wait
    # A test that ran out of GPU memory beside the other run's workers (one GPU: a test or two of
    # a run), rerun alone; its first failure stays in its run's log (benchmarks/oom_reruns.py)
    # (within the call's 600 s: what is left of 570 s since the script began, if a minute is)
    python3 "$REPO/benchmarks/oom_reruns.py" "$OUT"/suite_compile.xml "$OUT"/suite_rest.xml \
        > /tmp/oom_ids.txt
    mapfile -t OOM_IDS < /tmp/oom_ids.txt
    LEFT=$((570 - SECONDS))
    if [ "${#OOM_IDS[@]}" -gt 0 ] && [ "$LEFT" -ge 60 ]; then
        timeout "$LEFT" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider "${OOM_IDS[@]}" \
            > "$OUT/suite_oom_rerun.txt" 2>&1
        echo "exit status $?" >> "$OUT/suite_oom_rerun.txt"
    fi
    echo "=== SUMMARY"
    tail -n 2 "$OUT/suite_compile.txt"; tail -n 2 "$OUT/suite_rest.txt"
    grep -hE "^(FAILED|ERROR)" "$OUT"/suite_compile.txt "$OUT"/suite_rest.txt | head -20
    if [ "${#OOM_IDS[@]}" -gt 0 ]; then
        echo "out of memory beside the other run, rerun alone (${LEFT} s left for it):"
        printf '%s\n' "${OOM_IDS[@]}"
        tail -n 2 "$OUT/suite_oom_rerun.txt" 2>/dev/null || echo "not rerun: too little time"
    fi
else
    source benchmarks/gpu_fla.sh 2 || echo "fla part 2 install failed"
    [ -d /tmp/site/surgery ] || { echo "machine lost: /tmp/site missing (run stage 1 again)"; exit 1; }
    export PYTHONPATH=/tmp/site REPO=$(pwd)
    source benchmarks/gpu_fla.sh use  # an argument: a bare `source` would pass on this script's "2"
    cd /tmp/w || exit 1
    FA=a  # the log of the tests run on GPU 0
    A="tests/surgery/test_linear_attention_fla.py tests/surgery/test_gpu.py tests/models/test_vision_attention.py tests/models/test_llama4.py"
    B="tests/surgery/test_compile.py tests/surgery/test_autocast.py tests/models/test_multimodal.py"
    case "$STAGE" in
        2a) B="" ;;
        2b) A="$B"; B=""; FA=b ;;
        *) if [ "$NGPU" -lt 2 ]; then A="$A $B"; B=""; fi ;;
    esac
    [ -n "$B" ] && ( CUDA_VISIBLE_DEVICES=$LAST timeout -s INT 540 python3 -m pytest -m gpu -v -n 7 \
        -p no:cacheprovider $B -k "$FLA" > "$OUT/suite_fla_b.txt" 2>&1
      echo "exit status $?" >> "$OUT/suite_fla_b.txt" ) &
    CUDA_VISIBLE_DEVICES=0 timeout -s INT 540 python3 -m pytest -m gpu -v -n 7 -p no:cacheprovider \
        $A -k "$FLA" > "$OUT/suite_fla_$FA.txt" 2>&1
    echo "exit status $?" >> "$OUT/suite_fla_$FA.txt"
    wait
    cd "$REPO" && fla_save_cache
    echo "=== SUMMARY"
    cat "$OUT"/suite_fla_*.txt | grep -E "FAILED|ERROR|passed|failed" | tail -n 12
fi
