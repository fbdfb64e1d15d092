"""Traced programs as data: lowering tapes to scalar rows, pruning, and re-recording the
reverse sweep as rows (derivatives of any order of a program are programs).

A program is a float64 matrix of rows ``(opcode, a, b, c, c0, c1)``: row ``k`` computes
value ``k`` from the values at slots ``a``, ``b``, ``c`` (-1 when absent) and its float
constants. ``leaf`` rows read input element ``c0``, ``const`` rows hold ``c0``, ``guard``
rows check that the truth value at ``a`` is still ``c0`` (``c1`` names the guard's site).
Only registered ops appear, so the generated interpreters (``_generated_replay.py``) run it
forward and backward, one sample or a batch. An array op over evenly spaced slots is an
array instruction instead, four rows for its whole run of values (``program_arrays``);
the slots are then counted apart from the rows, and the scalar interpreters run the
program's expansion (``_Code.rows``).
"""
from __future__ import annotations

import math
import struct

import numpy as np

from .._jit import njit_cached
from ..ops import (ARRAY, ARRAY_OP, BINARY, BY_NAME, COMPARE, OPS, UNARY, UNARY_C,
                   call_rule, lowering, rule_inputs)
from ..ops.elementwise import powc_op
from . import program_arrays as _arr

NCOL = 6
LEAF = BY_NAME["leaf"].code
CONST = BY_NAME["const"].code
GUARD = BY_NAME["guard"].code
_CODE = {op.name: op.code for op in OPS}
_PASS = ("clone", "import_")  # identity ops: the output is the input's slot


#: the terms a reduction sums in order (``Builder.reduce_terms``); longer ones are summed in
#: blocks of this many, then the blocks' sums
RED_BLOCK = 128


def _even(X):
    """Whether the slots ``X`` are evenly spaced along the last axis (the same step
    everywhere)."""
    if X.shape[-1] < 2 or X.size == 0:
        return True
    d = np.diff(X, axis=-1)
    return bool((d == d.flat[0]).all())


class Builder:
    """Emits program rows. Slots are Python ints (scalars) or int64 arrays shaped like the
    values; ``op`` broadcasts its inputs like NumPy and emits one row per element, or an
    array instruction per run of evenly spaced slots (``program_arrays``). ``n`` counts
    slots, not rows."""

    def __init__(self, min_run=None):
        self.n = 0
        # runs of at least this many elements become array instructions (program_arrays)
        self.min_run = max(4, _arr.MIN_RUN if min_run is None else min_run)
        self.arrays = False  # whether any row is an array instruction
        self._pending = []  # scalar rows as tuples, in order
        self._blocks = []   # (m, NCOL) arrays, in order with the pending rows flushed
        self._leaves = []   # the indices in _blocks of runs of leaf rows (``inputs``)
        self._detach_spans = []  # [start, stop) of the slots of detach ops (``op``)
        self._consts = {}

    def _flush(self):
        if self._pending:
            self._blocks.append(np.array(self._pending, dtype=np.float64).reshape(-1, NCOL))
            self._pending = []

    def row(self, code, a=-1, b=-1, c=-1, c0=0.0, c1=0.0):
        """Emit one row; returns its slot."""
        self._pending.append((code, a, b, c, c0, c1))
        self.n += 1
        return self.n - 1

    def rows(self):
        self._flush()
        if self.arrays:
            # a program of array instructions reads its inputs as instructions too: a
            # leaf row per element took 2 of lse's 16 ms (n = 640,000), and made it mostly
            # scalar rows (``MIN_COVER``); the slots are the same
            for j in self._leaves:
                b = self._blocks[j]
                if b.shape[0] >= self.min_run:
                    self._blocks[j] = np.array(
                        [[_arr.ARR, -1, -1, -1, b[0, 4], 0.0],
                         [_arr.TAIL, -1, -1, -1, b.shape[0], LEAF],
                         [_arr.TAIL, -1, -1, -1, 0.0, 0.0],
                         [_arr.TAIL, -1, -1, -1, 0.0, 0.0]], dtype=np.float64)
            self._leaves = []
        if not self._blocks:
            return np.zeros((0, NCOL))
        if len(self._blocks) > 1:
            self._blocks = [np.concatenate(self._blocks)]
            self._leaves = []
        return self._blocks[0]

    def op(self, name, *ins, c0=0.0, c1=0.0):
        """Rows of op ``name`` over (broadcast) slot arrays ``ins``."""
        if name == "powc":  # (the rare exponents' op of their own: ops.elementwise)
            name = powc_op(c0)
        code = _CODE[name]
        if all(i.__class__ is int for i in ins):
            ins = ins + (-1,) * (3 - len(ins))
            return self.row(code, ins[0], ins[1], ins[2], c0, c1)
        arrs = np.broadcast_arrays(*[np.asarray(i, dtype=np.int64) for i in ins])
        shape = arrs[0].shape
        m = int(np.prod(shape))
        if m > 1 and name in _arr.ARRAYABLE and all(not any(x.strides) for x in arrs):
            # every element is the same op of the same slots (a broadcast scalar): one row
            ins = tuple(int(x.reshape(-1)[0]) for x in arrs) + (-1,) * (3 - len(arrs))
            return np.full(shape, self.row(code, ins[0], ins[1], ins[2], c0, c1),
                           dtype=np.int64)
        if shape == ():
            ins = tuple(int(i) for i in arrs) + (-1,) * (3 - len(arrs))
            return np.asarray(self.row(code, ins[0], ins[1], ins[2], c0, c1))
        self._flush()
        flat = np.stack([x.reshape(-1) for x in arrs])
        if m >= self.min_run and name in _arr.ARRAYABLE:
            block, arrays = _arr.block(code, flat, c0, c1, self.min_run)
            self.arrays = self.arrays or arrays
        else:
            block = _arr.scalar_block(code, flat, c0, c1)
        self._blocks.append(block)
        out = np.arange(self.n, self.n + m, dtype=np.int64).reshape(shape)
        if name == "detach":
            self._detach_spans.append((self.n, self.n + m))
        self.n += m
        return out

    def reduce_terms(self, A, B=None, step="add"):
        """Slots of the sums over the last axis of the slot array ``A`` (of its products with
        ``B``, broadcast together: a dot product's, a matmul's), each summed in order (a
        chain of ``add`` rows, the products' ``mul`` rows before each), in blocks of
        ``RED_BLOCK`` terms whose sums are summed again (NumPy's pairwise summation keeps
        its error small the same way); reduction instructions where the terms are evenly
        spaced along the axis (``program_arrays.red_block``). None when they are not: the
        caller sums another way. ``step`` "maximum" or "minimum": the extremes of values
        that ``detach`` rows made (their gradient goes nowhere, so the instructions need
        no rule), else None."""
        if step != "add" and (B is not None or not self._detached(A)):
            return None
        if B is not None:
            A, B = np.broadcast_arrays(np.asarray(A, dtype=np.int64),
                                       np.asarray(B, dtype=np.int64))
        A = np.asarray(A, dtype=np.int64)
        shape, L = A.shape[:-1], A.shape[-1]
        if L < 2 or not all(_even(X) for X in (A, B) if X is not None):
            return None
        if L > RED_BLOCK:  # partial sums of blocks, then their sum, then the rest's
            nb = L // RED_BLOCK
            cut = nb * RED_BLOCK
            blk = lambda X: None if X is None else \
                X[..., :cut].reshape(shape + (nb, RED_BLOCK))  # noqa: E731
            P = self.reduce_terms(blk(A), blk(B), step)
            r = P[..., 0] if nb == 1 else self._reduce_terms(P, step)
            if r is None:  # the partial sums are not evenly spaced: added in order
                r = P[..., 0]
                for j in range(1, nb):
                    r = self.op(step, r, P[..., j])
            if L > cut:
                rest = (A[..., cut] if B is None else self.op(
                    "mul", A[..., cut], B[..., cut])) if L - cut == 1 else \
                    self.reduce_terms(A[..., cut:], None if B is None else B[..., cut:], step)
                r = self.op(step, r, rest)
            return r
        # the longest output axis last: its outputs are a run, whatever the others
        perm = None
        if len(shape) > 1 and int(np.argmax(shape)) != len(shape) - 1:
            j = int(np.argmax(shape))
            perm = [d for d in range(len(shape)) if d != j] + [j]
            A = np.transpose(A, perm + [len(shape)])
            B = None if B is None else np.transpose(B, perm + [len(shape)])
        oshape = A.shape[:-1]
        m = int(np.prod(oshape))
        step = _arr.MUL if B is not None else _CODE[step]
        self._flush()
        block, arrays, out = _arr.red_block(step, A.reshape(m, L),
                                            None if B is None else B.reshape(m, L), self.n,
                                            self.min_run)
        self.arrays = self.arrays or arrays
        self._blocks.append(block)
        out = out.reshape(oshape)
        self.n += m * _arr.red_width(step, L)
        return out if perm is None else np.transpose(out, np.argsort(perm))

    def _reduce_terms(self, P, name):
        """``reduce_terms`` of the partial results ``P`` (fresh slots) with step ``name``."""
        if name == "add":
            return self.reduce_terms(P)
        # (partial extremes of detached values: no gradient either)
        self._detach_spans.append((int(P.min()), int(P.max()) + 1))
        return self.reduce_terms(P, step=name)

    def _detached(self, A):
        """Whether every slot of ``A`` is the value of a ``detach`` row of this builder."""
        A = np.asarray(A).reshape(-1)
        if A.size == 0:
            return False
        lo, hi = int(A.min()), int(A.max())
        return any(a <= lo and hi < b for a, b in self._detach_spans)

    def const(self, value):
        """Slots holding ``value`` (a float or an array), one row per distinct value."""
        if isinstance(value, (float, int, bool, np.floating, np.integer, np.bool_)):
            v = float(value)
            key = struct.pack("d", v)
            s = self._consts.get(key)
            if s is None:
                s = self._consts[key] = self.row(CONST, c0=v)
            return s
        arr = np.asarray(value, dtype=np.float64)
        flat = arr.reshape(-1)
        if flat.size >= self.min_run:
            # a row per element, in order: slots evenly spaced, as an array instruction's
            # operand must be (a matmul with a constant matrix is then one reduction
            # instruction: shared rows would leave its terms scattered)
            return np.asarray([self.row(CONST, c0=v) for v in flat.tolist()],
                              dtype=np.int64).reshape(arr.shape)
        out = np.empty(flat.shape, dtype=np.int64)
        for i, v in enumerate(flat.tolist()):
            out[i] = self.const(v)
        return out.reshape(arr.shape)

    def inputs(self, start, shape):
        """Leaf rows reading input elements ``start ..`` as an array shaped ``shape``."""
        m = int(np.prod(shape))
        self._flush()
        block = np.zeros((m, NCOL), dtype=np.float64)
        block[:, 0] = LEAF
        block[:, 1:4] = -1.0
        block[:, 4] = np.arange(start, start + m, dtype=np.float64)
        self._leaves.append(len(self._blocks))
        self._blocks.append(block)
        slots = np.arange(self.n, self.n + m, dtype=np.int64)
        self.n += m
        return slots.reshape(shape)


