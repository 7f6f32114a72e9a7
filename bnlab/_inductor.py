"""The options bnlab hands to ``torch.compile``'s Inductor backend (private; every compiled route of
:mod:`bnlab.nets` and :mod:`bnlab.optim` passes them)."""
from __future__ import annotations

#: Inductor's buffer reuse off (``allow_buffer_reuse``).
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
COMPILE_OPTIONS: dict[str, object] = {"allow_buffer_reuse": False}


def compile_options() -> dict[str, object]:
    """A fresh copy of :data:`COMPILE_OPTIONS` for one ``torch.compile`` call (Inductor keeps it)."""
    return dict(COMPILE_OPTIONS)
