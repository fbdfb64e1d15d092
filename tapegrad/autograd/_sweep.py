"""The general backward strategies (hooks, rerecord, batched, checked, sweep) and their sweep."""
from __future__ import annotations

import numpy as np

from ..interpreters import cpu, rerecord
from ..ops import ARRAY
from ..tape import STATE, end_tape, set_grad_mode
from ..tensor import _plain, _pyfloat
from ._fast_paths import _FAST_GRAPH, _FAST_NOGRAPH
from ._leaves import (LEAF, _check_unused, _fill_retained, _leaf_outputs_only, _reached_leaves,
                      _slot_tensors, _slots_of, _zeros_like_input)
from ._tensor_backend import TensorF
from ._versions import _check_versions
from .anomaly import ANOMALY, nan_error
from . import hooks
from .graph import HOOKS
from .paths import STATE as _PATHS, STRATEGIES, Path, declined as _declined


def _run(outs, seeds, ins, retain_graph, skip_retained=(), fast=False, record=False,
         batch=None, allow_unused=True, accumulate=None):
    """One reverse sweep. With ``ins`` None (backward), the inputs are the graph's leaves
    and retained non-leaves, returned as a third value. With ``record`` (create_graph) the
    seeds are tensors and the sweep re-records every rule, so the results are tensors (an
    input ``allow_unused`` rejects is rejected before anything is recorded)."""
    path = _general_path(record, batch)
    _PATHS.last = path.name
    roots = _roots(outs)
    if not roots:
        return _leaf_outputs_only(outs, seeds, ins, batch)
    tapes = cpu.order_tapes(roots)
    graph = cpu.Graph(tapes)
    # backward (no ``ins``): every leaf on the tapes may be an input; the ones the outputs
    # reach are found after marking, so the work here is the output's graph's
    collect = ins is None
    slot_lists = None if collect else _input_slots(graph, tapes, ins)
    flat, is_input, fast_leaves = _input_mask(graph, ins, slot_lists, fast, record, batch)
    is_output, adj, adjd, direct = _seed_adjoints(graph, outs, seeds, record, batch)
    need, reach, arr = cpu.mark(graph.rows, *graph.nx, is_input, is_output)
    if collect:
        ins, slot_lists = _reached_leaves(graph, outs, np.flatnonzero(reach & is_input))
        skip_retained = {id(x) for x in ins}
        flat = [s for sl in slot_lists for s in sl]
    wanted = graph.wanted = need | is_input  # slots whose gradient anyone will read
    wanted |= is_output  # (in place: one array less)
    cpu.check_not_freed(graph, need)
    _check_versions(graph, need, reach)
    # only the hooks path runs hooks
    if HOOKS[0] and hooks.graph_has_hooks(graph, ins, (need | is_input | is_output) & reach):
        if batch:  # torch vmaps the hooks over the batch: here, one sweep per sample
            return _per_sample(outs, seeds, ins, retain_graph, record, batch, allow_unused,
                               graph, need, tapes)
        path = _general_path(record, batch, hooked=True)
        fast_leaves = False
    sw = _Sweep(graph, need, reach, arr, adj, adjd, is_input, is_output, accumulate,
                batch, ins, slot_lists, direct, allow_unused)
    sw.outs, sw.record = outs, record
    _PATHS.last = path.name
    path.run(sw)
    adj, adjd = sw.adj, sw.adjd
    if fast_leaves and not ANOMALY.enabled:
        flat_arr = np.array(flat, dtype=np.int64)
        if reach[flat_arr].all() and not direct:
            results = adj[flat_arr].tolist()
            _fill_retained(graph, need, reach, is_output, adj, adjd, skip_retained)
            if not retain_graph:
                _release(graph, need, tapes)
            return results, True
    results, used = _gather(sw, flat, tapes, fast)
    _fill_retained(graph, need, reach, is_output, adj, adjd, skip_retained, record)
    if not retain_graph:
        _release(graph, need, tapes)
    if collect:
        return results, used, ins
    return results, used


def _roots(outs):
    """The tapes the outputs were recorded on, each once, in the outputs' order."""
    if len(outs) == 1:  # (one loss: no generator per output)
        t = outs[0]._tape
        return [] if t is None else [t]
    roots = []
    for y in outs:
        if y._tape is not None and all(y._tape is not r for r in roots):
            roots.append(y._tape)
    return roots


