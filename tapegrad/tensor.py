"""Tensor, dtypes, factories, grad modes, and the recorder that puts ops on the tape."""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
import warnings
import weakref

import numpy as np

from .ops import ARRAY, BY_NAME, UNARY_C, const_ops
from .tape import STATE, bump, current_tape, set_grad_mode

_FUNCTION_OUT = BY_NAME["function_out"].code

# ---------------------------------------------------------------------------------------
# dtypes


class dtype:
    """A tensor element type (wraps a NumPy dtype; prints like torch's)."""

    __slots__ = ("name", "np", "is_floating_point", "is_complex", "itemsize")

    def __init__(self, name, np_dtype):
        self.name = name
        self.np = np.dtype(np_dtype)
        self.is_floating_point = self.np.kind == "f"
        self.is_complex = self.np.kind == "c"
        self.itemsize = self.np.itemsize

    def __repr__(self):
        return f"tapegrad.{self.name}"

    def __reduce__(self):
        return (_dtype_by_name, (self.name,))


float16 = dtype("float16", np.float16)
float32 = dtype("float32", np.float32)
float64 = dtype("float64", np.float64)
complex64 = dtype("complex64", np.complex64)
complex128 = dtype("complex128", np.complex128)
uint8 = dtype("uint8", np.uint8)
int8 = dtype("int8", np.int8)
int16 = dtype("int16", np.int16)
int32 = dtype("int32", np.int32)
int64 = dtype("int64", np.int64)
bool_ = dtype("bool", np.bool_)

_DTYPES = {d.np: d for d in (float16, float32, float64, complex64, complex128, uint8, int8,
                             int16, int32, int64, bool_)}
_pyfloat, _pyint, _pybool = float, int, bool
# dtypes a repr leaves unsaid, as torch's (with float64 as the default dtype)
_REPR_DEFAULT = (np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.bool_))
_F64 = np.dtype(np.float64)


def _dtype_by_name(name):
    return _DTYPES[np.dtype(name)]


def _np_dtype(d):
    """NumPy dtype for a tapegrad/NumPy/Python dtype argument, or a TypeError."""
    if d is None:
        return None
    if isinstance(d, dtype):
        nd = d.np
    else:
        try:
            nd = np.dtype(d)
        except TypeError:
            raise TypeError(f"dtype must be a tapegrad dtype such as tapegrad.float64, "
                            f"got {d!r}") from None
    if nd not in _DTYPES:
        raise TypeError(f"tapegrad does not support dtype {nd}; use float64, float32, an "
                        "integer type or bool")
    if nd.kind == "c":
        raise TypeError("complex tensors are not supported by tapegrad yet; use float64 or "
                        "float32 (complex support is planned)")
    return nd


def _tg_dtype(nd):
    return _DTYPES[nd]


# ---------------------------------------------------------------------------------------
# grad modes (thread-local, like torch's)


def is_grad_enabled():
    """Whether ops record onto the tape in this thread."""
    return STATE.grad_enabled


def is_inference_mode_enabled():
    return STATE.inference


class _GradMode:
    """Base for grad-mode context managers; each is also a function decorator (with or
    without parentheses, generators included)."""

    def __new__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not isinstance(args[0], _pybool):
            return cls()(args[0])  # used as @decorator without parentheses
        return super().__new__(cls)

    def _enter_mode(self):
        raise NotImplementedError

    def __enter__(self):
        self._prev = (STATE.grad_enabled, STATE.inference)
        self._enter_mode()
        return self

    def __exit__(self, *exc):
        set_grad_mode(self._prev[0])
        STATE.inference = self._prev[1]
        return False

    def __call__(self, fn):
        make = self.clone
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def generator(*args, **kwargs):
                gen = fn(*args, **kwargs)
                with make():
                    value = next(gen)
                while True:
                    try:
                        sent = yield value
                    except GeneratorExit:
                        with make():
                            gen.close()
                        raise
                    except BaseException as e:  # noqa: BLE001  thrown into the generator
                        with make():
                            value = gen.throw(e)
                    else:
                        try:
                            with make():
                                value = gen.send(sent)
                        except StopIteration as stop:
                            return stop.value
            return generator

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with make():
                return fn(*args, **kwargs)
        return wrapper

    def _args(self):
        return ()

    def clone(self):
        return self.__class__(*self._args())


class no_grad(_GradMode):
    """Context manager / decorator: ops in it do not record."""

    def _enter_mode(self):
        set_grad_mode(False)


class enable_grad(_GradMode):
    """Context manager / decorator: ops in it record (inside ``no_grad`` too)."""

    def _enter_mode(self):
        set_grad_mode(True)


class set_grad_enabled(_GradMode):
    """Sets grad mode at once (as a function), or for a ``with`` block or a decorated
    function (decorating restores the mode it had before)."""

    def __new__(cls, mode):
        return object.__new__(cls)

    def __init__(self, mode):
        if not isinstance(mode, _pybool):
            raise TypeError(f"set_grad_enabled expects a bool, got {type(mode).__name__}")
        self.mode = mode
        self._prev = (STATE.grad_enabled, STATE.inference)
        set_grad_mode(mode)

    def _enter_mode(self):
        set_grad_mode(self.mode)

    def __enter__(self):
        return self

    def __call__(self, fn):
        set_grad_mode(self._prev[0])
        STATE.inference = self._prev[1]
        return super().__call__(fn)

    def clone(self):
        return _SetGradMode(self.mode)

    def _args(self):
        return (self.mode,)


class _SetGradMode(_GradMode):
    def __new__(cls, mode):
        return object.__new__(cls)

    def __init__(self, mode):
        self.mode = mode

    def _enter_mode(self):
        set_grad_mode(self.mode)


class inference_mode(_GradMode):
    """Like ``no_grad`` (tapegrad has no separate inference tensors)."""

    def __init__(self, mode=True):
        self.mode = mode

    def _enter_mode(self):
        if self.mode:
            set_grad_mode(False)
            STATE.inference = True

    def _args(self):
        return (self.mode,)


# ---------------------------------------------------------------------------------------
# Tensor


class Size(tuple):
    """A tensor's shape: a tuple that prints as ``tapegrad.Size([4, 2])`` (torch.Size)."""

    __slots__ = ()

    def __repr__(self):
        return f"tapegrad.Size({list(self)})"

    __str__ = __repr__

    def __getitem__(self, i):
        r = tuple.__getitem__(self, i)
        return Size(r) if isinstance(i, slice) else r

    def numel(self):
        return math.prod(self)

    def __reduce__(self):
        return (Size, (tuple(self),))


_SIZE0 = Size()
# per tape: {entry: (opcode, torch name)} for entries whose op alone does not say which torch
# function made them (squeeze and view both record ``reshape``); read by graph.entry_name
_HINTS = weakref.WeakKeyDictionary()