# --- lowering tapes ---------------------------------------------------------------------------


def _value(tape, k):
    return tape.arrays[k] if k in tape.arrays else tape.vals[k]


def _scalar(x):
    """Python int for a 0-d slot array, else the array itself."""
    return int(x) if isinstance(x, np.ndarray) and x.ndim == 0 else x


def lower(tapes, inputs, outputs, refs=None, sites_base=0):
    """Lower the recorded ``tapes`` (in recording order) to program rows.

    ``inputs``: the leaf tensors that become program inputs, in order; ``outputs``: the
    tensors (or numbers) whose slots the program returns. Values from tapes not in ``tapes``
    and leaves that are not inputs are constants, except the tensors in ``refs``
    (id -> (tensor, reference)): values tracing derived from the inputs without recording
    them as entries (comparisons, detached values). Returns (builder, input slot arrays,
    output slot arrays).
    """
    L = Builder()
    in_slots, by_id, start = [], {}, 0
    for t in inputs:
        shape = np.shape(t._d)
        s = L.inputs(start, shape)
        start += int(np.prod(shape))
        in_slots.append(s)
        by_id[id(t)] = s
    maps = {}

    def resolve(ref):
        """Slots of a traced-value reference: ("s", tape, slot) or ("c", constant)."""
        if ref[0] == "c":
            return L.const(ref[1])
        if ref[0] == "u":
            raise lowering.NotTraceable(
                f"{ref[1]} depends on the traced inputs but cannot be recorded, so the "
                f"program would replay it as a constant; compute it with tapegrad ops, or "
                f"outside the traced function")
        return _scalar(maps[ref[1].sid][ref[2]]) if ref[1].sid in maps else \
            L.const(_value(ref[1], ref[2]))

    for tape in tapes:
        m = maps[tape.sid] = [None] * len(tape.vals)
        aux = tape.aux
        for k in range(len(tape.vals)):
            code, a, b, c0, c1 = tape.entry(k)
            op = OPS[int(code) & ~ARRAY]
            kind, name = op.kind, op.name
            try:
                if name in ("leaf", "const"):
                    t = aux[k][0]
                    s = by_id.get(id(t))
                    if s is None:
                        r = refs.get(id(t)) if refs else None
                        s = resolve(r[1]) if r is not None and r[0] is t else \
                            L.const(_value(tape, k))
                    m[k] = s
                elif name == "import_":
                    src, slot = aux[k]
                    sm = maps.get(src.sid)
                    m[k] = sm[slot] if sm is not None else L.const(_value(tape, k))
                elif name in _PASS:
                    m[k] = m[a]
                elif kind in (UNARY, UNARY_C):
                    m[k] = L.op(name, _scalar(m[a]), c0=c0, c1=c1)
                elif kind == BINARY:
                    m[k] = L.op(name, _scalar(m[a]), _scalar(m[b]))
                elif kind == COMPARE or name == "detach":
                    m[k] = L.op(name, *[resolve(r) for r in aux[k]])
                elif name == "guard":
                    m[k] = _lower_guard(L, resolve(aux[k][0]), aux[k], sites_base)
                elif kind == ARRAY_OP:
                    ins = [m[s] for s in aux[k][0]] if op.nary else \
                        [m[a]] if b < 0 else [m[a], m[b]]
                    ea = aux.get(k)
                    if name == "where" and len(ea) > 1:  # a traced condition
                        ea = (ea[0], np.broadcast_to(resolve(ea[1]), np.shape(ea[0])))
                    out = op.lower(L, [np.asarray(i) for i in ins], ea, _value(tape, k))
                    m[k] = _scalar(np.asarray(out))
                else:
                    raise lowering.NotTraceable(f"op {name!r} cannot be traced")
            except lowering.NotTraceable as e:
                raise NotImplementedError(f"tapegrad.trace: {e} (op '{name}', tape entry "
                                          f"%{k}).") from None
    out_slots = []
    for o in outputs:
        if hasattr(o, "_d"):
            s = by_id.get(id(o))
            r = refs.get(id(o)) if refs else None
            if s is None and r is not None and r[0] is o:
                s = resolve(r[1])
            if s is None and o._tape is not None and o._tape.sid in maps:
                s = maps[o._tape.sid][o._slot]
            out_slots.append(np.asarray(s if s is not None else L.const(o._d)))
        else:
            out_slots.append(np.asarray(L.const(o)))
    return L, in_slots, out_slots