def _input_slots(graph, tapes, ins):
    """Per input, its slots in ``graph``."""
    if len(tapes) == 1:
        tape0 = tapes[0]
        return [tape0.leaf_slots(x) if x._tape is None else
                ([x._slot] if x._tape is tape0 else []) for x in ins]
    return [_slots_of(graph, x) for x in ins]


def _input_mask(graph, ins, slot_lists, fast, record, batch):
    """(the inputs' slots, which slots are inputs, whether the results come straight out of
    the adjoint array); with ``ins`` None (backward) every leaf entry is an input."""
    if ins is None:
        return None, (graph.rows[:, 0].astype(np.int64) & ~ARRAY) == LEAF, False
    flat = [s for sl in slot_lists for s in sl]
    # one slot per input, all 0-d float64: results come straight out of the adjoint array
    fast_leaves = (fast and not record and not batch and len(flat) == len(ins)
                   and all([x._d.__class__ is _pyfloat for x in ins])
                   and not graph.arrays_at(flat))
    is_input = np.zeros(graph.n, dtype=np.bool_)
    if len(flat) == 1:  # one input slot: an item (indexing with a list costs a microsecond)
        is_input[flat[0]] = True
    else:
        is_input[flat] = True
    return flat, is_input, fast_leaves


def _seed_adjoints(graph, outs, seeds, record, batch):
    """(which slots are outputs, the 0-d adjoints, the array or tensor ones, the seeds of
    outputs that are leaves themselves by id) with the outputs' seeds in place."""
    n = graph.n
    is_output = np.zeros(n, dtype=np.bool_)
    # -0.0, the identity of IEEE addition: an adjoint is the exact sum of what reaches it,
    # a -0.0 seed or contribution kept (torch's sign; 0.0 + -0.0 would be +0.0)
    adj = np.empty((n, batch) if batch else n)
    adj.fill(-0.0)  # (np.full's Python steps cost 1 us more per backward)
    adjd = {}
    direct = {}
    if len(outs) == 1 and graph.arrays is not None and outs[0]._tape is not None:
        # one output on one tape (a loss): its slot is its own, no lookup through the graph
        k = outs[0]._slot
        is_output[k] = True
        if record or k in graph.arrays:
            adjd[k] = seeds[0]
        else:
            adj[k] += seeds[0]
        return is_output, adj, adjd, direct
    for y, s in zip(outs, seeds):
        if y._tape is None:
            direct[id(y)] = direct.get(id(y), 0.0) + s
            continue
        k = graph.slot(y._tape, y._slot)
        is_output[k] = True
        if record:
            adjd[k] = s if k not in adjd else adjd[k] + s
        elif graph.is_array(k):
            adjd[k] = s if k not in adjd else adjd[k] + s
        else:
            adj[k] += s
    return is_output, adj, adjd, direct


