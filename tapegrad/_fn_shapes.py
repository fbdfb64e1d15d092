"""Shape functions (reshape, permute, cat...), indexing (getitem, setitem), in-place writes."""
from __future__ import annotations

import sys
import weakref

import numpy as np

from ._fn_elementwise import _t, _tn, clone
from .ops import ARRAY, OPS, ROW
from .ops import BY_NAME as _O
from .tape import STATE, bump
from .tensor import (TORCH_NAMES, Tensor, _cat, _dim, _hint, _norm_value, _plain, _pyfloat,
                     _record, _to_dtype, array_op, result_dtype)

_CLONE = _O["clone"].code
_GETITEM = _O["getitem"].code | ARRAY
_F64 = np.dtype(np.float64)


def _shape_arg(shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    for s in shape:
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool):
            raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def reshape(input, *shape):
    """Same elements, new shape (one dim may be -1)."""
    x = _t(input)
    shape = _shape_arg(shape)
    a = np.asarray(x._d)
    try:
        v = a.reshape(shape)
    except ValueError:
        raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {a.size}") \
            from None
    return _aliased(array_op(_O["reshape"], [x], v, (v.shape, a.shape)), x, "reshape",
                    (v.shape, a.shape))


def flatten(input, start_dim=0, end_dim=-1):
    x = _t(input)
    if x.ndim == 0:
        return reshape(x, 1)
    s = _dim(start_dim, x.ndim)
    e = _dim(end_dim, x.ndim)
    shape = x.shape[:s] + (-1,) + x.shape[e + 1:]
    return reshape(x, shape)


def squeeze(input, dim=None):
    x = _t(input)
    shape = x.shape
    if dim is None:
        new = tuple(s for s in shape if s != 1)
    else:
        d = _dim(dim, x.ndim)
        new = shape[:d] + shape[d + 1:] if x.ndim and shape[d] == 1 else shape
    return _hint(reshape(x, new), "SqueezeBackward0" if dim is None else "SqueezeBackward1")


def unsqueeze(input, dim):
    x = _t(input)
    d = _dim(dim, x.ndim + 1)
    return _hint(reshape(x, x.shape[:d] + (1,) + x.shape[d:]), "UnsqueezeBackward0")


def transpose(input, dim0, dim1):
    """Swap two dims."""
    x = _t(input)
    nd = x.ndim
    d0, d1 = _dim(dim0, nd), _dim(dim1, nd)
    a = np.asarray(x._d)
    v = np.swapaxes(a, d0, d1) if nd else a
    return _aliased(array_op(_O["transpose"], [x], v, (d0, d1) if nd else (0, 0)), x,
                    "transpose", (d0, d1) if nd else None)


swapaxes = swapdims = transpose


def permute(input, *dims):
    x = _t(input)
    dims = _shape_arg(dims)
    if len(dims) != x.ndim:
        raise RuntimeError(f"permute(sparse_coo): number of dimensions in the tensor input "
                           f"does not match the length of the desired ordering of dimensions "
                           f"i.e. input.dim() = {x.ndim} is not equal to len(dims) = "
                           f"{len(dims)}")
    ds = tuple(_dim(d, x.ndim) for d in dims)
    if sorted(ds) != list(range(x.ndim)):
        raise RuntimeError(f"permute(): duplicate dims are not allowed: {dims}")
    return _aliased(array_op(_O["permute"], [x], np.transpose(np.asarray(x._d), ds), ds), x,
                    "permute", ds)


def t(input):
    x = _t(input)
    if x.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {x.ndim}D")
    return _hint(transpose(x, 0, 1), "TBackward0") if x.ndim == 2 else x


def _seq(tensors, fname):
    if isinstance(tensors, Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{fname}(): argument 'tensors' must be a tuple or list of Tensors, "
                        f"not {type(tensors).__name__}")
    if not tensors:
        raise RuntimeError(f"{fname}(): expected a non-empty list of Tensors")
    for i, x in enumerate(tensors):
        if not isinstance(x, Tensor):
            raise TypeError(f"{fname}(): expected Tensor as element {i} in argument 0, but got "
                            f"{type(x).__name__}")
    return list(tensors)


