"""The CPU reverse sweep: combine the tapes a backward needs, mark the entries between
outputs and inputs, sweep scalar runs compiled and array entries with NumPy.
"""
from __future__ import annotations

import bisect

import numpy as np

from .._jit import njit_cached
from ..ops import ARRAY, ARRAY_OP, BINARY, OPS, ROW, SPECIAL, UNARY, UNARY_C, NpF, call_rule
from ..ops._registry import Part
from ..ops.arrays import sum_axes, sum_to
from ..tape import STATE
from . import _generated_cpu, record_vm

SAVES = np.array([op.saves for op in OPS], dtype=np.bool_)
IMPORT_CODE = next(op.code for op in OPS if op.name == "import_")
CONST_CODE = next(op.code for op in OPS if op.name == "const")
FUNCTION_CODE = next(op.code for op in OPS if op.name == "function")
PROGRAM_CODE = next(op.code for op in OPS if op.name == "program")
_LAST_SPECIAL = max(op.code for op in OPS if op.kind == SPECIAL)
#: opcodes whose ``b`` column is an input slot
BSLOT = np.array([op.kind in (BINARY, ARRAY_OP) for op in OPS], dtype=np.bool_)
_NO_INT = np.zeros(0, dtype=np.int64)
_THUNK = type(lambda: None)  # a rule's lazily built gradient
_NO_NARY = (_NO_INT, np.zeros(1, dtype=np.int64), _NO_INT)  # read-only use in mark()


@njit_cached(nogil=True)
def mark(rows, nx_entries, nx_ptr, nx_idx, is_input, is_output):
    """``need``: entries that depend on an input and reach an output; ``reach``: slots an
    output reaches through needed entries (an input with ``reach`` False is unused);
    the needed array entries, last first."""
    n = rows.shape[0]
    dep = is_input.copy()
    need = np.zeros(n, dtype=np.bool_)
    j = 0
    for k in range(n):
        a = int(rows[k, 1])
        b = int(rows[k, 2])
        d = (a >= 0 and dep[a]) or (b >= 0 and dep[b])
        if j < nx_entries.shape[0] and nx_entries[j] == k:
            for p in range(nx_ptr[j], nx_ptr[j + 1]):
                if dep[nx_idx[p]]:
                    d = True
            j += 1
        if d:
            need[k] = True
            dep[k] = True
    reach = is_output.copy()
    j = nx_entries.shape[0] - 1
    n_arr = 0
    arr = np.empty(n, dtype=np.int64)
    for k in range(n - 1, -1, -1):
        nary = j >= 0 and nx_entries[j] == k
        if reach[k] and need[k]:
            a = int(rows[k, 1])
            b = int(rows[k, 2])
            if a >= 0:
                reach[a] = True
            if b >= 0:
                reach[b] = True
            if nary:
                for p in range(nx_ptr[j], nx_ptr[j + 1]):
                    reach[nx_idx[p]] = True
            if rows[k, 0] >= 256:
                arr[n_arr] = k
                n_arr += 1
        else:
            need[k] = False
        if nary:
            j -= 1
    return need, reach, arr[:n_arr]


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
    adj = np.zeros(rows.shape[0], dtype=np.float64)
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


def order_tapes(roots):
    """The tapes reachable from ``roots`` through imports, each after the tapes it imports."""
    if len(roots) == 1 and not roots[0].imports:
        return roots
    order, state = [], {}
    for root in roots:
        if state.get(root) == 2:
            continue
        stack = [(root, False)]
        while stack:
            tape, done = stack.pop()
            if done:
                state[tape] = 2
                order.append(tape)
                continue
            if state.get(tape) == 2:
                continue
            if state.get(tape) == 1:
                raise RuntimeError(
                    "tapes recorded by two threads import from each other; tapegrad cannot "
                    "order them for one backward. Record each graph within one thread.")
            state[tape] = 1
            stack.append((tape, True))
            for k in tape.imports:
                src = tape.aux[k][0]
                if state.get(src) != 2:
                    stack.append((src, False))
    return order


_FUNCTION_OUT = next(op.code for op in OPS if op.name == "function_out")


