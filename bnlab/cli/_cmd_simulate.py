"""``bnlab simulate``: an ensemble of random finite-width networks beside the mean field theory.

Parses and validates the arguments, calls :func:`bnlab.sim.simulate` and
:func:`bnlab.compare.compare_with_theory`, and prints the comparison.  The defaults are
those of :func:`bnlab.sim.simulate` except ``--num-batches`` (4, not 1): the command
reports the cross-batch rate, which needs two batches or more; and the command draws a progress bar on
stderr (``--no-progress``: none), which the library draws only when asked (``progress=True``).
"""
from __future__ import annotations

import argparse

from bnlab.cli._common import (INIT_ALIASES, NORM_ALIASES, activation_from_args, add_choice_argument,
                               add_deprecated_flag, add_phi_arguments, add_threads_argument, print_json, print_table)

#: The one default that differs from bnlab.sim.simulate (see the module docstring).
CLI_NUM_BATCHES = 4
#: bnlab.sim.NORMALIZATIONS and bnlab.sim.INITS, spelled here so that parsing imports no torch
#: (tests/cli/test_vocabulary.py checks they agree).
SIM_NORMS = ("bn", "bn_nomean", "none")
SIM_INITS = ("gaussian", "orthogonal", "uniform", "asymmetric_uniform")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate random BN networks and compare with the mean field theory",
        description="Simulate an ensemble of random batch-normalized networks (Yang et al. 2019, Eq. 7) "
        "and print the measured gradient explosion rate, cross-batch decay rate and BSB1 fixed point "
        "beside the theory engine's predictions (bnlab.compare.compare_with_theory).  Defaults are those "
        "of bnlab.sim.simulate, except --num-batches.",
    )
    add_phi_arguments(p)
    p.add_argument("--batch-size", "-B", type=int, default=32, help="samples per batch B (>= 2; default 32)")
    p.add_argument("--width", type=int, default=1000, help="neurons per layer N (default 1000)")
    p.add_argument("--depth", type=int, default=50, help="layers L (default 50)")
    p.add_argument("--networks", type=int, default=200,
                   help="independent random networks in the ensemble (default 200)")
    p.add_argument("--eps", type=float, default=0.0, help="batchnorm epsilon (>= 0)")
    p.add_argument("--sigma-w2", type=float, default=1.0, help="weight variance σ_w² (entries N(0, σ_w²/N))")
    p.add_argument("--sigma-b2", type=float, default=0.0, help="bias variance σ_b²")
    add_choice_argument(p, "--init", valid=SIM_INITS, aliases=INIT_ALIASES, default="gaussian",
                        help="weight initialization (bnlab.sim.init)")
    norm = add_choice_argument(p, "--norm", valid=SIM_NORMS, aliases=NORM_ALIASES, default="bn",
                               help="bn (batchnorm, Eq. 7), bn_nomean (no mean subtraction) or none")
    add_deprecated_flag(p, "--normalization", norm)
    p.add_argument("--residual-scale", type=float, default=None,
                   help="residual branch scale r: h^l = h^{l-1} + r·(...) (default: no residual connection)")
    p.add_argument("--num-batches", type=int, default=CLI_NUM_BATCHES,
                   help=f"batches per network (default {CLI_NUM_BATCHES}, where bnlab.sim.simulate has 1: the "
                   "cross-batch rate this command reports needs >= 2)")
    p.add_argument("--input-correlation", type=float, default=0.1,
                   help="correlation of the random input batches (default 0.1: the cross-batch rate is that of "
                   "the linearized dynamics, fitted where the correlation is <= 0.5)")
    p.add_argument("--weight-sampling", default="auto",
                   help="auto, explicit or conditional: Gaussian layers sampled from their conditional law "
                   "(exact in law, no N x N weights; auto uses it for gaussian init where k*B <= width/4)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float64",
                   help="float32 or float64 (default float64: 1.2x the time of float32, rounding far below "
                   "the Monte Carlo error)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    p.add_argument("--max-memory-gb", type=float, default=1.0, help="working-memory bound in GiB (default 1): networks run in chunks below it, and sizes "
                   "that cannot fit (one network, or all networks' results) are refused before allocating")
    add_threads_argument(p)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (by default one on stderr, also with --json: stdout stays the JSON)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _json_keys(comp) -> dict:
    """The comparison under the command's JSON keys (kept from before bnlab.compare existed)."""
    q = comp.quantities
    g, x = q["grad_explosion_rate"], q["cross_batch_rate"]
    qs, cs = q["q_star"], q["c_star"]
    per = comp.per_layer
    out = {
        "config": comp.config,
        "grad_explosion_rate": g.simulated,
        "grad_explosion_rate_ci": list(g.ci),
        "grad_explosion_fit_layers": None if g.layers is None else list(g.layers),
        "grad_explosion_rate_estimator": g.estimator,
        "grad_explosion_rate_ci_method": g.ci_method,
        # null: every moment is finite (EnsembleResult.grad_norm_tail_index is inf)
        "grad_norm_tail_index": comp.to_dict()["grad_norm_tail_index"],
        "theory_grad_explosion_rate": g.theory,
        "grad_explosion_rate_rel_diff": g.rel_diff,
        "cross_batch_rate": x.simulated,
        "cross_batch_rate_ci": list(x.ci),
        "cross_batch_fit_layers": None if x.layers is None else list(x.layers),
        "theory_cross_batch_rate": x.theory,
        "cross_batch_rate_rel_diff": x.rel_diff,
        "q": qs.simulated,
        "c": cs.simulated,
        "theory_q_star": qs.theory,
        "theory_c_star": cs.theory,
        "q_rel_diff": qs.rel_diff,
        "c_rel_diff": cs.rel_diff,
        "per_layer_grad_norm_sq": per["grad_norm_sq"],
        "per_layer_weight_grad_norm_sq": per["weight_grad_norm_sq"],
        "per_layer_cross_batch_corr": per["cross_batch_corr"],
        "per_layer_q": per["q"],
        "per_layer_c": per["c"],
        "theory_source": comp.theory_source,
        "notes": list(comp.notes),
        "comparison": comp.to_dict()["quantities"],
    }
    if per["bsb1_distance"] is not None:
        out["per_layer_bsb1_distance"] = per["bsb1_distance"]
    return out


