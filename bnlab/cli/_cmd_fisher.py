"""``bnlab fisher``: the mean-field λ̄max bound and η* of an architecture, and optionally the measured λmax."""
from __future__ import annotations

import argparse

from bnlab.cli._common import NORM_ALIASES, add_choice_argument, add_threads_argument, print_json, print_table

ARCH_HELP = """\
architecture spec (the last layer is the linear output; BN + phi follow every other layer):
  fc:N0-N1-...-NL                      fully connected, N0 inputs, NL outputs
  conv:CxHxW-LAYER-...-fcN             conv net on C x H x W inputs, where LAYER is
      c<C>k<K>[s<S>][p<P>]             conv, C channels, K x K kernel, stride S (1), padding P (0)
      fc<N>                            fully connected on the flattened feature map
examples: fc:784-1000-1000-1000-10   conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10"""


def _real_list(text: str) -> "float | list[float]":
    parts = [p for p in str(text).split(",") if p.strip()]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or comma-separated numbers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return vals[0] if len(vals) == 1 else vals


#: The measurement's options and their defaults: without --measure each must keep its default (a value given
#: there would otherwise be ignored without a word).
_MEASURE_DEFAULTS = {"dataset": "mnist", "data_dir": None, "batch_size": 256, "curvature": "fisher", "tol": 1e-4,
                     "seed": 0, "device": "cpu", "max_memory_gb": 1.0}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fisher",
        help="Fisher-information bound λ̄max and critical learning rate η* (mean field), optionally measured",
        description="The λ̄max lower bound (Claim 3.1) and η* = 2(1+μ)/λ̄max (Eq. 7) of the Fisher paper "
        "for an FC or conv architecture, with or without BN; with --measure also the λmax of a random "
        "network of that architecture on a real batch (matrix-free Lanczos).",
        epilog=ARCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arch", required=True, help="architecture spec (grammar below)")
    add_choice_argument(p, "--norm", valid=("bn", "none"), aliases=NORM_ALIASES, default="bn",
                        help="BatchNorm after hidden layers (default bn)")
    p.add_argument("--phi", default="relu", help="activation (bnlab activations lists them; default relu)")
    p.add_argument("--gamma", type=_real_list, default=1.0, help="BN γ, one value or one per hidden layer (default 1)")
    p.add_argument("--beta", type=_real_list, default=0.0, help="BN β, one value or one per hidden layer (default 0)")
    p.add_argument("--sigma-w2", type=_real_list, default=2.0, help="weight variance σ_w² (default 2)")
    p.add_argument("--sigma-b2", type=_real_list, default=0.5, help="bias variance σ_b² (default 0.5)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum μ in [0, 1) (default 0.9)")
    p.add_argument(
        "--formula",
        choices=("measured", "paper"),
        default="measured",
        help="corrected recursions (default) or the paper's as printed (docs/fisher.md, errata)",
    )
    p.add_argument(
        "--bn-mode",
        choices=("eval", "train"),
        default="eval",
        help="BN with population/running statistics (the paper's model, default) or batch statistics",
    )
    m = p.add_argument_group("measurement")
    m.add_argument("--measure", action="store_true", help="also measure λmax of a random network on real data")
    m.add_argument("--dataset", default=_MEASURE_DEFAULTS["dataset"],
                   help="dataset for --measure (bnlab data list; default mnist)")
    m.add_argument("--data-dir", default=_MEASURE_DEFAULTS["data_dir"], help="dataset directory (see bnlab data)")
    m.add_argument("--batch-size", "-B", type=int, default=_MEASURE_DEFAULTS["batch_size"],
                   help="samples in the fixed batch (default 256)")
    m.add_argument(
        "--curvature",
        choices=("fisher", "ggn", "hessian", "empirical_fisher"),
        default=_MEASURE_DEFAULTS["curvature"],
        help="which matrix to measure (default fisher: Eq. 10); ggn/hessian/empirical_fisher use cross-entropy",
    )
    m.add_argument("--tol", type=float, default=_MEASURE_DEFAULTS["tol"],
                   help="Lanczos relative tolerance, at most 0.5 (default 1e-4)")
    m.add_argument("--seed", type=int, default=_MEASURE_DEFAULTS["seed"],
                   help="seed of the network and of the batch (default 0)")
    m.add_argument("--device", default=_MEASURE_DEFAULTS["device"],
                   help="device of --measure: cpu or cuda (default cpu)")
    m.add_argument("--max-memory-gb", type=float, default=_MEASURE_DEFAULTS["max_memory_gb"],
                   help="memory bound of --measure (network, its copy, Lanczos vectors and the batch's activations, "
                        "estimated before anything is allocated; default 1)")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bnlab.fisher import fisher_order_parameters, parse_arch

    arch = parse_arch(args.arch)
    if not args.measure:
        given = [k for k, default in _MEASURE_DEFAULTS.items() if getattr(args, k) != default]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ValueError(f"{flag}={getattr(args, given[0])!r} is not allowed without --measure: it is an option "
                             "of the measurement (add --measure, or leave it out)")
    kwargs = dict(_network_keywords(args), momentum=args.momentum, formula=args.formula, bn_mode=args.bn_mode)
    out: dict = {}
    if args.measure:
        input_order_parameters, out_measure = _measure(args, arch)
        kwargs.update(input_order_parameters)
    res = fisher_order_parameters(arch, **kwargs)
    out.update(res.to_dict())
    if args.measure:
        out.update(out_measure)
        # a zero bound (odd φ, β = 0: the result's note) has no ratio
        bound = res.lambda_max_bound
        out["ratio_measured_to_bound"] = out["lambda_max_measured"] / bound if bound > 0 else None
    if args.json:
        print_json(out)
        return 0
    _print_text(args, res, out)
    return 0


