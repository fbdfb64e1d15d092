"""The CPU array sweep: ``sweep`` runs scalar runs compiled and each array entry's rule on
NumPy values (``array_vjp``), one seed or a batch of them."""
from __future__ import annotations

import numpy as np

from ..ops import ARRAY, ARRAY_OP, BINARY, OPS, UNARY, UNARY_C, NpF, call_rule
from ..ops._kernels import _MIN_SIZE as _ROWS_MIN, MUL, MUL2, PAR_MIN as _PAR_MIN, par_ufunc, \
    rows_op
from ..ops._registry import Part
from ..ops.arrays import sum_axes, sum_to
from . import _generated_cpu
from .cpu_fast import _AT_INDEX

_THUNK = type(lambda: None)  # a rule's lazily built gradient
_F64 = np.dtype(np.float64)
_LISTED = 256  # tapes of at most this many entries list their needed entries in sweep()
_add_reduce = np.add.reduce

try:  # NumPy 2: errstate sets a context variable; setting it directly costs a tenth
    from numpy._core._ufunc_config import _extobj_contextvar, _make_extobj
    _QUIET = _make_extobj(all="ignore")

    def _quiet_on():
        """NumPy's floating-point warnings off (torch warns of none) until ``_quiet_off``
        of the token: ``np.errstate``'s effect without its cost (2 us a sweep)."""
        return _extobj_contextvar.set(_QUIET)

    def _quiet_off(token):
        _extobj_contextvar.reset(token)
except (ImportError, AttributeError, TypeError):  # NumPy 1.x
    def _quiet_on():
        e = np.errstate(all="ignore")
        e.__enter__()
        return e

    def _quiet_off(e):
        e.__exit__(None, None, None)


def sum_to_shape(g, shape):
    """``sum_to(g, shape)`` for an array ``g`` larger than ``shape``: the same
    ``add.reduce`` call ``np.sum`` makes (the same bits) without np.sum's wrapper and
    reshape steps (4 us of a small sweep's sub rule); ``sum_to`` itself where its
    short-last-axis sum (``fast_sum``, its own order) may apply, for large arrays (its
    threads), or for other dtypes."""
    gs = g.shape
    if len(shape) > len(gs) or g.dtype is not _F64:
        return sum_to(g, shape)
    axes = sum_axes(gs, shape)
    if not axes or gs[-1] <= 8 and len(gs) - 1 in axes or g.size >= _PAR_MIN:
        return sum_to(g, shape)  # (a large one: fast_sum may split it over threads)
    r = _add_reduce(g, axes, None, None, True)
    return r.reshape(shape) if len(gs) != len(shape) else r


def sweep(graph, need, adj, adjd, arr, owned=None):
    """Run the reverse sweep over the needed entries (``arr``: the array ones, last first);
    scalar runs go to the compiled sweep, array entries to their rules on NumPy values.
    ``owned`` (a set, filled in): the slots whose adjoint array the sweep allocated itself,
    referenced by nothing else (the caller may hand such an adjoint out without a copy)."""
    rows = graph.rows
    hi = graph.n
    if not len(arr):  # scalar entries only: one compiled call, no NumPy
        if hi > 0:
            _generated_cpu.sweep(rows, graph.vals, adj, need, hi, 0)
        return
    if owned is None:
        owned = set()  # slots whose adjoint array this sweep allocated: added to in place
    wanted = graph.wanted.tolist()  # read twice per entry: a list's item is the cheaper
    # a needed scalar entry anywhere? (none: no compiled call between the array entries,
    # a few microseconds each, most of a create_graph sweep's entries are arrays). A short
    # tape's needed entries as a list: counted there (a NumPy count costs a microsecond),
    # and a run between array entries with none needed (the leaves and constants below the
    # first one) costs no compiled call
    need_l = need.tolist() if hi <= _LISTED else None
    scalars = (need_l.count(True) if need_l is not None else np.count_nonzero(need)) \
        > len(arr)
    if not scalars:
        need_l = None
    vals = graph.vals if scalars else None  # (converted only when a scalar run is swept)
    ks = arr.tolist()
    # the array entries' rows: one tape's straight from its code list (its opcode and slots
    # as ints, its constants as floats: the matrix's numbers), a few of them without the
    # matrix's fancy index (a microsecond or two of a small sweep)
    entry = graph.row if graph.arrays is not None and len(ks) <= 16 else None
    token = _quiet_on()
    try:
        # (a long tape's rows column by column, zipped: a list per row would be thousands
        # of objects alive through the sweep for the cyclic collector to scan)
        for k, row in zip(ks, [_entry_row(entry(k)) for k in ks] if entry is not None
                          else zip(*rows[arr].T.tolist())):
            if scalars and hi - k > 1 and (need_l is None or True in need_l[k + 1:hi]):
                _generated_cpu.sweep(rows, vals, adj, need, hi, k + 1)
            array_vjp(graph, k, adj, adjd, row=row, owned=owned, wanted=wanted)
            hi = k
        if scalars and hi > 0 and (need_l is None or True in need_l[:hi]):
            _generated_cpu.sweep(rows, vals, adj, need, hi, 0)
    finally:
        _quiet_off(token)