def _hint(t, name):
    """Name ``t``'s node as torch would (``t``: the result just recorded); returns ``t``."""
    tape = t._tape
    if tape is not None:
        h = _HINTS.get(tape)
        if h is None:
            h = _HINTS[tape] = {}
        h[t._slot] = (tape.code[t._slot * 5], name)
    return t


_NODES = weakref.WeakValueDictionary()  # (id(tape), entry) -> its live _GradFn


class _GradFn:
    """What ``Tensor.grad_fn`` returns: the node of the tape entry that made a tensor
    (``torch.autograd.graph.Node``: name, next_functions, metadata, hooks, saved values)."""

    __slots__ = ("_tape", "_slot", "__weakref__")

    def __new__(cls, tape, slot):
        # one object per (tape, entry) while anyone holds it: y.grad_fn is y.grad_fn, as in
        # torch (a live node holds its tape, so the tape's id is not reused meanwhile)
        key = (id(tape), slot)
        node = _NODES.get(key)
        if node is None or node._tape is not tape:
            node = object.__new__(cls)
            node._tape, node._slot = tape, slot
            _NODES[key] = node
        return node

    def name(self):
        from .autograd.graph import entry_name
        return entry_name(self._tape, self._slot)

    @property
    def next_functions(self):
        from .autograd.graph import next_functions
        return next_functions(self._tape, self._slot)

    @property
    def metadata(self):
        from .autograd.graph import node_state
        return node_state(self._tape, self._slot)["metadata"]

    def register_hook(self, fn):
        """``fn(grad_inputs, grad_outputs)`` after this node ran; it may return new
        grad_inputs."""
        from .autograd.graph import _add, node_state
        return _add(node_state(self._tape, self._slot)["post"], fn)

    def register_prehook(self, fn):
        """``fn(grad_outputs)`` before this node runs; it may return new grad_outputs."""
        from .autograd.graph import _add, node_state
        return _add(node_state(self._tape, self._slot)["pre"], fn)

    def __getattr__(self, name):
        if name in ("_saved_self", "_saved_other", "_saved_result"):
            from .autograd.graph import saved
            return saved(self._tape, self._slot, name)
        raise AttributeError(f"'{self.name()}' object has no attribute '{name}'")

    def __repr__(self):
        return f"<{self.name()} object at {id(self):#x}>"

    def __eq__(self, other):
        return (isinstance(other, _GradFn) and other._tape is self._tape
                and other._slot == self._slot)

    def __hash__(self):
        return hash((id(self._tape), self._slot))


