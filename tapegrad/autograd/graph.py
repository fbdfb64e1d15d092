"""The graph as torch shows it: ``Node`` (a tensor's ``grad_fn``: name, next_functions,
metadata, hooks, saved tensors), ``GradientEdge``, ``get_gradient_edge`` and
``saved_tensors_hooks``."""
from __future__ import annotations

import abc
import itertools
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np

from ..ops import ARRAY, OPS
from ..tensor import _HINTS, Tensor, _GradFn, _pyfloat

#: live hooks of every kind (tensor, node, post-accumulate): while none is registered the
#: backward sweeps take their fast paths; with any, ``hooks.sweep`` runs instead
HOOKS = [0]
_ids = itertools.count()


class Node(abc.ABC):
    """What ``grad_fn`` returns (torch.autograd.graph.Node): ``isinstance`` holds for every
    tensor's ``grad_fn`` and for ``AccumulateGrad``."""

    @abc.abstractmethod
    def name(self):
        ...

    @property
    @abc.abstractmethod
    def next_functions(self):
        ...

    @classmethod
    def __subclasshook__(cls, C):
        if cls is Node and C in (_GradFn, AccumulateGrad):
            return True
        return NotImplemented


class RemovableHandle:
    """Returned by every ``register_*hook``: ``remove()`` unregisters the hook."""

    def __init__(self, hooks_dict, key):
        self._ref = weakref.ref(hooks_dict) if hooks_dict is not None else None
        self.id = key

    def remove(self):
        d = self._ref() if self._ref is not None else None
        if d is not None and self.id in d:
            del d[self.id]
            d.live[0] -= 1
            HOOKS[0] -= 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class _HookDict(dict):
    """A dict of hooks in registration order (a class, so a handle can hold a weakref).
    When it dies with its tensor or tape, its hooks leave the live count."""

    def __init__(self):
        super().__init__()
        self.live = [0]
        weakref.finalize(self, _forget, self.live)


def _forget(live):
    HOOKS[0] -= live[0]


def _add(hooks, fn):
    if not callable(fn):
        raise TypeError(f"hook must be callable, got {type(fn).__name__}")
    key = next(_ids)
    hooks[key] = fn
    hooks.live[0] += 1
    HOOKS[0] += 1
    return RemovableHandle(hooks, key)


def node_state(tape, k, create=True):
    """{'pre', 'post', 'tensor', 'metadata'} of entry ``k`` of ``tape`` (None if none yet).
    Held by the tape (apart from the nodes, which may be made afresh, so the state outlives
    them): a hook that holds its own tensor makes a cycle the garbage collector frees, as
    in torch, where a table beside the tapes would keep both forever."""
    per = tape.hooks
    if per is None:
        if not create:
            return None
        per = tape.hooks = {}
    st = per.get(k)
    if st is None and create:
        st = per[k] = {"pre": _HookDict(), "post": _HookDict(), "tensor": _HookDict(),
                       "metadata": {}, "code": tape.code[k * 5]}
    elif st is not None and st["code"] != tape.code[k * 5]:  # the entry was rolled back
        if not create:
            return None
        del per[k]
        return node_state(tape, k, create)
    return st


def leaf_hooks(t, kind, create=False):
    """The ``kind`` ('tensor' or 'post') hooks of leaf ``t`` (None when it has none)."""
    try:
        hs = t._hooks
    except AttributeError:
        hs = None
    if hs is None:
        if not create:
            return None
        hs = t._hooks = {"tensor": _HookDict(), "post": _HookDict()}
    return hs[kind]


# -- names ----------------------------------------------------------------------------------

_FIXED = {"mulc": "MulBackward0", "rsubc": "RsubBackward1", "divc": "DivBackward0",
          "rdivc": "MulBackward0", "powc": "PowBackward0", "powc_special": "PowBackward0",
          "rpowc": "PowBackward2", "pow": "PowBackward1", "square": "PowBackward0",
          "cast": "ToCopyBackward0",
          "norm": "LinalgVectorNormBackward0", "clamp": "ClampBackward1",
          "clamp_min_t": "ClampMinBackward1", "clamp_max_t": "ClampMaxBackward1",
          "reshape": "ViewBackward0", "outer": "MulBackward0", "setitem": "CopySlices",
          "sum_to": "SumBackward1", "index_scatter": "IndexPutBackward0",
          "cross": "LinalgCrossBackward0"}
_DIMS = ("sum", "mean", "prod")


