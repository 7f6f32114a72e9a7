#!/bin/bash
# the device run of issue 27: install the carried wheels, then gpu_check.py (its JSON rewritten after each part)
set -o pipefail
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg BNLAB_DATA=$PWD/.devcarry/data
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc;
  python3 -c "import torch,triton,bnlab,dask,distributed,simpleeval;print('torch',torch.__version__,'triton',triton.__version__,torch.cuda.get_device_name(0))"; } 2>&1 | tee $OUT/env.txt
python3 -c "from bnlab.data import load_dataset; d=load_dataset('mnist', 'train'); print('mnist', d)" 2>&1 | tail -2
t0=$(date +%s)
timeout ${GC_TIMEOUT:-540} python3 benchmarks/gpu_check.py --budget ${GC_BUDGET:-480} --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log
echo "gpu_check rc=$? wall=$(( $(date +%s) - t0 )) s"
timeout 30 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/nets/test_train.py -k "bad_training" 2>&1 | tail -4
