"""Array instructions of traced programs: an elementwise op over ranges of slots kept as one
instruction, so that tracing and replay cost per op, not per element.

An array instruction of op ``f`` and length ``n`` computes the ``n`` slots ``k .. k + n -
1``: ``v[k + i] = f(v[a + i * sa], v[b + i * sb], v[c + i * sc]; c0, c1)``, exactly the
scalar rows it stands for (``expand`` writes them out, slot for slot). It takes four rows:
``(array_ew, a, b, c, c0, c1)``, then three ``(array_tail, -1, -1, -1, ., .)`` rows holding
``(n, opcode of f)``, ``(sa, sb)`` and ``(sc, inactive)`` in their constant columns. A
scalar row computes one slot, so a row's slot is the number of slots before it
(``row_slots``): in a program without array instructions, its index. The array
interpreters (``_generated_arrays.py``) run an instruction as a loop; every other
interpreter (batches, Jacobians, CUDA) runs the expansion.

A reduction instruction sums each of ``n`` runs of ``L`` terms into one slot, in order (a
chain of ``add`` rows; or ``maximum``, ``minimum`` rows, of detached values only, with no
gradient), or sums their products with the terms of a second operand (``mul``
and ``add`` rows, a matmul's or a dot product's): term ``t`` of output ``i`` is
``v[a + i * sa + t * ta]`` (and ``v[b + i * sb + t * tb]``). Its rows are
``(array_red, a, b, -1, L, ta)``, then ``(n, add or mul)``, ``(sa, sb)``, ``(tb,
inactive)``. Its expansion is the chains, ``W`` slots each (``red_width``: ``L - 1`` adds, or
``L`` products and ``L - 1`` adds), the chains' outputs last, contiguous, at ``k + n * (W - 1)
+ i``; the array interpreter keeps those numbers (so the slots mean the same in both forms) but
writes and reads only the outputs, never the chains' other slots: it keeps no products nor
partial sums.
"""
from __future__ import annotations

import contextlib

import numba
import numpy as np

from .._jit import njit_cached
from . import replay_cpu as _cpu
from ..ops import BINARY, BY_NAME, COMPARE, OPS, UNARY_C, Op

NCOL = 6
ARR = BY_NAME["array_ew"].code
TAIL = BY_NAME["array_tail"].code
RED = BY_NAME["array_red"].code
LEAF = BY_NAME["leaf"].code
CONST = BY_NAME["const"].code
ADD = BY_NAME["add"].code
MUL = BY_NAME["mul"].code
MAX = BY_NAME["maximum"].code
MIN = BY_NAME["minimum"].code
#: the shortest run of elements made one instruction (shorter runs stay scalar rows; at
#: least 4, an instruction's own rows). Set it to a huge number to trace scalar rows only
MIN_RUN = 16
#: the least share of a program's slots its array instructions must compute for it to run
#: them; below it the program runs its expansion. The array interpreter runs a program's
#: scalar rows slower than the scalar one (its ops outside ``LOOPED`` go through one shared
#: loop): bundle adjustment's vjp program, 37% in instructions, took 916 us against 364 as
#: scalar rows, Rosenbrock's Hessian-vector program (10%) 35 us against 13; lse (95%), gmm
#: (99.7%) and ode (99.2%) run 1.5 to 2x faster as instructions. 0: any instruction counts
MIN_COVER = 0.75
META = 3  # rows after an instruction's first


def _arrayable():
    from ._codegen_emit import _replay_ops
    return frozenset(op.name for op in _replay_ops())


ARRAYABLE = _arrayable()


def runs(flat, min_run):
    """The runs ``(start, stop, strides)`` of the elements ``0 .. m - 1`` where every slot
    array in ``flat`` (nin, m) is affine in the element (``stop`` exclusive), greedily from
    the first element; None when the runs would be shorter than ``min_run`` on average (the
    op is then scalar rows, without a Python loop over its runs)."""
    m = flat.shape[1]
    if m < min_run:
        return None
    D = np.diff(flat, axis=1)
    chg = np.nonzero(np.any(D[:, 1:] != D[:, :-1], axis=0))[0]
    if len(chg) * min_run > 2 * m:
        return None
    out, s = [], 0
    for p in chg.tolist():
        if p < s:  # a change inside a run already closed
            continue
        out.append((s, p + 2, D[:, s].tolist()))
        s = p + 2
    if s < m:
        out.append((s, m, D[:, s].tolist() if s < m - 1 else [0] * flat.shape[0]))
    return out


def scalar_block(code, flat, c0, c1):
    """Scalar rows of opcode ``code`` over the slot arrays ``flat`` (nin, m)."""
    block = np.empty((flat.shape[1], NCOL), dtype=np.float64)
    block[:, 0] = code
    block[:, 1:4] = -1.0
    block[:, 1:1 + flat.shape[0]] = flat.T
    block[:, 4] = c0
    block[:, 5] = c1
    return block


def block(code, flat, c0, c1, min_run):
    """The rows of opcode ``code`` over the slot arrays ``flat`` (nin, m): an array
    instruction for each run of ``min_run`` elements or more, scalar rows for the rest;
    and whether any is an instruction."""
    rs = runs(flat, min_run) if flat.shape[1] >= min_run else None
    if rs is None or not any(e - s >= min_run for s, e, _ in rs):
        return scalar_block(code, flat, c0, c1), False
    parts = []
    for s, e, st in rs:
        n = e - s
        if n < min_run:
            parts.append(scalar_block(code, flat[:, s:e], c0, c1))
            continue
        st = st + [0] * (3 - len(st))
        ins = [int(x) for x in flat[:, s]] + [-1] * (3 - flat.shape[0])
        parts.append(np.array([[ARR, ins[0], ins[1], ins[2], c0, c1],
                               [TAIL, -1, -1, -1, n, code],
                               [TAIL, -1, -1, -1, st[0], st[1]],
                               [TAIL, -1, -1, -1, st[2], 0.0]], dtype=np.float64))
    return np.concatenate(parts), True


def red_width(step, L):
    """The slots of each output's chain in a reduction instruction of ``L`` terms (``step``:
    ADD, a sum; MUL, a sum of products)."""
    return 2 * L - 1 if step == MUL else L - 1


def heads_of(rows):
    """The first rows of a program's instructions (elementwise and reductions)."""
    return np.nonzero((rows[:, 0] == ARR) | (rows[:, 0] == RED))[0]


def _sizes(rows, heads):
    """The slots of each instruction: ``n``, or ``n * W`` for a reduction."""
    n = rows[heads + 1, 4]
    L = rows[heads, 4]
    w = np.where(rows[heads + 1, 5] == MUL, 2 * L - 1, L - 1)
    return np.where(rows[heads, 0] == RED, n * w, n).astype(np.int64)


def chain_rows(step, A, B, k):
    """The scalar rows of the sums over the last axis of the slot grids ``A`` (n, L) (of the
    products with ``B`` when ``step`` is MUL), from slot ``k``: each output a chain of
    ``red_width(step, L)`` rows, the running sum on the left (``acc + term``, the order a
    reduction instruction adds in); the chains' last rows, the outputs, after all their
    other rows (``n * (W - 1)`` of them), so that the outputs are contiguous."""
    n, L = A.shape
    W = red_width(step, L)
    body = np.zeros((n, W, NCOL), dtype=np.float64)  # chain i's rows, its output last
    body[..., 3] = -1.0
    base = (k + np.arange(n, dtype=np.int64) * (W - 1))[:, None]
    # the slot of column j of chain i: its scratch, or the output's for the last
    slot = lambda j: base + j if j < W - 1 else k + n * (W - 1) + \
        np.arange(n, dtype=np.int64)[:, None]  # noqa: E731
    if step == MUL:
        body[:, 0, 0], body[:, 0, 1], body[:, 0, 2] = MUL, A[:, 0], B[:, 0]
        for t in range(1, L):  # p_t at column 2t - 1, the sum so far at 2t
            body[:, 2 * t - 1, 0] = MUL
            body[:, 2 * t - 1, 1] = A[:, t]
            body[:, 2 * t - 1, 2] = B[:, t]
            body[:, 2 * t, 0] = ADD
            body[:, 2 * t, 1] = slot(2 * t - 2)[:, 0]
            body[:, 2 * t, 2] = slot(2 * t - 1)[:, 0]
    else:
        body[:, :, 0] = step
        body[:, 0, 1], body[:, 0, 2] = A[:, 0], A[:, 1]
        for t in range(2, L):  # the sum of terms 0 .. t at column t - 1
            body[:, t - 1, 1] = slot(t - 2)[:, 0]
            body[:, t - 1, 2] = A[:, t]
    return np.concatenate([body[:, :W - 1].reshape(-1, NCOL), body[:, W - 1]])


def red_outputs(k, n, step, L):
    """The output slots of a reduction's ``n`` chains from slot ``k`` (after their other
    slots)."""
    return k + n * (red_width(step, L) - 1) + np.arange(n, dtype=np.int64)