def _outputs_to_their_entry(rows):
    """Point each ``function_out`` entry (an output of a custom Function or traced Program)
    at its multi-output entry itself where a tape rollover put an import between them: the
    output gradients are gathered on that entry ({index: gradient}), which an import,
    passing one adjoint through, would drop."""
    codes = rows[:, 0].astype(np.int64) & ~ARRAY
    outs = np.nonzero(codes == _FUNCTION_OUT)[0]
    if not len(outs):
        return
    for _ in range(len(rows)):  # an import of an import: follow it to the entry
        src = rows[outs, 1].astype(np.int64)
        via = codes[src] == IMPORT_CODE
        if not via.any():
            return
        rows[outs[via], 1] = rows[src[via], 1]


class Graph:
    """The tapes of one backward laid end to end, with slots renumbered to match."""

    def __init__(self, tapes):
        self.tapes = tapes
        if len(tapes) == 1:
            t = tapes[0]
            self.index = {id(t): 0}
            self.n = len(t.vals)
            self.offsets = [0, self.n]
            self.rows = t.rows()
            self.vals = t.values()
            arrays, vals = t.arrays, t.vals
            self.value = lambda s: arrays[s] if s in arrays else vals[s]
            self.is_array = arrays.__contains__
            self.row = t.entry
            self.aux = t.aux.get
        else:
            self.index = {id(t): i for i, t in enumerate(tapes)}
            self.offsets = [0]
            for t in tapes:
                self.offsets.append(self.offsets[-1] + len(t.vals))
            self.n = self.offsets[-1]
            parts = []
            for t, off in zip(tapes, self.offsets):
                r = t.rows().copy()
                if off:
                    cols = r[:, 1:3]
                    cols[cols >= 0] += off
                for k in t.imports:
                    src, ks = t.aux[k]
                    r[k, 1] = self.slot(src, ks)
                parts.append(r)
            self.rows = np.concatenate(parts) if parts else np.zeros((0, 5))
            self.vals = np.concatenate([t.values() for t in tapes])
            _outputs_to_their_entry(self.rows)
        self._nary()

    def _nary(self):
        if not any(t.nary for t in self.tapes):
            self.nx = _NO_NARY
            return
        ents, ptr, idx = [], [0], []
        for i, t in enumerate(self.tapes):
            off = self.offsets[i]
            ents.extend(k + off for k in t.nary)
        for e in ents:
            idx.extend(self.nary_inputs(e))
            ptr.append(len(idx))
        self.nx = (np.array(ents, dtype=np.int64), np.array(ptr, dtype=np.int64),
                   np.array(idx, dtype=np.int64))

    def slot(self, tape, k):
        """Combined slot of entry ``k`` of ``tape``, or None when the tape is not here."""
        i = self.index.get(id(tape))
        return None if i is None else self.offsets[i] + k

    def locate(self, s):
        i = bisect.bisect_right(self.offsets, s) - 1
        return self.tapes[i], s - self.offsets[i]

    def arrays_at(self, slots):
        """Whether any of ``slots`` holds an array."""
        if len(self.tapes) == 1:
            arrays = self.tapes[0].arrays
            return bool(arrays) and any([s in arrays for s in slots])
        return any([self.is_array(s) for s in slots])

    def row(self, k):
        op, a, b, c0, c1 = self.rows[k].tolist()
        return int(op), int(a), int(b), c0, c1

    def value(self, s):
        tape, k = self.locate(s)
        v = tape.arrays.get(k, tape)
        return tape.vals[k] if v is tape else v

    def is_array(self, s):
        tape, k = self.locate(s)
        return k in tape.arrays

    def aux(self, s):
        tape, k = self.locate(s)
        return tape.aux.get(k)

    def nary_inputs(self, s):
        tape, k = self.locate(s)
        off = s - k
        return [off + x for x in tape.aux[k][0]]

    def freed_mask(self):
        if all(t.freed is None for t in self.tapes):
            return None
        out = np.zeros(self.n, dtype=np.bool_)
        for t, off in zip(self.tapes, self.offsets):
            if t.freed is not None:
                out[off:off + len(t.freed)] = t.freed
        return out

    def free(self, need):
        """Mark the swept entries freed and drop the saved arrays no live entry reads."""
        for t, off in zip(self.tapes, self.offsets):
            free_entries(t, need[off:off + len(t.vals)])


