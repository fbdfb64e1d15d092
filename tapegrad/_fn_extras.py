"""Functions GradBench's tools use (einsum, cross, sort, mm, gamma functions), from recorded ops."""
from __future__ import annotations

import builtins
import collections
import math
import numbers

import numpy as np

from ._fn_elementwise import _t, _tn, clone
from ._fn_linalg import matmul
from ._fn_reductions import _float_input, sum  # sum: tapegrad's, over dims (einsum)
from ._fn_shapes import broadcast_to, getitem, permute, reshape
from .ops import BY_NAME as _O
from .tape import STATE, all_or_nothing
from .tensor import (Tensor, _dim, _hint, _plain, _to_dtype, array_op, is_grad_enabled, quiet,
                     tensor)

# --- functions GradBench's pytorch tool uses: built from the differentiable ops above, so
# create_graph, is_grads_batched and replay come with them -------------------------------


def empty(*size, dtype=None, requires_grad=False, device=None, out=None,
          **kwargs):
    """A tensor of shape ``size`` (torch leaves it uninitialized; tapegrad fills zeros).

    >>> tapegrad.empty(2, 3).shape
    (2, 3)
    """
    from .tensor import zeros
    if "size" in kwargs:
        size = (kwargs.pop("size"),)
    if kwargs:
        raise TypeError(f"empty() got an unexpected keyword argument {next(iter(kwargs))!r}")
    if not size:
        raise TypeError('empty() missing 1 required positional arguments: "size"')
    if device not in (None, "cpu") and str(device) != "cpu":
        raise RuntimeError(f"empty(): tapegrad tensors live on the CPU, got device={device!r}")
    if out is not None:
        raise TypeError("empty(): out= is not supported; use the returned tensor")
    return zeros(*size, dtype=dtype, requires_grad=requires_grad)


@all_or_nothing
def repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    """Repeat each element (each slice along ``dim``; of the flattened input when ``dim`` is
    None) ``repeats`` times; ``repeats`` is an int or one count per element. With one
    integer tensor argument, the indices repeated by their counts (torch's form).

    >>> tapegrad.repeat_interleave(tapegrad.tensor([1., 2.]), 2).tolist()
    [1.0, 1.0, 2.0, 2.0]
    """
    input = _t(input)
    if repeats is None:  # repeat_interleave(counts): arange(len(counts)) repeated
        counts = np.asarray(input._d)
        if counts.dtype.kind not in "iu" or counts.ndim != 1:
            raise RuntimeError("repeat_interleave: repeats must be a 1-d integer tensor")
        return tensor(np.repeat(np.arange(len(counts)), counts))
    if dim is None:
        input, dim = reshape(input, -1), 0
    elif input.ndim == 0:  # torch's check, as torch words it (for any dim)
        raise IndexError("Dimension out of range (expected to be in range of [-1, 0], but got "
                         "1); a 0-d input is repeated without dim")
    dim = _dim(dim, input.ndim) if input.ndim else 0
    if input.ndim == 0:
        input = reshape(input, 1)
    n = input.shape[dim]
    r = np.asarray(repeats._d if isinstance(repeats, Tensor) else repeats)
    if r.dtype.kind not in "iu":
        raise RuntimeError(f"repeat_interleave: repeats must be integers, got {r.dtype}")
    if r.ndim > 1 or (r.ndim == 1 and len(r) not in (1, n)):
        raise RuntimeError(f"repeat_interleave: repeats must have the same size as input "
                           f"along dim ({n}), got {list(r.shape)}")
    if (r < 0).any():
        raise RuntimeError("repeat_interleave: repeats can not be negative")
    idx = np.repeat(np.arange(n), r.reshape(-1) if r.ndim else int(r))
    if output_size is not None and len(idx) != output_size:
        raise RuntimeError(f"repeat_interleave: output_size {output_size} does not match the "
                           f"{len(idx)} elements the repeats give")
    return getitem(input, (slice(None),) * dim + (idx,))


