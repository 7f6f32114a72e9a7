"""``bnlab advise``: the four papers' predictions for a network, before training it (bnlab.advise)."""
from __future__ import annotations

import argparse

from bnlab.cli._common import add_data_dir_argument, apply_data_dir, print_json

EPILOG = """\
model (--model):
  package.module:factory | path/to/file.py:factory   your code: factory() returns the nn.Module
  fc:784-256-10 | conv:1x28x28-c30k3s2-fc10          the architecture grammar of `bnlab fisher`
  mlp, bnmlp, fisher-cnn, bnp-cnn, resnet20 … resnet110, resnet18/34/50, preact-resnet20/56/110, vgg11 … vgg19
data: --dataset NAME (bnlab data list), or --input-shape CxHxW for random inputs (with --classes).
parts: structure, gradients, learning_rate, rank, batch_size (--skip any but structure).
examples:
  bnlab advise --model resnet20 --input-shape 3x32x32 --lr 0.1 --momentum 0.9
  bnlab advise --model mynet.py:build --dataset mnist --batch-size 64 --lr 0.05 --html advice.html
  bnlab advise --model mlp --depth 48 --width 256 --dataset mnist --batch-size 8 --json"""


def _skip_list(text: str) -> list[str]:
    return [s.strip() for s in str(text).split(",") if s.strip()]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "advise",
        help="the four papers' predictions for your network before training it: depth, η*, rank, batch size",
        description="Measures a network at initialization on one batch and says what the four papers predict: "
        "gradient explosion and the trainable depth 16ξ (Yang et al. 2019), the largest stable learning rate "
        "η* (the Fisher paper), rank collapse (Daneshmand et al. 2020), and what the batch size means for BN "
        "and BNP (Lange et al.). The module is never changed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", required=True, help="module:factory, file.py:factory, an architecture, or a name")
    m.add_argument("--depth", type=int, default=None, help="hidden layers of mlp/bnmlp (default 10)")
    m.add_argument("--width", type=int, default=None, help="hidden width of mlp/bnmlp (default 128)")
    m.add_argument("--norm", default=None, help="normalization of bnlab's models and architectures (default bn)")
    m.add_argument("--phi", default=None, help="activation of bnlab's models and architectures (default relu)")
    d = p.add_argument_group("data")
    d.add_argument("--dataset", default=None, help="a dataset name (bnlab data list), standardized")
    d.add_argument("--input-shape", default=None, help="random standard normal inputs of this shape, e.g. 3x32x32")
    d.add_argument("--classes", type=int, default=None,
                   help="classes of the random labels of --input-shape (default 10; a dataset has its own)")
    d.add_argument("--batch-size", "-B", type=int, default=64, help="the batch B the normalizations see (default 64)")
    add_data_dir_argument(d)
    t = p.add_argument_group("training setup")
    t.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy",
                   help="cross_entropy (default) or mse (½‖f − y‖²)")
    t.add_argument("--lr", type=float, default=None, help="your SGD learning rate (placed against η*)")
    t.add_argument("--momentum", type=float, default=0.0, help="your SGD momentum μ (default 0)")
    a = p.add_argument_group("measurement")
    a.add_argument("--skip", action="append", type=_skip_list, default=[],
                   help="parts not to run (repeat or comma-separate): gradients, learning_rate, rank, batch_size")
    a.add_argument("--draws", type=int, default=8, help="weight draws of the gradient part (default 8)")
    a.add_argument("--curvature", choices=("hessian", "ggn", "fisher"), default="hessian",
                   help="the matrix whose λmax sets η* (default hessian)")
    a.add_argument("--tol", type=float, default=1e-2, help="Lanczos relative tolerance (default 1e-2)")
    a.add_argument("--bn-mode", choices=("train", "eval"), default="train",
                   help="BN with the batch's statistics (default, as in training) or the running ones")
    a.add_argument("--bnp-overhead", action=argparse.BooleanOptionalAction, default=None,
                   help="time BNP against SGD on this model (default: when B ≤ 8)")
    a.add_argument("--max-memory-gb", type=float, default=None, help="refuse above this estimated memory (default 8)")
    a.add_argument("--seed", type=int, default=0, help="seed of the model, the batch and the measurements")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="machine-readable output")
    o.add_argument("--html", default=None, metavar="FILE", help="also write the advice as one HTML page")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bnlab._validation import atomic_output_path, check_path
    from bnlab.advice import DEFAULT_MAX_MEMORY_GB, advise, batch_for, load_model
    from bnlab.advice.core import LabelRangeError

    apply_data_dir(args)
    if args.html is not None:
        check_path("--html", args.html)  # before the advice runs (minutes): a page that cannot be written
    max_gb = DEFAULT_MAX_MEMORY_GB if args.max_memory_gb is None else args.max_memory_gb
    if args.classes is not None and args.dataset is not None:
        raise ValueError(f"--classes={args.classes} is not allowed with --dataset={args.dataset!r}: the dataset's "
                         "labels set the classes; --classes is for the random labels of --input-shape")
    data, shape, classes = batch_for(dataset=args.dataset, input_shape=args.input_shape,
                                     num_classes=10 if args.classes is None else args.classes,
                                     batch_size=args.batch_size, seed=args.seed, max_memory_gb=max_gb)
    model = load_model(args.model, input_shape=shape, num_classes=classes, depth=args.depth, width=args.width,
                       norm=args.norm, phi=args.phi, seed=args.seed, max_memory_gb=max_gb)
    skip = [s for group in args.skip for s in group]
    try:
        advice = advise(model, data, loss=args.loss, lr=args.lr, momentum=args.momentum, batch_size=args.batch_size,
                        skip=skip, draws=args.draws, curvature=args.curvature, tol=args.tol, bn_mode=args.bn_mode,
                        measure_bnp=args.bnp_overhead, seed=args.seed,
                        max_memory_gb=max_gb,
                        progress=not args.quiet)
    except LabelRangeError as exc:
        if args.input_shape is None:
            raise
        # the labels are the random ones drawn over --classes: the option to change is --classes, not "targets"
        raise ValueError(f"--classes={10 if args.classes is None else args.classes} is not allowed with this model: "
                         f"it has {exc.outputs} outputs, so "
                         f"the random labels must lie in [0, {exc.outputs}); set --classes {exc.outputs}") from None
    # the advice is printed before the page is written: a page that cannot be written after all (the folder
    # changed during the run) does not lose it
    if args.json:
        print_json(advice.to_dict())
    else:
        print(advice.to_text())
    if args.html is not None:
        try:
            # written beside the path and renamed over it: a link planted at --html is replaced, never followed
            with atomic_output_path(args.html, name="--html") as tmp:
                tmp.write_text(advice.to_html(), encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--html={args.html!r}: the page could not be written ({exc.strerror or exc}); the "
                             "advice is printed above") from None
        if not args.json:
            print(f"HTML: {args.html}")
    return 0
