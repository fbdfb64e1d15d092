"""Array instructions of traced programs: an elementwise op over ranges of slots kept as one
instruction, so that tracing and replay cost per op, not per element.

An array instruction of op ``f`` and length ``n`` computes slots ``k .. k + n - 1``:
``v[k + i] = f(v[a + i * sa], v[b + i * sb], v[c + i * sc]; c0, c1)``, exactly the ``n``
scalar rows it stands for (``expand`` writes them out). It keeps the row format: slot ``k``
is still row ``k``, so the program's values, adjoints, input and output slots are those of
its scalar rows. Its first row is ``(array_ew, a, b, c, c0, c1)``, its other rows are
``(array_tail, k, -1, -1, ., .)`` with, in their constant columns, ``(n, opcode of f)``
(row ``k + 1``), ``(sa, sb)`` (row ``k + 2``) and ``(sc, 0)`` (row ``k + 3``). The array
interpreters (``_generated_arrays.py``) run it as a loop and skip its other rows; every
other interpreter (batches, Jacobians, CUDA) runs the expansion.
"""
from __future__ import annotations

import numpy as np

from .._jit import njit_cached
from ..ops import BY_NAME

NCOL = 6
ARR = BY_NAME["array_ew"].code
TAIL = BY_NAME["array_tail"].code
LEAF = BY_NAME["leaf"].code
#: the shortest run of elements made one instruction (shorter runs stay scalar rows; at
#: least 4: an instruction's rows after the first hold its length and strides). Set it to
#: a huge number to trace scalar rows only (``tapegrad.trace(..., array_instructions=False)``)
MIN_RUN = 16


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


def emit(block, flat, code, first, min_run):
    """Turn the runs of ``block`` (scalar rows of opcode ``code`` over ``flat``, the slot
    arrays; its first row is slot ``first``) that are ``min_run`` long or more into array
    instructions, in place; returns whether any is."""
    rs = runs(flat, min_run)
    if rs is None:
        return False
    made = False
    for s, e, st in rs:
        n = e - s
        if n < min_run:
            continue
        made = True
        block[s, 0] = ARR
        t = block[s + 1:e]
        t[:, 0] = TAIL
        t[:, 1] = first + s
        t[:, 2:4] = -1.0
        t[:, 4:6] = 0.0
        st = st + [0] * (3 - len(st))
        t[0, 4], t[0, 5] = n, code
        t[1, 4], t[1, 5] = st[0], st[1]
        t[2, 4] = st[2]
    return made


def expand(rows):
    """The scalar rows of a program with array instructions: each instruction's ``n`` rows
    become the rows it stands for (slot for slot: nothing else changes)."""
    out = np.array(rows, dtype=np.float64, copy=True)
    heads = np.nonzero(out[:, 0] == ARR)[0]
    for k in heads.tolist():
        n, code = int(out[k + 1, 4]), out[k + 1, 5]
        st = (out[k + 2, 4], out[k + 2, 5], out[k + 3, 4])
        blk = out[k:k + n]
        i = np.arange(n, dtype=np.float64)
        for j in range(3):
            s = rows[k, 1 + j]
            blk[:, 1 + j] = s + i * st[j] if s >= 0 else -1.0
        blk[:, 4:6] = rows[k, 4:6]
        blk[:, 0] = code
    return out


def _grad_bits():
    """By opcode: the inputs (bits a, b, c) whose gradient its rule gives."""
    from ..ops import OPS
    from ._codegen_emit import _replay_ops, rule_exprs
    bits = np.zeros(len(OPS), dtype=np.int64)
    for op in _replay_ops():
        exprs = rule_exprs(op)
        bits[op.code] = sum(1 << j for j, n in enumerate("abc") if n in exprs)
    return bits


GRAD_BITS = _grad_bits()


@njit_cached(nogil=True)
def mark_inactive(rows, bits, leaf):
    """Flag (1.0 in the constant column of an instruction's fourth row) the array
    instructions whose values depend on no input through a gradient: their reverse adds
    only to adjoints that reach no input, so the reverse sweep skips them (the max of
    detached values, the counts of tied elements...)."""
    n = rows.shape[0]
    act = np.zeros(n, dtype=np.bool_)
    k = 0
    while k < n:
        op = int(rows[k, 0])
        if op == leaf:
            act[k] = True
            k += 1
        elif op == ARR:
            m = int(rows[k + 1, 4])
            b = bits[int(rows[k + 1, 5])]
            st = (int(rows[k + 2, 4]), int(rows[k + 2, 5]), int(rows[k + 3, 4]))
            any_ = False
            for c in range(3):
                s = int(rows[k, 1 + c])
                if s >= 0 and (b >> c) & 1:
                    for i in range(m):
                        if act[s + i * st[c]]:
                            act[k + i] = True
                            any_ = True
            rows[k + 3, 5] = 0.0 if any_ else 1.0
            k += m
        else:
            b = bits[op] if op < bits.shape[0] else 0
            for c in range(3):
                s = int(rows[k, 1 + c])
                if s >= 0 and (b >> c) & 1 and act[s]:
                    act[k] = True
            k += 1


