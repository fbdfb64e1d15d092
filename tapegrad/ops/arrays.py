"""Array-only ops (reductions, shapes, linear algebra, indexing): NumPy forward, rule in F.

Forward: ``np(*values, aux)``; rule: ``vjp(F, g, values, out, aux)`` returning one gradient
(or None, or a zero-argument function that builds it: the sweep calls it only when that input
needs a gradient) per tensor input. ``aux`` holds the entry's non-float constants (shapes, dims,
index arrays), everything needed to run the forward again. Rules call other registered
ops through ``F`` so that a later re-recording backend can run them on tensors.
"""
from __future__ import annotations

import numpy as np

from .._fma import fms_np
from . import lowering as lw
from ._extreme import picked
from ._kernels import PAR_MIN as _PAR_MIN, matmul as _matmul, scatter_add as _scatter_add, \
    sum_last as _sum_last_par
from ._registry import ARRAY_OP, UNARY, Part, register

A = ARRAY_OP


def _shape(x):
    """``np.shape(x)`` (the same object: its own ``x.shape`` attempt first) without NumPy's
    function dispatch: 1.4 us on a tensor to 0.2, a dozen calls in a create_graph sweep.
    A float (a full reduction's gradient) is told first: its failed attribute read costs
    0.6 us."""
    if x.__class__ is float:
        return ()
    try:
        return x.shape
    except AttributeError:
        return np.asarray(x).shape


def _ndim(x):
    """``np.ndim(x)`` without NumPy's function dispatch (as ``_shape``)."""
    if x.__class__ is float:
        return 0
    try:
        return x.ndim
    except AttributeError:
        return np.asarray(x).ndim


def _kshape(out_shape, dims, keepdim, in_ndim):
    if keepdim:
        return tuple(out_shape)
    shape = list(out_shape)
    for d in sorted(range(in_ndim) if dims is None else dims):
        shape.insert(d, 1)
    return tuple(shape)


def _gk(F, g, a, aux):
    """g reshaped so that it broadcasts against the reduction's input."""
    dims, keepdim = aux[0], aux[1]
    if keepdim or dims is None and _ndim(g) == 0:
        return g
    gs = _shape(g)  # (once: on a tensor, a Size built each time)
    ks = _kshape(gs, dims, keepdim, _ndim(a))
    return g if ks == gs else F.reshape(g, (ks, gs))


# --- batched sweeps (is_grads_batched) ----------------------------------------------------
# An array op's rule runs once for the whole batch: its values are viewed with a leading
# batch axis (zero-copy broadcasts) and its aux is shifted to match, so the rule itself is
# unchanged; ``post`` (one function or None per input) maps a gradient back where the views
# changed its shape. Elementwise ops need nothing: their rules broadcast. Each array op
# names its batch rule in its register(...) call.


def _bval(x, B):
    if x is None:
        return None
    if hasattr(x, "expand"):  # a tensor (the recorded sweep of create_graph): recorded
        return x.expand((B,) + tuple(x.shape))
    return np.broadcast_to(x, (B,) + _shape(x))


def _bdims(dims, ndim):
    return tuple(range(1, ndim + 1)) if dims is None else tuple(d + 1 for d in dims)


def _bidx(index):
    return (slice(None),) + (index if isinstance(index, tuple) else (index,))


def _plain_batch(shift_aux):
    def batch(values, out, g, aux, B):
        return [_bval(v, B) for v in values], _bval(out, B), g, shift_aux(aux, values, B), None
    return batch


def _reduce_aux(aux, values, B):
    # a saved index (max/min over a dim) gets the batch axis too; over the only dim of a
    # 1-d input it is a NumPy integer, not an array
    rest = tuple(_bval(r, B) if isinstance(r, (np.ndarray, np.integer)) else r
                 for r in aux[2:])
    return (_bdims(aux[0], _ndim(values[0])), aux[1]) + rest


def _shapes_aux(aux, values, B):
    return ((B,) + tuple(aux[0]), (B,) + tuple(aux[1]))


def _same_aux(aux, values, B):
    return aux


def _softmax_aux(aux, values, B):
    return (aux[0] + 1,)


def _transpose_aux(aux, values, B):
    return tuple(d + 1 if d >= 0 else d for d in aux)


def _permute_aux(aux, values, B):
    return (0,) + tuple(p + 1 for p in aux)


def _index_aux(aux, values, B):
    return (_bidx(aux[0]), (B,) + tuple(aux[1])) + tuple(aux[2:])


def _diag_aux(aux, values, B):
    return (aux[0], True)


def _nary_aux(aux, values, B):
    return (aux[0], aux[1] + 1)


