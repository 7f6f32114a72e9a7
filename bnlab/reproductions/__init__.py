"""The papers' figures and tables, one module per figure, each exposing ``EXPERIMENTS``.

Every public module here (name not starting with ``_``) is imported by
:mod:`bnlab.experiments.registry` and its ``EXPERIMENTS: list[Experiment]``
registered by name; a module that fails to import is reported (``bnlab
reproduce --list``, the report) without hiding the others.  Adding a
reproduction is adding a module: see ``docs/experiments.md`` for the contract
(``grid``, a module-level ``run_cell``, ``plot``, ``compare``).
"""