def _cross(input, other, dim):
    input, other = _t(input), _t(other, "other")
    if input.dtype != other.dtype:  # (torch promotes nothing here either)
        raise RuntimeError(f"linalg.cross: inputs must have the same dtype, got "
                           f"{input.dtype} and {other.dtype}; cast one with .to(dtype)")
    if input.ndim != other.ndim:
        raise RuntimeError(f"linalg.cross: inputs must have the same number of dimensions "
                           f"(got {input.ndim} and {other.ndim}); unsqueeze the smaller one")
    try:
        shape = np.broadcast_shapes(input.shape, other.shape)
    except ValueError:
        raise RuntimeError(f"linalg.cross: inputs of shapes {list(input.shape)} and "
                           f"{list(other.shape)} do not broadcast") from None
    if dim is None:  # torch.cross without dim: the first dimension of size 3
        dims = [i for i, n in enumerate(shape) if n == 3]
        if not dims:
            raise RuntimeError("no dimension of size 3 in input")
        dim = dims[0]
    dim = _dim(dim, len(shape))
    if shape[dim] != 3:
        raise RuntimeError(f"linalg.cross: inputs dimension {dim} must have length 3. Got "
                           f"{input.shape[dim - len(shape) + input.ndim] if input.ndim else 0}"
                           f" and {other.shape[dim - len(shape) + other.ndim] if other.ndim else 0}")  # noqa: E501
    input, other = broadcast_to(input, shape), broadcast_to(other, shape)
    # one op (ops/arrays.py), rounded as torch's kernel: fma(a_p, b_q, -(a_q * b_p))
    v = quiet(_O["cross"].np, np.asarray(input._d), np.asarray(other._d), (dim,))
    return array_op(_O["cross"], [input, other], v, (dim,))


@all_or_nothing
def cross(input, other, dim=None):
    """Cross product of 3-vectors along ``dim`` (default: the first dimension of size 3,
    as torch.cross).

    >>> tapegrad.cross(tapegrad.tensor([1., 0, 0]), tapegrad.tensor([0., 1, 0])).tolist()
    [0.0, 0.0, 1.0]
    """
    return _cross(input, other, dim)


def linalg_cross(input, other, *, dim=-1):
    """``tapegrad.linalg.cross``: cross product of 3-vectors along ``dim`` (default -1)."""
    return _cross(input, other, dim)


def _einsum_parse(equation, operands):
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise RuntimeError(f"einsum(): {len(terms)} operand(s) in the equation "
                           f"{equation!r} but {len(operands)} tensor(s) given")
    used = set(c for c in eq if c.isalpha())
    spare = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                 if c not in used)
    nell = builtins.max([op.ndim - len(t.replace("...", "")) for t, op in zip(terms, operands)
                         if "..." in t] + [0])
    ell = "".join(next(spare) for _ in range(nell))
    labels = []
    for t, op in zip(terms, operands):
        if "..." in t:
            k = op.ndim - len(t.replace("...", ""))
            t = t.replace("...", ell[nell - k:] if k else "")
        if not builtins.all(c.isalpha() for c in t):
            raise RuntimeError(f"einsum(): invalid subscript in {equation!r}: subscripts must "
                               "be letters (and one '...')")
        if len(t) != op.ndim:
            raise RuntimeError(f"einsum(): the number of subscripts in the equation "
                               f"({len(t)}) does not match the number of dimensions "
                               f"({op.ndim}) for operand {len(labels)}")
        labels.append(t)
    if arrow:
        out = out.replace("...", ell)
        if len(set(out)) != len(out) or not builtins.all(c.isalpha() for c in out):
            raise RuntimeError(f"einsum(): invalid output subscripts in {equation!r}")
        missing = set(out) - set("".join(labels))
        if missing:
            raise RuntimeError(f"einsum(): output subscript {sorted(missing)[0]} does not "
                               "appear in the equation for any input operand")
    else:  # implicit output: the ellipsis, then every label used once, sorted
        counts = collections.Counter("".join(labels))
        out = ell + "".join(sorted(c for c in counts if counts[c] == 1 and c not in ell))
    return labels, out


