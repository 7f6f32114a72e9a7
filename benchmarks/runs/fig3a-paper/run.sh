#!/bin/bash
# Yang et al. Fig. 3a at paper scale on one lent GPU, over several device calls (issue 27's "planned at
# <= 1 hour and, if the plan says so, run"): each call continues the sweep for at most LIMIT seconds and
# stops it cleanly (SIGTERM: the finished cells are committed, the running column keeps its checkpoint).
#
#   device run, carry [".devcarry"], timeout_s ~ LIMIT + 60:
#       LIMIT=480 bash benchmarks/runs/fig3a-paper/run.sh
#
# Between calls of one session the device machine keeps its files while it stays warm (its
# idle_release_s), so the column in flight goes on from its checkpoint (--checkpoint-every 60) in the
# next call: the B = 4 column, planned at 770 s on an H100, is longer than one call may run (600 s).
# The store (a few MB) comes back in $OUT after every call; a later session carries it back in
# .devcarry/fig3a/ (copy $OUT's store there) and resumes at whole columns — the checkpoint, ~0.5 GB,
# is over what a call carries, so a column in flight when a session ends starts over in the next.
# Prerequisite: bash benchmarks/gpu_carry.sh (wheels and MNIST in .devcarry/).
set -o pipefail
LIMIT=${LIMIT:-480}
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg BNLAB_DATA=$PWD/.devcarry/data
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devcarry/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
STORE_DIR=${STORE_DIR:-/tmp/fig3a}     # on the device's disk: kept between the calls of a session
mkdir -p "$STORE_DIR"
if [ ! -e "$STORE_DIR/yang2019-fig3a-paper.sqlite" ] && [ -e .devcarry/fig3a/yang2019-fig3a-paper.sqlite ]; then
  cp .devcarry/fig3a/yang2019-fig3a-paper.sqlite "$STORE_DIR/"   # a store carried from an earlier session
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
t0=$(date +%s)
timeout -s TERM "$LIMIT" python3 -m bnlab sweep run yang2019-fig3a --scale paper --workers 1 \
    --results-dir "$STORE_DIR" --checkpoint-every 60 2>&1 | tail -20 | tee "$OUT/sweep.log"
echo "sweep rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/sweep.log"
python3 -m bnlab sweep status yang2019-fig3a --scale paper --results-dir "$STORE_DIR" --json > "$OUT/status.json"
python3 -c "import json; d=json.load(open('$OUT/status.json')); print('cells', d['total'], d['counts'])"
ls -la "$STORE_DIR" "$STORE_DIR"/*.checkpoints 2>/dev/null | tee "$OUT/files.txt"
cp "$STORE_DIR/yang2019-fig3a-paper.sqlite" "$OUT/"
# once every cell is done: the figure and its verdict beside the paper's
if python3 -c "import json, sys; d = json.load(open('$OUT/status.json')); sys.exit(d['counts']['done'] != d['total'])"; then
  python3 -m bnlab reproduce yang2019-fig3a --scale paper --results-dir "$STORE_DIR" --serial --no-progress \
      --out "$OUT/report" 2>&1 | tail -20 | tee "$OUT/reproduce.log"
fi