def _network_keywords(args: argparse.Namespace) -> dict:
    """The network the theory describes and --measure builds: one source, so the two cannot differ."""
    return dict(norm=args.norm, phi=args.phi, gamma=args.gamma, beta=args.beta, sigma_w2=args.sigma_w2,
                sigma_b2=args.sigma_b2)


def _measure(args: argparse.Namespace, arch) -> tuple[dict, dict]:
    """--measure: λmax of a random network of ``arch`` on a standardized batch of the dataset.

    Returns the batch's own input order parameters (``input_q``, ``input_q_xy``: Claim 6.1's base case for
    this batch, handed to the theory) and the measurement's output keys.
    """
    import torch

    from bnlab._validation import check_choice, check_device, check_int, check_max_memory_gb, check_real, check_seed
    from bnlab.fisher import build_model, calibrate_batchnorm_, curvature_spectrum

    from bnlab.data import DATASET_NAMES

    check_choice("--dataset", args.dataset, DATASET_NAMES)
    device = check_device("--device", args.device)
    batch = check_int("--batch-size", args.batch_size, minimum=1)
    seed = check_seed("--seed", args.seed)
    check_real("--tol", args.tol, minimum=0.0, maximum=0.5)
    max_bytes = check_max_memory_gb("max_memory_gb", args.max_memory_gb)
    _check_measure_memory(arch, batch, max_bytes)
    if args.norm == "bn" and args.bn_mode == "train" and batch < 2:
        raise ValueError(
            f"--batch-size={batch} with --bn-mode train is not allowed: BatchNorm's batch variance is "
            "undefined for one sample (use >= 2 or --bn-mode eval)"
        )
    x, y = _standardized_batch(args, arch, batch, seed)
    flat = x.reshape(x.shape[0], -1)
    # the data's own input order parameters (Claim 6.1's base case for this batch)
    input_order_parameters = {"input_q": float((flat**2).sum(1).mean() / flat.shape[1]),
                              "input_q_xy": float((flat.mean(0) ** 2).sum() / flat.shape[1])}
    model = build_model(arch, **_network_keywords(args), seed=seed, dtype=torch.float64, max_memory_bytes=max_bytes)
    model, x = model.to(device), x.to(device)
    calibrate_batchnorm_(model, x)  # eval mode = the batch's own statistics (the theory's population)
    loss = "mse" if args.curvature == "fisher" else "cross_entropy"
    spec = curvature_spectrum(
        model, x, y, curvature=args.curvature, loss=loss, bn_mode=args.bn_mode, tol=args.tol,
        max_memory_bytes=max_bytes,
    )
    return input_order_parameters, {
        "lambda_max_measured": spec.lambda_max,
        "bn_mode": args.bn_mode,
        "curvature": args.curvature,
        "device": str(device),
        "dataset": args.dataset,
        "batch_size": spec.batch_size,
        "num_params": spec.num_params,
        "matvecs": spec.matvecs,
        "tol": spec.tol,
        "seconds": spec.seconds,
    }


