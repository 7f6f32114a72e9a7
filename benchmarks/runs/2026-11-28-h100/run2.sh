#!/bin/bash
# 2026-11-28 second device call: BNP's captured step through the fast path (test + bench_bnp, pipelined too),
# then the Yang 3a plan with the trainer's own step timing
set -o pipefail
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg BNLAB_DATA=$PWD/.devcarry/data
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/env.txt
t0=$(date +%s)
timeout 80 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/optim/test_bnp_captured.py tests/optim/test_bnp_routes.py -k cuda 2>&1 | tail -3 | tee $OUT/test_captured.txt
echo "captured tests rc=$? $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 130 python3 benchmarks/bench_bnp.py --device cuda --no-native --no-compiled --rounds 3 --json > $OUT/bench_bnp.json 2> $OUT/bench_bnp.err
echo "bnp rc=$? $(( $(date +%s) - t0 )) s"; grep -iv "warn" $OUT/bench_bnp.err | tail -3
python3 - <<PY
import json
d=json.load(open("$OUT/bench_bnp.json"))
print("synced  bnp/sgd", {k: round(v, 3) for k, v in d["bnp_over_sgd"].items()}, "bnp/bn", {k: round(v, 3) for k, v in d["bnp_over_bn"].items()})
print("piped   bnp/sgd", {k: round(v, 3) for k, v in d["bnp_over_sgd_pipelined"].items()}, "bnp/bn", {k: round(v, 3) for k, v in d["bnp_over_bn_pipelined"].items()})
for r in d["rows"]:
    print(r["batch_size"], "pre ms", {v: round(1e3 * p["pre"], 3) for v, p in r["phase_s"].items()})
    print(r["batch_size"], "piped", {k: round(v, 3) for k, v in r["pipelined_ratios"].items()}, "sgd ms", round(1e3 * r["pipelined_step_s"]["sgd"], 3))
PY
t0=$(date +%s)
timeout 280 python3 benchmarks/gpu_check.py --skip tests bench_sim bench_ensemble bench_bnp --plan-only yang2019-fig3a --budget 265 --out $OUT/plan3a.json 2>&1 | tee $OUT/plan3a.log | tail -8
echo "plan rc=$? $(( $(date +%s) - t0 )) s"
python3 -c "import json;d=json.load(open('$OUT/plan3a.json'));e=d['plan']['plan']['experiments'][0];[print({k:p[k] for k in ('task','steps','seconds','warmup_seconds','step_seconds','fixed_seconds','step_source')}) for p in e['pilots']];print('task_seconds',[round(t) for t in e['task_seconds']],'total h',e['wall_seconds']/3600)"
