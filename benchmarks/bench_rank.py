"""Rank collapse benchmarks: the streamed deep chain, and batched vs per-layer rank measures.

1. The paper's Fig. 3a chain (d = N = 32, BN without mean subtraction, linear, γ = ∞) at
   several depths up to L = 10⁶: wall time, time per layer, and the peak memory of the run.
   Each depth runs in a fresh subprocess that reports its peak resident set size above the
   baseline after ``import torch, bnlab`` and a small warm-up (CPU), or
   ``torch.cuda.max_memory_allocated`` (CUDA).  Flat memory in depth is the claim; a run
   that stored every layer would need depth · chains · d · N · 8 bytes (8.4 GB at 10⁶).
2. Rank measures of a stack of layers (L, d, N) in one batched call vs a Python loop over
   the layers calling the same function per layer: the speed-up ratio, in one process.

Usage::

    python benchmarks/bench_rank.py [--quick] [--device cpu|cuda] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(int(sys.argv[4]))
from bnlab.rank import run_chain
depth, device, chains = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
run_chain(32, 32, 300, chains=chains, device=device, seed=1)  # warm-up: allocator, kernels
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
t = time.perf_counter()
res = run_chain(32, 32, depth, chains=chains, device=device, seed=0)
if device == "cuda":
    torch.cuda.synchronize()
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {"depth": depth, "wall_s": wall, "peak_rss_above_baseline_mb": (peak - base) / 1024.0,
       "peak_rss_mb": peak / 1024.0, "mean_soft_rank": float(res.mean_soft_rank.mean())}
if device == "cuda":
    out["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
print(json.dumps(out))
"""


def bench_depth(depth: int, device: str, chains: int, threads: int) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(depth), device, str(chains), str(threads)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_stack(layers: int, d: int, n: int, device: str, repeats: int = 3) -> dict:
    import torch

    from bnlab.rank import rank_lower_bound, rank_measures, soft_rank

    gen = torch.Generator(device=device).manual_seed(0)
    stack = torch.randn(layers, d, n, generator=gen, dtype=torch.float64, device=device)

    def timed(fn):
        fn()  # warm-up
        best = float("inf")
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    out = {"layers": layers, "d": d, "N": n}
    functions = (("rank_measures", rank_measures), ("soft_rank", soft_rank), ("rank_lower_bound", rank_lower_bound))
    for name, fn in functions:
        t_batched = timed(lambda: fn(stack))
        t_loop = timed(lambda: [fn(stack[i]) for i in range(layers)])
        out[name] = {"batched_s": t_batched, "loop_s": t_loop, "speedup": t_loop / t_batched}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small depths and stack (a smoke run, seconds)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chains", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    depths = [100, 1000] if args.quick else [1_000, 10_000, 100_000, 1_000_000]
    rows = [bench_depth(dep, args.device, args.chains, args.threads) for dep in depths]
    stack = bench_stack(100 if args.quick else 2000, 32, 32, args.device)
    result = {"device": args.device, "threads": args.threads, "chains": args.chains, "torch": torch.__version__,
              "depth_runs": rows, "stack": stack}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"chain d = N = 32, chains = {args.chains}, device {args.device}, {args.threads} thread(s), "
          f"torch {torch.__version__}")
    print(f"{'depth':>9} {'wall s':>9} {'us/layer':>9} {'peak RSS above baseline MB':>27} {'mean rank_1/2':>14}")
    for r in rows:
        print(f"{r['depth']:>9} {r['wall_s']:>9.2f} {1e6 * r['wall_s'] / r['depth']:>9.1f} "
              f"{r['peak_rss_above_baseline_mb']:>27.1f} {r['mean_soft_rank']:>14.3f}")
    stored = depths[-1] * args.chains * 32 * 32 * 8 / 2**20
    print(f"(storing every layer at depth {depths[-1]} would take {stored:.0f} MB)")
    print(f"\nrank measures of a stack of {stack['layers']} layers ({stack['d']} x {stack['N']}, float64):")
    print(f"{'function':>18} {'batched s':>10} {'loop s':>10} {'speed-up':>9}")
    for name in ("rank_measures", "soft_rank", "rank_lower_bound"):
        s = stack[name]
        print(f"{name:>18} {s['batched_s']:>10.4f} {s['loop_s']:>10.4f} {s['speedup']:>8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
