"""Argument groups and output helpers shared by the CLI commands."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["add_phi_arguments", "activation_from_args", "print_json", "print_table", "to_jsonable"]


def add_phi_arguments(parser: argparse.ArgumentParser) -> None:
    """--phi, its family parameters, and the pre-activation scale/shift γ, β."""
    g = parser.add_argument_group("nonlinearity")
    g.add_argument(
        "--phi",
        default="relu",
        help="a registered activation (bnlab activations lists them) or an expression in x, e.g. 'tanh(2*x)+0.1*x'",
    )
    g.add_argument("--alpha", type=float, default=None, help="parameter alpha of alpha_relu (relu^alpha) or elu")
    g.add_argument("--slope", type=float, default=None, help="negative slope of leaky_relu")
    g.add_argument("--gamma", type=float, default=1.0, help="pre-activation scale: phi(gamma*x + beta)")
    g.add_argument("--beta", type=float, default=0.0, help="pre-activation shift: phi(gamma*x + beta)")


def activation_from_args(args: argparse.Namespace):
    from bnlab.activations import get_activation

    params = {}
    if args.alpha is not None:
        params["alpha"] = args.alpha
    if args.slope is not None:
        params["slope"] = args.slope
    return get_activation(args.phi, gamma=args.gamma, beta=args.beta, **params)


def to_jsonable(obj: Any) -> Any:
    """Convert NumPy scalars/arrays, dataclasses and non-finite floats for JSON output."""
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def print_json(obj: Any, file=None) -> None:
    json.dump(to_jsonable(obj), file or sys.stdout, indent=2, allow_nan=False)
    (file or sys.stdout).write("\n")


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.10g}"
    if v is None:
        return "-"
    return str(v)


def print_table(rows: Iterable[Sequence[Any]], header: Sequence[str] | None = None, file=None) -> None:
    """Print rows as an aligned plain-text table."""
    rows = [[_fmt(c) for c in r] for r in rows]
    if header is not None:
        rows.insert(0, list(header))
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(len(r) for r in rows))]
    out = file or sys.stdout
    for k, r in enumerate(rows):
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
        if k == 0 and header is not None:
            out.write("  ".join("-" * w for w in widths) + "\n")