@all_or_nothing
def einsum(equation, *operands):
    """Einstein summation, as torch.einsum: products, batched products, traces, diagonals,
    outer products and sums over indices (``'ij,jk->ik'``, ``'bij,bjk->bik'``, ``'ii'``,
    ``'i,j->ij'``, ``'...ij->...i'``). Operands are contracted left to right through
    reshape, permute, matmul and sum, so every derivative order works.

    >>> a = tapegrad.tensor([[1., 2.], [3., 4.]])
    >>> tapegrad.einsum("ii", a).item()
    5.0
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    operands = [_t(o, f"operand {i}") for i, o in enumerate(operands)]
    if not operands:
        raise ValueError("einsum(): must specify the equation string and at least one "
                         "operand")
    labels, out = _einsum_parse(equation, operands)
    sizes = {}
    for i, (lab, op) in enumerate(zip(labels, operands)):
        own = {}
        for c, n in zip(lab, op.shape):
            if own.setdefault(c, n) != n:
                raise RuntimeError(f"einsum(): subscript {c} is repeated for operand {i} but "
                                   f"the sizes don't match, {n} != {own[c]}")
            seen = sizes.setdefault(c, n)
            if seen != n and 1 not in (seen, n):
                raise RuntimeError(f"einsum(): subscript {c} has size {n} for operand {i} "
                                   f"which does not broadcast with previously seen size "
                                   f"{seen}")
            sizes[c] = n if seen == 1 else seen  # (1 against 0 broadcasts to 0)
    terms = []
    for lab, op in zip(labels, operands):
        full = tuple(sizes[c] for c in lab)
        if full != op.shape:  # a size-1 dimension broadcasts against the label's size, as torch
            op = broadcast_to(op, full)
        # a label repeated within one operand takes the diagonal
        while len(set(lab)) < len(lab):
            c = next(c for c in lab if lab.count(c) > 1)
            p, q = lab.index(c), lab.index(c, lab.index(c) + 1)
            rest = [i for i in range(len(lab)) if i not in (p, q)]
            op = permute(op, tuple(rest + [p, q]))
            ar = np.arange(sizes[c])
            op = getitem(op, (slice(None),) * len(rest) + (ar, ar))
            lab = "".join(lab[i] for i in rest) + c
        terms.append((lab, op))

    la, a = terms[0]
    for k in range(1, len(terms)):
        lb, b = terms[k]
        keep = set(out).union(*[set(t[0]) for t in terms[k + 1:]])  # needed after this pair
        # labels only in a or only in b and needed nowhere else are summed first
        others_a = set(lb) | keep
        drop = [i for i, c in enumerate(la) if c not in others_a]
        if drop:
            a, la = sum(a, tuple(drop)), "".join(c for c in la if c in others_a)
        others_b = set(la) | keep
        drop = [i for i, c in enumerate(lb) if c not in others_b]
        if drop:
            b, lb = sum(b, tuple(drop)), "".join(c for c in lb if c in others_b)
        batch = [c for c in la if c in lb and c in keep]
        contr = [c for c in la if c in lb and c not in keep]
        only_a = [c for c in la if c not in lb]
        only_b = [c for c in lb if c not in la]
        a = permute(a, tuple(la.index(c) for c in batch + only_a + contr))
        b = permute(b, tuple(lb.index(c) for c in batch + contr + only_b))

        def size(cs):
            return int(np.prod([sizes[c] for c in cs], dtype=np.int64))
        prod = matmul(reshape(a, (size(batch), size(only_a), size(contr))),
                      reshape(b, (size(batch), size(contr), size(only_b))))
        la = "".join(batch + only_a + only_b)
        a = reshape(prod, tuple(sizes[c] for c in la))
    drop = [i for i, c in enumerate(la) if c not in out]
    if drop:
        a, la = sum(a, tuple(drop)), "".join(c for c in la if c in out)
    if la != out:
        a = permute(a, tuple(la.index(c) for c in out))
    return a


def _lgamma_np(x):
    x = np.asarray(x, dtype=np.float64)
    pole = (x <= 0) & (x == np.floor(x))  # math.lgamma raises there; torch gives inf
    return np.where(pole, np.inf, np.vectorize(math.lgamma, otypes=[np.float64])(
        np.where(pole | ~np.isfinite(x), 1.0, x))) + np.where(np.isfinite(x), 0, np.abs(x))


# Bernoulli numbers B_2k for the asymptotic series of the polygamma functions
_BERNOULLI = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730, 7 / 6, -3617 / 510)


def _polygamma_np(n, x):
    """psi^(n)(x): below 0.5 by the reflection formula (no loop that -inf or -1e12 would
    never leave), else shift x past 12 by the recurrence, then the asymptotic series
    (relative error under 1e-15 there)."""
    x = np.array(x, dtype=np.float64)
    neg = x < 0.5
    if neg.any():
        # psi^(n)(x) = (-1)^n psi^(n)(1 - x) - pi d^n/dx^n cot(pi x); the n-th derivative of
        # cot(pi x) is a polynomial in c = cot(pi x): P_{k+1}(c) = -pi (1 + c^2) P_k'(c)
        poly = np.polynomial.Polynomial([0.0, 1.0])
        for _ in range(n):
            poly = -math.pi * np.polynomial.Polynomial([1.0, 0.0, 1.0]) * poly.deriv()
        xn = x[neg]
        with np.errstate(divide="ignore", invalid="ignore"):
            fr = xn - np.rint(xn)  # (exact) cot(pi x) has period 1: near a pole, pi * x
            c = np.cos(math.pi * fr) / np.sin(math.pi * fr)  # itself would lose digits
            pole = xn == np.floor(xn)  # poles at 0, -1, -2, ...: torch's +0 limit at 0, else nan
            refl = (-1) ** n * _polygamma_np(n, 1.0 - xn) - math.pi * poly(c)
        out = np.empty_like(x)
        out[neg] = np.where(pole, np.where(xn == 0, (-1) ** (n + 1) * np.inf, np.nan), refl)
        if (~neg).any():
            out[~neg] = _polygamma_np(n, x[~neg])
        return out
    acc = np.zeros_like(x)
    fact = math.factorial(n)
    while True:
        small = x < 12
        if not small.any():
            break
        # psi^(n)(x) = psi^(n)(x + 1) - (-1)^n n! / x^(n+1)
        acc = np.where(small, acc - (-1) ** n * fact / x ** (n + 1), acc)
        x = np.where(small, x + 1, x)
    if n == 0:
        s = np.log(x) - 1 / (2 * x)
        for k, b in enumerate(_BERNOULLI, 1):
            s = s - b / (2 * k * x ** (2 * k))
    else:
        s = math.factorial(n - 1) / x ** n + fact / (2 * x ** (n + 1))
        for k, b in enumerate(_BERNOULLI, 1):
            s = s + b * math.factorial(2 * k + n - 1) / (math.factorial(2 * k)
                                                          * x ** (2 * k + n))
        s = (-1) ** (n + 1) * s
    return acc + s


def _gamma_function(n):
    """lgamma (n = -1) or polygamma n as a custom Function whose backward is the next one,
    so every derivative order is available."""
    from .autograd.function import Function
    cache = _GAMMA_FNS

    if n in cache:
        return cache[n]

    class _Gamma(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            d = np.asarray(x._d, dtype=np.float64)
            return tensor(_lgamma_np(d) if n < 0 else _polygamma_np(n, d))

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * _gamma_function(n + 1).apply(x)
    cache[n] = _Gamma
    return _Gamma


_GAMMA_FNS = {}


def special_multigammaln(input, p):
    """``tapegrad.special.multigammaln``: log of the multivariate gamma function of
    dimension ``p``, elementwise (defined for elements above (p - 1) / 2; below, like
    torch, the sum of log|Gamma| terms).

    >>> round(tapegrad.special.multigammaln(tapegrad.tensor(2.5), 3).item(), 6)
    1.880995
    """
    if STATE.trace is not None:  # (its custom Functions' Python code cannot be replayed)
        raise NotImplementedError("tapegrad.trace: special.multigammaln is computed by NumPy "
                                  "and cannot be replayed yet; compute it outside the traced "
                                  "function")
    input = _float_input(_t(input), "multigammaln")
    if isinstance(p, Tensor) and p.ndim == 0 and np.asarray(p._d).dtype.kind in "iu":
        p = int(p._d)  # torch takes a 0-d integer tensor as p
    if not isinstance(p, numbers.Integral) or p < 1:
        raise RuntimeError(f"multigammaln: p has to be greater than or equal to 1, got {p}")
    lg = _gamma_function(-1)
    terms = [lg.apply(input - j / 2) for j in range(p)]
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total + p * (p - 1) / 4 * math.log(math.pi)


# --- sorting, matrix products, comparisons, index_add (built from recorded ops) ----------------

_sort_result = collections.namedtuple("sort", ["values", "indices"])


def _sort_indices(a, d, descending):
    """Stable sort indices along ``d``; NaN sorts as the largest value, as in torch."""
    if not descending:
        return np.argsort(a, axis=d, kind="stable")
    n = a.shape[d]
    rev = np.flip(a, axis=d)  # ties keep their order: sort the reversed array, then flip
    return (n - 1) - np.flip(np.argsort(rev, axis=d, kind="stable"), axis=d)


def _guard_order(x, idx, d, descending, what):
    """While tracing, ``idx`` (the order of traced ``x`` along ``d``) is baked into the
    program: guard that it is still the stable sorted order at replay (each neighbour pair
    in order, ties only in index order), so another order raises GuardError instead of
    replaying a wrong permutation. Where that cannot be checked (NaN), guard the values."""
    tr = STATE.trace
    if tr is None or not tr.traced(x) or x.shape[d] < 2:
        return
    n = x.shape[d]
    v = getitem(x, _along(idx, d))
    lo = getitem(v, (slice(None),) * d + (slice(0, n - 1),))
    hi = getitem(v, (slice(None),) * d + (slice(1, n),))
    ilo = np.take(idx, np.arange(n - 1), axis=d)
    ihi = np.take(idx, np.arange(1, n), axis=d)
    tie_ok = _plain(ilo < ihi)
    ok = ((hi < lo) if descending else (lo < hi)) | ((lo == hi) & tie_ok)
    if builtins.bool(np.all(np.asarray(ok._d))):
        builtins.bool(ok.all())  # bool() of a traced truth value records the guard
    else:
        tr.on_escape(x, what)


def _along(idx, d):
    """An advanced index picking ``idx`` (same shape as the input) along dim ``d``."""
    grids = list(np.indices(idx.shape, sparse=True))
    grids[d] = idx
    return tuple(grids)


def sort(input, dim=-1, descending=False, stable=False):
    """(values, indices) sorted along ``dim``; the values are differentiable (their gradient
    goes back to where each value came from). Ties keep their order (a stable sort), where
    torch's unstable sort may order tied indices otherwise."""
    x = _t(input)
    if x.ndim == 0:
        return _sort_result(_hint(clone(x), "SortBackward0") if x._rg else clone(x),
                            _plain(np.asarray(0, dtype=np.int64)))
    d = _dim(dim, x.ndim)
    a = np.asarray(x._d)
    idx = _sort_indices(a, d, descending)
    _guard_order(x, idx, d, descending, "sort()")
    values = _hint(getitem(x, _along(idx, d)), "SortBackward0")
    return _sort_result(values, _plain(idx.astype(np.int64)))


