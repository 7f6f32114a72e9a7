"""The networks ``bnlab advise`` can be pointed at by name: the user's own code, an architecture string, or
one of bnlab's models.

:func:`load_model` resolves

* ``"package.module:factory"`` or ``"path/to/file.py:factory"`` — the user's code: ``factory()`` is called
  with no arguments and must return an ``nn.Module`` (the current directory is importable, as for
  ``python -m``; importing runs that code, as any import does);
* ``"fc:784-256-10"`` / ``"conv:1x28x28-c30k3s2-fc10"`` — the architecture grammar of ``bnlab fisher``
  (:func:`bnlab.fisher.build_model`: BN + φ after every hidden layer, or ``norm="none"``);
* a name of :data:`NAMED_MODELS` — bnlab's own models, sized for the data's input shape and classes.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import sys
from pathlib import Path

from bnlab._validation import check_choice, check_int, check_real

__all__ = ["NAMED_MODELS", "load_model", "parse_shape", "batch_for"]

NAMED_MODELS = ("mlp", "bnmlp", "fisher-cnn", "bnp-cnn", "resnet20", "resnet32", "resnet44", "resnet56", "resnet110",
                "resnet18", "resnet34", "resnet50", "preact-resnet20", "preact-resnet56", "preact-resnet110", "vgg11",
                "vgg13", "vgg16", "vgg19")

_FACTORY = re.compile(r"^(?P<module>[^:]+):(?P<attr>[A-Za-z_][A-Za-z0-9_]*)$")


def _load_factory(spec: str):
    m = _FACTORY.match(spec)
    if m is None:
        raise ValueError(f"model={spec!r} is not allowed: expected 'package.module:factory', 'file.py:factory', an "
                         f"architecture ('fc:…', 'conv:…') or one of {', '.join(NAMED_MODELS)}")
    target, attr = m.group("module"), m.group("attr")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"model={spec!r} is not allowed: no file {str(path)!r}")
        name = f"bnlab_advise_user_{abs(hash(str(path.resolve())))}"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's code
            raise ValueError(f"model={spec!r}: importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from None
    else:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", target):
            raise ValueError(f"model={spec!r} is not allowed: {target!r} is not a module name")
        cwd = os.getcwd()
        added = cwd not in sys.path
        if added:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # noqa: BLE001 - the user's code
            raise ValueError(f"model={spec!r}: importing {target!r} failed: {type(exc).__name__}: {exc}") from None
        finally:
            if added and cwd in sys.path:
                sys.path.remove(cwd)
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"model={spec!r} is not allowed: {target!r} has no callable {attr!r}")
    return factory


def _refuse_unused_options(spec: str, given: dict) -> None:
    """``ValueError`` naming the first option in ``given`` (not None) that the kind of model ``spec`` does not
    use: an option that would be silently ignored misleads more than a refusal."""
    low = spec.lower()
    if ":" in spec and not low.startswith(("fc:", "conv:")):
        unused, why = ("depth", "width", "norm", "phi"), "the factory builds the module itself"
    elif low.startswith(("fc:", "conv:")):
        unused, why = ("depth", "width"), "the architecture string sets the layers"
    elif low not in ("mlp", "bnmlp"):
        unused, why = ("depth", "width"), "they size mlp and bnmlp only"
    else:
        return
    for opt in unused:
        if given[opt] is not None:
            raise ValueError(f"{opt}={given[opt]!r} is not allowed with model={spec!r}: {why}")


def load_model(spec: str, *, input_shape=None, num_classes: int | None = None, depth: int | None = None,
               width: int | None = None, norm: str | None = None, phi: str | None = None, seed: int = 0,
               max_memory_gb: float = 8.0):
    """The ``nn.Module`` that ``spec`` names (see the module docstring).

    ``input_shape`` (per sample) and ``num_classes`` size bnlab's models; ``depth``, ``width``, ``norm``, ``phi``
    set the MLPs' hidden layers (default 10 × 128, BN, relu) and the norm/φ of the others and of an
    architecture string.  An option the named kind does not use is a ``ValueError`` naming it: any of the
    four with a factory, ``depth``/``width`` with an architecture string or a model other than mlp/bnmlp.
    ``max_memory_gb`` bounds the parameters of the models bnlab builds (``bnlab advise --max-memory-gb``; the
    builders' own default bound is 1 GiB).
    """
    from torch import nn

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model={spec!r} is not allowed: expected a non-empty string")
    spec = spec.strip()
    seed = check_int("seed", seed, minimum=0)
    max_memory_gb = check_real("max_memory_gb", max_memory_gb, minimum=0.0, strict_minimum=True)
    limit = int(max_memory_gb * 1e9)
    low = spec.lower()
    _refuse_unused_options(spec, {"depth": depth, "width": width, "norm": norm, "phi": phi})
    if low.startswith(("fc:", "conv:")):
        from bnlab.fisher import build_model, parse_arch

        arch = parse_arch(spec)
        if input_shape is not None:
            want = tuple(arch.input_shape)
            have = tuple(input_shape)
            if want != have and not (len(want) == 1 and want[0] == math.prod(have)):
                raise ValueError(f"model={spec!r} is not allowed with this data: the architecture takes inputs of "
                                 f"shape {want}, the data has {have}")
        model = build_model(arch, norm=norm or "bn", phi=phi or "relu", seed=seed, max_memory_bytes=limit)
        if len(arch.input_shape) == 1:
            model = nn.Sequential(nn.Flatten(), *model)
        return model
    if ":" in spec:
        factory = _load_factory(spec)
        try:
            model = factory()
        except Exception as exc:  # noqa: BLE001 - the user's code
            raise ValueError(f"model={spec!r}: calling {spec.split(':')[1]}() failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={spec!r} is not allowed: the factory returned {type(model).__name__}, expected an "
                             "nn.Module")
        return model
    name = check_choice("model", low, NAMED_MODELS)
    if input_shape is None or num_classes is None:
        raise ValueError(f"model={name!r} needs the data's input shape and number of classes")
    shape = tuple(int(s) for s in input_shape)
    classes = check_int("num_classes", num_classes, minimum=2)
    from bnlab import nets

    d = 10 if depth is None else check_int("depth", depth, minimum=1)
    w = 128 if width is None else check_int("width", width, minimum=1)
    n_in = int(math.prod(shape))
    kw = {"max_memory_bytes": limit} if phi is None else {"phi": phi, "max_memory_bytes": limit}
    if name in ("mlp", "bnmlp"):
        # checked here in one line: the builder's own refusal lists every hidden width (100 KB at depth 20 000)
        n_params = n_in * w + (d - 1) * w * w + w * classes + 3 * d * w + classes
        if 4.0 * n_params > limit:
            raise ValueError(f"model={name!r} is not allowed with depth={d}, width={w}: its {n_params:.3g} parameters "
                             f"need about {4.0 * n_params / 1e9:.2f} GB, more than max_memory_gb={max_memory_gb:g} "
                             "(--max-memory-gb); use fewer or narrower layers, or raise it")
    if name == "mlp":
        return nets.MLP(n_in, [w] * d, classes, norm=norm or "bn", seed=seed, **kw)
    if name == "bnmlp":
        if norm not in (None, "bn"):
            raise ValueError(f"norm={norm!r} is not allowed with model='bnmlp' (its BN is built in); use model='mlp'")
        return nets.BNMLP(n_in, classes, depth=d, width=w, seed=seed, **kw)
    if len(shape) != 3:
        raise ValueError(f"model={name!r} is not allowed with inputs of shape {shape}: it needs images (C, H, W)")
    if name == "fisher-cnn":
        return nets.FisherCNN(shape, classes, norm=norm or "bn", seed=seed, **kw)
    if name == "bnp-cnn":
        return nets.BNPCNN(shape, classes, norm=norm or "bn", seed=seed, **kw)
    if "resnet" in name:
        return nets.resnet(int(name.rsplit("resnet", 1)[1]), classes, in_channels=shape[0], norm=norm or "bn",
                           preact=name.startswith("preact-"), seed=seed, **kw)
    return nets.vgg(int(name[3:]), classes, in_channels=shape[0], norm=norm or "bn", seed=seed, **kw)


def parse_shape(text: str) -> tuple:
    """``"3x32x32"`` → (3, 32, 32); ``"784"`` → (784,) (the per-sample input shape of ``--input-shape``)."""
    parts = str(text).strip().lower().split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"input_shape={text!r} is not allowed: expected sizes joined by 'x', e.g. 3x32x32 or 784") from None
    return _check_shape(shape, text)


def _check_shape(shape: tuple, given) -> tuple:
    """``shape`` if it has 1 to 4 positive sizes and at most 5e7 values, else ``ValueError`` showing ``given``."""
    if not shape or any(s < 1 for s in shape) or len(shape) > 4 or math.prod(shape) > 50_000_000:
        raise ValueError(f"input_shape={given!r} is not allowed: expected 1 to 4 positive sizes (at most 5e7 values)")
    return shape


def batch_for(*, dataset: str | None = None, input_shape=None, num_classes: int = 10, batch_size: int = 64,
              seed: int = 0, max_memory_gb: float = 8.0):
    """(data for :func:`bnlab.advise`, per-sample input shape, number of classes) from a dataset name, or random
    standard normal inputs of ``input_shape`` with random labels in [0, num_classes) (seeded).  Random inputs
    larger than a quarter of ``max_memory_gb`` are refused before they are drawn."""
    import torch

    batch_size = check_int("batch_size", batch_size, minimum=1, maximum=1_000_000)
    max_memory_gb = check_real("max_memory_gb", max_memory_gb, minimum=0.0, strict_minimum=True)
    if (dataset is None) == (input_shape is None):
        raise ValueError("give exactly one of dataset= (a name, e.g. 'mnist') and input_shape= (random inputs)")
    if dataset is not None:
        from bnlab.data import load_dataset

        ds = load_dataset(dataset, "train")
        return dataset, tuple(ds.image_shape), int(ds.num_classes)
    if isinstance(input_shape, str):
        shape = parse_shape(input_shape)
    else:
        try:  # a tuple of sizes: the same rules as the text form (integers: 3.0 is 3, 3.5 and True are refused)
            shape = tuple(check_int("input_shape", s) for s in input_shape)
        except (TypeError, ValueError):
            raise ValueError(f"input_shape={input_shape!r} is not allowed: expected sizes such as (3, 32, 32) or "
                             "'3x32x32'") from None
        shape = _check_shape(shape, input_shape)
    num_classes = check_int("num_classes", num_classes, minimum=2, maximum=100_000)
    need = 4.0 * batch_size * math.prod(shape)
    if need > max_memory_gb * 1e9 / 4:
        raise ValueError(f"batch_size={batch_size} with input_shape={'x'.join(map(str, shape))} is not allowed: the "
                         f"inputs alone take {need / 1e9:.2f} GB (more than a quarter of max_memory_gb={max_memory_gb:g})")
    gen = torch.Generator().manual_seed(check_int("seed", seed, minimum=0))
    x = torch.randn((batch_size,) + shape, generator=gen)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen)
    return (x, y), shape, num_classes