def _lower_guard(L, slots, aux, sites_base):
    """Guard rows for a ``guard`` entry: aux (reference, expected, site[, "value"]). Every
    element of the referenced value keeps its truth value (``expected``: 1.0/0.0 per
    element), or with "value", its value (an ``eq`` row, ``ne(a, a)`` for NaN, and for a
    zero its sign too: ``1 / a > 0``, as Python may tell 0.0 from -0.0)."""
    site = float(sites_base + aux[2])
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    exp = np.broadcast_to(np.asarray(aux[1], dtype=np.float64).reshape(-1), slots.shape)
    checks = []  # (slots, expected truth value), one guard row per slot
    if len(aux) > 3 and aux[3] == "value":
        nan, zero = exp != exp, exp == 0.0
        if nan.any():
            checks.append((L.op("ne", slots[nan], slots[nan]), 1.0))
        if (~nan).any():
            checks.append((L.op("eq", slots[~nan], L.const(exp[~nan])), 1.0))
        if zero.any():
            pos = L.op("gt", L.op("rdivc", slots[zero], c0=1.0), L.const(0.0))
            neg = np.signbit(exp[zero])
            checks += [(pos[~neg], 1.0), (pos[neg], 0.0)]
    else:
        truth = exp != 0.0
        checks += [(slots[truth], 1.0), (slots[~truth], 0.0)]
    g = -1
    for s, e in checks:
        s = np.asarray(s, dtype=np.int64).reshape(-1)
        if s.size:
            g = int(np.asarray(L.op("guard", s, c0=e, c1=site)).reshape(-1)[-1])
    return g


def prune(rows, roots):
    """Keep the rows that ``roots`` (and guard and leaf rows) depend on, renumbered;
    returns (rows, new slot of each old slot, -1 when dropped). Array instructions are kept
    whole (``program_arrays.prune_arrays``)."""
    if _arr.has_arrays(rows):
        return _arr.prune_arrays(rows, roots, GUARD, LEAF)
    return _prune(rows, roots)


def _prune(rows, roots):
    """``prune`` of scalar rows: the marking sweep compiled, the rest NumPy (compiled, its
    ``np.zeros``/``np.full``/``np.empty`` specializations cost 0.4 s of every cold trace)."""
    n = rows.shape[0]
    ops = rows[:, 0]
    need = (ops == GUARD) | (ops == LEAF)
    need[roots] = True
    (_mark_py if n <= MARK_IN_PYTHON else _mark)(rows, need)
    new = np.full(n, -1, dtype=np.int64)
    m = int(np.count_nonzero(need))
    new[need] = np.arange(m)
    out = rows[need]  # a copy, rows in order
    operands = out[:, 1:4]
    used = operands >= 0
    operands[used] = new[operands[used].astype(np.int64)]
    return out, new


#: programs of at most this many rows are marked in Python: 0.2 us a row, where compiling
#: ``_mark`` costs 0.15 s of a cold start (a trace of that many rows took longer)
MARK_IN_PYTHON = 50_000


def _mark_py(rows, need):
    """``_mark`` in Python, on flat lists (row k's operands at 3 k, 3 k + 1, 3 k + 2: a list
    a row made 10,000 lists for the garbage collector to count and run for, a quarter of the
    1k-step pendulum's trace)."""
    operands = rows[:, 1:4].astype(np.int64).ravel().tolist()
    nd = need.tolist()
    for k in range(len(nd) - 1, -1, -1):
        if nd[k]:
            for s in operands[3 * k:3 * k + 3]:
                if s >= 0:
                    nd[s] = True
    need[:] = nd


@njit_cached(nogil=True)
def _mark(rows, need):
    """Mark the operands of needed rows as needed, last row first (an operand's row comes
    before its reader's, so one sweep marks them all)."""
    for k in range(rows.shape[0] - 1, -1, -1):
        if need[k]:
            for c in range(1, 4):
                s = int(rows[k, c])
                if s >= 0:
                    need[s] = True


def _diff_operands():
    """Two (number of opcodes, 3) bool arrays by operand a, b, c of a row: whether it has a
    derivative (the op's scalar rule gives it a gradient: a constant zero counts, as torch's
    sign/floor pass ``0 * g`` and the rule before them multiplies it), and whether that
    gradient is 0.0 whenever the adjoint is, whatever the row's values (``g``, ``-g``,
    ``g if ... else 0.0``: tried at inf, NaN, 0 and +-1), so that a row whose adjoint is
    zero passes only zeros there."""
    global _DIFF
    if _DIFF is None:
        from ..ops import SymF, Sym, rule_of
        d = np.zeros((max(op.code for op in OPS) + 1, 3), dtype=np.bool_)
        safe = np.zeros_like(d)
        for op in OPS:
            if op.vjp is None or op.kind == COMPARE or op.kind == ARRAY_OP:
                continue
            for name, gr in rule_of(op, SymF, Sym).items():
                d[op.code, "abc".index(name)] = True
                safe[op.code, "abc".index(name)] = _zero_at_zero(
                    gr.s if isinstance(gr, Sym) else repr(float(gr)))
        _DIFF = d, safe
    return _DIFF


def _zero_at_zero(expr):
    """Whether the rule's gradient ``expr`` (source text) is 0.0 at ``g = 0`` for every row
    value among inf, -inf, NaN, 0, 1, -1 (at most three values besides ``g``: else no)."""
    import itertools
    import re
    names = sorted(set(re.findall(r"\b(a|b|c|c0|c1|out)\b", expr)))
    if len(names) > 3:
        return False
    code = compile(expr, "<rule>", "eval")
    for vals in itertools.product((math.inf, -math.inf, math.nan, 0.0, 1.0, -1.0),
                                  repeat=len(names)):
        env = dict(zip(names, vals), g=0.0, math=math, np=np)
        try:
            with np.errstate(all="ignore"):
                v = eval(code, env)  # noqa: S307  (the registry's own rule text)
        except Exception:
            return False
        if not v == 0.0:
            return False
    return True


_DIFF = None
DETACH = BY_NAME["detach"].code