def free_entries(t, sub):
    """Mark the entries ``sub`` of tape ``t`` freed (a backward without retain_graph) and
    release what no later backward can use: the saved arrays no unfreed entry reads, and
    the converted rows and values (rebuilt from the entries if a backward comes again)."""
    n = len(t.vals)  # more than ``sub`` covers when the sweep recorded onto t (create_graph)
    f = t.freed
    if f is None and len(sub) == n:
        f = t.freed = sub  # the sweep's own mask: nothing reads it after the free
    else:
        if f is None:
            f = t.freed = np.zeros(n, np.bool_)
        elif len(f) < n:
            f = t.freed = np.concatenate([f, np.zeros(n - len(f), np.bool_)])
        f[:len(sub)] |= sub
    # an output kept for logging (``losses.append(loss)``) keeps its tape: only what a
    # backward through its unfreed entries needs should stay
    t._cache = t._vcache = None
    big = t.nbytes >= _RELEASE_BYTES
    if (big or t.nary) and STATE.trace is None:  # a trace lowers every entry it recorded
        if big and sub.any():
            _release(t, f)
        if t.nary:
            _release_contexts(t, f)


#: a tape whose saved arrays take fewer bytes keeps them: they weigh about what its entries
#: do, and releasing them would cost a tenth of a small backward (the 10-element Rosenbrock)
_RELEASE_BYTES = 1 << 12

#: zero-stride stand-ins of released arrays, by (shape, dtype): read-only, so tapes share them
_PLACEHOLDERS = {}


def _placeholder(v):
    """A zero-stride read-only array of ``v``'s shape and dtype (rules that save nothing
    still read their inputs' shapes)."""
    key = (v.shape, v.dtype)
    p = _PLACEHOLDERS.get(key)
    if p is None:
        if len(_PLACEHOLDERS) >= 256:
            _PLACEHOLDERS.clear()
        p = _PLACEHOLDERS[key] = np.broadcast_to(np.zeros((), v.dtype), v.shape)
    return p


@njit_cached(nogil=True)
def _droppable(rows, freed, last_special, bslot):
    """Entries whose saved value no later backward reads: freed or bookkeeping, and not an
    input of an unfreed entry; and whether any entry is unfreed."""
    n = rows.shape[0]
    drop = np.empty(n, dtype=np.bool_)
    for k in range(n):
        drop[k] = freed[k] or (int(rows[k, 0]) & ~256) <= last_special
    keep = np.zeros(n, dtype=np.bool_)
    live = False
    for k in range(n):
        if not drop[k]:
            live = True
            a, b = int(rows[k, 1]), int(rows[k, 2])
            if a >= 0:
                keep[a] = True
            if b >= 0 and bslot[int(rows[k, 0]) & ~256]:
                keep[b] = True
    for k in range(n):
        drop[k] = drop[k] and not keep[k]
    return drop, live


def _release(tape, freed):
    """Drop the saved arrays whose producing entry is freed (or is bookkeeping) and that no
    unfreed entry reads; a tensor that holds such a value keeps its own reference. A
    constant's tensor goes too (torch frees saved inputs at backward), leaves stay (a later
    backward accumulates their ``.grad``)."""
    drop, live = _droppable(tape.rows(), freed, _LAST_SPECIAL, BSLOT)
    if live:
        for k in tape.nary:
            if not drop[k] and not freed[k]:
                drop[tape.aux[k][0]] = False
    drop = drop.tolist()
    arrays, aux, code, ph = tape.arrays, tape.aux, tape.code, _PLACEHOLDERS
    consts = False
    for k, v in arrays.items():
        if drop[k]:
            p = ph.get((v.shape, v.dtype))
            if p is v:  # released by an earlier backward
                continue
            arrays[k] = _placeholder(v) if p is None else p
            if code[k * ROW] & ~ARRAY == CONST_CODE:
                aux[k] = (None, aux[k][1])
                consts = True
    if consts:  # nothing left to check for in-place changes
        tape.versioned = [k for k in tape.versioned if aux[k][0] is not None]


def _release_contexts(tape, freed):
    """A freed custom Function's saved tensors go, as torch's (``ctx.saved_tensors`` then
    raises torch's error; what else the user put on ctx stays, as on torch's node), and a
    freed traced Program call's copy of its inputs."""
    code, aux = tape.code, tape.aux
    for k in tape.nary:
        if freed[k]:
            op = code[k * ROW] & ~ARRAY
            if op == FUNCTION_CODE:
                ctx = aux[k][2]
                ctx._saved = None
                ctx.to_save = ()
            elif op == PROGRAM_CODE and aux[k][3] is not None:
                aux[k] = aux[k][:3] + (None,) + aux[k][4:]  # (slots, program, code, x, batch)