def stack(tensors, dim=0):
    """Join same-shape tensors along a new ``dim``."""
    ts = _seq(tensors, "stack")
    shape0 = ts[0].shape
    for i, x in enumerate(ts):
        if x.shape != shape0:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got "
                               f"{list(shape0)} at entry 0 and {list(x.shape)} at entry {i}")
    d = _dim(dim, len(shape0) + 1)
    rd = result_dtype(*ts)
    v = np.stack([np.asarray(x._d, dtype=rd) for x in ts], axis=d)
    return array_op(_O["stack"], ts, v, (d,))


def cat(tensors, dim=0):
    """Join tensors along an existing ``dim``."""
    if (tensors.__class__ is list or tensors.__class__ is tuple) and dim.__class__ is int \
            and STATE.trace is None:
        # float64 arrays (ode's right-hand side, many small joins): NumPy checks the shapes,
        # the general path below only when it refuses (for torch's messages)
        ds = []
        for x in tensors:
            d = x._d if x.__class__ is Tensor else None
            if d.__class__ is not np.ndarray or d.dtype is not _F64:
                break
            ds.append(d)
        else:
            if ds and -ds[0].ndim <= dim < ds[0].ndim:
                try:
                    v = np.concatenate(ds, axis=dim)
                except ValueError:
                    v = None
                if v is not None:
                    return array_op(_O["cat"], tensors, v, (dim % ds[0].ndim,))
    ts = _seq(tensors, "cat")
    nd = ts[0].ndim
    if nd == 0:
        raise RuntimeError("zero-dimensional tensor (at position 0) cannot be concatenated")
    d = _dim(dim, nd)
    for i, x in enumerate(ts):
        if x.ndim != nd:
            raise RuntimeError(f"Tensors must have same number of dimensions: got {nd} and "
                               f"{x.ndim}")
        s0, s1 = list(ts[0].shape), list(x.shape)
        s0[d] = s1[d] = 0
        if s0 != s1:
            raise RuntimeError(f"Sizes of tensors must match except in dimension {d}. Expected "
                               f"size {ts[0].shape} but got size {x.shape} for tensor number "
                               f"{i} in the list.")
    rd = result_dtype(*ts)
    v = np.concatenate([np.asarray(x._d, dtype=rd) for x in ts], axis=d)
    return array_op(_O["cat"], ts, v, (d,))



def broadcast_to(input, size):
    x = _t(input)
    shape = _shape_arg((size,))
    a = np.asarray(x._d)
    try:
        v = np.broadcast_to(a, shape)
    except ValueError:
        raise RuntimeError(f"The expanded size of the tensor must match the existing size: "
                           f"cannot expand {list(a.shape)} to {list(shape)}") from None
    return _aliased(array_op(_O["expand"], [x], v, (v.shape, a.shape)), x, "expand", v.shape)


# --- indexing ------------------------------------------------------------------------------


def _index(idx):
    """A NumPy index from a torch-style one (tensors become arrays)."""
    if isinstance(idx, tuple):
        return tuple(_index_item(i) for i in idx)
    return _index_item(idx)


def _index_item(i):
    if isinstance(i, Tensor):
        a = np.asarray(i._d)
        if a.dtype.kind == "f":
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        return a
    if isinstance(i, list):
        a = np.asarray(i)
        if a.dtype.kind == "f":
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        return a
    if isinstance(i, float):
        raise IndexError("only integers, slices (`:`), ellipsis (`...`), None and long or byte "
                         "Variables are valid indices (got float)")
    return i


#: the types of an index of slices and new axes only (a view: ``getitem``'s short path)
_SLICE_NONE = frozenset((slice, type(None)))