def argsort(input, dim=-1, descending=False, stable=False):
    """Indices that sort ``input`` along ``dim`` (int64; ties in order)."""
    x = _t(input)
    if x.ndim == 0:
        return _plain(np.asarray(0, dtype=np.int64))
    d = _dim(dim, x.ndim)
    idx = _sort_indices(np.asarray(x._d), d, descending)
    _guard_order(x, idx, d, descending, "argsort()")
    return _plain(idx.astype(np.int64))


def mm(input, mat2):
    """Matrix product of two 2-D tensors (``matmul`` restricted to matrices, as torch)."""
    x, y = _t(input), _t(mat2, "mat2")
    if x.ndim != 2:
        raise RuntimeError(f"self must be a matrix (mm needs 2-D tensors), got {x.ndim}-D")
    if y.ndim != 2:
        raise RuntimeError(f"mat2 must be a matrix (mm needs 2-D tensors), got {y.ndim}-D")
    if x.shape[1] != y.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({x.shape[0]}x"
                           f"{x.shape[1]} and {y.shape[0]}x{y.shape[1]})")
    return matmul(x, y)


def equal(input, other):
    """True when both tensors have the same shape and elements (NaN is unequal)."""
    x, y = _t(input), _t(other, "other")
    if x.shape != y.shape:
        return False
    tr = STATE.trace
    if tr is not None and (tr.traced(x) or tr.traced(y) or tr.ref(x) is not None
                           or tr.ref(y) is not None):
        return builtins.bool((x == y).all())  # a guard: replay checks the answer holds
    return builtins.bool(np.array_equal(np.asarray(x._d), np.asarray(y._d)))