def _entry_row(e):
    """A tape entry (``Tape.entry``) as the rows matrix's row would give it: the constants
    as Python floats (an int constant would change which NumPy loop a rule runs)."""
    op, a, b, c0, c1 = e
    return op, a, b, float(c0), float(c1)


def elementwise_rule(op, F, g, out, a, b, c0, c1, value):
    """(inputs, gradients) of an elementwise or bookkeeping entry's rule; ``value(slot)``
    gives the values it reads."""
    if op.kind is BINARY:
        return (a, b), call_rule(op, F, g, out, value(a), value(b))
    return (a,), call_rule(op, F, g, out, value(a), None, c0, c1)


#: each side of the binary rules that are arithmetic (add, sub, mul, div: the registry's
#: rules, generated side by side), so an array entry computes only the gradients someone
#: reads: ``x * w`` with ``x`` a constant skips ``g * w`` (torch skips it too), and
#: ``x * x`` computes ``g * x`` once. {opcode: (side a, side b, symmetric)}
_SIDES = dict(getattr(_generated_cpu, "SIDES", {}))  # {} while regenerating


def _one_sided(code, g, a, b, value, wanted):
    """The gradients of a binary entry in ``_SIDES``, None for an input nobody reads; for
    ``x * x`` (a symmetric rule) the same array twice (the sweep adds it to itself: the
    bits of g*x + g*x)."""
    fa, fb, symmetric = _SIDES[code]
    va, vb = value(a), value(b)
    if a == b:
        ga = None
        if code == _MUL and g.__class__ is np.ndarray and g.size >= _ROWS_MIN:
            # x * x's g * x, large (gmm's Qxc * Qxc): a broadcast g (a sum's gradient) by the
            # compiled rows pass (NumPy runs one loop per row), else NumPy's on threads;
            # NumPy's bits either way
            ga = rows_op(MUL, g, vb) if 0 in g.strides else par_ufunc(np.multiply, g, vb)
        if ga is None:
            ga = fa(g, va, vb)
        return ga, (ga if symmetric else fb(g, va, vb))
    if code == _MUL and g.__class__ is np.ndarray and g.size >= _ROWS_MIN:
        # g * v with one operand broadcast along rows of n >= 64 (kmeans' g * diff, with
        # g or the constant factor expanded): the compiled pass, NumPy's bits; else NumPy
        ga = gb = None
        if wanted[a]:
            ga = _rows_mul(g, vb)
            if ga is None:
                ga = fa(g, va, vb)
        if wanted[b]:
            gb = _rows_mul(g, va)
            if gb is None:
                gb = fb(g, va, vb)
        return ga, gb
    if code == _SUB and wanted[b] and g.__class__ is np.ndarray and g.size >= 4096 \
            and g.flags.c_contiguous:
        if vb.__class__ is not np.ndarray:  # x - m, m a number (lse's max): -sum(g)
            r = -np.sum(g)  # (the same bits as np.sum(-g), as neg_sum_to says)
            return (fa(g, va, vb) if wanted[a] else None), \
                (float(r) if r and not np.isnan(r) else float(np.sum(-g)))
        if negated_sum_applies(g, vb):
            return (fa(g, va, vb) if wanted[a] else None), neg_sum_to(g, vb.shape)
    return (fa(g, va, vb) if wanted[a] else None), (fb(g, va, vb) if wanted[b] else None)


_SUB = next(op.code for op in OPS if op.name == "sub")
_MUL = next(op.code for op in OPS if op.name == "mul")


def _rows_mul(g, v):
    """``g * v`` by ``rows_op`` where it applies (an operand broadcast along rows of n >=
    64: NumPy's bits), else None."""
    return rows_op(MUL, g, v) if v.__class__ is np.ndarray else None