def cut_dead(rows, roots, upto=None):
    """Cut the rows whose adjoint nothing differentiable writes off from the rest: such a
    row's adjoint stays 0.0 while the reverse sweep runs its rule anyway, and ``0 * inf``
    there gave NaN to an operand whose gradient torch gives as a number (``exp(x).detach()
    * x`` at x = 1000, the ``x * x`` a max's ties only compare). A row's adjoint is live
    when it is a root or a leaf, or a live row reads it through an operand with a
    derivative (``_diff_operands``); a dead row reads a live operand through a ``detach``
    row inserted before it, whose rule passes nothing, unless its rule passes only zeros
    there (``a - a``: ``g`` and ``-g``, and no NaN came into its adjoint from other dead
    rows). Rows from ``upto`` on are not run backward (a one-sample sweep stops at its last
    output): left as they are. Returns (rows, new slot of each old slot), or (``rows``
    itself, None) when nothing is cut (the usual case: only comparisons, detach, pick
    weights and guards read values without a derivative). Array instructions are cut
    whole (``_cut_arrays``); where that cannot be (a cut in an instruction some of whose
    values are live), the program's expansion is cut instead."""
    n = rows.shape[0]
    if n == 0:
        return rows, None
    if _arr.has_arrays(rows):
        if upto is None:
            got = _cut_arrays(rows, roots)
            if got is not None:
                return got
        # (the scalar rows, slot for slot: a cut there is a cut of the same slots)
        rows = _arr.expand(rows)
        n = rows.shape[0]
        out, new = cut_dead(rows, roots, upto)
        return (out, new) if new is not None else (rows, np.arange(n, dtype=np.int64))
    upto = n if upto is None else int(upto)
    diff, safe = _diff_operands()
    codes = rows[:upto, 0].astype(np.int64)
    diff, safe = diff[codes], safe[codes]
    live = rows[:upto, 0] == LEAF
    roots = np.asarray(roots, dtype=np.int64)
    live[roots[roots < upto]] = True
    cut = np.zeros((upto, 3), dtype=np.bool_)
    (_cuts_py if upto <= MARK_IN_PYTHON else _cuts)(rows[:upto], diff, safe, live, cut)
    if not cut.any():
        return rows, None
    operands = rows[:upto, 1:4].astype(np.int64)
    ks, js = np.nonzero(cut)
    srcs = operands[ks, js]
    # one detach row per cut slot, just before its first dead reader
    uniq, first = np.unique(srcs, return_index=True)
    at = ks[first]  # the reader's row (ks ascending: the first)
    order = np.argsort(at, kind="stable")
    uniq, at = uniq[order], at[order]
    # new index of old row k: k + the detaches inserted at or before it
    shift = np.searchsorted(at, np.arange(n), side="right")
    new = np.arange(n, dtype=np.int64) + shift
    det_new = at + np.arange(at.size)  # each detach's index: just before its reader
    out = np.empty((n + at.size, NCOL), dtype=np.float64)
    out[new] = rows
    o = out[new, 1:4]
    used = o >= 0
    o[used] = new[o[used].astype(np.int64)]
    det_of = np.full(n, -1, dtype=np.int64)
    det_of[uniq] = det_new
    o[ks, js] = det_of[srcs]
    out[new, 1:4] = o
    out[det_new] = 0.0
    out[det_new, 0] = DETACH
    out[det_new, 1] = new[uniq]
    out[det_new, 2:4] = -1.0
    return out, new


def _cut_arrays(rows, roots):
    """``cut_dead`` of a program with array instructions. Liveness is per instruction, as
    torch's is per op: an instruction with a live value is live whole (its rule runs for
    every element, as torch's whole op's does: 0 * inf there is torch's NaN too), so every
    slot it reads is live; a dead one (no live value: read only by comparisons, detach,
    guards) reads each operand it is cut from through a detach instruction over the slots
    that operand reads (its stride then 1; a reduction's grid through one over the span it
    reads, its strides kept), placed just before it. Returns (rows, new slot of each old
    slot), (``rows``, None) when nothing is cut, or None where a detach's slots would fall
    inside a span another instruction reads evenly spaced (the caller cuts the expansion
    then)."""
    at, nslots = _arr.row_slots(rows)
    nr = rows.shape[0]
    heads = _arr.heads_of(rows)
    kind = np.zeros(nr, dtype=np.int64)  # 0 a scalar row, 1 elementwise, 2 reduction, -1
    red = rows[heads, 0] == _arr.RED
    kind[heads] = np.where(red, 2, 1)
    for j in range(1, _arr.META + 1):
        kind[heads + j] = -1
    size = np.ones(nr, dtype=np.int64)
    size[heads] = _arr._sizes(rows, heads)
    nval = np.ones(nr, dtype=np.int64)
    nval[heads] = rows[heads + 1, 4].astype(np.int64)
    # by row: each operand's (first slot or -1, stride per value, stride per term)
    geo = np.zeros((nr, 3, 3), dtype=np.int64)
    geo[:, :, 0] = rows[:, 1:4]
    geo[heads, 0, 1] = rows[heads + 2, 4]
    geo[heads, 1, 1] = rows[heads + 2, 5]
    geo[heads, 2, 1] = np.where(red, 0, rows[heads + 3, 4])
    geo[heads, 2, 0] = np.where(red, -1, geo[heads, 2, 0])
    geo[heads, 0, 2] = np.where(red, rows[heads, 5], 0)
    geo[heads, 1, 2] = np.where(red, rows[heads + 3, 4], 0)
    terms = np.ones(nr, dtype=np.int64)
    terms[heads] = np.where(red, rows[heads, 4], 1).astype(np.int64)
    diff, safe = _diff_operands()
    code = rows[:, 0].astype(np.int64)
    code[heads] = rows[heads + 1, 5].astype(np.int64)
    code[kind < 0] = 0
    d, sf = diff[code], safe[code]
    # a reduction's terms: mul's operands (a sum of products), or the step's either operand
    # (the chain's running value on one side, a term on the other)
    rh = heads[red & (code[heads] != _arr.MUL)]
    d[rh, 0] = diff[code[rh], 0] | diff[code[rh], 1]
    sf[rh, 0] = safe[code[rh], 0] & safe[code[rh], 1]
    d[rh, 1:] = False
    live = np.zeros(nslots, dtype=np.bool_)
    live[at[(kind == 0) & (code == LEAF)]] = True
    for h in heads[(~red) & (code[heads] == LEAF)].tolist():
        live[at[h]:at[h] + nval[h]] = True
    roots = np.asarray(roots, dtype=np.int64)
    live[roots] = True
    cut = np.zeros((nr, 3), dtype=np.bool_)
    _array_cuts(rows, at, kind, size, nval, geo, terms, d, sf, live, cut)
    if not cut.any():
        return rows, None
    return _insert_detaches(rows, at, nslots, kind, nval, geo, terms, cut)


#: where an elementwise instruction keeps operand a's, b's and c's stride: (row after its
#: first, column)
_STRIDE_AT = ((2, 4), (2, 5), (3, 4))