def _index_added(self, dim, index, source, alpha):
    """``self`` with ``alpha * source`` added at ``index`` along ``dim`` (repeats add up),
    recorded as ``self + index_scatter(...)`` so every order of derivative follows."""
    x = _t(self, "self")
    d = _dim(dim, builtins.max(x.ndim, 1))
    if not isinstance(index, Tensor) or np.asarray(index._d).dtype.kind not in "iu" \
            or index.ndim > 1:
        raise IndexError("index_add_(): index must be a 1-D tensor of integers (int64), got "
                         f"{index if not isinstance(index, Tensor) else index.dtype}")
    src = _tn(source, "source")
    if not isinstance(src, Tensor):
        raise TypeError(f"index_add_(): source must be a Tensor, got {type(source).__name__}")
    idx = np.asarray(index._d).reshape(-1).astype(np.int64)
    shape = x.shape
    want = shape[:d] + (len(idx),) + shape[d + 1:] if x.ndim else (len(idx),)
    if tuple(src.shape if src.ndim else (1,) * builtins.max(x.ndim, 1)) != tuple(want) \
            and not (x.ndim == 0 and src.numel() == len(idx) == 1):
        raise RuntimeError(f"index_add_(): source has shape {list(src.shape)}; it must be "
                           f"the shape of self with dim {d} of size len(index) = {list(want)}")
    n = shape[d] if x.ndim else 1
    if idx.size and (idx.min() < 0 or idx.max() >= n):  # torch takes no negative index
        raise IndexError(f"index_add_(): index out of range for dimension {d} of size {n}")
    if x.ndim == 0:  # index is [0] or [], source a single value
        return src.reshape(()) * alpha if len(idx) else zeros_like_t(x)
    nidx = (slice(None),) * d + (idx,)
    scaled = src if alpha == 1 else src * alpha
    if scaled.dtype is not x.dtype:
        scaled = _to_dtype(scaled, x.dtype.np)
    z = np.zeros(shape, dtype=x.dtype.np)
    np.add.at(z, nidx, np.asarray(scaled._d))
    return array_op(_O["index_scatter"], [scaled], z, (nidx, tuple(shape), False))