def _gather(sw, flat, tapes, fast=False):
    """(result, used) per input of a finished sweep: each input's slots' adjoints summed.
    With ``fast`` (grad() without create_graph, which copies each array result into a new
    tensor), an adjoint the sweep owns is that tensor already: no copy of it is made."""
    graph, reach, adj, adjd, direct = sw.graph, sw.reach, sw.adj, sw.adjd, sw.direct
    record, batch, is_array, owned = sw.record, sw.batch, sw.is_array, sw.owned
    # only the inputs' slots are read: no pass over the whole tape in Python. Batched: each
    # slot's row stays an array (an input entered on several tapes sums its rows)
    if batch or len(flat) > 8:
        reach_l = dict(zip(flat, reach[flat].tolist()))
        adj_l = dict(zip(flat, adj[flat].tolist() if not batch else list(adj[flat])))
    elif len(flat) == 1:  # one input slot (a loss's one parameter): no comprehension
        s = flat[0]
        reach_l, adj_l = {s: reach.item(s)}, {s: adj.item(s)}
    else:  # a few inputs: one item each (indexing with a list costs microseconds)
        reach_l = {s: reach.item(s) for s in flat}
        adj_l = {s: adj.item(s) for s in flat}
    if is_array is not None:
        pass
    elif len(tapes) == 1:
        is_array = tapes[0].arrays.__contains__
    else:
        is_array = graph.is_array
    results, used = [], []
    for x, sl in zip(sw.ins, sw.slot_lists):
        if len(sl) == 1 and not direct:  # the common case: one slot per input
            s = sl[0]
            if not reach_l[s]:
                results.append(None)
                used.append(False)
            elif is_array(s) or record:
                v = adjd.get(s)
                if v is None:  # reached, but every rule on the way gave None (torch's
                    results.append(None)  # undefined gradient: a Function's None, the
                    used.append(False)  # norm of order 0): unused, as torch says
                    continue
                elif (fast and s in owned and x._d.__class__ is np.ndarray
                      and v.dtype == x._d.dtype and v.shape == x._d.shape):
                    # the sweep allocated it and is done with it: no seed, saved value or
                    # .grad is it (a rule may have passed it on as another slot's adjoint,
                    # which is never written in place, and is copied when handed out)
                    owned.remove(s)  # (an input given twice: the second one is a copy)
                    v = _plain(v)
                results.append(v)
                used.append(True)
            else:
                results.append(adj_l[s])
                used.append(True)
            continue
        total, u = None, False
        for s in sl:
            if reach_l[s]:
                u = True
                v = adjd.get(s) if is_array(s) else adj_l[s]
                if v is not None:
                    total = v if total is None else total + v
        if direct and id(x) in direct:
            u = True
            total = direct[id(x)] if total is None else total + direct[id(x)]
        if u and total is None:
            total = _zeros_like_input(x, record)
        results.append(total)
        used.append(u)
    return results, used


def _release(graph, need, tapes):
    """Free what the sweep needed and end its tapes (a backward without retain_graph)."""
    graph.free(need)
    for t in tapes:
        end_tape(t)


class _Sweep:
    """What a general path's ``run`` reads and writes: the marked graph, the adjoints (0-d
    in ``adj``, arrays and tensors in ``adjd``), and for the results ``is_array`` (None: the
    tape's own test)."""
    __slots__ = ("graph", "need", "reach", "arr", "adj", "adjd", "is_input", "is_output",
                 "accumulate", "batch", "ins", "slot_lists", "direct", "allow_unused",
                 "is_array", "outs", "record", "owned")

    def __init__(self, graph, need, reach, arr, adj, adjd, is_input, is_output, accumulate,
                 batch, ins, slot_lists, direct, allow_unused):
        self.graph, self.need, self.reach, self.arr = graph, need, reach, arr
        self.adj, self.adjd, self.is_input, self.is_output = adj, adjd, is_input, is_output
        self.accumulate, self.batch, self.ins = accumulate, batch, ins
        self.slot_lists, self.direct, self.allow_unused = slot_lists, direct, allow_unused
        self.is_array = None
        self.outs = ()  # the call's outputs (a leaf output's hooks see its whole gradient)
        self.record = False  # create_graph: the rules are re-recorded on tensors
        # slots whose adjoint array the sweep allocated and nothing else references (the
        # sweep strategy fills it): grad() returns such an input's adjoint without a copy
        self.owned = ()


def _general_path(record, batch, hooked=False):
    """The general strategy for a sweep's options: the first of ``_GENERAL`` whose
    ``applies`` takes them. Under ``paths.force``/``disable`` it must be allowed: a forced
    ``checked`` takes whatever ``sweep`` takes; otherwise ``PathDeclined``."""
    if not (record or batch or hooked or ANOMALY.enabled) and _PATHS.ctl is None:
        return SWEEP  # (the common call: what the loop below finds, without its five tests)
    call = (record, batch, hooked)
    for p in _GENERAL:
        if p.applies(call):
            break
    ctl = _PATHS.ctl
    if ctl is None or ctl.allows(p.name):
        return p
    if ctl.forced == "checked" and p is SWEEP:
        return CHECKED  # the checked sweep takes whatever the general one takes
    _declined(ctl.forced or p.name, f"this call takes the {p.name!r} path")


