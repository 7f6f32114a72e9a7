"""One instrumented forward pass of a (copied) module: what ran, in which order, on what.

:class:`Probe` is a ``TorchFunctionMode`` plus a forward pre-hook on every submodule.  During one
forward pass it records, in execution order:

* **weight ops** — ``F.linear``, ``F.conv1d/2d/3d`` and matrix products (``@``, ``matmul``, ``mm``,
  ``addmm``) with a parameter (or a view of one, e.g. ``w.T``) as an operand; named by the parameter's
  owner (``"blocks.0.0"`` for ``blocks.0.0.weight``, ``"weights.3"`` for a ``ParameterList`` entry);
* **normalizations** — ``nn.BatchNorm*``/``F.batch_norm`` (with the mode it ran in), layer, group and
  instance norm, and bnlab's own batch-statistics layers (BN without mean, ghost BN, Batch Renorm);
* **activations** — activation modules (``nn.ReLU`` …, bnlab's ``ActivationModule``) and functional
  calls (``torch.relu``, ``F.gelu`` …) outside them, resolved to a :class:`bnlab.activations.Activation`
  where bnlab knows the function;
* **pooling** (``F.*pool*``, and a ``mean`` over all the positions of a tensor (N, C, …) once a conv layer
  has run: global average pooling written as ``x.mean((2, 3))``) and **residual additions** (the sum of two
  activations of the same shape).

Every record keeps the identities of its input and output tensors, so the caller can follow the data:
which normalization consumes a weight op's output directly (its weights are then scale-invariant), and
whether φ comes before or after it.  Optional: the weight ops' inputs (the representations the rank part
measures) and a gradient hook on each weight op's output (the pre-activation gradients ‖∂L/∂h^l‖² of
the gradient part).  Nothing here computes a paper's quantity; it only observes the forward pass.

A forward pass that raises is reported with the innermost module that was running (``failed_in``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

_LINEAR_FUNCS = {F.linear}
_CONV_FUNCS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_MATMUL_FUNCS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm,
                 torch.Tensor.mm, torch.addmm, torch.Tensor.addmm}
_NORM_FUNCS = {F.batch_norm: "batchnorm", F.layer_norm: "layernorm", F.group_norm: "groupnorm",
               F.instance_norm: "instancenorm"}
_POOL_FUNCS = {F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
               F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
               F.adaptive_max_pool2d, F.adaptive_max_pool3d}
#: means over the spatial dimensions of a conv feature map: global average pooling written as ``x.mean((2, 3))``
_MEAN_FUNCS = {torch.mean, torch.Tensor.mean}
_ADD_FUNCS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add_,
              torch.Tensor.__iadd__}
_VIEW_NAMES = ("__get__", "t", "transpose", "permute", "reshape", "view", "contiguous", "flatten", "squeeze",
               "unsqueeze", "expand", "view_as", "reshape_as")
_DROPOUT_FUNCS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout}

# functional activations bnlab can name (for the theory): function -> (registry name, parameter getter)
_ACT_FUNCS: dict[Any, tuple[str, Any]] = {
    torch.relu: ("relu", None), F.relu: ("relu", None), torch.Tensor.relu: ("relu", None),
    torch.relu_: ("relu", None), torch.Tensor.relu_: ("relu", None), F.relu_: ("relu", None),
    torch.tanh: ("tanh", None), F.tanh: ("tanh", None), torch.Tensor.tanh: ("tanh", None),
    torch.sigmoid: ("sigmoid", None), F.sigmoid: ("sigmoid", None), torch.Tensor.sigmoid: ("sigmoid", None),
    F.gelu: ("gelu", lambda a, k: None if k.get("approximate", "none") != "none" else {}),
    F.silu: ("silu", None), F.selu: ("selu", None), torch.selu: ("selu", None),
    F.elu: ("elu", lambda a, k: {"alpha": float(k.get("alpha", a[1] if len(a) > 1 else 1.0))}),
    F.leaky_relu: ("leaky_relu", lambda a, k: {"slope": float(k.get("negative_slope", a[1] if len(a) > 1 else 0.01))}),
    F.softplus: ("softplus", lambda a, k: {} if float(k.get("beta", a[1] if len(a) > 1 else 1.0)) == 1.0 else None),
    torch.erf: ("erf", None), torch.sin: ("sin", None),
}
_OTHER_ACT_FUNCS = {F.hardtanh, F.relu6, F.hardswish, F.hardsigmoid, F.mish, F.softsign, F.tanhshrink, F.logsigmoid,
                    F.celu, F.rrelu, F.glu, F.prelu}

# activation modules -> (registry name, parameter getter)
_ACT_MODULES: dict[type, tuple[str, Any]] = {
    nn.ReLU: ("relu", None), nn.Tanh: ("tanh", None), nn.Sigmoid: ("sigmoid", None),
    nn.GELU: ("gelu", lambda m: {} if m.approximate == "none" else None), nn.SiLU: ("silu", None),
    nn.SELU: ("selu", None), nn.ELU: ("elu", lambda m: {"alpha": float(m.alpha)}),
    nn.LeakyReLU: ("leaky_relu", lambda m: {"slope": float(m.negative_slope)}),
    nn.Softplus: ("softplus", lambda m: {} if float(m.beta) == 1.0 else None),
}
_OTHER_ACT_MODULES = (nn.Hardtanh, nn.ReLU6, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Softsign, nn.Tanhshrink,
                      nn.LogSigmoid, nn.CELU, nn.RReLU, nn.GLU, nn.PReLU, nn.Threshold, nn.Softmax, nn.LogSoftmax)


def _bnlab_norm_kind(module: nn.Module) -> str | None:
    """The kind of bnlab's own batch-statistics layers (module-level: they do not call F.batch_norm)."""
    from bnlab.nets import (BatchNormNoMean1d, BatchNormNoMean2d, BatchRenorm1d, BatchRenorm2d, GhostBatchNorm1d,
                            GhostBatchNorm2d)

    if isinstance(module, (BatchNormNoMean1d, BatchNormNoMean2d)):
        return "batchnorm_no_mean"
    if isinstance(module, (GhostBatchNorm1d, GhostBatchNorm2d)):
        return "ghost_batchnorm"
    if isinstance(module, (BatchRenorm1d, BatchRenorm2d)):
        return "batch_renorm"
    return None


