"""The CPU reverse sweep: combine the tapes a backward needs, mark the entries between
outputs and inputs, sweep scalar runs compiled and array entries with NumPy. The sweep and
the array rules live in ``cpu_arrays``, the one-call scalar, recording and flat entry points
in ``cpu_fast``; their names are re-exported here.
"""
from __future__ import annotations

import bisect
import threading

import numpy as np

from .._jit import njit_cached
from ..ops import ARRAY, ARRAY_OP, BINARY, OPS, ROW, SPECIAL
from ..ops.arrays import sum_axes  # noqa: F401 (re-exported)
from ..tape import STATE, seen_rows
from .cpu_arrays import (  # noqa: F401 (the sweep's names, re-exported from cpu)
    _SIDES, _THUNK, MULTI_OUTPUT, _compact, _gather, _one_sided, array_vjp,
    array_vjp_batched, elementwise_rule, neg_sum_to, negated_sum_applies, sum_to_batched,
    sweep, sweep_batched, sweep_checked)
from .cpu_fast import (  # noqa: F401 (the one-call entry points, re-exported from cpu)
    _AT_INDEX, _F64, _FLAT_AUX, FLAT, FLAT_MAX, IMPORT_CODE, RECORDABLE, SWEEPABLE,
    _flat_slots, _mark_scalar, flat_layout, grad_record, grad_scalar)

SAVES = np.array([op.saves for op in OPS], dtype=np.bool_)
CONST_CODE = next(op.code for op in OPS if op.name == "const")
FUNCTION_CODE = next(op.code for op in OPS if op.name == "function")
PROGRAM_CODE = next(op.code for op in OPS if op.name == "program")
_LAST_SPECIAL = max(op.code for op in OPS if op.kind == SPECIAL)
#: opcodes whose ``b`` column is an input slot
BSLOT = np.array([op.kind in (BINARY, ARRAY_OP) for op in OPS], dtype=np.bool_)
_NO_INT = np.zeros(0, dtype=np.int64)
_NO_NARY = (_NO_INT, np.zeros(1, dtype=np.int64), _NO_INT)  # read-only use in mark()


class _Marks(threading.local):
    """The markings found last, by (id of rows, inputs' and outputs' mask bytes): the
    marking is a function of these alone where no entry is N-ary, and a tape's rows are
    never written to (``seen_rows`` hands the same matrix to every tape of the same
    program), so an optimization loop's backward (llsq's, both of kmeans') marks once.
    Each holds its rows (so the id is not reused) and read-only copies."""

    def __init__(self):
        self.d = {}


_MARKS = _Marks()
_MARKS_MAX = 8  # markings kept per thread
_MARKS_N = 4096  # entries of the longest tape whose marking is kept (its masks' bytes a key)


def mark(rows, nx_entries, nx_ptr, nx_idx, is_input, is_output):
    """``need``: entries that depend on an input and reach an output; ``reach``: slots an
    output reaches through needed entries (an input with ``reach`` False is unused);
    the needed array entries, last first (read-only). The arrays are allocated here and
    filled by the compiled ``_mark_into`` (a compiled function that returns three arrays
    boxes each: a microsecond of a small backward); a marking found before (``_Marks``)
    is copied, not found again (3 us to 1)."""
    n = rows.shape[0]
    memo = None
    if n <= _MARKS_N and not len(nx_entries):
        key = (id(rows), is_input.tobytes(), is_output.tobytes())
        memo = _MARKS.d
        hit = memo.get(key)
        if hit is not None and hit[0] is rows:
            return hit[1].copy(), hit[2].copy(), hit[3]
    need = np.zeros(n, dtype=np.bool_)
    reach = is_output.copy()
    arr = np.empty(n, dtype=np.int64)
    arr = arr[:_mark_into(rows, nx_entries, nx_ptr, nx_idx, is_input, need, reach, arr)]
    arr.flags.writeable = False  # (kept by the memo: no caller writes to it)
    if memo is not None:
        if len(memo) >= _MARKS_MAX:
            memo.clear()
        kept = need.copy(), reach.copy()
        kept[0].flags.writeable = kept[1].flags.writeable = False
        memo[key] = (rows,) + kept + (arr,)
    return need, reach, arr


