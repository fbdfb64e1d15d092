"""``grad`` and ``backward``: argument checks (torch's rules), then one reverse sweep.

The strategies that run the sweep are in ``_fast_paths`` (one compiled call, or decline) and
``_sweep`` (the general ones); ``_leaves`` reads the results out, ``_versions`` checks saved
values."""
from __future__ import annotations

import warnings

import numpy as np

from .. import _notice
from .._dtypes import _F64
from ..tensor import Tensor, _plain, _plain_s, _pyfloat
from ._fast_paths import _FAST_GRAPH, _FAST_NOGRAPH
from ._leaves import _accumulate, _as_tensor, _check_unused, _zeros_for
from ._sweep import _run
from . import hooks
from .graph import HOOKS, GradientEdge, edge_tensor
from .paths import FAST as _FAST, STATE as _PATHS, declined as _declined



def _tensors(x, name, allow_empty=True):
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, GradientEdge):
        return [edge_tensor(x)]
    if isinstance(x, (list, tuple)):
        out = list(x)
        for i, t in enumerate(out):
            if isinstance(t, GradientEdge):
                out[i] = edge_tensor(t)
            elif not isinstance(t, Tensor):
                raise TypeError(f"{name}[{i}] must be a Tensor or GradientEdge, got "
                                f"{type(t).__name__}")
        return out
    raise TypeError(f"{name} must be a Tensor or a sequence of Tensors, got "
                    f"{type(x).__name__}")


def _grad_outputs(outputs, grad_outputs, name="grad_outputs"):
    """Seeds (float or ndarray, one per output) from ``grad_outputs``, with torch's checks."""
    if grad_outputs is None and len(outputs) == 1 and outputs[0]._d.__class__ is _pyfloat:
        return [1.0]  # the common case: one 0-d float64 loss
    if grad_outputs is None:
        gos = [None] * len(outputs)
    elif isinstance(grad_outputs, Tensor):
        gos = [grad_outputs]
    elif isinstance(grad_outputs, (list, tuple)):
        gos = list(grad_outputs)
    else:
        raise TypeError(f"{name} must be a Tensor, None or a sequence of them, got "
                        f"{type(grad_outputs).__name__}")
    if len(gos) != len(outputs):
        raise RuntimeError(f"got {len(outputs)} tensors and {len(gos)} gradients: pass one "
                           f"{name} entry (or None) per output")
    seeds = []
    for i, (y, g) in enumerate(zip(outputs, gos)):
        if g is None:
            if y.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs "
                                   f"(output {i} has shape {list(y.shape)}); pass "
                                   f"{name}= with a tensor of that shape")
            seeds.append(1.0 if y._d.__class__ is _pyfloat else np.ones(y.shape, y.dtype.np))
            continue
        if not isinstance(g, Tensor):
            raise TypeError(f"{name}[{i}] must be a Tensor or None, got {type(g).__name__}")
        gv, yd = g._d, y._d
        if gv.__class__ is np.ndarray and yd.__class__ is np.ndarray and \
                gv.dtype is _F64 and yd.dtype is _F64 and gv.shape == yd.shape:
            seeds.append(gv)  # (kmeans' ones_like(J): np.asarray's own result, without
            continue          # the Size and dtype objects of the checks below, 1 us)
        if g.shape != y.shape:
            raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of "
                               f"{list(g.shape)} and output[{i}] has a shape of "
                               f"{list(y.shape)}.")
        if g.dtype.is_complex:
            raise RuntimeError(f"For complex Tensors, both grad_output and output are required "
                               f"to have the same dtype. Mismatch in dtype: grad_output[{i}] "
                               f"has a dtype of {g.dtype} and output[{i}] has a dtype of "
                               f"{y.dtype}.")
        gv = g._d
        if y._d.__class__ is _pyfloat:
            seeds.append(float(gv))
        else:
            seeds.append(np.asarray(gv, dtype=y.dtype.np))
    return seeds


