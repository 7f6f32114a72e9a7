"""``bnlab theory``: what the mean field theory of batchnorm says about (φ, B, ε) (Yang et al. 2019)."""
from __future__ import annotations

import argparse
import math

from bnlab.cli._common import add_phi_arguments, phi_keywords, print_json, print_table

_ROWS = (
    ("fixed_point_kind", "attracting fixed point (BSB1 or BSB2)"),
    ("q_star", "q*: BSB1 fixed point diagonal"),
    ("c_star", "c*: BSB1 fixed point correlation"),
    ("forward_lambda_G", "forward λ_G↑ (RG)"),
    ("forward_lambda_L", "forward λ_L↑ (L)"),
    ("forward_lambda_M", "forward λ_M↑ (M)"),
    ("grad_explosion_rate", "gradient explosion rate λ_G↓"),
    ("backward_lambda_L", "backward λ_L↓"),
    ("backward_lambda_M", "backward λ_M↓"),
    ("cross_batch_c_star", "cross-batch fixed point c_CB*"),
    ("cross_batch_rate", "cross-batch rate λ_M̃↑ = λ_M̃↓"),
    ("depth_scale", "depth scale ξ = 1/log λ_G↓"),
    ("max_trainable_depth", "max trainable depth 16ξ"),
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from bnlab.theory.analyze import METHODS

    p = sub.add_parser(
        "theory",
        help="fixed point, forward/backward/cross-batch eigenvalues, gradient explosion rate and depth scale",
        description="Everything the mean field theory of batchnorm (Yang et al. 2019) says about (phi, B, eps).",
    )
    add_phi_arguments(p)
    p.add_argument("--batch-size", "-B", type=int, required=True, help="batch size B (>= 3; B = 2 is degenerate)")
    p.add_argument("--eps", type=float, default=0.0, help="batchnorm epsilon (>= 0)")
    p.add_argument("--sigma-w2", type=float, default=1.0, help="weight variance (matters only for eps > 0)")
    p.add_argument("--method", choices=METHODS, default="auto", help="route for every quantity (default: auto)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bnlab.theory.analyze import analyze

    # φ goes in unresolved: analyze resolves it once (bnlab.activations.get_activation)
    res = analyze(args.phi, args.batch_size, eps=args.eps, sigma_w2=args.sigma_w2, method=args.method,
                  **phi_keywords(args))
    if args.json:
        print_json(res.to_dict())
        return 0
    print(f"phi = {res.phi}   B = {res.batch_size}   eps = {res.eps:g}   sigma_w2 = {res.sigma_w2:g}   method = {res.method}")
    rows = []
    d = res.to_dict()
    for key, label in _ROWS:
        v = d[key]
        if isinstance(v, float) and math.isinf(v):
            v = "inf"
        rows.append((label, v, key))
    print_table(rows, header=["quantity", "value", "key"])
    if res.methods_used:
        print("\nmethods used: " + ", ".join(f"{k}={v}" for k, v in res.methods_used.items()))
    for w in res.warnings:
        print(f"warning: {w}")
    return 0