def _insert_detaches(rows, at, nslots, kind, nval, geo, terms, cut):
    """The rows of ``_cut_arrays`` with the cut operands read through detach rows: one per
    operand read (the same slots read twice share theirs), just before its first reader,
    or before an earlier row where that is inside a span of slots an instruction reads."""
    specs = {}  # (first slot, stride, count) -> index; its first reader's row
    uses = []   # (row, operand, spec, the operand's new first slot from the detach's)
    for r, j in zip(*[x.tolist() for x in np.nonzero(cut)]):
        s0, per, per_t = (int(x) for x in geo[r, j])
        if kind[r] == 0:
            key, off = (int(rows[r, 1 + j]), 0, 1), 0
        elif kind[r] == 1:
            key, off = (s0, per, int(nval[r])) if per else (s0, 0, 1), 0
        else:  # the span of a reduction's grid, its strides kept
            m, L = int(nval[r]), int(terms[r])
            lo = s0 + min(0, (m - 1) * per) + min(0, (L - 1) * per_t)
            hi = s0 + max(0, (m - 1) * per) + max(0, (L - 1) * per_t)
            key, off = (lo, 1 if hi > lo else 0, hi - lo + 1), s0 - lo
        if key not in specs:
            specs[key] = (len(specs), r)
        uses.append((r, j, specs[key][0], off))
    keys = sorted(specs, key=lambda k: specs[k][0])
    reader = np.array([specs[k][1] for k in keys], dtype=np.int64)
    count = np.array([k[2] for k in keys], dtype=np.int64)
    src_hi = np.array([max(k[0], k[0] + (k[2] - 1) * k[1]) for k in keys], dtype=np.int64)
    # every span read evenly spaced must shift as a whole: nothing inserted inside it (at a
    # slot in (lo, hi]); the detaches' own sources too
    spans = [(min(k[0], k[0] + (k[2] - 1) * k[1]), max(k[0], k[0] + (k[2] - 1) * k[1]))
             for k in keys]
    for r in np.nonzero(kind > 0)[0].tolist():
        for j in range(3):
            s0, per, per_t = (int(x) for x in geo[r, j])
            if s0 < 0:
                continue
            m, L = int(nval[r]), int(terms[r])
            spans.append((s0 + min(0, (m - 1) * per) + min(0, (L - 1) * per_t),
                          s0 + max(0, (m - 1) * per) + max(0, (L - 1) * per_t)))
    lo, hi = np.array(spans, dtype=np.int64).reshape(-1, 2).T
    wide = hi > lo
    lo, hi = lo[wide] + 1, hi[wide]  # the slots nothing may be inserted at
    o = np.argsort(lo, kind="stable")
    lo, hi = lo[o], np.maximum.accumulate(hi[o]) if len(o) else hi
    # merged: an interval starts where no earlier one reaches
    starts = np.ones(len(lo), dtype=np.bool_)
    starts[1:] = lo[1:] > hi[:-1] + 1
    idx = np.nonzero(starts)[0]
    f_lo = lo[idx]
    f_hi = np.maximum.reduceat(hi, idx) if len(idx) else hi
    row_start = at[kind >= 0]  # the slots a detach can go before (a row's first)
    rows_at = np.nonzero(kind >= 0)[0]
    place = np.empty(len(keys), dtype=np.int64)  # the slot each detach goes before
    for q_i in range(len(keys)):
        q = int(at[reader[q_i]])  # just before its first reader, or earlier
        while True:
            i = int(np.searchsorted(f_lo, q, side="right")) - 1
            if i < 0 or q > f_hi[i]:
                break
            j = int(np.searchsorted(row_start, f_lo[i], side="left")) - 1
            q = int(row_start[j]) if j >= 0 else -1  # the row before the span's
        if q <= src_hi[q_i]:
            return None
        place[q_i] = q
    order = np.argsort(place, kind="stable")
    p = place[order]
    ends = np.cumsum(count[order])
    cum = np.concatenate([[0], ends])
    # new slot of old slot s: s + the slots inserted at or before it (a cumulative sum: a
    # search per slot took 1 s of gmm's gradient program, 17 million slots)
    new = np.zeros(nslots, dtype=np.int64)
    np.add.at(new, p, count[order])
    np.cumsum(new, out=new)
    new += np.arange(nslots, dtype=np.int64)
    start = np.empty(len(keys), dtype=np.int64)
    start[order] = p + cum[:-1]
    # the rows: each detach's before its reader's
    blocks = []
    for q, (s0, per, m) in enumerate(keys):
        src = float(new[s0])
        if m == 1:
            b = np.array([[DETACH, src, -1, -1, 0.0, 0.0]])
        else:
            b = np.array([[_arr.ARR, src, -1, -1, 0.0, 0.0],
                          [_arr.TAIL, -1, -1, -1, m, DETACH],
                          [_arr.TAIL, -1, -1, -1, per, 0.0],
                          [_arr.TAIL, -1, -1, -1, 0.0, 0.0]])
        blocks.append(b)
    out = rows.copy()
    o = out[:, 1:4]
    used = (o >= 0) & (kind >= 0)[:, None]
    o[used] = new[o[used].astype(np.int64)]
    for r, j, q, off in uses:
        out[r, 1 + j] = start[q] + off
        if kind[r] == 1 and geo[r, j, 1] != 0:  # (the detach's slots are contiguous)
            out[r + _STRIDE_AT[j][0], _STRIDE_AT[j][1]] = 1.0
    parts, prev = [], 0
    for q in order.tolist():
        r = int(rows_at[np.searchsorted(row_start, place[q])])
        parts.append(out[prev:r])
        parts.append(blocks[q])
        prev = r
    parts.append(out[prev:])
    return np.concatenate(parts), new


@njit_cached(nogil=True)
def _array_cuts(rows, at, kind, size, nval, geo, terms, d, sf, live, cut):
    """``_cuts`` over rows and instructions (``kind``: 0 a scalar row, 1 elementwise, 2 a
    reduction, whose values are its chains' outputs, its last ``nval`` slots; -1 the rows
    after an instruction's first); ``d``, ``sf``: by row and operand, whether it has a
    derivative and whether its rule passes zeros at a zero adjoint. An instruction with a
    live value is live whole; a dead one is cut from an operand whole."""
    nr = rows.shape[0]
    for r in range(nr - 1, -1, -1):
        if kind[r] < 0:
            continue
        k = at[r]
        if kind[r] == 0:
            if live[k]:
                for j in range(3):
                    s = int(rows[r, 1 + j])
                    if s >= 0 and d[r, j]:
                        live[s] = True
            continue
        m = nval[r]
        base = k + size[r] - m
        any_live = False
        for i in range(m):
            any_live = any_live or live[base + i]
        if not any_live:
            continue
        # live whole, as torch's op is in the graph whole: its rule runs for every element
        # (0 * inf there gives torch's NaN too), so every slot it reads is live
        for i in range(m):
            live[base + i] = True
            for j in range(3):
                s0 = geo[r, j, 0]
                if s0 >= 0 and d[r, j]:
                    for t in range(terms[r]):
                        live[s0 + i * geo[r, j, 1] + t * geo[r, j, 2]] = True
    bad = np.zeros(live.shape[0], dtype=np.bool_)  # dead adjoints that may hold NaN
    for r in range(nr - 1, -1, -1):
        if kind[r] < 0:
            continue
        k = at[r]
        if kind[r] == 0:
            if not live[k]:
                for j in range(3):
                    s = int(rows[r, 1 + j])
                    if s >= 0 and d[r, j] and (bad[k] or not sf[r, j]):
                        if live[s]:
                            cut[r, j] = True
                        else:
                            bad[s] = True
            continue
        m = nval[r]
        base = k + size[r] - m
        if live[base]:  # (live whole)
            continue
        for j in range(3):
            s0 = geo[r, j, 0]
            if s0 < 0 or not d[r, j]:
                continue
            need = False
            for i in range(m):
                if bad[base + i] or not sf[r, j]:
                    for t in range(terms[r]):
                        need = need or live[s0 + i * geo[r, j, 1] + t * geo[r, j, 2]]
            if need:
                cut[r, j] = True
                continue
            for i in range(m):
                if bad[base + i] or not sf[r, j]:
                    for t in range(terms[r]):
                        bad[s0 + i * geo[r, j, 1] + t * geo[r, j, 2]] = True


