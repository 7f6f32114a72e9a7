"""``bnlab train`` and :func:`bnlab.optim.train_network`: per-epoch rows, JSON, the paper's learning
rates, BN at batch size 1 rejected, bad input → exit code 2 naming the argument."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("bnlab.nets")

from bnlab.cli import main  # noqa: E402
from bnlab.optim import default_learning_rate, train_network  # noqa: E402

FAST = ["--train-size", "300", "--test-size", "200", "--widths", "16", "16"]


def test_bnp_at_batch_size_one_json(capsys):
    assert main(["train", "--model", "fc", "--norm", "bnp", "--batch-size", "1", "--dataset", "mnist",
                 "--epochs", "1", *FAST, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["norm"] == "bnp" and out["batch_size"] == 1 and out["steps"] == 300
    assert out["learning_rate"] == 0.1  # Table 2, mini-batch 1, BNP
    (row,) = out["epochs"]
    assert row["epoch"] == 1 and 0.0 <= row["test_accuracy"] <= 1.0 and row["train_loss"] > 0
    # 300 online steps of a 16-16 network: above chance (0.1).  With 200 test images the standard
    # error of an accuracy of 0.1 is 0.021, so 0.2 is ~5 s.e. above chance (0.28 measured).
    assert row["test_accuracy"] > 0.2


def test_readable_output_fractional_epochs(capsys):
    assert main(["train", "--norm", "ln", "--batch-size", "10", "--epochs", "1.5", *FAST]) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out and "norm=ln" in out
    lines = [l for l in out.splitlines() if l.strip() and l.split()[0].replace(".", "").isdigit()]
    assert [l.split()[0] for l in lines] == ["1", "1.5"]


@pytest.mark.parametrize("argv,needle", [
    (["--norm", "bn", "--batch-size", "1"], "batch_size=1"),
    (["--norm", "brn", "--batch-size", "1"], "batch_size=1"),
    (["--norm", "bogus"], "argument --norm: invalid choice: 'bogus'"),
    (["--model", "rnn"], "argument --model: invalid choice: 'rnn'"),
    (["--epochs", "0"], "epochs=0"),
    (["--lr", "-1"], "lr=-1"),
    (["--rho", "1.0"], "rho=1.0"),
    (["--eps1", "-0.1"], "eps1=-0.1"),
    (["--batch-size", "0"], "batch_size=0"),
    (["--dataset", "imagenet"], "dataset='imagenet'"),  # named as the option, not load_dataset's name=
    # --native selects BNP's kernels: with a norm that trains without BNP it used to be ignored silently
    (["--norm", "bn", "--native"], "native=True is not allowed with norm='bn'"),
    (["--norm", "none", "--native"], "native=True is not allowed with norm='none'"),
    # BNP's settings and the checkpoint interval were ignored silently where they do nothing
    (["--norm", "bn", "--rho", "0.5"], "--rho=0.5 is not allowed with --norm bn"),
    (["--norm", "none", "--eps1", "0.5"], "--eps1=0.5 is not allowed with --norm none"),
    (["--norm", "gn", "--eps2", "0.001"], "--eps2=0.001 is not allowed with --norm gn"),
    (["--checkpoint-every", "5"], "--checkpoint-every=5.0 is not allowed without --checkpoint"),
])
def test_bad_input_exits_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *FAST, *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_native_flag_reaches_the_preconditioner(monkeypatch, capsys):
    # --native is passed to BNPreconditioner(native=True); the kernels' build is replaced by a failed
    # one (no compiler needed here), which warns and keeps the eager route.
    from bnlab.optim import _native

    seen = []
    real = _native.kernels

    def kernels():
        seen.append(True)
        return None

    monkeypatch.setattr(_native, "kernels", kernels)
    assert main(["train", "--norm", "bnp", "--batch-size", "30", "--epochs", "1", *FAST, "--native", "--json"]) == 0
    assert seen and json.loads(capsys.readouterr().out)["steps"] == 10
    seen.clear()
    assert main(["train", "--norm", "bnp", "--batch-size", "30", "--epochs", "1", *FAST, "--json"]) == 0
    assert not seen
    assert real is not kernels


def test_module_entry_point_exit_code():
    proc = subprocess.run([sys.executable, "-m", "bnlab", "train", "--norm", "bn", "--batch-size", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "batch_size=1" in proc.stderr


def test_default_learning_rates_follow_table2():
    assert default_learning_rate("fc", "bnp", 60) == 0.5
    assert default_learning_rate("fc", "none", 64) == 0.1
    assert default_learning_rate("fc", "ln", 6) == 5e-2
    assert default_learning_rate("fc", "none", 1) == 5e-4
    assert default_learning_rate("cnn", "bnp", 2) == 1e-2


def test_cnn_bnp_gn_runs():
    res = train_network(model="cnn", norm="bnp_gn", dataset="mnist", batch_size=4, epochs=1, train_size=16,
                        test_size=8, lr=0.01)
    assert res.steps == 4 and not res.diverged and res.epochs[-1]["epoch"] == 1
