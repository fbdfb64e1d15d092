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

from ..functions import _rebind
from ..ops import BY_NAME
from ..tensor import Tensor, _plain, array_op, enable_grad, is_grad_enabled, no_grad
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
        self._dirty = ()
        self._unpack = None  # saved_tensors_hooks' unpack hook, when they packed _saved
        self._versions = ()  # per saved tensor: (its data, version box, version) when saved

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
        if self._unpack is not None:
            return tuple(None if p is None else self._unpack(p) for p in self._saved)
        for t, v in zip(self._saved, self._versions):
            # changed in place since it was saved (rebound by an op with grad, written
            # under no_grad): torch raises, and the tensor no longer holds the saved value
            if v is not None and (t._d is not v[0] or getattr(t, "_ver", None) is not v[1]
                                  or (v[1] is not None and v[1][0] != v[2])):
                from ._versions import _version_error
                box = getattr(t, "_ver", None)
                _version_error(t, box[0] if box is v[1] and box is not None else v[2] + 1,
                               v[2])
        return self._saved

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable.update(id(t) for t in tensors)

    def mark_dirty(self, *tensors):
        """Declare inputs that ``forward`` modified in place; each must be returned as an
        output, and becomes that output (its ``grad_fn`` is this Function's node)."""
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(f"mark_dirty expects Tensors, but argument {i} is "
                                f"{type(t).__name__}")
        self._dirty = tensors

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
        # where each input sat on the tape: an input forward modifies in place (mark_dirty)
        # is recorded as the value it was, then rebound to the output
        before = [(a, a._tape, a._sid, a._slot) for _, a in tensor_args]
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
        dirty = {id(t) for t in ctx._dirty}
        for t in ctx._dirty:
            if all(o is not t for o in outs):
                raise RuntimeError(f"{cls.__name__}.forward marked a tensor dirty "
                                   "(ctx.mark_dirty) that it does not return: return every "
                                   "tensor it modified in place as an output")
            if record and t.requires_grad and t.is_leaf:
                raise RuntimeError("a leaf Variable that requires grad has been used in an "
                                   f"in-place operation ({cls.__name__} with "
                                   "ctx.mark_dirty). Pass a clone (x.clone()) or modify it "
                                   "inside tapegrad.no_grad().")
        if not record:
            _save(ctx, tuple(ctx.to_save))
            return outputs
        for a, tape, sid, slot in before:
            if id(a) in dirty and tape is not None:
                a._tape, a._sid, a._slot = tape, sid, slot
        inputs = [a for _, a in tensor_args]
        node = array_op(_FUNCTION, inputs, 0.0,
                        (cls, ctx, len(outs), [i for i, _ in tensor_args], len(args),
                         [(o.shape, o.dtype.np) if o is not None else None for o in outs]))
        recorded = []
        for i, o in enumerate(outs):
            if o is None or id(o) in ctx.non_differentiable or not o.dtype.is_floating_point:
                recorded.append(o)
                continue
            r = array_op(_FUNCTION_OUT, [node], o._d, (i,))
            if id(o) in dirty:  # the modified input becomes this output, as in torch
                _rebind(o, r)
                r = o
            recorded.append(r)
        swap = {id(o): r for o, r in zip(outs, recorded) if o is not None}
        _save(ctx, tuple(swap.get(id(t), t) for t in ctx.to_save))
        return tuple(recorded) if is_tuple else recorded[0]


def _save(ctx, tensors):
    """Keep what forward saved; inside ``saved_tensors_hooks``, as its pack hook made it."""
    from .graph import current_saved_hooks
    hooks = current_saved_hooks()
    if hooks is None:
        ctx._saved = tensors
        ctx._versions = tuple(None if t is None else
                              (t._d, getattr(t, "_ver", None), getattr(t, "_ver", [0])[0])
                              for t in tensors)
        return
    ctx._saved = tuple(None if t is None else hooks.pack_hook(t) for t in tensors)
    ctx._unpack = hooks.unpack_hook


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
    if len(res) > n_args and all(r is None for r in res[n_args:]):
        res = res[:n_args]  # torch accepts extra trailing Nones
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


def call_backward(F, grads, aux):
    """The rule of a ``function`` entry (registered in ops/arrays.py): recorded, and so
    differentiable again, when the sweep runs it on the tensor backend (create_graph)."""
    return _call_backward(F is TensorF, grads, aux)
