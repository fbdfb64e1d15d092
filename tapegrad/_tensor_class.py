"""The Tensor class, its shape (Size) and grad_fn node, and the plain tensors the recorder makes."""
from __future__ import annotations

import math
import warnings
import weakref

import numpy as np

from ._dtypes import _DTYPES, _F64, _REPR_DEFAULT, _pybool, _pyfloat, _pyint, float64
from .ops import ARRAY, BY_NAME
from .tape import STATE, bump

_FUNCTION_OUT = BY_NAME["function_out"].code


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


def _register_detach_first(x, t):
    """``_fn_shapes._register_detach``, imported on the first detach (it imports this
    module); later calls go to it directly (an import statement per detach cost 0.4 us)."""
    from ._fn_shapes import _register_detach
    _REGISTER_DETACH[0] = _register_detach
    _register_detach(x, t)


_REGISTER_DETACH = [_register_detach_first]

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
    # _alias: (base, kind, arg) of a view, _views: weak references to a base's views
    # (_fn_shapes: torch's views share their base's storage)
    __slots__ = ("_d", "_rg", "_tape", "_sid", "_slot", "_ver", "_grad", "_retains",
                 "_alias", "_views", "_hooks", "_param", "__weakref__")
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
        tr = STATE.trace
        if tr is not None or d.__class__ is _pyfloat:
            t = _plain(d)
            if tr is not None:  # tracing: the value is recomputed at replay, without gradient
                t = tr.on_detach(t, self)  # (the tensor returned is the one registered
                # below: a write into self after this derives it again, recorded:
                # _fn_shapes._rebase)
            if d.__class__ is _pyfloat:
                return t
        else:  # (_plain written out: its version box is replaced by self's below)
            t = Tensor()
            t._d, t._rg, t._tape, t._sid, t._slot = d, False, None, -1, -1
        t._ver = self._ver  # shares memory, and so the version counter
        if not self._rg or self._tape is not None or \
                getattr(self, "_alias", None) is not None:
            # writes through t are made on self, and t sees self's (a leaf that requires
            # grad is only ever written in place: t shares its array)
            _REGISTER_DETACH[0](self, t)
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
        from ._factories import tensor  # the factories sit above the Tensor class
        return tensor(array)

    def __float__(self):
        if self._d.__class__ is not _pyfloat and self._d.size != 1:
            raise ValueError("only one element tensors can be converted to Python scalars")
        tr = STATE.trace
        if tr is not None:
            tr.on_escape(self, "float()")
            with tr.quiet():
                return _pyfloat(self.item())
        return _pyfloat(self.item())

    def __int__(self):
        if self._d.__class__ is not _pyfloat and self._d.size != 1:
            raise ValueError("only one element tensors can be converted to Python scalars")
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
        from ._factories import tensor
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


def _dim(d, ndim):
    if not isinstance(d, (_pyint, np.integer)) or isinstance(d, _pybool):
        raise TypeError(f"dim must be an int, got {type(d).__name__}")
    lo, hi = (-ndim, ndim - 1) if ndim else (-1, 0)
    if not lo <= d <= hi:
        raise IndexError(f"Dimension out of range (expected to be in range of [{lo}, {hi}], "
                         f"but got {d})")
    return d % ndim if ndim else 0
