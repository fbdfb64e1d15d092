"""How each array op becomes scalar program rows, for ``tapegrad.trace``.

A traced program is scalar: every element of an array value gets its own slot. An array
op's ``lower(L, ins, aux, value)`` receives its inputs as arrays of program slots (``ins``,
int64 arrays shaped like the values), its ``aux`` and its eager output ``value`` (for the
shape), and returns the output's slot array. Each op names its lowering in its
``register(..., lower=...)`` call (ops/arrays.py). Moving, copying and selecting elements
(reshape, transpose, indexing, cat...) only rearranges slots; arithmetic emits rows through
``L`` (``L.op(name, *slot_arrays)`` broadcasts like NumPy). Gradients then come from the
scalar rows' own rules; where eager mode's array rule follows a convention the chain rule
would not (ties share a maximum's gradient, ``norm`` has gradient 0 at 0), the lowering
builds it from ``detach``, ``select`` and ``pick`` rows.
"""
from __future__ import annotations

import numpy as np


class NotTraceable(NotImplementedError):
    """An op that a traced program cannot contain."""


def _axes(dims, ndim):
    return tuple(range(ndim)) if dims is None else tuple(d % max(ndim, 1) for d in dims)


def reduce(L, name, A, dims, keepdim, empty):
    """Reduce ``A`` over ``dims`` (all when None) with binary op ``name``, pairwise (a tree,
    like NumPy's summation); ``empty`` is the value of an empty reduction."""
    A = np.asarray(A)
    axes = _axes(dims, A.ndim)
    keep = [d for d in range(A.ndim) if d not in axes]
    out_shape = tuple(A.shape[d] for d in keep)
    # the reduced axis first: each level of the tree is one op over whole blocks of the
    # kept elements, which stay contiguous slots (array instructions, program_arrays); the
    # reduced size spelled out: with an empty kept dim, -1 cannot be inferred
    M = np.transpose(A, list(axes) + keep).reshape(
        (int(np.prod([A.shape[d] for d in axes])),) + out_shape) if A.ndim else A.reshape(1)
    R = M.shape[0]
    r = None
    if name in ("add", "maximum", "minimum") and R > 1:
        # a sum (an extreme of detached values) in order, as reduction instructions where
        # its terms are evenly spaced: no slot for each level of a tree
        r = L.reduce_terms(np.moveaxis(M, 0, -1), step=name)
    if r is not None:
        pass
    elif R == 0:
        r = L.const(np.full(out_shape, empty))
    else:
        while M.shape[0] > 1:
            h = M.shape[0] // 2
            pair = L.op(name, M[:h], M[h:2 * h])
            M = np.concatenate([pair, M[2 * h:]], axis=0) if M.shape[0] % 2 else pair
        r = M[0]
    if keepdim:
        r = np.reshape(r, tuple(1 if d in axes else A.shape[d] for d in range(A.ndim)))
    return r


def _kept(r, A, dims, keepdim):
    """A reduction's result ``r`` with the reduced dims back (size 1), to broadcast on ``A``."""
    if keepdim:
        return r
    axes = _axes(dims, np.ndim(A))
    return np.reshape(r, tuple(1 if d in axes else np.shape(A)[d] for d in range(np.ndim(A))))