class Tensor:
    """A value that may sit on the tape. NumPy-backed; 0-d float64 values are Python floats.

    Examples
    --------
    >>> import tapegrad
    >>> x = tapegrad.tensor(2.0, requires_grad=True)
    >>> (x * x).backward()
    >>> x.grad.item()
    4.0
    """

    # _d: value (Python float for 0-d float64, else ndarray); _rg: requires grad;
    # _tape/_slot: the tape entry that made a non-leaf (None/-1 for leaves);
    # _sid: sid of the tape whose slot _slot is valid (leaves: cache of their entering);
    # _ver: [version] shared with views (arrays only)
    __slots__ = ("_d", "_rg", "_tape", "_sid", "_slot", "_ver", "_grad", "_retains", "_view",
                 "_alias", "_hooks", "_param", "__weakref__")
    __array_priority__ = 1000
    # No __init__: ``Tensor()`` is the recorder's constructor (the C one, 30 ns cheaper per op
    # than object.__new__(Tensor)); users make tensors with tapegrad.tensor(data, ...) or a
    # factory, and Tensor(data) raises TypeError.

    # -- basic properties ----------------------------------------------------------------
    @property
    def shape(self):
        d = self._d
        return _SIZE0 if d.__class__ is _pyfloat else Size(d.shape)

    def size(self, dim=None):
        s = self.shape
        return s if dim is None else s[_dim(dim, len(s))]

    def numel(self):
        d = self._d
        return 1 if d.__class__ is _pyfloat else d.size

    nelement = numel

    @property
    def ndim(self):
        d = self._d
        return 0 if d.__class__ is _pyfloat else d.ndim

    def dim(self):
        return self.ndim

    @property
    def dtype(self):
        d = self._d
        return float64 if d.__class__ is _pyfloat else _DTYPES[d.dtype]

    @property
    def device(self):
        return "cpu"

    def is_floating_point(self):
        return self.dtype.is_floating_point

    def is_complex(self):
        return False

    @property
    def requires_grad(self):
        return self._rg

    @requires_grad.setter
    def requires_grad(self, value):
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad=True):
        if not isinstance(requires_grad, _pybool):
            raise TypeError("requires_grad must be a bool")
        if self._tape is not None:
            if not requires_grad:
                raise RuntimeError(
                    "you can only change requires_grad flags of leaf variables. If you want to "
                    "use a computed variable in a subgraph that doesn't require differentiation "
                    "use var_no_grad = var.detach().")
            return self
        if requires_grad and not self.dtype.is_floating_point:
            raise RuntimeError("only Tensors of floating point and complex dtype can require "
                               f"gradients (this tensor is {self.dtype}); convert it first, "
                               "e.g. t.double().requires_grad_()")
        self._rg = requires_grad
        self._sid = -1
        return self

    @property
    def is_leaf(self):
        return self._tape is None

    @property
    def grad_fn(self):
        tape = self._tape
        if tape is None:
            return None
        k = self._slot
        if tape.code[k * 5] & ~ARRAY == _FUNCTION_OUT:  # a custom Function's output: its node
            return _GradFn(tape, k - int(tape.code[k * 5 + 1]))
        return _GradFn(tape, k)

    # -- hooks (the sweep calls them: autograd/hooks.py) -----------------------------------
    def register_hook(self, hook):
        """``hook(grad)`` when this tensor's gradient is computed; returning a tensor
        replaces the gradient (torch.Tensor.register_hook)."""
        if not self._rg:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require "
                               "gradient")
        from .autograd.graph import _add, leaf_hooks, node_state
        if self._tape is None:
            return _add(leaf_hooks(self, "tensor", create=True), hook)
        return _add(node_state(self._tape, self._slot)["tensor"], hook)

    def register_post_accumulate_grad_hook(self, hook):
        """``hook(tensor)`` after ``backward`` accumulated into this leaf's ``.grad``."""
        if not self._rg:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require "
                               "gradient")
        if self._tape is not None:
            raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf "
                               "tensors")
        from .autograd.graph import _add, leaf_hooks
        return _add(leaf_hooks(self, "post", create=True), hook)

    @property
    def grad(self):
        g = getattr(self, "_grad", None)
        if g is None and self._tape is not None and not getattr(self, "_retains", False):
            warnings.warn(
                "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. "
                "Its .grad attribute won't be populated during autograd.backward(). If you "
                "indeed want the .grad field to be populated for a non-leaf Tensor, use "
                ".retain_grad() on the non-leaf Tensor. If you access the non-leaf Tensor by "
                "mistake, make sure you access the leaf Tensor instead.", UserWarning,
                stacklevel=2)
        return g

    @grad.setter
    def grad(self, value):
        if value is not None:
            if not isinstance(value, Tensor):
                raise TypeError(f"assigned grad expected to be a Tensor or None but got grad "
                                f"of type {type(value).__name__}")
            if value.shape != self.shape:
                raise RuntimeError(f"assigned grad has data of a different size: grad shape "
                                   f"{list(value.shape)}, tensor shape {list(self.shape)}")
            if value.dtype is not self.dtype:
                raise RuntimeError(f"assigned grad has data of a different type: grad is "
                                   f"{value.dtype}, tensor is {self.dtype}")
        self._grad = value

    @grad.deleter
    def grad(self):
        self._grad = None

    @property
    def retains_grad(self):
        return self._tape is not None and getattr(self, "_retains", False)

    def retain_grad(self):
        if not self._rg:
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
        if self._tape is not None and not getattr(self, "_retains", False):
            import weakref
            self._retains = True
            self._tape.retained[self._slot] = weakref.ref(self)

    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, value):
        if not isinstance(value, Tensor):
            raise TypeError("Tensor.data must be set to a Tensor")
        self._set_value(value._d if value._d.__class__ is _pyfloat else value._d)

    def detach(self):
        d = self._d
        t = _plain(d)
        if d.__class__ is not _pyfloat:
            t._ver = self._ver  # shares memory, and so the version counter
        tr = STATE.trace
        if tr is not None:  # tracing: the value is recomputed at replay, without gradient
            return tr.on_detach(t, self)
        return t

    def detach_(self):
        if self._tape is not None and getattr(self, "_retains", False):
            self._tape.retained.pop(self._slot, None)
        self._tape = None
        self._rg = False
        self._sid = -1
        self._slot = -1
        return self

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """Accumulate d(self)/d(leaf) into the leaves' ``.grad`` (``autograd.backward``)."""
        from .autograd import backward
        backward(self, gradient, retain_graph, create_graph, inputs=inputs)

    # -- conversion ---------------------------------------------------------------------
    def item(self):
        tr = STATE.trace
        if tr is not None:
            tr.on_escape(self, "item()")
        d = self._d
        if d.__class__ is _pyfloat:
            return d
        if d.size != 1:
            raise RuntimeError(f"a Tensor with {d.size} elements cannot be converted to Scalar")
        return d.reshape(()).item()

    def numpy(self, *, force=False):
        tr = STATE.trace
        if tr is not None:
            force = force or id(self) in tr.detached
        # as torch, only while grad mode is on (a custom Function's forward may call it)
        if self._rg and not force and STATE.grad_enabled:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use "
                               "tensor.detach().numpy() instead.")
        if tr is not None:
            tr.on_escape(self, "numpy()")
        d = self._d
        return np.array(d) if d.__class__ is _pyfloat else d

    def tolist(self):
        tr = STATE.trace
        if tr is not None:
            tr.on_escape(self, "tolist()")
        d = self._d
        return d if d.__class__ is _pyfloat else d.tolist()

    def __array__(self, dtype=None, copy=None):
        tr = STATE.trace
        if self._rg and STATE.grad_enabled and (tr is None or id(self) not in tr.detached):
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use "
                               "tensor.detach().numpy() instead.")
        if tr is not None:
            tr.on_escape(self, "numpy.asarray()")
        d = self._d
        a = np.array(d) if d.__class__ is _pyfloat else d
        if dtype is not None:
            a = a.astype(dtype)
        return a

    def __array_wrap__(self, array, context=None, return_scalar=False):
        # a NumPy function of a tensor gives a tensor that requires no grad, as torch's does
        # (NumPy 2's signature: the two-argument one is deprecated)
        return tensor(array)

    def __float__(self):
        tr = STATE.trace
        if tr is not None:
            tr.on_escape(self, "float()")
            with tr.quiet():
                return _pyfloat(self.item())
        return _pyfloat(self.item())

    def __int__(self):
        tr = STATE.trace
        if tr is not None:
            tr.on_escape(self, "int()")
            with tr.quiet():
                return _pyint(self.item())
        return _pyint(self.item())

    def __index__(self):
        if self.dtype.is_floating_point or self.numel() != 1:
            raise TypeError("only integer tensors of a single element can be converted to an "
                            "index")
        return _pyint(self.item())

    def __bool__(self):
        tr = STATE.trace
        if tr is not None:
            b = tr.on_bool(self)
            if b is not None:
                return b
        d = self._d
        if d.__class__ is _pyfloat:
            return d != 0.0
        if d.size != 1:
            raise RuntimeError(f"Boolean value of Tensor with more than one value is "
                               f"ambiguous ({d.size} elements); use .any() or .all()")
        return _pybool(d.reshape(()).item())

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def __hash__(self):
        return id(self)

    def __repr__(self):
        try:
            d = self._d
        except AttributeError:  # made by calling Tensor() directly
            return ("<empty tapegrad.Tensor: make tensors with tapegrad.tensor(data) or a "
                    "factory such as tapegrad.zeros>")
        from . import _format
        a = np.asarray(d)
        extra = []
        if a.size == 0:
            if a.ndim != 1:
                extra.append(f"size={tuple(a.shape)}")
            if a.dtype != _F64:
                extra.append(f"dtype={self.dtype}")
        elif a.dtype not in _REPR_DEFAULT:
            extra.append(f"dtype={self.dtype}")
        if self._tape is not None:
            extra.append(f"grad_fn=<{self.grad_fn.name()}>")
        elif self._rg:
            extra.append("requires_grad=True")
        text = _format.with_suffixes("tensor(" + _format.body(a, 7), extra, 7)
        if getattr(self, "_param", False):
            return "Parameter containing:\n" + text
        return text

    def __reduce__(self):
        return (tensor, (self.tolist(), self.dtype, self._rg))

    # -- internal -----------------------------------------------------------------------
    def _set_value(self, value):
        """Replace the value in place (no recording); invalidates cached tape entries."""
        if value.__class__ is not _pyfloat:
            value = np.asarray(value)
            if value.shape == () and value.dtype == _F64:
                value = _pyfloat(value)
        self._d = value
        self._sid = -1
        if value.__class__ is not _pyfloat:
            ver = getattr(self, "_ver", None)
            if ver is None:
                self._ver = [0]
            else:
                bump(ver)



