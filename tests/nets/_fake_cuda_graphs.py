"""Stand-ins for CUDA graphs on the CPU, for the tests of train_ensemble's ``"cuda_graph"`` route.

:func:`install` replaces ``torch.cuda``'s graph and stream objects so that the route's Python runs on
any machine: a capture records the step it is given instead of running it (as a capture records
kernels without executing them), a replay runs the recorded step on the recorded state (or what
``replay`` makes of it), a side stream is a no-op context.  ``torch.compile`` returns the functional
step as it is, and the route is allowed on the CPU.  ``events`` (a list) receives ``"warm"`` for each
warm-up step, ``"capture"`` and ``"replay"``.
"""
from __future__ import annotations

from typing import Callable

import torch


def install(monkeypatch, events: list | None = None,
            replay: Callable[[Callable, dict], None] | None = None) -> None:
    import bnlab.nets._ensemble_step as step_mod
    import bnlab.nets.ensemble as ens

    log = events if events is not None else []
    run_replay = replay or (lambda fn, state: fn(state))

    class FakeGraph:
        capturing: "FakeGraph | None" = None

        def replay(self):
            log.append("replay")
            run_replay(self.fn, self.state)

    class FakeGraphContext:
        def __init__(self, graph):
            self.graph = graph

        def __enter__(self):
            FakeGraph.capturing = self.graph
            log.append("capture")

        def __exit__(self, *exc):
            FakeGraph.capturing = None

    class FakeStream:
        def wait_stream(self, other):
            pass

    class FakeStreamContext:
        def __init__(self, stream):
            pass

        def __enter__(self):
            log.append("warm")

        def __exit__(self, *exc):
            pass

    real_compiled_step = step_mod.StepRunner._compiled_step

    def compiled_step(self):
        fn = real_compiled_step(self)

        def run(state):
            if FakeGraph.capturing is not None:  # recorded, not run
                FakeGraph.capturing.fn, FakeGraph.capturing.state = fn, state
            else:
                fn(state)
        return run

    for name, fake in dict(CUDAGraph=FakeGraph, graph=FakeGraphContext, Stream=FakeStream, stream=FakeStreamContext,
                           current_stream=lambda: FakeStream()).items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(step_mod.torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(step_mod.StepRunner, "_compiled_step", compiled_step)
    monkeypatch.setattr(ens, "resolve_step_mode", lambda mode, device, steps=0: mode)  # allow it on the CPU