def _lower_extreme(L, ins, aux, value, pick_name):
    """max/min: the value from detached inputs; the gradient through ``pick`` rows to the
    tied elements, evenly (full reductions, amax/amin) or to the first (max(dim))."""
    A = ins[0]
    dims, keepdim, mode = aux[0], aux[1], aux[2]
    if np.ndim(A) == 0:
        return A
    D = L.op("detach", A)
    m = reduce(L, pick_name, D, dims, keepdim, np.nan)
    mk = np.broadcast_to(_kept(m, A, dims, keepdim), np.shape(A))
    # max()/min() over everything and over a dim: a NaN result goes to the NaNs, as eager
    # mode and torch (a NaN max ties with the NaNs, a number with its equals: one pass over
    # the elements); amax/amin: no element ties with a NaN, and the gradient divided by a
    # count of 0 is NaN everywhere, as eager mode and torch's scale_grad_by_count
    # (of A, not of D: the comparisons pass no gradient, and D is read by the max alone,
    # which then reads A: program_arrays._skip_detach)
    tie = L.op("eq" if mode is None else "eq_nan", A, mk)
    # amax/amin: torch's mask * (g / count), an inf or NaN g NaN at every element (pick:
    # g * w); max()/min() and max(dim): g / count or g at the picked elements only, 0.0
    # elsewhere whatever g is (torch's masked fill, index scatter: pick_where)
    pick = "pick" if mode is None else "pick_where"
    if mode is None or isinstance(mode, str):  # ties share evenly
        # the picks' sum (-0.0) divided by the count: each tied element's gradient is
        # g / count, with no pass dividing every element
        count = reduce(L, "add", tie, dims, True, 0.0)
        share = L.op("div", reduce(L, "add", L.op(pick, A, tie), dims, True, -0.0), count)
        return L.op("add", _kept(m, A, dims, keepdim), share).reshape(np.shape(m))
    else:  # the first tied index along the one reduced dim
        d = dims[0] % np.ndim(A)
        T = np.moveaxis(tie, d, -1)
        seen = L.const(np.zeros(T.shape[:-1]))
        first = []
        for i in range(T.shape[-1]):
            first.append(L.op("mul", T[..., i], L.op("logical_not", seen)))
            seen = L.op("logical_or", seen, T[..., i])
        w = np.moveaxis(np.stack(first, axis=-1), -1, d)
    picks = L.op(pick, A, w)
    return L.op("add", _kept(m, A, dims, keepdim),
                reduce(L, "add", picks, dims, True, -0.0)).reshape(np.shape(m))


def _lower_matmul(L, ins, aux, value):
    A, B = ins
    na, nb = np.ndim(A), np.ndim(B)
    if na == 1 and nb == 1:
        r = L.reduce_terms(A, B) if np.shape(A)[0] > 1 else None
        return r if r is not None else reduce(L, "add", L.op("mul", A, B), None, False, 0.0)
    A2 = A[None, :] if na == 1 else A
    B2 = B[:, None] if nb == 1 else B
    # each output a sum of products in order (reduction instructions keep no product's
    # slot), or products then their sum where the terms are not evenly spaced
    Ta, Tb = A2[..., :, None, :], np.swapaxes(B2, -1, -2)[..., None, :, :]
    r = L.reduce_terms(Ta, Tb) if A2.shape[-1] > 1 else None
    if r is None:
        P = L.op("mul", A2[..., :, :, None], B2[..., None, :, :])
        r = reduce(L, "add", P, (P.ndim - 2,), False, 0.0)
    if na == 1:
        r = r[..., 0, :]
    if nb == 1:
        r = r[..., 0]
    return r


def _finite_or_zero(L, m):
    """``m`` where finite, else 0 (logsumexp's shift, as torch's), branch-free."""
    fin = L.op("eq", L.op("sub", m, m), L.const(0.0))
    return L.op("select", fin, m, L.const(0.0))


def _lower_logsumexp(L, ins, aux, value):
    A = ins[0]
    dims, keepdim = aux[0], aux[1]
    # the shift: the max where finite, 0 where -inf or NaN (as eager mode and torch), and
    # the largest double where +inf: the same inf, and the other elements' exp(x - m) stay
    # at most 1, so their gradients g / inf * exp(x - m) are 0, as torch's g * exp(x -
    # result) (a shift of 0 overflowed those of the large ones: inf / inf = NaN). One row
    # per reduced row: no pass over the elements
    big = L.const(np.finfo(np.float64).max)
    m = _finite_or_zero(L, L.op("minimum", reduce(L, "maximum", L.op("detach", A), dims,
                                                  True, 0.0), big))
    s = L.op("log", reduce(L, "add", L.op("exp", L.op("sub", A, m)), dims, True, 0.0))
    r = L.op("add", s, m)
    return r if keepdim else r.reshape(np.shape(value))


def _lower_softmax(L, ins, aux, value, log):
    A = ins[0]
    d = (aux[0],)
    if np.ndim(A) == 0:
        A = A.reshape(1)
        d = (0,)
    # shifted by the max itself, as torch and eager mode (``arrays._softmax_np``)
    z = L.op("sub", A, reduce(L, "maximum", L.op("detach", A), d, True, 0.0))
    if log:
        r = L.op("sub", z, L.op("log", reduce(L, "add", L.op("exp", z), d, True, 0.0)))
    else:
        e = L.op("exp", z)
        r = L.op("div", e, reduce(L, "add", e, d, True, 0.0))
    return r.reshape(np.shape(value))