def _plain(value):
    """A tensor that does not require grad, holding ``value`` (float or ndarray)."""
    t = Tensor()
    t._d = value
    t._rg = False
    t._tape = None
    t._sid = -1
    t._slot = -1
    if value.__class__ is not _pyfloat:
        t._ver = [0]
    return t


def _leaf(value, requires_grad):
    t = _plain(value)
    if requires_grad:
        if value.__class__ is not _pyfloat and value.dtype.kind != "f":
            raise RuntimeError("Only Tensors of floating point and complex dtype can require "
                               f"gradients (got {_DTYPES[value.dtype]}); create the tensor with "
                               "a floating dtype, e.g. dtype=tapegrad.float64")
        t._rg = True
    return t


def _norm_value(v):
    """0-d float64 results become Python floats; NumPy scalars become arrays."""
    c = v.__class__
    if c is _pyfloat:
        return v
    if c is np.float64:
        return _pyfloat(v)
    v = np.asarray(v)
    if v.ndim == 0 and v.dtype == _F64:
        return _pyfloat(v)
    return v


# ---------------------------------------------------------------------------------------
# the recorder


def _record(code, x, y, c0, c1, value, aux=None):
    """Append one entry (inputs ``x``, ``y`` or None) and return its output tensor."""
    tape = STATE.tape()
    if tape is None or len(tape.vals) >= tape.limit:
        tape = current_tape()
    sid = tape.sid
    a = x._slot if x._sid == sid else tape.enter(x)
    if y is None:
        b = -1
    else:
        b = y._slot if y._sid == sid else tape.enter(y)
    if value.__class__ is _pyfloat:
        vals = tape.vals
        k = len(vals)
        vals.append(value)
        tape.code += (code, k - a, 0 if b < 0 else k - b, c0, c1)
        if aux is not None:
            tape.aux[k] = aux
    else:
        k = tape.append(code, a, b, c0, c1, value, aux)
    t = Tensor()
    t._d = value
    t._rg = True
    t._tape = tape
    t._sid = sid
    t._slot = k
    if value.__class__ is not _pyfloat:
        t._ver = [0]
    return t


def _record_nary(op, inputs, value, aux_rest):
    tape = current_tape()
    sid = tape.sid
    slots = [t._slot if t._sid == sid else tape.enter(t) for t in inputs]
    k = tape.append(op.code | ARRAY, -1, -1, 0.0, 0.0, value, (slots,) + aux_rest)
    tape.nary.append(k)
    t = Tensor()
    t._d, t._rg, t._tape, t._sid, t._slot = value, True, tape, sid, k
    if value.__class__ is not _pyfloat:
        t._ver = [0]
    return t


def _errstate():
    return np.errstate(all="ignore")


try:  # NumPy 2: errstate sets a context variable; setting it directly costs a tenth
    from numpy._core._ufunc_config import _extobj_contextvar, _make_extobj
    _QUIET = _make_extobj(all="ignore")

    def quiet(f, *args):
        """``f(*args)`` with NumPy's floating-point warnings off (torch warns of none)."""
        token = _extobj_contextvar.set(_QUIET)
        try:
            return f(*args)
        finally:
            _extobj_contextvar.reset(token)
except (ImportError, AttributeError, TypeError):  # NumPy 1.x
    def quiet(f, *args):
        """``f(*args)`` with NumPy's floating-point warnings off (torch warns of none)."""
        with np.errstate(all="ignore"):
            return f(*args)


# ops that keep an integer tensor integer (the rest compute in the default float dtype)
_INT_PRESERVING = frozenset(("neg", "abs", "sign", "square", "clone", "addc", "mulc", "rsubc",
                             "clamp", "relu"))


def _bool_error(exc, msg):
    def f(d):
        raise exc(msg)
    return f


# torch's results on a bool tensor where they are not "compute in the default float dtype"
_BOOL_RULES = {
    "neg": _bool_error(RuntimeError, "Negation, the `-` operator, on a bool tensor is not "
                       "supported. If you are trying to invert a mask, use the `~` or "
                       "`logical_not()` operator instead."),
    "relu": _bool_error(RuntimeError, "Boolean inputs not supported for relu"),
    "abs": _bool_error(NotImplementedError, "\"abs_cpu\" not implemented for 'Bool'"),
    "sign": lambda d: d.copy(),
    "square": lambda d: d.astype(np.int64),
}


def unary(op, x, c0=0.0, c1=0.0):
    """Apply elementwise ``op`` to tensor ``x`` (constants ``c0``, ``c1`` for unary_c ops)."""
    d = x._d
    if d.__class__ is _pyfloat:
        v = op.py(d, c0, c1) if op.kind == UNARY_C else op.py(d)
        if x._rg and STATE.grad_enabled:
            return _record(op.code, x, None, c0, c1, v)
        if STATE.trace is not None:  # a traced comparison's result, say: recorded
            return STATE.trace.plain_op(lambda a: unary(op, a, c0, c1), (x,), _plain(v))
        return _plain(v)
    if d.dtype.kind == "b" and op.name in _BOOL_RULES:
        return _plain(_BOOL_RULES[op.name](d))
    if d.dtype.kind != "f" and not (
            op.name in _INT_PRESERVING and d.dtype.kind in "iu"
            or op.name == "clone" and d.dtype.kind == "b"):
        d = d.astype(np.float64)  # e.g. exp of an integer tensor is floating, as in torch
    # quiet: NumPy's warnings off through its context variable, a tenth of an errstate
    v = quiet(op.np, d, c0, c1) if op.kind == UNARY_C else quiet(op.np, d)
    v = _norm_value(v)
    if v.__class__ is not _pyfloat and v.dtype != d.dtype and d.dtype.kind == "f":
        v = v.astype(d.dtype)
    if x._rg and STATE.grad_enabled:
        return _record(op.code | ARRAY, x, None, c0, c1, v)
    if STATE.trace is not None:
        return STATE.trace.plain_op(lambda a: unary(op, a, c0, c1), (x,), _plain(v))
    return _plain(v)


def array_op(op, inputs, value, aux):
    """Wrap ``value``, the forward of array op ``op`` on ``inputs``, recording when needed."""
    value = _norm_value(value)
    if STATE.grad_enabled:
        for t in inputs:
            if t._rg:
                if op.nary:
                    return _record_nary(op, inputs, value, aux)
                return _record(op.code | ARRAY, inputs[0],
                               inputs[1] if len(inputs) > 1 else None, 0.0, 0.0, value, aux)
    if STATE.trace is not None:  # e.g. the count of a traced mask: recorded
        return STATE.trace.plain_op(lambda *ins: array_op(op, list(ins), value, aux), inputs,
                                    _plain(value))
    return _plain(value)


