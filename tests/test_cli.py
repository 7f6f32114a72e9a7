import json
import subprocess
import sys

from bnlab.cli import main


def test_activations_json(capsys):
    assert main(["activations", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "relu" in out["activations"] and "tanh" in out["expression_functions"]


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "bnlab", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and "bnlab" in proc.stdout
