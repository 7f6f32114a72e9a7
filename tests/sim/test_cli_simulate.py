"""``bnlab simulate``: JSON contract, agreement with the library call, clean errors."""
import json

import numpy as np
import pytest

from bnlab.cli import main
from bnlab.sim import simulate
from tests.sim import _reference as ref


def test_json_output_keys_and_values(capsys):
    argv = ["simulate", "--batch-size", "8", "--width", "64", "--depth", "12", "--networks", "6",
            "--seed", "4", "--num-batches", "2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("grad_explosion_rate", "grad_explosion_rate_ci", "theory_grad_explosion_rate",
                "per_layer_grad_norm_sq", "per_layer_cross_batch_corr"):
        assert key in out
    assert len(out["per_layer_grad_norm_sq"]) == 12 and len(out["per_layer_cross_batch_corr"]) == 12
    assert out["config"]["weight_sampling"] == "conditional"  # auto: 2·8 rows ≤ 64/4
    lo, hi = out["grad_explosion_rate_ci"]
    assert lo <= out["grad_explosion_rate"] <= hi
    assert out["grad_explosion_rate_estimator"] == "step_ratio"
    assert out["grad_norm_tail_index"] == 3.5  # (B − 1)/2 at B = 8, eps = 0
    assert out["grad_explosion_rate_ci_method"] == "percentile_bootstrap"
    assert not any("tail index" in note for note in out["notes"])
    # the CLI only calls the library: same arguments and defaults, same numbers
    res = simulate("relu", 8, 64, 12, 6, num_batches=2, seed=4)
    assert out["grad_explosion_rate"] == pytest.approx(res.grad_explosion_rate().rate, rel=1e-12)
    np.testing.assert_allclose(out["per_layer_grad_norm_sq"], res.grad_norm_sq.mean(0), rtol=1e-12)
    if out["theory_grad_explosion_rate"] is not None:
        assert out["theory_grad_explosion_rate"] == pytest.approx(ref.relu_grad_rate(8), rel=1e-6)


def test_cli_defaults_are_the_library_defaults_but_num_batches():
    # one documented difference: the command reports the cross-batch rate, which needs >= 2 batches
    import argparse
    import inspect

    from bnlab.cli import _cmd_simulate

    sub = argparse.ArgumentParser().add_subparsers()
    _cmd_simulate.add_parser(sub)
    parser = sub.choices["simulate"]
    library = inspect.signature(simulate).parameters
    compared = 0
    for action in parser._actions:
        if action.default is argparse.SUPPRESS:
            continue  # an old spelling (--normalization) of an option compared here under its own name
        name = action.dest
        if name in library and library[name].default is not inspect.Parameter.empty:
            compared += 1
            if name == "num_batches":
                assert (action.default, library[name].default) == (4, 1)
            else:
                assert action.default == library[name].default, name
    assert compared >= 12  # eps, sigma_w2, sigma_b2, init, normalization, residual_scale, input_correlation, ...


def test_json_has_the_comparison_of_every_quantity(capsys):
    argv = ["simulate", "--batch-size", "8", "--width", "64", "--depth", "10", "--networks", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    comp = out["comparison"]
    assert set(comp) == {"q_star", "c_star", "grad_explosion_rate", "weight_grad_explosion_rate", "cross_batch_rate"}
    assert comp["q_star"]["simulated"] == out["q"] and comp["q_star"]["theory"] == out["theory_q_star"]
    assert comp["q_star"]["layers"] == [9, 10]  # the last 20 % of 10 layers
    assert comp["cross_batch_rate"]["theory"] == out["theory_cross_batch_rate"]


def test_small_batch_notes_the_infinite_variance_and_its_interval(capsys):
    argv = ["simulate", "--batch-size", "4", "--width", "32", "--depth", "8", "--networks", "20", "--num-batches", "1"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["grad_norm_tail_index"] == 1.5
    assert out["grad_explosion_rate_ci_method"] == "tail_bootstrap_t"
    assert any("tail index 1.5" in note and "bootstrap-t" in note for note in out["notes"])
    assert main(argv) == 0
    assert "note: the gradient norms have tail index 1.5" in capsys.readouterr().out
    assert main([*argv, "--eps", "0.001", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["grad_norm_tail_index"] is None and not any("tail index" in note for note in out["notes"])


@pytest.mark.parametrize(
    "extra,needle",
    [(["--width", "0"], "width"), (["--depth", "0"], "depth"), (["--networks", "0"], "networks"),
     (["--init", "he"], "init"), (["--dtype", "int8"], "dtype"),
     (["--weight-sampling", "lazy"], "weight_sampling"),
     (["--init", "uniform", "--weight-sampling", "conditional"], "weight_sampling")],
)
def test_bad_input_exits_2_naming_argument(extra, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--width", "4", "--depth", "3", "--networks", "1", *extra])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
