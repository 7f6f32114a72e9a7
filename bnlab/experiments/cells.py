"""Typed cells: a reproduction declares its cell parameters once, and ``run_cell`` receives them parsed.

A cell is stored as a JSON dict (its key, :func:`bnlab.experiments.store.cell_key`, is the hash of that
dict, so stores written before a reproduction declared its cells resume unchanged).  A reproduction that
declares a cell kind — a frozen dataclass subclassing :class:`Cell` — names it in
:attr:`bnlab.experiments.spec.Experiment.cell`; the engine parses each dict once, where it hands the cell
to ``run_cell`` / ``run_group`` (:func:`bnlab.experiments._worker.execute_cell`), and the function gets the
typed object.  An unknown key, a missing key, a value of the wrong type or out of range is refused there
with a ``ValueError`` that names the experiment, the key, the value and what is allowed (validation up
front, as ``torch.optim`` checks its hyper-parameters in the constructor), and the cell is recorded
``failed`` with that message.

Declaring a kind::

    @dataclass(frozen=True, kw_only=True)
    class MyCell(Cell):
        width: int = cell_param(minimum=1)
        optimizer: Literal["sgd", "adam"] = "sgd"
        lr: float = cell_param(minimum=0.0, strict_minimum=True)
        steps: int | None = cell_param(None, minimum=1)
        seed: int = cell_param(minimum=0)

        def check(self) -> None:  # relations between fields (optional)
            ...

Field types: ``int``, ``float``, ``str``, ``bool``, ``Literal[...]`` (the allowed values),
``tuple[int, ...]`` / ``tuple[float, ...]`` (a JSON list), ``float | Literal["inf"]`` (a number or named
values, as JSON cannot hold ∞), and ``X | None`` (null allowed); ``cell_param(choices=NAMES)`` restricts a
``str`` to a library's names.  A field without a default is required (its key must be present), one with
a default may be absent.  ``cell.params`` is the dict the cell was parsed from: the stored dict, plus the
``device`` the engine adds for a GPU experiment.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from typing import Any, Literal, Mapping, Sequence

__all__ = ["Cell", "cell_param", "parse_cell"]

_MISSING = dataclasses.MISSING


def cell_param(default: Any = _MISSING, *, minimum: float | None = None, maximum: float | None = None,
               strict_minimum: bool = False, choices: Sequence[str] | None = None) -> Any:
    """A cell field with bounds (inclusive; ``strict_minimum`` makes the lower one exclusive), or, for a
    ``str`` field, the values it may take (``choices``: a library's tuple of names, where ``Literal[...]``
    would copy it).

    Without ``default`` the parameter is required.  Bounds apply to a number and to every entry of a tuple.
    """
    meta = {"minimum": minimum, "maximum": maximum, "strict_minimum": strict_minimum,
            "choices": None if choices is None else tuple(choices)}
    if default is _MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    kind: str  # "int", "float", "str", "bool", "choice", "tuple[int]", "tuple[float]"
    optional: bool  # None allowed (the key may be absent)
    required: bool
    choices: tuple = ()  # kind "choice": the values; a number: named values it may also take ("inf")
    minimum: float | None = None
    maximum: float | None = None
    strict_minimum: bool = False

    def allowed(self) -> str:
        if self.kind == "choice":
            what = "one of " + ", ".join(map(repr, self.choices))
        else:
            what = {"int": "an integer", "float": "a finite real number", "str": "a string", "bool": "true or false",
                    "tuple[int]": "a list of integers", "tuple[float]": "a list of finite real numbers"}[self.kind]
        bounds = []
        if self.minimum is not None:
            bounds.append(f"{'>' if self.strict_minimum else '>='} {self.minimum:g}")
        if self.maximum is not None:
            bounds.append(f"<= {self.maximum:g}")
        if bounds:
            what += (" (each " if self.kind.startswith("tuple") else " ") + " and ".join(bounds) + \
                    (")" if self.kind.startswith("tuple") else "")
        if self.choices and self.kind != "choice":
            what += " or " + " or ".join(map(repr, self.choices))
        return what


def _kind_of(cls: type, name: str, hint: Any) -> tuple[str, bool, tuple]:
    """``(kind, optional, choices)`` of a field's annotation; TypeError for an annotation cells cannot hold."""
    optional = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        literals = [a for a in args if typing.get_origin(a) is Literal]
        rest = [a for a in args if a is not type(None) and typing.get_origin(a) is not Literal]
        if len(rest) == 1 and len(literals) == 1 and rest[0] in (int, float):
            return rest[0].__name__, optional, tuple(typing.get_args(literals[0]))  # a number or named values
        if len(rest) + len(literals) != 1:
            raise TypeError(f"{cls.__name__}.{name}: a cell field is one type, 'X | None', or 'float | "
                            f"Literal[...]' (a number or named values), not {hint!r}")
        hint = (rest or literals)[0]
        origin = typing.get_origin(hint)
    if origin is Literal:
        return "choice", optional, tuple(typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis and args[0] in (int, float):
            return f"tuple[{args[0].__name__}]", optional, ()
    if hint in (int, float, str, bool):
        return hint.__name__, optional, ()
    raise TypeError(f"{cls.__name__}.{name}: cell fields are int, float, str, bool, Literal[...], "
                    f"tuple[int, ...], tuple[float, ...] or 'X | None', not {hint!r}")


@functools.lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, optional, choices = _kind_of(cls, f.name, hints[f.name])
        if f.metadata.get("choices") is not None:
            if kind != "str":
                raise TypeError(f"{cls.__name__}.{f.name}: choices= applies to a str field, not {kind}")
            kind, choices = "choice", f.metadata["choices"]
        required = f.default is _MISSING and f.default_factory is _MISSING
        out.append(_Field(f.name, kind, optional, required, choices, f.metadata.get("minimum"),
                          f.metadata.get("maximum"), bool(f.metadata.get("strict_minimum", False))))
    return tuple(out)


def _number(field: _Field, value: Any, integer: bool) -> int | float | None:
    """``value`` as the field's number, or None when it is not one (bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if integer:
        return int(value) if isinstance(value, numbers.Integral) else None
    value = float(value)
    return value if math.isfinite(value) else None


def _in_bounds(field: _Field, x: float) -> bool:
    if field.minimum is not None and (x <= field.minimum if field.strict_minimum else x < field.minimum):
        return False
    return field.maximum is None or x <= field.maximum


def _convert(field: _Field, value: Any) -> Any:
    """The typed value of ``value`` for ``field``; ``_MISSING`` when it is not allowed."""
    if value is None:
        return None if field.optional else _MISSING
    kind = field.kind
    if kind == "choice":
        return value if any(value == c and type(value) is type(c) for c in field.choices) else _MISSING
    if kind == "str":
        return value if isinstance(value, str) else _MISSING
    if kind == "bool":
        return value if isinstance(value, bool) else _MISSING
    if kind in ("int", "float"):
        if isinstance(value, str) and value in field.choices:
            return value
        x = _number(field, value, kind == "int")
        return x if x is not None and _in_bounds(field, x) else _MISSING
    # tuple[int] / tuple[float]: a JSON list (a tuple from Python code is accepted too)
    if not isinstance(value, (list, tuple)):
        return _MISSING
    items = [_number(field, v, kind == "tuple[int]") for v in value]
    if any(x is None or not _in_bounds(field, x) for x in items):
        return _MISSING
    return tuple(items)


def _where(cls: type, experiment: str) -> str:
    return f"experiment {experiment!r}: " if experiment else f"{cls.__name__}: "


def parse_cell(cls: type["Cell"], params: Any, *, experiment: str = "") -> "Cell":
    """``params`` (a cell's JSON dict) as a ``cls``; a ``cls`` instance is returned unchanged.

    Raises ``ValueError`` naming ``experiment`` (when given), the key, the value and what is allowed, for
    a key ``cls`` does not declare, a required key that is absent, a value of the wrong type or out of
    bounds, and a combination :meth:`Cell.check` refuses.
    """
    if isinstance(params, cls):
        return params
    where = _where(cls, experiment)
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}a cell must be a dict of parameters, got {type(params).__name__}: {params!r}")
    schema = _schema(cls)
    names = {f.name for f in schema}
    unknown = sorted(str(k) for k in params if k not in names)
    if unknown:
        k = unknown[0]
        raise ValueError(f"{where}cell parameter {k!r}={params[k]!r} is not allowed: {cls.__name__} declares "
                         f"only {', '.join(sorted(names))}")
    missing = [f.name for f in schema if f.required and f.name not in params]
    if missing:
        raise ValueError(f"{where}cell parameter {missing[0]!r} is missing (required: "
                         f"{', '.join(f.name for f in schema if f.required)}; got {', '.join(sorted(params))})")
    values = {}
    for f in schema:
        if f.name not in params:
            continue
        value = _convert(f, params[f.name])
        if value is _MISSING:
            allowed = f.allowed() + (" or null" if f.optional else "")
            raise ValueError(f"{where}cell parameter {f.name!r}={params[f.name]!r} is not allowed: expected {allowed}")
        values[f.name] = value
    try:
        cell = cls(**values)
        cell.check()
    except ValueError as exc:
        raise ValueError(f"{where}{exc}") from None
    object.__setattr__(cell, "_params", dict(params))
    return cell


@dataclasses.dataclass(frozen=True)
class Cell:
    """Base of a declared cell kind (see the module docstring): subclass it as a frozen dataclass.

    Build one from a stored dict with :meth:`parse`; :attr:`params` gives that dict back, unchanged.
    """

    @classmethod
    def parse(cls, params: Any, *, experiment: str = "") -> "Cell":
        """:func:`parse_cell` for this kind (an instance of it is returned unchanged)."""
        return parse_cell(cls, params, experiment=experiment)

    def check(self) -> None:
        """Refuse combinations of fields (``ValueError`` naming the keys); called after the fields are parsed."""

    @property
    def params(self) -> dict:
        """The cell as its JSON dict: the dict it was parsed from, or (built in code) its fields that are set."""
        given = self.__dict__.get("_params")
        if given is not None:
            return dict(given)
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out
