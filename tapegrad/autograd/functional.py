"""``tapegrad.autograd.functional``: vjp, jvp, jacobian, hessian, hvp, vhp with
torch.autograd.functional's signatures, built on ``grad`` (``create_graph`` for the
second-order ones)."""
from __future__ import annotations

import numpy as np

from ..functions import stack
from ..tensor import Tensor, _plain, enable_grad
from ._engine import grad

__all__ = ["vjp", "jvp", "jacobian", "hessian", "hvp", "vhp"]


def _zeros(x):
    return _plain(np.zeros(x.shape, x.dtype.np) if x.shape else 0.0)


def _tuple(x, name, fname):
    is_tuple = isinstance(x, tuple)
    xs = x if is_tuple else (x,)
    for i, t in enumerate(xs):
        if not isinstance(t, Tensor):
            raise TypeError(f"The {name} given to {fname} must be either a Tensor or a tuple of "
                            f"Tensors but the value at index {i} has type {type(t).__name__}.")
    return is_tuple, xs


def _prepare(inputs, create_graph):
    """Inputs the function is traced at: fresh leaves, or (create_graph) views that keep
    the caller's graph."""
    out = []
    for x in inputs:
        if create_graph and x.requires_grad:
            out.append(x * 1.0)
        else:
            out.append(x.detach().requires_grad_(x.dtype.is_floating_point))
    return tuple(out)


def _finish(xs, is_tuple, create_graph):
    xs = tuple(x if (create_graph or x is None) else x.detach() for x in xs)
    return xs if is_tuple else xs[0]


def _check_strict(strict, what, i):
    if strict:
        raise RuntimeError(f"The {what} of the user-provided function is independent of input "
                           f"{i}. This is not allowed in strict mode.")


def _grads(outputs, inputs, vs, create_graph, strict, fname, what="output"):
    gs = grad(outputs, inputs, grad_outputs=vs, create_graph=create_graph, allow_unused=True,
              retain_graph=True)
    out = []
    for i, (g, x) in enumerate(zip(gs, inputs)):
        if g is None:
            _check_strict(strict, what, i)
            g = _zeros(x)
        out.append(g)
    return tuple(out)


def _check_v(v, outs, fname, against="output"):
    if v is None:
        if any(o.numel() != 1 for o in outs):
            raise RuntimeError(f"The vector v can only be None if the user-provided function "
                               f"returns a single Tensor with a single element ({fname}).")
        return [None] * len(outs)
    _, vs = _tuple(v, "v", fname)
    if len(vs) != len(outs):
        raise RuntimeError(f"v has invalid size: should be {len(outs)} but got {len(vs)}.")
    for i, (a, o) in enumerate(zip(vs, outs)):
        if a.shape != o.shape:
            raise RuntimeError(f"Entry {i} in v has invalid size: should be {list(o.shape)} but "
                               f"got {list(a.shape)}.")
    return list(vs)


def _call(func, inputs, fname):
    with enable_grad():
        out = func(*inputs)
    is_tuple, outs = _tuple(out, "outputs of the user-provided function", fname)
    return is_tuple, outs


