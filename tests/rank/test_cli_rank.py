"""``bnlab rank``: JSON contract, agreement with the library call, clean errors (exit 2)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bnlab.cli import main
from bnlab.rank import default_record_layers, run_chain


def test_json_keys_and_library_agreement(capsys):
    argv = ["rank", "--depth", "300", "--width", "8", "--batch-size", "8", "--chains", "2", "--seed", "3",
            "--record-points", "50", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("mean_soft_rank", "mean_r_lower_bound", "final_soft_rank", "per_layer_soft_rank", "layers"):
        assert key in out
    # depth 300 > 50 points: log-spaced layers, with their indices given
    assert out["layers"] == default_record_layers(300, 50).tolist()
    assert len(out["per_layer_soft_rank"]) == len(out["layers"]) < 301
    res = run_chain(8, 8, 300, chains=2, seed=3, record_layers=default_record_layers(300, 50))
    assert out["mean_soft_rank"] == pytest.approx(float(res.mean_soft_rank.mean()), rel=1e-12)
    np.testing.assert_allclose(out["per_layer_soft_rank"], res.soft_rank.mean(0))
    assert out["config"]["norm"] == "bn_nomean" and out["config"]["residual_gamma"] == "inf"


def test_norm_spellings_and_text_output(capsys):
    assert main(["rank", "--depth", "20", "--width", "4", "--batch-size", "4", "--norm", "none",
                 "--phi", "relu", "--residual-gamma", "0.5", "--init", "uniform", "--tau", "0.25"]) == 0
    text = capsys.readouterr().out
    assert "norm=none" in text and "gamma=0.5" in text and "rank_tau" in text


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--tau", "0"], "tau"),
        (["--tau", "-1"], "tau"),
        (["--width", "0"], "width"),
        (["--depth", "0"], "depth"),
        (["--norm", "layer"], "norm"),
        (["--residual-gamma", "abc"], "residual_gamma"),
        (["--residual-gamma", "-2"], "residual_gamma"),
        (["--phi", "tanh"], "phi"),
        (["--width", "1000000"], "width"),
        (["--max-memory-gb", "0"], "max_memory_gb"),
    ],
)
def test_bad_input_exits_2(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["rank", "--depth", "5", "--width", "4", "--batch-size", "4", *argv])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter importing torch (the in-process tests above cover the CLI itself)
def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "bnlab", "rank", "--depth", "10", "--width", "4", "--batch-size",
                           "4", "--json"], capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["config"]["depth"] == 10
