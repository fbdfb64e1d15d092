"""The fast backward strategies (scalar, flat, fused, record): one compiled call each or decline."""
from __future__ import annotations

import threading

import numpy as np

from ..interpreters import _generated_cpu, cpu, fused
from ..tape import INPLACE, STATE, end_tape
from ..tensor import Tensor, _plain, _plain_s, _pyfloat
from .anomaly import ANOMALY
from .graph import HOOKS
from .paths import STATE as _PATHS, Path


def _scalar_case(y, inputs, arrays=False):
    """(tape, input slots) when ``grad(y, inputs)`` is the case the one-call paths cover:
    a 0-d float64 loss on one tape of scalar entries (no arrays, N-ary or retained entries,
    nothing freed or changed in place) and 0-d float64 leaves entered once each; else None.
    With ``arrays``, the tape and the leaves may hold arrays."""
    tape = y._tape
    if (tape is None or y._d.__class__ is not _pyfloat or (tape.arrays and not arrays)
            or tape.nary or tape.retained or tape.freed is not None or tape.reentered
            or tape.epoch != INPLACE[0] or tape.dirty or ANOMALY.enabled or HOOKS[0]):
        return None
    if inputs.__class__ is Tensor:
        inputs = (inputs,)
    elif inputs.__class__ is not list and inputs.__class__ is not tuple:
        return None
    sid = tape.sid
    slots = []
    for x in inputs:
        if (x.__class__ is not Tensor or x._sid != sid or x._tape is not None
                or (x._d.__class__ is not _pyfloat and not arrays) or not x._rg):
            return None
        slots.append(x._slot)
    if not slots:
        return None
    return tape, np.array(slots, dtype=np.int64)


def _scalar_applies(y, inputs, retain_graph):
    """``grad(y, inputs)`` with default options in one compiled call, for the case that
    dominates scalar optimization loops (``_scalar_case``, and no import on the path). None
    when anything else holds: the next path then runs (and raises whatever torch raises)."""
    case = _scalar_case(y, inputs)
    if case is None:
        return None
    tape, slots = case
    grads, need, used = cpu.grad_scalar(tape.rows(), tape.values(), slots, y._slot,
                                        cpu.SWEEPABLE,
                                        tape.imports[0] if tape.imports else y._slot)
    if not used:
        return None  # an unused input: the general path raises or returns None for it
    return tape, need, grads, retain_graph


def _scalar_run(plan):
    tape, need, grads, retain_graph = plan
    if not retain_graph:
        cpu.free_entries(tape, need)
        end_tape(tape)
    return tuple([_plain_s(v) for v in grads.tolist()])


def _flat_mark(y, inputs, case=None):
    """(tape, rows, need, lo, input slots) when the flat path may take the call
    (``_scalar_case`` with arrays, every input reached, every entry on the path one
    ``cpu.FLAT`` covers); else None. ``case``: ``_scalar_case``'s, when found already."""
    if case is None:
        tape = y._tape
        if tape is None or not tape.arrays:
            return None
        case = _scalar_case(y, inputs, arrays=True)
        if case is None:
            return None
    tape, ins = case
    rows = tape.rows()
    lo0 = tape.imports[0] if tape.imports else y._slot
    need, reach, lo, ok = cpu._mark_scalar(rows, ins, y._slot, cpu.FLAT, lo0)
    if not ok or not reach[ins].all():
        _DECLINED.v = (rows, ins.tolist(), y._slot, lo0)
        return None
    return tape, rows, need, lo, ins


class _Declined(threading.local):
    """The last marking ``_flat_mark`` declined: (rows, input slots, output slot, lowest
    entry). The marking is a function of these alone, and a tape's rows are never written
    to (``seen_rows`` hands the same matrix to every tape of the same program), so the same
    call again (an optimization loop's, llsq's) declines without marking: 5 us a backward."""
    v = None


_DECLINED = _Declined()


