"""``bnlab activations``: list the registered nonlinearities."""
from __future__ import annotations

import argparse

from bnlab.cli._common import print_json, print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("activations", help="list the registered nonlinearities and the expression syntax")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bnlab.activations import EXPRESSION_FUNCTIONS, list_activations

    acts = list_activations()
    if args.json:
        print_json({"activations": acts, "expression_functions": list(EXPRESSION_FUNCTIONS)})
    else:
        print_table(sorted(acts.items()), header=["name", "description"])
        print("\nExpressions in x may use + - * / ** and: " + ", ".join(EXPRESSION_FUNCTIONS))
    return 0
