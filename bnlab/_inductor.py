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
#: compiled route, not only that one.  Off, each intermediate buffer gets its own allocation (freed as
#: before when dead): ~3 % more time per compiled ensemble step on CPU
#: (``tests/nets/test_ensemble_compiled_reuse.py``).
COMPILE_OPTIONS: dict[str, object] = {"allow_buffer_reuse": False}


def compile_options() -> dict[str, object]:
    """A fresh copy of :data:`COMPILE_OPTIONS` for one ``torch.compile`` call (Inductor keeps it)."""
    return dict(COMPILE_OPTIONS)