def _declined_before(y, inputs, tape):
    """Whether ``_flat_mark`` declined this very marking last time (see ``_Declined``).
    Declining then is what the full test would do: with these rows, slots and output the
    marking declines, and any other reason to decline (``_scalar_case``) declines too."""
    d = _DECLINED.v
    if d is None or d[2] != y._slot:
        return False
    if inputs.__class__ is Tensor:
        slots = [inputs._slot]
    elif inputs.__class__ is tuple or inputs.__class__ is list:
        slots = [x._slot if x.__class__ is Tensor else None for x in inputs]
    else:
        return False
    return (d[1] == slots and tape.rows() is d[0]
            and d[3] == (tape.imports[0] if tape.imports else y._slot))


def _past_flat_limit(tape, ins):
    """Whether the inputs alone overflow the flat buffers (they are in them whenever the
    flat path runs): then ``flat_layout`` is None, known before any marking."""
    arrays, total = tape.arrays, 0
    for s in ins.tolist():
        v = arrays.get(s)
        if v is not None:
            total += v.size
    # (an input given twice is packed once)
    return total > cpu.FLAT_MAX and sum([arrays[s].size for s in set(ins.tolist())
                                         if s in arrays]) > cpu.FLAT_MAX


class _Marked(threading.local):
    """What the flat path found marking the call it then declined, for the fused path
    tried next in the same call: ``(y, inputs, mark)``, the mark None when marking found
    none (``_flat_mark`` is None); ``v`` None: the fused path marks itself. Only written
    with nothing forced or off, so the fused path runs next and takes it out: a call never
    sees another's (the identity check guards that too)."""
    v = None


_MARKED = _Marked()


def _marked(y, inputs, m):
    if _PATHS.ctl is None:  # nothing forced or off: the fused path runs next in this call
        _MARKED.v = (y, inputs, m)


def _flat_applies(y, inputs, retain_graph):
    """``grad(y, inputs)`` with default options on a tape with small arrays, in one compiled
    call over flat buffers (``cpu.flat_layout``, ``sweep_flat``): a 0-d float64 loss on one
    tape, float64 leaves, and on the path elementwise ops, 1-d slices, full sums and means.
    None when anything else holds (past the buffers' size limit: the fused path)."""
    tape = y._tape
    if tape is None or not tape.arrays:
        return None
    if _declined_before(y, inputs, tape):
        return _marked(y, inputs, None)
    case = _scalar_case(y, inputs, arrays=True)
    if case is None or _past_flat_limit(*case):  # (a large array's backward: no marking)
        return None
    m = _flat_mark(y, inputs, case)
    if m is None:
        return _marked(y, inputs, None)
    tape, rows, need, lo, ins = m
    layout = cpu.flat_layout(tape, rows, need, lo, y._slot + 1)
    if layout is None:
        return _marked(y, inputs, m)
    off, size, V, p0, p1 = layout
    A = np.zeros(len(V), dtype=np.float64)
    A[y._slot] = 1.0
    if _generated_cpu.sweep_flat(rows, need, y._slot + 1, lo, off, size, V, A, p0, p1):
        return None  # broadcasting it does not run
    return tape, need, ins, off, A, retain_graph


def _flat_run(plan):
    tape, need, ins, off, A, retain_graph = plan
    out = []
    arrays = tape.arrays
    for s in ins.tolist():
        v = arrays.get(s)
        if v is None:
            out.append(_plain_s(float(A[s])))
        else:
            o = off[s]
            out.append(_plain(A[o:o + v.size].reshape(v.shape).copy()))
    if not retain_graph:
        cpu.free_entries(tape, need)
        end_tape(tape)
    return tuple(out)


