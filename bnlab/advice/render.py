"""The advice as a terminal table (:func:`advice_text`) and as one self-contained HTML card
(:func:`advice_html`: the report's stylesheet, matplotlib figures inlined as PNG)."""
from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path

__all__ = ["advice_text", "advice_html"]

_TITLES = {
    "structure": "1. Structure and the papers' assumptions",
    "gradients": "2. Gradient explosion and trainable depth (Yang et al. 2019)",
    "learning_rate": "3. Learning rate (the Fisher paper)",
    "rank": "4. Rank of the representations (Daneshmand et al. 2020)",
    "batch_size": "5. Batch size and BNP (Lange et al.)",
}


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf"
        return f"{v:.4g}"
    return str(v)


def _table(rows, header) -> str:
    rows = [[_fmt(c) for c in r] for r in rows]
    rows.insert(0, list(header))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _structure_rows(s):
    return [(x.label, x.norm or "-", x.placement or "-", x.activation or "-", x.scale_invariant, x.sigma_w2)
            for x in s.layers]


def _gradient_rows(g):
    return [(name, m, min(col), max(col)) for name, m, col in zip(g.layers, g.mean, zip(*g.values))]


def _lr_rows(lr):
    rows = [(f"λmax ({lr.curvature}, whole network)", lr.lambda_max, f"η* = {_fmt(lr.eta_star)}")]
    if lr.lambda_max_free is not None:
        rows.append((f"λmax (parameters outside the normalized layers: {lr.free_parameters})",
                     lr.lambda_max_free, f"η* = {_fmt(lr.eta_star_free)}"))
    if lr.bound is not None:
        for mode in ("eval", "train"):
            scaled = f", × {lr.bound['scale']:.3g} for your loss" if "scale" in lr.bound else ""
            rows.append((f"mean field bound λ̄max ({mode} mode, {lr.bound['arch']}{scaled}; {lr.bound_basis})",
                         lr.bound[mode]["lambda_max"],
                         f"η* = {_fmt(lr.bound[mode]['eta_star'])}"))
    return rows