def getitem(x, idx):
    d = x._d
    if idx.__class__ is slice and d.__class__ is np.ndarray and d.ndim:
        v = d[idx]  # one slice: a view, the common case written out
        if not (x._rg and STATE.grad_enabled):
            t = _plain(v)
            t._ver = x._ver
            _register(x, t, idx)
            if STATE.trace is not None:  # a slice of a traced comparison: recorded
                return STATE.trace.plain_op(lambda a: getitem(a, idx), (x,), t)
            return t
        return _record_view(x, v, idx, d.shape)
    if idx.__class__ is tuple and d.__class__ is np.ndarray and d.ndim and \
            STATE.trace is None and _SLICE_NONE.issuperset(map(type, idx)):
        # slices and new axes (kmeans' C[:, :, None]): a view, the checks below not needed
        try:
            v = d[idx]
        except IndexError:
            v = None  # (the general path raises torch's message)
        if v is not None:
            if x._rg and STATE.grad_enabled:
                return _record_view(x, v, idx, d.shape)
            t = _plain(v)
            t._ver = x._ver
            _register(x, t, idx)
            return t
    if d.__class__ is _pyfloat:
        d = np.asarray(d)
    if d.ndim == 0 and idx not in ((), Ellipsis, None):
        raise IndexError("invalid index of a 0-dim tensor. Use `tensor.item()` in Python or "
                         "`tensor.item<T>()` in C++ to convert a 0-dim tensor to a number")
    nidx = _index(idx)
    try:
        v = d[nidx]
    except IndexError as e:
        raise IndexError(str(e).replace("axis", "dimension")) from None
    tr = STATE.trace
    if tr is not None:  # a traced mask or index chooses elements: guarded
        tr.on_index(idx)
    if not (x._rg and STATE.grad_enabled):
        t = _plain(_norm_value(v))
        if isinstance(v, np.ndarray) and np.shares_memory(v, d):
            t._ver = x._ver  # a view: in-place writes through it bump the base's version
        if x._d.__class__ is not _pyfloat and (nidx.__class__ is int or _basic_index(nidx)):
            _register(x, t, nidx)  # a view (0-d ones too, as torch's)
        if tr is not None:
            return tr.plain_op(lambda a: getitem(a, idx), (x,), t)
        return t
    basic = _basic_index(nidx)
    if not basic:
        return array_op(_O["getitem"], [x], v, (nidx, d.shape, basic))
    return _record_view(x, v, nidx, d.shape)


def _record_view(x, v, index, shape):
    """Record ``v = x[index]`` for a basic index. A basic index gives a view: no copy. The
    tape keeps the view, and checks the base's version at backward, as torch's views share
    their base's version counter."""
    if v.__class__ is np.ndarray and v.ndim:  # (the callers checked x._rg and grad mode:
        # recorded; a 0-d result, ``x[0, ...]``, becomes a float through array_op)
        res = _record(_GETITEM, x, None, 0.0, 0.0, v, _view_aux(index, shape))
    else:
        res = array_op(_O["getitem"], [x], v, (index, shape, True))
    if isinstance(v, np.ndarray) and res._tape is not None:
        try:
            box = x._ver
        except AttributeError:
            box = x._ver = [0]
        res._tape.viewed += (res._slot, box, box[0])  # (flat: no tuple kept per view)
    _register(x, res, index)
    return res


#: (a slice's bounds, shape) -> the aux of a view's entry, shared: a loop's ``x[1:]``
#: (ode's thousands) keeps one tuple and slice for the backward, not one per entry for
#: the cyclic collector to scan
_VIEW_AUX: dict = {}
_BOUND = frozenset((int, type(None)))


