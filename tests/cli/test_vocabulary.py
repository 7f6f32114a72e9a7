"""One vocabulary (docs/cli.md "Vocabulary"): canonical flags and values in every command, old spellings
accepted with a one-line note for one release, help that shows defaults, errors with the subcommand's usage,
a summary that fits a terminal and --strict that names what failed."""
import argparse
import io

import pytest

from bnlab.cli import build_parser, main
from bnlab.cli._common import _ShowsDefaults, print_table


def _parse(argv):
    args, unknown = build_parser().parse_known_args(argv)
    assert not unknown
    return args


def _subparsers(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _subparsers(sub, prefix + (name,))


# (old command line, new command line, the attribute and its canonical value, the old spelling in the note)
ALIASES = [
    (["rank", "--activation", "relu"], ["rank", "--phi", "relu"], ("phi", "relu"), "--activation"),
    (["rank", "--norm", "bn-nomean"], ["rank", "--norm", "bn_nomean"], ("norm", "bn_nomean"), "--norm bn-nomean"),
    (["rank", "--norm", "batch_no_mean"], ["rank", "--norm", "bn_nomean"], ("norm", "bn_nomean"),
     "--norm batch_no_mean"),
    (["simulate", "--normalization", "bn"], ["simulate", "--norm", "bn"], ("norm", "bn"), "--normalization"),
    (["simulate", "--norm", "batch"], ["simulate", "--norm", "bn"], ("norm", "bn"), "--norm batch"),
    (["simulate", "--norm", "batch_no_mean"], ["simulate", "--norm", "bn_nomean"], ("norm", "bn_nomean"),
     "--norm batch_no_mean"),
    (["simulate", "--init", "asym_uniform"], ["simulate", "--init", "asymmetric_uniform"],
     ("init", "asymmetric_uniform"), "--init asym_uniform"),
    (["train", "--norm", "batch"], ["train", "--norm", "bn"], ("norm", "bn"), "--norm batch"),
    (["fisher", "--arch", "fc:4-2", "--norm", "batch"], ["fisher", "--arch", "fc:4-2", "--norm", "bn"],
     ("norm", "bn"), "--norm batch"),
]


@pytest.mark.parametrize("old, new, attr, spelling", ALIASES, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_old_spelling_works_with_a_one_line_note_and_the_new_one_silently(old, new, attr, spelling, capsys):
    assert getattr(_parse(old), attr[0]) == attr[1]
    err = capsys.readouterr().err.strip().splitlines()
    command = old[0]
    assert len(err) == 1 and err[0].startswith(f"bnlab {command}: note: {spelling} is deprecated; use ")
    assert getattr(_parse(new), attr[0]) == attr[1]
    assert capsys.readouterr().err == ""


def test_both_old_spellings_at_once(capsys):
    assert _parse(["simulate", "--normalization", "batch_no_mean"]).norm == "bn_nomean"
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" is deprecated")[0] for line in err] == [
        "bnlab simulate: note: --normalization", "bnlab simulate: note: --norm batch_no_mean"]


def test_cli_value_lists_agree_with_the_library():
    from bnlab import rank, sim
    from bnlab.cli import _cmd_rank, _cmd_simulate, _cmd_train
    from bnlab.optim import training

    assert _cmd_simulate.SIM_NORMS == sim.NORMALIZATIONS and _cmd_simulate.SIM_INITS == sim.INITS
    assert (_cmd_rank.RANK_NORMS, _cmd_rank.RANK_PHIS, _cmd_rank.RANK_INITS) == (
        rank.CHAIN_NORMS, rank.CHAIN_ACTIVATIONS, rank.CHAIN_INITS)
    assert (_cmd_train.TRAIN_MODELS, _cmd_train.TRAIN_NORMS) == (training.TRAIN_MODELS, training.TRAIN_NORMS)


def test_the_same_thing_has_the_same_flag_in_every_command():
    flags = {path: {s for a in sub._actions for s in a.option_strings} for path, sub in _subparsers(build_parser())}
    for path, f in flags.items():
        if "--batch-size" in f:
            assert "-B" in f, path
    for command in ("theory", "simulate", "fisher", "advise"):
        assert "--phi" in flags[(command,)]
    assert "--phi" in flags[("rank",)] and "--norm" in flags[("simulate",)]
    for command in ("simulate", "rank", "train", "fisher"):
        assert "--device" in flags[(command,)], command
    # the old flags are accepted but hidden from help
    assert "--activation" not in build_parser()._subparsers._group_actions[0].choices["rank"].format_help()
    assert "--normalization" not in build_parser()._subparsers._group_actions[0].choices["simulate"].format_help()