def vjp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), v^T J).

    Examples
    --------
    >>> import tapegrad
    >>> x = tapegrad.tensor([1.0, 2.0])
    >>> tapegrad.autograd.functional.vjp(lambda t: (t * t).sum(), x)[1]
    tensor([2., 4.])
    """
    in_tuple, xs = _tuple(inputs, "inputs", "vjp")
    xs = _prepare(xs, create_graph)
    out_tuple, outs = _call(func, xs, "vjp")
    vs = _check_v(v, outs, "vjp")
    diff = [o for o in outs if o.requires_grad]
    if not diff:
        if strict:
            raise RuntimeError("The output of the user-provided function is independent of "
                               "input 0. This is not allowed in strict mode.")
        gs = tuple(_zeros(x) for x in xs)
    else:
        keep = [i for i, o in enumerate(outs) if o.requires_grad]
        gs = _grads([outs[i] for i in keep], xs, [vs[i] for i in keep], create_graph, strict,
                    "vjp")
    return _finish(outs, out_tuple, create_graph), _finish(gs, in_tuple, create_graph)


def jvp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), J v), by differentiating a vjp (the double-backward trick)."""
    in_tuple, xs = _tuple(inputs, "inputs", "jvp")
    xs = _prepare(xs, create_graph)
    if v is None:
        if any(x.numel() != 1 for x in xs):
            raise RuntimeError("The vector v can only be None if the input to the user-provided "
                               "function is a single Tensor with a single element.")
        vs = [None] * len(xs)
    else:
        _, vs = _tuple(v, "v", "jvp")
        if len(vs) != len(xs):
            raise RuntimeError(f"v has invalid size: should be {len(xs)} but got {len(vs)}.")
    out_tuple, outs = _call(func, xs, "jvp")
    # u -> J^T u is linear in u; its vjp with v is J v
    us = [Tensor.requires_grad_(_zeros(o))
          for o in outs]
    gs = grad(list(outs), list(xs), grad_outputs=us, create_graph=True, allow_unused=True)
    pairs = [(g, vi if vi is not None else _plain(1.0)) for g, vi in zip(gs, vs)
             if g is not None]
    if not pairs:
        jv = tuple(_zeros(o) for o in outs)
    else:
        jv = grad([g for g, _ in pairs], us, grad_outputs=[vi for _, vi in pairs],
                  create_graph=create_graph, allow_unused=True)
        jv = tuple(j if j is not None else _plain(np.zeros(o.shape, o.dtype.np)
                                                  if o.shape else 0.0)
                   for j, o in zip(jv, outs))
    if strict and not pairs:
        raise RuntimeError("The output of the user-provided function is independent of input "
                           "0. This is not allowed in strict mode.")
    return _finish(outs, out_tuple, create_graph), _finish(jv, out_tuple, create_graph)


def _rows(outs, xs, create_graph, strict, fname):
    """d(out)/d(x) blocks: one batched sweep per output (is_grads_batched), or one sweep per
    output element when the blocks must be recorded (create_graph)."""
    if not create_graph:
        try:
            return _rows_batched(outs, xs, strict)
        except NotImplementedError:  # an op the batched sweep cannot cross yet
            pass
    blocks = [[None] * len(xs) for _ in outs]
    for k, o in enumerate(outs):
        n = o.numel()
        rows = [[] for _ in xs]
        for r in range(n):
            seed = np.zeros(n, dtype=o.dtype.np)
            seed[r] = 1.0
            if o.requires_grad:
                g = _grads([o], list(xs), [_plain(seed.reshape(o.shape) if o.shape
                                                  else float(seed[0]))],
                           create_graph, strict, fname)
            else:
                if strict:
                    raise RuntimeError(f"Output {k} of the user-provided function does not "
                                       "require gradients. This is not allowed in strict "
                                       "mode.")
                g = tuple(_zeros(x)
                          for x in xs)
            for i, gi in enumerate(g):
                rows[i].append(gi)
        for i, x in enumerate(xs):
            if n == 0:
                blocks[k][i] = _plain(np.zeros(o.shape + x.shape, x.dtype.np))
                continue
            j = stack(rows[i]) if rows[i][0].shape or n > 1 else rows[i][0]
            blocks[k][i] = j.reshape(tuple(o.shape) + tuple(x.shape))
    return blocks


def _rows_batched(outs, xs, strict):
    blocks = []
    for k, o in enumerate(outs):
        n = o.numel()
        if not o.requires_grad or n == 0:
            if strict and not o.requires_grad:
                raise RuntimeError(f"Output {k} of the user-provided function does not require "
                                   "gradients. This is not allowed in strict mode.")
            blocks.append([_plain(np.zeros(o.shape + x.shape, x.dtype.np)) for x in xs])
            continue
        seeds = _plain(np.eye(n, dtype=o.dtype.np).reshape((n,) + tuple(o.shape)))
        gs = grad(o, list(xs), grad_outputs=seeds, retain_graph=True, allow_unused=True,
                  is_grads_batched=True)
        row = []
        for i, (g, x) in enumerate(zip(gs, xs)):
            if g is None:
                _check_strict(strict, "jacobian", i)
                g = _plain(np.zeros((n,) + tuple(x.shape), x.dtype.np))
            row.append(g.reshape(tuple(o.shape) + tuple(x.shape)))
        blocks.append(row)
    return blocks


