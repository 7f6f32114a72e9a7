"""Plotting helpers shared by the reproductions: a headless pyplot, one way to save a figure, and
tick labels in a grid's own units.

Every reproduction writes each figure once as PNG (shown on the report page) and SVG (linked
from it) under the same stem (:func:`save_figure`).  Axes that span a parameter grid are ticked
at the grid's values (:func:`grid_ticks`: ε = 0.001 … 1 reads "0.001, 0.01, 0.1, 1", not powers of
2), and log axes whose range is under a decade get plain number labels instead of "1.04×10⁰"
(:func:`plain_log_ticks`).  Titles use matplotlib mathtext (``$\\lambda_G^{L-l}$``) or plain
Unicode, never raw TeX-like markup.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

__all__ = ["pyplot", "save_figure", "grid_ticks", "plain_log_ticks", "FORMATS"]

#: The formats every figure is saved in; the report shows the first and links the others.
FORMATS = ("png", "svg")


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (figures are files; never a window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, outdir: str | Path, stem: str, *, formats: Sequence[str] = FORMATS,
                dpi: float = 110, bbox_inches: "str | None" = "tight") -> list[Path]:
    """Write ``fig`` as ``<outdir>/<stem>.<fmt>`` for each format, close it, return the paths.

    Each file is written to a temporary file in ``outdir`` and renamed over its path
    (:func:`bnlab._validation.atomic_output_path`): a symbolic link planted at a figure's name is
    replaced, never followed, so it cannot make bnlab overwrite the file it points to.
    """
    from bnlab._validation import atomic_output_path

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = [outdir / f"{stem}.{fmt}" for fmt in formats]
    try:
        for p in paths:
            fmt = p.suffix.lstrip(".")
            with atomic_output_path(p, name="figure") as tmp:
                fig.savefig(tmp, format=fmt, dpi=dpi if fmt == "png" else None, bbox_inches=bbox_inches)
    finally:
        pyplot().close(fig)
    return paths


def _number(v: float) -> str:
    """A tick label in plain decimals from 0.001 to 99 999 ("0.001", "1.04", "1000"), in mathtext
    powers of ten beyond ("$10^{5}$", "$2\\times10^{-4}$") — never "1e+03" or "1.04×10⁰"."""
    import math

    import numpy as np

    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    exp = math.floor(math.log10(abs(v)) + 1e-9)
    if -3 <= exp <= 4:
        return np.format_float_positional(v, precision=3, unique=True, fractional=False, trim="-")
    mant = v / 10**exp
    return f"$10^{{{exp}}}$" if abs(mant - 1) < 1e-9 else f"${mant:.2g}\\times10^{{{exp}}}$"


def grid_ticks(ax: Any, axis: str, values: Sequence[float]) -> None:
    """Major ticks of ``axis`` ("x" or "y") at the grid's ``values``, labelled as plain numbers; no
    minor ticks (on a log axis matplotlib would otherwise add powers of its base)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator([float(v) for v in values]))
    target.set_major_formatter(FuncFormatter(lambda v, _pos: _number(v)))
    target.set_minor_locator(NullLocator())


def plain_log_ticks(ax: Any, axis: str = "y") -> None:
    """Readable labels on a log ``axis``: plain numbers ("0.25", "3") on major and minor ticks when
    the axis spans under two decades (matplotlib's default then labels minor ticks "2.5×10⁻¹")."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    target = ax.xaxis if axis == "x" else ax.yaxis
    lo, hi = (ax.get_xlim() if axis == "x" else ax.get_ylim())
    if lo <= 0 or hi <= 0:
        return
    fmt = FuncFormatter(lambda v, _pos: _number(v))
    target.set_major_formatter(fmt)
    if math.log10(hi / lo) < 2:
        target.set_minor_locator(LogLocator(base=10, subs=(2, 3, 5), numticks=12))
        target.set_minor_formatter(fmt)
    else:
        target.set_minor_formatter(NullFormatter())