def _matmul_batch(values, out, g, aux, B):
    a, b = values
    one_a, one_b = _ndim(a) == 1, _ndim(b) == 1
    g = g if hasattr(g, "expand") else np.asarray(g)
    if one_a and one_b:  # a dot product: the rule is elementwise, g needs a sample axis
        return [a, b], out, g[:, None], aux, None
    if one_a:
        a, g = a[None, :], g[..., None, :]
    if one_b:
        b, g = b[:, None], g[..., None]
    # the batch axis goes in front of both: a side with fewer dims than the other first
    # gets its broadcast axes, or (B, 4, 30) would meet (B, 22, 4, 4) misaligned
    nd = max(_ndim(a), _ndim(b))
    pads = [nd - _ndim(a), nd - _ndim(b)]
    a, b = (x.reshape((1,) * p + tuple(_shape(x))) if p else x for x, p in zip((a, b), pads))

    def unpad(p, then):
        if not p:
            return then
        return lambda gx: (then or (lambda y: y))(gx.reshape(
            (_shape(gx)[0],) + tuple(_shape(gx)[1 + p:])))
    post = (unpad(pads[0], (lambda ga: ga[..., 0, :]) if one_a else None),
            unpad(pads[1], (lambda gb: gb[..., 0]) if one_b else None))
    return [_bval(a, B), _bval(b, B)], None, g, aux, post


def _broadcast_batch(values, out, g, aux, B):
    """expand / sum_to (aux: this entry's shape, its input's shape). A broadcast aligns
    shapes at the right, which under a leading batch axis would align the batch with a data
    axis: the smaller shape is padded with leading 1s to the larger's length instead (and
    g with it, where g has the smaller shape); the sweep's batched fit drops the 1s again."""
    to, frm = tuple(aux[0]), tuple(aux[1])
    n = max(len(to), len(frm))
    pto, pfrm = (1,) * (n - len(to)) + to, (1,) * (n - len(frm)) + frm
    if pto != to:
        g = g.reshape((B,) + pto)
    return [_bval(v, B) for v in values], _bval(out, B), g, ((B,) + pto, (B,) + pfrm), None


def _setitem_batch(values, out, g, aux, B):
    """The written value's gradient is g at the index, summed to the value's shape. Under
    the batch axis that sum must keep the batch axis: the rule sees the value as shaped like
    the indexed region (its sum_to is then the identity) and the sweep's batched fit sums
    it to the value's own shape."""
    a, b = values
    region = np.empty(_shape(out), dtype=np.bool_)[aux[0]].shape
    return ([_bval(a, B), np.broadcast_to(np.zeros(()), (B,) + region)], _bval(out, B), g,
            (_bidx(aux[0]), _bval(aux[1], B)), None)


def _outer_batch(values, out, g, aux, B):
    a, b = values
    return ([_bval(a[None, :], B), _bval(b[:, None], B)], None, g, aux,
            (lambda ga: ga[..., 0], lambda gb: gb[..., 0, :]))


# --- shapes -----------------------------------------------------------------------------------
register("clone", UNARY, py=lambda a: a, np=lambda a: np.array(  # torch: an expanded
    a, copy=True, order="C" if 0 in np.shape(a) or 0 in np.asarray(a).strides else "K"),
    nb="{a}",  # (overlapping) tensor's clone is contiguous, a dense one keeps its strides
         torch="clone", vjp=lambda F, g, a, out: (g,), saves=False, api=("clone",), method=True)
register("reshape", A, np=lambda a, aux: np.reshape(a, aux[0]), torch="reshape", saves=False,
         vjp=lambda F, g, v, out, aux: (F.reshape(g, (aux[1], aux[0])),),
         batch=_plain_batch(_shapes_aux), lower=lw.lower_reshape, api=("reshape",))
def _expand(a, aux):
    shape = aux[0]
    if a.__class__ is np.ndarray and a.ndim and a.flags.c_contiguous and a.size:
        # (a sum's gradient broadcast back in an array sweep): the zero-stride view
        # broadcast_to makes, built directly at half its cost
        pad = len(shape) - a.ndim
        if pad >= 0:
            strides = [0] * pad
            for n, st, want in zip(a.shape, a.strides, shape[pad:]):
                if n == want:
                    strides.append(st)
                elif n == 1:
                    strides.append(0)
                else:
                    break  # not broadcastable: broadcast_to's error below
            else:
                v = np.ndarray(shape, a.dtype, a, 0, strides)
                v.flags.writeable = False
                return v
    if a.__class__ is float:  # the common case (a full reduction's gradient): a zero-stride
        # view of it, built without asarray and reshape (1.9 us to 0.7)
        return np.ndarray(shape, _F64, np.array((a,)), 0, (0,) * len(shape))
    if _ndim(a) == 0:  # a 0-d array or a NumPy scalar: a zero-stride view
        a = np.asarray(a)
        return np.ndarray(shape, a.dtype, buffer=a.reshape(1), strides=(0,) * len(shape))
    return np.broadcast_to(a, shape)


register("expand", A, np=_expand, saves=False,
         vjp=lambda F, g, v, out, aux: (F.sum_to(g, (aux[1], aux[0])),),
         batch=_broadcast_batch, lower=lw.lower_expand, via="`Tensor.expand`, broadcasting")