def has_arrays(rows):
    return bool(rows.shape[0]) and bool(np.any(rows[:, 0] == ARR))


def head_of(rows, k):
    """The first row of the instruction that row ``k`` belongs to (``k`` for a scalar row)."""
    return int(rows[k, 1]) if rows[k, 0] == TAIL else k


def info(rows, k):
    """(n, opcode, strides) of the instruction whose first row is ``k``; (1, opcode, 0s) for a
    scalar row."""
    if rows[k, 0] != ARR:
        return 1, int(rows[k, 0]), (0, 0, 0)
    return (int(rows[k + 1, 4]), int(rows[k + 1, 5]),
            (int(rows[k + 2, 4]), int(rows[k + 2, 5]), int(rows[k + 3, 4])))


@njit_cached(nogil=True)
def prune_arrays(rows, roots, guard, leaf):
    """``program.prune`` of a program with array instructions: an instruction is kept whole
    when any of its slots is needed, and with every slot its strided inputs span (so the
    kept slots of a span stay evenly spaced after renumbering)."""
    n = rows.shape[0]
    need = np.zeros(n, dtype=np.bool_)
    for r in roots:
        need[r] = True
    for k in range(n):
        op = int(rows[k, 0])
        if op == guard or op == leaf:
            need[k] = True
    for k in range(n - 1, -1, -1):
        op = int(rows[k, 0])
        if op == TAIL:
            if need[k]:
                need[int(rows[k, 1])] = True
            continue
        if not need[k]:
            continue
        if op == ARR:
            m = int(rows[k + 1, 4])
            for i in range(m):
                need[k + i] = True
            for c in range(3):
                s = int(rows[k, 1 + c])
                if s < 0:
                    continue
                st = int(rows[k + 2, 4]) if c == 0 else int(rows[k + 2, 5]) if c == 1 \
                    else int(rows[k + 3, 4])
                lo, hi = s, s + (m - 1) * st
                if st == 0:
                    need[s] = True
                else:
                    for t in range(min(lo, hi), max(lo, hi) + 1):
                        need[t] = True
        else:
            for c in range(1, 4):
                s = int(rows[k, c])
                if s >= 0:
                    need[s] = True
    new = np.full(n, -1, dtype=np.int64)
    m = 0
    for k in range(n):
        if need[k]:
            new[k] = m
            m += 1
    out = np.empty((m, rows.shape[1]), dtype=np.float64)
    for k in range(n):
        j = new[k]
        if j >= 0:
            for c in range(rows.shape[1]):
                out[j, c] = rows[k, c]
            for c in range(1, 4):
                s = int(rows[k, c])
                if s >= 0:
                    out[j, c] = new[s]
    return out, new


# --- running: one sample ------------------------------------------------------------------

from ._generated_arrays import forward, reverse  # noqa: E402 (generated from this format)


@njit_cached(error_model="numpy", nogil=True)
def run_into(rows, slots, x, work, res, grad):
    """``replay_cpu.run_into`` of a program with array instructions."""
    n = rows.shape[0]
    m = work.shape[0] - 2 * n
    v = work[m:m + n]
    status = forward(rows, x, v)
    for i in range(m):
        res[i] = v[slots[i]]
    if grad and status == 0:
        adj = work[m + n:]
        adj[:] = 0.0
        for i in range(m):
            adj[slots[i]] += work[i]
        reverse(rows, v, adj)
        for i in range(m, slots.shape[0]):
            res[i] = adj[slots[i]]
    return status


def run_fresh(rows, x, out_slots, seeds, in_slots, grad):
    """``replay_cpu.run_fresh`` of a program with array instructions: (status, outputs,
    gradients at ``in_slots``; zeros without ``grad``)."""
    m = out_slots.shape[0]
    work = np.empty(m + 2 * rows.shape[0])
    work[:m] = seeds
    res = np.zeros(m + in_slots.shape[0])
    status = run_into(rows, np.concatenate((out_slots, in_slots)), x, work, res, grad)
    return status, res[:m], res[m:]