def advice_text(a) -> str:
    s = a.structure
    out = [f"bnlab advise: {s.model}, {s.num_params:,} parameters; data: {a.data}"]
    for n in a.notes:
        out.append(f"note: {n}")
    out += ["", _TITLES["structure"], a.verdicts()["structure"],
            _table(_structure_rows(s), ["layer", "norm", "placement", "φ", "scale-inv.", "σ_w²"]), "",
            _table([(x.paper, x.statement, x.holds, x.detail) for x in s.assumptions],
                   ["paper", "assumption", "holds", "detail"])]
    g = a.gradients
    if g is not None:
        out += ["", _TITLES["gradients"], "verdict: " + g.verdict,
                _table(_gradient_rows(g), ["layer", f"mean ‖∂L/∂h‖² ({g.draws} draws)", "min", "max"])]
        if g.theory_rate is None:
            out.append(f"mean field: not evaluated — {g.theory_reason}")
        if g.knobs:
            out += ["knobs (mean field):", _table([(k.name, k.current, k.suggested, k.max_trainable_depth, k.effect)
                                                   for k in g.knobs], ["knob", "now", "try", "16ξ", "effect"])]
    lr = a.learning_rate
    if lr is not None:
        out += ["", _TITLES["learning_rate"], "verdict: " + lr.verdict,
                _table(_lr_rows(lr), ["quantity", "value", "η* = 2(1+μ)/λ"])]
        if lr.bound is None:
            out.append(f"mean field bound: not evaluated — {lr.bound_reason}")
        elif lr.bound_reason:
            out.append(f"mean field bound: {lr.bound_reason}")
        out += [f"note: {n}" for n in lr.notes]
    r = a.rank
    if r is not None:
        out += ["", _TITLES["rank"], "verdict: " + r.verdict + f" [{r.basis}]"]
        if r.layers:
            out.append(_table(list(zip(r.layers, r.width, r.soft_rank, r.r_bound, r.numerical_rank, r.reference,
                                       r.status)),
                              ["representation", "d", "rank_τ", "r(H)", "num. rank", "√min(d,N)", "status"]))
        out += [f"remedy: {x}" for x in r.remedies]
    bs = a.batch_size
    if bs is not None:
        out += ["", _TITLES["batch_size"], "verdict: " + bs.verdict]
        if bs.norm_layers:
            shown = list(bs.norm_layers[:8])
            out.append(_table([(n, k, per, None if noise is None else f"{100 * noise:.0f}%") for n, k, per, noise in shown],
                              ["normalization", "kind", "values per statistic", "variance spread"]))
            if len(bs.norm_layers) > 8:
                out.append(f"… and {len(bs.norm_layers) - 8} more")
        out += ["BNP (two lines):", *("    " + line for line in bs.bnp_code.splitlines())]
        out += [f"note: {n}" for n in bs.notes]
    for part, reason in a.not_evaluated.items():
        out += ["", _TITLES[part], f"not evaluated: {reason}"]
    out += ["", "time per part (wall s / CPU s): " + ", ".join(
        f"{p} {a.seconds[p]:.1f}/{a.cpu_seconds.get(p, float('nan')):.1f}" for p in a.seconds)]
    if a.skipped:
        out.append("skipped: " + ", ".join(a.skipped))
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ HTML
def _css() -> str:
    path = Path(__file__).resolve().parents[1] / "experiments" / "templates" / "report.css"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:  # an installation without the report's templates: unstyled, still complete
        return ""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gradient_figure(g):
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    idx = np.arange(1, len(g.mean) + 1)
    for row in g.values:
        ax.semilogy(idx, row, color="0.75", lw=0.8)
    ax.semilogy(idx, g.mean, "ko-", ms=3, label=f"mean over {g.draws} draws")
    first, last = g.fit_layers
    if g.rate is not None and g.mean[last - 1] > 0:
        xs = np.arange(first, last + 1)
        ax.semilogy(xs, g.mean[last - 1] * g.rate ** (last - xs), "r-", label=f"fitted {g.rate:.3g}/layer")
    if g.theory_rate is not None and g.mean[last - 1] > 0:
        xs = np.arange(first, last + 1)
        ax.semilogy(xs, g.mean[last - 1] * g.theory_rate ** (last - xs), "b--",
                    label=f"mean field λ_G↓ = {g.theory_rate:.3g} ({g.theory_basis})")
    ax.set(xlabel="weight layer l (execution order)", ylabel="‖∂L/∂h_l‖² at initialization")
    ax.legend(fontsize=8)
    return fig


def rank_figure(r):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(2, len(r.layers) + 2)
    ax.plot(xs, r.soft_rank, "o-", label="rank_τ (τ = ½, tr M = d)")
    ax.plot(xs, r.r_bound, "s-", label="r(H) = tr(M)²/‖M‖²_F")
    ax.plot(xs, r.numerical_rank, "^-", label="numerical rank")
    ax.plot(xs, r.reference, "k--", label="√min(d, N)")
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set(xlabel="weight layer whose input is measured", ylabel="rank of the representation")
    ax.legend(fontsize=8)
    return fig


def lr_figure(lr):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 1.9))
    marks = [(lr.eta_star / 2, "η*/2 (whole)", "C0", ":"), (lr.eta_star, "η* (whole)", "C0", "-")]
    if lr.eta_star_free is not None:
        marks += [(lr.eta_star_free / 2, "η*/2 (outside normalized layers)", "C2", ":"),
                  (lr.eta_star_free, "η* (outside normalized layers)", "C2", "-")]
    if lr.bound is not None:
        marks += [(lr.bound["train"]["eta_star"], "mean field η* (train mode)", "C4", "--"),
                  (lr.bound["eval"]["eta_star"], "mean field η* (eval mode)", "C5", "--")]
    vals = [m[0] for m in marks if m[0] and math.isfinite(m[0]) and m[0] > 0]
    if lr.lr is not None:
        vals.append(lr.lr)
    for v, label, color, style in marks:
        if v and math.isfinite(v) and v > 0:
            ax.axvline(v, color=color, ls=style, label=label)
    if lr.lr is not None:
        ax.plot([lr.lr], [0.5], "r*", ms=14, label=f"your lr = {lr.lr:.3g}")
    if vals:
        ax.set_xscale("log")
        ax.set_xlim(min(vals) / 3, max(vals) * 3)
    ax.set_yticks([])
    ax.set_xlabel("learning rate")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def _html_table(rows, header) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(fig, alt: str) -> str:
    return f'<figure><img src="{_png(fig)}" alt="{html.escape(alt)}"></figure>'


