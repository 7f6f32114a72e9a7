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


def test_a_table_writes_control_characters_as_escapes(capsys):
    """Tables show values read from stores and reports (a sweep's experiment name, a claim's verdict),
    which could be planted: an escape sequence is printed as text, never sent to the terminal."""
    from bnlab.cli._common import print_table

    print_table([["\x1b[31mEVIL\x1b[0m", "λ_G ok", "two\nlines"]], header=["a", "b", "c"])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[31mEVIL\\x1b[0m" in out
    assert "λ_G ok" in out and "two\\nlines" in out