def _standardized_batch(args: argparse.Namespace, arch, batch: int, seed: int):
    """``batch`` samples of the dataset's training split drawn with ``seed`` (float64, flattened for an FC
    ``arch``), refused if ``arch``'s input does not match the data or the split is smaller than ``batch``."""
    import torch

    from bnlab.data import load_dataset, standardize

    data = load_dataset(args.dataset, "train", data_dir=args.data_dir)
    n_in = 1
    for d in data.image_shape:
        n_in *= d
    if len(arch.input_shape) == 1 and arch.input_shape[0] != n_in:
        raise ValueError(
            f"--arch={args.arch!r} is not allowed with --dataset {args.dataset}: the input dimension "
            f"{arch.input_shape[0]} differs from the data's {n_in} = {'x'.join(map(str, data.image_shape))}"
        )
    if len(arch.input_shape) == 3 and tuple(arch.input_shape) != tuple(data.image_shape):
        raise ValueError(
            f"--arch={args.arch!r} is not allowed with --dataset {args.dataset}: input shape "
            f"{arch.input_shape} differs from the data's {data.image_shape}"
        )
    if batch > len(data):
        raise ValueError(
            f"--batch-size={batch} is not allowed with --dataset {args.dataset}: its training split has "
            f"{len(data)} samples"
        )
    # the batch is standardized with its own per-channel statistics (cheap; the theory's input
    # order parameters are taken from this same batch)
    sub = standardize(data.subset(batch, seed=seed))
    x = sub.x.to(torch.float64)
    if len(arch.input_shape) == 1:
        x = x.reshape(x.shape[0], -1)
    return x, sub.y


def _print_text(args: argparse.Namespace, res, out: dict) -> None:
    """The human-readable report: the per-layer order parameters, the bound, η* and the measurement."""
    print(f"arch {res.arch}  norm={res.norm}  phi={res.phi}  formula={res.formula}  bn_mode={res.bn_mode}")
    rows = [
        (d["layer"], d["kind"], d["fan_in"], d["positions"], d["q"], d["q_hat_xy"], d["q_tilde_xy"], d["f"])
        for d in res.layers
    ]
    print_table(rows, header=["layer", "kind", "fan_in", "|K|", "q", "q̂_xy(in)", "q̃_xy", "f_l"])
    print(f"lambda_max_bound = {res.lambda_max_bound:.6g}")
    print(f"eta_star = 2(1+{res.momentum:g})/lambda_max_bound = {res.eta_star:.6g}")
    if res.note:
        print(f"note: {res.note}")
    if args.measure:
        ratio = out["ratio_measured_to_bound"]
        print(
            f"lambda_max_measured = {out['lambda_max_measured']:.6g} ({args.curvature}, bn_mode={args.bn_mode}, "
            f"{args.dataset} batch of {out['batch_size']}, {out['matvecs']} products, {out['seconds']:.2f} s); "
            f"measured/bound = {'-' if ratio is None else format(ratio, '.3f')}"
        )


def _check_measure_memory(arch, batch: int, max_bytes: int) -> None:
    """--measure in float64: the network twice (it and the measured copy), ~6 working vectors and the
    batch's activations kept for the forward- and reverse-mode products (~4 copies of every unit)."""
    from bnlab._validation import check_memory

    geos = arch.geometry()
    params = sum(g["fan_in"] * g["out_units"] / max(g["positions"], 1) + g["out_units"] for g in geos)
    units = sum(g["out_units"] for g in geos) + geos[0]["in_units"]
    need = 8.0 * (8 * params + 4 * batch * units)
    check_memory(f"--measure on --arch {arch.to_spec()} with --batch-size {batch}", need, max_bytes,
                 hint="use a smaller --arch or --batch-size, or raise --max-memory-gb")
