"""``bnlab rank``: the rank of the paper's random chains (Daneshmand et al. 2020, Eqs. 1–6)."""
from __future__ import annotations

import argparse
import sys

from bnlab.cli._common import (NORM_ALIASES, add_choice_argument, add_deprecated_flag, add_threads_argument, print_json,
                               print_table)

#: bnlab.rank.CHAIN_NORMS, CHAIN_ACTIVATIONS and CHAIN_INITS, spelled here so that parsing imports no torch
#: (tests/cli/test_vocabulary.py checks they agree).
RANK_NORMS = ("bn_nomean", "bn", "none")
RANK_PHIS = ("linear", "relu")
RANK_INITS = ("gaussian", "uniform")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rank",
        help="rank of the hidden representations of a deep random chain (BN vs vanilla)",
        description="Run independent random chains H_{l+1} = Norm(H_l + gamma W_l H_l) (Daneshmand et al. "
        "2020, Eqs. 1, 2, 6; gamma = inf: no skip) layer by layer and report the soft rank rank_tau (Eq. 3), "
        "the lower bound r(H) (Eq. 4) and the numerical rank: averages over all layers and per-layer "
        "values (log-spaced layers beyond depth 200). Memory does not grow with depth.",
    )
    p.add_argument("--depth", type=int, default=1000, help="L, the number of layers")
    p.add_argument("--width", type=int, default=32, help="d, the number of features")
    p.add_argument("--batch-size", "-B", type=int, default=32, help="N, the number of samples")
    phi = add_choice_argument(p, "--phi", valid=RANK_PHIS, default="linear", help="the nonlinearity φ")
    add_deprecated_flag(p, "--activation", phi)
    add_choice_argument(p, "--norm", valid=RANK_NORMS, aliases=NORM_ALIASES, default="bn_nomean",
                        help="bn_nomean (the paper's BN, Eq. 2), bn (with mean subtraction) or none (vanilla)")
    p.add_argument("--placement", default="pre",
                   help="pre: phi(Norm(H + gamma W H)) (Linear -> BN -> phi), or post: Norm(H + gamma phi(W H))")
    p.add_argument("--residual-gamma", default="inf", help="skip-branch strength gamma > 0, or inf (no skip)")
    add_choice_argument(p, "--init", valid=RANK_INITS, default="gaussian",
                        help="gaussian (N(0,1)) or uniform (U[-sqrt 3, sqrt 3])")
    p.add_argument("--tau", type=float, default=0.5, help="soft-rank threshold (Eq. 3)")
    p.add_argument("--chains", type=int, default=1, help="independent chains run together")
    p.add_argument("--record-points", type=int, default=200,
                   help="per-layer values kept: every layer up to this depth, ~this many log-spaced beyond")
    p.add_argument("--eps", type=float, default=0.0, help="BN epsilon (the paper: 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and weights")
    p.add_argument("--dtype", default="float64", help="float32 or float64")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--max-memory-gb", type=float, default=1.0,
                   help="working-memory bound (layers are streamed in blocks that fit; default 1)")
    p.add_argument("--max-hours", type=float, default=24.0,
                   help="refuse, before starting, a chain estimated to take longer (default 24)")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bnlab._validation import check_int, check_max_memory_gb, check_real, check_seed
    from bnlab.rank import default_record_layers, run_chain

    points = check_int("record_points", args.record_points, minimum=1, maximum=10**6)
    depth = check_int("depth", args.depth, minimum=1)
    max_bytes = check_max_memory_gb("max_memory_gb", args.max_memory_gb)
    check_seed("seed", args.seed)
    gamma = args.residual_gamma
    if isinstance(gamma, str) and gamma.strip().lower() not in ("inf", "infinity"):
        try:
            gamma = float(gamma)
        except ValueError:
            raise ValueError(f"residual_gamma={args.residual_gamma!r} is not allowed: expected a number > 0 or 'inf'")
    try:
        res = run_chain(
            args.width, args.batch_size, depth, chains=args.chains, norm=args.norm, phi=args.phi,
            placement=args.placement, residual_gamma=gamma, init=args.init, tau=args.tau,
            record_layers=default_record_layers(depth, points), seed=args.seed, dtype=args.dtype,
            device=args.device, eps=args.eps, max_memory_bytes=max_bytes,
            max_seconds=check_real("max_hours", args.max_hours, minimum=0.0, strict_minimum=True) * 3600.0,
        )
    except FloatingPointError as exc:
        # not bad input but a chain that cannot go on (a zero row, an overflow): the message names the option
        print(f"bnlab rank: error: {exc}", file=sys.stderr)
        return 1
    out = res.to_dict()
    if args.json:
        print_json(out)
        return 0
    c = res.config
    print(f"chain: d={c['width']} N={c['batch_size']} depth={c['depth']} chains={c['chains']} norm={c['norm']} "
          f"phi={c['phi']} ({c['placement']}) gamma={c['residual_gamma']} init={c['init']}")
    print_table([
        [f"mean rank_tau over layers 1..L (tau={c['tau']})", out["mean_soft_rank"]],
        ["mean r(H) lower bound", out["mean_r_lower_bound"]],
        ["mean numerical rank", out["mean_numerical_rank"]],
        ["final rank_tau", out["final_soft_rank"]],
        ["final r(H)", out["final_r_lower_bound"]],
        ["final numerical rank", out["final_numerical_rank"]],
    ], header=["quantity", "value (mean over chains)"])
    layers = out["layers"]
    step = max(1, len(layers) // 15)
    shown = sorted(set(range(0, len(layers), step)) | {len(layers) - 1})
    print()
    print_table([[layers[i], out["per_layer_soft_rank"][i], out["per_layer_r_lower_bound"][i],
                  out["per_layer_numerical_rank"][i]] for i in shown],
                header=["layer", "rank_tau", "r(H)", "numerical rank"])
    return 0