def _view_aux(index, shape):
    """``(index, shape, True)``: for one slice of int bounds (ode's ``x[1:]``), the one
    object per slice and shape (a dict lookup costs less than the collector's scans of
    a tuple and a slice per entry); a new tuple for any other index."""
    if index.__class__ is not slice:
        return (index, shape, True)
    a, b, c = index.start, index.stop, index.step
    if a.__class__ not in _BOUND or b.__class__ not in _BOUND or c.__class__ not in _BOUND:
        return (index, shape, True)
    key = (a, b, c, shape)
    aux = _VIEW_AUX.get(key)
    if aux is None:
        if len(_VIEW_AUX) >= 512:  # (a bound on the cache: any index kept is correct)
            _VIEW_AUX.clear()
        aux = _VIEW_AUX[key] = (index, shape, True)
    return aux


def _aliased(res, x, kind, arg):
    """``res`` is a view of ``x`` (``kind`` and ``arg`` make it from ``x``, see
    ``_derive``): it shares ``x``'s memory, as torch's views do."""
    if res is not x and isinstance(x._d, np.ndarray) and (
            isinstance(res._d, np.ndarray) and np.shares_memory(res._d, x._d)
            or res._d.__class__ is _pyfloat and x._d.size == 1):  # a 0-d view: a float here
        _register(x, res, arg, kind)
    return res


# --- views: torch's views share their base's storage -----------------------------------------
# A view ``v`` of ``base`` holds ``v._alias = (base, kind, arg)``, and ``base._views`` weak
# references to its views (only tensors that have views pay for it). An in-place change of a
# view is made on its base (``_write_back`` recorded, ``_inplace_write`` not); whenever a
# base's array is replaced (an in-place op copied it, or recorded its new value), each live
# view is derived again from the new array (``_rederive``): recorded as the view op of the
# new base when grad is on, so the view's gradient flows through the write, as torch's views
# are rebased; a plain re-slice otherwise. Without this a view kept its base's old value.


def _register(base, view, arg, kind="index"):
    # an unrecorded view (a detach, one under no_grad) of a tensor in a graph refers to it
    # weakly: it must not keep the tape alive (a list of y.detach() over the steps)
    view._alias = (base if view._tape is not None or base._tape is None else
                   weakref.ref(base), kind, arg)
    vs = getattr(base, "_views", None)  # (a base's first view: no exception raised, 0.5 us)
    if vs is None:
        base._views = [weakref.ref(view)]
        return
    vs.append(weakref.ref(view))
    n = len(vs)
    if n >= 64 and not n & (n - 1):  # drop dead views now and then: amortized O(1), as
        live = [r for r in vs if r() is not None]  # kept only when half of them are dead
        if len(live) <= n // 2:
            vs[:] = live


def _register_detach(x, t):
    """``t = x.detach()`` shares ``x``'s memory: a view of the first tensor up ``x``'s views
    that is no view, through the same steps (``arg``: the path), so that a write through
    ``t`` reaches it after ``x``, a temporary view (``a[1:].detach()``), is gone."""
    path, root = (), x
    while True:
        alias = getattr(root, "_alias", None)
        b = None if alias is None else _base(alias)
        if b is None:
            break
        path = (alias[2] if alias[1] == "detach" else ((alias[1], alias[2]),)) + path
        root = b
    _register(root, t, path, "detach")


def _base(alias):
    """The base of a view's ``_alias``; None when it is gone (see ``_register``)."""
    b = alias[0]
    return b() if b.__class__ is weakref.ReferenceType else b


def _derive(kind, arg, a):
    """The view's array, from its base's array ``a``."""
    if kind == "index":
        return a[arg]
    if kind == "reshape":
        v = a.view()
        v.shape = arg[0]  # AttributeError when that needs a copy: the caller raises
        return v
    if kind == "transpose":
        return a if arg is None else np.swapaxes(a, *arg)
    if kind == "permute":
        return np.transpose(a, arg)
    if kind == "expand":
        return np.broadcast_to(a, arg)
    for k, g in arg:  # detach: the path from its base
        a = _derive(k, g, a)
    return a