def entry_name(tape, k):
    """torch's name for the node of entry ``k`` (e.g. ``SumBackward1``)."""
    hint = _HINTS.get(tape)
    if hint is not None:
        h = hint.get(k)
        if h is not None and h[0] == tape.code[k * 5]:
            return h[1]
    code, a, b, c0, _ = tape.entry(k)
    op = OPS[int(code) & ~ARRAY]
    name = op.name
    if name == "function":
        return tape.aux[k][1]._backward_cls_name
    if name == "function_out":
        return entry_name(tape, a)
    if name == "addc":
        return "SubBackward0" if c0 < 0 else "AddBackward0"
    if name in _FIXED:
        return _FIXED[name]
    if name in _DIMS:
        return f"{name.capitalize()}Backward{0 if tape.aux[k][0] is None else 1}"
    if name == "matmul":
        na, nb = np.ndim(_value(tape, a)), np.ndim(_value(tape, b))
        return {(1, 1): "DotBackward0", (2, 1): "MvBackward0", (2, 2): "MmBackward0",
                (1, 2): "SqueezeBackward4"}.get((na, nb), "UnsafeViewBackward0")
    if name == "diag":
        return "DiagEmbedBackward0" if np.ndim(_value(tape, a)) == 1 else "DiagonalBackward0"
    if name in ("amax", "amin"):
        how = tape.aux[k][2]
        if how is None:
            return f"{name.capitalize()}Backward0"
        return f"{name[1:].capitalize()}Backward{1 if isinstance(how, str) else 0}"
    if name == "getitem":
        return _getitem_name(tape.aux[k])
    return "".join(p.capitalize() for p in name.rstrip("_").split("_")) + "Backward0"


def _getitem_name(aux):
    index = aux[0]
    items = index if isinstance(index, tuple) else (index,)
    if not (len(aux) > 2 and aux[2]):
        return "IndexBackward0"
    last = [i for i in items if i is not Ellipsis and not (isinstance(i, slice)
                                                            and i == slice(None))]
    if not last:
        return "AliasBackward0"
    i = last[-1]
    if i is None:
        return "UnsqueezeBackward0"
    return "SliceBackward0" if isinstance(i, slice) else "SelectBackward0"


def _value(tape, s):
    v = tape.arrays.get(s, tape)
    return tape.vals[s] if v is tape else v


def bound_tensor(tape, k, value):
    """A non-leaf tensor bound to entry ``k`` of ``tape`` with value ``value`` (so ops on it
    record on top of the recorded graph)."""
    t = Tensor()
    t._d = value
    t._rg = True
    t._tape = tape
    t._sid = tape.sid
    t._slot = k
    if t._d.__class__ is not _pyfloat:
        t._ver = [0]
    return t


def _slot_tensor(tape, s):
    """The tensor at entry ``s``: a leaf or constant itself, else one bound to the entry."""
    code = int(tape.code[s * 5]) & ~ARRAY
    if OPS[code].name in ("leaf", "const"):
        return tape.aux[s][0]
    return bound_tensor(tape, s, _value(tape, s))


def entry_inputs(tape, k):
    """Slots that entry ``k`` reads, in argument order."""
    code, a, b, _, _ = tape.entry(k)
    op = OPS[int(code) & ~ARRAY]
    if op.nary:
        return list(tape.aux[k][0])
    return [s for s in (a, b) if s >= 0]


# constant forms whose torch node has the Python number as a second input (edge to None)
_NUMBER_EDGE = frozenset(("addc", "mulc", "divc", "rdivc"))


def next_functions(tape, k):
    out = []
    for s in entry_inputs(tape, k):
        name = OPS[int(tape.code[s * 5]) & ~ARRAY].name
        if name == "leaf":
            out.append((AccumulateGrad(tape.aux[s][0]), 0))
        elif name == "const":
            out.append((None, 0))
        elif name == "import_":
            src, j = tape.aux[s]
            out.append((_GradFn(src, j), 0))
        else:
            out.append((_GradFn(tape, s), 0))
    if OPS[int(tape.code[k * 5]) & ~ARRAY].name in _NUMBER_EDGE:
        out.append((None, 0))
    return tuple(out)


def saved(tape, k, which):
    """``_saved_self`` / ``_saved_other`` / ``_saved_result`` of entry ``k``."""
    code, a, b, _, _ = tape.entry(k)
    op = OPS[int(code) & ~ARRAY]
    key = {"_saved_self": "a", "_saved_other": "b", "_saved_result": "out"}[which]
    if key not in op.uses or op.nary:
        raise AttributeError(f"'{entry_name(tape, k)}' object has no attribute '{which}'")
    if tape.freed is not None and k < len(tape.freed) and tape.freed[k]:
        raise RuntimeError("Trying to backward through the graph a second time (or directly "
                           "access saved tensors after they have already been freed). Saved "
                           "intermediate values of the graph are freed when you call "
                           ".backward() or autograd.grad(). Specify retain_graph=True if you "
                           "need to backward through the graph a second time or if you need "
                           "to access saved tensors after calling backward.")
    s = {"a": a, "b": b, "out": k}[key]
    if s < 0:
        raise AttributeError(f"'{entry_name(tape, k)}' object has no attribute '{which}'")
    return _slot_tensor(tape, s)