def _square_twice(code, g, a, value, adjd, wanted):
    """``x * x``'s gradient under a broadcast ``g`` (gmm's Qxc * Qxc under its sum over d),
    x's first: the sweep's g * x + g * x in one compiled pass, the same bits; None where
    that does not apply."""
    if code == _MUL and wanted[a] and a not in adjd and g.__class__ is np.ndarray \
            and g.size >= _ROWS_MIN and 0 in g.strides:
        return rows_op(MUL2, g, value(a))
    return None


def negated_sum_applies(g, v):
    """Whether ``x - v``'s gradient ``-g`` broadcast over a smaller array ``v`` may be
    summed first and negated after (``neg_sum_to``): a C-contiguous g (so g and -g are
    summed in the same order) larger than v."""
    return (g.__class__ is np.ndarray and v.__class__ is np.ndarray and g.shape != v.shape
            and g.size >= 4096 and g.flags.c_contiguous)


def neg_sum_to(g, shape):
    """``sum_to(-g, shape)`` as ``-sum_to(g, shape)``: the negation on the summed array
    (kmeans' centroids: 80 numbers, not 80,000). The same bits: in any order of additions
    each partial sum of -g is minus g's, or both are zeros (x + -x is +0.0 either way), or
    both NaN; so a result with a zero or a NaN (signs could differ) is summed from -g."""
    r = -sum_to_shape(g, shape)
    if r.all() and not np.isnan(r.sum()):  # (a NaN sum: maybe inf - inf, the direct way)
        return r
    return sum_to(-g, shape)


#: unary rules that read neither the input nor the output: functions of g alone (``-g``)
_G_ONLY = frozenset(op.code for op in OPS if op.kind in (UNARY, UNARY_C)
                    and "a" not in op.uses and "out" not in op.uses)


def _compact(g):
    """An index of ``g`` that keeps one copy along each zero-stride axis."""
    return tuple(slice(0, 1) if st == 0 else slice(None) for st in g.strides)


def sweep_checked(graph, need, adj, adjd, on_bad):
    """The reverse sweep entry by entry in Python (anomaly mode): each rule's outputs are
    checked, and ``on_bad(k, i)`` builds the error for a NaN/inf in output ``i`` of ``k``."""
    with np.errstate(all="ignore"):
        for k in np.nonzero(need)[0][::-1].tolist():
            array_vjp(graph, k, adj, adjd, on_bad)


# entries whose outputs are separate ``function_out`` entries: their rule gets {index: grad}
MULTI_OUTPUT = frozenset(("function", "program"))
_MULTI_CODES = frozenset(op.code for op in OPS if op.nary and op.name in MULTI_OUTPUT)
#: per opcode, whether its rule reads the entry's output, first and second input (the
#: registry's ``uses``: a value it does not read is not looked up, and is None, as the
#: re-recording sweep gives it)
_READS_OUT = [("out" in op.uses) for op in OPS]
_READS_A = [("a" in op.uses) for op in OPS]
_READS_B = [("b" in op.uses) for op in OPS]