# binary ops with a float-constant variant (each op's ``const`` in the registry): name ->
# (x op c, c op x) as (op, sign of c)
_CONST_OPS = const_ops()
_NUMBER = (_pyfloat, _pyint, _pybool)
_CAST = BY_NAME["cast"]
_ADDC = BY_NAME["addc"]


def _addc_name(r, op, c):
    """``x + c`` and ``x - c`` record one op (``addc``), named by the sign of its constant
    ``c``; hint torch's name where that sign says otherwise (``x + (-2.0)``, ``x - 0.0``)."""
    if (c < 0) != (op.name == "sub"):
        _hint(r, "SubBackward0" if op.name == "sub" else "AddBackward0")
    return r
_NUM_FAST = (_pyfloat, _pyint)  # a bool operand takes the slow path (bool - x raises)


def _cat(nd):
    k = nd.kind
    return 0 if k == "b" else 1 if k in "iu" else 2 if k == "f" else 3


def promote_types(a, b):
    """torch.promote_types on NumPy dtypes: within a category (bool, integer, floating,
    complex) as NumPy; across categories the higher one's dtype (int64 with float32 is
    float32, where NumPy gives float64), complex widened to the float's precision."""
    if a is b or a == b:
        return a
    ca, cb = _cat(a), _cat(b)
    if ca == cb or ca + cb == 5:  # complex with float: NumPy's rule is torch's
        return np.result_type(a, b)
    return a if ca > cb else b


#: dtypes by name as torch's error messages spell them
TORCH_NAMES = {"bool": "Bool", "uint8": "Byte", "int8": "Char", "int16": "Short",
               "int32": "Int", "int64": "Long", "float16": "Half", "float32": "Float",
               "float64": "Double", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}


def result_dtype(*operands):
    """torch.result_type: dimensioned tensors win over 0-d ones and Python numbers of the
    same category; a 0-d tensor of a higher category gives its dtype, a Python number of a
    higher category the default dtype of its category (float64: tapegrad's default)."""
    dims = zeros = None
    num_cat = -1
    for o in operands:
        if o.__class__ is Tensor:
            d = o._d
            if d.__class__ is _pyfloat:
                zeros = _F64 if zeros is None else promote_types(zeros, _F64)
            elif d.ndim:
                dims = d.dtype if dims is None else promote_types(dims, d.dtype)
            else:
                zeros = d.dtype if zeros is None else promote_types(zeros, d.dtype)
        elif isinstance(o, _pybool):
            num_cat = max(num_cat, 0)
        elif isinstance(o, numbers.Integral):
            num_cat = max(num_cat, 1)
        elif isinstance(o, numbers.Complex) and not isinstance(o, numbers.Real):
            num_cat = 3
        else:
            num_cat = max(num_cat, 2)
    r = dims
    if zeros is not None and (r is None or _cat(zeros) > _cat(r)):
        r = zeros
    if num_cat >= 0 and (r is None or num_cat > _cat(r)):
        if num_cat == 3 and r is not None and r.kind == "f":
            r = np.result_type(r, np.complex64)  # float32 with 1j: complex64, as torch
        else:
            r = (np.dtype(np.bool_), np.dtype(np.int64), _F64, np.dtype(np.complex128))[num_cat]
    return r


def _to_tensor(y, like=None):
    if y.__class__ is Tensor or isinstance(y, Tensor):
        return y
    if isinstance(y, (np.ndarray, list, tuple)) or isinstance(y, np.generic):
        return tensor(y)
    raise TypeError(f"unsupported operand type: {type(y).__name__}; expected a Tensor, a "
                    "Python number or a NumPy array")


def _plain_s(v):
    t = Tensor()
    t._d = v
    t._rg = False
    t._tape = None
    t._sid = -1
    t._slot = -1
    return t


def _rec_s(code, x, y, c0, v):
    """``_record`` for the hot path: scalar entry, float value, no aux."""
    tape = STATE.tape()
    if tape is None or len(tape.vals) >= tape.limit:
        tape = current_tape()
    sid = tape.sid
    a = x._slot if x._sid == sid else tape.enter(x)
    b = -1 if y is None else (y._slot if y._sid == sid else tape.enter(y))
    vals = tape.vals
    k = len(vals)
    vals.append(v)
    tape.code += (code, k - a, 0 if b < 0 else k - b, c0, 0.0)
    t = Tensor()
    t._d = v
    t._rg = True
    t._tape = tape
    t._sid = sid
    t._slot = k
    return t


_FLOAT_ONLY = frozenset(("div", "pow", "atan2"))


def binary(op, x, y):
    """Apply elementwise binary ``op`` (x, y: tensors or Python numbers; one a tensor)."""
    xc, yc = x.__class__, y.__class__
    if xc is Tensor and yc is Tensor:
        xd, yd = x._d, y._d
        if xd.__class__ is _pyfloat and yd.__class__ is _pyfloat:
            v = op.py(xd, yd)
            if STATE.grad_enabled and (x._rg or y._rg):
                return _record(op.code, x, y, 0.0, 0.0, v)
            return _plain(v)
    elif xc is Tensor and yc in _NUM_FAST:
        xd = x._d
        if xd.__class__ is _pyfloat:
            v = op.py(xd, _pyfloat(y))
            if x._rg and STATE.grad_enabled:
                forms = _CONST_OPS.get(op.name)
                if forms is not None:
                    cop, sgn = forms[0]
                    if cop is _ADDC:
                        return _addc_name(_record(cop.code, x, None, sgn * y, 0.0, v), op,
                                          sgn * y)
                    return _record(cop.code, x, None, sgn * y, 0.0, v)
                return _record(op.code, x, _plain(_pyfloat(y)), 0.0, 0.0, v)
            return _plain(v)
    elif yc is Tensor and xc in _NUM_FAST:
        yd = y._d
        if yd.__class__ is _pyfloat:
            v = op.py(_pyfloat(x), yd)
            if y._rg and STATE.grad_enabled:
                forms = _CONST_OPS.get(op.name)
                if forms is not None:
                    cop, sgn = forms[1]
                    if cop is _ADDC:
                        return _addc_name(_record(cop.code, y, None, sgn * x, 0.0, v), op,
                                          sgn * x)
                    return _record(cop.code, y, None, sgn * x, 0.0, v)
                return _record(op.code, _plain(_pyfloat(x)), y, 0.0, 0.0, v)
            return _plain(v)
    return _binary_general(op, x, y)


_ND = np.ndarray


