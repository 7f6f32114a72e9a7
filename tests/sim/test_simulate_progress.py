"""``simulate(progress=...)`` and ``bnlab simulate``'s progress bar: every network counted once, on
stderr (stdout stays the JSON), the numbers unchanged, bad values refused."""
import io
import json

import numpy as np
import pytest
import torch

from bnlab.cli import main
from bnlab.sim import simulate


def _final_count(text: str) -> str:
    # tqdm redraws its line with '\r'; the last drawing is the finished bar
    return [part for part in text.replace("\r", "\n").splitlines() if part.strip()][-1]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_bar_counts_every_network_once_and_changes_no_number(threads):
    # 7 networks in one chunk per chunk thread (1 or 2): with 2, the updates arrive from the two threads in
    # either order; the bar must still end at 7/7 and never pass it.  Same process, same thread count, and
    # each network drawn from its own generator: the arrays are the same floats with and without the bar
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        quiet = simulate("relu", 4, 16, 5, 7, num_batches=2, seed=3)
        stream = io.StringIO()
        shown = simulate("relu", 4, 16, 5, 7, num_batches=2, seed=3, progress=stream)
    finally:
        torch.set_num_threads(before)
    assert shown.chunks == threads  # one chunk per chunk thread
    last = _final_count(stream.getvalue())
    assert "7/7" in last and "network" in last
    assert "8/7" not in stream.getvalue()
    # the bar observes: same draws, same arithmetic
    np.testing.assert_array_equal(shown.grad_norm_sq, quiet.grad_norm_sq)
    np.testing.assert_array_equal(shown.q, quiet.q)


def test_the_bar_advances_chunk_by_chunk(monkeypatch):
    # a memory bound of two and a half networks gives chunks of 2, 2, 2, 1 networks: the bar moves as
    # each finishes (what it draws is tqdm's to throttle; what it is told is checked here)
    from bnlab.sim import networks

    told = []
    monkeypatch.setattr(networks._NetworkProgress, "update", lambda self, n: told.append(n))
    per = networks._network_bytes(False, False, b=4, k=2, width=64, depth=6, d0=64, grads=True, itemsize=8)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = simulate("relu", 4, 64, 6, 7, num_batches=2, seed=0, weight_sampling="explicit",
                       max_memory_bytes=2 * per + per // 2, progress=io.StringIO())
    finally:
        torch.set_num_threads(before)
    assert res.chunks == 4 and told == [2, 2, 2, 1]


@pytest.mark.parametrize("bad", ["yes", 1, None, object()])
def test_a_progress_that_is_neither_a_bool_nor_a_stream_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"progress=.* is not allowed: expected True .*False .*stream"):
        simulate("relu", 4, 8, 2, 2, progress=bad)


def test_cli_draws_the_bar_on_stderr_and_keeps_stdout_json(capsys):
    argv = ["simulate", "-B", "4", "--width", "16", "--depth", "4", "--networks", "5", "--num-batches", "2", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout is the JSON alone
    assert "5/5" in _final_count(captured.err)
    assert main(argv + ["--no-progress"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    assert captured.err == ""
