"""``bnlab fisher``: JSON keys, values from the library, --measure on MNIST, exit code 2 on bad input."""
import json

import pytest

from bnlab.cli import main
from bnlab.fisher import fisher_order_parameters


def _run_json(capsys, *argv):
    assert main(["fisher", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_keys_and_values_match_the_library(capsys):
    out = _run_json(capsys, "--arch", "fc:784-1000-1000-1000-10", "--gamma", "1", "--sigma-w2", "2",
                    "--sigma-b2", "0.5", "--momentum", "0.9")
    assert {"lambda_max_bound", "eta_star", "per_layer_f", "formula", "layers", "bn_mode"} <= set(out)
    ref = fisher_order_parameters("fc:784-1000-1000-1000-10")
    assert out["lambda_max_bound"] == pytest.approx(ref.lambda_max_bound, rel=1e-12)
    assert out["eta_star"] == pytest.approx(2 * 1.9 / ref.lambda_max_bound, rel=1e-12)
    assert out["per_layer_f"] == pytest.approx(list(ref.per_layer_f), rel=1e-12)
    assert out["formula"] == "measured"
    paper = _run_json(capsys, "--arch", "fc:784-1000-1000-1000-10", "--formula", "paper", "--norm", "none")
    assert paper["formula"] == "paper" and paper["norm"] == "none"


def test_per_layer_gamma_and_conv_table(capsys):
    out = _run_json(capsys, "--arch", "conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10", "--gamma", "0.5,1,2")
    assert out["gamma"] == [0.5, 1.0, 2.0] and len(out["per_layer_f"]) == 4
    assert main(["fisher", "--arch", "conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10"]) == 0
    text = capsys.readouterr().out
    assert "lambda_max_bound" in text and "eta_star" in text


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_measure_on_digits(capsys, mode):
    out = _run_json(capsys, "--arch", "conv:1x8x8-c16k3s2p1-fc10", "--measure", "--dataset", "digits",
                    "--bn-mode", mode, "--batch-size", "64")
    assert out["bn_mode"] == mode and out["lambda_max_measured"] > 0
    assert out["ratio_measured_to_bound"] == pytest.approx(out["lambda_max_measured"] / out["lambda_max_bound"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_measure_on_mnist(capsys, mode):
    out = _run_json(capsys, "--arch", "fc:784-64-10", "--measure", "--dataset", "mnist", "--bn-mode", mode,
                    "--batch-size", "64")
    assert out["bn_mode"] == mode and out["lambda_max_measured"] > 0
    assert out["ratio_measured_to_bound"] == pytest.approx(out["lambda_max_measured"] / out["lambda_max_bound"])
    assert 0.5 < out["input_q"] < 1.5  # standardized MNIST: E‖x‖²/N0 ≈ 1 on a batch


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--arch", "fc:784"], "arch"),
        (["--arch", "conv:1x4x4-c3k2s9-fc2"], "stride 9"),
        (["--arch", "fc:5-3", "--sigma-w2", "-1"], "sigma_w2"),
        (["--arch", "fc:5-3", "--sigma-b2", "-1"], "sigma_b2"),
        (["--arch", "fc:5-3", "--momentum", "1"], "momentum"),
        (["--arch", "fc:5-3", "--momentum", "-0.5"], "momentum"),
        (["--arch", "fc:784-3", "--measure", "--bn-mode", "train", "--batch-size", "1"], "batch-size"),
        (["--arch", "fc:100-3", "--measure", "--dataset", "digits"], "input dimension"),
        (["--arch", "fc:5-3-2", "--gamma", "1,2,3"], "gamma"),
    ],
)
def test_bad_input_exits_2_naming_the_argument(capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        main(["fisher", *argv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_measure_hessian_curvature_on_digits(capsys):
    out = _run_json(capsys, "--arch", "fc:64-32-10", "--measure", "--dataset", "digits", "--curvature", "hessian",
                    "--batch-size", "32")
    assert out["curvature"] == "hessian" and out["lambda_max_measured"] > 0


@pytest.mark.parametrize("phi", ["tanh", "sin", "erf"])
def test_odd_phi_reports_a_zero_bound_instead_of_failing(capsys, phi):
    # used to exit 2 with "the bound is -1.09e-15: not a positive finite number" on AMD EPYC
    out = _run_json(capsys, "--arch", "fc:784-256-256-10", "--phi", phi)
    assert out["lambda_max_bound"] == 0.0 and out["eta_star"] is None and "bound is 0" in out["note"]
    assert main(["fisher", "--arch", "fc:784-256-256-10", "--phi", phi, "--bn-mode", "train"]) == 0
    text = capsys.readouterr().out
    assert "eta_star = 2(1+0.9)/lambda_max_bound = inf" in text and "note: the bound is 0" in text