def array_vjp(graph, k, adj, adjd, on_bad=None, row=None, owned=None, wanted=None):
    """Run entry ``k``'s rule on NumPy values and accumulate into its inputs (``row``: its
    row as a list, when the caller has it). ``owned``: slots whose adjoint array the sweep
    allocated itself, so adding to it in place changes no other array (an adjoint can be
    a rule's input gradient or a view of one, never written to). ``wanted``:
    ``graph.wanted`` as a list, when the caller has it."""
    if wanted is None:
        wanted = graph.wanted
    if row is None:
        code, a, b, c0, c1 = graph.row(k)
    else:
        code, a, b, c0, c1 = row
        code, a, b = int(code), int(a), int(b)
    op = OPS[code & ~ARRAY]
    opc = op.code
    value, is_array = graph.value, graph.is_array
    # the output only for a rule that reads it (a value lookup per entry saved: ode's and
    # ba's sweeps run thousands of small rules); a rule that does not gets None, as the
    # re-recording sweep gives it
    out = value(k) if _READS_OUT[opc] else None
    if opc in _MULTI_CODES:
        g = adjd.get(k)  # {output index: gradient}, gathered from its function_out entries
    elif is_array(k):
        g = adjd.get(k)
        if g is None:
            g = np.zeros_like(value(k))
    else:
        g = adj[k]
    aux = graph.aux(k) if opc in _AT_INDEX and owned is not None else None
    if aux is not None and len(aux) > 2 and aux[2] and is_array(a):
        # a basic index (a view): the op's scatter form, added into that part of the base's
        # adjoint in place (no input-sized gradient built)
        base = adjd.get(a)
        if base is None or a not in owned:
            v = value(a)
            fresh = np.zeros(v.shape, v.dtype)
            if base is not None:
                fresh += base
            base = adjd[a] = fresh
            owned.add(a)
        base[aux[0]] += op.scatter[1](g, base.size)
        return
    if op.kind is ARRAY_OP:
        inputs = graph.nary_inputs(k) if op.nary else ((a,) if b < 0 else (a, b))
        grads = op.vjp(NpF, g, [value(s) for s in inputs], out, graph.aux(k))
    elif on_bad is None and a == b and (twice := _square_twice(op.code, g, a, value, adjd,
                                                                wanted)) is not None:
        inputs, grads = (a,), (twice,)
    elif on_bad is None and op.code in _SIDES and (
            a == b or not (wanted[a] and wanted[b]) or op.code == _SUB):
        inputs, grads = (a, b), _one_sided(op.code, g, a, b, value, wanted)
    elif (on_bad is None and op.code in _G_ONLY and g.__class__ is np.ndarray
          and g.size >= 4096 and 0 in g.strides):
        # a rule of g alone, elementwise, on a broadcast g (a sum's gradient): run on one
        # copy of the repeated part and broadcast the result back (the same numbers)
        inputs, grads = elementwise_rule(op, NpF, g[_compact(g)], out, a, b, c0, c1, value)
        grads = [np.broadcast_to(gr, g.shape) if gr.__class__ is np.ndarray else gr
                 for gr in grads]
    elif op.kind is BINARY:  # (elementwise_rule's call, inline: ode's thousands of rules)
        inputs = (a, b)
        grads = op.vjp(NpF, g, value(a) if _READS_A[opc] else None,
                       value(b) if _READS_B[opc] else None, out)
    elif op.kind is UNARY_C:
        inputs = (a,)
        grads = op.vjp(NpF, g, value(a) if _READS_A[opc] else None, out, c0, c1)
    else:
        inputs, grads = elementwise_rule(op, NpF, g, out, a, b, c0, c1, value)
    if on_bad is not None:
        grads = [gr() if gr.__class__ is _THUNK else gr for gr in grads]
        for i, gr in enumerate(grads):
            if gr is not None and gr.__class__ is not Part and \
                    not np.all(np.isfinite(gr)):
                raise on_bad(k, i)
    _accumulate(graph, inputs, grads, adj, adjd, owned, wanted, value, is_array)


def _accumulate(graph, inputs, grads, adj, adjd, owned, wanted, value, is_array):
    """Add a rule's gradients into its inputs' adjoints (broadcasting summed away, the
    input's dtype); ``owned`` as ``array_vjp``'s."""
    arrays = graph.arrays  # (one tape's: one lookup says array or not and gives it)
    for s, gr in zip(inputs, grads):
        if gr is None or not wanted[s]:  # nobody reads that adjoint (a constant input):
            if gr is None and wanted[s] and (arrays.get(s) is None if arrays is not None
                                             else not is_array(s)):
                adj[s] += 0.0  # (from its -0.0 start: a 0-d adjoint nothing defined is 0.0)
            continue  # no broadcast to undo, no sum (torch skips it too)
        if gr.__class__ is _THUNK:
            gr = gr()
        if gr.__class__ is Part:
            _gather(adjd, s, gr)
            continue
        v = arrays.get(s) if arrays is not None else value(s) if is_array(s) else None
        if v is not None:
            if gr.__class__ is not np.ndarray:
                gr = np.broadcast_to(np.asarray(gr, dtype=v.dtype), v.shape)
            elif gr.shape != v.shape:
                gr = sum_to_shape(gr, v.shape)
            if gr.dtype != v.dtype:
                gr = gr.astype(v.dtype)
            prev = adjd.get(s)
            if prev is None:
                adjd[s] = gr
            elif owned is not None and s in owned:
                np.add(prev, gr, out=prev)
            elif (prev.__class__ is np.ndarray and prev.size >= 4096 and 0 in prev.strides
                  and gr.strides == prev.strides):
                # two broadcasts alike (x + x under a sum's gradient): added on one copy of
                # the repeated part and broadcast back, the same numbers; a read-only view,
                # so not owned (a later gradient is added into a fresh array)
                c = _compact(prev)
                adjd[s] = np.broadcast_to(prev[c] + gr[c], prev.shape)
            else:  # (a large sum on threads: gmm's x * x, g * x added to itself)
                v = par_ufunc(np.add, prev, gr) if prev.size >= _PAR_MIN else None
                adjd[s] = prev + gr if v is None else v
                if owned is not None:
                    owned.add(s)
        elif gr.__class__ is float or gr.__class__ is np.float64:
            adj[s] += gr  # (np.sum of a 0-d -0.0 is +0.0: the sign torch keeps)
        else:
            adj[s] += float(np.sum(gr))


