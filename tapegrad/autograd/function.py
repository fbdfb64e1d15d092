"""``Function``: custom ops with a user ``forward`` and ``backward``, as torch's.

``apply`` runs ``forward`` without recording, then records one ``function`` entry (its
inputs are the tensor arguments; ``aux`` holds the context) and one ``function_out``
entry per differentiable output. The sweeps hand ``function`` entries back to Python,
which calls the user's ``backward`` with all output gradients at once: on plain values
normally, recorded (and so differentiable again) under ``create_graph``.
"""
from __future__ import annotations

import functools

import numpy as np

from ..ops import BY_NAME, NpF
from ..ops._registry import Part
from ..tensor import Tensor, _plain, _pyfloat, array_op, enable_grad, is_grad_enabled, no_grad
from ._tensor_backend import TensorF

_FUNCTION = BY_NAME["function"]
_FUNCTION_OUT = BY_NAME["function_out"]


class FunctionCtx:
    """The ``ctx`` of a Function: what forward leaves for backward."""

    def __init__(self):
        self.to_save = ()
        self.needs_input_grad = ()
        self.non_differentiable = set()
        self.materialize_grads = True
        self._saved = None

    def save_for_backward(self, *tensors):
        for i, t in enumerate(tensors):
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(f"save_for_backward can only save variables, but argument {i} "
                                f"is not a Tensor or None (got {type(t).__name__})")
        self.to_save = tensors

    @property
    def saved_tensors(self):
        if self._saved is None:
            raise RuntimeError("Trying to backward through the graph a second time (or "
                               "directly access saved tensors after they have already been "
                               "freed). Specify retain_graph=True if you need to backward "
                               "through the graph a second time.")
        return self._saved

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable.update(id(t) for t in tensors)

    def mark_dirty(self, *tensors):
        raise NotImplementedError("tapegrad Functions cannot modify their inputs in place "
                                  "(mark_dirty); return a new tensor instead")

    def set_materialize_grads(self, value):
        self.materialize_grads = bool(value)


class _FunctionMeta(type):
    def __init__(cls, name, bases, attrs):
        super().__init__(name, bases, attrs)
        cls._backward_cls_name = f"{name}Backward"


class Function(metaclass=_FunctionMeta):
    """Base class for custom differentiable ops (torch.autograd.Function).

    Examples
    --------
    >>> import tapegrad
    >>> class Cube(tapegrad.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x ** 3
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return 3.0 * x * x * g
    >>> x = tapegrad.tensor(2.0, requires_grad=True)
    >>> tapegrad.autograd.grad(Cube.apply(x), x)[0].item()
    12.0
    """

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError("You must implement the forward function for custom "
                                  "autograd.Function.")

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise NotImplementedError("You must implement either the backward or vjp method for "
                                  "your custom autograd.Function to use it with backward mode "
                                  "AD.")

    vjp = backward

    @classmethod
    def apply(cls, *args, **kwargs):
        from ..tape import STATE
        if STATE.trace is not None:
            raise NotImplementedError(
                f"tapegrad.trace: {cls.__name__} is a custom autograd.Function, whose Python "
                f"forward and backward a traced program cannot replay; write the function "
                f"with tapegrad ops to trace it")
        ctx = FunctionCtx()
        tensor_args = [(i, a) for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        setup = cls.__dict__.get("setup_context")
        with no_grad():
            if setup is not None and not _takes_ctx(cls.forward):
                outputs = cls.forward(*args, **kwargs)
            else:
                outputs = cls.forward(ctx, *args, **kwargs)
        if setup is not None and not _takes_ctx(cls.forward):
            cls.setup_context(ctx, args, outputs)
        is_tuple = isinstance(outputs, tuple)
        outs = outputs if is_tuple else (outputs,)
        for i, o in enumerate(outs):
            if o is not None and not isinstance(o, Tensor):
                raise TypeError(f"{cls.__name__}.forward must return Tensors (or a tuple of "
                                f"them); output {i} is {type(o).__name__}")
        record = is_grad_enabled() and any(a.requires_grad for _, a in tensor_args)
        if not record:
            ctx._saved = tuple(ctx.to_save)
            return outputs
        inputs = [a for _, a in tensor_args]
        node = array_op(_FUNCTION, inputs, 0.0,
                        (cls, ctx, len(outs), [i for i, _ in tensor_args], len(args),
                         [(o.shape, o.dtype.np) if o is not None else None for o in outs]))
        recorded = []
        for i, o in enumerate(outs):
            if o is None or id(o) in ctx.non_differentiable or not o.dtype.is_floating_point:
                recorded.append(o)
                continue
            recorded.append(array_op(_FUNCTION_OUT, [node], o._d, (i,)))
        swap = {id(o): r for o, r in zip(outs, recorded) if o is not None}
        ctx._saved = tuple(swap.get(id(t), t) for t in ctx.to_save)
        return tuple(recorded) if is_tuple else recorded[0]


def _takes_ctx(fn):
    import inspect
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return True
    return bool(params) and params[0] == "ctx"


def once_differentiable(fn):
    """Mark a backward as not differentiable itself: under create_graph it runs without
    recording (its results are constants)."""
    @functools.wraps(fn)
    def wrapper(ctx, *grads):
        with no_grad():
            return fn(ctx, *grads)
    wrapper._once_differentiable = True
    return wrapper


def _call_backward(recorded, grads, aux):
    """The user's backward for a ``function`` entry; gradients per tensor input (tensors
    when ``recorded``, for create_graph; plain values otherwise)."""
    cls, ctx, n_out, tensor_positions, n_args, metas = aux
    gs = []
    for i in range(n_out):
        g = grads.get(i) if grads is not None else None
        if g is None and ctx.materialize_grads and metas[i] is not None:
            shape, dtype = metas[i]
            g = np.zeros(shape, dtype) if shape else 0.0
        if g is not None and not isinstance(g, Tensor):
            g = _plain(g if isinstance(g, float) or np.ndim(g) else float(g)) \
                if np.ndim(g) == 0 else _plain(np.asarray(g))
        gs.append(g)
    mode = enable_grad() if recorded else no_grad()
    with mode:
        res = cls.backward(ctx, *gs)
    res = res if isinstance(res, tuple) else (res,)
    if len(res) != n_args:
        raise RuntimeError(f"function {cls._backward_cls_name} returned an incorrect number of "
                           f"gradients (expected {n_args}, got {len(res)})")
    out = []
    for pos in tensor_positions:
        r = res[pos]
        if r is None:
            out.append(None)
        elif not isinstance(r, Tensor):
            raise TypeError(f"function {cls._backward_cls_name} returned a gradient of type "
                            f"{type(r).__name__} for input {pos}; return a Tensor or None")
        else:
            out.append(r if recorded else r._d)
    return tuple(out)


NpF.call_backward = functools.partial(_call_backward, False)
TensorF.call_backward = functools.partial(_call_backward, True)
_unused = (Part, _pyfloat)