def _check_outputs(outputs):
    for i, y in enumerate(outputs):
        if not y._rg:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have "
                               "a grad_fn")


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         only_inputs=True, allow_unused=None, is_grads_batched=False,
         materialize_grads=False):
    """Gradients of ``outputs`` with respect to ``inputs`` (a tuple, one per input).

    Same signature, defaults, warnings and errors as ``torch.autograd.grad``.

    Examples
    --------
    >>> import tapegrad
    >>> x = tapegrad.tensor(3.0, requires_grad=True)
    >>> tapegrad.autograd.grad(x * x, x)[0].item()
    6.0
    """
    if "gradient" in _notice.PENDING:  # a cold cache compiles for seconds: say so, once
        _notice.announce("gradient")
    if (outputs.__class__ is Tensor and not is_grads_batched and grad_outputs is None
            and allow_unused is None and not materialize_grads and only_inputs):
        # the fast strategies (paths.STRATEGIES): the first that applies runs the call
        ctl = _PATHS.ctl
        for p in (_FAST_GRAPH if retain_graph is not False else ()) if create_graph \
                else _FAST_NOGRAPH:
            if ctl is not None and not ctl.allows(p.name):
                continue
            plan = p.applies(outputs, inputs, retain_graph)
            if plan is not None:
                _PATHS.last = p.name
                return p.run(plan)
        if ctl is not None and ctl.forced in _FAST:
            _declined(ctl.forced, "the call is not one this path covers")
    if materialize_grads and allow_unused is False:
        raise ValueError("Expected allow_unused to be True or not passed when "
                         "materialize_grads=True, but got: allow_unused=False.")
    if allow_unused is None:
        allow_unused = materialize_grads
    if not only_inputs:
        warnings.warn("only_inputs argument is deprecated and is ignored now (defaults to "
                      "True). To accumulate gradient for other parts of the graph, please use "
                      "tapegrad.autograd.backward.", FutureWarning, stacklevel=2)
    outs = _tensors(outputs, "outputs")
    ins = _tensors(inputs, "inputs")
    if not ins:
        raise RuntimeError("`inputs` argument to `grad()` cannot be empty.")
    _check_outputs(outs)
    if not all([x._rg for x in ins]):
        raise RuntimeError("One of the differentiated Tensors does not require grad")
    if retain_graph is None:
        retain_graph = create_graph
    if is_grads_batched:
        seeds, batch = _batched_seeds(outs, grad_outputs)
        if create_graph:
            results, used = _run(outs, _seed_tensors(outs, seeds, grad_outputs), ins,
                                 retain_graph, record=True, batch=batch,
                                 allow_unused=allow_unused)
            return _batched_recorded(ins, results, used, batch, allow_unused,
                                     materialize_grads)
        results, used = _run(outs, seeds, ins, retain_graph, batch=batch)
        return _batched_results(ins, results, used, batch, allow_unused, materialize_grads)
    seeds = _grad_outputs(outs, grad_outputs)
    if create_graph:
        results, used = _run(outs, _seed_tensors(outs, seeds, grad_outputs), ins,
                             retain_graph, record=True, allow_unused=allow_unused)
    else:
        results, used = _run(outs, seeds, ins, retain_graph, fast=True)
    if used.__class__ is bool:  # the fast path: every input a used 0-d float64 leaf
        return tuple([_plain_s(r) for r in results])
    out = []
    for i, (x, r, u) in enumerate(zip(ins, results, used)):
        if not u:
            _check_unused(i, allow_unused)
            z = _zeros_for(x) if materialize_grads else None
            if z is not None and create_graph:  # torch: zeros_like(x, requires_grad=True),
                z.requires_grad_(True)          # a leaf of its own
            out.append(z)
        elif isinstance(r, Tensor):  # create_graph
            out.append(r)
        elif x._d.__class__ is _pyfloat:
            out.append(_plain_s(float(r)))
        else:
            out.append(_as_tensor(r, x))
    return tuple(out)


def _batched_seeds(outs, grad_outputs):
    """Seeds with a leading batch axis (is_grads_batched), checked as torch checks them."""
    if grad_outputs is None:
        raise RuntimeError("is_grads_batched=True needs grad_outputs: one tensor per output "
                           "whose first dimension is the batch")
    gos = [grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs)
    if len(gos) != len(outs):
        raise RuntimeError(f"got {len(outs)} tensors and {len(gos)} gradients")
    batch, seeds = None, []
    for i, (y, g) in enumerate(zip(outs, gos)):
        if not isinstance(g, Tensor):
            raise TypeError(f"grad_outputs[{i}] must be a Tensor when is_grads_batched=True, "
                            f"got {type(g).__name__}")
        if g.ndim == 0 or tuple(g.shape[1:]) != tuple(y.shape):
            raise RuntimeError(
                "If `is_grads_batched=True`, we interpret the first dimension of each "
                "grad_output as the batch dimension. The sizes of the remaining dimensions are "
                "expected to match the shape of corresponding output, but a mismatch was "
                f"detected: grad_output[{i}] has a shape of {list(g.shape)} and output[{i}] "
                f"has a shape of {list(y.shape)}.")
        if batch is not None and g.shape[0] != batch:
            raise RuntimeError(f"is_grads_batched=True: every grad_output needs the same batch "
                               f"size, but grad_output[{i}] has {g.shape[0]} and the first "
                               f"has {batch}")
        batch = g.shape[0]
        seeds.append(np.asarray(g._d, dtype=y.dtype.np))
    return seeds, batch