def advice_html(a) -> str:
    s = a.structure
    v = a.verdicts()
    parts = [f"<h1>bnlab advise: {html.escape(s.model)}</h1>",
             f'<p class="meta">{s.num_params:,} parameters · {html.escape(a.data)} · BN measured in '
             f"{html.escape(s.measured_bn_mode)} mode</p>"]
    parts += [f'<div class="note">{html.escape(n)}</div>' for n in a.notes]
    parts.append("<h2>Summary</h2>" + _html_table([(_TITLES[k], v[k] if v[k] is not None else "skipped")
                                                   for k in _TITLES], ["part", "verdict"]))
    parts.append(f"<h2>{_TITLES['structure']}</h2><p>{html.escape(v['structure'])}</p>")
    parts.append(_html_table(_structure_rows(s), ["layer", "norm", "placement", "φ", "scale-invariant", "σ_w²"]))
    parts.append(_html_table([(x.paper, x.statement, x.holds, x.detail) for x in s.assumptions],
                             ["paper", "assumption", "holds", "detail"]))
    g = a.gradients
    if g is not None:
        parts.append(f"<h2>{_TITLES['gradients']}</h2><p><b>Verdict.</b> {html.escape(g.verdict)}</p>")
        parts.append(_figure(gradient_figure(g), "gradient norms per layer"))
        if g.theory_rate is None:
            parts.append(f'<p class="muted">Mean field: not evaluated — {html.escape(g.theory_reason)}</p>')
        if g.knobs:
            parts.append(_html_table([(k.name, k.current, k.suggested, k.max_trainable_depth, k.effect) for k in g.knobs],
                                     ["knob", "now", "try", "16ξ", "effect"]))
    lr = a.learning_rate
    if lr is not None:
        parts.append(f"<h2>{_TITLES['learning_rate']}</h2><p><b>Verdict.</b> {html.escape(lr.verdict)}</p>")
        parts.append(_html_table(_lr_rows(lr), ["quantity", "value", "η* = 2(1+μ)/λ"]))
        parts.append(_figure(lr_figure(lr), "learning rates"))
        if lr.bound_reason:
            parts.append(f'<p class="muted">Mean field bound: {html.escape(lr.bound_reason)}</p>')
        parts += [f'<p class="muted">{html.escape(n)}</p>' for n in lr.notes]
    r = a.rank
    if r is not None:
        parts.append(f"<h2>{_TITLES['rank']}</h2><p><b>Verdict.</b> {html.escape(r.verdict)} ({r.basis})</p>")
        if r.layers:
            parts.append(_figure(rank_figure(r), "rank per layer"))
            parts.append(_html_table(list(zip(r.layers, r.width, r.soft_rank, r.r_bound, r.numerical_rank,
                                              r.reference, r.status)),
                                     ["representation", "d", "rank_τ", "r(H)", "numerical rank", "√min(d,N)", "status"]))
        parts += [f"<p>Remedy: {html.escape(x)}</p>" for x in r.remedies]
    bs = a.batch_size
    if bs is not None:
        parts.append(f"<h2>{_TITLES['batch_size']}</h2><p><b>Verdict.</b> {html.escape(bs.verdict)}</p>")
        if bs.norm_layers:
            parts.append(_html_table([(n, k, per, None if noise is None else f"{100 * noise:.0f}%")
                                      for n, k, per, noise in bs.norm_layers],
                                     ["normalization", "kind", "values per statistic", "variance spread"]))
        parts.append(f"<p>BNP in two lines:</p><pre>{html.escape(bs.bnp_code)}</pre>")
        parts += [f'<p class="muted">{html.escape(n)}</p>' for n in bs.notes]
    for part, reason in a.not_evaluated.items():
        parts.append(f"<h2>{_TITLES[part]}</h2><p><b>Not evaluated.</b> {html.escape(reason)}</p>")
    times = ", ".join(f"{p} {a.seconds[p]:.1f} s" for p in a.seconds)
    parts.append(f'<p class="muted">Time per part (wall): {html.escape(times)}.</p>')
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>bnlab advise: '
            f"{html.escape(s.model)}</title><style>\n{_css()}\n</style></head><body>\n{body}\n</body></html>\n")
