"""The BNP/SGD overhead of the batch-size part: the timing procedure, on an injected clock (no wall-clock value
is asserted anywhere: the audit's D4 was a figure of 3 single steps that ranged 0.01× … 14.8×)."""
import pytest
import torch

from bnlab.advice import batch
from bnlab.nets import MLP


class _FakeClock:
    """Virtual seconds: each step advances it by its cost; every ``spike_every``-th step of A also by ``spike``."""

    def __init__(self, cost_a, cost_b, spike=0.0, spike_every=0):
        self.t, self.cost_a, self.cost_b, self.spike, self.spike_every = 0.0, cost_a, cost_b, spike, spike_every
        self.log = []

    def __call__(self):
        return self.t

    def a(self):
        self.log.append("a")
        self.t += self.cost_a
        if self.spike_every and self.log.count("a") % self.spike_every == 0:
            self.t += self.spike

    def b(self):
        self.log.append("b")
        self.t += self.cost_b


def test_rounds_run_until_both_sides_have_the_minimum_time_and_the_median_ratio_is_exact():
    # binary fractions of a second: the clock's sums are exact
    clock = _FakeClock(2 ** -10, 2 ** -9)
    ratio, d = batch.interleaved_ratio(clock.a, clock.b, clock=clock, round_seconds=2 ** -6, min_total_seconds=0.5,
                                       min_rounds=5, max_rounds=200)
    assert ratio == 2.0
    assert d["steps_per_round"] == 16  # 1, 2, 4, 8 steps timed: 8 of A take half a round → 16 steps a round
    assert d["rounds"] == 32  # 32 rounds × 16 steps × 2⁻¹⁰ s = the 0.5 s minimum of the faster side
    assert d["sgd_step_s"] == 2 ** -10 and d["bnp_step_s"] == 2 ** -9
    assert d["ratio_quartiles"] == (2.0, 2.0)


def test_the_median_of_rounds_ignores_a_disturbed_round_where_one_step_pairs_did_not():
    # a 0.5 s stall once in every 400 steps of A: a single-step figure is 250× off when it hits; the rounds' median
    # is not moved
    clock = _FakeClock(1e-3, 2e-3, spike=0.5, spike_every=400)
    ratio, d = batch.interleaved_ratio(clock.a, clock.b, clock=clock, round_seconds=0.02, min_total_seconds=0.5,
                                       min_rounds=5, max_rounds=200)
    assert ratio == pytest.approx(2.0, rel=1e-9)
    assert d["ratio_quartiles"][0] < 2.0 or d["ratio_quartiles"][1] <= 2.0


def test_warmup_first_then_alternating_order_and_the_round_cap():
    clock = _FakeClock(1e-3, 1e-3)
    ratio, d = batch.interleaved_ratio(clock.a, clock.b, clock=clock, round_seconds=0.004, min_total_seconds=100.0,
                                       min_rounds=2, max_rounds=4)
    assert d["rounds"] == 4 and ratio == pytest.approx(1.0)  # the time minimum is not reached: capped rounds
    n = d["steps_per_round"]
    assert clock.log[:2] == ["a", "b"]  # one untimed step of each first
    calib = 1 + 2  # 1 then 2 steps of A (2 ms ≥ half of 4 ms)
    rounds = clock.log[2 + calib:]
    assert n == 4 and len(rounds) == 4 * 2 * n
    firsts = [rounds[i * 2 * n] for i in range(4)]
    assert firsts == ["a", "b", "a", "b"]


def test_a_clock_that_never_advances_gives_no_figure():
    ratio, d = batch.interleaved_ratio(lambda: None, lambda: None, clock=lambda: 0.0, min_rounds=3, max_rounds=3)
    assert ratio is None and d["rounds"] == 3 and d["steps_per_round"] == batch.MAX_STEPS_PER_ROUND


def test_measure_bnp_overhead_reports_its_procedure_and_restores_the_thread_count():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 12, generator=g), torch.randint(0, 3, (4,), generator=g)
    model = MLP(12, [8, 8], 3, norm="bn", seed=0).train()
    threads = torch.get_num_threads()
    ticks = iter(range(10 ** 9))
    ratio, d = batch.measure_bnp_overhead(model, x, y, torch.nn.functional.cross_entropy,
                                          clock=lambda: next(ticks) * 1e-3, round_seconds=0.002,
                                          min_total_seconds=0.0, min_rounds=3, max_rounds=3)
    assert torch.get_num_threads() == threads
    assert ratio is not None and d["rounds"] == 3 and len(d["removed_layers"]) == 2
    text = batch._overhead_text(ratio, d)
    assert "median of 3 interleaved rounds" in text and "steps each" in text and "quartiles" in text