def zeros_like_t(x):
    return _plain(np.zeros(x.shape, x.dtype.np)) if x.ndim else _plain(0.0)


# --- floor division and remainders (torch's //, %, fmod) ------------------------------------


def _reduce_like(g, shape):
    """``g`` summed over the dimensions that broadcasting added to an operand of ``shape``."""
    lead = g.ndim - len(shape)
    dims = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and g.shape[lead + i] != 1)
    return reshape(sum(g, dims, keepdim=True), shape) if dims else g


def _floor_operands(input, other, name):
    """Both operands as arrays of torch's result dtype, checked before anything is recorded."""
    from ._recorder import result_dtype
    if STATE.trace is not None:
        raise NotImplementedError(f"tapegrad.trace: {name} is computed by NumPy and cannot be "
                                  "replayed yet; compute it outside the traced function")
    x, y = _tn(input), _tn(other, "other")
    dt = result_dtype(x, y)
    if dt.kind == "b":
        raise NotImplementedError(f"{name} is not implemented for 'Bool'")
    if dt.kind not in "iuf":
        raise RuntimeError(f"{name} is not implemented for {dt}")
    a = np.asarray(x._d if isinstance(x, Tensor) else x).astype(dt, copy=False)
    b = np.asarray(y._d if isinstance(y, Tensor) else y).astype(dt, copy=False)
    try:
        np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise RuntimeError(f"{name}: the shapes {list(a.shape)} and {list(b.shape)} do not "
                           "broadcast") from None
    if dt.kind in "iu" and (b == 0).any():
        raise RuntimeError("ZeroDivisionError")
    xs = x if isinstance(x, Tensor) else tensor(a)
    ys = y if isinstance(y, Tensor) else tensor(b)
    return xs, ys, a, b