def _lower_norm(L, ins, aux, value):
    A = ins[0]
    dims, keepdim, p = aux
    if p != 0 and (np.size(A) if dims is None else np.prod([np.shape(A)[d] for d in dims])) == 1:
        p = 1  # one element: its absolute value, as the eager norm (``arrays._norm_np``)
    if p == 2:
        s = reduce(L, "add", L.op("mul", A, A), dims, keepdim, 0.0)
        zero = L.op("eq", s, L.const(0.0))
        # gradient 0 at 0 (torch's convention), and no 0/0 from sqrt's rule on the way
        safe = L.op("sqrt", L.op("select", zero, L.const(1.0), s))
        return L.op("select", zero, L.const(0.0), safe)
    if p == 1:
        return reduce(L, "add", L.op("abs", A), dims, keepdim, 0.0)
    if p == 0:
        return reduce(L, "add", L.op("ne", L.op("detach", A), L.const(0.0)), dims, keepdim,
                      0.0)
    if p in (np.inf, -np.inf):
        return _lower_extreme(L, [L.op("abs", A)], (dims, keepdim, None), value,
                              "maximum" if p > 0 else "minimum")
    s = reduce(L, "add", L.op("powc", L.op("abs", A), c0=p), dims, keepdim, 0.0)
    return L.op("powc", s, c0=1.0 / p)


def _lower_index_scatter(L, ins, aux, value):
    G = ins[0]
    index, shape = aux[0], aux[1]
    pos = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)[index]
    pos, G = np.broadcast_arrays(pos, G)
    pos, G = pos.ravel(), G.ravel()
    out = np.full(int(np.prod(shape)), -1, dtype=np.int64)
    order = np.argsort(pos, kind="stable")
    pos, G = pos[order], G[order]
    start = 0
    while start < len(pos):  # repeated targets accumulate
        stop = start
        while stop < len(pos) and pos[stop] == pos[start]:
            stop += 1
        out[pos[start]] = G[start] if stop - start == 1 else \
            reduce(L, "add", G[start:stop], None, False, 0.0)
        start = stop
    if (out < 0).any():
        out[out < 0] = L.const(0.0)
    return out.reshape(shape)


def _lower_setitem(L, ins, aux, value):
    A, B = ins
    out = np.array(A, copy=True)
    out[aux[0]] = B
    # a position the index repeats holds the last value written, but every occurrence's
    # value gets that position's gradient (eager mode's and torch's rule: the values'
    # gradient gathers g at the index): the earlier ones through pick rows (-0.0)
    pos = np.arange(out.size, dtype=np.int64).reshape(out.shape)[aux[0]]
    if np.unique(pos).size < pos.size:
        pos, Bb = np.broadcast_arrays(pos, B)
        pos, Bb = pos.ravel(), Bb.ravel()
        flat = out.reshape(-1)  # C order, as pos (a copy when out is not C-contiguous)
        last = {int(p): i for i, p in enumerate(pos.tolist())}
        for i, p in enumerate(pos.tolist()):
            if last[p] != i:
                flat[p] = L.op("add", int(flat[p]), L.op("pick", int(Bb[i]), L.const(1.0)))
        out = flat.reshape(out.shape)
    return out


def _lower_where(L, ins, aux, value):
    X, Y = ins
    cond = aux[0]
    C = aux[1] if len(aux) > 1 else None  # slots of a traced condition
    if C is None:  # a constant mask only chooses slots
        return np.where(cond, X, Y)
    return L.op("select", C, X, Y)


def _lower_cast(L, ins, aux, value):
    dt = np.dtype(aux[0])
    to = dt.kind
    src = np.dtype(aux[1]).kind if len(aux) > 1 else "f"
    if to == "b":  # a truth value: x != 0, exactly as NumPy's cast
        return L.op("ne", ins[0], L.const(0.0))
    if to in "iu" and src in "biu":  # a count or a truth value: already a whole number
        return ins[0]
    if to != "f":
        raise NotTraceable(f"a traced program computes in floating point; casting a traced "
                           f"value to {dt} would freeze it. Keep it floating "
                           f"point, or compute it outside the traced function")
    if dt == np.float32:
        # replay computes in float64: the cast's rounding is a row of its own (x - x.float()
        # is not 0, and a program may depend on it)
        return L.op("round_f32", ins[0])
    if dt.itemsize < 4:
        raise NotTraceable(f"a traced program computes in float64 and rounds casts to "
                           f"float32 only; a cast to {dt} cannot be replayed exactly. Cast "
                           f"to float32 or float64")
    return ins[0]


