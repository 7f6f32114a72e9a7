#!/bin/bash
# the second device call: the two benchmarks gpu_check.py's shares cut off, without the compile routes
set -o pipefail
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg BNLAB_DATA=$PWD/.devcarry/data
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
timeout 140 python3 benchmarks/bench_ensemble.py --device cuda --routes eager,cuda_graph --rounds 3 2>&1 | grep -v Warn | tee $OUT/bench_ensemble.txt
echo "ensemble rc=$?"
timeout 95 python3 benchmarks/bench_bnp.py --device cuda --no-native --no-compiled --rounds 3 2>&1 | grep -v -i warn | tee $OUT/bench_bnp.txt
echo "bnp rc=$?"