def _floor_function(name, np_fn):
    from .autograd.function import Function

    class _Floor(Function):
        @staticmethod
        def forward(ctx, x, y, a, b):
            ctx.shapes = (x.shape, y.shape)
            ctx.operands = (x, y)  # (not saved tensors: the values are read, never written)
            with np.errstate(divide="ignore", invalid="ignore"):
                ctx.q = (np.trunc(a / b) if name == "fmod" else None
                         if name in ("floor_divide", "rremainder") else np.floor_divide(a, b))
                return tensor(np_fn(a, b))

        @staticmethod
        def backward(ctx, g):
            if name in ("floor_divide", "rremainder"):  # as torch (number % tensor too)
                op = "remainder" if name == "rremainder" else name
                raise RuntimeError(f"derivative for aten::{op} is not implemented")
            sx, sy = ctx.shapes  # x - q y with q = floor(x / y) (trunc for fmod), constant
            q = None
            if ctx.needs_input_grad[1]:
                # under create_graph, torch's q = floor(x / y) is a graph of x and y whose
                # derivative is zero: the second derivatives are zeros, not None
                q = (_Quotient.apply(*ctx.operands, -ctx.q) if is_grad_enabled()
                     else tensor(-ctx.q))
            gy = None if q is None else g * q
            return (_reduce_like(g, sx) if ctx.needs_input_grad[0] else None,
                    None if gy is None else _reduce_like(gy, sy), None, None)
    _Floor.__name__ = _Floor.__qualname__ = {"floor_divide": "FloorDivideBackward",
                                             "remainder": "RemainderBackward",
                                             "rremainder": "RemainderBackward",
                                             "fmod": "FmodBackward"}[name]
    return _Floor


_FLOOR = {}


def _quotient_function():
    from .autograd.function import Function

    class _Quotient(Function):
        """The rounded quotient of ``x`` and ``y`` (given), whose derivative is zero."""

        @staticmethod
        def forward(ctx, x, y, q):
            ctx.like = (x, y)
            return tensor(q)

        @staticmethod
        def backward(ctx, g):
            return tuple(zeros_like_t(t) for t in ctx.like) + (None,)
    return _Quotient


class _LazyQuotient:
    fn = None

    def apply(self, *args):
        if _LazyQuotient.fn is None:
            _LazyQuotient.fn = _quotient_function()
        return _LazyQuotient.fn.apply(*args)


_Quotient = _LazyQuotient()


def _remainder_np(a, b):
    """torch's remainder: C's fmod, plus ``b`` where it is nonzero and its sign is not
    ``b``'s; a zero keeps ``a``'s sign (NumPy's gives it ``b``'s: 1 / (x % y) was +inf where
    torch's is -inf)."""
    if a.dtype.kind != "f":
        return np.remainder(a, b)
    with np.errstate(invalid="ignore"):
        m = np.fmod(a, b)
        return np.where((m != 0) & ((b < 0) != (m < 0)), m + b, m)


def _floor_op(name, np_fn, input, other):
    if name == "fmod" and not isinstance(input, Tensor):
        raise TypeError(f"fmod(): argument 'input' (position 1) must be Tensor, not "
                        f"{type(input).__name__}")
    x, y, a, b = _floor_operands(input, other, name)
    if name == "remainder" and not isinstance(input, Tensor):
        name = "rremainder"  # a number % a tensor: torch has no derivative for it
    fn = _FLOOR.get(name)
    if fn is None:
        fn = _FLOOR[name] = _floor_function(name, np_fn)
    return fn.apply(x, y, a, b)