def red_block(step, A, B, k, min_run):
    """The rows of the sums over the last axis of the slot grids ``A`` (m, L) (of products
    with ``B`` when ``step`` is MUL), evenly spaced along it, their chains from slot ``k``:
    a reduction instruction for each run of outputs whose first terms are evenly spaced and
    that sums ``min_run`` terms or more, the chains as scalar rows for the rest; whether any
    is an instruction, and the outputs' slots (each run's are contiguous, after its
    chains' other slots)."""
    m, L = A.shape
    W = red_width(step, L)
    flat = A[:, :1].T if B is None else np.stack([A[:, 0], B[:, 0]])
    rs = runs(flat, max(1, -(-min_run // L))) if m * L >= min_run else None
    if rs is None:
        return chain_rows(step, A, B, k), False, red_outputs(k, m, step, L)
    ta = int(A[0, 1] - A[0, 0]) if L > 1 else 0
    tb = int(B[0, 1] - B[0, 0]) if B is not None and L > 1 else 0
    parts, outs, any_ = [], [], False
    for s, e, st in rs:
        n = e - s
        outs.append(red_outputs(k + s * W, n, step, L))
        if n * L < min_run:
            parts.append(chain_rows(step, A[s:e], None if B is None else B[s:e], k + s * W))
            continue
        st = st + [0] * (2 - len(st))
        ib = int(B[s, 0]) if B is not None else -1
        parts.append(np.array([[RED, int(A[s, 0]), ib, -1, L, ta],
                               [TAIL, -1, -1, -1, n, step],
                               [TAIL, -1, -1, -1, st[0], st[1]],
                               [TAIL, -1, -1, -1, tb, 0.0]], dtype=np.float64))
        any_ = True
    return np.concatenate(parts), any_, np.concatenate(outs)


def red_grids(rows, r):
    """(A, B or None) of the reduction instruction at row ``r``: its terms' slots (n, L)."""
    n, L = int(rows[r + 1, 4]), int(rows[r, 4])
    i = np.arange(n, dtype=np.int64)[:, None]
    t = np.arange(L, dtype=np.int64)[None, :]
    A = int(rows[r, 1]) + i * int(rows[r + 2, 4]) + t * int(rows[r, 5])
    B = None if rows[r, 2] < 0 else \
        int(rows[r, 2]) + i * int(rows[r + 2, 5]) + t * int(rows[r + 3, 4])
    return A, B


def row_slots(rows):
    """(the slot of each row, the number of slots): an instruction's first row has its
    first slot, its other rows the next instruction's."""
    n = np.ones(rows.shape[0], dtype=np.int64)
    heads = heads_of(rows)
    n[heads] = _sizes(rows, heads)
    for j in range(1, META + 1):
        n[heads + j] = 0
    ends = np.cumsum(n)
    return ends - n, int(ends[-1]) if len(ends) else 0


def expand(rows):
    """The scalar rows of a program with array instructions, one per slot (the slots, and
    so the input and output slots, are unchanged)."""
    at, nslots = row_slots(rows)
    out = np.empty((nslots, NCOL), dtype=np.float64)
    scalar = np.ones(rows.shape[0], dtype=np.bool_)
    heads = heads_of(rows)
    for j in range(META + 1):
        scalar[heads + j] = False
    out[at[scalar]] = rows[scalar]
    i_all = np.arange(max([int(rows[k + 1, 4]) for k in heads.tolist()] or [0]),
                      dtype=np.float64)
    for k in heads.tolist():
        if rows[k, 0] == RED:
            A, B = red_grids(rows, k)
            blk = chain_rows(int(rows[k + 1, 5]), A, B, int(at[k]))
            out[at[k]:at[k] + blk.shape[0]] = blk
            continue
        n, code = int(rows[k + 1, 4]), rows[k + 1, 5]
        st = (rows[k + 2, 4], rows[k + 2, 5], rows[k + 3, 4])
        blk = out[at[k]:at[k] + n]
        i = i_all[:n]
        for j in range(3):
            s = rows[k, 1 + j]
            blk[:, 1 + j] = s + i * st[j] if s >= 0 else -1.0
        blk[:, 4:6] = rows[k, 4:6]
        if code == LEAF:  # input elements c0 ..
            blk[:, 4] += i
        blk[:, 0] = code
    return out


def mark_inactive(rows, nslots, bits, leaf):
    """``_mark_inactive``; an extreme's reduction of values with a gradient (it has no rule:
    ``Builder.reduce_terms`` makes them of detached values only) is refused."""
    heads = heads_of(rows)
    nr = rows.shape[0]
    size = np.zeros(nr, dtype=np.int64)  # by row, as ``_needed`` takes them
    size[heads] = _sizes(rows, heads)
    # by row: each operand's (first slot or -1, stride per value, stride per term) and the
    # terms of each value (1 but for a reduction's)
    red = rows[heads, 0] == RED
    geo = np.zeros((nr, 3, 3), dtype=np.int64)
    geo[heads, :, 0] = rows[heads, 1:4]
    geo[heads, 0, 1] = rows[heads + 2, 4]
    geo[heads, 1, 1] = rows[heads + 2, 5]
    geo[heads, 2, 1] = np.where(red, 0, rows[heads + 3, 4])
    geo[heads, 0, 2] = np.where(red, rows[heads, 5], 0)
    geo[heads, 1, 2] = np.where(red, rows[heads + 3, 4], 0)
    terms = np.ones(nr, dtype=np.int64)
    terms[heads] = np.where(red, rows[heads, 4], 1)
    act = _mark_inactive(rows, nslots, bits, leaf, size, geo, terms)
    h = np.nonzero((rows[:, 0] == RED) & ((np.roll(rows[:, 5], -1) == MAX)
                                          | (np.roll(rows[:, 5], -1) == MIN)))[0]
    if len(h) and (rows[h + 3, 5] != 1.0).any():
        raise ValueError("an extreme's reduction instruction of values with a gradient: it "
                         "has no rule (only of detached values)")
    return act


@njit_cached(nogil=True)
def _mark_inactive(rows, nslots, bits, leaf, size, geo, terms):
    """Flag (1.0 in the constant column of an instruction's last row) the array
    instructions whose values depend on no input through a gradient: their reverse adds
    only to adjoints that reach no input, so the reverse sweep skips them (the max of
    detached values, the counts of tied elements...); an elementwise instruction's
    operands whose gradient reaches no input, ``-(bits a, b, c)`` there (lse's shift by
    its max: a sum in order of 640,000 gradients that went nowhere). Returns whether each
    slot's value depends on an input through a gradient. ``size``, ``geo``, ``terms``:
    ``mark_inactive``'s, by row."""
    act = np.zeros(nslots, dtype=np.bool_)
    r = 0
    k = 0
    while r < rows.shape[0]:
        op = int(rows[r, 0])
        if op == RED or op == ARR:
            # all its values active where any element an operand reads is (one loop nest
            # for every kind of instruction: each loop of its own cost compile time); a
            # reduction's outputs only (its chains' other slots are never read); inputs
            # are active and have no rule
            m = int(rows[r + 1, 4])
            code = int(rows[r + 1, 5])
            b = 7 if op == RED else 0 if code == leaf else bits[code]
            any_ = op == ARR and code == leaf
            skip = 0  # the operands whose gradient reaches no input (bits a, b, c)
            for c in range(3):
                s = geo[r, c, 0]
                if s >= 0 and (b >> c) & 1:
                    need = False
                    for i in range(m):
                        for t in range(terms[r]):
                            need = need or act[s + i * geo[r, c, 1] + t * geo[r, c, 2]]
                    any_ = any_ or need
                    if not need:
                        skip |= 1 << c
            for i in range(size[r] - m, size[r]):
                act[k + i] = any_
            rows[r + 3, 5] = 1.0 if not any_ or b == 0 else 0.0 if op == RED else -float(skip)
            k += size[r]
            r += META + 1
            continue
        b = bits[op] if op < bits.shape[0] else 0
        if op == leaf:
            act[k] = True
        for c in range(3):
            s = int(rows[r, 1 + c])
            if s >= 0 and (b >> c) & 1 and act[s]:
                act[k] = True
        r += 1
        k += 1
    return act


def has_arrays(rows):
    return bool(rows.shape[0]) and bool(np.any((rows[:, 0] == ARR) | (rows[:, 0] == RED)))


def coverage(rows):
    """The share of the program's computed slots that its array instructions compute
    (constant rows are values written, not computed: a constant matrix of a matmul made
    llsq's program two thirds instructions)."""
    heads = heads_of(rows)
    total = row_slots(rows)[1] - int(np.count_nonzero(rows[:, 0] == CONST))
    return float(_sizes(rows, heads).sum()) / total if total > 0 else 0.0


def info(rows, r):
    """(n, opcode, strides) of the instruction whose first row is ``r``; (1, opcode, 0s) for a
    scalar row; for a reduction (n outputs, ``array_red``, (sa, sb, ta, tb, L))."""
    if rows[r, 0] == RED:
        return (int(rows[r + 1, 4]), RED, (int(rows[r + 2, 4]), int(rows[r + 2, 5]),
                                           int(rows[r, 5]), int(rows[r + 3, 4]),
                                           int(rows[r, 4])))
    if rows[r, 0] != ARR:
        return 1, int(rows[r, 0]), (0, 0, 0)
    return (int(rows[r + 1, 4]), int(rows[r + 1, 5]),
            (int(rows[r + 2, 4]), int(rows[r + 2, 5]), int(rows[r + 3, 4])))


def spans(rows, heads):
    """(slots, spans, kept) of the instructions at ``heads``: how many slots each has, the
    lowest and highest slot each operand reads (n, 3, 2; -1 where absent), and whether it
    is kept whatever reads it (leaves)."""
    n = rows[heads + 1, 4].astype(np.int64)
    red = rows[heads, 0] == RED
    L = np.where(red, rows[heads, 4], 1).astype(np.int64)
    first = rows[heads, 1:4].astype(np.int64)
    per = np.stack([rows[heads + 2, 4], rows[heads + 2, 5], rows[heads + 3, 4]], 1)
    # a reduction's strides: (sa, sb) per output, (ta, tb) per term; none for c
    term = np.stack([np.where(red, rows[heads, 5], 0), np.where(red, rows[heads + 3, 4], 0),
                     np.zeros(len(heads))], 1)
    per = np.where(red[:, None] & (np.arange(3) == 2), 0, per).astype(np.int64)
    term = term.astype(np.int64)
    a = (n - 1)[:, None] * per
    b = (L - 1)[:, None] * term
    lo = first + np.minimum(a, 0) + np.minimum(b, 0)
    hi = first + np.maximum(a, 0) + np.maximum(b, 0)
    out = np.stack([np.where(first >= 0, lo, -1), np.where(first >= 0, hi, -1)], 2)
    kept = (rows[heads, 0] == ARR) & (rows[heads + 1, 5] == LEAF)
    return _sizes(rows, heads), out, kept


def prune_arrays(rows, roots, guard, leaf):
    """``program.prune`` of a program with array instructions (``roots`` and the result's
    renumbering are slots): an instruction is kept whole when any of its slots is needed,
    and with every slot its strided inputs span (so that the kept slots of a span stay
    evenly spaced after renumbering). The backward pass is compiled (``_needed``), over
    the instructions' sizes and spans that NumPy works out (``spans``: one branch for
    every kind of instruction, compiled in less time); the renumbering is NumPy's
    (compiled too, it doubled the cold compile at trace time)."""
    at, nslots = row_slots(rows)
    heads = heads_of(rows)
    owner = at.copy()  # the slot that decides whether a row is kept: its instruction's first
    for j in range(1, META + 1):
        owner[heads + j] = at[heads]
        at[heads + j] = -1
    size = np.zeros(rows.shape[0], dtype=np.int64)  # by row: 0 for a scalar row
    span = np.full((rows.shape[0], 3, 2), -1, dtype=np.int64)
    kept = np.zeros(rows.shape[0], dtype=np.bool_)
    size[heads], span[heads], kept[heads] = spans(rows, heads)
    need = _needed(rows, at, nslots, np.asarray(roots, dtype=np.int64), guard, leaf, size,
                   span, kept)
    # (the kept slots numbered in order, in one array: a cumsum of the bools themselves
    # took 1 s of gmm's Hessian-vector program's 17 million slots, NumPy's accumulate
    # casting each bool; fresh arrays of that size cost their page faults, 0.1 s or more)
    new = need.astype(np.int64)
    np.cumsum(new, out=new)
    new -= 1
    new[~need] = -1
    out = rows[need[owner]]
    slots = out[:, 1:4]
    live = slots >= 0  # (an instruction's other rows hold -1 there)
    slots[live] = new[slots[live].astype(np.int64)]
    return out, new


@njit_cached(nogil=True)
def _needed(rows, at, nslots, roots, guard, leaf, size, span, kept):
    """The slots ``prune_arrays`` keeps: ``at[r]``, the slot of row ``r`` (-1 for an
    instruction's rows after its first); ``size``, ``span``, ``kept``: ``spans``' by row."""
    need = np.zeros(nslots, dtype=np.bool_)
    for s in roots:
        need[s] = True
    for r in range(rows.shape[0] - 1, -1, -1):
        k = at[r]
        if k < 0:
            continue
        m = size[r]
        if m > 0:  # an instruction
            any_ = kept[r]
            for i in range(m):
                any_ = any_ or need[k + i]
            if not any_:
                continue
            for i in range(m):
                need[k + i] = True
            for c in range(3):
                # (an absent operand's span is (-1, -1): its range(-1, 0) marked need[-1],
                # the last slot, which then numbered one slot past the kept ones)
                if span[r, c, 0] < 0:
                    continue
                for t in range(span[r, c, 0], span[r, c, 1] + 1):
                    need[t] = True
            continue
        op = int(rows[r, 0])
        if op == guard or op == leaf:
            need[k] = True
        if need[k]:
            for c in range(1, 4):
                s = int(rows[r, c])
                if s >= 0:
                    need[s] = True
    return need


# --- running: one sample ------------------------------------------------------------------

#: (the one-sample run's context where no NumPy step runs: none entered)
_LOUD = contextlib.nullcontext()

# generated from this format; GRAD_BITS: by opcode, the inputs its rule gives gradients to
from ._generated_arrays import (  # noqa: E402, F401
    GRAD_BITS, forward, red_forward, red_reverse, red_reverse_mm, reverse)


def _has_matmul_rows(rows, plan):
    """Whether a reduction instruction that the compiled sweeps run (not in a batched
    product) sums products with the same ``a`` terms for every output (a matmul's row:
    ``sa`` 0), which ``red_reverse_mm`` runs faster (eight terms' gradients at a time) for
    0.5 s more of cold compile."""
    for r0, r1, _, _, op in plan:
        if op is RED or op is NPRED:
            h = np.arange(r0, r1)
            h = h[rows[h, 0] == RED]
            if np.any((rows[h + 1, 5] == MUL) & (rows[h + 2, 4] == 0)):
                return True
    return False


def run_into(rows, work, res):
    """``replay_cpu.run_into`` of a program with array instructions, on the same ``work``
    layout (``replay_cpu.new_work``); the values' count is what its size leaves for them."""
    return entry(rows, work)(rows, work, res)


def entry(rows, work):
    """``replay_cpu.entry`` of this module's ``run_into``, for this program's ``work`` layout
    (its sizes and slots, read once here): the compiled entries of ``forward`` and
    ``reverse`` for the types of ``rows`` and ``work`` (its slices, the vectors they take,
    are of its type), called without Numba's typing of each argument; the dispatchers
    themselves without the JIT.

    Python over the compiled sweeps (and ``red_forward``, ``red_reverse`` for the
    reductions, ``_plan`` and ``_reverse_plan``'s steps), not a compiled driver: a compiled
    caller links them in and LLVM optimizes them all again (0.8 s of a cold first gradient
    on 2 cores), for about 2 us per call saved."""
    fw, rv, rfw, rrv = forward, reverse, red_forward, red_reverse
    plan = _plan(rows)
    if hasattr(forward, "compile"):
        mat, vec, i64 = numba.typeof(rows), numba.typeof(work), numba.int64
        fw = forward.compile((mat, vec, vec, i64, i64, i64))
        rv = reverse.compile((mat, vec, vec, i64, i64, i64))
        if any(op is RED or op is NPRED for *_, op in plan):
            # (only then: they cost cold compile time; a matmul's row's faster loops too)
            rfw = red_forward.compile((mat, vec, i64, i64, i64))
            rrv = (red_reverse_mm if _has_matmul_rows(rows, plan) else red_reverse).compile(
                (mat, vec, vec, i64, i64, i64))
    elif _has_matmul_rows(rows, plan):
        rrv = red_reverse_mm
    back = _reverse_plan(rows, plan)
    m, p, nx = int(work[0]), int(work[1]), int(work[2])
    s = _cpu.HEADER + m
    o = s + m + p
    n = (work.shape[0] - o - nx) // 2
    # the outputs' slots gathered and seeded by NumPy: a program of many outputs (ba's
    # 2,000 residuals) spent 0.8 ms a call in a Python loop over them
    out = work[s:s + m].astype(np.intp)
    ins = work[s + m:o].astype(np.intp)
    repeats = np.unique(out).shape[0] < m  # an output slot twice: its seeds add up
    sets = _first_writers(rows, plan, out)
    if sets:  # (a sum's reverse step alone: its last row and slot, its first row)
        at = row_slots(rows)[0]
        split = []
        for step in back:
            r1, k, r0, kind = step
            if kind is not RED:
                split.append(step)
                continue
            hs = [h for h in sets if r0 <= h <= r1 - META]
            for h in sorted(hs, reverse=True):  # (the rows after it, it, the rest)
                if r1 > h + META:
                    split.append((r1, k, h + META + 1, RED))
                split.append((h, int(at[h]), h, (ASSIGN,)))
                r1, k = h - 1, int(at[h]) - 1
            if r1 >= r0:
                split.append((r1, k, r0, kind))
        back = split
    firsts = _first_operands(rows, back, out)
    mm_firsts = _mm_first(rows, back, out)
    rg_firsts = _rgrp_first(rows, back, out)
    back, sqs = _sqs_back(rows, back, _sum_squares(rows, back, out, rg_firsts))
    back, shifts = _exp_shift(rows, back, out, sets)
    back = _exp_shift_direct(rows, back, firsts)
    back, tiles = _red_tiles(rows, back, out)
    live = _live(rows, n, [sets[h] for h in sets] + [r for f in firsts.values() for r in f]
                 + list(mm_firsts.values()) + list(rg_firsts.values()) + shifts
                 + [r for st in sqs.values() for r in st[-1]] + tiles)
    # (zeroed by one compiled call: NumPy's assignment of a slice took 0.5 us more each,
    # and twice the time over 80,000 slots)
    zs = np.array([sl.start for sl in live] if live is not None else [0], dtype=np.int64)
    ze = np.array([sl.stop for sl in live] if live is not None else [1 << 62],
                  dtype=np.int64)
    if p and (ins == ins[0] + np.arange(p)).all():
        # the inputs' slots in order (a leaf instruction's): their gradient is a slice,
        # not a gather (1 ms of lse's gradient at n = 640,000)
        ins = slice(int(ins[0]), int(ins[0]) + p)

    plan = _flat_extremes(rows, _skip_picks(rows, _skip_detach(rows, plan, out), sets), out)
    plan, back = _ties(rows, plan, back, out, sets)
    back = _rgrp_compiled(rows, _no_rules(rows, back), rg_firsts)
    if rrv is red_reverse and hasattr(forward, "compile") and any(
            k is RED for *_, k in back):  # (the sums' rules of ``_rgrp_compiled``)
        rrv = red_reverse.compile((numba.typeof(rows), numba.typeof(work), numba.typeof(work),
                                   numba.int64, numba.int64, numba.int64))
    plan = _sqs_inactive(rows, _sqs_plan(rows, plan, sqs), out)
    # the values begin where the inputs are when the first instruction is a large leaf
    # instruction copying them, in order, into the first slots: those slots are the
    # inputs themselves, and the copy is left out (0.26 ms of lse's 640,000 elements)
    base = o + nx
    if plan[0][4] is BY_NAME["leaf"] and plan[0][2] == 0 and int(rows[0, 4]) == 0 \
            and plan[0][3] == nx:
        plan, base = plan[1:], o
    plan = _const_fills(rows, plan)
    quiet = any(op is not None and op is not RED for *_, op in plan) or any(
        kind is not None and kind is not RED for *_, kind in back)

    def run(rows, work, res):
        # (quiet, as the compiled loops: a log of 0 is -inf, not a warning; one errstate
        # a run where a NumPy step runs, 2 us each, not one a step: 10 of them in
        # kmeans' Hessian-vector program)
        with np.errstate(all="ignore") if quiet else _LOUD:
            v = work[base:base + n]
            x = work[o:o + nx]
            status = 0
            masks = {}
            for r0, r1, k0, k1, op in plan:
                if op is None:
                    status = int(fw(rows, x, v, r0, r1, k0))
                    if status:
                        break
                elif op is RED:
                    rfw(rows, v, r0, r1, k0)
                elif op is NPRED:
                    _np_red_forward(rows, r0, k0, v)
                elif type(op) is tuple and op[0] is NPRED:  # (of a detach's operand)
                    _np_red_forward(rows, r0, k0, v, op[1])
                elif type(op) is tuple and op[0] is FILL:
                    v[op[1]:op[2]] = -0.0
                elif type(op) is tuple and op[0] is CONSTS:
                    v[k0:k1] = op[1]
                elif type(op) is tuple and op[0] is TIES:
                    _ties_forward(op, v, masks)
                elif type(op) is tuple and op[0] is XRED:
                    if not _xred_forward(op, v):
                        for q0, q1, j0, _, qop in op[-1]:  # the tree's own steps
                            if qop is None:
                                status = int(fw(rows, x, v, q0, q1, j0))
                            elif qop is RED:
                                rfw(rows, v, q0, q1, j0)
                            elif qop is NPRED or type(qop) is tuple:
                                _np_red_forward(rows, q0, j0, v,
                                                qop[1] if type(qop) is tuple else 0)
                            else:  # (the detach that only the tree reads)
                                _np_forward(qop, rows, q0, j0, v, x)
                        if status:
                            break
                elif type(op) is tuple:
                    if op[0] is RGRP:
                        _rgrp_forward(op, v)
                    elif op[0] is SQS:
                        _sqs(v, v, False, *_sqs_args(op))
                    elif op[0] is not GRP:
                        _mm_forward(op, v)
                    elif op[-1]:
                        _grp_forward(op, v, k0)
                    else:  # (its forward compiled: arithmetic, a pass of the loop)
                        status = int(fw(rows, x, v, r0, r1, k0))
                        if status:
                            break
                else:
                    _np_forward(op, rows, r0, k0, v, x)
            res[:m] = v[out]
            if res.shape[0] > m and status == 0:
                adj = work[o + nx + n:]
                _zero(adj, zs, ze)
                if repeats:
                    np.add.at(adj, out, work[_cpu.HEADER:s])
                else:
                    adj[out] += work[_cpu.HEADER:s]
                for r, k, lo, kind in back:
                    if kind is None:
                        rv(rows, v, adj, r, k, lo)
                    elif kind is RED:
                        rrv(rows, v, adj, r, k, lo)
                    elif type(kind) is tuple and kind[0] is ASSIGN:
                        _red_assign(rows, r, k, adj)
                    elif type(kind) is tuple and kind[0] is TILES:
                        _red_tiles_reverse(rows, adj, kind[1], r + 1, kind[2])
                    elif type(kind) is tuple and kind[0] is EXPSUBX:
                        _exp_shift_direct_reverse(kind, v, adj)
                    elif type(kind) is tuple and kind[0] is TIESREV:
                        _ties_reverse(kind, adj, masks)
                    elif type(kind) is tuple and kind[0] is EXPSUB:
                        _exp_shift_reverse(kind, v, adj)
                        _np_reverse(kind[1], rows, kind[2], kind[3], v, adj,
                                    firsts.get(kind[2], ()))
                    elif type(kind) is tuple:
                        if kind[0] is GRP:
                            _grp_reverse(kind, v, adj, k)
                        elif kind[0] is RGRP:
                            _rgrp_reverse(kind, v, adj, r in rg_firsts)
                        elif kind[0] is SQS:
                            _sqs(v, adj, True, *_sqs_args(kind))
                        else:
                            _mm_reverse(kind, v, adj, r in mm_firsts)
                    else:  # (an instruction's first row and slot)
                        _np_reverse(kind, rows, r, k, v, adj, firsts.get(r, ()))
                res[m:] = adj[ins]
            return status
    return run


#: elementwise instructions whose forward runs as a NumPy call over views of the values,
#: from the driver, when they have at least this many elements (by op): NumPy's loops are
#: vectorized (SIMD exp and log: lse's exp of 640,000 elements took 3.4 ms as a loop of
#: ``math.exp``, 0.5 ms in NumPy), but each call and the break in the compiled sweep cost
#: a few us. NumPy's exp and log are not libm's: such an instruction's values may differ
#: from its expansion's in the last bits (both as close to torch's), the same on every
#: call; its other ops round exactly as the compiled loop does. The reverse sweep stays
#: compiled, but for a broadcast operand's gradient (``NUMPY_BCAST_MIN``): the rules are
#: arithmetic, and NumPy's rules over views take two passes where the loop takes one
TRANSCENDENTAL = frozenset(("exp", "log", "log1p", "expm1", "sqrt", "sin", "cos", "tanh"))
NUMPY_MIN = dict.fromkeys(TRANSCENDENTAL, 8192)
NUMPY_MIN.update(dict.fromkeys(("add", "sub", "mul", "neg", "mulc", "addc", "divc", "div",
                                "square", "detach", "select", "pick", "eq", "ne", "lt", "le",
                                "gt", "ge", "leaf", "eq_nan", "pick_where"), 65536))


def _numpyable(rows, h):
    """The op of the elementwise instruction at row ``h`` if the driver runs its forward in
    NumPy: large enough (or its reverse runs in NumPy: ``_np_reversible``), its operands'
    strides not negative (views by slicing)."""
    n, code, st = info(rows, h)
    op = OPS[code]
    if min(st) < 0:
        return None
    if n < NUMPY_MIN.get(op.name, 1 << 62) and not _np_reversible(rows, h):
        return None
    return op


def _plan(rows):
    """The forward's steps: (first row, row after, first slot, slot after, None) for rows
    the compiled sweep runs, (.., op) for an instruction run in NumPy (``NUMPY_MIN``), (..,
    RED) for a run of reduction instructions and the scalar ``add`` rows after each
    (``red_forward``), (.., NPRED) for a reduction instruction run in NumPy
    (``NUMPY_RED_MIN``), (.., (MM, ..)) for a batched product by ``np.matmul``
    (``_mm_group``)."""
    at, nslots = row_slots(rows)
    nr = rows.shape[0]
    slot = lambda r: int(at[r]) if r < nr else nslots  # noqa: E731
    plan, r0, after, tried = [], 0, 0, 0
    for h in heads_of(rows).tolist():
        if h < after:  # (in a batched product)
            continue
        mm = None
        if h >= tried:
            # (a run that is no batched product, nor a run of instructions as one call, is
            # not tried again from each of its rows: quadratic in its length)
            if rows[h, 0] == RED:
                mm, tried = _mm_group(rows, h, at)
                mm = None if mm is None else (mm[0], (MM,) + mm[1:])
                if mm is None:
                    mm, seen = _red_group(rows, h, at)
                    tried = max(tried, seen)
            else:
                mm, tried = _ew_group(rows, h, at)
        if mm is not None:
            after = mm[0]
            if h > r0:
                plan.append((r0, h, slot(r0), slot(h), None))
            plan.append((h, after, slot(h), slot(after), mm[1]))
            r0 = after
            continue
        op = (NPRED if _np_reducible(rows, h) else RED) if rows[h, 0] == RED \
            else _numpyable(rows, h)
        if op is None:
            continue
        e = h + META + 1
        while op is RED and e < nr and rows[e, 0] == ADD:  # (``red_forward`` runs them too)
            e += 1
        if op is RED and plan and plan[-1][4] is RED and plan[-1][1] == h:
            plan[-1] = plan[-1][:1] + (e,) + plan[-1][2:3] + (slot(e), RED)  # one call
        else:
            if h > r0:
                plan.append((r0, h, slot(r0), slot(h), None))
            plan.append((h, e, slot(h), slot(e), op))
        r0 = e
    if r0 < nr or not plan:
        plan.append((r0, nr, slot(r0), nslots, None))
    return plan


def _reverse_plan(rows, plan):
    """The reverse sweep's steps, last first: (last row, its last slot, first row, RED or
    None for ``reverse``), or (first row, first slot, first row, op) for an instruction
    whose rule runs in NumPy (``_np_reversible``), from the forward's; a run of reductions
    (no scalar row) none of which has a gradient to pass on (a max's shift:
    ``mark_inactive`` flags them) is left out."""
    out = []
    for r0, r1, k0, k1, op in reversed(plan):
        if r1 == r0:
            continue
        if isinstance(op, tuple) and op[0] is GRP and not op[-2]:
            op = None  # (a run of instructions whose reverse is compiled)
        if isinstance(op, tuple):  # a batched product or a run: all or none of it active
            if rows[r0 + META, 5] != 1.0 and (op[0] is not GRP or op[6]):
                out.append((r0, k0, r1, op))
            continue
        kind = RED if op is RED or op is NPRED else None
        # (reductions only: a scalar add row among them puts a head past the rows' end)
        if kind is RED and (r1 - r0) % (META + 1) == 0 \
                and (rows[r0:r1:META + 1, 0] == RED).all() \
                and all(rows[h + META, 5] == 1.0 for h in range(r0, r1, META + 1)):
            continue
        if kind is None and op is not None and _np_reversible(rows, r0):
            if rows[r0 + META, 5] != 1.0:  # (else no input's gradient goes through it)
                out.append((r0, k0, r0, op))
            continue
        if kind is None and out and out[-1][3] is None and out[-1][2] == r1:
            out[-1] = out[-1][:2] + (r0, None)  # (a NumPy step's reverse is compiled)
        else:
            out.append((r1 - 1, k1 - 1, r0, kind))
    return out


def _operands(rows, h, n, v):
    """Views of ``v`` at the operands of the instruction at row ``h`` (a float where the
    stride is 0, None where absent)."""
    st = info(rows, h)[2]
    out = []
    for j in range(3):
        s0 = int(rows[h, 1 + j])
        out.append(None if s0 < 0 else v[s0] if st[j] == 0 else
                   v[s0:s0 + (n - 1) * st[j] + 1:st[j]])
    return out


#: the ops with a constant whose NumPy forward is a ufunc of ``a`` and ``c0`` (their
#: registry ``np`` is a lambda that allocates its result): so they write into the values
_UFUNC_C = {"mulc": np.multiply, "addc": np.add, "divc": np.divide}


def _np_forward(op, rows, h, k, v, x):
    """The instruction at row ``h`` (slots ``k ..``) by its op's NumPy forward (the replay
    helpers' and comparisons' as their rows compute them: 1.0/0.0, ``-0.0``...), written
    into its slots by the ufunc's ``out``: a result allocated and copied cost more than the
    op (lse's exp of 640,000: 1.8 ms, 0.5 ms into the slots; a fresh array's pages are
    faulted in on every call)."""
    n = int(rows[h + 1, 4])
    out = v[k:k + n]
    if op.name == "leaf":  # input elements c0 ..
        c0 = int(rows[h, 4])
        out[:] = x[c0:c0 + n]
        return
    _np_apply(op, out, *_operands(rows, h, n, v), float(rows[h, 4]), float(rows[h, 5]))


def _np_apply(op, out, a, b, c, c0, c1):
    """``out[...] = op(a, b, c; c0, c1)`` by NumPy, elementwise over arrays of any shape
    (``_np_forward``'s and ``_grp_forward``'s)."""
    if op.name == "select":
        out[...] = c
        np.copyto(out, b, where=a != 0.0)
    elif op.name == "pick" or op.name == "pick_where":
        out.fill(-0.0)
    elif op.name == "fms":
        out[...] = op.np(a, b, c)
    elif op.name == "detach":
        out[...] = a
    elif op.name == "eq_nan" and isinstance(b, float) and b == b:
        np.equal(a, b, out=out)  # (a max's ties: no NaN to tie with, one pass)
    elif op.name == "eq_nan" and isinstance(b, float):
        np.not_equal(a, a, out=out)  # (NaN's ties: the NaNs)
    elif op.name in _UFUNC_C:
        _UFUNC_C[op.name](a, c0, out=out)
    elif isinstance(op.np, np.ufunc):  # (comparisons: their bool as 1.0 or 0.0)
        op.np(*(a, b, c)[:op.np.nin], out=out)
    elif op.kind == UNARY_C:
        out[...] = op.np(a, c0, c1)
    elif op.kind == BINARY or op.kind == COMPARE:
        out[...] = op.np(a, b)
    else:
        out[...] = op.np(a)


def _g(g, a, b, out, c0, s):
    return g


#: the rules ``_np_reverse`` runs, by op and operand: (the term, as the registry's rule
#: computes it, rounding for rounding, into the scratch ``s``; its sign: -1 subtracts ``g``,
#: as the rule's ``-g`` added). ``test_numpy_rules_are_the_registrys`` checks them against
#: the registry's rule expressions
NP_RULES = {
    "add": ((_g, 1), (_g, 1)),
    "sub": ((_g, 1), (_g, -1)),
    "neg": ((_g, -1),),
    "addc": ((_g, 1),),
    "mul": ((lambda g, a, b, out, c0, s: np.multiply(g, b, out=s), 1),
            (lambda g, a, b, out, c0, s: np.multiply(g, a, out=s), 1)),
    "pick": ((lambda g, a, b, out, c0, s: np.multiply(g, b, out=s), 1),),
    "exp": ((lambda g, a, b, out, c0, s: np.multiply(g, out, out=s), 1),),
    "log": ((lambda g, a, b, out, c0, s: np.divide(g, a, out=s), 1),),
    "mulc": ((lambda g, a, b, out, c0, s: np.multiply(g, c0, out=s), 1),),
    "divc": ((lambda g, a, b, out, c0, s: np.divide(g, c0, out=s), 1),),
    "square": ((lambda g, a, b, out, c0, s: np.multiply(np.multiply(g, 2.0, out=s), a,
                                                         out=s), 1),),
}
#: an instruction with a broadcast operand (stride 0) that takes a gradient runs its rule
#: in NumPy from this many elements: the compiled loop adds each element's gradient to
#: that one slot, each add waiting on the last (lse's shift by its max at n = 640,000:
#: 2.1 ms); NumPy sums them pairwise, as eager mode does, and adds the sum (0.23 ms with
#: the other operand's). Other rules stay compiled: NumPy's take two passes over their
#: arrays where the loop takes one (exp's at 640,000: 0.42 ms, compiled 0.28)
NUMPY_BCAST_MIN = 8192


def _grad_operands(rows, h):
    """[(operand, first slot, stride)] of the instruction at ``h`` that its reverse adds
    gradients to: those of its op's rule, less those whose gradient reaches no input and
    that are broadcast (``mark_inactive``'s bits; their adjoints are never read)."""
    n, code, st = info(rows, h)
    sk = int(-rows[h + META, 5]) if rows[h + META, 5] < 0 else 0
    out = []
    for j in range(3):
        s0 = int(rows[h, 1 + j])
        if s0 >= 0 and GRAD_BITS[code] >> j & 1 and not (st[j] == 0 and sk >> j & 1):
            out.append((j, s0, st[j]))
    return out


#: reduction instructions of at least this many terms (outputs times terms) run their
#: forward in NumPy, when their strides are not negative: a sum by ``np.add.reduce``
#: (pairwise along a contiguous axis, as eager mode's ``np.sum``: within rounding of the
#: expansion's sum in order), an extreme by ``np.maximum.reduce`` or ``np.minimum.reduce``
#: (exact), a sum of products by ``np.einsum`` (within rounding). The compiled loop adds a
#: term at a time, about 0.8 ns a term (lse's four reductions of 640,000 terms: 2.1 ms);
#: NumPy's sum is vectorized (0.1 ms each). The same numbers on every call: NumPy's
#: reductions run on the calling thread, in an order set by the layout only
NUMPY_RED_MIN = 65536
#: (the forward plan's mark of a reduction instruction run in NumPy)
NPRED = "npred"


def _view(v, s0, shape, strides, writeable=True):
    """The view of ``v`` (a contiguous vector) from slot ``s0`` with ``shape`` and
    ``strides`` in slots: ``np.ndarray`` over its buffer, which checks that the view lies
    inside ``v`` (NumPy's ``as_strided`` took 2 to 30 us a call, as much as a step of
    80,000 elements: 7 of them in each of kmeans' ``grad`` and ``hvp``)."""
    e = v.itemsize
    a = np.ndarray(shape, v.dtype, v, s0 * e, tuple(int(t) * e for t in strides))
    if not writeable:
        a.flags.writeable = False
    return a


def _red_views(rows, h, v, shift=0):
    """(step, output slots' view, terms (n, L) as a view of ``v``, the second operand's
    terms or None) of the reduction instruction at row ``h`` (its slots from ``k``)."""
    n, _, (sa, sb, ta, tb, L) = info(rows, h)
    step = int(rows[h + 1, 5])
    A = _view(v, int(rows[h, 1]) + shift, (n, L), (sa, ta), False)
    B = None if step != MUL else _view(v, int(rows[h, 2]), (n, L), (sb, tb), False)
    return step, A, B


#: a run of consecutive reduction instructions that are one batched product (matmul rows:
#: ``C`` batches of ``g`` rows of ``A`` (g, L) times the same ``B`` (L, n), gmm's ``Q @ xc``)
#: of at least this many products runs as one ``np.matmul`` (BLAS), forward and reverse
#: (``G @ B^T``, ``A^T @ G``): within rounding of the expansion, whose sums are in order,
#: and the same on every call (gmm's 250 instructions, 25 batches of 10 rows: 0.6 ms
#: forward and 1.1 ms reverse compiled, 0.3 and 0.65 ms so). A matrix shared by every
#: batch (its slots twice in a view) is a batch at a time
NUMPY_MM_MIN = 65536
#: (the plan's mark of a batched product: (MM, shape, A's, B's and the outputs' strides))
MM = "mm"


def _injective(strides, shape):
    """Whether a grid of slots with these strides (not negative) and shape has no slot
    twice: sorted by stride, each exceeds the span of the smaller ones."""
    span = 0
    for st, n in sorted(zip(strides, shape)):
        if n > 1 and st <= span:
            return False
        span += (n - 1) * st
    return True


def _affine(x, C, g):
    """(first, step per batch, step per row) of ``x`` (C * g values) if affine, else None."""
    X = np.asarray(x[:C * g], dtype=np.int64).reshape(C, g)
    dc = int(X[1, 0] - X[0, 0]) if C > 1 else 0
    dj = int(X[0, 1] - X[0, 0]) if g > 1 else 0
    ok = (X == X[0, 0] + dc * np.arange(C)[:, None] + dj * np.arange(g)[None, :]).all()
    return (int(X[0, 0]), dc, dj) if ok else None


def _mm_group(rows, h, at):
    """((row after, (C, g, n, L), A's (first slot, strides), B's, the outputs') of the batched
    product whose first matmul row is the reduction instruction at row ``h``, or None; the
    row after the run of instructions it looked at). ``at``: ``row_slots``'. A product is
    consecutive instructions of the same shape and strides (one operand's terms the same
    for every output, all other strides positive), ``B`` the same for ``g`` of them in a
    row, every start affine in (batch, row), each operand's grid with no slot twice (its
    gradients are added through a view), at least ``NUMPY_MM_MIN`` products."""
    if rows[h + 1, 5] != MUL:
        return None, h
    n, _, (sa, sb, ta, tb, L) = info(rows, h)
    # the operand whose terms are the same for every output is ``A``'s row (a's, or b's:
    # a product's factors commute, bit for bit)
    ca, cb = (1, 2) if sa == 0 else (2, 1)
    if sa != 0 and sb == 0:
        sa, sb, ta, tb = sb, sa, tb, ta
    elif sa != 0:
        return None, h
    if min(sb, ta, tb) < 1:
        return None, h
    nr = rows.shape[0]
    hs = [h]
    while hs[-1] + 2 * (META + 1) <= nr and rows[hs[-1] + META + 1, 0] == RED:
        e = hs[-1] + META + 1
        if rows[e + 1, 5] != MUL or info(rows, e) != info(rows, h) \
                or rows[e + META, 5] != rows[h + META, 5]:
            break
        hs.append(e)
    hs = np.array(hs)
    seen = int(hs[-1]) + META + 1
    B = rows[hs, cb]
    g = int(np.argmax(B != B[0])) if (B != B[0]).any() else len(hs)
    C = len(hs) // g
    if C * g * n * L < NUMPY_MM_MIN:
        return None, seen
    W = red_width(MUL, L)
    a, b, o = _affine(rows[hs, ca], C, g), _affine(B, C, g), \
        _affine(at[hs] + n * (W - 1), C, g)
    if a is None or b is None or o is None or b[2] != 0 or min(a[1:] + b[1:2]) < 0:
        return None, seen
    if not (_injective((a[1], a[2], ta), (C, g, L)) and _injective((b[1], tb, sb), (C, L, n))):
        return None, seen
    after = int(hs[C * g - 1]) + META + 1
    return (after, (C, g, n, L), (a[0], a[1], a[2], ta), (b[0], b[1], tb, sb),
            (o[0], o[1], o[2], 1)), after


def _mm_views(step, v):
    """A (C, g, L), B (C, L, n) and the outputs (C, g, n) of a batched product, views of
    ``v``."""
    _, (C, g, n, L), a, b, o = step
    return (_view(v, a[0], (C, g, L), a[1:]), _view(v, b[0], (C, L, n), b[1:]),
            _view(v, o[0], (C, g, n), o[1:]))


def _mm_forward(step, v):
    A, B, O = _mm_views(step, v)
    np.matmul(A, B, out=O)


def _mm_reverse(step, v, adj, first=False):
    """A batched product's reverse: ``G @ B^T`` added to A's adjoints, ``A^T @ G`` to B's
    (written, ``0.0 + t``, when ``first``: ``_mm_first``)."""
    A, B, _ = _mm_views(step, v)
    gA, gB, G = _mm_views(step, adj)
    gA += np.matmul(G, B.transpose(0, 2, 1))
    if first:  # (into gB, then 0.0 added there: no 2 MB temporary for gmm, 30 us)
        np.matmul(A.transpose(0, 2, 1), G, out=gB)
        np.add(gB, 0.0, out=gB)
    else:
        gB += np.matmul(A.transpose(0, 2, 1), G)


#: a run of consecutive elementwise instructions of the same op, length, strides and
#: constants whose operands' first slots step evenly from one to the next, in batches (a
#: (C, g, n) grid each: gmm's 250 ``x - mu`` of 1,000 points, the points' 10 rows again for
#: each of 25 components) runs as NumPy calls over views when its elements together reach
#: the op's ``NUMPY_MIN`` (``_ew_group``): an exp's or log's forward (``_grp_forward``:
#: NumPy's SIMD loops), the reverse when an operand's gradients are summed
#: (``_grp_reverse``: a broadcast one's pairwise over each instruction's elements, as
#: eager mode's sum over the broadcast axis, where the compiled loop's adds each wait on
#: the last: gmm's 250 ``x - mu``, 0.3 ms). What eager mode computes, within rounding of
#: the expansion, the same bits on every call and thread. The arithmetic forwards and the
#: other rules stay compiled: over 2-D views of gmm's strided slots NumPy's ``x - mu``
#: took 0.25 ms, the loop 0.12; its rules take two passes where the loop takes one
GRP = "grp"


def _grid_span(s0, strides, shape):
    """[first, last] slot of a grid of slots from ``s0`` (strides not negative)."""
    return s0, s0 + sum((m - 1) * t for t, m in zip(strides, shape))


def _run_of(rows, h, kind):
    """The heads of the consecutive instructions of ``kind`` from ``h`` on whose head and
    meta rows carry ``h``'s shape columns (4 and 5), and the row after the last of them."""
    nr = rows.shape[0]
    hs = [h]
    key = rows[h, 4:6].tolist() + rows[h + 1:h + META + 1, 4:6].ravel().tolist()
    while hs[-1] + 2 * (META + 1) <= nr and rows[hs[-1] + META + 1, 0] == kind:
        e = hs[-1] + META + 1
        if rows[e, 4:6].tolist() + rows[e + 1:e + META + 1, 4:6].ravel().tolist() != key:
            break
        hs.append(e)
    return hs, hs[-1] + META + 1


def _ew_group(rows, h, at):
    """((row after, (GRP, op, (C, g, n), the operands' (first slot, strides) or None, c0,
    c1, the gradients' (index, first slot, strides), whether the reverse runs in NumPy,
    whether the forward does)) of
    the run of elementwise instructions from row ``h`` run as one NumPy call over (C, g,
    n) views, or None; and the row after the instructions looked at. One call: at least
    two instructions of the same op (an exp or log, ``TRANSCENDENTAL``, or one of
    ``NP_RULES``), length, strides, constants and inactive
    marks, consecutive, strides not negative, every operand's first slot affine in (batch,
    instruction) with steps not negative (gmm's ``x - mu``: the points' rows again for
    each of 25 components), no operand reading the run's own outputs, ``NUMPY_MIN``
    elements in all. Its reverse runs in NumPy when an operand's gradients are summed
    (a broadcast one: ``x - mu``'s ``mu``), which the compiled loop adds one at a time,
    each add waiting on the last; the others' rules stay compiled (one pass over the
    elements where NumPy's take two: gmm's ``Qxc * Qxc``). In NumPy: a rule in
    ``NP_RULES``, and each operand that takes gradients (but one whose gradient reaches
    no input: ``mark_inactive``'s bits, never read) with no slot twice but along the
    summed axes, apart from the others' or the same slots (``x * x``)."""
    n, code, st = info(rows, h)
    op = OPS[code]
    if op.name not in TRANSCENDENTAL and op.name not in NP_RULES or min(st) < 0:
        return None, h
    hs, seen = _run_of(rows, h, ARR)
    G = len(hs)
    if G < 2 or G * n < NUMPY_MIN.get(op.name, 1 << 62):
        return None, seen
    hs = np.array(hs)
    present = [j for j in range(3) if rows[h, 1 + j] >= 0]
    # g: the instructions of the first batch, those of the longest run from the first
    # along which every operand steps evenly
    g = G
    for j in present:
        d = np.diff(rows[hs, 1 + j])
        brk = np.nonzero(d != d[0])[0]
        if brk.size:
            g = min(g, int(brk[0]) + 1)
    C = G // g
    if C * g * n < NUMPY_MIN.get(op.name, 1 << 62):
        return None, seen
    after = int(hs[C * g - 1]) + META + 1
    k0 = int(at[h])
    if not (at[hs[:C * g]] == k0 + n * np.arange(C * g)).all():
        return None, seen
    shape = (C, g, n)
    opnds = [None] * 3
    for j in present:
        af = _affine(rows[hs, 1 + j], C, g)
        if af is None or min(af[1:]) < 0:
            return None, seen
        strides = (af[1], af[2], st[j])
        lo, hi = _grid_span(af[0], strides, shape)
        if not (hi < k0 or lo >= k0 + C * g * n):
            return None, seen
        opnds[j] = (af[0], strides)
    flag = rows[h + META, 5]
    grads = []
    numpy_rev = False
    if flag != 1.0:
        sk = int(-flag) if flag < 0 else 0
        for j in present:
            if GRAD_BITS[code] >> j & 1 and not sk >> j & 1:
                s0, strides = opnds[j]
                kept = [(t, m) for t, m in zip(strides, shape) if t != 0 and m > 1]
                numpy_rev |= len(kept) < sum(m > 1 for m in shape)
                if not _injective([t for t, _ in kept], [m for _, m in kept]):
                    return None, seen
                grads.append((j, s0, strides))
        if numpy_rev:
            if op.name not in NP_RULES:
                return None, seen
            for i, (_, s0, sa) in enumerate(grads):
                for _, t0, tb in grads[i + 1:]:
                    a0, a1 = _grid_span(s0, sa, shape)
                    b0, b1 = _grid_span(t0, tb, shape)
                    if (s0, sa) != (t0, tb) and not (a1 < b0 or b1 < a0):
                        return None, seen
    # (its forward in NumPy for a vectorized exp or log: arithmetic over 2-D views of
    # strided slots took longer than the compiled loop, 0.25 against 0.12 ms for gmm's)
    numpy_fw = op.name in TRANSCENDENTAL
    if not (numpy_fw or numpy_rev):
        return None, seen
    return (after, (GRP, op, shape, tuple(opnds), float(rows[h, 4]), float(rows[h, 5]),
                    tuple(grads), numpy_rev, numpy_fw)), seen


def _grp_view(v, o, shape):
    """The view of ``v`` at an operand's grid ``o`` (first slot, strides); a float for one
    slot; None when absent."""
    if o is None:
        return None
    s0, strides = o
    if not any(strides):
        return float(v[s0])
    return _view(v, s0, shape, strides, False)


def _grp_forward(step, v, k):
    """A run of elementwise instructions (``_ew_group``) from slot ``k``, one NumPy call."""
    _, op, shape, opnds, c0, c1, _, _, _ = step
    _np_apply(op, v[k:k + shape[0] * shape[1] * shape[2]].reshape(shape),
              *(_grp_view(v, o, shape) for o in opnds), c0, c1)


def _grp_reverse(step, v, adj, k):
    """The reverse of a run of elementwise instructions from slot ``k`` in NumPy: each
    operand's gradients by its op's rule (``NP_RULES``), as the compiled loop computes
    each; a broadcast operand's summed pairwise over the axes it is broadcast along
    (``np.sum`` over them, as eager mode), within rounding of the expansion."""
    _, op, shape, opnds, c0, _, grads, _, _ = step
    m = shape[0] * shape[1] * shape[2]
    g = adj[k:k + m].reshape(shape)
    out = v[k:k + m].reshape(shape)
    a, b = (_grp_view(v, o, shape) for o in opnds[:2])
    rules = NP_RULES[op.name]
    s = None
    for j, s0, strides in grads:
        rule, sign = rules[j]
        if s is None and rule is not _g:
            s = np.empty(shape)
        t = rule(g, a, b, out, c0, s)
        add = np.add if sign > 0 else np.subtract
        summed = tuple(i for i in range(3) if strides[i] == 0 and shape[i] > 1)
        if len(summed) == sum(x > 1 for x in shape):
            adj[s0] += float(np.sum(t)) if sign > 0 else -float(np.sum(t))
            continue
        if summed:
            t = np.add.reduce(t, axis=summed, keepdims=True)
        dst = _view(adj, s0, t.shape, strides)
        add(dst, t, out=dst)


#: (the plan's mark of a run of sums as one NumPy call: ``_red_group``)
RGRP = "rgrp"


def _red_group(rows, h, at):
    """((row after, (RGRP, terms' (first slot, strides), their shape (C, g, n, L), the
    outputs' (first slot, strides)) of the run of sum instructions from row ``h`` run as
    one NumPy call, or None; the row after the instructions looked at. One call:
    consecutive sums (no scalar row between) of the same shape, strides and inactive
    marks, each's first term affine in (batch, instruction), strides not negative, the
    terms' grid with no slot twice (their gradients added through a view), at least
    ``NUMPY_RED_MIN`` terms in all (gmm's 25 sums over the coordinates of 1,000 points:
    ``Qxc * Qxc`` summed, 250,000 terms). Forward ``np.add.reduce`` along the terms (in
    order along a strided axis, as eager mode's sum over an axis), within rounding of the
    expansion; reverse each term's ``g`` added once, the compiled loop's bits."""
    if int(rows[h + 1, 5]) != ADD:
        return None, h
    n, _, (sa, sb, ta, tb, L) = info(rows, h)
    hs, seen = _run_of(rows, h, RED)
    G = len(hs)
    if G < 2 or L < 2 or G * n * L < NUMPY_RED_MIN or min(sa, ta) < 0:
        return None, seen
    hs = np.array(hs)
    d = np.diff(rows[hs, 1])
    brk = np.nonzero(d != d[0])[0]
    g = int(brk[0]) + 1 if brk.size else G
    C = G // g
    if C * g * n * L < NUMPY_RED_MIN:
        return None, seen
    af = _affine(rows[hs, 1], C, g)
    if af is None or min(af[1:]) < 0:
        return None, seen
    shape = (C, g, n, L)
    strides = (af[1], af[2], sa, ta)
    if not _injective(strides, shape):
        return None, seen
    W = red_width(ADD, L)
    o0 = int(at[h]) + n * (W - 1)
    ostr = (g * n * W, n * W, 1)
    lo, hi = _grid_span(af[0], strides, shape)
    if not hi < int(at[h]):  # (terms before the sums' slots)
        return None, seen
    after = int(hs[C * g - 1]) + META + 1
    return (after, (RGRP, (af[0], strides), shape, (o0, ostr))), seen


def _rgrp_views(step, v):
    _, (t0, ts), shape, (o0, os_) = step
    return _view(v, t0, shape, ts), _view(v, o0, shape[:3], os_)


def _rgrp_forward(step, v):
    T, O = _rgrp_views(step, v)
    np.add.reduce(T, axis=3, out=O)


def _rgrp_reverse(step, v, adj, first=False):
    """Each term's ``g`` added to its adjoint (written, ``0.0 + g``, when ``first``:
    ``_rgrp_first``)."""
    T, G = _rgrp_views(step, adj)
    if first:
        np.add(0.0, G[..., None], out=T)
    else:
        np.add(T, G[..., None], out=T)


#: (the plan's mark of a run of constant rows written by one copy: ``_const_fills``)
CONSTS = "consts"
#: the fewest consecutive constant rows copied by NumPy rather than run one by one
CONST_RUN = 64


def _const_fills(rows, plan):
    """``plan`` with each run of ``CONST_RUN`` or more constant scalar rows in a compiled
    step written by one copy of their values (their bits): kmeans' points, a (8, 1000)
    constant traced as 8,000 rows, took 12.7 us a call through the compiled loop."""
    at, nslots = row_slots(rows)
    nr = rows.shape[0]
    isconst = rows[:, 0] == CONST  # (instructions' rows hold other opcodes there)
    out = []
    for step in plan:
        r0, r1, k0, k1, op = step
        if op is not None or r1 - r0 < CONST_RUN:
            out.append(step)
            continue
        d = np.diff(np.concatenate(([0], isconst[r0:r1].astype(np.int8), [0])))
        cur = r0
        for a, b in zip((np.nonzero(d == 1)[0] + r0).tolist(),
                        (np.nonzero(d == -1)[0] + r0).tolist()):
            if b - a < CONST_RUN:
                continue
            if a > cur:
                out.append((cur, a, int(at[cur]), int(at[a]), None))
            out.append((a, b, int(at[a]), int(at[a]) + b - a,
                        (CONSTS, np.ascontiguousarray(rows[a:b, 4]))))
            cur = b
        if cur < r1:
            out.append((cur, r1, int(at[cur]) if cur < nr else nslots, k1, None))
    return out


def _no_rules(rows, back):
    """``back`` without the compiled reverse steps over rows whose rules pass nothing:
    constants' and inputs' scalar rows and leaf instructions (kmeans' 8,000 points, a
    constant traced as scalar rows: 12 us a call of a sweep that did nothing)."""
    heads = heads_of(rows)
    out = []
    for step in back:
        r, _, lo, kind = step
        if kind is None:
            hs = heads[(heads >= lo) & (heads <= r)]
            scalar = np.ones(r + 1 - lo, dtype=np.bool_)
            for j in range(META + 1):
                scalar[hs - lo + j] = False
            ops = rows[lo:r + 1, 0][scalar]
            if ((ops == LEAF) | (ops == CONST)).all() and (rows[hs, 0] == ARR).all() \
                    and (rows[hs + 1, 5] == LEAF).all():
                continue
        out.append(step)
    return out


def _rgrp_compiled(rows, back, firsts):
    """``back`` with the reverse of each run of sums (``_red_group``) that adds to its
    terms' adjoints (not in ``firsts``) and whose sums are long (``RGRP_LOOP_L`` terms or
    more) run by the compiled loop (``red_reverse``) over their rows: the same adds, one
    pass, where NumPy's broadcast add over the (C, g, n, L) views took 3 to 4 times as long
    (kmeans' Hessian-vector program: 80 sums of 1,000 gradients in blocks of 128, 25 us
    compiled, 88 us in NumPy)."""
    at, nslots = row_slots(rows)
    out = []
    for step in back:
        r0, _, r1, kind = step
        if (type(kind) is tuple and kind[0] is RGRP and r0 not in firsts
                and kind[2][3] >= RGRP_LOOP_L):
            k1 = int(at[r1]) if r1 < rows.shape[0] else nslots
            step = (r1 - 1, k1 - 1, r0, RED)
        out.append(step)
    return out


#: the least terms a sum of a run of sums (``_red_group``) for its reverse to be compiled
#: (``_rgrp_compiled``); shorter sums' adds (gmm's 10 coordinates) stay one NumPy call
RGRP_LOOP_L = 64


def _rgrp_first(rows, back, out):
    """{first row: (start, stop)} of the runs of sums (``_red_group``) whose terms are a
    contiguous run of slots that no row or instruction after them reads and no output is:
    their reverse writes the terms' adjoints first (``0.0 + g``), so they are not zeroed
    (gmm's ``Qxc * Qxc``: 250,000 slots)."""
    res = {}
    outs = np.asarray(out)
    heads = heads_of(rows)
    for r0, _, r1, kind in back:
        if type(kind) is not tuple or kind[0] is not RGRP:
            continue
        _, (t0, ts), shape, _ = kind
        lo, hi = t0, t0 + shape[0] * shape[1] * shape[2] * shape[3]
        if _grid_span(t0, ts, shape)[1] != hi - 1:
            continue
        if ((outs >= lo) & (outs < hi)).any() or _read_after(rows, r1, lo, hi, heads):
            continue
        res[r0] = (lo, hi)
    return res

#: whether a run of squares summed is one step (``_sum_squares``); off, the squares and
#: their sums are steps of their own, as before
FUSE_SQUARES = True
#: (the plans' mark of a run of squares summed, ``_sum_squares``)
SQS = "sqs"


def _grid(s0, strides, shape):
    """The slots of a grid from ``s0`` (an int64 array of ``shape``)."""
    g = np.full(shape, s0, dtype=np.int64)
    for ax, (t, m) in enumerate(zip(strides, shape)):
        g += t * np.arange(m, dtype=np.int64).reshape((-1,) + (1,) * (len(shape) - ax - 1))
    return g


def _affine_grid(X):
    """(first, strides) of the int array ``X`` if affine in its indices, else None."""
    s0 = int(X.flat[0])
    strides = tuple(int(np.take(X, 1, ax).flat[0] - s0) if X.shape[ax] > 1 else 0
                    for ax in range(X.ndim))
    return (s0, strides) if np.array_equal(X, _grid(s0, strides, X.shape)) else None


def _reads_any(rows, r, starts, stops, heads):
    """``_read_after`` of many ranges at once: whether a row or instruction from row ``r`` on
    reads a slot in one of the sorted, disjoint ranges [starts, stops)."""
    def hit(lo, hi):  # [lo, hi] (inclusive) against the ranges
        i = np.searchsorted(starts, hi, side="right") - 1
        return (i >= 0) & (stops[np.maximum(i, 0)] > lo)
    later = rows[r:]
    scalar = later[:, 0] != TAIL
    hl = heads[heads >= r] - r
    scalar[hl[(later[hl, 0] == ARR) | (later[hl, 0] == RED)]] = False
    ops = later[scalar, 1:4].astype(np.int64).ravel()
    ops = ops[ops >= 0]
    if ops.size and hit(ops, ops).any():
        return True
    hs = heads[heads >= r]
    if not hs.size:
        return False
    _, sp, _ = spans(rows, hs)
    on = sp[..., 0] >= 0
    return bool(hit(sp[..., 0][on], sp[..., 1][on]).any())


def _square_run(rows, at, r0, plo, phi, inactive):
    """The instructions right before row ``r0`` that square slots ``plo .. phi`` in one run:
    ``x * x`` elementwise instructions of one length and stride, each squaring one operand
    range (no third operand), their inactive flags all ``inactive``, their outputs
    contiguous from ``plo`` and covering exactly ``plo .. phi``. (heads, length, strides)
    or None."""
    hs, h = [], r0 - META - 1
    while h >= 0 and rows[h, 0] == ARR and int(at[h]) >= plo:
        hs.append(h)
        h -= META + 1
    if not hs:
        return None
    hs = np.array(hs[::-1])
    n, code, st = info(rows, int(hs[0]))
    if code != MUL or st[0] != st[1] or st[0] <= 0 \
            or not all(info(rows, int(e)) == (n, code, st) for e in hs) \
            or (rows[hs, 1] != rows[hs, 2]).any() or (rows[hs, 3] >= 0).any() \
            or (rows[hs + META, 5] != inactive).any() \
            or not (at[hs] == plo + n * np.arange(len(hs))).all() \
            or int(at[hs[0]]) != plo or plo + n * len(hs) != phi:
        return None
    return hs, n, st


def _sum_squares(rows, back, out, rg_firsts):
    """{first row of the sums: (SQS, the squares' first row, the outputs' (first slot,
    strides), the squared operand's, the shape (C, g, n, L))} of the runs of sums
    (``_red_group``) whose terms are the squares ``x * x`` of the run of ``mul``
    instructions right before them (gmm's ``sum(Qxc * Qxc, 1)``): its forward is one pass
    summing each output's squares in order, the expansion's adds, the squares not stored;
    its reverse writes each ``x``'s adjoint ``(0.0 + t) + t``, ``t`` the term's gradient
    ``0.0 + g`` times ``x``: the sums' and the squares' compiled rules on zeroed adjoints,
    to the bit, with neither the squares' adjoints nor ``x``'s zeroed first (gmm: 500,000
    slots stored and read back, 250,000 zeroed). Only where exactly so: the sums write
    their terms' adjoints first (``_rgrp_first``: nothing else reads the squares), every
    square's two operands are the same slot of ``x``, gradients to both, and every slot
    of ``x`` is one term's (no slot twice), none an output nor read by anything after the
    sums, apart from the squares and the sums' outputs."""
    at = row_slots(rows)[0]
    heads = heads_of(rows)
    outs = np.asarray(out)
    res = {}
    for r0, _, r1, kind in back if FUSE_SQUARES else ():
        if type(kind) is not tuple or kind[0] is not RGRP or r0 not in rg_firsts:
            continue
        plo, phi = rg_firsts[r0]
        _, (t0, ts), shape, (o0, os_) = kind
        found = _square_run(rows, at, r0, plo, phi, 0.0)
        if found is None:
            continue
        hs, n, st = found
        P = _grid(t0, ts, shape)
        if not np.array_equal(np.sort(P.ravel()), np.arange(plo, phi)):
            continue
        q = P - plo
        X = rows[hs, 1].astype(np.int64)[q // n] + (q % n) * st[0]
        xg = _affine_grid(X)
        xs = np.sort(X.ravel())
        if xg is None or (np.diff(xs) == 0).any():
            continue
        O = _grid(o0, os_, shape[:3]).ravel()
        if (np.isin(xs, O).any() or ((xs >= plo) & (xs < phi)).any()
                or np.isin(xs, outs).any()):
            continue
        brk = np.nonzero(np.diff(xs) != 1)[0] + 1  # x's slots as ranges [start, stop)
        starts = xs[np.concatenate([[0], brk])]
        stops = xs[np.concatenate([brk - 1, [xs.size - 1]])] + 1
        if _reads_any(rows, r1, starts, stops, heads):
            continue
        res[r0] = (SQS, int(hs[0]), (o0, os_), xg, shape, list(zip(starts.tolist(),
                                                                  stops.tolist())))
    return res


def _sqs_back(rows, back, sqs):
    """The reverse plan with each run of squares summed (``_sum_squares``) one step, the
    squares' rows left out of the compiled step before it; and the runs so taken (a plan
    not as expected keeps its steps)."""
    at = row_slots(rows)[0]
    back, done = list(back), {}
    for r0, step in sqs.items():
        m0 = step[1]
        bi = [i for i, s in enumerate(back) if s[0] == r0 and type(s[3]) is tuple
              and s[3][0] is RGRP]
        if len(bi) != 1 or bi[0] + 1 >= len(back):
            continue
        bi = bi[0]
        q = back[bi + 1]  # (the compiled step whose last rows are the squares)
        if q[3] is not None or q[0] != r0 - 1 or q[2] > m0:
            continue
        back[bi] = back[bi][:3] + (step,)
        back[bi + 1:bi + 2] = [(m0 - 1, int(at[m0]) - 1, q[2], None)] if q[2] < m0 else []
        done[r0] = step
    return back, done


def _sqs_plan(rows, plan, sqs):
    """The forward plan with each run of squares summed (``_sum_squares``) one step, the
    squares' rows left out of the compiled step before it, or that step left out when it
    is the squares' one instruction in NumPy (kmeans' ``diff * diff``); a plan not as
    expected keeps its steps."""
    at = row_slots(rows)[0]
    plan = list(plan)
    for r0, step in sqs.items():
        m0 = step[1]
        fi = [i for i, s in enumerate(plan) if s[0] == r0 and type(s[4]) is tuple
              and s[4][0] is RGRP]
        if len(fi) != 1 or fi[0] == 0:
            continue
        fi = fi[0]
        p = plan[fi - 1]  # (the compiled step whose last rows are the squares)
        if p[4] is not None and not (isinstance(p[4], Op) and p[0] == m0) \
                or p[1] != r0 or p[0] > m0:
            continue
        plan[fi] = plan[fi][:4] + (step,)
        plan[fi - 1:fi] = [(p[0], m0, p[2], int(at[m0]), None)] if p[0] < m0 else []
    return plan


def _sqs_inactive(rows, plan, out):
    """The forward plan with each run of squares summed that passes no gradient (its sums
    and squares flagged inactive, ``mark_inactive``: no reverse step runs them; kmeans'
    Hessian-vector program's distances, which only its min's tie masks read) one forward
    step (``_sum_squares``' forward: each output its squares added in order, the
    expansion's bits), the squares not stored; where the squared slots are a ``detach``
    instruction's copy (``cut_dead``'s, of kmeans' 80,000 differences) that nothing else
    reads, the step reads the detach's operand and the copy is left out. Only where the
    squares are read by nothing but the sums and are no output, each square's two operands
    one slot, the sums' terms exactly the squares' slots."""
    if not FUSE_SQUARES:
        return plan
    at = row_slots(rows)[0]
    heads = heads_of(rows)
    outs = np.asarray(out)
    dt = BY_NAME["detach"]
    sqs = {}
    for i, (r0, r1, _, _, op) in enumerate(plan):
        if type(op) is not tuple or op[0] is not RGRP or i == 0 or rows[r0 + META, 5] != 1.0:
            continue
        _, (t0, ts), shape, (o0, os_) = op
        P = _grid(t0, ts, shape)
        plo, phi = int(P.min()), int(P.max()) + 1
        if P.size != phi - plo or not np.array_equal(np.sort(P.ravel()), np.arange(plo, phi)):
            continue
        found = _square_run(rows, at, r0, plo, phi, 1.0)
        if found is None or ((outs >= plo) & (outs < phi)).any() \
                or _read_after(rows, r1, plo, phi, heads):
            continue
        hs, n, st = found
        q = P - plo
        X = rows[hs, 1].astype(np.int64)[q // n] + (q % n) * st[0]
        xg = _affine_grid(X)
        if xg is None:
            continue
        sqs[r0] = (SQS, int(hs[0]), (o0, os_), xg, shape, [])
    plan = _sqs_plan(rows, plan, sqs)
    # the squared slots a detach's copy that only the squares read: read at its operand
    for j, (r0, _, _, _, op) in enumerate(plan):
        if type(op) is not tuple or op[0] is not SQS or r0 not in sqs:
            continue
        m0 = op[1]
        X = _grid(op[3][0], op[3][1], op[4])
        xlo, xhi = int(X.min()), int(X.max()) + 1
        for d, step in enumerate(plan[:j]):
            if step is None:
                continue
            d0, d1, dk0, dk1, dop = step
            if d1 != d0 + META + 1 or rows[d0, 0] != ARR or not dk0 <= xlo < xhi <= dk1:
                continue
            dn, dcode, dst = info(rows, d0)
            if dcode != dt.code or dst[0] != 1 or dop not in (None, dt) \
                    or ((outs >= dk0) & (outs < dk1)).any() \
                    or _read_after(rows[:m0], d1, dk0, dk1, heads[heads < m0]) \
                    or _read_after(rows, r0, dk0, dk1, heads):
                break
            shift = int(rows[d0, 1]) - dk0
            plan[j] = plan[j][:4] + (op[:3] + ((op[3][0] + shift, op[3][1]),) + op[4:],)
            plan[d] = None
            break
    return [p_ for p_ in plan if p_ is not None]


@njit_cached(nogil=True)
def _sqs(v, adj, rev, o0, oc, og, on, x0, xc, xg, xn, xl, C, G, N, L):
    """A run of squares summed (``_sum_squares``), one function for both sweeps (one cold
    compile, 0.4 s). Forward (``rev`` False): each output the sum in order of its ``L``
    squares ``x * x`` (the expansion's chain of adds, ``((p0 + p1) + p2) ..``), the
    squares not stored. Reverse: each ``x``'s adjoint written ``(0.0 + t) + t``, ``t =
    (0.0 + g) * x`` of its output's ``g``: the sum's term written ``0.0 + g`` and ``x *
    x``'s two rules added to a zeroed adjoint, the same operations. Outputs and ``x``
    contiguous along the outputs (gmm's): a term at a time over a row kept in a scratch
    array, loops LLVM vectorizes (an output at a time, its terms' loads 19,000 slots
    apart, took 80 us more of gmm's 1.3 ms); else an output at a time (unsigned indices:
    no wraparound test, as the generated loops)."""
    if xn == 1 and on == 1:
        acc = np.empty(N)
        for c in range(C):
            for j in range(G):
                ob = o0 + c * oc + j * og
                xb = x0 + c * xc + j * xg
                if rev:
                    Gv = adj[ob:ob + N]
                    for i in range(N):
                        acc[i] = 0.0 + Gv[i]
                    for d in range(L):
                        X = v[xb + d * xl:xb + d * xl + N]
                        A = adj[xb + d * xl:xb + d * xl + N]
                        for i in range(N):
                            t = acc[i] * X[i]
                            A[i] = (0.0 + t) + t
                    continue
                X = v[xb:xb + N]
                for i in range(N):
                    acc[i] = X[i] * X[i]
                for d in range(1, L):
                    X = v[xb + d * xl:xb + d * xl + N]
                    for i in range(N):
                        acc[i] = acc[i] + X[i] * X[i]
                O = v[ob:ob + N]
                for i in range(N):  # (a loop: a slice assigned cost 2 s of cold compile)
                    O[i] = acc[i]
        return
    for c in range(C):
        for j in range(G):
            ob = o0 + c * oc + j * og
            xb = x0 + c * xc + j * xg
            for i in range(N):
                s = xb + i * xn
                if rev:
                    gi = 0.0 + adj[np.uint64(ob + i * on)]
                    for d in range(L):
                        k = np.uint64(s + d * xl)
                        t = gi * v[k]
                        adj[k] = (0.0 + t) + t
                    continue
                a = v[np.uint64(s)]
                sq = a * a
                for d in range(1, L):
                    a = v[np.uint64(s + d * xl)]
                    sq = sq + a * a
                v[np.uint64(ob + i * on)] = sq


def _sqs_args(step):
    _, _, (o0, os_), (x0, xs), shape, _ = step
    return (o0, *os_, x0, *xs, *shape)


def _np_reducible(rows, h):
    """Whether the reduction instruction at row ``h`` runs its forward in NumPy
    (``NUMPY_RED_MIN``): enough terms, no negative stride (views by ``as_strided`` from
    the first term)."""
    n, _, (sa, sb, ta, tb, L) = info(rows, h)
    dot = int(rows[h + 1, 5]) == MUL
    return n * L >= NUMPY_RED_MIN and min(sa, ta) >= 0 and (not dot or min(sb, tb) >= 0)


def _np_red_forward(rows, h, k, v, shift=0):
    """The reduction instruction at row ``h`` (its chains from slot ``k``) by NumPy
    (``NUMPY_RED_MIN``) into its output slots; its terms ``shift`` slots on
    (``_skip_detach``)."""
    n, L = int(rows[h + 1, 4]), int(rows[h, 4])
    step, A, B = _red_views(rows, h, v, shift)
    o = k + n * (red_width(step, L) - 1)
    out = v[o:o + n]
    if step == MUL:
        np.einsum("it,it->i", A, B, out=out)
    elif step == MAX:
        np.maximum.reduce(A, axis=1, out=out)
    elif step == MIN:
        np.minimum.reduce(A, axis=1, out=out)
    else:
        np.add.reduce(A, axis=1, out=out)


def _np_reversible(rows, h):
    """Whether the reverse of the elementwise instruction at row ``h`` runs in NumPy: its op's
    rule in ``NP_RULES``, a broadcast operand that takes a gradient, ``NUMPY_BCAST_MIN``
    elements or more, strides not negative, and every slot its
    gradients go to getting them in the compiled loop's order: each strided operand's slots
    apart from the others' or the same slots (``x * x``: a's then b's, element by element
    as in the loop)."""
    if rows[h, 0] != ARR:
        return False
    n, code, st = info(rows, h)
    op = OPS[code]
    if op.name not in NP_RULES or min(st) < 0:
        return False
    ops = _grad_operands(rows, h)
    if n < NUMPY_BCAST_MIN or not any(sj == 0 for _, _, sj in ops):
        return False
    spans_ = [(s0, sj) for _, s0, sj in ops if sj > 0]
    for i, (s0, sj) in enumerate(spans_):
        for t0, tj in spans_[i + 1:]:
            if (s0, sj) != (t0, tj) and not (s0 + (n - 1) * sj < t0 or t0 + (n - 1) * tj < s0):
                return False
    return True


def _np_reverse(op, rows, h, k, v, adj, first=()):
    """The reverse of the elementwise instruction at row ``h`` (slots ``k ..``) by its op's
    rule in NumPy (``NP_RULES``) over views of the values and adjoints: each element's
    gradient as the compiled loop computes it; a broadcast operand's summed pairwise
    (``np.sum``, eager mode's sum over the broadcast axis), within rounding of the
    expansion's adds in order, the same on every call."""
    n = int(rows[h + 1, 4])
    g = adj[k:k + n]
    out = v[k:k + n]
    a, b, _ = _operands(rows, h, n, v)
    c0 = float(rows[h, 4])
    rules = NP_RULES[op.name]
    s = None
    for j, s0, sj in _grad_operands(rows, h):
        rule, sign = rules[j]
        if s is None and rule is not _g:
            s = np.empty(n)
        t = rule(g, a, b, out, c0, s)
        if sj == 0:
            adj[s0] += float(np.sum(t)) if sign > 0 else -float(np.sum(t))
        elif (s0, s0 + n) in first:  # the first to write them: 0.0 + t, as added to zeros
            (np.add if sign > 0 else np.subtract)(0.0, t, out=adj[s0:s0 + n])
        else:
            dst = adj[s0:s0 + (n - 1) * sj + 1:sj]
            (np.add if sign > 0 else np.subtract)(dst, t, out=dst)


#: (the reverse plan's mark of a sum whose reverse writes its terms' adjoints:
#: ``_first_writers``)
ASSIGN = "assign"


def _first_writers(rows, plan, out):
    """{first row: (first term's slot, slot after the last)} of the sums run in NumPy
    (``NPRED``) whose terms are a contiguous run of slots that no other row nor
    instruction reads and no output is: the reverse sweep reaches their adjoints first at
    the sum, which writes them (``_red_assign``: each term's ``0.0 + g``, what adding to a
    zeroed adjoint gives, to the bit), so they are not zeroed first (lse's sums of its
    exps and picks: 1.3 million slots, 0.3 ms of zeroing)."""
    cands = {}
    ew = None
    for r0, r1, _, _, op in plan:
        hs = [r0]
        if op is RED and r1 - r0 > META + 1:
            # (and the sums of one output in a run of compiled reductions whose terms an
            # elementwise instruction made: the rest after a long sum's blocks, lse's
            # last 64 exps and picks at n = 200,000; their step is split in reverse)
            if ew is None:
                at = row_slots(rows)[0]
                hh = heads_of(rows)
                hh = hh[rows[hh, 0] == ARR]
                ew = (at[hh], at[hh] + rows[hh + 1, 4].astype(np.int64))
            hs = [h for h in range(r0, r1) if rows[h, 0] == RED and rows[h + 1, 4] == 1.0
                  and np.any((ew[0] <= rows[h, 1]) & (rows[h, 1] + rows[h, 4] <= ew[1]))]
        elif op is not NPRED:
            continue
        for h in hs:
            if rows[h + META, 5] == 1.0 or int(rows[h + 1, 5]) != ADD or rows[h, 2] >= 0:
                continue
            n, _, (sa, sb, ta, tb, L) = info(rows, h)
            if ta == 1 and (sa == L or n == 1):
                a = int(rows[h, 1])
                cands[h] = (a, a + n * L)
    # (a compiled one only as the rest after a sum in NumPy: elsewhere its own step in
    # reverse costs the driver more than the zeroing it saves)
    npred = {p_[0] for p_ in plan if p_[4] is NPRED}
    ends = {c[1] for h, c in cands.items() if h in npred}
    cands = {h: c for h, c in cands.items() if h in npred or c[0] in ends}
    if not cands:
        return cands
    lo = np.array([c[0] for c in cands.values()])
    hi = np.array([c[1] for c in cands.values()])
    read = np.zeros(len(cands), dtype=bool)  # read elsewhere: not a first writer

    def reads(s0, s1):  # slots [s0, s1] read: which candidates they overlap
        return (s0 < hi) & (s1 >= lo)
    for o in np.asarray(out).tolist():
        read |= reads(o, o)
    heads = heads_of(rows)
    tails = (rows[:, 0] == TAIL)
    scalar = ~tails
    scalar[heads[(rows[heads, 0] == ARR) | (rows[heads, 0] == RED)]] = False
    srt = np.sort(rows[scalar, 1:4].ravel())
    srt = srt[srt >= 0]
    if srt.size:  # (the least slot a scalar row reads from each candidate's first)
        idx = np.searchsorted(srt, lo)
        read |= (idx < srt.size) & (srt[np.minimum(idx, srt.size - 1)] < hi)
    names = list(cands)
    if heads.size:
        # each operand's lowest and highest slot over its strides of either sign (a
        # reversed gather's span from its first slot alone misses the slots below it)
        _, sp, _ = spans(rows, heads)
        owner = np.repeat(heads, 3)
        s0, s1 = sp[..., 0].ravel(), sp[..., 1].ravel()
        has = s0 >= 0
        owner, s0, s1 = owner[has], s0[has], s1[has]
        for i, h in enumerate(names):  # (a sum's own terms are no other reader)
            other = owner != h
            read[i] |= bool(((s0 <= hi[i] - 1) & (s1 >= lo[i]) & other).any())
    return {h: c for h, c, r in zip(names, cands.values(), read.tolist()) if not r}


def _skip_detach(rows, plan, out):
    """``plan`` without the NumPy steps of a detach that only extremes of detached values
    run in NumPy read (a max's, whose ties test its operand): they read its operand's
    slots instead, ``(NPRED, shift)``, the same values; its own slots are left as they
    were (lse's copy of 640,000 elements: 0.24 ms)."""
    dt = BY_NAME["detach"]
    new = list(plan)
    for i, (r0, r1, k0, k1, op) in enumerate(plan):
        if op is not dt or info(rows, r0)[2][0] != 1:
            continue
        lo, hi = k0, k1
        if ((np.asarray(out) >= lo) & (np.asarray(out) < hi)).any():
            continue
        scalar = rows[:, 0] != TAIL
        heads = heads_of(rows)
        scalar[heads[(rows[heads, 0] == ARR) | (rows[heads, 0] == RED)]] = False
        ops = rows[scalar, 1:4]
        if ((ops >= lo) & (ops < hi)).any():
            continue
        readers, ok = [], True
        for h in heads.tolist():
            if h == r0:
                continue
            n, code, st = info(rows, h)
            if code == RED:
                sa, sb, ta, tb, L = st
                a = int(rows[h, 1])
                if not (a + (n - 1) * sa + (L - 1) * ta < lo or a >= hi):
                    readers.append(h)
                continue
            for j in range(3):
                s0 = int(rows[h, 1 + j])
                if s0 >= 0 and not (s0 + (n - 1) * st[j] < lo or s0 >= hi):
                    ok = False
        steps = {p_[0]: j for j, p_ in enumerate(plan) if p_[4] is NPRED}
        if not ok or not readers or any(
                h not in steps or rows[h + META, 5] != 1.0 or int(rows[h + 1, 5]) not in (
                    MAX, MIN) or min(info(rows, h)[2][0], info(rows, h)[2][2]) < 0
                or int(rows[h, 1]) < lo or int(rows[h, 1]) + (info(rows, h)[0] - 1)
                * info(rows, h)[2][0] + (info(rows, h)[2][4] - 1) * info(rows, h)[2][2]
                >= hi for h in readers):
            continue
        shift = int(rows[r0, 1]) - k0
        for h in readers:
            j = steps[h]
            new[j] = new[j][:4] + ((NPRED, shift),)
        new[i] = None
    return [p_ for p_ in new if p_ is not None]


#: (the plan's mark of a max or min of detached values over one run of slots, as a flat
#: NumPy extreme where no zero is its result: ``_flat_extremes``)
XRED = "xred"
#: a flat extreme's run has at least this many terms: a NumPy call and a step of the
#: driver cost about what a compiled tree of a few thousand maxima does (gmm's of 25)
FLAT_MIN = 8192


def _extreme_tree(rows, h, at, heads_set, limit=256):
    """(last row, its result's slot, terms M, raw terms read by scalar rows or later
    instructions) when the rows from the reduction instruction at row ``h`` (a max or min
    of contiguous terms) on are a tree of the same extreme whose result is that of terms
    ``[0, M)`` (the slots from the first term's): each row's operands the outputs of
    earlier rows of the tree, or terms after the instruction's own (a long reduction's
    blocks, then the rest); else None."""
    n, _, (sa, _, ta, _, L) = info(rows, h)
    step = int(rows[h + 1, 5])
    if ta != 1 or (sa != L and n != 1):
        return None
    base, N = int(rows[h, 1]), n * L
    cover = {int(o): (i * L, (i + 1) * L) for i, o in
             enumerate(red_outputs(int(at[h]), n, step, L).tolist())}
    raw, best = set(), None
    nr = rows.shape[0]
    r = h + META + 1
    if len(cover) == 1:
        best = (h + META, next(iter(cover)), N, False)

    def take(s):  # the terms' interval that slot s holds, consumed
        if s in cover:
            return cover.pop(s)
        t = s - base
        if N <= t and s < int(at[h]) and t not in raw:
            raw.add(t)
            return (t, t + 1)
        return None
    while r < nr and r < h + limit:
        code = int(rows[r, 0])
        if code == RED and r in heads_set:
            m, _, (sa2, _, ta2, _, L2) = info(rows, r)
            if int(rows[r + 1, 5]) != step or rows[r, 2] >= 0 or rows[r + META, 5] != 1.0:
                break
            A = red_grids(rows, r)[0]
            outs = red_outputs(int(at[r]), m, step, L2).tolist()
            ok = True
            for i in range(m):
                iv = [take(int(s)) for s in A[i].tolist()]
                if any(x is None for x in iv):
                    ok = False
                    break
                iv.sort()
                if any(iv[j][1] != iv[j + 1][0] for j in range(len(iv) - 1)):
                    ok = False
                    break
                cover[int(outs[i])] = (iv[0][0], iv[-1][1])
            if not ok:
                break
            r += META + 1
        elif code == step:
            a, b = take(int(rows[r, 1])), take(int(rows[r, 2]))
            if a is None or b is None:
                break
            lo, hi = sorted((a, b))
            if lo[1] != hi[0]:
                break
            cover[int(at[r])] = (lo[0], hi[1])
            r += 1
        else:
            break
        if len(cover) == 1:
            (s, (lo, hi)), = cover.items()
            if lo == 0 and hi >= N:
                best = (r - 1, s, hi, bool(raw))
    return best


def _flat_extremes(rows, plan, out):
    """``plan`` with each max or min of detached values over a contiguous run of slots (a
    reduction instruction and the tree that reduces its outputs and the rest's terms to
    one slot: ``_extreme_tree``) as one step (XRED, ..) that takes the flat extreme of the
    run by NumPy (``np.max``, vectorized: lse's 640,000 terms took 0.6 ms as 5,000
    maxima of 128 then theirs, 0.06 ms so). The tree's other slots are read by no row
    after it: when that extreme is neither zero nor NaN, the tree's result is it
    whatever the order (equal numbers other than zeros have the same bits), and it is
    written alone; else the tree's steps run as before (their order sets the sign of a
    zero maximum, and which NaN). A max whose gradient matters is no such tree: its
    terms are detached values (``reduce_terms``), the tree's rows flagged inactive."""
    idx = [i for i, p_ in enumerate(plan) if (p_[4] is NPRED or p_[4] is RED or (
        type(p_[4]) is tuple and p_[4][0] is NPRED)) and rows[p_[0], 0] == RED
        and int(rows[p_[0] + 1, 5]) in (MAX, MIN) and rows[p_[0] + META, 5] == 1.0]
    if not idx:
        return plan
    at, nslots = row_slots(rows)
    heads = heads_of(rows)
    heads_set = set(heads.tolist())
    outs = np.asarray(out)
    nr = rows.shape[0]
    slot = lambda r: int(at[r]) if r < nr else nslots  # noqa: E731
    new, j = [], 0
    for i in idx:
        if i < j:
            continue
        h = plan[i][0]
        tree = _extreme_tree(rows, h, at, heads_set)
        if tree is None:
            continue
        last, F, M, raw = tree
        k0 = int(at[h])
        if M < FLAT_MIN or ((outs >= k0) & (outs < F)).any() \
                or _read_after(rows, last + 1, k0, F, heads):
            continue
        if raw:  # the rest's terms read from the run too: a detach's slots
            if not any(rows[g, 0] == ARR and OPS[int(rows[g + 1, 5])].name == "detach"
                       and int(at[g]) <= int(rows[h, 1]) and int(rows[h, 1]) + M
                       <= int(at[g]) + int(rows[g + 1, 4]) for g in heads.tolist()):
                continue
        shift = plan[i][4][1] if type(plan[i][4]) is tuple else 0
        e = i  # the steps of the tree's rows, the last cut after its last row
        while e < len(plan) and plan[e][1] <= last:
            e += 1
        if e == len(plan) or any(p_[4] is not None and p_[4] is not RED and p_[4] is not NPRED
                                 and not (type(p_[4]) is tuple and p_[4][0] is NPRED)
                                 for p_ in plan[i:e + 1]):
            continue
        sub = plan[i:e] + [plan[e][:1] + (last + 1,) + plan[e][2:3] + (slot(last + 1),)
                           + plan[e][4:]]
        lo = int(rows[h, 1]) + shift
        # the detach in NumPy whose slots only the tree reads (the rest's terms kept it,
        # ``_skip_detach``): the flat extreme reads its operand, and the copy runs only
        # before the tree's steps (lse at n = 200,000: 0.1 ms)
        dt = [d for d in range(j, i) if plan[d][4] is BY_NAME["detach"] and shift == 0
              and plan[d][1] == plan[d][0] + META + 1 and plan[d][2] <= lo
              and lo + M <= plan[d][3] and info(rows, plan[d][0])[2][0] == 1
              and not ((outs >= plan[d][2]) & (outs < plan[d][3])).any()
              and _tie_readers(rows, plan[d][2], plan[d][3], heads, (h, last)) == []]
        if dt:
            sub = [plan[dt[0]]] + sub
            lo += int(rows[plan[dt[0]][0], 1]) - plan[dt[0]][2]
        new.extend(p_ for d, p_ in enumerate(plan[j:i], j) if d not in dt[:1])
        new.append((h, last + 1, k0, slot(last + 1),
                    (XRED, int(rows[h + 1, 5]), lo, M, F, sub)))
        if plan[e][1] > last + 1:
            if plan[e][4] is not None and plan[e][4] is not RED:
                new.pop()
                new.extend(plan[i:e + 1])
            else:
                new.append((last + 1,) + plan[e][1:2] + (slot(last + 1),) + plan[e][3:])
        j = e + 1
    new.extend(plan[j:])
    return new


def _xred_forward(step, v):
    """Whether the flat extreme of an XRED step (``_flat_extremes``) is its tree's result,
    which it then writes: neither zero nor NaN."""
    _, code, lo, M, F, _ = step
    f = (np.maximum if code == MAX else np.minimum).reduce(v[lo:lo + M])
    if f != 0.0 and f == f:
        v[F] = f
        return True
    return False


#: (the plans' marks of a max's ties and their count, and of its picks' reverse: ``_ties``)
TIES = "ties"
TIESREV = "tiesrev"


def _tie_readers(rows, lo, hi, heads, skip):
    """The instructions that read a slot in [lo, hi), but for the rows in ``skip`` (first,
    last); None when a scalar row does."""
    scalar = rows[:, 0] != TAIL
    scalar[heads[(rows[heads, 0] == ARR) | (rows[heads, 0] == RED)]] = False
    scalar[skip[0]:skip[1] + 1] = False
    ops = rows[scalar, 1:4]
    if ((ops >= lo) & (ops < hi)).any():
        return None
    res = []
    for g in heads.tolist():
        if skip[0] <= g <= skip[1]:
            continue
        m, code, st = info(rows, g)
        spans_ = ([(int(rows[g, 1]), st[0] * (m - 1) + st[2] * (st[4] - 1)),
                   (int(rows[g, 2]), st[1] * (m - 1) + st[3] * (st[4] - 1))]
                  if code == RED else
                  [(int(rows[g, 1 + i]), st[i] * (m - 1)) for i in range(3)])
        if any(a >= 0 and min(a, a + e) < hi and max(a, a + e) >= lo for a, e in spans_):
            res.append(g)
    return res


def _ties(rows, plan, back, out, sets):
    """(plan, back) with a max's ties (``eq`` or ``eq_nan`` of a run of slots and one
    slot: the max) that only their count (a sum of them all, reduced to one slot: any
    order of its adds gives the count) and their picks read, the picks skipped and their
    sums' reverse writing their adjoints (``_skip_picks``, ``_first_writers``), as one
    forward step (TIES: the tie mask as NumPy bools, kept for the reverse, and its
    ``count_nonzero`` written as the count's value) and one reverse step for the picks'
    sums and rule (TIESREV): the tie values, the count's partial sums and the picks'
    adjoints are never stored. Eager mode, likewise, makes its mask in the backward
    alone (lse at 640,000 elements: the ties and their count took 0.9 ms as two passes
    over float slots)."""
    pk = (BY_NAME["pick"].code, BY_NAME["pick_where"].code)
    heads = None
    at, nslots = row_slots(rows)
    nr = rows.shape[0]
    slot = lambda r: int(at[r]) if r < nr else nslots  # noqa: E731
    outs = np.asarray(out)
    by_start = {sets[h][0]: h for h in sets}
    for i, (t, t1, kt, kt1, op) in enumerate(plan):
        if op is None or type(op) is tuple or op is RED or op is NPRED \
                or op.name not in ("eq", "eq_nan") or t1 != t + META + 1:
            continue
        n, _, st = info(rows, t)
        if st[0] != 1 or st[1] != 0 or rows[t, 3] >= 0 or int(rows[t, 2]) < 0:
            continue
        if ((outs >= kt) & (outs < kt + n)).any():
            continue
        heads = heads_of(rows) if heads is None else heads
        # the count: a sum of the ties alone, from their first, reduced to one slot whose
        # tree's other slots no row after it reads
        ci = [j for j, q in enumerate(plan) if (q[4] is NPRED or q[4] is RED)
              and rows[q[0], 0] == RED and int(rows[q[0], 1]) == kt
              and int(rows[q[0] + 1, 5]) == ADD and rows[q[0], 2] < 0]
        if not ci:
            continue
        c = plan[ci[0]][0]
        tree = _extreme_tree(rows, c, at, set(heads.tolist()))
        if tree is None or tree[2] != n:
            continue
        last, Fc, _, _ = tree
        kc = int(at[c])
        if ((outs >= kc) & (outs < Fc)).any() or _read_after(rows, last + 1, kc, Fc, heads):
            continue
        readers = _tie_readers(rows, kt, kt + n, heads, (c, last))
        if readers is None or len(readers) != 1:
            continue
        p = readers[0]
        if rows[p, 0] != ARR or int(rows[p + 1, 5]) not in pk:
            continue
        np_, _, pst = info(rows, p)
        if np_ != n or int(rows[p, 2]) != kt or pst[1] != 1 or pst[0] != 1 \
                or any(q[0] == p and getattr(q[4], "code", None) in pk
                       for q in plan):  # (skipped: _skip_picks)
            continue
        e = ci[0]
        while e < len(plan) and plan[e][1] <= last:
            e += 1
        if e == len(plan) or plan[e][4] is not RED and plan[e][4] is not NPRED \
                and plan[e][4] is not None:
            continue
        cut = [] if plan[e][1] == last + 1 else [
            (last + 1,) + plan[e][1:2] + (slot(last + 1),) + plan[e][3:]]
        if cut and plan[e][4] is NPRED:
            continue
        # the picks' sums, one after another over their slots, each run in NumPy writing
        # their adjoints (ASSIGN), before the picks' rule in the reverse
        hs, k = [], int(at[p])
        while k < int(at[p]) + n and k in by_start:
            hs.append(by_start[k])
            k = sets[hs[-1]][1]
        if k != int(at[p]) + n:
            continue
        pos = {b[0]: j for j, b in enumerate(back)
               if type(b[3]) is tuple and b[3][0] is ASSIGN}
        pj = [j for j, b in enumerate(back) if b[3] is None and b[2] <= p <= b[0] - META]
        if not pj or any(h not in pos or pos[h] > pj[0] for h in hs):
            continue
        r, k, lo, _ = back[pj[0]]
        sums = []
        for h in hs:
            ns, L = int(rows[h + 1, 4]), int(rows[h, 4])
            sums.append((int(at[h]) + ns * (L - 2), ns, L))  # (outputs after the chains)
        spec = (TIES, op.name == "eq_nan", int(rows[t, 1]), n, int(rows[t, 2]), Fc, t)
        rev = (TIESREV, int(rows[p, 1]), n, tuple(sums), t,
               int(rows[p + 1, 5]) == pk[1])
        nb = [(r, k, p + META + 1, None)] if r > p + META else []
        nb.append((p, int(at[p]), p, rev))
        if lo < p:
            nb.append((p - 1, int(at[p]) - 1, lo, None))
        drop = {pos[h] for h in hs}
        back = [b for j, b in enumerate(back[:pj[0]]) if j not in drop] + nb \
            + back[pj[0] + 1:]
        plan = plan[:i] + [(t, t1, kt, kt1, spec)] + plan[i + 1:ci[0]] + cut + plan[e + 1:]
        return plan, back
    return plan, back


def _ties_forward(step, v, masks):
    """TIES (``_ties``): the tie mask, kept in ``masks``, and its count as the count's
    value."""
    _, nan, a0, n, ms, F, t = step
    a, m = v[a0:a0 + n], v[ms]
    mask = np.equal(a, m)
    if nan and m != m:
        mask |= np.isnan(a)
    masks[t] = mask
    v[F] = float(np.count_nonzero(mask))


def _ties_reverse(step, adj, masks):
    """TIESREV (``_ties``): each pick's adjoint ``0.0 + g`` (its sum's rule), times its tie
    (1.0 or 0.0: the pick's rule ``g * b``) added to its operand's adjoint, the same
    bits: where every ``g`` is one finite number, the non-ties' ``g * 0.0`` is a zero
    (which leaves an adjoint as it was) and only the ties get ``g``. ``pick_where``'s
    rule (``where``: ``max()``'s picks) gives the ties their ``g`` whatever it is, and
    the others nothing (an inf or NaN ``g`` too: torch's masked fill)."""
    _, a0, n, sums, t, where = step
    mask = masks[t]
    G = [adj[o:o + ns] + 0.0 for o, ns, _ in sums]
    dst = adj[a0:a0 + n]
    g = G[0][0]
    if (where or np.isfinite(g)) and all((Gi == g).all() for Gi in G):
        # (g * 0.0 is a zero, and adding a zero to an adjoint leaves it as it was: the
        # sweep reads no adjoint that is -0.0, each zeroed or first written ``0.0 + t``,
        # then only added to, and x + y is -0.0 only when both are)
        dst[np.flatnonzero(mask)] += g
    else:
        gp = np.concatenate([np.repeat(Gi, L) for Gi, (_, _, L) in zip(G, sums)])
        if where:
            idx = np.flatnonzero(mask)
            dst[idx] += gp[idx]
        else:
            dst += np.multiply(gp, mask)


#: (the plan's mark of a sum of picks written as its value, -0.0: ``_skip_picks``)
FILL = "fill"


def _skip_picks(rows, plan, sets):
    """``plan`` without the NumPy steps of the picks (a max's gradient's routes, each
    -0.0) whose slots only a sum reads that writes their adjoints (``sets``,
    ``_first_writers``'): their values are never read but by that sum, whose outputs are
    then -0.0, what its adds of -0.0 give (lse's picks and their sum at 640,000
    elements: two passes, 0.25 ms). The picks' reverse reads their tie weights, not their
    values."""
    pk = (BY_NAME["pick"], BY_NAME["pick_where"])
    by_start = {sets[h][0]: h for h in sets}
    sums, picks = set(), set()
    for r0, r1, k0, k1, op in plan:
        if op not in pk or r1 != r0 + META + 1:
            continue
        hs, at_ = [], k0  # the sums whose terms, one after another, are the picks' slots
        while at_ < k1 and at_ in by_start:
            hs.append(by_start[at_])
            at_ = sets[hs[-1]][1]
        if at_ == k1:
            sums.update(hs)
            picks.add(r0)
    if not sums:
        return plan
    at = row_slots(rows)[0]
    npred = {p_[0] for p_ in plan if p_[4] is NPRED}
    new = []
    for r0, r1, k0, k1, op in plan:
        if op in pk and r0 in picks:
            # (the picks that a compiled sum reads, as their values: -0.0)
            new.extend((r0, r1, k0, k1, (FILL,) + sets[h]) for h in sorted(sums)
                       if h not in npred and k0 <= sets[h][0] < k1)
            continue
        if op is NPRED and r0 in sums:
            n, L = int(rows[r0 + 1, 4]), int(rows[r0, 4])
            o = int(at[r0]) + n * (L - 2)  # (its outputs after the chains of L - 1 adds)
            op = (FILL, o, o + n)
        new.append((r0, r1, k0, k1, op))
    return new


def _first_operands(rows, back, out):
    """{first row: [(start, stop)]} of the elementwise instructions whose reverse runs in
    NumPy (``_np_reverse``) and is the first to reach an operand's adjoints: a contiguous
    run of slots that no row or instruction after it reads and no output is (lse's input,
    shifted by its max): their rule writes ``0.0 + t``, what adding to zeros gives, and
    they are not zeroed first."""
    res = {}
    outs = np.asarray(out)
    heads = heads_of(rows)
    for h, _, _, kind in back:
        if kind is None or kind is RED or type(kind) is tuple:
            continue
        n, _, st = info(rows, h)
        for j, s0, sj in _grad_operands(rows, h):
            if sj != 1 or ((outs >= s0) & (outs < s0 + n)).any():
                continue
            # another operand of its own over these slots (``x[:1] - x``: the broadcast
            # one's rule adds to x[0]'s adjoint before this one would write it) is a
            # reader too: not sure to be first, it adds
            if any(i != j and int(rows[h, 1 + i]) >= 0 and _overlaps(
                    int(rows[h, 1 + i]), ((st[i], n),), s0, s0 + n) for i in range(3)):
                continue
            if not _read_after(rows, h + META + 1, s0, s0 + n, heads):
                res.setdefault(h, []).append((s0, s0 + n))
    return res


def _overlaps(s0, grid, lo, hi):
    """Whether the slots from ``s0`` on a grid of (stride, count) pairs, strides of either
    sign, may reach a slot in [lo, hi): its exact lowest and highest slot against them."""
    a = b = s0
    for t, m in grid:
        a += min(0, t * (m - 1))
        b += max(0, t * (m - 1))
    return a < hi and b >= lo


def _read_after(rows, r, lo, hi, heads):
    """Whether a row or instruction from row ``r`` on reads a slot in [lo, hi)."""
    later = rows[r:]
    scalar = later[:, 0] != TAIL
    hl = heads[heads >= r] - r
    scalar[hl[(later[hl, 0] == ARR) | (later[hl, 0] == RED)]] = False
    ops = later[scalar, 1:4]
    if ((ops >= lo) & (ops < hi)).any():
        return True
    hs = heads[heads >= r]
    if not hs.size:
        return False
    # each operand's lowest and highest slot over all its strides, of either sign (a
    # reduction's first term and its span per output and per term: a row-reversed gather,
    # sa > 0 and ta < 0, reads below its first slot)
    _, sp, _ = spans(rows, hs)
    return bool(((sp[..., 0] >= 0) & (sp[..., 0] < hi) & (sp[..., 1] >= lo)).any())


def _mm_first(rows, back, out):
    """{first row: (start, stop)} of the batched products (``_mm_group``) whose ``B`` is a
    contiguous run of slots that no row or instruction after the product reads and no
    output is: the reverse sweep reaches their adjoints first at the product, which writes
    ``A^T @ G`` there as ``0.0 + t`` (what adding to zeros gives), so they are not zeroed
    (gmm's ``x - mu``, 250,000 slots: their zeroing and a pass reading them)."""
    res = {}
    outs = np.asarray(out)
    heads = heads_of(rows)
    for r0, _, r1, kind in back:  # (a product's: its first row, slot, the row after)
        if type(kind) is not tuple or kind[0] is not MM:
            continue
        _, (C, g, n, L), a, b, _ = kind
        lo, hi = b[0], b[0] + C * L * n
        if not (_injective(b[1:], (C, L, n))
                and _grid_span(b[0], b[1:], (C, L, n))[1] == hi - 1):
            continue
        # A over B's slots (``A @ A``, ``A @ A.T``): A's gradient, added first, would be
        # written over
        if _overlaps(a[0], zip(a[1:], (C, g, L)), lo, hi):
            continue
        if ((outs >= lo) & (outs < hi)).any() or _read_after(rows, r1, lo, hi, heads):
            continue
        res[r0] = (lo, hi)
    return res


def _red_assign(rows, h, k, adj):
    """The reverse of the sum at row ``h`` (slots from ``k``) that writes its terms'
    adjoints (``_first_writers``): each term's ``0.0 + g`` of its output's ``g``, as the
    compiled loop's add to a zeroed adjoint, in one pass of stores."""
    n, L = int(rows[h + 1, 4]), int(rows[h, 4])
    o = k + n * (L - 2)  # (the outputs after the chains of L - 1 adds)
    a = int(rows[h, 1])
    adj[a:a + n * L].reshape(n, L)[...] = (adj[o:o + n] + 0.0)[:, None]


#: (the reverse plan's mark of a run of sums whose terms tile a range, ``_red_tiles``)
TILES = "tiles"
#: the fewest terms whose adjoints ``_red_tiles`` writes: fewer are zeroed at no cost to
#: speak of (a slice's zeroing costs what 2,000 slots' do), and a step split in three
#: costs the driver 1 to 2 us
TILES_MIN = 2000


def _red_tiles(rows, back, out):
    """The reverse plan with the sums of each compiled step of sums (``red_reverse``:
    reduction instructions only, no scalar row, each passing gradients) whose terms
    together are ranges of slots outside the step, each slot one term's, read by nothing
    else and no output, in steps of their own that write the terms' adjoints
    (``_red_tiles_reverse``: each ``0.0 + g``, what the compiled rule's add to a zeroed
    adjoint gives, to the bit), the step's other sums (a sum of its sums) in steps of
    ``red_reverse`` between them, in the same order; and those ranges [start, stop), which
    are then not zeroed (kmeans' gradient's blocked sums over its 1,000 points: 80,000
    slots, 8 sums of 80 blocks of up to 128 terms, 1,000 slots apart)."""
    at = row_slots(rows)[0]
    heads = None
    outs = np.asarray(out)
    res, ranges = [], []
    for step in back:
        r, k, lo, kind = step
        if kind is not RED or (r + 1 - lo) % (META + 1):
            res.append(step)
            continue
        hs = np.arange(lo, r + 1, META + 1)
        if (rows[hs, 0] != RED).any() or (rows[hs + 1, 5] != ADD).any() \
                or (rows[hs + META, 5] == 1.0).any():
            res.append(step)
            continue
        mine, terms = [], []
        for h in hs.tolist():
            n, _, (sa, _, ta, _, L) = info(rows, h)
            g = _grid(int(rows[h, 1]), (sa, ta), (n, L)).ravel()
            if L >= 2 and (g.max() < at[lo] or g.min() > k):  # (not a sum of the step's)
                mine.append(h)
                terms.append(g)
        if not mine or sum(t.size for t in terms) < TILES_MIN:
            res.append(step)
            continue
        terms = np.sort(np.concatenate(terms))
        if (np.diff(terms) == 0).any() or np.isin(outs, terms).any():
            res.append(step)
            continue
        brk = np.nonzero(np.diff(terms) != 1)[0] + 1
        starts = terms[np.concatenate([[0], brk])]
        stops = terms[np.concatenate([brk - 1, [terms.size - 1]])] + 1
        if heads is None:
            heads = heads_of(rows)
            scalar = rows[:, 0] != TAIL
            scalar[heads[(rows[heads, 0] == ARR) | (rows[heads, 0] == RED)]] = False
            sops = rows[scalar, 1:4].astype(np.int64).ravel()
            sops = sops[sops >= 0]
            _, sp, _ = spans(rows, heads)

        def hit(s0, s1):  # [s0, s1] (inclusive) against the ranges
            i = np.searchsorted(starts, s1, side="right") - 1
            return (i >= 0) & (stops[np.maximum(i, 0)] > s0)
        o = sp[~np.isin(heads, mine)]
        o = o[o[..., 0] >= 0]
        if hit(sops, sops).any() or hit(o[:, 0], o[:, 1]).any():
            res.append(step)
            continue
        ranges += list(zip(starts.tolist(), stops.tolist()))
        mine = set(mine)
        groups = []  # (first row, last row, tiles?) of the runs of the step's sums
        for h in hs.tolist():
            if groups and groups[-1][2] == (h in mine):
                groups[-1][1] = h + META
            else:
                groups.append([h, h + META, h in mine])
        for g0, g1, tiles in reversed(groups):
            h1 = g1 - META
            last = int(at[h1]) + int(rows[h1 + 1, 4]) * (int(rows[h1, 4]) - 1) - 1
            res.append((g1, last, g0, (TILES, g0, int(at[g0])) if tiles else RED))
    return res, ranges


@njit_cached(nogil=True)
def _red_tiles_reverse(rows, adj, r, nr, k):
    """The reverse of the sums at rows ``r .. nr - 1`` (their first slot ``k``) that write
    their terms' adjoints (``_red_tiles``): each term's ``0.0 + g`` of its output's ``g``
    (unsigned indices: no wraparound test, as the generated loops)."""
    while r < nr:
        L = int(rows[r, 4])
        ta = int(rows[r, 5])
        m = int(rows[r + 1, 4])
        ia = int(rows[r, 1])
        sa = int(rows[r + 2, 4])
        o = k + m * (L - 2)  # (the outputs after the chains of L - 1 adds)
        for i in range(m):
            g = 0.0 + adj[np.uint64(o + i)]
            b = ia + i * sa
            for t in range(L):
                adj[np.uint64(b + t * ta)] = g
        k += m * (L - 1)
        r += META + 1


#: (the reverse plan's mark of a sum of exps of a shift, ``_exp_shift``)
EXPSUB = "expsub"


def _exp_shift(rows, back, out, sets):
    """The reverse plan with each sum of ``exp(x - a)`` (lse's, softmax's: a sum that writes
    its terms' adjoints, ``_first_writers``, of an exp instruction whose operand is the
    elementwise ``sub`` just before it, run in NumPy, ``_np_reversible``) as one step
    (``_exp_shift_reverse``), and the shifts' adjoints [start, stop), which that step
    writes and does not add to, so they are not zeroed. The exps' adjoints (each ``0.0 +
    g``) are neither stored nor read back: 640,000 of each in lse's gradient."""
    res, shifts, i = [], [], 0
    heads = None
    done = set()  # (the sums that wrote their terms' adjoints before this step)
    while i < len(back):
        step = back[i]
        if type(step[3]) is tuple and step[3][0] is ASSIGN and step[0] in sets:
            done.add(step[0])
        if i + 2 < len(back) and type(step[3]) is tuple and step[3][0] is ASSIGN:
            fused = _exp_shift_step(rows, back[i:i + 3], out, sets, heads, done)
            heads = fused[1]
            if fused[0] is not None:
                res.append((step[0], step[1], step[2], fused[0]))
                shifts.append((fused[0][3], fused[0][3] + fused[0][8]))
                i += 3
                continue
        res.append(step)
        i += 1
    return res, shifts


def _exp_shift_step(rows, steps, out, sets, heads, done=()):
    """(EXPSUB, sub's op, its first row, its first slot, the exps' first slot, the sum's
    outputs n, terms L each, its outputs' first slot) for the three reverse steps
    ``steps`` (the sum's, the exp's, the shift's) when they are such a sum, else None;
    and ``heads`` (computed once)."""
    (s, _, _, _), (re, ke, e, kind_e), (b, kb, b2, op) = steps
    if kind_e is not None or op is None or type(op) is tuple or op is RED \
            or op.name != "sub" or b2 != b or s not in sets:
        return None, heads
    if rows[e, 0] != ARR or rows[b, 0] != ARR or e != b + META + 1 or re != e + META:
        return None, heads
    n, code, st = info(rows, e)
    if OPS[code].name != "exp" or st[0] != 1 or int(rows[e, 1]) != kb \
            or int(rows[b + 1, 4]) != n or not _np_reversible(rows, b):
        return None, heads
    ke0 = ke - n + 1  # (the exp's first slot: the step names its last)
    ns, _, (sa, _, ta, _, L) = info(rows, s)
    if int(rows[s + 1, 5]) != ADD or ta != 1 or (sa != L and ns != 1) \
            or int(rows[s, 1]) != ke0 or ns * L > n:
        return None, heads
    # the exps after the sum's terms (a long sum's rest): summed by sums that wrote their
    # adjoints earlier in the sweep (``done``), which the step reads
    k = ke0 + ns * L
    by_start = {sets[h][0]: h for h in done}
    while k < ke0 + n and k in by_start:
        k = sets[by_start[k]][1]
    if k != ke0 + n:
        return None, heads
    outs = np.asarray(out)
    if ((outs >= kb) & (outs < kb + n)).any():
        return None, heads
    heads = heads_of(rows) if heads is None else heads
    # the shift read by its exp alone: its adjoint gets the exp's rule and nothing else
    if _read_after(rows, e + META + 1, kb, kb + n, heads):
        return None, heads
    o = int(row_slots(rows)[0][s]) + ns * (L - 2)  # (the sum's outputs, _red_assign's)
    return (EXPSUB, OPS[int(rows[b + 1, 5])], b, kb, ke0, ns, L, o, n), heads


def _exp_shift_reverse(step, v, adj):
    """The shift's adjoints of a sum of exps (``_exp_shift``): the exp's rule ``g * out``
    of each exp's adjoint ``0.0 + g`` (the sum's rule), added to the zeroed shift's
    adjoints (``0.0 + t``), as the sum's assignment and the compiled exp rule compute
    them, to the bit, in two passes that store none of the exps' adjoints; the shift's
    own rule then runs on them (``_np_reverse``)."""
    _, _, _, kb, ke, ns, L, o, n = step
    t = adj[kb:kb + n]
    m = ns * L
    np.multiply(v[ke:ke + m].reshape(ns, L), (adj[o:o + ns] + 0.0)[:, None],
                out=t[:m].reshape(ns, L))
    if m < n:  # (the rest's exps: their adjoints written by their own sums)
        np.multiply(v[ke + m:ke + n], adj[ke + m:ke + n], out=t[m:])
    np.add(0.0, t, out=t)


#: (the reverse plan's mark of a sum of exps of a shift whose rule writes its operand's
#: adjoints directly: ``_exp_shift_direct``)
EXPSUBX = "expsubx"


def _exp_shift_direct(rows, back, firsts):
    """``back`` with each sum of exps of a shift (EXPSUB) whose shift is ``sub`` of a run
    of slots and a broadcast one, both taking gradients, and which is the first to write
    the run's adjoints (``_first_operands``) as (EXPSUBX, ..): the exp's rule written
    straight into the run's adjoints, whose ``0.0 +`` the shift's rule is (``0.0 + t`` is
    never -0.0, and adding it to a zero is itself), and their sum subtracted from the
    broadcast operand's adjoint, the bits of ``_exp_shift_reverse`` then ``_np_reverse``
    with one pass fewer: the shift's adjoints are not stored (lse's 640,000)."""
    res = []
    for step in back:
        kind = step[3]
        if type(kind) is tuple and kind[0] is EXPSUB and kind[1].name == "sub":
            _, _, b, kb, ke, ns, L, o, n = kind
            ops = _grad_operands(rows, b)
            if len(ops) == 2 and ops[0][0] == 0 and ops[0][2] == 1 and ops[1][0] == 1 \
                    and ops[1][2] == 0 and (ops[0][1], ops[0][1] + n) in firsts.get(b, ()):
                step = step[:3] + ((EXPSUBX, ops[0][1], ops[1][1], ke, ns, L, o, n),)
        res.append(step)
    return res


def _exp_shift_direct_reverse(step, v, adj):
    """EXPSUBX (``_exp_shift_direct``)."""
    _, a0, bs, ke, ns, L, o, n = step
    t = adj[a0:a0 + n]
    m = ns * L
    np.multiply(v[ke:ke + m].reshape(ns, L), (adj[o:o + ns] + 0.0)[:, None],
                out=t[:m].reshape(ns, L))
    if m < n:  # (the rest's exps: their adjoints written by their own sums)
        np.multiply(v[ke + m:ke + n], adj[ke + m:ke + n], out=t[m:])
    np.add(0.0, t, out=t)
    adj[bs] += -float(np.sum(t))


#: whether the adjoints of runs of constant rows are zeroed before the reverse sweep
#: (``_live``; off: they are not, their adjoints never read)
LIVE_CONSTS = False


def _live(rows, nslots, assigned=()):
    """The slices of the adjoints to zero before the reverse sweep: the slots whose adjoint
    it reads or adds to and then reads. Not a reduction's chains' other slots (never
    touched: gmm's gradient zeroed 5.7 million slots for 3.4 million read), nor those of
    an instruction that ``mark_inactive`` flagged, whose adjoints the sweep may add to but
    never reads (lse's max, its tie tests and counts: 3.2 of its 7.7 million slots); the
    inputs' (leaf instructions' too) and every scalar row's are zeroed. None when zeroing
    them all costs about as much (fewer slots skipped than 2,000 a slice: a slice's
    assignment costs what zeroing that many does). Nor the ``assigned`` ranges [start,
    stop): the terms of a sum whose reverse writes their adjoints first
    (``_first_writers``). Nor a run of ``CONST_RUN`` or more constant rows' (``LIVE_CONSTS``
    off): a constant has no rule and is no input, so its adjoint is added to, never read
    (kmeans' points: 8,000 of the 30,000 slots its gradient zeroed)."""
    at = row_slots(rows)[0]
    skip = []  # [start, stop) of the slots left alone, in order
    if not LIVE_CONSTS:  # (sorted and merged with the others below)
        d = np.diff(np.concatenate(([0], (rows[:, 0] == CONST).astype(np.int8), [0])))
        assigned = list(assigned) + [
            (int(at[a]), int(at[a]) + b - a)
            for a, b in zip(np.nonzero(d == 1)[0].tolist(), np.nonzero(d == -1)[0].tolist())
            if b - a >= CONST_RUN]
    for h in heads_of(rows).tolist():
        k0, n = int(at[h]), int(rows[h + 1, 4])
        inactive = rows[h + 3, 5] == 1.0
        if rows[h, 0] == RED:
            W = red_width(int(rows[h + 1, 5]), int(rows[h, 4]))
            stop = k0 + n * W if inactive else k0 + n * (W - 1)
        else:
            stop = k0 + n if inactive and int(rows[h + 1, 5]) != LEAF else k0
        if stop > k0:
            if skip and skip[-1][1] == k0:
                skip[-1] = (skip[-1][0], stop)
            else:
                skip.append((k0, stop))
    if assigned:  # (sorted, merged with the others; a range may hold inactive slots)
        merged = []
        for a, b in sorted(skip + list(assigned)):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        skip = merged
    sl, prev = [], 0
    for a, b in skip:
        if a > prev:
            sl.append(slice(prev, a))
        prev = b
    if prev < nslots:
        sl.append(slice(prev, nslots))
    skipped = sum(b - a for a, b in skip)
    return sl if skipped > 2000 * max(len(sl), 1) else None


def zeroed(run):
    """The slices of the adjoints that the one-sample entry ``run`` (``entry``'s) zeroes
    before its reverse sweep (``_live``'s), or None for all of them."""
    cells = dict(zip(run.__code__.co_freevars, run.__closure__))
    zs, ze = cells["zs"].cell_contents, cells["ze"].cell_contents
    if ze[0] == 1 << 62:
        return None
    return [slice(int(a), int(b)) for a, b in zip(zs, ze)]


@njit_cached(nogil=True)
def _zero(adj, starts, stops):
    """Zero ``adj`` over the ranges [starts, stops) (``_live``'s slices; a stop past its end
    is its end)."""
    for j in range(starts.shape[0]):
        adj[starts[j]:min(stops[j], adj.shape[0])] = 0.0


def run_fresh(rows, n, x, out_slots, seeds, in_slots, grad):
    """``replay_cpu.run_fresh`` of a program with array instructions and ``n`` slots:
    (status, outputs, gradients at ``in_slots``; zeros without ``grad``)."""
    m, p = out_slots.shape[0], in_slots.shape[0]
    work = _cpu.new_work(n, out_slots, in_slots, x.shape[0])
    work[_cpu.HEADER:_cpu.HEADER + m] = seeds
    o = _cpu.HEADER + 2 * m + p
    work[o:o + x.shape[0]] = x
    res = np.zeros(m + p if grad else m)
    status = run_into(rows, work, res)
    return status, res[:m], res[m:] if grad else np.zeros(p)
