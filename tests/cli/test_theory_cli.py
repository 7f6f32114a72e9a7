"""``bnlab theory``: JSON keys, the readable table, and exit code 2 with a clear message on bad input."""
import json
import math

import pytest

from bnlab.cli import main

KEYS = {
    "phi", "batch_size", "eps", "method", "fixed_point_kind", "q_star", "c_star", "forward_lambda_L",
    "forward_lambda_M", "grad_explosion_rate", "cross_batch_c_star", "cross_batch_rate", "depth_scale",
    "max_trainable_depth",
}


def _run_json(capsys, *argv):
    assert main(["theory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_keys_and_values(capsys):
    out = _run_json(capsys, "--phi", "relu", "--batch-size", "32")
    assert KEYS <= set(out)
    assert out["phi"] == "relu" and out["batch_size"] == 32 and out["fixed_point_kind"] == "BSB1"
    # Thm 3.10 at B = 32 (value from the closed form, which the theory tests check against 3 other routes)
    b = 32
    j = (math.sqrt(1 - 1 / (b - 1) ** 2) + (math.pi - math.acos(-1 / (b - 1))) * (-1 / (b - 1))) / math.pi
    dj = (math.pi - math.acos(-1 / (b - 1))) / math.pi
    assert out["grad_explosion_rate"] == pytest.approx(((b - 1 + dj) / (1 - j) - 1) / (b - 3), rel=1e-12)
    assert out["max_trainable_depth"] == pytest.approx(16 / math.log(out["grad_explosion_rate"]), rel=1e-12)


def test_family_parameters_and_affine(capsys):
    out = _run_json(capsys, "--phi", "alpha_relu", "--alpha", "2", "-B", "8")
    assert out["fixed_point_kind"] == "BSB2" and out["grad_explosion_rate"] is None and out["warnings"]
    out = _run_json(capsys, "--phi", "tanh", "-B", "16", "--gamma", "0.5", "--method", "sphere")
    assert out["phi"].startswith("tanh") and out["method"] == "sphere"
    out = _run_json(capsys, "--phi", "relu", "-B", "16", "--eps", "0.1", "--sigma-w2", "2")
    assert out["eps"] == 0.1 and out["forward_lambda_L"] is None


def test_readable_table(capsys):
    assert main(["theory", "--phi", "tanh", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "gradient explosion rate" in out and "grad_explosion_rate" in out and "methods used" in out
    assert "{" not in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--phi", "relu", "-B", "1"], "batch_size=1"),
        (["--phi", "relu", "-B", "2"], "batch_size=2"),
        (["--phi", "relu", "-B", "8", "--eps", "-1"], "eps"),
        (["--phi", "relu", "-B", "8", "--eps", "nan"], "eps"),
        (["--phi", "no_such_phi", "-B", "8"], "no_such_phi"),
        (["--phi", "__import__('os').system('true')", "-B", "8"], "phi"),
        (["--phi", "tanh", "-B", "8", "--method", "closed"], "closed"),
    ],
)
def test_bad_input_exits_2_with_message(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["theory", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["--phi", "tanh", "-B", "8"],
    ["--phi", "alpha_relu", "--alpha", "1.5", "-B", "8", "--gamma", "2", "--beta", "0.5"],
])
def test_the_command_resolves_phi_once(argv, capsys, monkeypatch):
    # the command hands φ unresolved (name, γ, β, family parameters) to analyze, which resolves it once
    # (bnlab.activations.get_activation: "resolved once and handed down"); it used to be resolved twice,
    # by the command and again by analyze.  The count would read 2 if either resolved again.
    import sys

    import bnlab.activations as activations
    import bnlab.cli._cmd_theory  # noqa: F401  (load the command and the theory before the counter goes in)
    import bnlab.theory.analyze  # noqa: F401

    calls = []
    real = activations.get_activation

    def counting(phi, **kw):
        calls.append(phi)
        return real(phi, **kw)

    monkeypatch.setattr(activations, "get_activation", counting)
    for name, module in list(sys.modules.items()):
        if name.startswith(("bnlab.theory", "bnlab.cli")) and getattr(module, "get_activation", None) is real:
            monkeypatch.setattr(module, "get_activation", counting)
    assert main(["theory", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert calls == [argv[1]]
    assert out["phi"] == real(argv[1], **_phi_keywords(argv)).spec


def _phi_keywords(argv):
    names = {"--alpha": "alpha", "--gamma": "gamma", "--beta": "beta"}
    return {names[flag]: float(value) for flag, value in zip(argv, argv[1:]) if flag in names}