def _binary_general(op, x, y):
    xv = x._d if x.__class__ is Tensor else x
    yv = y._d if y.__class__ is Tensor else y
    xc, yc = xv.__class__, yv.__class__
    # fast path: float arrays of one dtype, or a float64 array beside a Python number
    if xc is _ND and xv.dtype.kind == "f" and (
            (yc is _ND and yv.dtype is xv.dtype)
            or (yc in _NUM_FAST and (xv.dtype is _F64 or y.__class__ is not Tensor))) \
            or yc is _ND and yv.dtype.kind == "f" and xc in _NUM_FAST and (
                yv.dtype is _F64 or x.__class__ is not Tensor):
        try:
            v = quiet(op.np, xv, yv)  # torch gives inf and nan quietly
        except ValueError:
            return _binary_slow(op, x, y)
        if v.ndim == 0:
            return _binary_slow(op, x, y)
        if x.__class__ is Tensor and y.__class__ is Tensor and (x._rg or y._rg) \
                and STATE.grad_enabled:  # two tensors: _record_binary's last case, direct
            return _record(op.code | ARRAY, x, y, 0.0, 0.0, v)
        return _record_binary(op, x, y, v)
    return _binary_slow(op, x, y)


def _record_binary(op, x, y, v):
    """Wrap array result ``v`` of binary ``op`` (x, y: tensors or Python numbers), recording
    it when grad is on; a Python-number operand becomes the op's constant form."""
    xr = x.__class__ is Tensor and x._rg
    yr = y.__class__ is Tensor and y._rg
    if not ((xr or yr) and STATE.grad_enabled):
        if STATE.trace is not None:
            return STATE.trace.plain_op(lambda a, b: _record_binary(op, a, b, v),
                                        (x, y), _plain(v))
        return _plain(v)
    forms = _CONST_OPS.get(op.name)
    if not yr and forms is not None and y.__class__ in _NUMBER:
        cop, sgn = forms[0]
        r = _record(cop.code | ARRAY, x, None, sgn * _pyfloat(y), 0.0, v)
        return _addc_name(r, op, sgn * _pyfloat(y)) if cop is _ADDC else r
    if not xr and forms is not None and x.__class__ in _NUMBER:
        cop, sgn = forms[1]
        r = _record(cop.code | ARRAY, y, None, sgn * _pyfloat(x), 0.0, v)
        return _addc_name(r, op, sgn * _pyfloat(x)) if cop is _ADDC else r
    return _record(op.code | ARRAY, _as_operand(x), _as_operand(y), 0.0, 0.0, v)


def binary_fallback(op, x, y):
    """Binary ``op`` on anything but two 0-d float64 values (NotImplemented for foreign
    types, so Python can try the reflected operator)."""
    if (x.__class__ is Tensor or x.__class__ in _NUMBER) and \
            (y.__class__ is Tensor or y.__class__ in _NUMBER):
        return _binary_general(op, x, y)
    try:
        x = x if isinstance(x, Tensor) or x.__class__ in _NUMBER else _operand(x)
        y = y if isinstance(y, Tensor) or y.__class__ in _NUMBER else _operand(y)
    except TypeError:
        if isinstance(x, complex) or isinstance(y, complex):
            _complex_error(op, x, y)
        return NotImplemented
    return binary(op, x, y)


def _complex_error(op, x, y):
    z = x if isinstance(x, complex) else y
    raise TypeError(f"{op.torch or op.name}() with the complex number {z!r}: complex tensors "
                    "are not supported by tapegrad yet; use real numbers (float64 or float32)")


def _kind(x):
    """NumPy dtype kind of a binary op's operand (a tensor or a Python number)."""
    if x.__class__ is Tensor:
        d = x._d
        return "f" if d.__class__ is _pyfloat else d.dtype.kind
    return "b" if x.__class__ is _pybool else "i" if isinstance(x, numbers.Integral) else "f"


def _operand(x):
    if isinstance(x, numbers.Real):
        return x.item() if isinstance(x, np.generic) else _pyfloat(x)
    if isinstance(x, (np.ndarray, list, tuple)):
        return _to_tensor(x)
    raise TypeError(f"unsupported operand type: {type(x).__name__}")


def unary_fallback(op, x):
    if not isinstance(x, Tensor):
        raise TypeError(f"{op.torch or op.name}(): argument 'input' must be a Tensor, not "
                        f"{type(x).__name__}")
    return unary(op, x)


def _as_operand(x):
    return _plain_s(_pyfloat(x)) if x.__class__ in _NUMBER else x


def _binary_slow(op, x, y):
    if isinstance(x, complex) or isinstance(y, complex):
        _complex_error(op, x, y)
    if x.__class__ not in _NUMBER:
        x = _to_tensor(x)
    if y.__class__ not in _NUMBER:
        y = _to_tensor(y)
    rd = result_dtype(x, y)
    if op.name == "sub" and "b" in (_kind(x), _kind(y)):
        if _kind(x) == _kind(y):
            raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not "
                               "supported. Use the `^` or `logical_xor()` operator instead.")
        raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not "
                           "supported. If you are trying to invert a mask, use the `~` or "
                           "`logical_not()` operator instead.")
    if op.name == "pow" and rd.kind == "b":
        if x.__class__ is not Tensor or y.__class__ is Tensor:
            raise NotImplementedError("\"pow\" not implemented for 'Bool'")
        # bool tensor ** bool: x ** True is x, x ** False is True (torch keeps bool)
        v = np.asarray(x._d) if y else np.ones(np.shape(x._d), dtype=np.bool_)
        return _record_binary(op, x, y, np.array(v, dtype=np.bool_))
    if op.name in _FLOAT_ONLY and rd.kind != "f" and not (op.name == "pow" and rd.kind in "iu"):
        rd = _F64
    if op.name == "pow" and rd.kind in "iu":
        yv = y._d if y.__class__ is Tensor else y
        if np.any(np.asarray(yv) < 0):
            raise RuntimeError("Integers to negative integer powers are not allowed.")
    if rd.kind == "c":
        raise TypeError("complex tensors are not supported by tapegrad yet")
    xv = x._d if x.__class__ is Tensor else x
    yv = y._d if y.__class__ is Tensor else y
    if rd.kind in "iu":  # a Python int wraps into the integer dtype (uint8 + -1), as torch's
        xv = _wrap_int(xv, rd) if xv.__class__ is _pyint else xv
        yv = _wrap_int(yv, rd) if yv.__class__ is _pyint else yv
    if xv.__class__ is not _pyfloat and isinstance(xv, np.ndarray) and xv.dtype != rd:
        xv = xv.astype(rd)
    if yv.__class__ is not _pyfloat and isinstance(yv, np.ndarray) and yv.dtype != rd:
        yv = yv.astype(rd)
    if rd != _F64 and (xv.__class__ is _pyfloat or yv.__class__ is _pyfloat):
        # a float64 scalar beside a float32 array keeps float32, like torch's 0-d rule
        xv = np.asarray(xv, dtype=rd) if xv.__class__ is _pyfloat and x.__class__ is Tensor \
            else xv
        yv = np.asarray(yv, dtype=rd) if yv.__class__ is _pyfloat and y.__class__ is Tensor \
            else yv
    try:
        with np.errstate(all="ignore"):
            v = op.np(xv, yv)
    except ValueError as e:
        raise RuntimeError(
            f"The size of tensor a ({list(np.shape(xv))}) must match the size of tensor b "
            f"({list(np.shape(yv))}) for op '{op.name}': the shapes are not broadcastable "
            f"({e})") from None
    v = _norm_value(v)
    if v.__class__ is not _pyfloat and v.dtype != rd:
        v = v.astype(rd)
        v = _norm_value(v)
    if STATE.grad_enabled:
        # the op ran on its operands converted to its dtype, as torch's does: its rule must
        # read an input's value converted too (log of a float32 input of a float64 pow, a
        # float32 beside a float64 in maximum's tie test). A constant stays itself (a trace
        # follows it by identity; NumPy promotes it beside the gradient in the rule).
        if x.__class__ is Tensor and x._rg and x._d.__class__ is not _pyfloat \
                and x._d.dtype != rd:
            x = array_op(_CAST, [x], xv, (rd, x._d.dtype))
        if y.__class__ is Tensor and y._rg and y._d.__class__ is not _pyfloat \
                and y._d.dtype != rd:
            y = array_op(_CAST, [y], yv, (rd, y._d.dtype))
    return _record_binary(op, x, y, v)