def jacobian(func, inputs, create_graph=False, strict=False, vectorize=False,
             strategy="reverse-mode"):
    """The Jacobian of ``func`` at ``inputs``: shape ``out.shape + in.shape`` per pair."""
    if strategy not in ("reverse-mode", "forward-mode"):
        raise ValueError('Expected strategy to be either "forward-mode" or "reverse-mode". '
                         f'Hint: You are using "{strategy}".')
    in_tuple, xs = _tuple(inputs, "inputs", "jacobian")
    xs = _prepare(xs, create_graph)
    out_tuple, outs = _call(func, xs, "jacobian")
    blocks = _rows(outs, xs, create_graph, strict, "jacobian")
    blocks = [tuple(b if create_graph else b.detach() for b in row) for row in blocks]
    if out_tuple:
        return tuple(row if in_tuple else row[0] for row in blocks)
    return blocks[0] if in_tuple else blocks[0][0]


def hessian(func, inputs, create_graph=False, strict=False, vectorize=False,
            outer_jacobian_strategy="reverse-mode"):
    """The Hessian of scalar ``func`` at ``inputs`` (blocks per input pair)."""
    in_tuple, xs = _tuple(inputs, "inputs", "hessian")

    def gradient(*args):
        out = func(*args)
        is_t, outs = _tuple(out, "outputs of the user-provided function", "hessian")
        if is_t or outs[0].numel() != 1:
            raise RuntimeError("The function given to hessian should return a single Tensor "
                               "with a single element.")
        gs = _grads([outs[0]], list(args), None, True, strict, "hessian")
        return gs if len(gs) > 1 else gs[0]

    res = jacobian(gradient, xs if in_tuple else xs[0], create_graph=create_graph,
                   strict=strict)
    return res


def vhp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), v^T H)."""
    return _hessian_product(func, inputs, v, create_graph, strict, "vhp")


def hvp(func, inputs, v=None, create_graph=False, strict=False):
    """(func(inputs), H v); the Hessian is symmetric, so this is v^T H."""
    return _hessian_product(func, inputs, v, create_graph, strict, "hvp")


def _hessian_product(func, inputs, v, create_graph, strict, fname):
    in_tuple, xs = _tuple(inputs, "inputs", fname)
    xs = _prepare(xs, create_graph)
    if v is None:
        if any(x.numel() != 1 for x in xs):
            raise RuntimeError("The vector v can only be None if the input to the user-provided "
                               "function is a single Tensor with a single element.")
        vs = [_plain(1.0) if not x.shape else _plain(np.ones(x.shape)) for x in xs]
    else:
        _, vs = _tuple(v, "v", fname)
        vs = list(vs)
        if len(vs) != len(xs):
            raise RuntimeError(f"v has invalid size: should be {len(xs)} but got {len(vs)}.")
        for i, (a, x) in enumerate(zip(vs, xs)):
            if a.shape != x.shape:
                raise RuntimeError(f"Entry {i} in v has invalid size: should be "
                                   f"{list(x.shape)} but got {list(a.shape)}.")
    out_tuple, outs = _call(func, xs, fname)
    if out_tuple or outs[0].numel() != 1:
        raise RuntimeError(f"The function given to {fname} should return a single Tensor with "
                           "a single element.")
    gs = _grads([outs[0]], list(xs), None, True, strict, fname)
    keep = [(g, vi) for g, vi in zip(gs, vs) if g.requires_grad]
    if not keep:
        if strict:
            raise RuntimeError("The jacobian of the user-provided function is independent of "
                               "input 0. This is not allowed in strict mode.")
        res = tuple(_zeros(x) for x in xs)
    else:
        res = _grads([g for g, _ in keep], list(xs), [vi for _, vi in keep], create_graph,
                     strict, fname, "jacobian")
    return _finish(outs, False, create_graph), _finish(res, in_tuple, create_graph)
