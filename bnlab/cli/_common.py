"""Argument groups and output helpers shared by the CLI commands."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = [
    "add_phi_arguments",
    "activation_from_args",
    "phi_keywords",
    "print_json",
    "print_table",
    "to_jsonable",
    "add_data_dir_argument",
    "apply_data_dir",
    "check_output_dir",
    "check_cluster_arguments",
    "yes_no",
    "add_threads_argument",
    "apply_threads",
    "add_checkpoint_arguments",
    "checkpoint_every",
    "BnlabParser",
    "add_choice_argument",
    "add_deprecated_flag",
    "NORM_ALIASES",
    "INIT_ALIASES",
]

from bnlab._vocabulary import INIT_ALIASES, NORM_ALIASES, deprecation_text


class _ShowsDefaults:
    """Every option's help ends with its default, unless the text already says it (the commands'
    own "default ..." phrases explain defaults that are chosen, not fixed)."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return (bool(action.option_strings) and action.nargs != 0 and action.help is not argparse.SUPPRESS
                and action.default not in (None, False, argparse.SUPPRESS)
                and "default" not in (action.help or "").lower())

    def _get_help_string(self, action):
        text = (action.help or "").strip()
        if self._shows_default(action):
            text = f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return text

    def _format_action(self, action):
        if not (action.help or "").strip() and self._shows_default(action):
            import copy

            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _expand_help(self, action):
        if isinstance(action.default, (list, tuple)):  # --widths 100 100 100, as typed
            import copy

            action = copy.copy(action)
            action.default = " ".join(map(str, action.default))
        return super()._expand_help(action)


class _DefaultsHelpFormatter(_ShowsDefaults, argparse.HelpFormatter):
    pass


class _RawDefaultsHelpFormatter(_ShowsDefaults, argparse.RawDescriptionHelpFormatter):
    pass


class BnlabParser(argparse.ArgumentParser):
    """The parser of ``bnlab`` and of every subcommand: help shows each option's default (a command's
    ``RawDescriptionHelpFormatter`` keeps its layout), and the subcommand's own usage goes with its errors
    (``bnlab.cli.main``)."""

    def __init__(self, *args, **kwargs):
        raw = issubclass(kwargs.get("formatter_class", argparse.HelpFormatter), argparse.RawDescriptionHelpFormatter)
        kwargs["formatter_class"] = _RawDefaultsHelpFormatter if raw else _DefaultsHelpFormatter
        super().__init__(*args, **kwargs)


def _note(parser: argparse.ArgumentParser, text: str) -> None:
    """A one-line note on stderr naming the command (a deprecated spelling was used)."""
    print(f"{parser.prog}: note: {text}", file=sys.stderr)


class _CanonicalChoice(argparse.Action):
    """A value among ``valid``; an old spelling in ``aliases`` is replaced by its canonical name with a note."""

    def __init__(self, option_strings, dest, valid=(), aliases=None, **kwargs):
        self.valid, self.aliases = tuple(valid), dict(aliases or {})
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        if value in self.aliases:
            new = self.aliases[value]
            _note(parser, deprecation_text(f"{option_string} {value}", f"{option_string} {new}"))
            value = new
        if value not in self.valid:
            parser.error(f"argument {'/'.join(self.option_strings)}: invalid choice: {value!r} "
                         f"(choose from {', '.join(self.valid)})")
        setattr(namespace, self.dest, value)


def add_choice_argument(parser, *flags: str, valid, aliases=None, **kwargs) -> argparse.Action:
    """An option whose value is one of ``valid`` (shown in the usage), old spellings ``aliases`` accepted
    with a note (the canonical names: bnlab._vocabulary, docs/cli.md "Vocabulary")."""
    kwargs.setdefault("metavar", "{" + ",".join(valid) + "}")
    return parser.add_argument(*flags, action=_CanonicalChoice, valid=valid, aliases=aliases, **kwargs)


class _DeprecatedFlag(argparse.Action):
    """An old flag: a note naming the new one, then the new flag's action (``target``) does the work."""

    def __init__(self, option_strings, dest, target=None, **kwargs):
        self.target = target
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        _note(parser, deprecation_text(option_string, self.target.option_strings[0]))
        self.target(parser, namespace, value, self.target.option_strings[0])


def add_deprecated_flag(parser, old: str, target: argparse.Action) -> None:
    """Accept ``old`` (hidden from help) as the option ``target`` for one release, with a note on stderr."""
    parser.add_argument(old, dest=target.dest, action=_DeprecatedFlag, target=target, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS, metavar=target.metavar, type=target.type, nargs=target.nargs)


def add_data_dir_argument(parser: argparse.ArgumentParser) -> None:
    """--data-dir, as ``bnlab data`` has it: where the datasets are (default $BNLAB_DATA, else ~/.cache/bnlab)."""
    parser.add_argument("--data-dir", default=None,
                        help="data directory of the datasets (default: $BNLAB_DATA, else ~/.cache/bnlab)")


def apply_data_dir(args: argparse.Namespace) -> None:
    """Make ``--data-dir`` the data directory of this process and of the workers it starts ($BNLAB_DATA)."""
    import os

    if getattr(args, "data_dir", None) is None:
        return
    from bnlab.data import data_dir

    os.environ["BNLAB_DATA"] = str(data_dir(args.data_dir).absolute())


def check_output_dir(name: str, value: Any) -> None:
    """An output folder: non-empty, not an existing file or device, inside a writable folder (ValueError)."""
    from bnlab._validation import check_path

    check_path(name, value, kind="directory")