@pytest.mark.parametrize("path, sub", list(_subparsers(build_parser())), ids=lambda x: " ".join(x) if isinstance(x, tuple) else None)
def test_help_shows_every_default(path, sub):
    """Every option with a fixed default says it in its help (either the command's own words or
    "(default: X)"), and every command has a description or help."""
    text = " ".join(sub.format_help().split())
    for action in sub._actions:
        if not _ShowsDefaults._shows_default(action) and "default" not in (action.help or "").lower():
            assert action.default in (None, False, argparse.SUPPRESS) or not action.option_strings \
                or action.help is argparse.SUPPRESS or action.nargs == 0, (path, action.option_strings)
            continue
        if action.help is argparse.SUPPRESS:
            continue
        if _ShowsDefaults._shows_default(action):
            shown = " ".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)
            assert f"(default: {shown})" in text or f"default: {shown}" in text, (path, action.option_strings)
    assert sub.description, path


def test_rank_and_train_help_show_defaults():
    for command, needle in (["rank", "(default: 1000)"], ["train", "(default: 60)"], ["simulate", "(default: 1.0)"]):
        out = io.StringIO()
        with pytest.raises(SystemExit):
            import contextlib

            with contextlib.redirect_stdout(out):
                main([command, "--help"])
        assert needle in " ".join(out.getvalue().split()), command


@pytest.mark.parametrize("argv, usage", [
    (["rank", "--bogus", "1"], "usage: bnlab rank"),
    (["theory", "-B", "8", "--no-such-flag"], "usage: bnlab theory"),
    (["rank", "--norm", "batchy"], "usage: bnlab rank"),
    (["simulate", "--init", "nope"], "usage: bnlab simulate"),
    (["sweep", "status", "x", "--bogus"], "usage: bnlab sweep status"),
    (["theory", "-B", "1"], "usage: bnlab theory"),  # a value the library refuses (ValueError)
    (["fisher", "--arch", "fc:4-2", "--measure", "--device", "cuda:99"], "usage: bnlab fisher"),
])
def test_errors_print_the_subcommand_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert "usage: bnlab [-h]" not in err
    assert f"bnlab {argv[0]}" in err.splitlines()[-1] and "error:" in err.splitlines()[-1]


def test_print_table_wraps_the_widest_column_to_fit():
    out = io.StringIO()
    rows = [("a-reproduction-name", "not_reproduced", "ok", "6/0/6", "why " * 120)] * 3
    print_table(rows, header=["reproduction", "verdict", "cells", "done/fail/all", "why"], file=out, max_width=100)
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 100 and len(lines) > 5
    assert " ".join(out.getvalue().split()).count("why") == 3 * 120 + 1  # nothing lost (+ the header)
    unbounded = io.StringIO()
    print_table(rows, file=unbounded)
    assert max(map(len, unbounded.getvalue().splitlines())) > 480


def test_report_summary_fits_a_terminal_and_strict_names_the_failures(tmp_path, capsys, monkeypatch):
    from tests.experiments import _verdict_helpers as vh

    monkeypatch.delenv("BNLAB_RESULTS", raising=False)
    names = [f"{vh.__name__}:{n}" for n in vh.EXPECTED]
    argv = ["report", "--only", *names, "--results-dir", str(tmp_path / "res"), "--out", str(tmp_path / "out"),
            "--serial", "--no-progress"]
    assert main(argv + ["--strict"]) == 1
    out, err = capsys.readouterr()
    assert max(map(len, out.splitlines())) <= 100, out
    failing = {n: v for n, v in vh.EXPECTED.items() if v not in ("reproduced", "skipped")}
    line = [x for x in err.splitlines() if "--strict" in x]
    assert len(line) == 1 and line[0].startswith(f"bnlab report: --strict: {len(failing)} not reproduced: ")
    for name, v in failing.items():
        assert f"{name} ({v})" in line[0]
    for name, v in vh.EXPECTED.items():
        if v in ("reproduced", "skipped"):
            assert f"{name} (" not in line[0]
    # a second, fully cached run reuses every drawn figure
    assert main(argv) == 0
    out = capsys.readouterr().out
    drawn = sum(1 for v in vh.EXPECTED.values() if v != "skipped")
    assert f"figures: {drawn} of {len(vh.EXPECTED)} reproductions' reused unchanged" in out


def test_reproduce_and_report_share_one_default_folder():
    from bnlab.cli._cmd_report import DEFAULT_OUT
    from bnlab.experiments.report import build_report, reproduce
    import inspect

    assert _parse(["report"]).out == _parse(["reproduce", "x"]).out == DEFAULT_OUT == "bnlab-report"
    assert inspect.signature(reproduce).parameters["out"].default == DEFAULT_OUT
    assert inspect.signature(build_report).parameters["out"].default == DEFAULT_OUT


def test_fisher_device_measures_on_that_device(capsys):
    import json

    assert main(["fisher", "--arch", "fc:64-16-10", "--measure", "--dataset", "digits", "-B", "16", "--device",
                 "cpu", "--tol", "1e-3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["batch_size"] == 16 and out["lambda_max_measured"] > 0