def _wrap_int(v, rd):
    """Python int ``v`` as integer dtype ``rd``, wrapping as a C cast does (torch's rule)."""
    if not -(1 << 63) <= v < (1 << 64):
        raise OverflowError(f"int too big to convert: {v} does not fit in 64 bits")
    return np.array(v % (1 << 64), dtype=np.uint64).astype(rd)


# ---------------------------------------------------------------------------------------
# factories

#: the device types torch knows (its error for any other names them)
_DEVICE_TYPES = ("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve",
                 "fpga", "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia",
                 "privateuseone")
_DEVICE_STRING = re.compile(r"([a-zA-Z_]+)(?::(0|[1-9][0-9]*))?")


def check_device(device, fname):
    """A factory's ``device`` argument, as torch's CPU build takes it: None, ``"cpu"``,
    ``"cpu:N"`` (or a torch.device of type cpu) pass; anything else raises what torch raises
    there, saying that tapegrad tensors live on the CPU. torch accepts ``"meta"`` (shape-only
    tensors); tapegrad has none and raises NotImplementedError rather than make a CPU one."""
    if device is None:
        return
    if isinstance(device, str):
        text = device
    elif isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise RuntimeError("Device index must not be negative")
        raise RuntimeError(f"Cannot access accelerator device when none is available: device="
                           f"{device} names an accelerator; tapegrad tensors live on the CPU "
                           "(device='cpu', or leave it out)")
    elif hasattr(device, "type") and hasattr(device, "index"):  # a torch.device
        text = str(device)
    else:
        raise TypeError(f"{fname}(): argument 'device' must be torch.device, not "
                        f"{type(device).__name__}")
    m = _DEVICE_STRING.fullmatch(text)
    if m is None:
        raise RuntimeError(f"Invalid device string: {text!r}")
    kind = m.group(1)
    if kind not in _DEVICE_TYPES:
        raise RuntimeError(f"Expected one of {', '.join(_DEVICE_TYPES)} device type at start "
                           f"of device string: {text}")
    if kind == "cpu":
        return
    where = ("tapegrad tensors live on the CPU: pass device='cpu' or leave it out (a traced "
             "program runs on an NVIDIA GPU with target='cuda', see docs/cuda.md)")
    if kind == "meta":
        raise NotImplementedError(f"{fname}(): meta tensors (device='meta') are not supported "
                                  f"by tapegrad; {where}")
    if kind in ("cuda", "xpu"):  # what torch's CPU build raises for these
        raise AssertionError(f"{fname}(): device {text!r} is not available; {where}")
    # torch raises RuntimeError (tensor, to) or NotImplementedError (the rest), its subclass
    raise NotImplementedError(f"{fname}(): device {text!r} is not supported; {where}")


def _infer_np(data, nd):
    if isinstance(data, Tensor):
        tr = STATE.trace
        if tr is not None:  # a copy of a traced value is a constant: guarded
            tr.on_escape(data, "tapegrad.tensor()")
        return np.array(data._d, dtype=nd)
    if isinstance(data, (list, tuple)):
        data = [d.tolist() if isinstance(d, Tensor) else d for d in data]
    try:
        a = np.array(data, dtype=nd)
    except ValueError as e:
        raise ValueError(f"tapegrad.tensor could not make a tensor from {type(data).__name__}: "
                         f"{e} (nested sequences must be rectangular)") from None
    except TypeError as e:
        raise TypeError(f"tapegrad.tensor could not make a tensor from {type(data).__name__}: "
                        f"{e}") from None
    if a.dtype == object:
        raise TypeError(f"tapegrad.tensor could not make a tensor from {data!r}: elements "
                        "must be numbers (nested lists must be rectangular)")
    if a.dtype.kind in "US":
        raise TypeError(f"tapegrad.tensor expects numbers, got strings: {data!r}")
    return a


def _finish(a, requires_grad, share=False):
    """ndarray -> leaf tensor (0-d float64 becomes a Python float unless ``share``)."""
    if not isinstance(requires_grad, _pybool):
        raise TypeError(f"requires_grad must be a bool, got {type(requires_grad).__name__}")
    if a.dtype.kind == "c":
        raise TypeError("complex tensors are not supported by tapegrad yet; use float64 or "
                        "float32 (complex support is planned)")
    if a.dtype not in _DTYPES:
        if a.dtype.kind == "f":
            a = a.astype(np.float64)
        elif a.dtype.kind in "iu":
            a = a.astype(np.int64)
        else:
            raise TypeError(f"tapegrad does not support dtype {a.dtype}")
    v = _pyfloat(a) if (a.ndim == 0 and a.dtype == _F64 and not share) else a
    return _leaf(v, requires_grad)