def floor_divide(input, other):
    """``input // other``: the quotient rounded toward minus infinity, as torch (and Python)
    round it; like torch's, it has no derivative (a backward through it raises).

    >>> (tapegrad.tensor([7, -7]) // 2).tolist()
    [3, -4]
    """
    return _floor_op("floor_divide", np.floor_divide, input, other)


def remainder(input, other):
    """``input % other``: the remainder with the sign of ``other`` (Python's and torch's);
    its derivative is 1 for ``input`` and ``-floor(input / other)`` for ``other``.

    >>> (tapegrad.tensor([5., -5.]) % 3).tolist()
    [2.0, 1.0]
    """
    return _floor_op("remainder", _remainder_np, input, other)


def fmod(input, other):
    """The remainder with the sign of ``input`` (C's fmod); its derivative is 1 for
    ``input`` and ``-trunc(input / other)`` for ``other``.

    >>> tapegrad.fmod(tapegrad.tensor([5., -5.]), 3).tolist()
    [2.0, -2.0]
    """
    return _floor_op("fmod", np.fmod, input, other)


def linalg_norm(input, ord=None, dim=None, keepdim=False, *, dtype=None):
    """``tapegrad.linalg.norm``: torch.linalg.norm. A vector norm of order ``ord`` over one
    dimension (or of a 1-d input), a matrix norm (``'fro'``, 1, -1, inf, -inf) over two
    dimensions (or of a 2-d input), the 2-norm of all elements when ``ord`` and ``dim`` are
    None. The spectral and nuclear norms (2, -2, ``'nuc'``) need an SVD tapegrad lacks.

    >>> tapegrad.linalg.norm(tapegrad.tensor([[1., -2.], [3., 4.]]), ord=1).item()
    6.0
    """
    from ._fn_reductions import amax, amin, norm
    x = _t(input)
    if dtype is not None:
        x = _to_dtype(x, np.dtype(getattr(dtype, "np", dtype)))
    if isinstance(dim, int):
        dim = (dim,)
    if ord is None:
        return norm(x, 2.0, dim, keepdim)
    if dim is None:
        if x.ndim not in (1, 2):
            raise RuntimeError(f"linalg.norm: If dim is not specified but ord is, the input "
                               f"must be 1D or 2D. Got {x.ndim}D.")
        dim = tuple(range(x.ndim))
    if len(dim) == 1:
        if isinstance(ord, str):
            raise RuntimeError(f"linalg.vector_norm: ord={ord!r} is a matrix norm; pass a "
                               "number for a vector norm")
        return norm(x, ord, dim, keepdim)
    if len(dim) != 2:
        raise RuntimeError(f"linalg.norm: dim must be an int or a 2-tuple, got {dim}")
    r, c = (_dim(d, x.ndim) for d in dim)
    if r == c:
        raise RuntimeError(f"linalg.matrix_norm: dims must be different. Got ({r}, {c})")
    if ord == "fro":
        return norm(x, 2.0, (r, c), keepdim)
    if ord in (2, -2, "nuc"):
        raise NotImplementedError(f"linalg.norm: ord={ord!r} needs singular values, which "
                                  "tapegrad does not compute; use ord='fro', 1, -1, inf or "
                                  "-inf")
    if ord not in (1, -1, math.inf, -math.inf):
        raise RuntimeError(f"linalg.matrix_norm: Order {ord} not supported.")
    # 1 / -1: the largest / smallest column sum; inf / -inf: row sums
    over, across = (r, c) if abs(ord) == 1 else (c, r)
    if x.shape[across] == 0 and ord > 0:  # torch: the largest of no sums is 0, off the graph
        shape = tuple(1 if i in (r, c) else n for i, n in enumerate(x.shape) if keepdim
                      or i not in (r, c))
        return _plain(np.zeros(shape, x.dtype.np)) if shape or x.dtype.np != np.float64 \
            else _plain(0.0)
    sums = sum(x.abs(), over, keepdim=True)
    out = (amax if ord > 0 else amin)(sums, across, keepdim=True)
    return out if keepdim else reshape(out, tuple(n for i, n in enumerate(x.shape)
                                                  if i not in (r, c)))
