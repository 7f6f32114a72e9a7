#!/bin/bash
# 2026-11-28 device call: BNP's captured step (CUDA test + bench_bnp), then gpu_check's CUDA tests and the Yang 3a plan
set -o pipefail
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg BNLAB_DATA=$PWD/.devcarry/data
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc;
  python3 -c "import torch,triton,bnlab,dask,distributed,simpleeval;print('torch',torch.__version__,'triton',triton.__version__,torch.cuda.get_device_name(0))"; } 2>&1 | tee $OUT/env.txt
t0=$(date +%s)
timeout 100 python3 -m pytest -v -p no:cacheprovider -o addopts= tests/optim/test_bnp_captured.py -k cuda 2>&1 | tail -15 | tee $OUT/test_captured.txt
echo "captured test rc=$? $(( $(date +%s) - t0 )) s" | tee -a $OUT/test_captured.txt
t0=$(date +%s)
timeout 110 python3 benchmarks/bench_bnp.py --device cuda --no-native --no-compiled --rounds 3 --json > $OUT/bench_bnp.json 2> $OUT/bench_bnp.err
echo "bnp rc=$? $(( $(date +%s) - t0 )) s"; tail -5 $OUT/bench_bnp.err
python3 -c "import json;d=json.load(open('$OUT/bench_bnp.json'));print('bnp/sgd',d['bnp_over_sgd'],'bnp/bn',d['bnp_over_bn']);[print(r['batch_size'],{k:round(v,3) for k,v in r['ratios'].items()},r.get('launches_per_step'),r.get('launch_calls_per_step'),{v:round(1e3*p['pre'],3) for v,p in r['phase_s'].items()}) for r in d['rows']]"
t0=$(date +%s)
timeout 345 python3 benchmarks/gpu_check.py --skip bench_sim bench_ensemble bench_bnp --plan-only yang2019-fig3a --budget 325 --out $OUT/gc.json 2>&1 | tee $OUT/gc.log | tail -30
echo "gpu_check rc=$? $(( $(date +%s) - t0 )) s"