def _torch_norm_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batchnorm"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if isinstance(module, nn.GroupNorm):
        return "groupnorm"
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return "instancenorm"
    return None


#: Normalizations whose statistics are taken over the batch (in train mode).
BATCH_NORMS = ("batchnorm", "batchnorm_no_mean", "ghost_batchnorm", "batch_renorm")


def module_activation(module: nn.Module):
    """(label, Activation or None) of an activation module, or None if ``module`` is not one."""
    from bnlab.activations import Activation, get_activation

    for klass, (name, getter) in _ACT_MODULES.items():
        if type(module) is klass:
            params = {} if getter is None else getter(module)
            if params is None:
                return type(module).__name__, None
            return name, get_activation(name, **params)
    act = getattr(module, "activation", None)
    if isinstance(act, Activation) and not list(module.parameters()):  # bnlab.nets.ActivationModule and alike
        return act.spec, act
    if isinstance(getattr(module, "spec", None), str) and not list(module.children()) and not list(module.parameters()):
        try:  # the Fisher paper's φ modules carry the spec they were built from
            a = get_activation(module.spec)
            return a.spec, a
        except ValueError:
            return module.spec, None
    if isinstance(module, _OTHER_ACT_MODULES):
        return type(module).__name__, None
    return None


def _unknown_elementwise_candidate(module: nn.Module) -> bool:
    """A module of the user's own (not torch's, not bnlab's) without submodules or parameters: it may be an
    activation bnlab does not know (``x * torch.sigmoid(1.7 * x)``).  The probe records it as an unknown φ when
    its output has its input's shape — never as linear, so no linearity assumption is granted for it."""
    if list(module.children()) or list(module.parameters(recurse=False)):
        return False
    origin = type(module).__module__ or ""
    return not origin.startswith(("torch.", "bnlab."))


@dataclass
class Event:
    """One recorded operation of the forward pass."""

    kind: str  # "weight", "norm", "activation", "pool", "residual", "dropout"
    order: int
    name: str  # weight: the parameter owner; norm/activation: the module name or the function
    inputs: tuple = ()  # ids of the tensor operands (activations, not parameters)
    output: int | None = None  # id of the output tensor
    info: dict = field(default_factory=dict)


