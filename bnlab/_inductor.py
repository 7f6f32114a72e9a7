"""How bnlab compiles (private; shared by every compiled route of :mod:`bnlab.nets` and :mod:`bnlab.optim`):
the options handed to ``torch.compile``'s Inductor backend, and the comparison that checks the first
calls of compiled code against the eager code it replaces (:func:`disagreement`).  torch is imported
where it is used, as in :mod:`bnlab._threads`."""
from __future__ import annotations

import itertools
import math
from typing import Any, Iterator

#: The options of every compiled route.  Inductor's buffer reuse off (``allow_buffer_reuse``).
#:
#: With it on (torch 2.13.0 on CPU, 2026-11-28), the compiled step of
#: :func:`bnlab.nets.train_ensemble` on BN-MLPs of unequal depths computed a wrong weight gradient for
#: the last hidden layer of the deepest network.  The final activations of all networks meet in one
#: ``torch.cat`` before the readout; Inductor lets the producers write straight into the slices of the
#: concatenation, so the deepest network's slice is an *alias* of the cat's buffer.  The backward then
#: wrote that layer's pre-activation gradient into the alias's storage ("reuse"), and a later buffer of
#: the concatenation's size took over the concatenation's storage while that gradient was still to be
#: read by the weight gradient: the update of that one weight came out 9-11× too large, every other
#: parameter exact (float64, depths 4 and 16, width 128, 784 inputs, B = 32, one step: 0.0075 against
#: 0.00084; the same function under Dynamo with the ``eager`` or ``aot_eager`` backend, and Inductor
#: with this option off, agree with the eager route to 1e-16).  Which shapes trigger it depends on
#: Inductor's scheduling (depths 8 and 16, or width 64, did not), so the option is off for every
#: compiled route, not only that one (``tests/nets/test_ensemble_compiled_reuse.py``).  Off, each
#: intermediate buffer gets its own allocation (freed as before when dead).  Its cost was not measurable
#: on this project's 2-core CPU machine: ``python benchmarks/bench_ensemble.py --buffer-reuse-ab`` (3
#: float32 BN-MLPs, depths 4, 8, 16, width 128, B = 32, one thread; 2026-11-28) gave 3.8 ms per steady
#: step with it off against 5.4 ms with Inductor's default, the least of 3 runs each, whose runs spread
#: over 3.8–6.7 and 5.4–7.3 ms.  On a GPU the compiled step is replayed from a CUDA graph, whose
#: private memory pool recycles freed blocks within the capture either way; not yet measured there.
#:
#: Inductor's random numbers drawn by torch's own kernels (``fallback_random``).
#:
#: By default Inductor generates its own random numbers for a module's dropout (its own stream, other
#: numbers than the eager kernels draw from the same generator state).  A compiled step then never equals
#: the eager one: :func:`bnlab.nets.train_ensemble`'s check of its first compiled calls against the eager
#: step found every step of a module with dropout "wrong" and fell back to the eager step (correct, slow),
#: and :func:`bnlab.nets.train`'s compiled run was another run than the eager one (measured on the CPU,
#: torch 2.13.0, 2026-11-28: a float64 BN-MLP with ``Dropout(0.2)``, 20 SGD steps: losses 0.17 apart by step
#: 5 with Inductor's numbers, equal to the last bit with this option).  With it the compiled code calls the
#: eager random kernels, so a compiled run draws the eager run's numbers; where a step has no random
#: operation it changes nothing.
COMPILE_OPTIONS: dict[str, object] = {"allow_buffer_reuse": False, "fallback_random": True}


def compile_options() -> dict[str, object]:
    """A fresh copy of :data:`COMPILE_OPTIONS` for one ``torch.compile`` call (Inductor keeps it)."""
    return dict(COMPILE_OPTIONS)


# --------------------------------------------------------------------------- checking compiled code
#: Relative tolerance κ of :func:`disagreement` by dtype name; other floating types (16-bit) get 0.5.
#: Two correct routes differ by the order of their sums (Higham, Accuracy and Stability of Numerical
#: Algorithms, §3.1: ≤ n·u for n terms, ~√n·u in practice) and by fused elementwise chains (a rounding
#: per operation).  A training step's backward adds such relative errors layer by layer rather than
#: multiplying them (the same linear maps carry the gradient and its error), so with n ≤ 5·10⁴ terms
#: (batch × width at paper scale) and ≤ 120 layers a result differs by ≲ 120·√n·u relative: 1.6e-3 in
#: float32 (u = 6e-8), 3e-12 in float64.  κ = 1e-2 and 1e-6 leave room above those and still catch a
#: result off by a percent (float32); the Inductor fault above was off by ~900 %.
KAPPA: dict[str, float] = {"float64": 1e-6, "float32": 1e-2}


def copy_tensors(tree: Any) -> Any:
    """``tree`` (tensors in dicts, lists and tuples) with every tensor cloned; anything else as it is."""
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: copy_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(copy_tensors(v) for v in tree)
    return tree


