"""The CPU backward's one-call entry points: the compiled scalar sweep (``grad_scalar``), the
compiled recording sweep (``grad_record``) and the flat sweep's layout (``flat_layout``)."""
from __future__ import annotations

import numpy as np

from .._jit import njit_cached
from ..ops import ARRAY, BINARY, OPS, ROW, UNARY, UNARY_C
from . import _generated_cpu, record_vm

IMPORT_CODE = next(op.code for op in OPS if op.name == "import_")


@njit_cached(nogil=True)
def _mark_scalar(rows, ins, out, sweepable, lo):
    """``need`` and ``reach`` (as ``mark``) of a backward from scalar entry ``out`` to the
    entries ``ins``, over entries ``lo`` (at most the first input or import) to ``out``, and
    the lowest entry swept, and whether one compiled call can do it: False when a needed entry
    is not one it runs
    (``sweepable[opcode]``) or the path reaches an entry that imports a value from another
    tape (it may depend on an input there, through entries one tape's rows do not lead to)."""
    n = rows.shape[0]
    for s in ins:
        lo = min(lo, s)
    dep = np.zeros(n, dtype=np.bool_)
    for s in ins:
        dep[s] = True
    need = np.zeros(n, dtype=np.bool_)
    reach = np.zeros(n, dtype=np.bool_)
    for k in range(lo, out + 1):
        a = int(rows[k, 1])
        b = int(rows[k, 2])
        # an import of an array (its opcode with the ARRAY bit) is an import too
        if (a >= 0 and dep[a]) or (b >= 0 and dep[b]) or \
                int(rows[k, 0]) & ~ARRAY == IMPORT_CODE:
            dep[k] = True
            need[k] = True
    reach[out] = True
    for k in range(out, lo - 1, -1):
        if need[k]:
            if reach[k]:
                if not sweepable[int(rows[k, 0])] or int(rows[k, 0]) & ~ARRAY == IMPORT_CODE:
                    return need, reach, lo, False
                a = int(rows[k, 1])
                b = int(rows[k, 2])
                if a >= 0:
                    reach[a] = True
                if b >= 0:
                    reach[b] = True
            else:
                need[k] = False
    return need, reach, lo, True


@njit_cached(error_model="numpy", nogil=True)
def grad_scalar(rows, vals, ins, out, sweepable, lo):
    """The common backward in one call: gradients of scalar entry ``out`` (seed 1) with
    respect to the scalar entries ``ins`` (see ``_mark_scalar``). Returns the gradients,
    ``need`` and whether the result is complete (False also when an input is unused)."""
    need, reach, lo, ok = _mark_scalar(rows, ins, out, sweepable, lo)
    if not ok:
        return np.empty(0), need, False
    adj = np.full(rows.shape[0], -0.0)  # IEEE addition's identity: -0.0 sums kept (torch's)
    adj[out] = 1.0
    _generated_cpu.sweep(rows, vals, adj, need, out + 1, lo)
    grads = np.empty(len(ins), dtype=np.float64)
    used = True
    for i in range(len(ins)):
        grads[i] = adj[ins[i]]
        used = used and reach[ins[i]]
    return grads, need, used


@njit_cached(error_model="numpy", nogil=True)
def grad_record(rows, vals, ins, out, seed_slot, seed, recordable, lo, base):
    """``grad_scalar`` with ``create_graph=True``: the sweep is recorded as new entries
    (slots from ``base``) so the gradients can be differentiated again. ``seed_slot`` is the
    seed's slot, or -1 when it is the constant ``seed``. Returns the new entries' absolute
    rows, relative (opcode, a, b) and values, each input gradient's slot (-1: a constant)
    and value, and whether the call was complete; when it is not, nothing was emitted."""
    need, reach, lo, ok = _mark_scalar(rows, ins, out, recordable, lo)
    for s in ins:
        ok = ok and reach[s]
    if not ok:
        return (np.empty((0, ROW)), np.empty((0, 3), dtype=np.int64), np.empty(0),
                np.empty(0, dtype=np.int64), np.empty(0), False)
    n = rows.shape[0]
    aslot = np.full(n, -2, dtype=np.int64)
    aval = np.zeros(n, dtype=np.float64)
    aslot[out] = seed_slot
    aval[out] = seed
    cap = _generated_cpu.MAX_EMIT * need.sum() + 1
    orow = np.empty((cap, ROW), dtype=np.float64)
    ocode = np.empty((cap, 3), dtype=np.int64)
    oval = np.empty(cap, dtype=np.float64)
    m = record_vm.sweep_record(rows, vals, need, out + 1, lo, aslot, aval, orow, ocode,
                               oval, base)
    return orow[:m], ocode[:m], oval[:m], aslot[ins], aval[ins], True


