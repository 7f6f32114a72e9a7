"""The child process of :func:`bnlab.experiments.plan.plan_experiments` (``python -m bnlab.experiments._pilot``).

Reads one JSON request per line on stdin (``name``, ``module``, ``scale``, ``device``, ``workers``,
``budget``, ``pilot_steps``, ``clock``), pilots that experiment with one torch thread (as a Dask worker runs), and
writes one JSON line with the :class:`~bnlab.experiments.plan.ExperimentPlan` to the stdout it was
started with — after a ``{"progress": …}`` line before each pilot run, so that a parent which stops a
pilot past its limit knows whether a whole task was running.  Anything the pilots print goes to stderr, so the answer line stays clean.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import asdict


def main() -> int:
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # a pilot's prints must not mix with the answers
    from bnlab.experiments._worker import _limit_threads

    _limit_threads()
    from bnlab.experiments.plan import plan_experiment
    from bnlab.experiments.registry import get_experiment

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            exp = get_experiment(req["name"], module=req.get("module"))
            plan = plan_experiment(exp, req["scale"], device=req.get("device"), workers=req.get("workers"),
                                   budget=float(req["budget"]), pilot_steps=tuple(req["pilot_steps"]),
                                   limit_threads=True, clock=req.get("clock", "wall"),
                                   _notify=lambda msg: answer.write(json.dumps(msg) + "\n"))
            out = asdict(plan)
        except Exception as exc:  # the parent turns this into a ValueError naming the cause
            traceback.print_exc()
            out = {"crash": f"{type(exc).__name__}: {exc}"}
        answer.write(json.dumps(out, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
