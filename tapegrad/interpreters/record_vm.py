"""The recording sweep's interpreter (create_graph=True on scalar tapes): runs the
instructions ``_codegen`` assembles from each op's rule (tables ``RECORD_CODE``,
``RECORD_AT``... and the per-op forward ``value`` in ``_generated_cpu``), emitting exactly the
entries the tensor backend would record."""
from __future__ import annotations

import numpy as np

from .._jit import njit_cached
from ._generated_cpu import (ACC, ADD, AND, BIN, CMP, CONST_FORMS, END, JMP, JMPF, MOV, NUM, OR,
                             POWC, POWC_EXPONENTS, POWC_SPECIAL, RECORD_AT, RECORD_CODE,
                             RECORD_NUMS, REGISTERS, RIGHT_SIGN, UN, value)


@njit_cached(nogil=True)
def _put(orow, ocode, oval, m, base, op, sa, sb, c0, c1, v):
    """Write emitted entry ``m`` (slot ``base + m``): absolute row, relative code, value."""
    k = base + m
    orow[m, 0] = op
    orow[m, 1] = sa
    orow[m, 2] = sb
    orow[m, 3] = c0
    orow[m, 4] = c1
    ocode[m, 0] = op
    ocode[m, 1] = k - sa if sa >= 0 else 0
    ocode[m, 2] = k - sb if sb >= 0 else 0
    oval[m] = v
    return m + 1


@njit_cached(nogil=True)
def _special(c):
    """Whether ``x ** c`` is recorded as ``powc_special`` (``POWC_EXPONENTS``)."""
    for e in POWC_EXPONENTS:
        if c == e:
            return True
    return False


@njit_cached(error_model="numpy", nogil=True)
def _binary(op, sx, vx, sy, vy, orow, ocode, oval, m, base):
    """``x <op> y`` as the tensor operators record it: folded when both are constants, a
    constant form (``mulc``...) when one is, the binary op otherwise. Returns (m, slot,
    value)."""
    if sx < 0 and sy < 0:
        return m, -1, value(op, vx, vy, 0.0, 0.0)
    if sy < 0:
        f = CONST_FORMS[op, 0]
        c = vy * RIGHT_SIGN[op]
        if f == POWC and _special(c):  # (the rare exponents' op: ops.elementwise)
            f = POWC_SPECIAL
        v = value(f, vx, 0.0, c, 0.0)
        return _put(orow, ocode, oval, m, base, f, sx, -1, c, 0.0, v), base + m, v
    if sx < 0:
        f = CONST_FORMS[op, 1]
        v = value(f, vy, 0.0, vx, 0.0)
        return _put(orow, ocode, oval, m, base, f, sy, -1, vx, 0.0, v), base + m, v
    v = value(op, vx, vy, 0.0, 0.0)
    return _put(orow, ocode, oval, m, base, op, sx, sy, 0.0, 0.0, v), base + m, v


@njit_cached(error_model="numpy", nogil=True)
def sweep_record(rows, vals, need, hi, lo, aslot, aval, orow, ocode, oval, base):
    """The reverse sweep of entries ``hi-1 .. lo`` recorded as new entries: ``aslot[k]``,
    ``aval[k]`` hold slot ``k``'s adjoint (slot -1: a constant, -2: none yet). Emitted entry
    ``m`` gets slot ``base + m``; returns how many were emitted (at most ``MAX_EMIT`` per
    swept entry). Runs ``RECORD_CODE`` from ``RECORD_AT[opcode]`` for each entry."""
    code = RECORD_CODE
    rs = np.empty(REGISTERS, dtype=np.int64)
    rv = np.zeros(REGISTERS, dtype=np.float64)
    m = 0
    for k in range(hi - 1, lo - 1, -1):
        if not need[k] or aslot[k] == -2:
            continue
        ia = int(rows[k, 1])
        ib = int(rows[k, 2])
        rs[0] = aslot[k]
        rv[0] = aval[k]
        rs[1] = ia
        rv[1] = vals[ia] if ia >= 0 else 0.0
        rs[2] = ib
        rv[2] = vals[ib] if ib >= 0 else 0.0
        rs[3] = k
        rv[3] = vals[k]
        rs[4] = -1
        rv[4] = rows[k, 3]
        rs[5] = -1
        rv[5] = rows[k, 4]
        pc = RECORD_AT[int(rows[k, 0])]
        while True:
            kind, op, x, y, z, d = (code[pc, 0], code[pc, 1], code[pc, 2], code[pc, 3],
                                    code[pc, 4], code[pc, 5])
            pc += 1
            if kind == END:
                break
            if kind == BIN:
                m, rs[d], rv[d] = _binary(op, rs[x], rv[x], rs[y], rv[y], orow, ocode, oval,
                                          m, base)
            elif kind == UN:
                c0 = rv[y] if y >= 0 else 0.0
                c1 = rv[z] if z >= 0 else 0.0
                v = value(op, rv[x], 0.0, c0, c1)
                if rs[x] < 0:
                    rs[d] = -1
                else:
                    rs[d] = base + m
                    m = _put(orow, ocode, oval, m, base, op, rs[x], -1, c0, c1, v)
                rv[d] = v
            elif kind == ACC:  # add register y into the adjoint of register x's slot
                s = rs[x]
                if aslot[s] == -2:
                    aslot[s] = rs[y]
                    aval[s] = rv[y]
                else:
                    m, aslot[s], aval[s] = _binary(ADD, aslot[s], aval[s], rs[y], rv[y],
                                                   orow, ocode, oval, m, base)
            elif kind == NUM:
                rs[d] = -1
                rv[d] = RECORD_NUMS[x]
            elif kind == MOV:
                rs[d] = rs[x]
                rv[d] = rv[x]
            elif kind == JMPF:
                if rv[x] == 0.0:
                    pc = d
            elif kind == JMP:
                pc = d
            else:  # truth values, as 1.0 / 0.0
                a, b = rv[x], rv[y]
                if kind == CMP:
                    t = (a > b if op == 0 else a >= b if op == 1 else a < b if op == 2 else
                         a <= b if op == 3 else a == b if op == 4 else a != b)
                elif kind == AND:
                    t = a != 0.0 and b != 0.0
                elif kind == OR:
                    t = a != 0.0 or b != 0.0
                else:
                    t = a == 0.0
                rs[d] = -1
                rv[d] = 1.0 if t else 0.0
    return m