def _fused_applies(y, inputs, retain_graph):
    """The flat path's calls past the flat buffers' size limit: the array entries run as one
    generated loop per shape (``interpreters.fused``, each rule rendered by the one
    emitter), the scalar entries compiled. None when the flat path takes the call, the
    region does not fit that form or its loop is not compiled yet (forcing the path
    compiles it at once)."""
    ctl, marked = _PATHS.ctl, _MARKED.v
    if marked is not None:
        _MARKED.v = None
    reused = ctl is None and marked is not None and marked[0] is y and marked[1] is inputs
    # (reused: the flat path marked this very call and declined it, or found no mark)
    m = marked[2] if reused else _flat_mark(y, inputs)
    if m is None:
        return None
    tape, rows, need, lo, ins = m
    if ((ctl is None or ctl.allows("flat")) and not reused
            and not _past_flat_limit(tape, ins)
            and cpu.flat_layout(tape, rows, need, lo, y._slot + 1) is not None):
        return None  # the flat path's (or, when it declined, the general sweep's)
    p = fused.plan_for(tape, rows, need, lo, y._slot + 1, ins)
    if p is None:
        return None
    fn = fused.kernel(p.text, force=ctl is not None and ctl.forced == "fused")
    if fn is None:
        return None
    adj = np.zeros(len(rows), dtype=np.float64)
    adj[y._slot] = 1.0
    G = fused.run(p, fn, tape, rows, tape.values(), need, lo, y._slot + 1, adj)
    out = []
    arrays = tape.arrays
    given = set()
    for s in ins.tolist():
        v = arrays.get(s)
        if v is None:
            out.append(_plain_s(float(adj[s])))
        elif s in G:
            g = G[s].reshape(v.shape)  # the loops' own array: handed out as it is
            if s in given:  # an input listed twice gets a gradient of its own, as in torch
                g = g.copy()
            given.add(s)
            out.append(_plain(g))
        else:
            return None
    return tape, need, tuple(out), retain_graph


def _fused_run(plan):
    tape, need, out, retain_graph = plan
    if not retain_graph:
        cpu.free_entries(tape, need)
        end_tape(tape)
    return out


def _record_applies(y, inputs, retain_graph):
    """``grad(y, inputs, create_graph=True)`` with default options in one compiled call:
    the sweep's entries are emitted by ``cpu.grad_record`` (appended to the loss's tape by
    ``_record_run``), which must be the one this thread records onto. Covers
    ``_scalar_case`` with every rule on the path recordable; None otherwise (the tensor
    sweep then records the same entries)."""
    case = _scalar_case(y, inputs)
    if case is None:
        return None
    tape, slots = case
    if STATE.tape() is not tape or STATE.trace is not None or len(tape.vals) >= tape.limit:
        return None
    base = len(tape.vals)
    rows, codes, values, gslots, gvals, ok = cpu.grad_record(
        tape.rows(), tape.values(), slots, y._slot, -1, 1.0, cpu.RECORDABLE,
        tape.imports[0] if tape.imports else y._slot, base)
    if not ok:
        return None
    return tape, rows, codes, values, gslots, gvals


def _record_run(plan):
    tape, rows, codes, values, gslots, gvals = plan
    tape.extend(rows, codes, values)
    sid, out = tape.sid, []
    for s, v in zip(gslots.tolist(), gvals.tolist()):
        if s < 0:  # a constant gradient (no path through a recorded value)
            out.append(_plain_s(v))
            continue
        t = Tensor()
        t._d = v
        t._rg = True
        t._tape = tape
        t._sid = sid
        t._slot = s
        out.append(t)
    return tuple(out)


SCALAR = Path("scalar", _scalar_applies, _scalar_run, graph=False)
FLAT = Path("flat", _flat_applies, _flat_run, graph=False)
FUSED = Path("fused", _fused_applies, _fused_run, graph=False)
RECORD = Path("record", _record_applies, _record_run, graph=True)
_FAST_NOGRAPH = (SCALAR, FLAT, FUSED)  # create_graph off, in the order they are tried
_FAST_GRAPH = (RECORD,)                # create_graph on (and the graph retained)
