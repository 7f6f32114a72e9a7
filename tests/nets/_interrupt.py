"""Stopping a training run right after its k-th checkpoint save, as a time limit or a kill would (the resume
tests of both trainers)."""
from __future__ import annotations

import bnlab.nets._checkpoint as ck

#: the real writer, to put back where a test keeps other patches in place
REAL_WRITE = ck.write


class Stop(Exception):
    """Stands for what ends a process mid-run (a time limit, a kill)."""


def interrupt_after(monkeypatch, saves: int) -> list:
    """Make the ``saves``-th checkpoint write raise :class:`Stop` once it is on disk; the list counts writes
    (the step of each)."""
    real, count = ck.write, []

    def write(path, payload, *kind):
        real(path, payload, *kind)
        count.append(payload["done"])
        if len(count) == saves:
            raise Stop

    monkeypatch.setattr(ck, "write", write)
    return count


def disk_full(monkeypatch) -> list:
    """Make every checkpoint write fail as on a full disk; the list holds the step of each try."""
    tries = []

    def full(path, payload, *kind):
        tries.append(payload["done"])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "write", full)
    return tries
