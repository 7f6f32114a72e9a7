"""The sweep's progress bar: cells done / failed / remaining and an ETA (tqdm)."""
from __future__ import annotations

import sys
from typing import IO

__all__ = ["SweepProgress"]


class SweepProgress:
    """A tqdm bar over all cells of the grid, starting at the cells already finished.

    The ETA is tqdm's: remaining cells divided by the rate measured in this
    run (cells finished before the run count in the position, not in the
    rate), so a resumed sweep does not report a spuriously fast rate.

    Parameters
    ----------
    total, done, failed:
        Cells in the grid; cells already done/failed when the run starts.
    desc:
        Label (the experiment name and scale).
    file:
        Stream to write to (default ``sys.stderr``); ``enabled=False`` writes nothing.
    """

    def __init__(self, total: int, done: int = 0, failed: int = 0, *, desc: str = "", file: IO | None = None,
                 enabled: bool = True):
        self.total = int(total)
        self.done = int(done)
        self.failed = int(failed)
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.total,
                initial=self.done + self.failed,
                desc=desc,
                unit="cell",
                file=file if file is not None else sys.stderr,
                dynamic_ncols=True,
                mininterval=0.2,
                smoothing=0.1,
                postfix=f"done={self.done} failed={self.failed} remaining={self.remaining}",
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
            )
            self._refresh_postfix()

    @property
    def remaining(self) -> int:
        return self.total - self.done - self.failed

    def _refresh_postfix(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"done={self.done} failed={self.failed} remaining={self.remaining}", refresh=False)

    def update(self, ok: bool) -> None:
        """One more cell finished (``ok``) or failed."""
        if ok:
            self.done += 1
        else:
            self.failed += 1
        if self._bar is not None:
            self._refresh_postfix()
            self._bar.update(1)

    def write(self, message: str) -> None:
        """A line printed above the bar (nothing when the bar is disabled)."""
        if self._bar is not None:
            self._bar.write(message, file=self._bar.fp)

    def close(self) -> None:
        if self._bar is not None:
            self._refresh_postfix()
            self._bar.refresh()
            self._bar.close()
            self._bar = None