def _derive_tensor(kind, arg, base):
    """The view, recorded, of tensor ``base``."""
    if kind == "index":
        return getitem(base, arg)
    if kind == "reshape":
        return reshape(base, arg[0])
    if kind == "transpose":
        return base if arg is None else transpose(base, *arg)
    if kind == "permute":
        return permute(base, arg)
    return broadcast_to(base, arg)


def _check_writable(x):
    """Raise before anything is written when ``x`` is (a view of) an expanded tensor, as
    torch does: its elements share memory."""
    while True:
        alias = getattr(x, "_alias", None)
        if alias is None:
            return
        base = _base(alias)
        if base is None:
            return
        if alias[1] == "expand" and np.asarray(x._d).size > np.asarray(base._d).size:
            raise RuntimeError("unsupported operation: more than one element of the written-to "
                               "tensor refers to a single memory location. Please clone() the "
                               "tensor before performing the operation.")
        x = base


def _rederive(base):
    """``base``'s array was replaced: its live views take their values from the new one."""
    vs = getattr(base, "_views", None)
    if not vs:
        return
    live = []
    for r in vs:
        v = r()
        if v is None or getattr(v, "_alias", None) is None or _base(v._alias) is not base:
            continue
        live.append(r)
        _rebase(v)
    base._views = live  # (the views recorded above registered themselves: not kept)


def _rebase(v):
    _, kind, arg = v._alias
    base = _base(v._alias)
    if kind != "detach" and base._rg and STATE.grad_enabled:
        new = _derive_tensor(kind, arg, base)
        _rebind(v, new)  # derives v's views in turn
        v._alias = (base, kind, arg)
        if new._d.__class__ is not _pyfloat:
            v._ver = base._ver
        return
    d = base._d
    if d.__class__ is _pyfloat:
        d = np.asarray(d)
    try:
        a = _derive(kind, arg, d)
    except AttributeError:  # a reshape view of a base whose layout changed
        raise RuntimeError("an in-place change of a tensor that has a reshape view, whose "
                           "layout no longer allows the view: clone() the view, or the "
                           "tensor, before the write") from None
    v._d = _norm_value(a)
    if v._d.__class__ is not _pyfloat:
        v._ver = base._ver if np.shares_memory(v._d, d) else [0]
    v._sid = -1
    tr = STATE.trace
    if tr is not None and kind == "detach" and not arg and tr.ref(v) is not None:
        # a traced detach of base, recorded again from base's new value (replay read the
        # value before the write: a wrong number, review8)
        t = tr.on_detach(_plain(v._d), base)
        if tr.ref(t) is not None:
            v._tape, v._sid, v._slot = t._tape, t._sid, t._slot
            tr.refs[id(v)] = (v, tr.ref(t))
            tr.detached.add(id(v))
            _rederive(v)
            return
    if tr is not None:
        tr.written(v, base, "an in-place change of a view's base")
    if v._tape is not None:  # the view keeps its history, as torch's (see _keep_on_tape)
        v._tape.dirty[v._slot] = len(v._tape)
        _keep_on_tape(v)
    _rederive(v)


def _basic_index(index):
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, np.integer, slice))
               for i in items)