#: opcodes the compiled scalar sweep runs (scalar elementwise ops and imports)
SWEEPABLE = np.array([c < len(OPS) and (OPS[c].kind in (UNARY, UNARY_C, BINARY)
                                        or OPS[c].name == "import_") for c in range(2 * ARRAY)],
                     dtype=np.bool_)

#: opcodes the compiled recording sweep (create_graph=True) runs
RECORDABLE = np.zeros(2 * ARRAY, dtype=np.bool_)
RECORDABLE[list(getattr(_generated_cpu, "RECORDS", ()))] = True  # () while regenerating


#: opcodes the flat sweep runs: elementwise ops on scalars or arrays, and array ops with a
#: ``scatter`` form (getitem, sum, mean)
FLAT = np.zeros(2 * ARRAY, dtype=np.bool_)
#: the ones whose entries flat_layout checks in Python (their aux): the scatter ones
_FLAT_AUX = np.zeros(2 * ARRAY, dtype=np.bool_)
#: opcodes whose scatter form adds at an index (their entries need p0, p1)
_AT_INDEX = frozenset(op.code for op in OPS if op.scatter and op.scatter[0] == "index")
for _op in OPS:
    if _op.kind in (UNARY, UNARY_C, BINARY) and _op.vjp is not None:
        FLAT[_op.code] = FLAT[_op.code | ARRAY] = True
    elif _op.scatter is not None:
        FLAT[_op.code | ARRAY] = _FLAT_AUX[_op.code | ARRAY] = True
del _op
FLAT_MAX = 1 << 16  # elements packed into the flat buffers, at most: beyond, NumPy is as fast
_F64 = np.dtype(np.float64)


@njit_cached(nogil=True)
def _flat_slots(rows, need, lo, hi, keys, sizes, special):
    """Offsets and sizes of every slot in the flat buffers (scalars at their slot, the
    arrays that needed entries ``lo .. hi-1`` read after them), those arrays' slots in
    order, and the needed entries whose aux Python checks (``special[opcode]``)."""
    n = rows.shape[0]
    off = np.arange(n)
    size = np.ones(n, dtype=np.int64)
    is_arr = np.zeros(n, dtype=np.bool_)
    for i in range(len(keys)):
        size[keys[i]] = sizes[i]
        is_arr[keys[i]] = True
    used = np.zeros(n, dtype=np.bool_)
    checks = []
    for k in range(lo, hi):
        if need[k]:
            used[k] = True
            a, b = int(rows[k, 1]), int(rows[k, 2])
            if a >= 0:
                used[a] = True
            if b >= 0:
                used[b] = True
            if special[int(rows[k, 0])]:
                checks.append(k)
    slots = []
    pos = n
    for s in range(n):
        if used[s] and is_arr[s]:
            slots.append(s)
            off[s] = pos
            pos += size[s]
    return off, size, np.array(slots, dtype=np.int64), np.array(checks, dtype=np.int64), pos


def flat_layout(tape, rows, need, lo, hi):
    """The flat sweep's buffers for the needed entries ``lo .. hi-1`` of ``tape``: (off,
    size, V, p0, p1). None when an array they read is not float64, the arrays are large,
    or a needed entry with a scatter form is not one the flat sweep runs (an index other
    than one slice or integer of a 1-d array, a reduction over some dims). The sweep itself
    checks that elementwise entries broadcast only from one element."""
    arrays = tape.arrays
    m = len(arrays)
    keys = np.fromiter(arrays, dtype=np.int64, count=m)
    sizes = np.fromiter([v.size for v in arrays.values()], dtype=np.int64, count=m)
    off, size, slots, checks, total = _flat_slots(rows, need, lo, hi, keys, sizes, _FLAT_AUX)
    if total - len(rows) > FLAT_MAX:
        return None
    parts = [tape.values()]
    f64 = _F64
    for s in slots.tolist():
        v = arrays[s]
        if v.dtype is not f64:
            return None
        parts.append(v.ravel())
    p0 = p1 = off  # read by entries that scatter at an index only
    for k in checks.tolist():
        code, a = int(rows[k, 0]) & ~ARRAY, int(rows[k, 1])
        if code not in _AT_INDEX:  # a full reduction, or one the flat sweep does not run
            if tape.aux[k][0] is not None:
                return None
            continue
        base, index = arrays.get(a), tape.aux[k][0]
        if base is None or base.ndim != 1:
            return None
        if index.__class__ is tuple and len(index) == 1:
            index = index[0]
        if p0 is off:
            p0, p1 = np.zeros(len(rows), dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
        if index.__class__ is slice:
            p0[k], _, p1[k] = index.indices(base.shape[0])
        elif index.__class__ is int:
            p0[k] = index + base.shape[0] if index < 0 else index
        else:
            return None
    return off, size, np.concatenate(parts), p0, p1