@njit_cached(nogil=True)
def _mark_into(rows, nx_entries, nx_ptr, nx_idx, is_input, need, reach, arr):
    """``mark``'s work into its arrays (``need`` zeros, ``reach`` the outputs, ``arr`` room
    for every entry); returns how many array entries ``arr`` holds."""
    n = rows.shape[0]
    dep = is_input.copy()
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
    j = nx_entries.shape[0] - 1
    n_arr = 0
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
    return n_arr




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


#: a grown tape of at most this many entries is converted whole through ``seen_rows``
_SEEN_GROWN = 256


class Graph:
    """The tapes of one backward laid end to end, with slots renumbered to match."""

    def __init__(self, tapes):
        self.tapes = tapes
        if len(tapes) == 1:
            t = tapes[0]
            self.index = {id(t): 0}
            self.n = len(t.vals)
            self.offsets = [0, self.n]
            c = t._cache
            if c is not None and c[0] != self.n and self.n <= _SEEN_GROWN:
                # a tape a create_graph sweep grew (kmeans' second backward): the same
                # program records the same rows each call, whose matrix seen_rows keeps
                # (a list comparison, not the new rows converted and concatenated)
                t._cache = (self.n, seen_rows(t.code, self.n))
            self.rows = t.rows()
            self._vals = None  # converted on first use: an array sweep may never read it
            arrays, vals = t.arrays, t.vals
            self.arrays = arrays  # (the array sweep's one lookup: array or not, and which)
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
            self._vals = np.concatenate([t.values() for t in tapes])
            self.arrays = None  # (slots of several tapes: is_array and value locate them)
            _outputs_to_their_entry(self.rows)
        self._nary()

    def _nary(self):
        tapes = self.tapes
        if not (tapes[0].nary if len(tapes) == 1 else any([t.nary for t in tapes])):
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

    @property
    def vals(self):
        """The scalar values as a float64 array (NaN where an array sits), the compiled
        sweep's input; only its first ``n`` (a create_graph sweep records onto the tape)."""
        v = self._vals
        if v is None:
            v = self.tapes[0].values()
            if len(v) != self.n:
                v = v[:self.n]
            self._vals = v
        return v

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
        tapes = self.tapes
        if len(tapes) == 1:  # (every backward asks: no generator for one tape)
            f = tapes[0].freed
            if f is None:
                return None
        elif all(t.freed is None for t in tapes):
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
    # backward through its unfreed entries needs should stay. The rows the sweep just
    # converted are read once more below (not converted again), then dropped
    c = t._cache
    rows = c[1] if c is not None and c[0] == n else None
    t._cache = t._vcache = None
    big = t.nbytes >= _RELEASE_BYTES
    if (big or t.nary) and STATE.trace is None:  # a trace lowers every entry it recorded
        # a short mask as a list (NumPy's any() costs 2 us of a small backward), which the
        # release reads again when it is the tape's whole freed mask
        sub_l = sub.tolist() if big and len(sub) <= _SHORT else None
        if big and (True in sub_l if sub_l is not None else sub.any()):
            _release(t, f, rows, sub_l if f is sub else None)
        if t.nary:
            _release_contexts(t, f)


#: a tape whose saved arrays take fewer bytes keeps them: they weigh about what its entries
#: do, and releasing them would cost a tenth of a small backward (the 10-element Rosenbrock)
_RELEASE_BYTES = 1 << 12

#: zero-stride stand-ins of released arrays, by (shape, dtype): read-only, so tapes share them
_PLACEHOLDERS = {}


#: the float64 ones again, by shape alone (the release's lookup per array)
_PLACEHOLDERS_F64 = {}
_CONST_ARRAY = CONST_CODE | ARRAY


