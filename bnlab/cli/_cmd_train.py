"""``bnlab train``: train Lange et al.'s FC network or 5-layer CNN with BNP or a normalization layer."""
from __future__ import annotations

import argparse

from bnlab._task_checkpoint import DEFAULT_EVERY
from bnlab.cli._common import (NORM_ALIASES, add_choice_argument, add_data_dir_argument, add_threads_argument, print_json,
                               print_table)

#: The networks and normalizations bnlab.optim.train_network trains (spelled here: parsing imports no torch).
TRAIN_MODELS = ("fc", "cnn")
TRAIN_NORMS = ("bnp", "bnp_gn", "none", "bn", "brn", "ln", "gn")


#: BNP's options and their defaults (bnlab.optim.training.train_network's).
_BNP_DEFAULTS = {"rho": 0.99, "eps1": 1e-2, "eps2": 1e-4}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a network with BNP (batch normalization preconditioning) or a normalization layer",
        description="Train the fully connected network (3 hidden layers of 100, post-activation normalization) "
        "or the 5-layer CNN of Lange et al. with SGD and print the training loss and test accuracy per epoch. "
        "--norm bnp is the vanilla network with the BN preconditioner (bnlab.optim.BNPreconditioner); "
        "bnp_gn is BNP on the GroupNorm network.",
    )
    add_choice_argument(p, "--model", valid=TRAIN_MODELS, default="fc",
                        help="fc (3 hidden layers of --widths) or cnn (the 5-layer CNN)")
    add_choice_argument(p, "--norm", valid=TRAIN_NORMS, aliases=NORM_ALIASES, default="bnp",
                        help="bnp/bnp_gn (the BN preconditioner on the vanilla/GroupNorm network), none, bn, brn, "
                        "ln or gn")
    p.add_argument("--dataset", default="mnist", help="mnist, fashion_mnist, digits, cifar10 or cifar100")
    p.add_argument("--batch-size", "-B", type=int, default=60, help="SGD mini-batch size B")
    p.add_argument("--epochs", type=float, default=1.0, help="may be fractional, e.g. 0.05")
    p.add_argument("--lr", type=float, default=None,
                   help="SGD learning rate (default: the paper's Table 2/3 value for model, norm, batch size)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum μ")
    p.add_argument("--widths", type=int, nargs="+", default=[100, 100, 100], help="FC hidden widths")
    p.add_argument("--train-size", type=int, default=None, help="train on this many examples (seeded draw)")
    p.add_argument("--test-size", type=int, default=None, help="test on this many examples (seeded draw)")
    p.add_argument("--rho", type=float, default=_BNP_DEFAULTS["rho"],
                   help="BNP running-average factor (only with --norm bnp or bnp_gn)")
    p.add_argument("--eps1", type=float, default=_BNP_DEFAULTS["eps1"], help="BNP epsilon_1 (only with BNP)")
    p.add_argument("--eps2", type=float, default=_BNP_DEFAULTS["eps2"], help="BNP epsilon_2 (only with BNP)")
    p.add_argument("--native", action="store_true",
                   help="BNP: compiled CPU kernels for the dense layers (a C++ compiler; built once, ~20 s; "
                        "same gradients to rounding, faster steps at small batches); only with --norm bnp or "
                        "bnp_gn (an error otherwise)")
    p.add_argument("--seed", type=int, default=0, help="seed of the network, the data draw and the batches")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_data_dir_argument(p)
    p.add_argument("--max-memory-gb", type=float, default=1.0,
                   help="bound on the network's parameters, checked before it is built (default 1)")
    p.add_argument("--checkpoint", default=None, metavar="FILE",
                   help="keep the run's state in FILE (every --checkpoint-every seconds): the same command run "
                        "again goes on from the last save instead of the first step; removed once the run ends")
    p.add_argument("--checkpoint-every", type=float, default=DEFAULT_EVERY, metavar="SECONDS",
                   help=f"seconds between two saves of --checkpoint (default {DEFAULT_EVERY:g}; only with "
                        "--checkpoint)")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bnlab._validation import check_max_memory_gb
    from bnlab.optim.training import train_network

    # options that would be ignored without a word (as --native is refused without BNP)
    if args.norm not in ("bnp", "bnp_gn"):
        for name, default in _BNP_DEFAULTS.items():
            if getattr(args, name) != default:
                raise ValueError(f"--{name}={getattr(args, name)!r} is not allowed with --norm {args.norm}: it is an "
                                 "option of BNP (--norm bnp or bnp_gn); leave it out")
    if args.checkpoint is None and args.checkpoint_every != DEFAULT_EVERY:
        raise ValueError(f"--checkpoint-every={args.checkpoint_every!r} is not allowed without --checkpoint FILE: "
                         "there is nothing to save")
    max_bytes = check_max_memory_gb("max_memory_gb", args.max_memory_gb)
    res = train_network(
        model=args.model, norm=args.norm, dataset=args.dataset, batch_size=args.batch_size, epochs=args.epochs,
        lr=args.lr, momentum=args.momentum, widths=args.widths, train_size=args.train_size,
        test_size=args.test_size, rho=args.rho, eps1=args.eps1, eps2=args.eps2, native=args.native, seed=args.seed,
        device=args.device, data_dir=args.data_dir, max_memory_bytes=max_bytes, checkpoint=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
    )
    if args.json:
        print_json(res.to_dict())
        return 0
    print(f"{res.model} network, norm={res.norm}, {res.dataset} ({res.train_size} train / {res.test_size} test), "
          f"batch {res.batch_size}, SGD lr {res.learning_rate:g}, {res.steps} steps in {res.seconds:.1f} s"
          + ("  [DIVERGED]" if res.diverged else ""))
    rows = [[f"{r['epoch']:g}", f"{r['train_loss']:.4f}",
             "-" if r["test_accuracy"] is None else f"{r['test_accuracy']:.4f}"] for r in res.epochs]
    print_table(rows, header=["epoch", "train loss", "test accuracy"])
    return 0