def prune_live(rows, roots):
    """``prune`` then ``cut_dead``: (rows, new slot of each old slot, -1 when dropped)."""
    pruned, new = prune(rows, roots)
    if _arr.has_arrays(pruned) and _arr.coverage(pruned) < _arr.MIN_COVER:
        # mostly scalar rows: ``_Code`` runs their expansion (the same slots), so cut that
        pruned = _arr.expand(pruned)
    out, cut = cut_dead(pruned, new[roots])
    if cut is None:
        return pruned, new
    kept = new >= 0
    new[kept] = cut[new[kept]]  # (in place: gmm's gradient program has 17 million slots)
    return out, new


def _cuts_py(rows, diff, safe, live, cut):
    """``_cuts`` in Python, on flat lists (as ``_mark_py``)."""
    operands = rows[:, 1:4].astype(np.int64).ravel().tolist()
    d, sf = diff.ravel().tolist(), safe.ravel().tolist()
    lv = live.tolist()
    for k in range(len(lv) - 1, -1, -1):
        if lv[k]:
            for i in range(3 * k, 3 * k + 3):
                if d[i] and operands[i] >= 0:
                    lv[operands[i]] = True
    bad = [False] * len(lv)  # dead adjoints that may hold NaN
    cuts = []
    for k in range(len(lv) - 1, -1, -1):
        if not lv[k]:
            bk = bad[k]
            for j in range(3):
                i = 3 * k + j
                s = operands[i]
                if d[i] and s >= 0 and (bk or not sf[i]):
                    if lv[s]:
                        cuts.append((k, j))
                    else:
                        bad[s] = True
    live[:] = lv
    for k, j in cuts:
        cut[k, j] = True


@njit_cached(nogil=True)
def _cuts(rows, diff, safe, live, cut):
    """Mark live the operands that live rows read through an operand with a derivative,
    last row first; then ``cut`` the operands through which a dead row's rule may pass a
    nonzero (NaN) into a live adjoint: its rule at a zero adjoint (not ``safe``), or
    any, when a dead reader's rule may have put NaN into its adjoint."""
    n = rows.shape[0]
    for k in range(n - 1, -1, -1):
        if live[k]:
            for j in range(3):
                s = int(rows[k, 1 + j])
                if diff[k, j] and s >= 0:
                    live[s] = True
    bad = np.zeros(n, dtype=np.bool_)
    for k in range(n - 1, -1, -1):
        if not live[k]:
            for j in range(3):
                s = int(rows[k, 1 + j])
                if diff[k, j] and s >= 0 and (bad[k] or not safe[k, j]):
                    if live[s]:
                        cut[k, j] = True
                    else:
                        bad[s] = True


# --- re-recording the reverse sweep as rows -------------------------------------------------


class _R:
    """A program value under construction (its slot), with Python's operators emitting rows."""

    __slots__ = ("s", "L")

    def __init__(self, L, s):
        self.L, self.s = L, s

    def _em(self, name, *args, c0=0.0):
        return _R(self.L, self.L.op(name, *args, c0=c0))

    def _slot(self, x):
        return x.s if isinstance(x, _R) else self.L.const(float(x))

    def __add__(self, o):
        return self._em("add", self.s, o.s) if isinstance(o, _R) else \
            self._em("addc", self.s, c0=float(o))

    def __radd__(self, o):
        return self._em("addc", self.s, c0=float(o))

    def __sub__(self, o):
        return self._em("sub", self.s, o.s) if isinstance(o, _R) else \
            self._em("sub", self.s, self._slot(o))

    def __rsub__(self, o):
        return self._em("rsubc", self.s, c0=float(o))

    def __mul__(self, o):
        return self._em("mul", self.s, o.s) if isinstance(o, _R) else \
            self._em("mulc", self.s, c0=float(o))

    __rmul__ = __mul__

    def __truediv__(self, o):
        return self._em("div", self.s, o.s) if isinstance(o, _R) else \
            self._em("divc", self.s, c0=float(o))

    def __rtruediv__(self, o):
        return self._em("rdivc", self.s, c0=float(o))

    def __pow__(self, o):
        if isinstance(o, _R):
            return self._em("pow", self.s, o.s)
        if float(o) == 1.0:
            # x itself: pow(x, 1.0) is x for every double, and its rule passes g * 1.0 *
            # x ** 0.0, g itself. Eager mode records it so that x ** 2's derivatives stay a
            # graph as torch's do (its third is 0, not an error); a program has no such
            # error, and the row cost Rosenbrock's derivative programs 297 rows of 1,783
            return self
        return self._em("powc", self.s, c0=float(o))

    def __rpow__(self, o):
        return self._em("rpowc", self.s, c0=float(o))

    def __neg__(self):
        return self._em("neg", self.s)

    def _cmp(name):
        def f(self, o):
            return self._em(name, self.s, self._slot(o))
        return f

    __lt__, __le__, __gt__ = _cmp("lt"), _cmp("le"), _cmp("gt")
    __ge__, __eq__, __ne__ = _cmp("ge"), _cmp("eq"), _cmp("ne")
    __and__ = __rand__ = _cmp("logical_and")
    __or__ = __ror__ = _cmp("logical_or")
    del _cmp
    __hash__ = None

    def __invert__(self):
        return self._em("logical_not", self.s)


class RowF:
    """The rule backend that emits rows: ``vjp(RowF(L), ...)`` re-records a rule."""

    def __init__(self, L):
        self.L = L

    def _wrap(self, x):
        return x if isinstance(x, _R) else _R(self.L, self.L.const(float(x)))

    def where(self, c, x, y):
        if not isinstance(c, _R):
            return x if c else y
        return _R(self.L, self.L.op("select", c.s, self._wrap(x).s, self._wrap(y).s))

    def cond(self, c, x, y):
        if not isinstance(c, _R):
            return x() if c else y()
        return self.where(c, x(), y())

    def zeros_like(self, x):
        return 0.0

    def __getattr__(self, name):
        op = BY_NAME[name]
        L = self.L

        def call(*args):
            if op.kind == UNARY_C:
                x, c0, c1 = args
                if not isinstance(x, _R):
                    return op.py(float(x), c0, c1)
                return _R(L, L.op(name, x.s, c0=c0, c1=c1))
            if not any(isinstance(x, _R) for x in args):
                return op.py(*[float(x) for x in args])
            return _R(L, L.op(name, *[self._wrap(x).s for x in args]))
        return call


def rule_rows(L, F, op, g, row, k):
    """[(input slot, gradient (_R or float))] of row ``k`` (``row``: its 6 numbers) for
    adjoint ``g``, re-recorded through ``F`` (a slot read twice appears twice)."""
    code, a, b, c, c0, c1 = row
    a, b, c = int(a), int(b), int(c)
    R = lambda s: _R(L, s)  # noqa: E731
    out = R(k)
    grads = call_rule(op, F, g, out, R(a), R(b) if b >= 0 else None, float(c0), float(c1),
                      R(c) if c >= 0 else None)
    slots = {"a": a, "b": b, "c": c}
    return [(slots[n], gr) for n, gr in zip(rule_inputs(op), grads) if gr is not None]