register("sum_to", A, saves=False,
         np=lambda a, aux: sum_to(a, aux[0]),
         vjp=lambda F, g, v, out, aux: (F.expand(g, (aux[1], aux[0])),),
         batch=_broadcast_batch, lower=lw.lower_sum_to, via="the gradient of broadcasting")
register("transpose", A, np=lambda a, aux: np.swapaxes(a, aux[0], aux[1]), torch="transpose",
         saves=False, vjp=lambda F, g, v, out, aux: (F.transpose(g, aux),),
         batch=_plain_batch(_transpose_aux), lower=lw.lower_transpose,
         api=("transpose",), method=True)
register("permute", A, np=lambda a, aux: np.transpose(a, aux), torch="permute", saves=False,
         vjp=lambda F, g, v, out, aux: (F.permute(g, tuple(np.argsort(aux))),),
         batch=_plain_batch(_permute_aux), lower=lw.lower_permute, api=("permute",), method=True)
register("cast", A, np=lambda a, aux: np.asarray(a, dtype=aux[0]), saves=False,
         vjp=lambda F, g, v, out, aux: (F.cast(g, (aux[1], aux[0])),),
         batch=_plain_batch(_same_aux), lower=lw.lower_cast,
         via="`Tensor.to(dtype)`, `.double()`, `.float()`")


def _stack_vjp(F, g, vals, out, aux):
    dim = aux[1]
    return tuple(F.getitem(g, ((slice(None),) * dim + (i,), _shape(g)))
                 for i in range(len(vals)))


def _cat_vjp(F, g, vals, out, aux):
    dim, grads, start = aux[1], [], 0
    for v in vals:
        n = _shape(v)[dim]
        grads.append(F.getitem(g, ((slice(None),) * dim + (slice(start, start + n),),
                                   _shape(g))))
        start += n
    return tuple(grads)


register("stack", A, nary=True, torch="stack", saves=False,
         np=lambda *a: np.stack(a[:-1], axis=a[-1][1]), vjp=_stack_vjp,
         batch=_plain_batch(_nary_aux), lower=lw.lower_stack, api=("stack",))
register("cat", A, nary=True, torch="cat", saves=False,
         np=lambda *a: np.concatenate(a[:-1], axis=a[-1][1]), vjp=_cat_vjp,
         batch=_plain_batch(_nary_aux), lower=lw.lower_cat, api=("cat", "concat"))


def _diag_np(a, aux):
    return np.diag(a, aux[0])


def _diag_vjp(F, g, v, out, aux):
    """aux: (offset,), or (offset, True) under a batch axis (is_grads_batched)."""
    lead = (slice(None),) if len(aux) > 1 else ()
    shape = _shape(v[0])
    if len(shape) - len(lead) == 1:  # diag built a matrix: its gradient is g's diagonal
        gshape = _shape(g)
        return (F.getitem(g, (lead + diag_index(gshape[len(lead):], aux[0]), gshape)),)
    return (F.index_scatter(g, (lead + diag_index(shape[len(lead):], aux[0]), shape)),)


def diag_index(shape, k):
    n = len(np.diag(np.empty(shape, dtype=np.bool_), k))
    rows = np.arange(n) + max(-k, 0)
    return (rows, rows + k)


register("diag", A, np=_diag_np, torch="diag", saves=False, vjp=_diag_vjp,
         batch=_plain_batch(_diag_aux), lower=lw.lower_diag, api=("diag",), method=True)

# --- indexing -----------------------------------------------------------------------------------