def _hooks_run(sw):
    leaves = {id(y): y for y in sw.outs if y._tape is None}
    if not sw.record:
        hooks.sweep(sw.graph, sw.need, sw.adj, sw.adjd, sw.is_input, sw.is_output, sw.reach,
                    sw.accumulate, sw.direct, leaves)
        return
    graph = sw.graph

    def run(adjd):
        hooks.sweep(graph, sw.need, sw.adj, adjd, sw.is_input, sw.is_output, sw.reach,
                    sw.accumulate, sw.direct, leaves,
                    rec=(TensorF, _slot_tensors(graph), lambda u, v: u + v))
        return adjd
    # no rollback: the hooks' own code ran, and may hold what it recorded (a .grad
    # accumulated before a later hook raised, a logged tensor), as it may in torch
    _recorded(sw, run, rollback=False)


def _rerecord_run(sw):
    graph = sw.graph
    _recorded(sw, lambda adjd: rerecord.sweep(graph, sw.need, adjd, TensorF,
                                              _slot_tensors(graph), lambda u, v: u + v,
                                              batch=sw.batch))


def _recorded(sw, sweep, rollback=True):
    """Run ``sweep(seeds) -> adjoints`` recording (create_graph): unused inputs are
    rejected first, and (with ``rollback``) a sweep that fails part way leaves nothing
    recorded."""
    if not sw.allow_unused:  # raise before recording anything
        reach = sw.reach
        for i, sl in enumerate(sw.slot_lists):
            if not any([reach.item(s) for s in sl]) and id(sw.ins[i]) not in sw.direct:
                _check_unused(i, False)
    prev = STATE.grad_enabled
    set_grad_mode(True)  # create_graph wins over an enclosing no_grad, as in torch
    tape = STATE.tape()
    start = len(tape.vals) if tape else 0
    graph = sw.graph
    try:
        sw.adjd = sweep(sw.adjd)
    except BaseException:
        if tape and rollback:  # a rule that failed part way leaves nothing recorded
            tape.truncate(start)
        raise
    finally:
        set_grad_mode(prev)
    sw.is_array = sw.adjd.__contains__  # every adjoint is a tensor in adjd
    sw.adj = np.zeros(graph.n)


def _per_sample(outs, seeds, ins, retain_graph, record, batch, allow_unused, graph, need,
                tapes):
    """is_grads_batched through a graph with hooks: one hooked sweep per sample, stacked.
    torch calls each hook once under vmap, on one sample's gradient; the values are the
    same, a hook is called once per sample here (docs/differences.md)."""
    per = [_run(outs, [sd[i] for sd in seeds], ins, True, record=record,
                allow_unused=allow_unused) for i in range(batch)]
    used = per[0][1]
    results = []
    for j, u in enumerate(used):
        if not u:
            results.append(None)
        elif record:
            from ..functions import stack
            results.append(stack([p[0][j] for p in per]))
        else:
            results.append(np.stack([np.asarray(p[0][j]) for p in per]))
    if not retain_graph:
        graph.free(need)
        for t in tapes:
            end_tape(t)
    return results, used


def _batched_run(sw):
    cpu.sweep_batched(sw.graph, sw.need, sw.adj, sw.adjd, sw.arr)


def _checked_run(sw):
    graph = sw.graph
    cpu.sweep_checked(graph, sw.need, sw.adj, sw.adjd, lambda k, i: nan_error(graph, k, i))


def _sweep_run(sw):
    sw.owned = set()
    cpu.sweep(sw.graph, sw.need, sw.adj, sw.adjd, sw.arr, sw.owned)


# the general strategies: ``applies`` reads (create_graph, batch size, hooked) and says
# yes before anything is swept; the sweep itself is ``run``. Tried in this order.
HOOKS_PATH = Path("hooks", lambda c: c[2], _hooks_run)
RERECORD = Path("rerecord", lambda c: c[0], _rerecord_run)
BATCHED = Path("batched", lambda c: bool(c[1]), _batched_run)
CHECKED = Path("checked", lambda c: ANOMALY.enabled and ANOMALY.check_nan, _checked_run)
SWEEP = Path("sweep", lambda c: True, _sweep_run)
_GENERAL = (HOOKS_PATH, RERECORD, BATCHED, CHECKED, SWEEP)
STRATEGIES[:] = _FAST_NOGRAPH + _FAST_GRAPH + _GENERAL
