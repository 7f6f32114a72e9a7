"""Benchmark: CPU of one trainability column in a process started with Dask's default worker environment
against the environment of bnlab's own LocalCluster (bnlab.experiments.sweep._LOCAL_CLUSTER_CONFIG).

Dask's nannies start workers with ``MALLOC_TRIM_THRESHOLD_=65536``; glibc then also stops adapting its
mmap threshold, so every tensor above 128 KiB is a fresh mmap that is page-faulted in and unmapped
again.  The same ensemble training (a column of Yang et al. 2019, Fig. 3a: BN-MLPs of width 128 and
depths 4–64 on MNIST-shaped random inputs, one ``train_ensemble``) runs in two fresh processes, one per
environment, one after the other; printed: user, system and total CPU seconds of each and their ratio.

    python benchmarks/bench_worker_env.py [--quick] [--steps 60] [--batch 128] [--json]

Random inputs (no dataset needed): the cost does not depend on the pixel values.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import resource, sys, torch
torch.set_num_threads(1)
from bnlab.nets import BNMLP, train_ensemble
depths, batch, steps = [int(v) for v in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(0)
x, y = torch.rand(4096, 784, generator=g), torch.randint(0, 10, (4096,), generator=g)
models = [BNMLP(784, 10, depth=d, width=128, seed=0) for d in depths]
r0 = resource.getrusage(resource.RUSAGE_SELF)
train_ensemble(models, (x, y), test_data=(x[:1000], y[:1000]), lr=1e-3 * batch, batch_size=batch, steps=steps)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime)
"""


def _run(env_changes: dict, depths, batch: int, steps: int) -> tuple[float, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", _CHILD, ",".join(map(str, depths)), str(batch), str(steps)],
                         env=env, capture_output=True, text=True, check=True)
    user, system = map(float, out.stdout.split())
    return user, system


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, seconds)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    args = ap.parse_args(argv)
    depths = [2, 4] if args.quick else [4, 8, 12, 16, 24, 32, 48, 64]
    steps = 3 if args.quick else args.steps
    batch = 16 if args.quick else args.batch
    rows = []
    for name, env in [("Dask default (MALLOC_TRIM_THRESHOLD_=65536)", {"MALLOC_TRIM_THRESHOLD_": "65536"}),
                      ("bnlab's LocalCluster (glibc defaults)", {})]:
        user, system = _run(env, depths, batch, steps)
        rows.append({"environment": name, "user_s": user, "system_s": system, "cpu_s": user + system})
    ratio = rows[0]["cpu_s"] / rows[1]["cpu_s"] if rows[1]["cpu_s"] > 0 else float("inf")
    out = {"depths": depths, "batch": batch, "steps": steps, "rows": rows, "cpu_ratio": ratio}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"one ensemble of depths {depths}, batch {batch}, {steps} SGD steps, width 128, 1 thread")
        print(f"{'environment':46s} {'user s':>8s} {'system s':>9s} {'CPU s':>8s}")
        for r in rows:
            print(f"{r['environment']:46s} {r['user_s']:8.2f} {r['system_s']:9.2f} {r['cpu_s']:8.2f}")
        print(f"CPU ratio Dask default / bnlab: {ratio:.2f}")
    return out


if __name__ == "__main__":
    main()