def setitem(x, idx, value):
    d = x._d
    scalar = d.__class__ is _pyfloat
    if scalar:
        d = np.asarray(d)
    nidx = _index(idx)
    tr = STATE.trace
    if tr is not None:
        tr.on_index(idx, "x[i] = v")
    v = value if isinstance(value, Tensor) else _tn(value, "value")
    vt = v if isinstance(v, Tensor) else None
    vv = np.asarray(v._d if vt is not None else v)
    try:
        tshape = np.shape(d[nidx])  # no view of d kept: _owned_write counts its holders
        np.broadcast_to(vv, tshape)
    except IndexError as e:
        raise IndexError(str(e).replace("axis", "dimension")) from None
    except ValueError:
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(vv.shape)} cannot be "
                           f"broadcast to indexing result of shape {list(tshape)}") \
            from None
    grad = STATE.grad_enabled and (x._rg or (vt is not None and vt._rg))
    _check_writable(x)
    if grad:
        if x._rg and x._tape is None:
            raise RuntimeError("a leaf Variable that requires grad is being used in an "
                               "in-place operation (index assignment). Assign into a clone "
                               "(y = x.clone(); y[...] = v) or wrap it in tapegrad.no_grad().")
        if _leaf_base(x) is not None:  # checked before anything is recorded
            raise RuntimeError("a view of a leaf Variable that requires grad is being used in "
                               "an in-place operation (index assignment). Assign into a clone, "
                               "or wrap it in tapegrad.no_grad().")
        vt = vt if vt is not None else _plain(_norm_value(vv.astype(d.dtype)))
        if vt.dtype.np != d.dtype:
            vt = _to_dtype(vt, d.dtype)
        own = _owned_write(x, d)
        out = d if own else np.array(d, copy=True)
        out[nidx] = vv.astype(d.dtype, copy=False)
        res = array_op(_O["setitem"], [x, vt], out, (nidx, None))
        if own:  # the older entry's value is dead (see _owned_write): a zero-stride stand-in
            # keeps its shape and frees its hold on the array; the tape counted it once
            res._tape.arrays[x._slot] = np.broadcast_to(np.zeros((), d.dtype), d.shape)
            res._tape.nbytes -= out.nbytes
        _rebind(x, res)
        _write_back(x)
        return
    if tr is not None:
        tr.written(x, v, "an index assignment (x[i] = v) of a traced value")
    if scalar and getattr(x, "_alias", None) is None:
        out = np.array(d, copy=True)
        out[nidx] = vv
        x._d = _pyfloat(out)
        x._sid = -1
        if x._tape is not None:
            x._tape.dirty[x._slot] = len(x._tape)
            _keep_on_tape(x)
        return
    _inplace_write(x, lambda arr: arr.__setitem__(nidx, vv))


def _owned_write(x, d):
    """Whether an index assignment into ``x`` may write its array in place: ``d`` is the
    copy that the previous recorded assignment made, still on the tape the next entry goes
    to, and nothing but ``x`` and that entry holds it (no view, no other tensor, no import
    into another tape), and no entry recorded since reads it. Nothing reads that entry's
    value after this write then (the setitem rule needs only shapes). So a loop of row writes
    keeps the written rows and one array,
    not one copy of the destination per write."""
    tape = x._tape
    if (tape is None or x._sid != tape.sid or d.__class__ is not np.ndarray
            or d.base is not None or not d.flags.writeable or STATE.tape() is not tape
            or len(tape.vals) >= tape.limit or tape.arrays.get(x._slot) is not d
            or OPS[int(tape.code[x._slot * ROW]) & ~ARRAY] is not _O["setitem"]):
        return False
    # holders: x._d, the tape's entry, the caller's d, our d and getrefcount's argument
    if sys.getrefcount(d) > 5:
        return False
    # an entry recorded since that reads the value (x * x) needs it as it is: copy
    k0, code = x._slot, tape.code
    for k in range(k0 + 1, len(tape.vals)):
        uses = OPS[int(code[k * ROW]) & ~ARRAY].uses
        if uses and (("a" in uses and code[k * ROW + 1] == k - k0)
                     or ("b" in uses and code[k * ROW + 2] == k - k0)):
            return False
    return not any(k > k0 and k0 in tape.aux[k][0] for k in tape.nary)


def _rebind(x, res):
    """Make tensor ``x`` the result of an in-place op recorded out of place."""
    if x._tape is not None:  # entries before this op that saved x's old value now see a
        x._tape.dirty[x._slot] = res._slot if res._tape is x._tape else len(x._tape)
    x._d = res._d
    x._rg = res._rg
    x._tape = res._tape
    x._sid = res._sid
    x._slot = res._slot
    if res._d.__class__ is not _pyfloat:
        x._ver = [0]  # a new array: what a tape saved of the old one is unchanged
    if getattr(x, "_views", None):
        _rederive(x)