def _basic(index):
    """Whether ``index`` is basic (ints, slices, None, Ellipsis): no element repeats."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, np.integer, slice))
               for i in items)


def _index_scatter(g, aux):
    index, shape = aux[0], aux[1]
    z = np.zeros(shape, dtype=g.dtype if g.__class__ is np.ndarray else np.result_type(g))
    if (aux[2] if len(aux) > 2 else _basic(index)):
        z[index] = g
    elif _scatter_add(z, index, g):
        pass  # one integer array among full slices (gmm's ``lpad[:, idx]``): add.at's bits
    elif z.dtype.kind == "f" and _distinct(index, shape):
        # no element repeats (ba's ``a[:, [1, 2, 0]]``): written, not ``add.at``'s slow
        # accumulation (30 us to 4 for 3,000 numbers); ``+ 0.0`` gives add.at's bits
        # (0.0 + g: a -0.0 of g becomes 0.0, as in torch's accumulating index_put)
        z[index] = g
        z += 0.0
    else:
        np.add.at(z, index, g)  # repeated indices accumulate
    return z


def _distinct(index, shape):
    """Whether advanced ``index`` into an array of ``shape`` reaches no element twice: one
    integer array among slices and ints (no None or Ellipsis), its values distinct."""
    items = index if index.__class__ is tuple else (index,)
    arr = None
    for ax, i in enumerate(items):
        if i.__class__ is np.ndarray:
            if arr is not None or i.dtype.kind not in "iu" or ax >= len(shape):
                return False
            arr, n = i, shape[ax]
        elif i.__class__ is not slice and i.__class__ is not int:
            return False
    if arr is None or len(items) > len(shape):
        return False
    flat = arr.reshape(-1)
    if flat.size <= 16:  # (ba's three columns: a set, not NumPy's sort)
        vals = [v + n if v < 0 else v for v in flat.tolist()]
        return len(set(vals)) == len(vals)
    flat = np.where(flat < 0, flat + n, flat)
    return np.unique(flat).size == flat.size


register("getitem", A, np=lambda a, aux: np.asarray(a)[aux[0]], saves=False,  # aux: index,
         vjp=lambda F, g, v, out, aux: (F.index_scatter(g, aux),),  # shape, basic
         scatter=("index", lambda g, n: g),  # the same rule, added in place at the index
         batch=_plain_batch(_index_aux), lower=lw.lower_getitem, via="`x[index]`")
register("index_scatter", A, np=_index_scatter, saves=False,
         vjp=lambda F, g, v, out, aux: (F.getitem(g, (aux[0], aux[1])),),
         batch=_plain_batch(_index_aux), lower=lw.lower_index_scatter,
         via="the gradient of `x[index]`")


def _setitem_np(a, b, aux):
    out = np.array(a, copy=True)
    out[aux[0]] = b
    return out


def _setitem_vjp(F, g, v, out, aux):
    # aux: (index, None). The written region of g is zeroed by writing zeros there: the
    # entry keeps only its index, no mask or copy the size of the destination (a loop of
    # row writes stays linear in memory)
    index = aux[0]
    gb = F.getitem(g, (index, _shape(g)))
    return (F.setitem(g, F.zeros_like(gb), (index, None)),
            F.sum_to(gb, (_shape(v[1]), _shape(gb))))


register("setitem", A, np=_setitem_np, saves=False, vjp=_setitem_vjp,
         batch=_setitem_batch, lower=lw.lower_setitem, via="`x[index] = v`")
register("where", A, np=lambda a, b, aux: np.where(aux[0], a, b), torch="where", saves=False,
         vjp=lambda F, g, v, out, aux: (F.where(aux[0], g, F.zeros_like(g)),
                                        F.where(aux[0], F.zeros_like(g), g)),
         batch=_plain_batch(_same_aux), lower=lw.lower_where, api=("where",))

# --- reductions -----------------------------------------------------------------------------


def _sum_vjp(F, g, v, out, aux):
    a = v[0]
    gk = _gk(F, g, a, aux)
    return (F.expand(gk, (_shape(a), _shape(gk))),)


def _numel(x):
    return int(np.prod(_shape(x)))


def _mean_vjp(F, g, v, out, aux):
    # the count from the reduced dims, not from out: the recorded sweep passes no out
    # (mean saves nothing), and numel(a) / 1 counted every element, not one slice's
    shape = _shape(v[0])
    n = _numel(v[0]) if aux[0] is None else int(np.prod([shape[d] for d in aux[0]]))
    gk = _gk(F, g, v[0], aux)
    return (F.expand(gk, (_shape(v[0]), _shape(gk))) / float(n),)


def _prod_np(a, aux):
    return np.prod(a, axis=aux[0], keepdims=aux[1])


def _prod_vjp(F, g, v, out, aux):
    a = v[0]
    if not np.any(F.raw(a) == 0):  # out / a, as torch: differentiable again
        return (_gk(F, g, a, aux) * (_gk(F, out, a, aux) / a),)
    return (_gk(F, g, a, aux) * F.prod_others(a, aux + (F.raw(out),)),)


def _reduced_rows(shape, dims):
    """How a reduction over ``dims`` lays ``shape`` out as rows: (perm, kept shape, n) where
    moving the reduced dims last (``perm``) and merging them gives shape ``kept + (n,)``."""
    nd = len(shape)
    red = tuple(range(nd)) if dims is None else tuple(sorted(d % nd for d in dims))
    kept = tuple(d for d in range(nd) if d not in red)
    return kept + red, tuple(shape[d] for d in kept), int(np.prod([shape[d] for d in red]))


def _prod_others(a, aux):
    """Product of all other elements of each one's reduced slice: ``out / a`` like torch where
    a slice has no zero, the exact exclusive product where it has one. aux: (dims, keepdim,
    the prod's value)."""
    a = np.asarray(a)
    out = np.asarray(aux[-1])
    if not (a == 0).any():
        return out.reshape(_kshape(out.shape, aux[0], aux[1], a.ndim)) / a
    perm, kept, n = _reduced_rows(a.shape, aux[0])
    rows = np.transpose(a, perm).reshape(kept + (n,))
    excl = _excl(rows).reshape(tuple(a.shape[d] for d in perm))
    return np.transpose(excl, np.argsort(perm))


def _excl(x):
    ones = np.ones_like(x[..., :1])
    left = np.cumprod(np.concatenate([ones, x[..., :-1]], axis=-1), axis=-1)
    right = np.cumprod(np.concatenate([ones, x[..., :0:-1]], axis=-1), axis=-1)[..., ::-1]
    return left * right


def _prod_others_vjp(F, g, v, out, aux):
    """d/da_i of prod_others(a)_k is the product of the slice without a_i and a_k (0 for i ==
    k). With the reduced dims laid out as a row of n, each element i gets the row M_i = a with
    a_i set to 1; the exclusive products of M_i, zeroed on the diagonal, weight g. Written in
    registered ops (prod_others again), so it differentiates to any order. It builds n x n
    per slice: it runs only where a slice holds an exact zero (elsewhere prod's rule is
    ``out / a``), and prod's reductions are short."""
    a = v[0]
    shape = _shape(a)
    perm, kept, n = _reduced_rows(shape, aux[0])
    moved = tuple(shape[d] for d in perm)
    ident = perm == tuple(range(len(shape)))

    def rows(x):
        x = x if ident else F.permute(x, perm)
        return F.reshape(x, (kept + (1, n), moved))

    eye = np.eye(n, dtype=bool)
    m = F.where(eye, 1.0, F.expand(rows(a), (kept + (n, n), kept + (1, n))))
    axis = (len(kept) + 1,)
    q = F.prod_others(m, (axis, True, np.prod(F.raw(m), axis=axis, keepdims=True)))
    gx = F.sum(F.where(eye, F.zeros_like(q), q) * rows(g), (axis, False))
    gx = F.reshape(gx, (moved, kept + (n,)))
    return (gx if ident else F.permute(gx, tuple(np.argsort(perm))),)


register("sum", A, np=lambda a, aux: np.sum(a, axis=aux[0], keepdims=aux[1]), torch="sum",
         saves=False, vjp=_sum_vjp, scatter=("all", lambda g, n: g),
         batch=_plain_batch(_reduce_aux), lower=lw.lower_sum, api=("sum",), method=True)


def _mean_np(a, aux):
    if np.size(a) == 0:  # NaN (0 / 0) without NumPy's "Mean of empty slice" warning, as torch
        with np.errstate(all="ignore"):
            return np.sum(a, axis=aux[0], keepdims=aux[1]) / 0.0
    return np.mean(a, axis=aux[0], keepdims=aux[1])


register("mean", A, np=_mean_np, torch="mean",
         saves=False, vjp=_mean_vjp, scatter=("all", lambda g, n: g / n),
         batch=_plain_batch(_reduce_aux), lower=lw.lower_mean, api=("mean",), method=True)
register("prod", A, np=_prod_np, torch="prod", vjp=_prod_vjp,
         batch=_plain_batch(_reduce_aux), lower=lw.lower_prod, api=("prod",), method=True,
         torch_saves=("a", "out"))
register("prod_others", A, np=_prod_others, vjp=_prod_others_vjp,
         batch=_plain_batch(_reduce_aux), lower=lw.lower_prod_others, via="the gradient of `prod`")


def _extreme_np(fn):
    return lambda a, aux: fn(a, axis=aux[0], keepdims=aux[1])


def _extreme_vjp(F, g, v, out, aux):
    """Full reductions split g evenly over ties; dim reductions give it to the first index."""
    a = v[0]
    even = isinstance(aux[2], str)  # max()/min() over everything
    if aux[2] is None or even:  # ties share evenly
        ra, ok = F.raw(a), F.raw(_gk(F, out, a, aux))
        mask = np.asarray(ra == ok)
        if even:  # a NaN result goes to the NaNs, as torch's evenly_distribute_backward
            # an array, also for a 0-d input: NumPy's bool scalar is not an operand a tensor
            # takes (create_graph multiplies a tensor by it)
            mask = np.asarray(mask | (np.isnan(ra) & np.isnan(ok))) if np.isnan(ok).any() \
                else np.asarray(mask)  # (no NaN result: no pass over the input for NaNs)
        if aux[0] is None:  # the count of a bool mask: count_nonzero, a tenth of sum's time
            count = np.array(np.count_nonzero(mask), dtype=np.int64).reshape((1,) * mask.ndim)
        else:
            count = np.sum(mask, axis=aux[0], keepdims=True)
        val = _gk(F, g, a, aux) / count
        if even:  # torch's evenly_distribute_backward (CPU): zeros, val where picked
            if val.__class__ is np.ndarray and val.size == 1 and mask.ndim:
                res = np.zeros(mask.shape, dtype=val.dtype)  # one pass, no bool-float cast:
                np.copyto(res, val.reshape(()), where=mask)  # most of lse's backward
                return (res,)
            return (F.where(mask, val, F.zeros_like(a)),)
        # amax/amin: torch's scale_grad_by_count, mask * val (all-NaN when count is 0)
        if val.__class__ is np.ndarray:  # its bits, 1.0 * val or 0.0 * val, with no cast
            return (np.where(mask, val, val * 0.0),)
        return (mask * val,)
    dim, index = aux[0][0], aux[2]
    shape = _shape(a)
    # where broadcasts g itself (no expand entry to record), unreshaped when the reduced
    # dim leads (kmeans' min over k): no reshape entry either
    gk = g if not aux[1] and all(n == 1 for n in shape[:dim]) else _gk(F, g, a, aux)
    return (F.where(picked(shape, dim, index), gk, F.zeros_like(a)),)


def _extreme_saves(aux):
    """torch's max/min over everything save the input and result; over a dim, the indices
    only (aux[2]: None or a str for everything, else the indices)."""
    return _INPUT_OUT if aux[2] is None or isinstance(aux[2], str) else frozenset()


_INPUT_OUT = frozenset(("a", "out"))
register("amax", A, np=_extreme_np(np.max), torch="max", vjp=_extreme_vjp,
         batch=_plain_batch(_reduce_aux), lower=lw.lower_amax, api=("amax", "max"), method=True,
         torch_saves=_extreme_saves)
register("amin", A, np=_extreme_np(np.min), torch="min", vjp=_extreme_vjp,
         batch=_plain_batch(_reduce_aux), lower=lw.lower_amin, api=("amin", "min"), method=True,
         torch_saves=_extreme_saves)


def _norm_np(a, aux):
    p, dims, keepdim = aux[2], aux[0], aux[1]
    x = np.abs(a)
    if p != 0 and (a.size if dims is None else np.prod([a.shape[d] for d in dims])) == 1:
        # one element: its absolute value, as torch's, where x * x overflows at 1e200 (inf)
        # or underflows at 1e-310 (0)
        return np.sum(x, axis=dims, keepdims=keepdim)
    if p == 2:
        return np.sqrt(np.sum(x * x, axis=dims, keepdims=keepdim))
    if p == np.inf:
        return np.max(x, axis=dims, keepdims=keepdim)
    if p == -np.inf:
        return np.min(x, axis=dims, keepdims=keepdim)
    if p == 0:
        return np.sum(x != 0, axis=dims, keepdims=keepdim).astype(np.result_type(a))
    if p == 1:
        return np.sum(x, axis=dims, keepdims=keepdim)
    return np.sum(x ** p, axis=dims, keepdims=keepdim) ** (1.0 / p)


def _norm_vjp(F, g, v, out, aux):
    a, p = v[0], aux[2]
    gk = _gk(F, g, a, aux)
    ok = _gk(F, out, a, aux)
    if isinstance(ok, float):  # 0.0 ** negative: inf like NumPy, not ZeroDivisionError
        ok = np.float64(ok)
    # the masked-out places divide by 1, not 0: no inf * 0 computed (a NumPy warning that
    # torch does not give), same values and derivatives
    zero = F.raw(ok) == 0.0
    if p == 2:
        # (torch's order, grad * (x / norm): at a subnormal x, 1 / norm overflows)
        return (F.where(zero, F.zeros_like(a), gk * (a / F.where(zero, 1.0, ok))),)
    if p == 1:
        return (F.sign(a) * gk,)
    if p == 0:  # a count: torch's gradient is undefined (None, zeros when materialized)
        return (None,)
    if p in (np.inf, -np.inf):
        mask = np.abs(F.raw(a)) == F.raw(ok)
        cnt = np.sum(mask, axis=aux[0], keepdims=True)
        return (F.where(mask, F.sign(a) * gk / cnt, F.zeros_like(a)),)
    za = F.raw(a) == 0.0
    return (F.where(zero | za, F.zeros_like(a),
                    F.sign(a) * F.where(za, 1.0, F.abs(a)) ** (p - 1.0) * gk
                    / F.where(zero, 1.0, ok) ** (p - 1.0)),)


register("norm", A, np=_norm_np, torch="norm", vjp=_norm_vjp,
         batch=_plain_batch(_reduce_aux), lower=lw.lower_norm, api=("norm",), method=True,
         torch_saves=("a", "out"))


def _lse_np(a, aux):
    dims, keepdim = aux[0], aux[1]
    m = np.max(a, axis=dims, keepdims=True) if np.size(a) else np.zeros_like(a, shape=())
    m = np.where(np.isfinite(m), m, 0.0)
    s = np.log(np.sum(np.exp(a - m), axis=dims, keepdims=True)) + m
    return s if keepdim else np.squeeze(s, axis=dims)


register("logsumexp", A, np=_lse_np, torch="logsumexp",
         vjp=lambda F, g, v, out, aux: (
             _gk(F, g, v[0], aux) * F.exp(v[0] - _gk(F, out, v[0], aux)),),
         batch=_plain_batch(_reduce_aux), lower=lw.lower_logsumexp, api=("logsumexp",), method=True,
         torch_saves=("a", "out"))


def _softmax_np(a, aux):
    d = aux[0]
    # shifted by the max itself, as torch: a row with +inf is NaN throughout (inf - inf),
    # not 0 at its finite elements; a row of -inf or with a NaN is NaN either way
    m = np.max(a, axis=d, keepdims=True, initial=-np.inf)  # initial: an empty input
    e = np.exp(a - m)
    return e / np.sum(e, axis=d, keepdims=True)


def _log_softmax_np(a, aux):
    d = aux[0]
    z = a - np.max(a, axis=d, keepdims=True, initial=-np.inf)  # (as softmax's shift)
    return z - np.log(np.sum(np.exp(z), axis=d, keepdims=True))


register("softmax", A, np=_softmax_np, torch="softmax",
         vjp=lambda F, g, v, out, aux: (
             out * (g - F.sum(g * out, ((aux[0],), True))),),
         batch=_plain_batch(_softmax_aux), lower=lw.lower_softmax, api=("softmax",), method=True,
         torch_saves=("out",))
register("log_softmax", A, np=_log_softmax_np, torch="log_softmax",
         vjp=lambda F, g, v, out, aux: (
             g - F.exp(out) * F.sum(g, ((aux[0],), True)),),
         batch=_plain_batch(_softmax_aux), lower=lw.lower_log_softmax,
         api=("log_softmax",), method=True, torch_saves=("out",))

# --- linear algebra ------------------------------------------------------------------------


def _matmul_vjp(F, g, v, out, aux):
    """Each gradient is a thunk: the sweep builds only those its inputs need (a matmul
    against a constant matrix skips the matrix's gradient, the costly half)."""
    a, b = v
    na, nb = _ndim(a), _ndim(b)
    if na == 1 and nb == 1:
        return (lambda: g * b), (lambda: g * a)
    if na == 2 and nb == 1 or na == 1 and nb == 2:
        # a matrix and a vector (llsq's P @ x): the vector's gradient is a matrix-vector
        # product, a.T @ g or g @ b.T, the same BLAS call (gemv) the reshaped product
        # below makes, so the same bits, without its three reshapes and its sum_to
        if na == 2:
            return (lambda: _matmul_general(F, g, a, b, na, nb)[0]()), \
                (lambda: F.matmul(F.transpose(a, (-1, -2)), g, None))
        return (lambda: F.matmul(g, F.transpose(b, (-1, -2)), None)), \
            (lambda: _matmul_general(F, g, a, b, na, nb)[1]())
    return _matmul_general(F, g, a, b, na, nb)


def _matmul_general(F, g, a, b, na, nb):
    """matmul's gradients as thunks, through 2-d (or batched) products."""
    a2 = a if na > 1 else F.reshape(a, ((1,) + _shape(a), _shape(a)))
    b2 = b if nb > 1 else F.reshape(b, (_shape(b) + (1,), _shape(b)))
    g2 = g
    if na == 1:
        g2 = F.reshape(g2, (_shape(g2)[:-1] + (1,) + _shape(g2)[-1:], _shape(g2)))
    if nb == 1:
        g2 = F.reshape(g2, (_shape(g2) + (1,), _shape(g2)))

    def grad_a():
        ga = F.matmul(g2, F.transpose(b2, (-1, -2)), None)
        ga = F.sum_to(ga, (_shape(a2), _shape(ga)))
        return F.reshape(ga, (_shape(a), _shape(ga))) if na == 1 else ga

    def grad_b():
        gb = F.matmul(F.transpose(a2, (-1, -2)), g2, None)
        gb = F.sum_to(gb, (_shape(b2), _shape(gb)))
        return F.reshape(gb, (_shape(b), _shape(gb))) if nb == 1 else gb
    return grad_a, grad_b


register("matmul", A, np=lambda a, b, aux: _matmul(a, b), torch="matmul", vjp=_matmul_vjp,
         batch=_matmul_batch, lower=lw.lower_matmul, api=("matmul",), method=True,
         torch_saves={"a": ("b",), "b": ("a",)})  # a's gradient reads b, b's reads a
register("outer", A, np=lambda a, b, aux: np.multiply.outer(a, b), torch="outer",
         vjp=lambda F, g, v, out, aux: ((lambda: F.matmul(g, v[1], None)),
                                        (lambda: F.matmul(v[0], g, None))),
         batch=_outer_batch, lower=lw.lower_outer, api=("outer",), method=True,
         torch_saves={"a": ("b",), "b": ("a",)})


#: cross's components as (p, q): component i is a_p * b_q - a_q * b_p
CROSS_P, CROSS_Q = np.array([1, 2, 0]), np.array([2, 0, 1])


def _cross_np(a, b, aux):
    """torch's cross along dim ``aux[0]`` (inputs of one shape): each component
    ``fma(a_p, b_q, -(a_q * b_p))``, as torch's CPU kernel rounds it (``_fma``)."""
    d = aux[0]
    a, b = np.asarray(a), np.asarray(b)
    ap, aq = np.take(a, CROSS_P, axis=d), np.take(a, CROSS_Q, axis=d)
    bp, bq = np.take(b, CROSS_P, axis=d), np.take(b, CROSS_Q, axis=d)
    t = aq * bp
    if t.dtype.kind != "f":  # integers: exact either way
        return ap * bq - t
    return fms_np(ap, bq, t).astype(t.dtype, copy=False)


def _cross_aux(aux, values, B):
    return (aux[0] + 1,)


# torch's rule: cross(other, g) and cross(g, input), crosses again (rounded as torch's)
register("cross", A, np=_cross_np, torch="cross",
         vjp=lambda F, g, v, out, aux: ((lambda: F.cross(v[1], g, aux)),
                                        (lambda: F.cross(g, v[0], aux))),
         batch=_plain_batch(_cross_aux), lower=lw.lower_cross,
         torch_saves={"a": ("b",), "b": ("a",)},
         via="`torch.linalg.cross`, `Tensor.cross`")


def sum_axes(have, want, keep=0):
    """The axes a gradient of shape ``have`` is summed over to shape ``want`` (NumPy
    broadcasting in reverse: the extra leading axes and the axes ``want`` has as 1), the
    first ``keep`` axes of both kept (a batch axis). The one statement of that rule: the
    array sweep (``sum_to``), the batched sweep and the lowering to program rows use it."""
    rest, want = have[keep:], want[keep:]
    lead = len(rest) - len(want)
    return tuple(range(keep, keep + lead)) + tuple(
        keep + lead + i for i, n in enumerate(want) if n == 1 and rest[lead + i] != 1)


def sum_to(g, shape):
    """Sum a broadcast gradient back to ``shape`` (NumPy broadcasting in reverse)."""
    shape = tuple(shape)
    gs = _shape(g)
    if gs == shape:
        return g
    axes = sum_axes(gs, shape)
    r = fast_sum(g, axes, True) if axes else g
    return np.reshape(r, shape)


_F64 = np.dtype(np.float64)


def fast_sum(a, axis, keepdims=False):
    """``np.sum(a, axis=axis, keepdims=keepdims)``, bit for bit, and several times faster
    over one short contiguous last axis (a coordinate axis: NumPy runs one inner loop per
    row, the cost of k-means' (n, k, d) distances): the rows' columns added as NumPy
    does, columns as whole vectors."""
    if a.__class__ is np.ndarray and a.ndim >= 2 and axis is not None and a.dtype == _F64:
        ax = axis
        if ax.__class__ is tuple:
            ax = ax[0] if len(ax) == 1 else None
        n = a.shape[-1]
        if (ax is not None and ax % a.ndim == a.ndim - 1 and 2 <= n <= 8
                and a.size >= 256 * n and a.flags.c_contiguous):
            s = _sum_last(a, n)
            return s[..., None] if keepdims else s
        if ax is not None and ax % a.ndim == a.ndim - 1 and a.size >= _PAR_MIN:
            s = _sum_last_par(a, keepdims)  # (gmm's sum over the points: on threads)
            if s is not None:
                return s
    return np.sum(a, axis=axis, keepdims=keepdims)


def _sum_last(a, n):
    # NumPy's add.reduce over a contiguous row of n <= 8: 0.0 + (sum in order) for n < 8,
    # 0.0 + the pairwise tree of the 8 for n == 8 (the 0.0 makes a sum of -0.0s +0.0)
    if n < 8:
        s = np.add(a[..., 0], a[..., 1])
        for i in range(2, n):
            np.add(s, a[..., i], out=s)
    else:
        s = np.add(a[..., 0], a[..., 1])
        np.add(s, np.add(a[..., 2], a[..., 3]), out=s)
        t = np.add(a[..., 4], a[..., 5])
        np.add(t, np.add(a[..., 6], a[..., 7]), out=t)
        np.add(s, t, out=s)
    np.add(s, 0.0, out=s)
    return s


# --- custom Functions (tapegrad.autograd.Function) -----------------------------------------
# ``function``: one entry per call, inputs its tensor arguments, aux (slots, class, ctx, ...);
# its rule calls the user's backward (autograd/function.py), with the output gradients
# gathered from its ``function_out`` entries as ``Part``s.


def _function_vjp(F, g, v, out, aux):
    # imported here, not at the top: autograd.function imports the tensor layer, which
    # imports the registry (a module already imported costs a dict lookup)
    from ..autograd.function import call_backward
    return call_backward(F, g, aux[1:])


def _program_vjp(F, g, v, out, aux):
    from ..replay import program_vjp  # (as above: replay imports the tensor layer)
    return program_vjp(F, g, v, aux[1:])


register("function", A, nary=True, np=None, vjp=_function_vjp, lower=lw.lower_function,
         via="`autograd.Function.apply`")
register("function_out", A, np=None, saves=False,
         vjp=lambda F, g, v, out, aux: (Part(aux[0], g),),
         batch=lambda values, out, g, aux, B: (values, out, g, aux, None),
         lower=lw.lower_function_out, via="an output of a custom `Function`")
# ``program``: a traced Program called on tensors that require grad (tapegrad.trace), one
# entry per call with its outputs as ``function_out`` entries; aux (slots, program, variant,
# flat inputs, batch). Its rule is the program's own compiled VJP (replay.program_vjp);
# under create_graph, a call of the program's VJP program.
register("program", A, nary=True, np=None, vjp=_program_vjp,
         batch=lambda values, out, g, aux, B: (values, out, g, aux + (B,), None),
         via="a traced `Program` called on tensors")