def check_not_freed(graph, need):
    freed = graph.freed_mask()
    if freed is None:
        return
    ops = graph.rows[:, 0].astype(np.int64)
    bad = need & freed & SAVES[ops & ~ARRAY]
    if bad.any():
        k = int(np.nonzero(bad)[0][-1])
        op = OPS[int(ops[k]) & ~ARRAY]
        raise RuntimeError(
            "Trying to backward through the graph a second time (or directly access saved "
            "tensors after they have already been freed). Saved intermediate values of the "
            "graph are freed when you call .backward() or autograd.grad(). Specify "
            "retain_graph=True if you need to backward through the graph a second time or if "
            "you need to access saved tensors after calling backward. (The freed values were "
            f"needed by op '{op.name}' ({backward_name(op)}), tape entry %{k}.)")


def backward_name(op):
    return "".join(p.capitalize() for p in op.name.rstrip("_").split("_")) + "Backward0"


def sweep(graph, need, adj, adjd, arr):
    """Run the reverse sweep over the needed entries (``arr``: the array ones, last first);
    scalar runs go to the compiled sweep, array entries to their rules on NumPy values."""
    rows = graph.rows
    hi = graph.n
    vals = graph.vals
    if not len(arr):  # scalar entries only: one compiled call, no NumPy
        if hi > 0:
            _generated_cpu.sweep(rows, vals, adj, need, hi, 0)
        return
    owned = set()  # slots whose adjoint array this sweep allocated: added to in place
    wanted = graph.wanted.tolist()  # read twice per entry: a list's item is the cheaper
    # a needed scalar entry anywhere? (none: no compiled call between the array entries,
    # a few microseconds each, most of a create_graph sweep's entries are arrays)
    scalars = np.count_nonzero(need) > len(arr)
    with np.errstate(all="ignore"):
        for k, row in zip(arr.tolist(), rows[arr].tolist()):
            if scalars and hi - k > 1:
                _generated_cpu.sweep(rows, vals, adj, need, hi, k + 1)
            array_vjp(graph, k, adj, adjd, row=row, owned=owned, wanted=wanted)
            hi = k
        if scalars and hi > 0:
            _generated_cpu.sweep(rows, vals, adj, need, hi, 0)


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
        ga = fa(g, va, vb)
        return ga, (ga if symmetric else fb(g, va, vb))
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
    r = -sum_to(g, shape)
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
    value, is_array = graph.value, graph.is_array
    out = value(k)
    if op.nary and op.name in MULTI_OUTPUT:
        g = adjd.get(k)  # {output index: gradient}, gathered from its function_out entries
    elif is_array(k):
        g = adjd.get(k)
        if g is None:
            g = np.zeros_like(out)
    else:
        g = adj[k]
    aux = graph.aux(k) if op.code in _AT_INDEX and owned is not None else None
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
    else:
        inputs, grads = elementwise_rule(op, NpF, g, out, a, b, c0, c1, value)
    if on_bad is not None:
        grads = [gr() if gr.__class__ is _THUNK else gr for gr in grads]
        for i, gr in enumerate(grads):
            if gr is not None and gr.__class__ is not Part and \
                    not np.all(np.isfinite(gr)):
                raise on_bad(k, i)
    for s, gr in zip(inputs, grads):
        if gr is None or not wanted[s]:  # nobody reads that adjoint (a constant input):
            continue  # no broadcast to undo, no sum (torch skips it too)
        if gr.__class__ is _THUNK:
            gr = gr()
        if gr.__class__ is Part:
            _gather(adjd, s, gr)
        elif is_array(s):
            v = value(s)
            if gr.__class__ is not np.ndarray:
                gr = np.broadcast_to(np.asarray(gr, dtype=v.dtype), v.shape)
            elif gr.shape != v.shape:
                gr = sum_to(gr, v.shape)
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
            else:
                adjd[s] = prev + gr
                if owned is not None:
                    owned.add(s)
        elif gr.__class__ is float:
            adj[s] += gr
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