def _inplace_write(x, write, detached=False):
    """Modify ``x``'s array in place (no recording): copy-on-write when a tape holds it.
    ``detached``: the write came through a ``detach``, whose writes are never recorded."""
    alias = getattr(x, "_alias", None)
    if alias is not None:  # a view: the write is made on its base, whose views all see it
        new = np.array(x._d, copy=True)
        write(new)
        _, kind, arg = alias
        base = _base(alias)
        if base is None:  # the base is gone, but a tape may hold the array: x's own copy
            x._alias = None
            if x._d.__class__ is _pyfloat:
                x._d = _pyfloat(new)
            else:
                x._d, x._ver = new, [0]
            x._sid = -1
            if x._tape is not None:
                x._tape.dirty[x._slot] = len(x._tape)
                _keep_on_tape(x)
            if getattr(x, "_views", None):
                _rederive(x)
            return
        if not detached and kind != "detach" and base._rg and STATE.grad_enabled:
            raise RuntimeError("A view was created in no_grad mode and is being modified "
                               "inplace with grad mode enabled. Given that this use case is "
                               "ambiguous and error-prone, it is forbidden. Clone the view, or "
                               "take it with grad mode enabled.")
        _inplace_write(base, lambda arr: _put(kind, arg, arr, new), detached or kind == "detach")
        return
    d = x._d
    if x._tape is not None or not d.flags.writeable:
        d = np.array(d, copy=True)
        write(d)
        if x._tape is not None:
            x._tape.dirty[x._slot] = len(x._tape)
        x._d = d
        x._ver = [0]  # a new array: what a tape saved of the old one is unchanged
    else:
        write(d)
        bump(x._ver)
    x._sid = -1
    if x._tape is not None:
        _keep_on_tape(x)
    if getattr(x, "_views", None):  # (0-d views, and those of a replaced array)
        _rederive(x)


def _put(kind, arg, a, v):
    """Write ``v``, the new value of a view, into its base's array ``a``."""
    if kind == "detach":
        if not arg:
            np.copyto(a, v, casting="unsafe")
            return
        for k, g in arg[:-1]:
            a = _derive(k, g, a)
        kind, arg = arg[-1]
    if kind == "index":
        a[arg] = v
        return
    try:
        view = _derive(kind, arg, a)
    except AttributeError:
        view = None
    if view is None or kind == "expand" or not np.shares_memory(view, a) and view.size:
        raise RuntimeError("an in-place change of a view whose base's layout no longer allows "
                           "the view: clone() the view before writing into it")
    np.copyto(view, v, casting="unsafe")


def _leaf_base(t):
    """The leaf that requires grad which view ``t`` (through views) is of, else None."""
    while True:
        alias = getattr(t, "_alias", None)
        if alias is None or alias[1] == "detach":  # (a detach's writes are no leaf's)
            return None
        t = _base(alias)
        if t is None:
            return None
        if t._rg and t._tape is None:
            return t


def _write_back(t):
    """``t``, a view, was changed in place (recorded): its base takes the new value,
    recorded too, and so on up the views; then the base's views are derived again."""
    alias = getattr(t, "_alias", None)
    if alias is None:
        return
    _, kind, arg = alias
    base = _base(alias)
    if base is None:  # nothing else shows t's elements any more
        return
    if kind == "index":
        setitem(base, arg, t)  # writes back from base in turn
        return
    if kind == "detach":  # torch: the base takes the value, not the graph (and t keeps its
        # own when derived again: _rebase)
        with _no_grad():
            _inplace_write(base, lambda arr: _put(kind, arg, arr, t._d), True)
        return
    if kind == "reshape":
        new = reshape(t, arg[1])
    elif kind == "transpose":
        new = t if arg is None else transpose(t, *arg)
    else:  # permute (expand views refuse writes: _check_writable)
        new = permute(t, tuple(int(i) for i in np.argsort(arg)))
    if new.dtype is not base.dtype:
        new = _to_dtype(new, base.dtype.np)
    old = base._d
    if new._d.__class__ is np.ndarray and old.__class__ is np.ndarray \
            and old.flags.c_contiguous and not new._d.flags.c_contiguous:
        # the base keeps its layout, as torch's storage does: as a view of t's new array
        # (t.T written by t.copy_) a later reshape of t gave a view of the base where
        # torch's copies (t is not contiguous), and its writes reached the base
        new = clone(new)
        new._d = np.ascontiguousarray(new._d)
    _rebind(base, new)
    _write_back(base)


