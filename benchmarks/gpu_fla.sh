# flash-linear-attention on the GPU machine (issue 32), whose image lacks it: fla-core 0.6 and,
# since fla 0.6 on Hopper with triton < 3.7.1 runs its backward through TileLang, TileLang and its
# needs. The wheels exceed one call's 64 MiB beside the repository, so they travel in two calls
# while the machine stays warm (it keeps /tmp between calls until it is given back).
#
# Here, once (the two large wheels are stored uncompressed and then xz-compressed: 49.5 MB of
# TileLang's wheel becomes 28.6 MB, 29.3 MB of z3's 9.7 MB, so the cache fits beside them):
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64"
#   pip download $P -d .fla1 tilelang==0.1.15
#   pip download $P -d .fla2 z3-solver==4.15.4.0 apache-tvm-ffi==0.1.12 \
#       torch-c-dlpack-ext==0.1.5 fla-core==0.6.0 flash-linear-attention==0.6.0
#   for w in .fla1/tilelang-*.whl .fla2/z3_solver-*.whl; do
#       rm -rf /tmp/unz && mkdir /tmp/unz && (cd /tmp/unz && unzip -q "$OLDPWD/$w" && rm "$OLDPWD/$w" \
#           && zip -0 -r -q -X "$OLDPWD/$w" .) && xz -9 -T2 "$w"; done
#   echo /.fla1/ >> .git/info/exclude; echo /.fla2/ >> .git/info/exclude
# (each call's carry beside the tree, 21.7 MB at 4bd5c57, must stay under 64 MiB: .whl + .fla1
# 31.7 MB, .fla2 16.5 MB with the cache)
# Then the first call (carry .whl and .fla1) runs `source benchmarks/gpu_fla.sh 1`, and the next
# one (carry .fla2) `source benchmarks/gpu_fla.sh 2`, which installs everything into /tmp/site2;
# every later call of that machine only `source benchmarks/gpu_fla.sh use` to use it (an argument
# other than 1 or 2: a bare `source` inside a script passes on that script's own arguments).
#
# TileLang compiles fla's backward kernels on first use (the fp32 ones several minutes each), and
# its cache lives in /tmp, lost with the machine. `fla_save_cache` (after the fla tests) writes it
# to $OUT/tilelang_cache.tar.gz when it fits what comes back (16 MiB); put that file into .fla2/
# here, and the next machine's `source benchmarks/gpu_fla.sh 2` unpacks it before anything runs.
if [ "$1" = 1 ]; then
    mkdir -p /tmp/fla_wheels && cp .fla1/* /tmp/fla_wheels/ || return 1
elif [ "$1" = 2 ]; then
    cp .fla2/*.whl* /tmp/fla_wheels/ && python3 - <<'PY' || return 1
import glob, lzma, os, shutil
for packed in glob.glob("/tmp/fla_wheels/*.whl.xz"):
    with lzma.open(packed) as src, open(packed[: -len(".xz")], "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(packed)
PY
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site2 /tmp/fla_wheels/*.whl || return 1
    if [ -f .fla2/tilelang_cache.tar.gz ]; then
        tar xzf .fla2/tilelang_cache.tar.gz -C /tmp && echo "TileLang cache unpacked"
    fi
fi
if [ "$1" != 1 ]; then
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site2"
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/tmp/site2/z3/lib"
    # TileLang's and Triton's compiled kernels in /tmp, which the warm machine keeps between calls:
    # TileLang builds each backward kernel shape once (minutes in fp32), and later calls reuse it.
    export TILELANG_CACHE_DIR=/tmp/tilelang_cache TRITON_CACHE_DIR=/tmp/triton_cache
fi

fla_save_cache() {
    # TileLang's compiled kernels into $OUT, if the archive is small enough to come back.
    [ -d /tmp/tilelang_cache ] || return 0
    tar czf /tmp/tilelang_cache.tar.gz -C /tmp tilelang_cache || return 0
    if [ "$(stat -c %s /tmp/tilelang_cache.tar.gz)" -lt 16000000 ]; then
        cp /tmp/tilelang_cache.tar.gz "$OUT/"
    else
        echo "TileLang cache: $(du -h /tmp/tilelang_cache.tar.gz | cut -f1), too large to come back"
    fi
}