def grad_rows(rows, out_slots, seeds, in_slots, min_run=None):
    """Rows computing, after ``rows``, the gradient of ``sum(seeds * outputs)`` with respect
    to the values at ``in_slots``; ``seeds`` are slots (or floats). Returns (builder, grad
    slots). The builder starts with ``rows`` unchanged, so old slots keep their meaning. An
    array instruction's rule is re-recorded once over its ranges of slots (so the gradient
    of an array program is array instructions too)."""
    L = Builder(min_run)
    L._blocks.append(np.array(rows, dtype=np.float64))
    at, L.n = _arr.row_slots(rows)
    L.arrays = _arr.has_arrays(rows)
    L._act = _active(L, in_slots)
    for r in np.nonzero(rows[:, 0] == CONST)[0].tolist():
        L._consts.setdefault(struct.pack("d", float(rows[r, 4])), int(at[r]))
    F = RowF(L)
    adj = np.full(L.n, -1, dtype=np.int64)  # each slot's adjoint's slot
    for s, seed in zip(out_slots, seeds):
        _accumulate(L, adj, int(s), seed if not isinstance(seed, int) else _R(L, seed))
    r = rows.shape[0] - 1
    # broadcast operands' sums not recorded yet (``_accumulate_range``), until the walk
    # reaches the rows that compute them (their slots: at most ``_bsums_top``)
    L._bsums, L._bsums_top = [], -1
    while r >= 0:
        if rows[r, 0] == _arr.TAIL:  # an array instruction's last row
            r -= _arr.META
            k = int(at[r])
            if L._bsums and k <= L._bsums_top:
                _flush_sums(L, adj)  # (its values' adjoints may be among them)
            if rows[r, 0] == _arr.RED:
                _red_rule(L, F, adj, rows, r, k)
            else:
                _array_rule(L, F, adj, rows, r, k)
            r -= 1
            continue
        k = int(at[r])
        if L._bsums and k <= L._bsums_top:
            _flush_sums(L, adj)
        g = adj[k]
        op = OPS[int(rows[r, 0])]
        row = rows[r]
        r -= 1
        if g < 0 or op.vjp is None or op.kind == COMPARE or op.name in ("leaf", "const"):
            continue
        for s, gr in rule_rows(L, F, op, _R(L, int(g)), row, k):
            _accumulate(L, adj, s, gr)
    _flush_sums(L, adj)
    del L._bsums
    grads = []
    for s in in_slots:
        g = adj[int(s)]
        grads.append(int(g) if g >= 0 else L.const(0.0))
    return L, grads


def _active(L, in_slots):
    """By slot, whether its value depends on an input through a gradient
    (``program_arrays.mark_inactive``), for an array program whose ``in_slots`` all do
    (inputs are): an adjoint elsewhere reaches none of them, so the rules' gradients for
    those slots are not recorded (``_accumulate``: kmeans' points, constants that its 80
    ``x - c`` broadcast over the centroids, got 71 adds of 1,000 gradients, which the
    spans of the sums around them kept in the gradient program). None otherwise: every
    gradient recorded, as for scalar rows."""
    if not L.arrays:
        return None
    try:
        act = _arr.mark_inactive(L._blocks[0], L.n, _arr.GRAD_BITS, LEAF)
    except ValueError:  # (an extreme's reduction with a gradient: the rules raise)
        return None
    ins = np.asarray(in_slots, dtype=np.int64)
    return act if act[ins].all() else None


def _squared(op, ins):
    """Whether an array instruction of ``op`` over operand slots ``ins`` is ``x * x``."""
    return (op.name == "mul" and ins[0] is not None and ins[1] is not None
            and np.array_equal(ins[0], ins[1]))


def _array_rule(L, F, adj, rows, r, k):
    """Re-record the rule of the array instruction at row ``r`` (slots ``k ..``) over its
    ranges of slots."""
    n, code, strides = _arr.info(rows, r)
    op = OPS[code]
    gs = adj[k:k + n]
    if (gs < 0).all() or op.vjp is None or op.kind == COMPARE:
        return
    if (gs < 0).any():
        gs = np.where(gs < 0, L.const(0.0), gs)
    i = np.arange(n, dtype=np.int64)
    ins = [int(rows[r, 1 + j]) + i * strides[j] if rows[r, 1 + j] >= 0 else None
           for j in range(3)]
    R = lambda s: None if s is None else _R(L, s)  # noqa: E731
    if _squared(op, ins):
        # ``x * x``: its rule's ``g * b`` and ``g * a`` are the same numbers, recorded once
        # and added twice (the same bits; kmeans' ``diff * diff``: 80,000 products and
        # their rules saved in its Hessian-vector program)
        t = _R(L, gs.copy()) * R(ins[1])
        if strides[0] != 0 and (adj[ins[0]] < 0).all():
            # (the operand's first gradients: ``t + t`` is ``2 t`` to the bit, and its rule
            # passes ``2 g``, what ``0 + g + g`` gives: one pass of the adds less)
            _accumulate_range(L, adj, ins[0], t * 2.0)
            return
        grads = (t, t)
    elif op.name == "sub" and ins[1] is not None and strides[1] == 0 and n > 1:
        # ``x - c`` of a broadcast ``c``: its gradient, the sum of the ``-g``, recorded as
        # ``-(sum of g)``, the same number (rounding is symmetric in sign), without the
        # ``n`` negations (kmeans' 80 ``x - c`` of 1,000 points: 80,000 in its
        # Hessian-vector program, their rules and their adjoints' zeroing)
        g = _R(L, gs.copy())
        if ins[0] is not None:
            _accumulate_range(L, adj, ins[0], g)
        _accumulate_range(L, adj, ins[1], g, negate=True)
        return
    else:
        grads = call_rule(op, F, _R(L, gs.copy()), _R(L, np.arange(k, k + n, dtype=np.int64)),
                          R(ins[0]), R(ins[1]), float(rows[r, 4]), float(rows[r, 5]),
                          R(ins[2]))
    slots = {"a": ins[0], "b": ins[1], "c": ins[2]}
    for name, gr in zip(rule_inputs(op), grads):
        if gr is not None:
            _accumulate_range(L, adj, slots[name], gr)


def _red_rule(L, F, adj, rows, r, k):
    """Re-record the rule of the reduction instruction at row ``r`` (chains from slot ``k``):
    add's passes each output's adjoint to every term, mul's gives a product's operands
    ``g * b`` and ``g * a``; where an operand's slots are every output's (a matmul's row,
    read by each of its columns) their gradients are summed by reductions again."""
    n, L_ = int(rows[r + 1, 4]), int(rows[r, 4])
    step = int(rows[r + 1, 5])
    gs = adj[_arr.red_outputs(k, n, step, L_)]
    if (gs < 0).all():
        return
    if (gs < 0).any():
        gs = np.where(gs < 0, L.const(0.0), gs)
    A, B = _arr.red_grids(rows, r)
    if step in (_arr.MAX, _arr.MIN):
        # the extremes of detached values: their gradient would stop at the detach rows
        # (``Builder.reduce_terms`` makes them of nothing else; checked here again)
        at = _arr.row_slots(rows)[0]
        src = np.searchsorted(at, np.unique(A), side="right") - 1
        head = rows[src, 0]
        code = np.where((head == _arr.ARR) | (head == _arr.RED),
                        rows[np.minimum(src + 1, rows.shape[0] - 1), 5], head)
        # (values of detach rows, or extremes of them: a first level's partial results)
        ok = (code == _CODE["detach"]) | ((head == _arr.RED) & (code == step))
        if not ok.all():
            raise AssertionError("a reduction to an extreme of values that are not detached")
        return
    G = np.broadcast_to(gs[:, None], A.shape)
    if B is None:  # add's rule: g to each term
        _accumulate_terms(L, adj, A, G, None)
        return
    _accumulate_terms(L, adj, A, G, B)
    _accumulate_terms(L, adj, B, G, A)