def run(args: argparse.Namespace) -> int:
    from bnlab._validation import check_real
    from bnlab.compare import compare_with_theory
    from bnlab.sim import simulate

    act = activation_from_args(args)
    mem = check_real("max_memory_gb", args.max_memory_gb, minimum=0.0, strict_minimum=True, maximum=2.0**20)
    res = simulate(
        act, args.batch_size, args.width, args.depth, args.networks,
        norm=args.norm, init=args.init, eps=args.eps, sigma_w2=args.sigma_w2,
        sigma_b2=args.sigma_b2, residual_scale=args.residual_scale, num_batches=args.num_batches,
        input_correlation=args.input_correlation, seed=args.seed, device=args.device, dtype=args.dtype,
        max_memory_bytes=max(1, int(mem * 2**30)), weight_sampling=args.weight_sampling,
        progress=not args.no_progress,
    )
    comp = compare_with_theory(res, phi=act)
    if args.json:
        print_json(_json_keys(comp))
        return 0
    print(f"{res.networks} networks, width {args.width}, depth {args.depth}, B = {args.batch_size}, "
          f"phi = {act.spec}, eps = {args.eps}, {res.config['dtype']} on {res.config['device']}")
    labels = {
        "grad_explosion_rate": "gradient explosion rate λ_G",
        "cross_batch_rate": "cross-batch decay rate λ_M̃",
        "q_star": "BSB1 q (last 20% of layers)",
        "c_star": "BSB1 c (last 20% of layers)",
    }
    rows = [(label, c.simulated, "" if c.ci[0] is None else f"[{c.ci[0]:.6g}, {c.ci[1]:.6g}]", c.theory, c.rel_diff)
            for name, label in labels.items() for c in [comp[name]]]
    print_table(rows, header=["quantity", "simulated", "95% CI", "theory", "rel. diff"])
    for note in comp.notes:
        print("note:", note)
    return 0
