"""``bnlab advise``: the model by name, by architecture and by module:factory; --json, --html, --skip; bad input."""
import json
import textwrap

import pytest

from bnlab.cli import main

SMALL = ["--input-shape", "12", "--classes", "3", "--batch-size", "16", "--draws", "2", "--quiet"]


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_named_model_json(capsys):
    code, out, _ = _run(capsys, "advise", "--model", "mlp", "--depth", "2", "--width", "8", "--lr", "0.1",
                        "--momentum", "0.9", "--json", *SMALL)
    assert code == 0
    d = json.loads(out)
    assert d["structure"]["depth"] == 2 and d["learning_rate"]["lr"] == 0.1 and d["learning_rate"]["momentum"] == 0.9
    assert d["gradients"]["draws"] == 2 and d["rank"] is not None and d["batch_size"]["batch_size"] == 16


def test_architecture_string_and_skip(capsys):
    code, out, _ = _run(capsys, "advise", "--model", "fc:12-8-8-3", "--skip", "rank,batch_size", "--skip",
                        "gradients", "--json", *SMALL)
    d = json.loads(out)
    assert code == 0 and d["skipped"] == ["rank", "batch_size", "gradients"] and d["rank"] is None
    assert d["learning_rate"]["bound"]["arch"] == "fc:12-8-8-3"


def test_user_module_factory_file_and_html(tmp_path, capsys, monkeypatch):
    src = tmp_path / "mynet.py"
    src.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    """))
    html = tmp_path / "advice.html"
    code, out, _ = _run(capsys, "advise", "--model", f"{src}:build", "--html", str(html), *SMALL)
    assert code == 0 and "2. Gradient explosion" in out and html.read_text().startswith("<!DOCTYPE html>")
    monkeypatch.chdir(tmp_path)  # package.module:factory from the current directory
    code, out, _ = _run(capsys, "advise", "--model", "mynet:build", "--json", *SMALL)
    assert code == 0 and json.loads(out)["structure"]["model"] == "Sequential"


def test_html_is_never_written_through_a_planted_link(tmp_path, capsys):
    # the old code opened --html with Path.write_text, which follows a link planted at the path and
    # overwrote the file it points to
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    html = tmp_path / "advice.html"
    html.symlink_to(victim)
    code, _, _ = _run(capsys, "advise", "--model", "mlp", "--depth", "2", "--width", "8", "--skip",
                      "rank,batch_size,gradients", "--html", str(html), *SMALL)
    assert code == 0 and victim.read_bytes() == b"precious\n"
    assert not html.is_symlink() and html.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("argv, needle", [
    (["--model", "nosuchmodule_xyz:build"], "importing 'nosuchmodule_xyz' failed"),
    (["--model", "json:nothing_here"], "has no callable 'nothing_here'"),
    (["--model", "resnet21"], "model='resnet21' is not allowed"),
    (["--model", "fc:10-8-3"], "takes inputs of shape (10,)"),
    (["--model", "mlp", "--skip", "structure"], "skip='structure' is not allowed"),
    (["--model", "mlp", "--input-shape", "0x3"], "input_shape='0x3' is not allowed"),
    (["--model", "mlp", "--lr", "-1"], "lr=-1.0 is not allowed"),
    (["--model", "resnet20"], "needs images"),
    (["--model", "mlp", "--input-shape", "3x224x224", "--batch-size", "100000"], "the inputs alone take"),
    (["--model", "mlp", "--max-memory-gb", "-1"], "max_memory_gb=-1.0 is not allowed"),
    # random labels over --classes 3 and a model with 2 outputs: the option to change is --classes (audit D12)
    (["--model", "fc:12-8-2"], "--classes=3 is not allowed with this model: it has 2 outputs"),
    # options the model does not use are refused, not silently ignored (audit D10)
    (["--model", "fc:12-8-3", "--depth", "5"], "depth=5 is not allowed with model='fc:12-8-3'"),
    (["--model", "resnet20", "--input-shape", "3x8x8", "--width", "7"], "width=7 is not allowed with model='resnet20'"),
    (["--model", "json:dumps", "--phi", "tanh"], "phi='tanh' is not allowed with model='json:dumps'"),
    (["--model", "mlp", "--dataset", "mnist"], "--classes=3 is not allowed with --dataset='mnist'"),
])
def test_bad_input_exits_2_with_the_message(capsys, argv, needle):
    args = ["advise", *argv]
    if "--input-shape" not in argv:
        args += ["--input-shape", "12"]
    args += ["--classes", "3", "--quiet"] + ([] if "--batch-size" in argv else ["--batch-size", "16"])
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err, err


def test_factory_that_returns_something_else(tmp_path, capsys):
    src = tmp_path / "bad.py"
    src.write_text("def build():\n    return 42\n")
    with pytest.raises(SystemExit):
        main(["advise", "--model", f"{src}:build", *SMALL])
    assert "the factory returned int" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/proc/a.html", "/proc/no/such/folder/a.html", "/sys/a.html"])
def test_an_unwritable_html_path_is_refused_before_the_advice_runs(capsys, monkeypatch, path):
    # the audit's D8: /sys and /proc pass the permission bits as root; the page failed after the whole run, rc 1,
    # with a message about a temporary file and not naming --html
    import bnlab.advice

    def never(*args, **kwargs):
        raise AssertionError("the advice ran before --html was checked")

    monkeypatch.setattr(bnlab.advice, "advise", never)
    with pytest.raises(SystemExit) as info:
        main(["advise", "--model", "mlp", "--depth", "2", "--width", "8", "--html", path, *SMALL])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--html={path!r} is not allowed" in err, err


def test_the_html_check_leaves_nothing_behind(tmp_path):
    # the writability probe of check_path (which --html goes through) creates and removes a folder
    from bnlab._validation import check_path

    check_path("--html", str(tmp_path / "page.html"))
    check_path("--html", str(tmp_path / "not" / "yet" / "page.html"))  # its folders are made only when written
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("shape", [(-3, 4), (0, 4), (), (2.5,), (True, 3), "3x-1", (1, 2, 3, 4, 5), None.__class__])
def test_batch_for_refuses_bad_input_shapes_with_a_value_error(shape):
    # the audit's D13: (-3, 4) reached torch.randn (RuntimeError) and (0, 4) drew empty inputs
    from bnlab.advice import batch_for

    with pytest.raises(ValueError, match="input_shape=.* is not allowed"):
        batch_for(input_shape=shape)


def test_batch_for_accepts_a_tuple_like_its_text():
    from bnlab.advice import batch_for

    (x, _), shape, _ = batch_for(input_shape=(3, 4.0), batch_size=2)
    assert shape == (3, 4) and tuple(x.shape) == (2, 3, 4)


def test_max_memory_gb_reaches_the_models_bnlab_builds(monkeypatch):
    # the audit's D9: --max-memory-gb 50 ended in the builder's 1 GiB default and a 100 KB message
    from bnlab import nets
    from bnlab.advice import load_model

    with pytest.raises(ValueError) as info:
        load_model("mlp", input_shape=(64,), num_classes=10, depth=20000, width=128, max_memory_gb=1)
    msg = str(info.value)
    assert len(msg) < 400 and "max_memory_gb=1 " in msg and "depth=20000" in msg
    seen = {}
    monkeypatch.setattr(nets, "MLP", lambda *a, **k: seen.update(k))
    load_model("mlp", input_shape=(64,), num_classes=10, max_memory_gb=50)
    assert seen["max_memory_bytes"] == 50 * 10 ** 9