def _lower_diag(L, ins, aux, value):
    A = ins[0]
    out = np.diag(A + 1, aux[0]) - 1  # 0 marks the zeros np.diag fills in
    if np.ndim(A) == 1 and (out < 0).any():
        out[out < 0] = L.const(0.0)
    return out


def unsupported(what):
    """The lowering of an op that a traced program cannot contain: raises ``what``."""
    def lower(L, ins, aux, value):
        raise NotTraceable(what)
    return lower


# --- each array op's lowering, passed to its register(...) call in ops/arrays.py -------------


def lower_reshape(L, ins, aux, value):
    return np.reshape(ins[0], aux[0])


def lower_expand(L, ins, aux, value):
    return np.broadcast_to(ins[0], aux[0])


def lower_sum_to(L, ins, aux, value):
    return _sum_to(L, ins[0], aux[0])


def lower_transpose(L, ins, aux, value):
    return np.swapaxes(ins[0], aux[0], aux[1])


def lower_permute(L, ins, aux, value):
    return np.transpose(ins[0], aux)


def lower_stack(L, ins, aux, value):
    return np.stack(ins, axis=aux[1])


def lower_cat(L, ins, aux, value):
    return np.concatenate(ins, axis=aux[1])


def lower_getitem(L, ins, aux, value):
    return np.asarray(ins[0])[aux[0]]


def _sum(L, A, dims, keepdim):
    """A sum from 0.0, as torch's and NumPy's: terms all -0.0 sum to 0.0 (the tree of adds,
    and one term alone, gave -0.0: 1 / sum was -inf)."""
    r = reduce(L, "add", A, dims, keepdim, 0.0)
    return L.op("addc", r, c0=0.0) if np.size(r) else r


def lower_sum(L, ins, aux, value):
    return _sum(L, ins[0], aux[0], aux[1])


def lower_mean(L, ins, aux, value):
    n = float(np.size(ins[0]) // max(np.size(value), 1)) if np.size(value) else 0.0
    return L.op("divc", _sum(L, ins[0], aux[0], aux[1]), c0=n)


def lower_prod(L, ins, aux, value):
    return reduce(L, "mul", ins[0], aux[0], aux[1], 1.0)


def lower_amax(L, ins, aux, value):
    return _lower_extreme(L, ins, aux, value, "maximum")


def lower_amin(L, ins, aux, value):
    return _lower_extreme(L, ins, aux, value, "minimum")


def lower_softmax(L, ins, aux, value):
    return _lower_softmax(L, ins, aux, value, False)


def lower_log_softmax(L, ins, aux, value):
    return _lower_softmax(L, ins, aux, value, True)


def lower_cross(L, ins, aux, value):
    # torch's rounding: a_q * b_p a mul row, then fma(a_p, b_q, -that) a row of fms
    from .arrays import CROSS_P, CROSS_Q  # (arrays imports this module while it loads)
    A, B, d = np.asarray(ins[0]), np.asarray(ins[1]), aux[0]
    t = L.op("mul", np.take(A, CROSS_Q, axis=d), np.take(B, CROSS_P, axis=d))
    return L.op("fms", np.take(A, CROSS_P, axis=d), np.take(B, CROSS_Q, axis=d), t)


def lower_outer(L, ins, aux, value):
    return L.op("mul", np.asarray(ins[0])[:, None], np.asarray(ins[1])[None, :])


lower_cast, lower_diag, lower_index_scatter = _lower_cast, _lower_diag, _lower_index_scatter
lower_setitem, lower_where, lower_norm = _lower_setitem, _lower_where, _lower_norm
lower_logsumexp, lower_matmul = _lower_logsumexp, _lower_matmul
lower_prod_others = unsupported("prod_others is internal to derivative rules")
lower_function = unsupported(
    "a custom autograd.Function runs Python code that a traced program cannot replay; "
    "write the function with tapegrad ops to trace it")
lower_function_out = unsupported("a custom autograd.Function cannot be traced")


def _sum_to(L, G, shape):
    """``arrays.sum_to`` on program slots: the same axes (``arrays.sum_axes``), summed by
    program rows."""
    from .arrays import sum_axes  # (arrays imports this module while it loads)
    shape = tuple(shape)
    gs = np.shape(G)
    if gs == shape:
        return G
    axes = sum_axes(gs, shape)
    r = reduce(L, "add", G, axes, True, 0.0) if axes else G
    return np.reshape(r, shape)