def _batched_recorded(ins, results, used, batch, allow_unused, materialize_grads):
    """``_batched_results`` for create_graph: the gradients are recorded tensors."""
    out = []
    for i, (x, r, u) in enumerate(zip(ins, results, used)):
        shape = (batch,) + tuple(x.shape)
        if not u:
            _check_unused(i, allow_unused)
            z = _plain(np.zeros(shape, x.dtype.np)) if materialize_grads else None
            if z is not None:  # recorded (create_graph): torch's zeros require grad
                z.requires_grad_(True)
            out.append(z)
        elif not isinstance(r, Tensor):
            out.append(_plain(np.array(np.broadcast_to(np.asarray(r, dtype=x.dtype.np),
                                                       shape))))
        else:
            out.append(r if r.shape == shape else r.expand(shape))
    return tuple(out)


def _batched_results(ins, results, used, batch, allow_unused, materialize_grads):
    out = []
    for i, (x, r, u) in enumerate(zip(ins, results, used)):
        if not u:
            _check_unused(i, allow_unused)
            out.append(_plain(np.zeros((batch,) + tuple(x.shape), x.dtype.np))
                       if materialize_grads else None)
        else:
            out.append(_plain(np.array(np.broadcast_to(np.asarray(r, dtype=x.dtype.np),
                                                       (batch,) + tuple(x.shape)))))
    return tuple(out)


def _seed_tensors(outs, seeds, grad_outputs):
    """The seeds as tensors for a recorded sweep: the user's grad_outputs themselves (they
    may require grad), cast to the output's dtype, or ones."""
    given = [grad_outputs] if isinstance(grad_outputs, Tensor) else (
        list(grad_outputs) if grad_outputs is not None else [None] * len(outs))
    out = []
    for y, raw, g in zip(outs, seeds, given):
        if g is None:
            out.append(_plain_s(raw) if raw.__class__ is float else _plain(raw))
        elif g.dtype is not y.dtype:
            out.append(g.to(y.dtype))
        else:
            out.append(g)
    return out


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
             grad_variables=None, inputs=None):
    """Accumulate the gradient of ``tensors`` into the ``.grad`` of the graph's leaves.

    Same signature and behaviour as ``torch.autograd.backward``.

    Examples
    --------
    >>> import tapegrad
    >>> w = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    >>> tapegrad.autograd.backward((w * w).sum())
    >>> w.grad.tolist()
    [2.0, 4.0]
    """
    if "gradient" in _notice.PENDING:
        _notice.announce("gradient")
    if grad_variables is not None:
        warnings.warn("'grad_variables' is deprecated. Use 'grad_tensors' instead.",
                      FutureWarning, stacklevel=2)
        if grad_tensors is not None:
            raise RuntimeError("`grad_tensors` and `grad_variables` (deprecated) arguments both "
                               "passed to `backward()`. Please only use `grad_tensors`.")
        grad_tensors = grad_variables
    outs = _tensors(tensors, "tensors")
    if inputs is not None:
        ins = _tensors(inputs, "inputs")
        if not ins:
            raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    else:
        ins = None
    _check_outputs(outs)
    seeds = _grad_outputs(outs, grad_tensors, "grad_tensors")
    if retain_graph is None:
        retain_graph = create_graph
    if create_graph:
        seeds = _seed_tensors(outs, seeds, grad_tensors)
    taken = set()  # leaves a hooked sweep accumulated itself, in torch's order
    accumulate = None
    if HOOKS[0]:
        def accumulate(x, r):
            taken.add(id(x))
            _accumulate(x, r)
            hooks.post_accumulate(x)
    if ins is not None:
        ins = list({id(x): x for x in ins}.values())
        for x in ins:
            if not x._rg:
                raise RuntimeError("One of the differentiated Tensors does not require grad")
        results, used = _run(outs, seeds, ins, retain_graph, {id(x) for x in ins},
                             record=create_graph, accumulate=accumulate)
        targets = ins
    else:
        results, used, targets = _run(outs, seeds, None, retain_graph, record=create_graph,
                                      accumulate=accumulate)
    for x, r, u in zip(targets, results, used):
        if u and id(x) not in taken:
            _accumulate(x, r)
            if HOOKS[0]:
                hooks.post_accumulate(x)