def tensor(data, dtype=None, requires_grad=False, device=None):
    """Make a leaf tensor from a number, (nested) list, NumPy array or tensor (copies).

    Examples
    --------
    >>> import tapegrad
    >>> tapegrad.tensor([1.0, 2.0], requires_grad=True).shape
    (2,)
    """
    if device is not None:
        check_device(device, "tensor")
    nd = _np_dtype(dtype)
    if isinstance(data, Tensor):
        warnings.warn("To copy construct from a tensor, it is recommended to use "
                      "sourceTensor.clone().detach() or "
                      "sourceTensor.clone().detach().requires_grad_(True), rather than "
                      "tapegrad.tensor(sourceTensor).", UserWarning, stacklevel=2)
    if data.__class__ is _pyfloat and nd is None:
        return _leaf(data, requires_grad) if isinstance(requires_grad, _pybool) \
            else _finish(np.array(data), requires_grad)
    a = _infer_np(data, nd)
    if nd is None and a.dtype.kind == "f" and a.dtype != _F64 and not isinstance(
            data, (np.ndarray, np.generic, Tensor)):
        a = a.astype(np.float64)
    return _finish(np.array(a, copy=True), requires_grad)


def as_tensor(data, dtype=None, device=None):
    """Like ``tensor`` but shares memory with a NumPy array or tensor where it can."""
    check_device(device, "as_tensor")
    nd = _np_dtype(dtype)
    if isinstance(data, Tensor):
        if nd is None or data.dtype.np == nd:
            return data
        return _to_dtype(data, nd)
    if isinstance(data, np.ndarray):
        return _finish(data if nd is None else data.astype(nd, copy=False), False, share=True)
    return tensor(data, dtype=dtype)


def from_numpy(ndarray):
    """A tensor sharing memory with ``ndarray``."""
    if not isinstance(ndarray, np.ndarray):
        raise TypeError(f"expected np.ndarray (got {type(ndarray).__name__})")
    if ndarray.dtype not in _DTYPES or ndarray.dtype.kind == "c":
        raise TypeError(f"can't convert np.ndarray of type {ndarray.dtype}. The only supported "
                        "types are: float64, float32, float16, int64, int32, int16, int8, "
                        "uint8, and bool.")
    return _finish(ndarray, False, share=True)


def _size_args(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    for s in size:
        if not isinstance(s, (_pyint, np.integer)) or isinstance(s, _pybool):
            raise TypeError(f"size must be a sequence of ints, got {size!r}")
        if s < 0:
            raise RuntimeError(f"Trying to create tensor with negative dimension {s}: {size!r}")
    return tuple(_pyint(s) for s in size)


def _factory(fill, fname):
    def make(*size, dtype=None, requires_grad=False, device=None):
        check_device(device, fname)
        shape = _size_args(size)
        nd = _np_dtype(dtype) or _F64
        return _finish(fill(shape, nd), requires_grad)
    return make


zeros = _factory(lambda shape, nd: np.zeros(shape, dtype=nd), "zeros")
ones = _factory(lambda shape, nd: np.ones(shape, dtype=nd), "ones")
zeros.__doc__ = "Tensor of zeros: ``zeros(2, 3)`` or ``zeros((2, 3))``."
ones.__doc__ = "Tensor of ones: ``ones(2, 3)`` or ``ones((2, 3))``."

_rng = np.random.default_rng()


def manual_seed(seed):
    """Seed the generator behind ``rand`` and ``randn``."""
    global _rng
    _rng = np.random.default_rng(seed)


rand = _factory(lambda shape, nd: _rng.random(shape).astype(nd), "rand")
randn = _factory(lambda shape, nd: _rng.standard_normal(shape).astype(nd), "randn")
rand.__doc__ = "Uniform samples on [0, 1)."
randn.__doc__ = "Standard normal samples."


def full(size, fill_value, dtype=None, requires_grad=False, device=None):
    check_device(device, "full")
    shape = _size_args((size,) if not isinstance(size, (tuple, list)) else (tuple(size),))
    nd = _np_dtype(dtype)
    if nd is None:
        nd = _F64 if isinstance(fill_value, _pyfloat) else (
            np.dtype(np.bool_) if isinstance(fill_value, _pybool) else np.dtype(np.int64))
    return _finish(np.full(shape, fill_value, dtype=nd), requires_grad)


def _like(fill, fname):
    def make(input, dtype=None, requires_grad=False, device=None):
        check_device(device, fname)
        if not isinstance(input, Tensor):
            raise TypeError(f"expected a Tensor, got {type(input).__name__}")
        nd = _np_dtype(dtype) or input.dtype.np
        return _finish(fill(input.shape, nd), requires_grad)
    return make


zeros_like = _like(lambda shape, nd: np.zeros(shape, dtype=nd), "zeros_like")
ones_like = _like(lambda shape, nd: np.ones(shape, dtype=nd), "ones_like")


def arange(start, end=None, step=1, dtype=None, requires_grad=False, device=None):
    check_device(device, "arange")
    if end is None:
        start, end = 0, start
    if step == 0:
        raise RuntimeError("step must be nonzero")
    nd = _np_dtype(dtype)
    if nd is None:
        nd = np.dtype(np.int64) if all(isinstance(v, (_pyint, np.integer))
                                       for v in (start, end, step)) else _F64
    return _finish(np.arange(start, end, step, dtype=nd), requires_grad)


def linspace(start, end, steps, dtype=None, requires_grad=False, device=None):
    check_device(device, "linspace")
    if not isinstance(steps, (_pyint, np.integer)) or steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    nd = _np_dtype(dtype) or _F64
    return _finish(np.linspace(start, end, steps, dtype=nd), requires_grad)


def eye(n, m=None, dtype=None, requires_grad=False, device=None):
    check_device(device, "eye")
    nd = _np_dtype(dtype) or _F64
    return _finish(np.eye(n, m, dtype=nd), requires_grad)


def _to_dtype(x, nd):
    if x.dtype.np == nd:
        return x
    d = x._d
    if x._rg and nd.kind != "f":
        tr = STATE.trace
        if tr is not None:  # tracing: bool is x != 0, recorded; an int cast cannot be
            if nd.kind == "b":
                return x != 0
            return tr.untraceable(_plain(np.asarray(d).astype(nd)),
                                  f"a cast of a traced value to {nd}", x)
        return _plain(np.asarray(d).astype(nd))
    v = np.asarray(d).astype(nd)
    return array_op(BY_NAME["cast"], [x], v, (nd, np.asarray(d).dtype))


def _dim(d, ndim):
    if not isinstance(d, (_pyint, np.integer)) or isinstance(d, _pybool):
        raise TypeError(f"dim must be an int, got {type(d).__name__}")
    lo, hi = (-ndim, ndim - 1) if ndim else (-1, 0)
    if not lo <= d <= hi:
        raise IndexError(f"Dimension out of range (expected to be in range of [{lo}, {hi}], "
                         f"but got {d})")
    return d % ndim if ndim else 0
