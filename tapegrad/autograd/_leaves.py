"""A sweep's inputs and results: the leaves it reaches, retained gradients, accumulating .grad."""
from __future__ import annotations

import threading

import numpy as np

from ..ops import ARRAY, BY_NAME
from ..tape import bump
from ..tensor import Tensor, _plain, _plain_s, _pyfloat
from . import hooks
from .graph import HOOKS, bound_tensor


def _check_unused(i, allow_unused):
    if not allow_unused:
        raise RuntimeError(f"The differentiated Tensor at index {i} appears to not have been "
                           "used in the graph. Set allow_unused=True if this is the desired "
                           "behavior.")


def _zeros_for(x):
    return _plain(0.0) if x._d.__class__ is _pyfloat else _plain(np.zeros(x.shape, x.dtype.np))


def _as_tensor(r, x):
    d = x._d
    if d.__class__ is _pyfloat:
        return _plain_s(float(r))
    if r.__class__ is np.ndarray and r.dtype is d.dtype and r.shape == d.shape:
        return _plain(r.copy("K"))  # (the common case: no dtype or Size object built)
    return _plain(np.array(r, dtype=x.dtype.np, copy=True).reshape(x.shape))


LEAF, CONST = BY_NAME["leaf"].code, BY_NAME["const"].code
_ACCUMULATE = threading.Lock()  # threads may run backward into the same leaves


def _accumulate(x, r):
    with _ACCUMULATE:
        _accumulate_locked(x, r)


def _accumulate_locked(x, r):
    g = getattr(x, "_grad", None)
    if isinstance(r, Tensor):  # create_graph: out of place, so .grad keeps its history
        x._grad = r if g is None else g + r
        return
    if g is None:
        x._grad = _as_tensor(r, x)
    elif g._d.__class__ is _pyfloat:
        g._d = g._d + float(r)
    else:
        v = np.asarray(r, dtype=g.dtype.np).reshape(g.shape)
        if g._d.flags.writeable:
            np.add(g._d, v, out=g._d)
            bump(g._ver)
        else:
            g._d = g._d + v


def _zeros_like_input(x, record):
    if record:
        return _zeros_for(x)
    return 0.0 if x._d.__class__ is _pyfloat else np.zeros(x.shape, x.dtype.np)


def _slot_tensors(graph):
    """``as_tensor(slot)`` for the re-recording sweep: the leaf or constant itself, or a
    non-leaf tensor bound to the slot (so rules record on top of the recorded graph)."""
    cache = {}
    leafish = (LEAF, CONST)
    single = graph.tapes[0] if len(graph.tapes) == 1 else None

    def as_tensor(s):
        t = cache.get(s)
        if t is None:
            tape, k = (single, s) if single is not None else graph.locate(s)
            code = tape.code[k * 5] & ~ARRAY
            if code == CONST:
                # the value recorded, not the tensor: an in-place op with grad since then
                # (``c *= x``, c not requiring grad) rebinds that tensor to its result
                v = graph.value(s)
                t = _plain_s(v) if v.__class__ is _pyfloat else _plain(v)
            elif code in leafish:
                t = tape.aux[k][0]
                if t is None:  # a constant a backward released (cpu._release): its shape
                    t = _plain(graph.value(s))
            else:
                t = bound_tensor(tape, k, graph.value(s))
            cache[s] = t
        return t
    return as_tensor


def _fill_retained(graph, need, reach, is_output, adj, adjd, skip, record=False):
    """retain_grad is a hook, as in torch: every sweep that computes a retaining non-leaf's
    gradient accumulates it into that tensor's ``.grad`` (grad() included)."""
    for t in graph.tapes:
        if not t.retained:
            continue
        off = graph.slot(t, 0)
        for k, ref in list(t.retained.items()):
            x = ref()
            if x is None or x._tape is not t or x._slot != k:
                del t.retained[k]
                continue
            if id(x) in skip:  # backward() accumulates into it as an input already
                continue
            s = off + k
            if reach[s] and (need[s] or is_output[s]):
                v = adjd.get(s) if (record or graph.is_array(s)) else adj[s]
                _accumulate(x, v if v is not None else _zeros_like_input(x, record))


def _slots_of(graph, x):
    if len(graph.tapes) == 1 and x._tape is None:
        return graph.tapes[0].leaf_slots(x)
    if x._tape is not None:
        s = graph.slot(x._tape, x._slot)
        return [] if s is None else [s]
    out = []
    for t in graph.tapes:
        ks = t.leaf_slots(x)
        if ks:
            off = graph.slot(t, 0)
            out.extend(off + k for k in ks)
    return out


def _reached_leaves(graph, outs, slots):
    """The leaves at ``slots`` (the leaf entries the outputs reach) in entering order, with
    their slots, and leaf outputs (backward on a leaf itself): the inputs of a backward.
    Leaves the outputs do not reach get no gradient, so they are not looked at."""
    ins, lists, seen = [], [], {}
    single = graph.tapes[0] if len(graph.tapes) == 1 else None
    for s in slots.tolist():
        tape, k = (single, s) if single is not None else graph.locate(s)
        leaf = tape.aux[k][0]
        i = seen.get(id(leaf))
        if i is None:
            seen[id(leaf)] = len(ins)
            ins.append(leaf)
            lists.append([s])
        else:
            lists[i].append(s)
    for y in outs:
        if y._tape is None and id(y) not in seen:
            seen[id(y)] = len(ins)
            ins.append(y)
            lists.append([])
    return ins, lists


def _leaf_outputs_only(outs, seeds, ins, batch=None):
    collect = ins is None
    if collect:
        ins = []
        for y in outs:
            if all(y is not x for x in ins):
                ins.append(y)
    results, used = [], []
    for x in ins:
        total = None
        for y, s in zip(outs, seeds):
            if y is x:
                total = s if total is None else total + s
        if HOOKS[0] and total is not None:  # a leaf's own hooks, on its seed
            total = hooks.leaf_output_hooks(x, total, batch)
        results.append(total)
        used.append(total is not None)
    return (results, used, ins) if collect else (results, used)