class Probe(TorchFunctionMode):
    """Record one forward pass of ``model`` (see the module docstring).

    ``capture_inputs``: keep each weight op's activation operand (detached).  ``grad_hooks``: register a
    hook on each weight op's output that stores Σ (∂L/∂h)² (float64) when ``backward()`` runs.
    ``check_finite``: note, per event, whether its output is finite (for the first non-finite layer).
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, *, capture_inputs: bool = False, grad_hooks: bool = False,
                 check_finite: bool = False):
        super().__init__()
        self.model = model
        self.capture_inputs = capture_inputs
        self.grad_hooks = grad_hooks
        self.check_finite = check_finite
        # a parameter shared by several modules (one Linear called twice) is named by its first owner, the name
        # model.named_parameters() and named_modules() keep: every lookup by that name then finds it
        self.param_name: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.param_name.setdefault(id(p), n)
        self.params = {id(p): p for p in model.parameters()}
        self.views: dict[int, tuple[str, torch.Tensor]] = {}  # id(view) -> (parameter name, the view: kept alive)
        self.alias: dict[int, int] = {}  # id(view of an activation) -> id of the tensor it views
        self.data_ids = {id(x)}
        self._alive: list = [x]  # tensors whose ids are recorded stay alive for the pass (ids stay unique)
        self.events: list[Event] = []
        self.stack: list[tuple[str, nn.Module]] = []
        self.inputs: dict[str, torch.Tensor] = {}
        self.grad_sq: dict[str, torch.Tensor] = {}
        self.weight_calls: dict[str, int] = {}
        self.first_nonfinite: str | None = None
        self.activation_bytes = 0  # bytes of the recorded outputs (weight ops, norms, activations, ...)
        self._handles = []
        self._roles: dict[int, str] = {}
        for name, module in model.named_modules():
            role = "other"
            if _torch_norm_kind(module) or _bnlab_norm_kind(module):
                role = "norm"
            elif module_activation(module) is not None:
                role = "activation"
            elif _unknown_elementwise_candidate(module):
                role = "unknown"
            self._roles[id(module)] = role
            self._handles.append(module.register_forward_pre_hook(self._make_pre(name, module)))
            self._handles.append(module.register_forward_hook(self._make_post(name, module)))

    # -- module hooks --------------------------------------------------------------------------------
    def _make_pre(self, name, module):
        def pre(mod, args):
            self.stack.append((name, module))
            role = self._roles[id(module)]
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if role == "norm" and not self._inside_leaf_role(skip_top=True):
                kind = _torch_norm_kind(module) or _bnlab_norm_kind(module)
                batch_stats = kind in BATCH_NORMS and (module.training or getattr(module, "running_mean", 0) is None)
                info = dict(norm=kind, batch_statistics=bool(batch_stats), training=bool(module.training),
                            eps=float(getattr(module, "eps", float("nan"))), module_type=type(module).__name__,
                            input_shape=tuple(first.shape) if first is not None else None)
                w, b = getattr(module, "weight", None), getattr(module, "bias", None)
                if isinstance(w, torch.Tensor):
                    info["gamma"] = w.detach().double().cpu()
                if isinstance(b, torch.Tensor):
                    info["beta"] = b.detach().double().cpu()
                self._push("norm", name, [first], None, info)
            elif role == "activation" and not self._inside_leaf_role(skip_top=True):
                label, act = module_activation(module)
                self._push("activation", name, [first], None, dict(label=label, activation=act))
            elif role == "unknown" and not self._inside_leaf_role(skip_top=True) and first is not None:
                # the user's own parameter-free module (x * sigmoid(1.7 x), a custom reshape ...): recorded as one
                # step; the post hook decides what it was from the shapes
                self._push("activation", name, [first], None,
                           dict(label=type(module).__name__, activation=None, unknown=True,
                                input_shape=tuple(first.shape)))
        return pre

    def _make_post(self, name, module):
        def post(mod, args, output):
            if self.stack and self.stack[-1][1] is module:
                self.stack.pop()
            role = self._roles[id(module)]
            if role == "unknown":
                ev = next((e for e in reversed(self.events) if e.name == name and e.info.get("unknown")
                           and e.output is None), None)
                if ev is None:
                    return
                if not isinstance(output, torch.Tensor) or tuple(output.shape) != ev.info["input_shape"]:
                    # not elementwise (a reshape, a reduction, several outputs): not a φ; the data flows on
                    # under the output's identity
                    self.events.remove(ev)
                    for i, e in enumerate(self.events):
                        e.order = i
                    if isinstance(output, torch.Tensor) and ev.inputs:
                        self.alias[id(output)] = ev.inputs[0]
                        self._keep(output)
                    return
            if role in ("norm", "activation", "unknown") and isinstance(output, torch.Tensor):
                # the module-level record takes the module's output
                for ev in reversed(self.events):
                    if ev.name == name and ev.kind in ("norm", "activation") and ev.output is None:
                        ev.output = id(output)
                        self._keep(output)
                        self.activation_bytes += bytes_of(output)
                        self._finite(ev, output)
                        break
        return post

    def _inside_leaf_role(self, skip_top: bool = False) -> bool:
        """Whether a norm or activation module is running (its internals are not recorded again)."""
        frames = self.stack[:-1] if skip_top else self.stack
        return any(self._roles[id(m)] in ("norm", "activation", "unknown") for _, m in frames)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def failed_in(self) -> tuple[str, str] | None:
        """(module name, type) of the innermost module running when the forward pass raised."""
        if not self.stack:
            return None
        name, module = self.stack[-1]
        return (name or "(the model itself)", type(module).__name__)

    # -- bookkeeping -----------------------------------------------------------------------------------
    def _keep(self, t) -> None:
        self._alive.append(t)

    def _finite(self, ev: Event, out) -> None:
        if self.check_finite and isinstance(out, torch.Tensor) and out.is_floating_point():
            ok = bool(torch.isfinite(out).all())
            ev.info["finite"] = ok
            if not ok and self.first_nonfinite is None:
                self.first_nonfinite = ev.name

    def _push(self, kind, name, inputs, output, info) -> Event:
        ev = Event(kind, len(self.events), name,
                   tuple(self.alias.get(id(t), id(t)) for t in inputs if isinstance(t, torch.Tensor)),
                   None if output is None else id(output), info)
        for t in inputs:
            if isinstance(t, torch.Tensor):
                self._keep(t)
        if output is not None:
            self._keep(output)
            self.activation_bytes += bytes_of(output)
        self.events.append(ev)
        return ev

    def _param_of(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.param_name:
            return self.param_name[id(t)]
        if id(t) in self.views:
            return self.views[id(t)][0]
        return None

    # -- the mode ----------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._observe(func, args, kwargs, out)
        except Exception:  # pragma: no cover - observing must never break the user's forward pass
            pass
        return out

    def _observe(self, func, args, kwargs, out) -> None:
        if not args:
            return
        a0 = args[0]
        # views of parameters (w.T, w.t(), w.view(...)) and of the data keep their identity
        if (isinstance(out, torch.Tensor) and isinstance(a0, torch.Tensor) and out.numel() == a0.numel()
                and func not in _MATMUL_FUNCS and func not in _LINEAR_FUNCS and func not in _CONV_FUNCS):
            is_view = out.data_ptr() == a0.data_ptr() or getattr(func, "__name__", "") in _VIEW_NAMES
            pname = self._param_of(a0)
            if pname is not None and is_view:
                self.views[id(out)] = (pname, out)
                return
            if id(a0) in self.data_ids and (is_view or getattr(func, "__name__", "") in ("to", "float", "double")):
                self.data_ids.add(id(out))
                self._keep(out)
                return
            if is_view and id(out) != id(a0):
                # reshape/flatten/view of an activation: the same data under another identity
                self.alias[id(out)] = self.alias.get(id(a0), id(a0))
                self._keep(out)
        if self._inside_leaf_role():
            return  # inside a norm/activation module: recorded at the module level
        if func in _LINEAR_FUNCS or func in _CONV_FUNCS:
            x = a0
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            pname = self._param_of(w)
            if pname is None or not isinstance(out, torch.Tensor):
                return
            info = dict(kind="fc" if func in _LINEAR_FUNCS else "conv", weight_shape=tuple(w.shape),
                        param=pname)
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            info["bias_param"] = self._param_of(bias)
            if func in _CONV_FUNCS:
                def arg(i, key, default):
                    return args[i] if len(args) > i else kwargs.get(key, default)
                info.update(stride=arg(3, "stride", 1), padding=arg(4, "padding", 0), dilation=arg(5, "dilation", 1),
                            groups=arg(6, "groups", 1), spatial_dims=_CONV_FUNCS[func])
            self._weight_event(pname, x, out, info)
            return
        if func in _MATMUL_FUNCS:
            ops = [t for t in args if isinstance(t, torch.Tensor)]
            if func in (torch.addmm, torch.Tensor.addmm):
                ops = ops[1:3]
            if len(ops) != 2 or not isinstance(out, torch.Tensor):
                return
            p0, p1 = self._param_of(ops[0]), self._param_of(ops[1])
            if (p0 is None) == (p1 is None):
                return
            pname, w, x = (p1, ops[1], ops[0]) if p1 is not None else (p0, ops[0], ops[1])
            if x.ndim != 2:
                return
            info = dict(kind="fc", weight_shape=tuple(w.shape), param=pname, bias_param=None, matmul=True)
            self._weight_event(pname, x, out, info)
            return
        if func in _NORM_FUNCS:
            kind = _NORM_FUNCS[func]
            info = dict(norm=kind, module_type=getattr(func, "__name__", "function"),
                        input_shape=tuple(a0.shape) if isinstance(a0, torch.Tensor) else None)
            if func is F.batch_norm:
                training = args[5] if len(args) > 5 else kwargs.get("training", False)
                running = args[1] if len(args) > 1 else kwargs.get("running_mean")
                info.update(batch_statistics=bool(training or running is None), training=bool(training),
                            eps=float(args[7] if len(args) > 7 else kwargs.get("eps", 1e-5)))
            else:
                info.update(batch_statistics=False, training=True)
            ev = self._push("norm", getattr(func, "__name__", "norm"), [a0], out, info)
            self._finite(ev, out)
            return
        if func in _ACT_FUNCS or func in _OTHER_ACT_FUNCS:
            from bnlab.activations import get_activation

            act = None
            label = getattr(func, "__name__", "activation")
            if func in _ACT_FUNCS:
                name, getter = _ACT_FUNCS[func]
                params = {} if getter is None else getter(args, kwargs)
                if params is not None:
                    act = get_activation(name, **params)
                    label = act.spec
            ev = self._push("activation", label, [a0], out, dict(label=label, activation=act))
            self._finite(ev, out)
            return
        if func in _POOL_FUNCS:
            glob = isinstance(out, torch.Tensor) and out.ndim >= 2 and int(math.prod(out.shape[2:])) == 1
            self._push("pool", getattr(func, "__name__", "pool"), [a0], out, {"global": glob})
            return
        if func in _MEAN_FUNCS and self._is_global_mean(a0, args, kwargs, out):
            self._push("pool", "mean", [a0], out, {"global": True, "via": "mean"})
            return
        if func in _DROPOUT_FUNCS:
            self._push("dropout", getattr(func, "__name__", "dropout"), [a0], out, {})
            return
        if func in _ADD_FUNCS:
            ops = [t for t in args[:2] if isinstance(t, torch.Tensor)]
            if (len(ops) == 2 and ops[0].shape == ops[1].shape and ops[0].ndim >= 2
                    and all(self._param_of(t) is None for t in ops) and isinstance(out, torch.Tensor)):
                self._push("residual", "add", ops, out, {})

    def _is_global_mean(self, a0, args, kwargs, out) -> bool:
        """Whether a ``mean`` call is global average pooling: the mean over every dimension after (N, C) — all the
        positions — of a tensor with positions, once a conv layer has run in this pass (so ``x.mean((2, 3))`` on a
        feature map counts, as ``F.adaptive_avg_pool2d(x, 1)`` does, and the mean over the tokens of an embedding
        in a network without convolutions does not)."""
        if not isinstance(a0, torch.Tensor) or not isinstance(out, torch.Tensor) or a0.ndim < 3:
            return False
        if not any(e.kind == "weight" and e.info.get("kind") == "conv" for e in self.events):
            return False
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None or isinstance(dim, torch.dtype):
            return False  # the mean of everything (a scalar), not a per-sample, per-channel pooling
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        try:
            dims = {int(d) % a0.ndim for d in dims}
        except (TypeError, ValueError):
            return False
        return dims == set(range(2, a0.ndim))

    def _weight_event(self, pname: str, x: torch.Tensor, out: torch.Tensor, info: dict) -> None:
        owner = pname.rsplit(".", 1)[0] if pname.endswith((".weight", ".bias")) else pname
        calls = self.weight_calls.get(owner, 0)
        self.weight_calls[owner] = calls + 1
        name = owner if calls == 0 else f"{owner}#{calls + 1}"
        info["from_data"] = id(x) in self.data_ids
        info["input_shape"] = tuple(x.shape)
        info["output_shape"] = tuple(out.shape)
        ev = self._push("weight", name, [x], out, info)
        self._finite(ev, out)
        if self.capture_inputs:
            self.inputs[name] = x.detach()
        if self.grad_hooks and out.requires_grad:
            def hook(g, name=name):
                self.grad_sq[name] = g.detach().to(torch.float64).pow(2).sum()
            out.register_hook(hook)


def run_probe(model: nn.Module, x: torch.Tensor, **options) -> tuple[Probe, Any]:
    """Run ``model(x)`` under a :class:`Probe`; returns (probe, output).  Exceptions propagate with the
    probe's ``failed_in`` attached as ``exc.bnlab_failed_in``."""
    probe = Probe(model, x, **options)
    try:
        with probe:
            out = model(x)
    except Exception as exc:
        exc.bnlab_failed_in = probe.failed_in
        raise
    finally:
        probe.close()
    return probe, out


def bytes_of(t) -> int:
    return int(t.numel()) * int(t.element_size()) if isinstance(t, torch.Tensor) else 0


def is_finite_number(v) -> bool:
    return isinstance(v, float) and math.isfinite(v)
