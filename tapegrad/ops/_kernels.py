"""Forward-only compiled passes NumPy runs slowly on (k, d, n) work: a float64 ``+ - *``
of broadcast operands, and a sum over the middle axis.
Each gives NumPy's result bit for bit (one correctly rounded operation per element, the
sum in NumPy's order) or None where it does not apply, for the NumPy path. Large passes
run on ``get_num_threads()`` threads (``_threads.run_compiled``, whose workers run these
compiled passes without the GIL, and ``run_chunks`` for NumPy's), each chunk contiguous
and computed as one thread would: the same bits. The compiled side of the threads'
hand-over (``claim``, ``help_out``) is here too, beside the passes it runs; the workers'
loop is ``interpreters._atomic.serve``."""
from __future__ import annotations

import numpy as np

from numba import carray

from .. import _notice
from .._jit import njit_cached
from .._threads import chunks_for, run_chunks, run_compiled
from ..interpreters._atomic import (CLOCK_THREAD_CPUTIME_ID, RUN_CHUNK, _clock_ns,
                                    compare_swap, f64_pointer, fetch_add, load_acquire,
                                    store_release)

_F64 = np.dtype(np.float64)
#: below this many result elements the call costs more than NumPy's slow loop
_MIN_SIZE = 16384
#: opcodes of the broadcast pass (MUL2: ``x * y`` added to itself, x * x's gradient
#: ``g * x + g * x`` in one pass)
ADD, SUB, MUL, MUL2 = 0, 1, 2, 3
#: the fewest numbers a thread's chunk holds: below, handing a chunk to a thread (about
#: 10 us on 2 cores, a woken thread's wait for a core on a loaded machine) costs about what
#: the thread saves on a memory-bound pass (65,536 additions take about 20 us)
MIN_CHUNK = 65536
#: the smallest pass split over threads
PAR_MIN = 2 * MIN_CHUNK
#: the fewest numbers a chunk of a compiled pass (``rows_op``, ``sum_middle``) holds, and
#: the chunks a thread: its workers take chunks without Python's lock, about 1 us after
#: the caller posts them when they spin (see ``bench/threads_passes.py``)
JOB_MIN_CHUNK = 16384
JOB_PER_THREAD = 4
#: the smallest compiled pass (numbers in its result, or summed) split over threads: below,
#: the hand-over's fixed cost (a few us) and the worker's late start eat what the second
#: thread saves (kmeans' 80,000-number passes took 1.08 to 1.17x their one-thread time on
#: two threads, measured where both ran at once; ``bench/threads_concurrent.py``)
JOB_SPLIT_MIN = 131072