def _accumulate_terms(L, adj, S, G, V):
    """Add ``G * V`` (mul's rule for ``a``, ``g * b``; ``G`` alone without ``V``) to the
    adjoints of the slot grid ``S`` (n, L), elementwise where its slots are distinct, as a
    sum over the grid's rows or columns where they repeat along one axis, else per slot."""
    n, m = S.shape
    flat = S.reshape(-1)
    if _distinct(S):
        # the long axis last: its elements are one instruction's run (kmeans' sums of 8
        # terms over 10,000 outputs, term by term: runs of 8, scalar rows)
        if n > m:
            S, G, V = S.T, G.T, None if V is None else V.T
        vals = G if V is None else _mul_rule(L, G, V)
        _accumulate_range(L, adj, S.reshape(-1), _R(L, np.asarray(vals).reshape(-1)))
        return
    for ax in (0, 1):
        first = S.take([0], axis=ax)
        if (S == first).all() and np.unique(first).size == first.size:
            # every row (column) the same slots: each gets its column's (row's) sum
            Gt, Vt = (G.T, None if V is None else V.T) if ax == 0 else (G, V)
            s = L.reduce_terms(Gt, Vt) if Gt.shape[-1] > 1 else None
            if s is None:
                P = Gt if Vt is None else _mul_rule(L, Gt, Vt)
                from ..ops.lowering import reduce
                s = reduce(L, "add", P, (1,), False, 0.0)
            _accumulate_range(L, adj, first.reshape(-1), _R(L, np.asarray(s).reshape(-1)))
            return
    vals = G if V is None else _mul_rule(L, G, V)
    order = np.argsort(flat, kind="stable")
    fs, vs = flat[order], np.asarray(vals).reshape(-1)[order]
    cuts = np.flatnonzero(np.diff(fs)) + 1
    for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, fs.size].tolist()):
        if b - a == 1:
            _accumulate(L, adj, int(fs[a]), _R(L, int(vs[a])))
        else:
            from ..ops.lowering import reduce
            _accumulate(L, adj, int(fs[a]),
                        _R(L, int(np.asarray(reduce(L, "add", vs[a:b], None, False, 0.0)))))


def _distinct(S):
    """Whether the slot grid ``S`` (n, m) holds no slot twice: by its strides when it is
    affine (gmm's Hessian-vector program: ``np.unique`` of its 789 grids took 0.7 s)."""
    n, m = S.shape
    if S.size == 0:
        return True
    si = int(S[1, 0] - S[0, 0]) if n > 1 else 0
    sj = int(S[0, 1] - S[0, 0]) if m > 1 else 0
    if (S == S[0, 0] + si * np.arange(n)[:, None] + sj * np.arange(m)[None, :]).all():
        from .program_arrays import _injective
        return _injective((abs(si), abs(sj)), (n, m))
    return np.unique(S).size == S.size


def _mul_rule(L, G, V):
    """mul's rule for its ``a``, ``g * b``, over the slot grids ``G``, ``V`` (the rules of a
    reduction's steps are add's and mul's: ``_codegen_arrays._red_exprs`` checks them)."""
    return L.op("mul", G, V)


def _accumulate_range(L, adj, slots, g, negate=False):
    """Add gradients ``g`` (an _R over the elements, or a float) to the adjoints of
    ``slots`` (distinct, or one slot repeated: a broadcast scalar, which gets their sum);
    ``-g`` when ``negate`` (a broadcast scalar's: the sum's negation)."""
    if not isinstance(g, _R):
        if g == 0.0 and not math.isnan(g):
            return
        g = _R(L, L.const(float(g)))
    act = getattr(L, "_act", None)
    if act is not None and not act[slots].any():
        return  # (no input's gradient: ``_active``)
    if negate and slots[0] != slots[-1]:
        g, negate = -g, False
    gv = np.broadcast_to(np.asarray(g.s, dtype=np.int64), slots.shape)
    if slots[0] == slots[-1]:  # stride 0: every element's gradient goes to one slot
        if getattr(L, "_bsums", None) is not None:
            L._bsums.append((int(slots[0]), gv, negate))
            L._bsums_top = max(L._bsums_top, int(slots[0]))
            return
        from ..ops.lowering import reduce
        total = _R(L, int(np.asarray(reduce(L, "add", gv, None, False, 0.0))))
        _accumulate(L, adj, int(slots[0]), -total if negate else total)
        return
    prev = adj[slots]
    if (prev < 0).all():
        adj[slots] = gv
        return
    if (prev < 0).any():
        prev = np.where(prev < 0, L.const(0.0), prev)
    adj[slots] = L.op("add", prev, gv)


def _flush_sums(L, adj):
    """Record the pending sums of broadcast operands' gradients (``_accumulate_range``),
    those of one length as one reduction over their rows, and add them to the adjoints in
    the order they came: a run of instructions broadcasting scalars (kmeans' 80 ``x - c``
    of 1,000 points, one per centroid's coordinate) gets its rules' elementwise
    instructions in a run and their sums after them, where each rule's own sum between
    them made the driver alternate between short stretches and sums (kmeans' `hvp`)."""
    pending, L._bsums = L._bsums, None
    from ..ops.lowering import reduce
    sums = [None] * len(pending)
    by_len = {}
    for i, (_, gv, _) in enumerate(pending):
        by_len.setdefault(gv.shape[0], []).append(i)
    for idx in by_len.values():
        G = np.stack([pending[i][1] for i in idx])
        out = np.asarray(reduce(L, "add", G, (1,), False, 0.0)).reshape(-1)
        for i, o in zip(idx, out.tolist()):
            sums[i] = o
    neg = [i for i, p in enumerate(pending) if p[2]]  # (``x - c``'s: negated, one op)
    if neg:
        negs = np.asarray(L.op("neg", np.array([sums[i] for i in neg], dtype=np.int64)))
        for i, o in zip(neg, negs.reshape(-1).tolist()):
            sums[i] = o
    for (s, _, _), o in zip(pending, sums):
        _accumulate(L, adj, s, _R(L, int(o)))
    L._bsums, L._bsums_top = [], -1


def _accumulate(L, adj, s, g):
    act = getattr(L, "_act", None)
    if act is not None and not act[s]:
        return  # (no input's gradient: ``_active``)
    if not isinstance(g, _R):
        if g == 0.0 and not math.isnan(g):
            return
        g = _R(L, L.const(float(g)))
    prev = adj[s]
    adj[s] = g.s if prev < 0 else L.op("add", int(prev), g.s)
