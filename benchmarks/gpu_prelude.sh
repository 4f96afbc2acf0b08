# How GPU runs were made from a developer machine with the `device` tool (see the session notes).
#
# Here, before a run: build our wheel next to the peers' wheels (the GPU machine has no network and
# `pip install -e .` there is not usable):
#   echo /.whl/ >> .git/info/exclude
#   pip wheel -q --no-deps --no-build-isolation -w .whl .
# Then, as the first thing of the GPU command (carry [".whl"]):
#   source benchmarks/gpu_prelude.sh
# It installs the wheels into /tmp/site and copies tests/ to /tmp/w: run pytest from /tmp/w, because
# in the repository root the `surgery/` folder (without models/ or kernels/ inside) shadows the
# installed package. Benchmark scripts load `surgery` from the checkout themselves. The modules of
# tests/benchmarks/ import the scripts of benchmarks/, which are not copied (copied beside tests/,
# they loaded a surgery package from /tmp/w): they hold no gpu-marked test, so pass
# `--ignore=tests/benchmarks` to `pytest -m gpu` rather than read their collection errors.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 REPO=$(pwd)
rm -rf /tmp/w && mkdir -p /tmp/w && cp -r tests pyproject.toml /tmp/w/
