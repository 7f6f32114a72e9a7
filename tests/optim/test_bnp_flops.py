"""Prop. 6 (Lange et al.): the operations one BNP step performs on a dense layer, counted.

A TorchDispatchMode sees every aten operation the implementation runs (the forward pre-hook's
statistics and ``step()``) and charges it by a fixed table: one operation per output element of a
pointwise op (two for a scaled add), one per input element of a reduction, 2mn(+m) for a
matrix-vector product and 2mn for a rank-1 update.  An operation not in the table fails the test,
so the count cannot silently miss work.  Prop. 6 gives 4·n_in·N + 6·n_in·n_out + 2·n_out + 8·n_in;
the implementation folds 1/q² into 1/σ̃² (5·n_in·n_out, see bnlab.optim.bnp's Errata) and spends
12·n_in + 2 on the O(n_in) terms (see ``implementation_count``), against Prop. 6's 8·n_in.  On CPU
the hook's statistics come from the batch-norm statistics kernel, charged 4·N·n_in + 2·n_in (a sum
pass, then subtract, square and add per entry; two divisions per column), as Prop. 6 counts step 1.  ``step()`` batches its
vector updates with ``torch._foreach_*``; those are charged as the same operation on each tensor
of the list.  The test pins the exact count and the two leading terms against Prop. 6.

``gradient="fused"`` moves work between backward() and step(): autograd no longer forms the
weight gradient (2·N·n_in·n_out), step() forms the preconditioned one as one product of the same
size plus O(N·n_in) work, and the 5·n_in·n_out passes over G_w disappear.  That route is counted
over forward hooks + backward + step against the transform route (``test_fused_route_count``).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bnlab.optim import BNPreconditioner


def _numel(t):
    return t.numel() if isinstance(t, torch.Tensor) else 1


class OpCounter(TorchDispatchMode):
    POINTWISE = {"sub", "mul", "div", "reciprocal", "clamp_min", "sqrt", "neg"}
    REDUCTION = {"sum", "max", "amax"}
    FREE = {"detach", "view", "_unsafe_view", "t", "alias", "lift_fresh", "clone", "copy", "_to_copy",
            "empty_like", "zeros_like", "expand", "reshape", "lift_fresh_copy", "le", "any", "is_nonzero",
            "_local_scalar_dense", "empty", "slice", "as_strided", "stack", "unbind", "select", "ones_like"}

    def __init__(self):
        super().__init__()
        self.count = 0
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__.rstrip("_")
        if name.startswith("_foreach_"):
            # A batched op over a list of tensors: charged as the same op on each of them
            # (broadcast operands are the same size as or smaller than args[0]'s entries).
            # The foreach addcmul takes its scale positionally, the plain one as a keyword.
            if name == "_foreach_addcmul" and len(args) > 3:
                kwargs = {**kwargs, "value": args[3]}
            self.count += sum(self._cost(name[len("_foreach_"):], t, (t,) + tuple(args[1:]), kwargs)
                              for t in args[0])
            return out
        self.count += self._cost(name, out, args, kwargs)
        return out

    def _cost(self, name, out, args, kwargs):
        if name in self.FREE:
            cost = 0
        elif name == "add":
            alpha = kwargs.get("alpha", 1)
            cost = _numel(out) * (1 if alpha == 1 else 2)
        elif name in self.POINTWISE:
            cost = _numel(out)
        elif name in self.REDUCTION:
            cost = _numel(args[0])
        elif name == "addcmul":
            cost = _numel(out) * (2 if kwargs.get("value", 1) == 1 else 3)
        elif name == "addr":
            cost = 2 * _numel(out)
        elif name == "addmm":  # the layer's own forward (subtracted below)
            cost = 2 * args[1].shape[0] * args[1].shape[1] * args[2].shape[1] + _numel(out)
        elif name == "addmv":  # β·y + α·A x: a scaling of y when β ≠ 1 (step 5's 1/q²)
            m, n = args[1].shape
            cost = 2 * m * n + m + (m if kwargs.get("beta", 1) != 1 else 0)
        elif name == "mm":  # the weight gradient (autograd's, or the fused route's)
            cost = 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
        elif name == "mv":
            cost = 2 * args[0].shape[0] * args[0].shape[1]
        elif name == "lerp":  # start + w·(end - start): subtract, multiply, add
            cost = 3 * _numel(out)
        elif name == "pow":  # square (the loss here, and (h - μ)² at N = 1 on the fused route)
            cost = _numel(out)
        elif name == "batch_norm_update_stats":
            # Σx over the N rows, mean (one division per column), Σ(x - μ)² (subtract, square, add),
            # variance (one division per column).
            cost = 4 * _numel(args[0]) + 2 * args[0].shape[1]
        else:
            raise AssertionError(f"operation {name} not in the cost table")
        self.ops.append((name, cost))
        return cost


def count_step(n_in, n_out, batch):
    torch.manual_seed(0)
    layer = nn.Linear(n_in, n_out)
    pre = BNPreconditioner(layer)
    x = torch.randn(batch, n_in)
    with pre.paused(), OpCounter() as plain_forward:
        layer(x)
    with OpCounter() as hooked_forward:
        out = layer(x)
    out.square().sum().backward()
    with OpCounter() as step_count:
        pre.step()
    return hooked_forward.count - plain_forward.count, step_count.count


def prop6(n_in, n_out, batch):
    return 4 * n_in * batch + 6 * n_in * n_out + 2 * n_out + 8 * n_in


def implementation_count(n_in, n_out, batch):
    # O(n_in) terms: hook 2 (the statistics kernel's divisions); running mean and variance 3 each
    # (lerp: subtract, scale, add); σ̃² 2 (max, + shift; the shift ε₁·max + ε₂ in Python floats
    # on CPU), 1/(q²σ̃²) 2 (scale by q², skipped where q² = 1; reciprocal).  At N = 1 the variance
    # is (h - μ)² about the running mean (2·n_in more).  Step 5 scales G_b by 1/q² (n_out) only
    # where q² = max(n_in/N, 1) is not 1.
    return (4 * n_in * batch + 5 * n_in * n_out + _bias_scaling(n_in, n_out, batch) + n_out
            + (11 if batch > 1 else 13) * n_in + _q2_scaling(n_in, batch))


def _bias_scaling(n_in, n_out, batch):
    return n_out if n_in > batch else 0


def _q2_scaling(n_in, batch):
    return n_in if n_in > batch else 0


@pytest.mark.parametrize("n_in,n_out,batch", [(100, 100, 60), (784, 100, 16), (30, 10, 1), (7, 3, 512)])
def test_bnp_step_operation_count(n_in, n_out, batch):
    hook_ops, step_ops = count_step(n_in, n_out, batch)
    assert hook_ops == 4 * n_in * batch + 2 * n_in  # Algorithm 2 step 1 as Prop. 6 counts it, + O(n_in)
    total = hook_ops + step_ops
    assert total == implementation_count(n_in, n_out, batch)
    if n_out >= 5:  # then n_in·n_out ≥ 4·n_in + 2: the implementation does no more than Prop. 6
        assert total <= prop6(n_in, n_out, batch)


def test_leading_terms_match_prop6():
    """∂count/∂N = 4·n_in exactly as Prop. 6; ∂count/∂n_out = 5·n_in + 2 ≤ Prop. 6's 6·n_in + 2."""
    base = sum(count_step(50, 20, 8))
    more_batch = sum(count_step(50, 20, 18))
    more_out = sum(count_step(50, 21, 8))
    assert more_batch - base == 4 * 50 * 10 == prop6(50, 20, 18) - prop6(50, 20, 8)
    assert more_out - base == 5 * 50 + 2
    assert prop6(50, 21, 8) - prop6(50, 20, 8) == 6 * 50 + 2