def _bounds(n, m):
    """``m`` contiguous spans of ``range(n)``, as even as they go."""
    return [n * i // m for i in range(m + 1)]


def _span(v, s, axis=0):
    """``v``'s part of the result's span ``s`` along ``axis`` (an operand broadcast along
    that axis, length 1 there, is read whole)."""
    if v.shape[axis] == 1:
        return v
    return v[s] if axis == 0 else v[:, s]


@njit_cached(nogil=True)
def _rows_op(x, y, op, out):  # pragma: no cover (compiled)
    # x: (ax, bx, nx), y: (ay, by, ny): each axis of length 1 or the result's, the last
    # one n (a row) or 1 (one number per row); out: (a, b, n). NumPy runs one inner loop
    # per broadcast row (a scalar loop where an operand repeats along it); here each row
    # of n is one contiguous loop the compiler vectorizes
    a, b, n = out.shape
    for i in range(a):
        ix = i if x.shape[0] > 1 else 0
        iy = i if y.shape[0] > 1 else 0
        for j in range(b):
            xr = x[ix, j if x.shape[1] > 1 else 0]
            yr = y[iy, j if y.shape[1] > 1 else 0]
            o = out[i, j]
            if xr.shape[0] == n and yr.shape[0] == n:
                if op == ADD:
                    for q in range(n):
                        o[q] = xr[q] + yr[q]
                elif op == SUB:
                    for q in range(n):
                        o[q] = xr[q] - yr[q]
                elif op == MUL:
                    for q in range(n):
                        o[q] = xr[q] * yr[q]
                else:
                    for q in range(n):
                        t = xr[q] * yr[q]
                        o[q] = t + t
            elif xr.shape[0] == n:
                s = yr[0]
                if op == ADD:
                    for q in range(n):
                        o[q] = xr[q] + s
                elif op == SUB:
                    for q in range(n):
                        o[q] = xr[q] - s
                elif op == MUL:
                    for q in range(n):
                        o[q] = xr[q] * s
                else:
                    for q in range(n):
                        t = xr[q] * s
                        o[q] = t + t
            else:
                s = xr[0]
                if op == ADD:
                    for q in range(n):
                        o[q] = s + yr[q]
                elif op == SUB:
                    for q in range(n):
                        o[q] = s - yr[q]
                elif op == MUL:
                    for q in range(n):
                        o[q] = s * yr[q]
                else:
                    for q in range(n):
                        t = s * yr[q]
                        o[q] = t + t


def _as3(v):
    return v if v.ndim == 3 else v.reshape((1,) * (3 - v.ndim) + v.shape)


def _compact(v):
    """``v`` without its broadcast: an axis of stride 0 (an expand's view) cut to length 1,
    where the pass reads it as a broadcast axis."""
    st = v.strides
    if 0 not in st:
        return v
    sh = v.shape
    if len(sh) == 3:  # (k, d, n) work, written out: a generator's tuple cost 1 us more
        return v[_ONE if st[0] == 0 and sh[0] > 1 else _WHOLE,
                 _ONE if st[1] == 0 and sh[1] > 1 else _WHOLE,
                 _ONE if st[2] == 0 and sh[2] > 1 else _WHOLE]
    return v[tuple([_ONE if s == 0 and k > 1 else _WHOLE for k, s in zip(sh, st)])]


_ONE, _WHOLE = slice(0, 1), slice(None)


def _readonly(v):
    """A read-only C-contiguous view (a copy where ``v`` is not contiguous: one number per
    row, small): the compiled pass is typed, and compiled, once for every operand."""
    f = v.flags
    if f.c_contiguous:
        if not f.writeable:
            return v  # (an expand's view cut to its rows: read-only already, 0.5 us)
        v = v.view()
    else:
        v = np.ascontiguousarray(v)
    v.flags.writeable = False
    return v


def broadcast_pair(xs, ys):
    """``np.broadcast_shapes(xs, ys)`` for two shapes, or None where they do not broadcast:
    NumPy's builds an array per shape and a broadcast object (1.7 us alone, several in
    place, once per compiled pass; this takes a few tenths)."""
    if xs == ys:
        return xs
    nx, ny = len(xs), len(ys)
    if nx < ny:
        xs, ys, nx, ny = ys, xs, ny, nx
    out = list(xs)
    for i in range(1, ny + 1):
        a, b = xs[-i], ys[-i]
        if a != b:
            if a == 1:
                out[-i] = b
            elif b != 1:
                return None
    return tuple(out)


def rows_op(op, x, y):
    """``x op y`` (op: ``ADD``, ``SUB``, ``MUL`` or ``MUL2``: ``x * y + x * y``; x, y float64
    arrays of 1 to 3 dims),
    NumPy's result bit for bit, where they broadcast to a result of rows of n >= 64
    (16384 elements or more): kmeans' ``P[None] - C[:, :, None]`` and ``g * diff`` with
    g an expanded (k, 1, n), gmm's ``P[None] - mu[:, :, None]``, 1.5 to 2x NumPy's time.
    None otherwise (nothing broadcast: NumPy's one contiguous loop is as fast)."""
    if x.__class__ is not np.ndarray or y.__class__ is not np.ndarray \
            or x.dtype is not _F64 or y.dtype is not _F64:
        return None
    if not (0 < x.ndim <= 3 and 0 < y.ndim <= 3) or x.shape == y.shape and \
            0 not in x.strides and 0 not in y.strides:
        return None  # (the same shapes, nothing broadcast: NumPy's one loop)
    shape = broadcast_pair(x.shape, y.shape)
    if shape is None:
        return None  # (NumPy's error, from the caller's path)
    n = shape[-1]
    if n < 64 or n * (shape[-2] if len(shape) > 1 else 1) * (shape[0] if len(shape) > 2
                                                             else 1) < _MIN_SIZE:
        return None
    x3, y3 = _as3(_compact(x)), _as3(_compact(y))
    if x3.shape == y3.shape or x3.shape[-1] != n and y3.shape[-1] != n:
        return None  # nothing broadcast (NumPy's one loop), or no operand holds the rows
    for v in (x3, y3):
        if not v.flags.c_contiguous and (v.shape[-1] > 1 or v.size > n * 64):
            return None  # a strided row (a copy would cost what the pass saves)
    out = np.empty((1,) * (3 - len(shape)) + shape, dtype=_F64)
    if "kernels" in _notice.PENDING:  # a cold cache compiles for seconds: say so, once
        _notice.announce("kernels")
    x3, y3 = _readonly(x3), _readonly(y3)
    # threads split the outer axis (gmm's and kmeans' k components), else the rows
    axis = 0 if out.shape[0] > 1 else 1
    m = 1 if out.size < JOB_SPLIT_MIN else \
        min(chunks_for(out.size, JOB_MIN_CHUNK, JOB_PER_THREAD), out.shape[axis])
    if m == 1 or not run_compiled(m, rows_caller, x3, y3, op, axis, out):
        _rows_op(x3, y3, op, out)
    return out.reshape(shape)


@njit_cached(nogil=True)
def _sum_middle(a, out):  # pragma: no cover (compiled)
    # a: (p, m, n) -> out: (p, n): 0.0 plus the m rows in order, NumPy's add.reduce over a
    # non-innermost axis (its identity first: a sum of -0.0s is +0.0)
    p, m, n = a.shape
    for i in range(p):
        o = out[i]
        for q in range(n):
            o[q] = 0.0
        for j in range(m):
            row = a[i, j]
            for q in range(n):
                o[q] += row[q]


def sum_middle(a, axis, keepdims):
    """``np.sum(a, axis, keepdims=keepdims)`` bit for bit, for a C-contiguous float64 ``a``
    of 2 or 3 dims summed over its second-to-last axis with rows of n >= 64 (gmm's and
    kmeans' sums over the coordinates, laid out (k, d, n)): one pass, about 0.6x NumPy's
    time. None otherwise."""
    if a.__class__ is not np.ndarray or a.dtype is not _F64 or not 2 <= a.ndim <= 3:
        return None
    if axis.__class__ is tuple:
        if len(axis) != 1:
            return None
        axis = axis[0]
    if axis.__class__ is not int or axis % a.ndim != a.ndim - 2:
        return None
    n = a.shape[-1]
    if n < 64 or a.size < _MIN_SIZE or not a.flags.c_contiguous:
        return None
    a3 = _as3(a)
    out = np.empty((a3.shape[0], n), dtype=_F64)
    if "kernels" in _notice.PENDING:
        _notice.announce("kernels")
    # each output row summed by one thread, in the same order
    m = 1 if a.size < JOB_SPLIT_MIN else \
        min(chunks_for(a.size, JOB_MIN_CHUNK, JOB_PER_THREAD), a3.shape[0])
    if m == 1 or not run_compiled(m, sum_caller, a3, out):
        _sum_middle(a3, out)
    shape = a.shape[:-2] + ((1,) if keepdims else ()) + (n,)
    return out.reshape(shape)


@njit_cached(nogil=True)
def _scatter_add(z, idx, g):  # pragma: no cover (compiled)
    # z: (pre, n, post), idx: (m,), g: (pre, m, post): z[p, idx[j], q] += g[p, j, q], j in
    # order (np.add.at's order for each element of z); False, nothing written, where an
    # index is out of range
    pre, n, post = z.shape
    m = idx.shape[0]
    for j in range(m):
        if idx[j] < -n or idx[j] >= n:
            return False
    for p in range(pre):
        for j in range(m):
            c = idx[j]
            if c < 0:
                c += n
            zr = z[p, c]
            gr = g[p, j]
            for q in range(post):
                zr[q] += gr[q]
    return True


def scatter_add(z, index, g):
    """``np.add.at(z, index, g)`` bit for bit, in one compiled pass, for a float64 ``z`` and
    ``g`` and an index of one 1-d integer array among full slices (gmm's gather of Q from l,
    ``lpad[:, idx]`` with idx repeating 0: NumPy's add.at took 24 us for 2,500 numbers):
    each element of z gets its numbers added in the index's order, from 0.0 for a zeroed
    z. Returns False where that does not apply (nothing written), for add.at."""
    if z.__class__ is not np.ndarray or g.__class__ is not np.ndarray \
            or z.dtype is not _F64 or g.dtype is not _F64 or not z.flags.c_contiguous:
        return False
    items = index if index.__class__ is tuple else (index,)
    if len(items) > z.ndim:
        return False
    ax = -1
    for i, it in enumerate(items):
        if it.__class__ is np.ndarray:
            if ax >= 0 or it.ndim != 1 or it.dtype.kind not in "iu":
                return False
            ax = i
        elif not (it.__class__ is slice and it.start is None and it.stop is None
                  and it.step is None):
            return False
    if ax < 0:
        return False
    shape = z.shape
    idx = items[ax]
    if g.shape != shape[:ax] + (idx.shape[0],) + shape[ax + 1:]:
        return False  # (a broadcast g: add.at's)
    pre = 1
    for k in shape[:ax]:
        pre *= k
    post = z.size // (pre * shape[ax]) if z.size else 0
    if not z.size or not g.size:
        return False
    # (read-only views of the index and g: one compiled signature whatever their flags)
    return _scatter_add(z.reshape(pre, shape[ax], post),
                        _readonly(idx.astype(np.int64, copy=False)),
                        _readonly(g.reshape(pre, idx.shape[0], post)))


# --- NumPy passes on threads -------------------------------------------------------------


def par_ufunc(ufunc, x, y):
    """``ufunc(x, y)`` (a NumPy binary ufunc on float64 arrays) on ``get_num_threads()``
    threads, each its own span of the result's first axis (NumPy releases the GIL for the
    loop); the same bits as one call. None where the result is small, for the caller's
    one call."""
    if x.__class__ is not np.ndarray or y.__class__ is not np.ndarray \
            or x.dtype is not _F64 or y.dtype is not _F64 or x.ndim != y.ndim or not x.ndim:
        return None
    shape = broadcast_pair(x.shape, y.shape)
    if shape is None:
        return None
    size = 1
    for k in shape:
        size *= k
    m = min(chunks_for(size, MIN_CHUNK), shape[0])
    if m == 1:
        return None
    out = np.empty(shape, dtype=_F64)
    b = _bounds(shape[0], m)

    def chunk(i):
        s = slice(b[i], b[i + 1])
        ufunc(_span(x, s), _span(y, s), out=out[s])
    run_chunks(chunk, m)
    return out


def matmul(a, b):
    """``np.matmul(a, b)``; a batch of products (3 dims each, gmm's ``Q @ (x - mu)`` and its
    gradients) over ``PAR_MIN`` numbers or more split over ``get_num_threads()`` threads, each
    its own span of the batch: the same products (one BLAS call per matrix), the same
    bits."""
    if a.__class__ is np.ndarray and b.__class__ is np.ndarray and a.ndim == 3 == b.ndim \
            and a.dtype is _F64 and b.dtype is _F64 and a.shape[2] == b.shape[1]:
        batch = max(a.shape[0], b.shape[0])
        size = max(a.size, b.size, batch * a.shape[1] * b.shape[2])
        m = min(chunks_for(size, MIN_CHUNK), batch)
        if m > 1 and (a.shape[0] == 1 or b.shape[0] == 1 or a.shape[0] == b.shape[0]):
            out = np.empty((batch, a.shape[1], b.shape[2]), dtype=_F64)
            bd = _bounds(batch, m)

            def chunk(i):
                s = slice(bd[i], bd[i + 1])
                np.matmul(_span(a, s), _span(b, s), out=out[s])
            run_chunks(chunk, m)
            return out
    return np.matmul(a, b)


def sum_last(a, keepdims):
    """``np.sum(a, axis=-1, keepdims=keepdims)`` for a C-contiguous float64 ``a`` of 2 dims or
    more and ``PAR_MIN`` numbers or more, over ``get_num_threads()`` threads, each summing its
    own rows as NumPy does (one reduction per row): the same bits. None otherwise (one
    thread, small)."""
    if a.__class__ is not np.ndarray or a.dtype is not _F64 or a.ndim < 2 \
            or not a.flags.c_contiguous:
        return None
    n = a.shape[-1]
    rows = a.size // n if n else 0
    m = min(chunks_for(a.size, MIN_CHUNK), rows)
    if m <= 1:
        return None
    a2 = a.reshape(rows, n)
    out = np.empty(rows, dtype=_F64)
    b = _bounds(rows, m)
    run_chunks(lambda i: np.add.reduce(a2[b[i]:b[i + 1]], axis=1, out=out[b[i]:b[i + 1]]), m)
    return out.reshape(a.shape[:-1] + ((1,) if keepdims else ()))


# --- the compiled side of the threads' hand-over (``_threads``) ---------------------------
# A job is an int64 array ``ctl`` (``_threads.Pool.ctl``): the claim word at CLAIM (the
# job's number, its chunk count and the next chunk to take, one word, so a thread that read
# it took a chunk of that job or none), the chunks the workers finished at DONE (on its own
# cache line), the kind of job at KIND and its arrays' addresses and shapes from PARAMS.
# Worker threads take chunks here without Python's lock (``_atomic.serve``); a Python job's chunk
# (a NumPy call, a replay block) goes back to Python to be run.
CLAIM, DONE, KIND, ALLOWED, PARAMS = 0, 8, 16, 17, 24
IDX_BITS = 20
IDX_MASK = (1 << IDX_BITS) - 1
SEQ_MASK = (1 << 22) - 1
#: kinds of job: chunks of a Python function, of ``_rows_op``, of ``_sum_middle``
JOB_PY, JOB_ROWS, JOB_SUM_MIDDLE = 0, 1, 2


@njit_cached(nogil=True)
def _operand(ctl, at):  # pragma: no cover (compiled)
    return carray(f64_pointer(ctl[at]), (ctl[at + 1], ctl[at + 2], ctl[at + 3]))


@njit_cached(nogil=True)
def _run_chunk(ctl, i, m):  # pragma: no cover (compiled)
    # chunk i of m: the span n * i // m to n * (i + 1) // m of the split axis, computed as
    # the whole pass computes it (elementwise, or a sum per output row in its order)
    kind = ctl[KIND]
    if kind == JOB_ROWS:
        op, axis = ctl[PARAMS], ctl[PARAMS + 1]
        x, y = _operand(ctl, PARAMS + 2), _operand(ctl, PARAMS + 6)
        out = _operand(ctl, PARAMS + 10)
        n = out.shape[axis]
        lo, hi = n * i // m, n * (i + 1) // m
        if axis == 0:
            xs = x[lo:hi] if x.shape[0] > 1 else x[:]
            ys = y[lo:hi] if y.shape[0] > 1 else y[:]
            _rows_op(xs, ys, op, out[lo:hi])
        else:
            xs = x[:, lo:hi] if x.shape[1] > 1 else x[:, :]
            ys = y[:, lo:hi] if y.shape[1] > 1 else y[:, :]
            _rows_op(xs, ys, op, out[:, lo:hi])
    elif kind == JOB_SUM_MIDDLE:
        a = _operand(ctl, PARAMS)
        out = carray(f64_pointer(ctl[PARAMS + 4]), (a.shape[0], a.shape[2]))
        n = a.shape[0]
        lo, hi = n * i // m, n * (i + 1) // m
        _sum_middle(a[lo:hi], out[lo:hi])


@njit_cached(nogil=True)
def describe_rows(ctl, x, y, op, axis, out):  # pragma: no cover (compiled)
    """``_rows_op(x, y, op, out)`` (C-contiguous arrays of 3 dims) as a job split on
    ``axis``."""
    ctl[PARAMS], ctl[PARAMS + 1] = op, axis
    ctl[PARAMS + 2] = x.ctypes.data
    ctl[PARAMS + 3], ctl[PARAMS + 4], ctl[PARAMS + 5] = x.shape
    ctl[PARAMS + 6] = y.ctypes.data
    ctl[PARAMS + 7], ctl[PARAMS + 8], ctl[PARAMS + 9] = y.shape
    ctl[PARAMS + 10] = out.ctypes.data
    ctl[PARAMS + 11], ctl[PARAMS + 12], ctl[PARAMS + 13] = out.shape


@njit_cached(nogil=True)
def describe_sum_middle(ctl, a, out):  # pragma: no cover (compiled)
    """``_sum_middle(a, out)`` (C-contiguous) as a job split on the first axis."""
    ctl[PARAMS] = a.ctypes.data
    ctl[PARAMS + 1], ctl[PARAMS + 2], ctl[PARAMS + 3] = a.shape
    ctl[PARAMS + 4] = out.ctypes.data


#: ``share``'s ``times``: the timespec it reads into (0, 1); set once by ``_threads``: the
#: turns of its wait for the workers' chunks, ``clock_gettime``'s address (0: not read) and
#: ``_run_chunk``'s, which the workers call (``T_RUN``, copied into the job);
#: then what it measured: the CPU ns of the caller's chunks (-1: not read) and the workers'
#: chunks done when it stopped waiting, and the chunks it ran (-1 until it ran them: a
#: KeyboardInterrupt before the call leaves the job to the caller's ``except``)
T_TURNS, T_CLOCK, T_CPU, T_DONE, T_OWN, T_RUN = 2, 3, 4, 5, 6, 7


@njit_cached(nogil=True)
def share(ctl, word, allowed, times):  # pragma: no cover (compiled)
    """The calling thread's share of the job just described in ``ctl``, in the same
    compiled call (no Python between the description, the claim word and the caller's
    first chunk, par18's ``_atomic.run_caller`` for intra-op passes): ``allowed``
    workers, none done yet, the claim word ``word`` stored, the chunks this thread claims
    run, then up to ``T_TURNS`` reads for the workers' chunks to end (``T_DONE``: those
    done). Returns the chunks it ran."""
    ctl[DONE] = 0
    ctl[ALLOWED] = allowed
    ctl[RUN_CHUNK] = times[T_RUN]
    store_release(ctl, CLAIM, word)
    clock = times[T_CLOCK]
    t0 = _clock_ns(clock, CLOCK_THREAD_CPUTIME_ID, times) if clock != 0 else 0
    own = help_out(ctl)
    times[T_OWN] = own
    times[T_CPU] = _clock_ns(clock, CLOCK_THREAD_CPUTIME_ID, times) - t0 if clock != 0 \
        else -1
    left = ((word >> IDX_BITS) & IDX_MASK) - (word & IDX_MASK) - own
    finished = load_acquire(ctl, DONE)
    if finished < left:
        for _ in range(times[T_TURNS]):
            finished = load_acquire(ctl, DONE)
            if finished >= left:
                break
    times[T_DONE] = finished
    return own


@njit_cached(nogil=True)
def rows_caller(ctl, x, y, op, axis, out, word, allowed, times):  # pragma: no cover
    """``_rows_op(x, y, op, out)`` split on ``axis``: described and ``share``d in one
    call."""
    describe_rows(ctl, x, y, op, axis, out)
    ctl[KIND] = JOB_ROWS
    return share(ctl, word, allowed, times)


@njit_cached(nogil=True)
def sum_caller(ctl, a, out, word, allowed, times):  # pragma: no cover (compiled)
    """``_sum_middle(a, out)`` split on the first axis: described and ``share``d in one
    call."""
    describe_sum_middle(ctl, a, out)
    ctl[KIND] = JOB_SUM_MIDDLE
    return share(ctl, word, allowed, times)


@njit_cached(nogil=True)
def claim(ctl):  # pragma: no cover (compiled)
    """A chunk of the posted job taken for this thread: (its index, the chunk count), or
    (-1, 0) when every chunk is taken."""
    while True:
        w = load_acquire(ctl, CLAIM)
        i, m = w & IDX_MASK, (w >> IDX_BITS) & IDX_MASK
        if i >= m:
            return -1, 0
        if compare_swap(ctl, CLAIM, w, w + 1) == w:
            return i, m


@njit_cached(nogil=True)
def help_out(ctl):  # pragma: no cover (compiled)
    """The posting thread's share of a compiled job: chunks taken and run until none is
    left; returns how many it ran."""
    own = 0
    while True:
        i, m = claim(ctl)
        if i < 0:
            return own
        _run_chunk(ctl, i, m)
        own += 1


@njit_cached(nogil=True)
def chunk_done(ctl):  # pragma: no cover (compiled)
    """A worker's Python chunk ended (its writes before this store)."""
    fetch_add(ctl, DONE, 1)


@njit_cached(nogil=True)
def wait_done(ctl, count, turns):  # pragma: no cover (compiled)
    """Whether the workers' finished chunks reached ``count`` within ``turns`` reads (one
    at least)."""
    for _ in range(max(turns, 1)):
        if load_acquire(ctl, DONE) >= count:
            return True
    return False


@njit_cached(nogil=True)
def publish(ctl, word):  # pragma: no cover (compiled)
    """The claim word stored after the job's description (seen by a worker's acquire)."""
    store_release(ctl, CLAIM, word)


@njit_cached(nogil=True)
def take_rest(ctl):  # pragma: no cover (compiled)
    """Every chunk not taken yet, taken (a failed job's rest, never run); returns how
    many."""
    while True:
        w = load_acquire(ctl, CLAIM)
        i, m = w & IDX_MASK, (w >> IDX_BITS) & IDX_MASK
        if i >= m:
            return 0
        if compare_swap(ctl, CLAIM, w, w - i + m) == w:
            return m - i