def _gather(adjd, s, part):
    """Collect the gradient of one output of a multi-output entry."""
    parts = adjd.get(s)
    if parts is None:
        parts = adjd[s] = {}
    prev = parts.get(part.index)
    parts[part.index] = part.grad if prev is None else prev + part.grad


# --- batched sweeps (is_grads_batched) ----------------------------------------------------


def sweep_batched(graph, need, adjb, adjd, arr):
    """``sweep`` for a batch of seeds: ``adjb[slot]`` holds a scalar slot's adjoints for the
    whole batch, ``adjd[slot]`` an array slot's with a leading batch axis."""
    rows, vals = graph.rows, graph.vals
    hi = graph.n
    B = adjb.shape[1]
    with np.errstate(all="ignore"):
        for k in arr.tolist():
            if hi - k > 1:
                _generated_cpu.sweep_batched(rows, vals, adjb, need, hi, k + 1)
            array_vjp_batched(graph, k, adjb, adjd, B)
            hi = k
        if hi > 0:
            _generated_cpu.sweep_batched(rows, vals, adjb, need, hi, 0)


def array_vjp_batched(graph, k, adjb, adjd, B):
    """Entry ``k``'s rule once for the whole batch (see ``Op.batch``)."""
    code, a, b, c0, c1 = graph.row(k)
    op = OPS[code & ~ARRAY]
    value = graph.value
    out = value(k)
    if op.nary and op.name in MULTI_OUTPUT:
        g = adjd.get(k) or {}
    else:
        g = adjd.get(k) if graph.is_array(k) else adjb[k]
    if g is None:
        g = np.zeros((B,) + np.shape(out))
    post = None
    if op.kind is not ARRAY_OP:  # elementwise rules broadcast over the batch axis
        inputs, grads = elementwise_rule(op, NpF, g, out, a, b, c0, c1, value)
    else:
        if op.batch is None:
            raise NotImplementedError(
                f"is_grads_batched=True cannot go through op '{op.name}' yet; compute the "
                "rows with separate grad() calls")
        inputs = graph.nary_inputs(k) if op.nary else ((a,) if b < 0 else (a, b))
        vs, out_b, g_b, aux_b, post = op.batch([value(s) for s in inputs], out, g,
                                               graph.aux(k), B)
        grads = op.vjp(NpF, g_b, vs, out_b, aux_b)
    for i, (s, gr) in enumerate(zip(inputs, grads)):
        if gr is None or not graph.wanted[s]:  # an adjoint nobody reads
            continue
        if gr.__class__ is _THUNK:
            gr = gr()
        if gr.__class__ is Part:
            _gather(adjd, s, gr)
            continue
        if post is not None and post[i] is not None:
            gr = post[i](gr)
        v = value(s)
        target = (B,) + np.shape(v)
        gr = sum_to_batched(np.asarray(gr), target)
        if graph.is_array(s):
            if gr.dtype != v.dtype:
                gr = gr.astype(v.dtype)
            prev = adjd.get(s)
            adjd[s] = gr if prev is None else prev + gr
        else:
            adjb[s] += gr


def sum_to_batched(g, shape):
    """``sum_to`` that keeps the leading batch axis (every gradient derived from the seeds
    has one; a 0-d gradient is a constant that broadcasts over the batch)."""
    if g.shape == shape:
        return g
    if g.ndim == 0:
        return np.broadcast_to(g, shape)
    axes = sum_axes(g.shape, shape, 1)
    r = np.sum(g, axis=axes, keepdims=True) if axes else g
    return np.reshape(r, (g.shape[0],) + tuple(shape[1:]))
