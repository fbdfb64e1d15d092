"""The re-recording sweep (``create_graph=True``): the reverse sweep run in Python with
every rule applied to tensors, so the gradients are themselves recorded on a tape and can
be differentiated again. Any order comes from the same rules as the compiled sweep.

Like every interpreter it never imports Tensor: the caller passes the tensor backend ``F``
(one function per registered op, recording) and ``as_tensor(slot)``, which gives the
recorded tensor for a slot (the leaf itself for a leaf, so derivatives reach it).
"""
from __future__ import annotations

import numpy as np

from ..ops import ARRAY, ARRAY_OP, BY_NAME, OPS
from ..ops._registry import Part
from ..tape import STATE
from .cpu import _SIDES, MULTI_OUTPUT, elementwise_rule, negated_sum_applies

#: array opcodes of the symmetric one-sided rules that read their input (``x * x``: one
#: side, added to itself)
_SYMMETRIC_ARRAY = {code | ARRAY: sides[0] for code, sides in _SIDES.items()
                    if sides[2] and "a" in OPS[code].uses}
_SUB_ARRAY = next(op.code for op in OPS if op.name == "sub") | ARRAY
_MUL_ARRAY = BY_NAME["mul"].code | ARRAY
_ROWS_MIN = 16384  # (the rows pass's least size)
_FUNCTION = type(lambda: None)  # an op's torch_saves given per entry (max/min over a dim)


def _no_zero_or_nan(r):
    """Whether the summed gradient ``r`` has no zero and no NaN (then -sum(g) has the bits
    of sum(-g)). A few numbers (kmeans' 80 centroid coordinates) are tested in Python: two
    NumPy reductions of a small array cost 3 us. A NaN sum of numbers none NaN (inf - inf)
    also says no, as NumPy's test did."""
    if r.size <= 256:
        v = r.ravel().tolist()
        t = sum(v)
        return all(v) and t == t
    with np.errstate(invalid="ignore"):  # (inf - inf: a NaN, quietly)
        return bool(r.all()) and not np.isnan(r.sum())


def sweep(graph, need, seeds, F, as_tensor, add, batch=None):
    """Adjoints as tensors: ``seeds`` maps slot -> seed; returns slot -> adjoint.
    ``add(x, y)`` sums two adjoints (broadcasting already undone). With ``batch``
    (is_grads_batched), every adjoint has a leading batch axis of that size: elementwise
    rules broadcast over it, array rules run once through their ``Op.batch`` views."""
    adj = dict(seeds)
    for k in np.nonzero(need)[0][::-1].tolist():
        g = adj.get(k)
        if g is None:
            continue
        for s, gr in rule(graph, k, g, F, as_tensor, batch):
            gather(graph, adj, s, gr, F, add, batch)
    return adj


