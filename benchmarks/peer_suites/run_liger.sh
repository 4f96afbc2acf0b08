#!/usr/bin/env bash
# Liger-Kernel's own tests of its cross entropy, fused linear cross entropy, RMSNorm, SwiGLU and
# RoPE, run twice: against
# Liger's kernels (the control: what the tests themselves do on this machine) and against
# surgery's (liger_adapter.py puts our kernels behind Liger's two autograd functions). Then the
# outcomes side by side (summary.py): every test that fails with ours, and whether it passes in
# the control.
#
#     bash benchmarks/peer_suites/run_liger.sh SRC OUT [both|control|surgery]
#
# On an H200 the five files take over 480 s a side: the device tool's 10-minute calls run one side
# each (`control`, then `surgery`, each writing its xml into OUT), and `both` on the two xml files
# brought back side by side writes the summary (a side whose xml is already in OUT is not run
# again).
#
# SRC holds Liger's test files (they are Liger's, not in this repository), taken from a Liger
# checkout at a commit you record, e.g. into the git-ignored .peers/liger:
#     mkdir -p .peers/liger && git -C LIGER_CHECKOUT archive --format=tar HEAD test/__init__.py \
#         test/conftest.py test/utils.py test/transformers/test_cross_entropy.py \
#         test/transformers/test_fused_linear_cross_entropy.py test/transformers/test_rms_norm.py \
#         test/transformers/test_swiglu.py test/transformers/test_rope.py | tar x -C .peers/liger
# liger_kernel must be importable (on the GPU machine: its wheel, through gpu_prelude.sh; carry
# .whl and .peers). Writes OUT/liger_{control,surgery}.xml, their logs and liger_summary.json.
set -o pipefail
SRC=$(cd "${1:?SRC: the folder holding the Liger test/ folder}" && pwd)
OUT=$(mkdir -p "${2:?OUT: a result folder}" && cd "$2" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
TESTS="test/transformers/test_fused_linear_cross_entropy.py test/transformers/test_cross_entropy.py
    test/transformers/test_rms_norm.py test/transformers/test_swiglu.py test/transformers/test_rope.py"
# Liger marks a test flaky (pytest-rerunfailures' marker); registered here because the rootdir's
# pyproject (this repository's, --strict-markers) knows no such marker: each test runs once.
ARGS=(-q -rs -p no:cacheprovider -o "markers=flaky: Liger's rerun marker, run once here")
SIDE=${3:-both}
cd "$SRC" || exit 1
if [ "$SIDE" = control ] || { [ "$SIDE" = both ] && [ ! -s "$OUT/liger_control.xml" ]; }; then
    python3 -m pytest $TESTS "${ARGS[@]}" --junitxml "$OUT/liger_control.xml" \
        > "$OUT/liger_control_log.txt" 2>&1
    tail -n 1 "$OUT/liger_control_log.txt"
fi
if [ "$SIDE" = surgery ] || { [ "$SIDE" = both ] && [ ! -s "$OUT/liger_surgery.xml" ]; }; then
    PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -p liger_adapter $TESTS \
        "${ARGS[@]}" --junitxml "$OUT/liger_surgery.xml" > "$OUT/liger_surgery_log.txt" 2>&1
    tail -n 1 "$OUT/liger_surgery_log.txt"
fi
[ "$SIDE" = both ] || exit 0
python3 "$HERE/summary.py" "$OUT/liger_control.xml" "$OUT/liger_surgery.xml" \
    --json "$OUT/liger_summary.json"