def _placeholder(v):
    """A zero-stride read-only array of ``v``'s shape and dtype (rules that save nothing
    still read their inputs' shapes)."""
    key = (v.shape, v.dtype)
    p = _PLACEHOLDERS.get(key)
    if p is None:
        if len(_PLACEHOLDERS) >= 256:
            _PLACEHOLDERS.clear()
            _PLACEHOLDERS_F64.clear()
        p = _PLACEHOLDERS[key] = np.broadcast_to(np.zeros((), v.dtype), v.shape)
        if v.dtype is _F64:
            _PLACEHOLDERS_F64[v.shape] = p
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


#: tapes of at most this many entries test in Python whether every entry is freed
_SHORT = 64


class _All:
    """``drop`` where every entry goes: any index is True."""
    __slots__ = ()

    def __getitem__(self, k):
        return True


_ALL = _All()


#: (rows matrix, freed mask's bytes, drop) of the last short release: ``_release``
_LAST_DROP = [None]


def _release(tape, freed, rows=None, freed_l=None):
    """Drop the saved arrays whose producing entry is freed (or is bookkeeping) and that no
    unfreed entry reads; a tensor that holds such a value keeps its own reference. A
    constant's tensor goes too (torch frees saved inputs at backward), leaves stay (a later
    backward accumulates their ``.grad``). ``rows``: the tape's rows, when already
    converted (else converted here and not kept); ``freed_l``: ``freed`` as a list, when
    the caller has it."""
    code = tape.code
    n = len(freed)
    # what goes is a function of the rows and the freed mask alone (without N-ary entries,
    # whose inputs are in their aux), and a loop's tape of the same program hands the same
    # rows matrix to every backward (``seen_rows``, never written to): the last answer
    # kept (kmeans' second backward: 3.7 us of the release's 12 in place)
    key = freed.tobytes() if rows is not None and not tape.nary and n <= _SHORT else None
    last = _LAST_DROP[0]
    if key is not None and last is not None and last[0] is rows and last[1] == key:
        drop = last[2]
    elif n <= _SHORT and all([f or c & ~ARRAY <= _LAST_SPECIAL
                              for f, c in zip(freed.tolist() if freed_l is None else freed_l,
                                              code[0:n * ROW:ROW])]):
        # a short tape with every entry freed or bookkeeping (a whole graph swept, the
        # common case): no live entry reads a saved value, so all go (what _droppable finds
        # then, without its compiled call)
        drop = _ALL
    else:
        if rows is None:
            rows = tape.rows()
            tape._cache = None
        drop, live = _droppable(rows, freed, _LAST_SPECIAL, BSLOT)
        if live:
            for k in tape.nary:
                if not drop[k] and not freed[k]:
                    drop[tape.aux[k][0]] = False
        drop = drop.tolist()
    if key is not None:
        _LAST_DROP[0] = (rows, key, drop)  # (drop is never written once kept)
    arrays, aux, ph, ph64 = tape.arrays, tape.aux, _PLACEHOLDERS, _PLACEHOLDERS_F64
    every = drop is _ALL  # (then no lookup per array: _All's __getitem__ is Python's)
    # (one pass over every saved array, the per-array steps kept few: ode's 3,600 arrays
    # cost 1.7 ms; a float64 one's stand-in found by its shape alone)
    for k, v in arrays.items():
        if every or drop[k]:
            p = ph64.get(v.shape) if v.dtype is _F64 else ph.get((v.shape, v.dtype))
            if p is v:  # released by an earlier backward
                continue
            arrays[k] = _placeholder(v) if p is None else p
    # a dropped constant array's tensor goes with it: the constants are among the entered
    # values (``versioned``), fewer than the arrays
    consts = False
    for k in tape.versioned:
        if code[k * ROW] == _CONST_ARRAY and (every or drop[k]) and aux[k][0] is not None:
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