def check_cluster_arguments(args: argparse.Namespace) -> None:
    """--workers and --scheduler checked up front, even when every cell is cached and no cluster starts."""
    from bnlab.experiments.sweep import check_scheduler_address
    from bnlab._validation import check_int

    if getattr(args, "workers", None) is not None:
        check_int("workers", args.workers, minimum=1, maximum=4096)
    if getattr(args, "scheduler", None) is not None:
        check_scheduler_address(args.scheduler)
        if getattr(args, "workers", None) is not None:
            raise ValueError("workers applies to a local cluster only; an existing cluster (--scheduler) has its own")
    if getattr(args, "serial", False) and getattr(args, "scheduler", None) is not None:
        raise ValueError("--serial runs in this process; do not also give --scheduler")
    if getattr(args, "serial", False) and getattr(args, "workers", None) is not None:
        raise ValueError(f"--workers={args.workers} is not allowed with --serial, which runs every cell in this "
                         "process; give one of them")


def add_threads_argument(parser, *, cells: bool = False) -> None:
    """--threads: the intra-op thread count of a long-running command (``cells``: of the processes
    that run a sweep's cells).  Default: chosen by the work (bnlab._threads; docs/experiments.md)."""
    if cells:
        text = ("intra-op threads (torch, OpenMP, BLAS) of every process that runs cells: each worker of the "
                "local cluster, the workers of --scheduler, or this process with --serial (default: a local "
                "worker gets its share of the cores, cores // workers, and small work runs on one thread)")
    else:
        text = ("intra-op threads of torch, OpenMP and BLAS (default: chosen by the size of the work: one "
                "thread for small operators such as batch-1 training or the rank chain at d = 32, else all cores)")
    parser.add_argument("--threads", type=int, default=None, metavar="N", help=text)


def add_checkpoint_arguments(parser) -> None:
    """--checkpoint-every / --no-checkpoints: how often a task's training saves, so that an interrupted sweep
    goes on mid-task (``run_sweep``'s ``checkpoint_every``; docs/paper-scale.md)."""
    from bnlab._task_checkpoint import DEFAULT_EVERY

    parser.add_argument("--checkpoint-every", type=float, default=DEFAULT_EVERY, metavar="SECONDS",
                        help="seconds between two checkpoints of a task's training, kept in "
                             f"<store>.checkpoints/ so that an interrupted task resumes mid-way (default {DEFAULT_EVERY:g})")
    parser.add_argument("--no-checkpoints", action="store_true",
                        help="keep no checkpoints: an interrupted task starts over")


def checkpoint_every(args: argparse.Namespace) -> float | None:
    """``checkpoint_every`` of ``run_sweep``/``build_report`` from :func:`add_checkpoint_arguments`'s options."""
    return None if args.no_checkpoints else args.checkpoint_every


def apply_threads(args: argparse.Namespace) -> None:
    """Check ``--threads`` (1 … the cores this process may use; 1 … 4096 for an existing cluster, whose
    machines are not this one: bnlab._threads.check_threads) and fix this process's count to it;
    nothing without the option."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    from bnlab import _threads

    remote = getattr(args, "scheduler", None) is not None
    cores = _threads.available_cores()
    if not remote and isinstance(threads, int) and threads > cores:
        raise ValueError(f"threads={threads} is not allowed: this process may use {cores} cores; expected "
                         f"an integer from 1 to {cores}")
    args.threads = _threads.check_threads(threads)
    _threads.pin_threads(args.threads)


def yes_no(value: Any) -> Any:
    """True/False as the report writes them (yes/no); anything else unchanged."""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    return value


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


def phi_keywords(args: argparse.Namespace) -> dict:
    """The keywords that, with ``args.phi``, name φ(γx + β): ``gamma``, ``beta`` and the family's given parameters.

    For a command that hands φ unresolved to a public function, which resolves it once
    (:func:`bnlab.activations.get_activation`)."""
    params = {name: getattr(args, name) for name in ("alpha", "slope") if getattr(args, name) is not None}
    return dict(gamma=args.gamma, beta=args.beta, **params)


def activation_from_args(args: argparse.Namespace):
    from bnlab.activations import get_activation

    return get_activation(args.phi, **phi_keywords(args))


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
    return _visible(str(v))


def _visible(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\x1b``): a table shows values read from
    stores and reports, which could be planted, and an escape sequence must not reach the terminal."""
    import unicodedata

    if text.isprintable():
        return text
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) == "Cc" else c
                   for c in text)


def print_table(rows: Iterable[Sequence[Any]], header: Sequence[str] | None = None, file=None,
                max_width: int | None = None) -> None:
    """Print rows as an aligned plain-text table.  With ``max_width``, the widest column is wrapped
    (continuation lines under it) so that no line is longer than ``max_width`` where that is possible."""
    import textwrap

    rows = [[_fmt(c) for c in r] for r in rows]
    if header is not None:
        rows.insert(0, list(header))
    if not rows:
        return
    ncols = max(len(r) for r in rows)
    rows = [r + [""] * (ncols - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(ncols)]
    wrap_col = None
    if max_width is not None and sum(widths) + 2 * (ncols - 1) > max_width:
        wrap_col = max(range(ncols), key=lambda i: widths[i])
        room = max_width - (sum(widths) - widths[wrap_col]) - 2 * (ncols - 1)
        widths[wrap_col] = max(room, 12, len(rows[0][wrap_col]) if header is not None else 0)
    out = file or sys.stdout
    for k, r in enumerate(rows):
        pieces = [[c] for c in r]
        if wrap_col is not None:
            pieces[wrap_col] = textwrap.wrap(r[wrap_col], widths[wrap_col], break_on_hyphens=False) or [""]
        for line in range(max(len(p) for p in pieces)):
            cells = [p[line] if line < len(p) else "" for p in pieces]
            out.write("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() + "\n")
        if k == 0 and header is not None:
            out.write("  ".join("-" * w for w in widths) + "\n")
