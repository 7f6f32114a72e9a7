"""Architectures for the Fisher-information theory: FC and conv layers, and their spec strings.

An architecture is an input shape followed by layers; the last layer is the linear
(fully-connected) output layer, every other layer is followed by the nonlinearity
(and by batch normalization when ``norm="bn"``), as in the Fisher paper's experiments
(Fisher paper §4: "Batch normalization is applied after each linear operation except
for the final linear output layer").

Spec-string grammar (case-insensitive, no spaces)::

    fc:N0-N1-...-NL                       fully connected; N0 = input dimension, NL = outputs
    conv:CxHxW-LAYER-LAYER-...-fcNL       convolutional input C channels, H x W pixels
        LAYER = c<C>k<K>[s<S>][p<P>]      conv: C output channels, K x K kernel, stride S (1),
                                          zero padding P (0)
              | fc<N>                     fully connected on the flattened feature map

e.g. ``"fc:784-1000-1000-1000-10"`` (the paper's FC net) and
``"conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10"`` (the paper's conv net on MNIST).
The last layer must be ``fc``; conv layers must come before fc layers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from bnlab._validation import check_int

__all__ = ["FCLayer", "ConvLayer", "Architecture", "parse_arch", "MAX_LAYERS", "MAX_SIDE", "MAX_UNITS"]

#: Most layers an architecture may have (the theory's recursions cost ~ms per layer).
MAX_LAYERS = 2000
#: Largest spatial side, kernel, stride or padding of a conv layer (the geometry costs O(side) per layer).
MAX_SIDE = 2**20
#: Largest width, channel count or input size (the theory needs only their values; a network of such
#: widths is refused by the memory bound of :func:`bnlab.fisher.build_model`).
MAX_UNITS = 10**12
#: Longest spec string parsed.
_MAX_SPEC_CHARS = 100_000


@dataclass(frozen=True)
class FCLayer:
    """A fully connected layer with ``width`` output units."""

    width: int

    def __post_init__(self):
        check_int("width", self.width, minimum=1, maximum=MAX_UNITS)


@dataclass(frozen=True)
class ConvLayer:
    """A 2-d convolution: ``channels`` outputs, square ``kernel``, ``stride``, zero ``padding``."""

    channels: int
    kernel: int
    stride: int = 1
    padding: int = 0

    def __post_init__(self):
        check_int("channels", self.channels, minimum=1, maximum=MAX_UNITS)
        check_int("kernel", self.kernel, minimum=1, maximum=MAX_SIDE)
        check_int("stride", self.stride, minimum=1, maximum=MAX_SIDE)
        check_int("padding", self.padding, minimum=0, maximum=MAX_SIDE)


Layer = Union[FCLayer, ConvLayer]


@dataclass(frozen=True)
class Architecture:
    """Input shape (``(N0,)`` or ``(C, H, W)``) and layers; the last layer is the linear output.

    ``geometry()`` gives, per layer, the input and output spatial sizes.
    """

    input_shape: tuple
    layers: tuple

    def __post_init__(self):
        shape = tuple(self.input_shape)
        if len(shape) not in (1, 3):
            raise ValueError(f"input_shape={shape!r} is not allowed: expected (N0,) or (C, H, W)")
        for i, n in enumerate(shape):
            check_int(f"input_shape[{i}]", n, minimum=1, maximum=MAX_UNITS if (i == 0) else MAX_SIDE)
        object.__setattr__(self, "input_shape", tuple(int(n) for n in shape))
        layers = tuple(self.layers)
        if not layers:
            raise ValueError("layers=() is not allowed: expected at least the output layer")
        if len(layers) > MAX_LAYERS:
            raise ValueError(f"layers has {len(layers)} entries: not allowed, at most {MAX_LAYERS}")
        for i, layer in enumerate(layers):
            if not isinstance(layer, (FCLayer, ConvLayer)):
                raise ValueError(f"layers[{i}]={layer!r} is not allowed: expected FCLayer or ConvLayer")
        if not isinstance(layers[-1], FCLayer):
            raise ValueError("layers[-1] is not allowed to be a conv layer: the output layer must be FCLayer")
        seen_fc = False
        for i, layer in enumerate(layers):
            if isinstance(layer, FCLayer):
                seen_fc = True
            elif seen_fc:
                raise ValueError(f"layers[{i}] is a conv layer after an fc layer: not allowed")
            elif len(shape) != 3:
                raise ValueError(f"layers[{i}] is a conv layer but input_shape={shape!r} has no (C, H, W)")
        object.__setattr__(self, "layers", layers)
        self.geometry()  # validates the sizes

    @property
    def depth(self) -> int:
        return len(self.layers)

    def geometry(self) -> list[dict]:
        """Per layer: ``fan_in`` (N_{l-1} of the paper: C_{l-1}|F_l| for conv), ``in_size``/``out_size``
        (spatial side lengths; 1 for fc), ``positions`` (|K_l|, output positions), ``in_units``
        (number of inputs h^{l-1}), ``out_units`` and, for conv, the 1-d valid-tap counts
        ``taps_per_position`` (per output coordinate, number of kernel taps that land inside the
        unpadded input) and ``positions_per_tap`` (per kernel coordinate, number of output
        coordinates whose tap lands inside the input)."""
        out = []
        if len(self.input_shape) == 1:
            channels, size = self.input_shape[0], 1
        else:
            channels, size = self.input_shape[0], self.input_shape[1]
            if self.input_shape[1] != self.input_shape[2]:
                raise ValueError(
                    f"input_shape={self.input_shape!r} is not allowed: only square inputs (H == W) are supported"
                )
        for i, layer in enumerate(self.layers):
            if isinstance(layer, ConvLayer):
                padded = size + 2 * layer.padding
                if layer.kernel > padded:
                    raise ValueError(
                        f"layer {i + 1} (conv k{layer.kernel}s{layer.stride}p{layer.padding}) is not allowed: "
                        f"kernel {layer.kernel} is larger than its padded input {padded}"
                    )
                if layer.stride > padded:
                    raise ValueError(
                        f"layer {i + 1} (conv k{layer.kernel}s{layer.stride}p{layer.padding}) is not allowed: "
                        f"stride {layer.stride} is larger than its padded input {padded}"
                    )
                out_size = (padded - layer.kernel) // layer.stride + 1
                # closed forms, O(out_size + kernel) array work (a Python double loop hung on large inputs)
                k, s, p = layer.kernel, layer.stride, layer.padding
                start = np.arange(out_size, dtype=np.int64) * s - p  # first tap of each output coordinate
                # per output coordinate: taps a in [0, k) with 0 <= start + a < size
                taps = np.maximum(0, np.minimum(k, size - start) - np.maximum(0, -start))
                # per kernel coordinate a: outputs o in [0, out) with 0 <= o*s - p + a < size
                a = np.arange(k, dtype=np.int64)
                lo = np.maximum(0, -((a - p) // s))  # ceil((p - a) / s)
                hi = np.minimum(out_size - 1, (size - 1 + p - a) // s)
                per_tap = np.maximum(0, hi - lo + 1)
                out.append(
                    dict(
                        kind="conv",
                        fan_in=channels * layer.kernel**2,
                        in_channels=channels,
                        in_size=size,
                        out_size=out_size,
                        kernel=layer.kernel,
                        positions=out_size**2,
                        in_units=channels * size**2,
                        out_units=layer.channels * out_size**2,
                        channels=layer.channels,
                        taps_per_position=taps,
                        positions_per_tap=per_tap,
                    )
                )
                channels, size = layer.channels, out_size
            else:
                n_in = channels * size * size
                out.append(
                    dict(
                        kind="fc",
                        fan_in=n_in,
                        in_channels=n_in,
                        in_size=1,
                        out_size=1,
                        kernel=1,
                        positions=1,
                        in_units=n_in,
                        out_units=layer.width,
                        channels=layer.width,
                        taps_per_position=[1],
                        positions_per_tap=[1],
                    )
                )
                channels, size = layer.width, 1
        return out

    def to_spec(self) -> str:
        if len(self.input_shape) == 1 and all(isinstance(x, FCLayer) for x in self.layers):
            return "fc:" + "-".join(str(n) for n in (self.input_shape[0], *(x.width for x in self.layers)))
        parts = ["x".join(str(n) for n in self.input_shape)]
        for layer in self.layers:
            if isinstance(layer, FCLayer):
                parts.append(f"fc{layer.width}")
            else:
                parts.append(f"c{layer.channels}k{layer.kernel}s{layer.stride}p{layer.padding}")
        return "conv:" + "-".join(parts)


_CONV_RE = re.compile(r"^c(\d+)k(\d+)(?:s(\d+))?(?:p(\d+))?$")
_FC_RE = re.compile(r"^fc(\d+)$")


def parse_arch(spec: "str | Architecture") -> Architecture:
    """Parse an architecture spec string (grammar in the module docstring) into an :class:`Architecture`.

    Raises ``ValueError`` naming the spec and the offending token.
    """
    if isinstance(spec, Architecture):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"arch={spec!r} is not allowed: expected a spec string such as 'fc:784-1000-10'")
    if len(spec) > _MAX_SPEC_CHARS:
        raise ValueError(f"arch is not allowed: the spec has {len(spec)} characters (at most {_MAX_SPEC_CHARS})")
    text = spec.strip().lower()
    kind, sep, body = text.partition(":")
    if not sep or kind not in ("fc", "conv") or not body:
        raise ValueError(
            f"arch={spec!r} is not allowed: expected 'fc:N0-N1-...-NL' or "
            "'conv:CxHxW-c<C>k<K>[s<S>][p<P>]-...-fc<N>'"
        )
    tokens = body.split("-")
    if len(tokens) > MAX_LAYERS + 1:
        raise ValueError(f"arch={spec[:60]!r}... is not allowed: {len(tokens) - 1} layers (at most {MAX_LAYERS})")
    longest = max(re.findall(r"\d+", body), key=len, default="")
    if len(longest) > 13:
        raise ValueError(f"arch is not allowed: the number {longest[:20]}... has {len(longest)} digits (at most 13)")
    try:
        return _parse_tokens(spec, kind, tokens)
    except ValueError as exc:
        if str(exc).startswith("arch"):
            raise
        raise ValueError(f"arch={spec if len(spec) < 80 else spec[:60] + '...'!r} is not allowed: {exc}") from None


def _parse_tokens(spec: str, kind: str, tokens: list) -> Architecture:
    if kind == "fc":
        if len(tokens) < 2 or not all(t.isdigit() for t in tokens):
            raise ValueError(f"arch={spec!r} is not allowed: 'fc:' needs at least two positive integers joined by '-'")
        widths = [int(t) for t in tokens]
        if min(widths) < 1:
            raise ValueError(f"arch={spec!r} is not allowed: widths must be >= 1")
        return Architecture((widths[0],), tuple(FCLayer(w) for w in widths[1:]))
    dims = tokens[0].split("x")
    if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"arch={spec!r} is not allowed: the conv input {tokens[0]!r} must be CxHxW (positive)")
    layers: list = []
    for tok in tokens[1:]:
        m = _CONV_RE.match(tok)
        if m:
            c, k, s, p = m.groups()
            if int(c) < 1 or int(k) < 1 or (s is not None and int(s) < 1):
                raise ValueError(f"arch={spec!r} is not allowed: layer {tok!r} needs channels, kernel, stride >= 1")
            layers.append(ConvLayer(int(c), int(k), int(s or 1), int(p or 0)))
            continue
        m = _FC_RE.match(tok)
        if m and int(m.group(1)) >= 1:
            layers.append(FCLayer(int(m.group(1))))
            continue
        raise ValueError(
            f"arch={spec!r} is not allowed: cannot parse layer {tok!r} (expected c<C>k<K>[s<S>][p<P>] or fc<N>)"
        )
    if not layers:
        raise ValueError(f"arch={spec!r} is not allowed: no layers after the input shape")
    return Architecture(tuple(int(d) for d in dims), tuple(layers))


def _as_arch(arch: "str | Architecture | Sequence") -> Architecture:
    if isinstance(arch, (str, Architecture)):
        return parse_arch(arch)
    raise ValueError(f"arch={arch!r} is not allowed: expected an Architecture or a spec string")