def _no_grad():
    from ._grad_mode import no_grad
    return no_grad()


def _keep_on_tape(x):
    """After an unrecorded in-place change (under no_grad) of non-leaf ``x``: enter its new
    value on its tape as an identity of the old entry, so later ops read the new value and
    the gradient flows through the in-place op unchanged, as in torch (``x`` keeps its
    history; without this it would be entered again as a leaf of its own)."""
    if STATE.trace is not None:
        return
    tape, old = x._tape, x._slot
    v = x._d
    k = tape.append(_CLONE if v.__class__ is _pyfloat else _CLONE | ARRAY, old, -1, 0.0, 0.0,
                    v)
    x._slot, x._sid = k, tape.sid
    if getattr(x, "_retains", False):
        import weakref
        tape.retained.pop(old, None)
        tape.retained[k] = weakref.ref(x)
    from .autograd.graph import entry_name
    _hint(x, entry_name(tape, old))  # it prints as the op that made it, as torch's


def _inplace(op_fn):
    def method(self, other):
        other = _tn(other, "other")
        grad = STATE.grad_enabled and (self._rg or (isinstance(other, Tensor) and other._rg))
        if grad and self._rg and self._tape is None:
            raise RuntimeError("a leaf Variable that requires grad is being used in an "
                               "in-place operation. Use an out-of-place op (x = x + y), or "
                               "update it inside tapegrad.no_grad().")
        view = _leaf_base(self) if grad else None
        if view is not None:
            raise RuntimeError("a view of a leaf Variable that requires grad is being used in "
                               "an in-place operation. Use an out-of-place op, or update it "
                               "inside tapegrad.no_grad().")
        oshape = other.shape if isinstance(other, Tensor) else np.shape(other)
        try:
            bshape = np.broadcast_shapes(self.shape, oshape)
        except ValueError:
            bshape = None
        if bshape != self.shape:  # checked before anything is recorded
            raise RuntimeError(f"output with shape {list(self.shape)} doesn't match the "
                               f"broadcast shape {list(bshape or oshape)}")
        _check_writable(self)
        res = op_fn(self, other)
        if grad:
            if res.dtype is not self.dtype:
                res = _to_dtype(res, self.dtype.np)
            _rebind(self, res)
            _write_back(self)  # write through to the base, as torch's views do
            return self
        v = res._d
        tr = STATE.trace
        if tr is not None:  # self takes res's value: and its reference, when traced
            tr.rebind(self, res)
        if self._d.__class__ is _pyfloat and getattr(self, "_alias", None) is None:
            self._d = v if v.__class__ is _pyfloat else float(v)
            self._sid = -1
            box = getattr(self, "_ver", None)
            if box is not None:
                bump(box)
            if self._tape is not None:
                self._tape.dirty[self._slot] = len(self._tape)
                _keep_on_tape(self)
            if getattr(self, "_views", None):
                _rederive(self)
            return self
        rt = np.asarray(v).dtype
        if _cat(rt) > _cat(self.dtype.np):  # torch's canCast: no float into int, int into bool
            raise RuntimeError(f"result type {TORCH_NAMES[rt.name]} can't be cast to the "
                               f"desired output type {TORCH_NAMES[self.dtype.name]}")
        _inplace_write(self, lambda arr: np.copyto(arr, v, casting="unsafe"))
        return self
    return method