def count_training_step(n_in, n_out, batch, gradient):
    """Operations of the forward hooks, backward() and step() of one BNP step on one dense layer,
    and the list of (operation, cost) of step()."""
    torch.manual_seed(0)
    layer = nn.Linear(n_in, n_out)
    pre = BNPreconditioner(layer, gradient=gradient)
    x = torch.randn(batch, n_in)
    with pre.paused(), OpCounter() as plain_forward:
        layer(x)
    with OpCounter() as hooked_forward:
        out = layer(x)
    loss = out.square().sum()
    with OpCounter() as backward:
        loss.backward()
    with OpCounter() as step_count:
        pre.step()
    total = hooked_forward.count - plain_forward.count + backward.count + step_count.count
    return total, backward.ops, step_count.ops


def fused_step_count(n_in, n_out, batch):
    # step() on the fused route, without its one product G_w' = δᵀĤ (2·N·n_in·n_out, the product
    # autograd no longer forms): the statistics (4·N·n_in + 2·n_in; at N = 1 also (h - μ)²:
    # 2·n_in), two lerps updating them (6·n_in), σ̃² and 1/(q²σ̃²) as on the transform route (max,
    # + shift, q²· where q² ≠ 1, reciprocal: 3·n_in (+ n_in)), Ĥ (subtract, scale: 2·N·n_in), Ĥμ (2·N·n_in) and
    # G_b/q² - δᵀ(Ĥμ) (2·n_out·N + n_out, and n_out for 1/q² where q² ≠ 1).  No term in n_in·n_out.
    extra_n1 = 2 * n_in if batch == 1 else 0
    return (4 * n_in * batch + 2 * n_in + extra_n1 + 6 * n_in + 3 * n_in + _q2_scaling(n_in, batch) + 2 * n_in * batch
            + 2 * n_in * batch + 2 * n_out * batch + n_out + _bias_scaling(n_in, n_out, batch))


@pytest.mark.parametrize("n_in,n_out,batch", [(100, 100, 60), (784, 100, 16), (30, 10, 1), (7, 3, 512)])
def test_fused_route_count(n_in, n_out, batch):
    """gradient="fused" against "transform": forward hooks + backward + step, counted.

    The fused route's forward hooks do no arithmetic (the statistics are taken in step() from the
    kept input); the transform route's cost 4·N·n_in + 2·n_in, its step() implementation_count
    minus that, and its backward the weight-gradient product on top of what both share."""
    fused, fused_backward, fused_step = count_training_step(n_in, n_out, batch, "fused")
    transform, transform_backward, _ = count_training_step(n_in, n_out, batch, "transform")
    # Autograd's weight-gradient product moved from backward() into step() ...
    product = 2 * batch * n_in * n_out
    assert ("mm", product) in transform_backward
    assert not any(name == "mm" for name, _ in fused_backward)
    assert [op for op in fused_step if op[0] == "mm"] == [("mm", product)]
    # ... and nothing else in step() is O(n_in·n_out): no pass over G_w.
    assert sum(cost for name, cost in fused_step if name != "mm") == fused_step_count(n_in, n_out, batch)
    assert fused - transform == fused_step_count(n_in, n_out, batch) - implementation_count(n_in, n_out, batch)