def rule(graph, k, g, F, as_tensor, batch=None, every=False):
    """(input slot, gradient) per argument of entry ``k``'s rule on adjoint ``g``, recorded;
    an argument whose gradient nobody reads (a constant) is left out, or with ``every``
    (the hooks' grad_inputs) given as None. A custom Function's output gives a ``Part``."""
    code, a, b, c0, c1 = graph.row(k)
    op = OPS[code & ~ARRAY]
    kind = op.kind
    if op.vjp is None:
        raise NotImplementedError(
            f"the derivative of op '{op.name}' cannot be recorded yet, so "
            "create_graph=True cannot go through it")
    uses = op.uses  # build tensors only for the values the rule reads
    post = None
    if kind is ARRAY_OP:
        inputs = graph.nary_inputs(k) if op.nary else ((a,) if b < 0 else (a, b))
        aux = graph.aux(k)
        if batch or STATE.trace is not None or op.saves and not (
                op.torch_saves.__class__ is _FUNCTION and not op.torch_saves(aux)):
            out = as_tensor(k) if "out" in uses else None
            values = [as_tensor(s) for s in inputs]
        else:  # a rule that reads its inputs' shapes only (a reduction, an index, a
            # reshape, max/min over a dim): the values themselves, no tensor built for them
            value = graph.value
            out = value(k) if "out" in uses else None
            values = [value(s) for s in inputs]
        if batch:
            if op.batch is None or op.name in MULTI_OUTPUT:
                raise NotImplementedError(
                    f"is_grads_batched=True with create_graph=True cannot go through "
                    f"{'a custom Function or traced Program' if op.nary else repr(op.name)}"
                    f" entry yet; loop over the grad_outputs with create_graph=True")
            if out is None:  # batch views read its shape even where the rule does not
                out = as_tensor(k)
            values, out, g, aux, post = op.batch(values, out, g, aux, batch)
        grads = op.vjp(F, g, values, out, aux)
    else:
        out = as_tensor(k) if "out" in uses else None
        ua, ub = "a" in uses, "b" in uses
        gb = None
        if code == _SUB_ARRAY and a != b and not batch and graph.wanted[b] \
                and negated_sum_applies(getattr(g, "_d", None), graph.value(b)):
            # x - v, v broadcast: neg(sum_to(g)) recorded, the bits of sum_to(neg(g)) with
            # the negation on the small array (cpu.neg_sum_to); a zero or NaN in the sum
            # takes the registry's order (the sum_to then left unused on the tape)
            s = F.fit(g, graph.value(b))
            if _no_zero_or_nan(s._d):
                gb = F.neg(s)
        if gb is not None:
            inputs, grads = (a, b), (g, gb)
        elif a == b and code == _MUL_ARRAY and not batch and not every and (
                gx := F.square_grad(g, as_tensor(a))) is not None:
            # x * x under a constant g (a seed's gradient): one entry, mul(2g, x), with
            # g*x + g*x's bits (F.square_grad says why)
            inputs, grads = (a,), (gx,)
        elif a != b and not batch and not every and (sides := _SIDES.get(code & ~ARRAY)) \
                is not None and not (graph.wanted[a] and graph.wanted[b]):
            # one input read (x * w with w a constant): only its side is computed and
            # recorded (the other one, g * x, was an entry and a pass nobody read); a hook's
            # grad_inputs (``every``) take the rule's every gradient, as below
            wa = graph.wanted[a]
            ta, tb = as_tensor(a) if ua else None, as_tensor(b) if ub else None
            inputs, grads = ((a,), (sides[0](g, ta, tb),)) if wa else \
                ((b,), (sides[1](g, ta, tb),))
        elif a == b and code in _SYMMETRIC_ARRAY:
            # x * x (an array): the rule's g * x recorded once and added to itself, the
            # bits of g*x + g*x with one product less to record and differentiate
            ta = as_tensor(a)
            # (a large mul: through F.mul, the recorder's binary path, which passes a
            # product with a broadcast operand, g expanded, to the compiled rows pass:
            # NumPy's bits; a small one: the operator's inline path)
            d = getattr(g, "_d", None)
            ga = F.mul(g, ta) if code == _MUL_ARRAY and d.__class__ is np.ndarray \
                and d.size >= _ROWS_MIN else _SYMMETRIC_ARRAY[code](g, ta, ta)
            inputs, grads = (a, b), (ga, ga)
        else:
            inputs, grads = elementwise_rule(
                op, F, g, out, a, b, c0, c1,
                lambda s: as_tensor(s) if (ua and s == a) or (ub and s == b) else None)
    wanted = graph.wanted
    res = []
    for i, (s, gr) in enumerate(zip(inputs, grads)):
        if gr is None or not wanted[s]:  # an adjoint nobody reads (a constant input):
            if every:  # its broadcast is not undone, nothing more is recorded
                res.append((s, None))
            continue
        if callable(gr) and not isinstance(gr, Part):  # a lazily built gradient
            gr = gr()
        if post is not None and post[i] is not None:
            gr = post[i](gr)
        if gr.__class__ is not Part:
            gr = F.fit(gr, graph.value(s)) if not batch else \
                F.fit_batched(gr, graph.value(s), batch)
        res.append((s, gr))
    return res


def gather(graph, adj, s, gr, F, add, batch=None):
    """Add gradient ``gr`` (from ``rule``) into slot ``s``'s adjoint."""
    if gr.__class__ is Part:  # one output of a custom Function
        parts = adj.setdefault(s, {})
        prev = parts.get(gr.index)
        parts[gr.index] = gr.grad if prev is None else add(prev, gr.grad)
        return
    prev = adj.get(s)
    adj[s] = gr if prev is None else add(prev, gr)