class GradientEdge(NamedTuple):
    """The ``node`` that receives a gradient (a tensor's ``grad_fn``, or the leaf's
    ``AccumulateGrad``) and which of its outputs (always 0 in tapegrad)."""

    node: Any
    output_nr: int
    ownership_token: Any = None


class AccumulateGrad:
    """The node of a leaf: its gradient accumulates into ``variable.grad``."""

    __slots__ = ("variable",)

    def __init__(self, variable):
        self.variable = variable

    def name(self):
        return "torch::autograd::AccumulateGrad"

    @property
    def next_functions(self):
        return ()

    @property
    def metadata(self):
        return {}

    def register_hook(self, fn):
        raise RuntimeError("register hooks on the leaf tensor itself (x.register_hook, "
                           "x.register_post_accumulate_grad_hook): tapegrad's AccumulateGrad "
                           "nodes are made on request and hold no hooks")

    register_prehook = register_hook

    def __eq__(self, other):
        return isinstance(other, AccumulateGrad) and other.variable is self.variable

    def __hash__(self):
        return id(self.variable)

    def __repr__(self):
        return f"<AccumulateGrad object at {id(self):#x}>"


def get_gradient_edge(tensor):
    """The gradient edge of ``tensor``, as ``torch.autograd.graph.get_gradient_edge``.

    Examples
    --------
    >>> import tapegrad
    >>> x = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    >>> y = x * 2.0
    >>> tapegrad.autograd.grad((y * y).sum(), tapegrad.autograd.graph.get_gradient_edge(y))
    (tensor([4., 8.]),)
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"get_gradient_edge expects a Tensor, got {type(tensor).__name__}")
    if not tensor.requires_grad:
        raise RuntimeError("It is not possible to get the gradient edge for a Tensor that does "
                           "not require gradients")
    node = tensor.grad_fn if tensor._tape is not None else AccumulateGrad(tensor)
    return GradientEdge(node, 0)


def edge_tensor(edge):
    """A tensor standing for ``edge`` in a backward: the leaf itself, or a tensor bound to
    the recorded entry (so it works after the user dropped the original tensor)."""
    node = edge.node
    if isinstance(node, AccumulateGrad):
        return node.variable
    if not isinstance(node, _GradFn):
        raise TypeError(f"GradientEdge.node must come from get_gradient_edge, got "
                        f"{type(node).__name__}")
    return _slot_tensor(node._tape, node._slot)


class saved_tensors_hooks:
    """Context manager: ``pack_hook(tensor)`` is called on each tensor a custom Function
    saves with ``ctx.save_for_backward`` inside it, and ``unpack_hook(packed)`` when
    ``ctx.saved_tensors`` reads it back (torch.autograd.graph.saved_tensors_hooks).

    tapegrad's built-in ops keep their values on the tape rather than as saved tensors, so
    the hooks do not see them; ops recorded inside the context other than custom Functions
    get a warning (docs/differences.md)."""

    def __init__(self, pack_hook, unpack_hook):
        self.pack_hook, self.unpack_hook = pack_hook, unpack_hook

    def __enter__(self):
        from ..tape import STATE
        tape = STATE.tape()
        self._start = (tape, len(tape.vals) if tape is not None else 0)
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _stack().pop()
        _warn_builtin(self._start)
        return False


class save_on_cpu(saved_tensors_hooks):
    """Every tapegrad tensor lives on the CPU already: pack and unpack are the identity."""

    def __init__(self, pin_memory=False, device_type="cuda"):
        super().__init__(lambda t: t, lambda t: t)


def _warn_builtin(start):
    import warnings
    from ..tape import STATE
    tape0, n0 = start
    tape = STATE.tape()
    if tape is None:
        return
    lo = n0 if tape is tape0 else 0
    quiet = ("leaf", "const", "import_", "function", "function_out")
    for k in range(lo, len(tape.vals)):
        op = OPS[int(tape.code[k * 5]) & ~ARRAY]
        if op.name not in quiet and op.saves:
            warnings.warn(
                "saved_tensors_hooks: tapegrad's built-in ops keep the values they need on "
                f"the tape, not as saved tensors, so the pack/unpack hooks did not see "
                f"'{op.name}' (and the other built-in ops recorded in this block); they apply "
                "to custom autograd.Function's save_for_backward only (see "
                "docs/differences.md)", UserWarning, stacklevel=3)
            return


_LOCAL = threading.local()  # the contexts are per thread, as torch's


def _stack():
    st = getattr(_LOCAL, "stack", None)
    if st is None:
        st = _LOCAL.stack = []
    return st


def current_saved_hooks():
    """The innermost active ``saved_tensors_hooks`` of this thread, or None."""
    st = _stack()
    return st[-1] if st else None