def write_tensors(dst: Any, src: Any) -> None:
    """Copy ``src``'s tensors into ``dst``'s, in place (same structure; a captured graph or a model keeps
    pointing at ``dst``'s storage)."""
    import torch

    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k, v in dst.items():
            write_tensors(v, src[k])
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            write_tensors(d, s)


def _leaves(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(tree, torch.Tensor) or tree is None:
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}[{i}]")


def disagreement(got: dict, ref: dict, start: dict, *, per_row: bool, ignore: dict | None = None) -> tuple[float, str]:
    """How far a compiled route's results (``got``) are from the eager route's (``ref``) on the same
    inputs: ``(worst, where)``, ``worst`` ≤ 1 where they agree, ``where`` naming the worst tensor.

    ``got``, ``ref``: dicts name → tensors (in dicts, lists, tuples), the same structure.  ``start``:
    the same names (or fewer) → the tensors as they were before the call; a result whose name is not in
    ``start`` (an output that replaces its input, a history started as NaN) is compared against its
    own size.  Integer and boolean tensors must be equal, floating ones non-finite at the same entries
    with the same non-finite values (else ``worst`` is infinite).  Over the finite entries,

        ‖got − ref‖₂  /  (κ · ‖ref − start‖₂ + 8u · ‖ref‖₂)      (‖ref‖₂ in place of ‖ref − start‖₂
                                                                    where there is no start)

    — against what the eager code changed, not against the values: a 9× wrong update of a weight (the
    fault above) moves it by a few percent of its size, less than a tolerance on the values would have
    to allow.  ``per_row``: the norms are taken per row of the leading axis (per entry of a 1-d tensor)
    — one stacked network each, so that a network exploding in a learning-rate sweep does not hide the
    others — else over the whole tensor.  u is the unit roundoff; the 8u term is the rounding of the
    values themselves.  κ: :data:`KAPPA`.  The 2-norm, not the largest entry: RMSProp's first update
    lr·g/(√(1−α)·|g| + ε) turns the rounding of a gradient entry near ε into an O(lr) difference of that
    entry (measured in float32: 2 of 32 768 entries of a weight 1e-4 apart against changes of 1e-3, 10
    times κ entry by entry, 0.08 of it in norm), where a compiler fault moves whole buffers.
    ``ignore``: names → trees of boolean masks like the results', True at entries left out of the
    floating comparison (their finiteness still compared): entries that no route computes reliably.
    """
    import torch

    worst, where = 0.0, "every tensor agrees"
    for name in ref:
        before = start.get(name)
        skip = (ignore or {}).get(name)
        pairs = zip(_leaves(ref[name], name), _leaves(got[name], name),
                    _leaves(before, name) if before is not None else itertools.repeat((None, None)),
                    _leaves(skip, name) if skip is not None else itertools.repeat((None, None)))
        for (path, r), (_, g), (_, s), (_, left_out) in pairs:
            if r is None:
                continue
            if not r.is_floating_point():
                if not torch.equal(g, r):
                    shown = (f"{g.tolist()} against {r.tolist()}" if r.numel() <= 8 else "values")
                    return math.inf, f"{path} differs ({shown})"
                continue
            fin = torch.isfinite(r)
            if not (torch.equal(fin, torch.isfinite(g)) and torch.equal(torch.isnan(r), torch.isnan(g))
                    and torch.equal(torch.where(fin | torch.isnan(r), 0.0, r),
                                    torch.where(fin | torch.isnan(g), 0.0, g))):
                return math.inf, f"{path} is not finite at other entries than the eager code's"
            if left_out is not None:
                fin = fin & ~left_out
            if not fin.any():
                continue
            if per_row:
                rows = (lambda t: t.reshape(t.shape[0], -1)) if r.ndim >= 2 else (lambda t: t.reshape(-1, 1))
            else:
                rows = lambda t: t.reshape(1, -1)  # noqa: E731
            r64 = torch.where(fin, r, 0.0).double()
            g64 = torch.where(fin, g, 0.0).double()
            if s is None:
                moved = r64.abs()
            else:
                s64 = s.double()
                moved = torch.where(torch.isfinite(s64), (r64 - s64).abs(), r64.abs()).masked_fill_(~fin, 0.0)
            err = rows(g64 - r64).norm(dim=1)
            change = rows(moved).norm(dim=1)
            kappa = KAPPA.get(str(r.dtype).removeprefix("torch."), 0.5)
            u = torch.finfo(r.dtype).eps / 2
            tol = kappa * change + 8 * u * rows(r64).norm(dim=1)
            ratio = torch.where(err == 0, 0.0, err / tol)  # err > 0 = tol: inf
            i = int(ratio.argmax())
            if float(ratio[i]) > worst:
                worst = float(ratio[i])
                at = path if not per_row else f"{path}, {'row' if r.ndim >= 2 else 'entry'} {i}"
                where = (f"{at}: difference {float(err[i]):.3g} against a change of {float(change[i]):.3g} by "
                         f"the eager code (κ = {kappa:g})")
    return worst, where
