"""Torch's check that no value saved for a backward was changed in place since it was recorded."""
from __future__ import annotations

import numpy as np

from ..ops import ARRAY, BY_NAME, OPS
from ..tape import INPLACE


def _check_versions(graph, need, reach):
    """Raise, as torch does, when a value saved for this backward was changed in place
    after it was recorded."""
    first = None  # per slot: the first needed entry that saved it (built when needed)
    n = len(graph.rows)
    for t in graph.tapes:
        # an in-place op with grad rebinds its tensor (tape.dirty) without a version bump
        if t.dirty:
            if first is None:
                first, saves_out = _first_savers(graph, need)
            off = graph.slot(t, 0)
            ks = np.fromiter(t.dirty.keys(), dtype=np.int64, count=len(t.dirty)) + off
            until = np.fromiter(t.dirty.values(), dtype=np.int64, count=len(t.dirty)) + off
            if ((need[ks] & saves_out[ks]) | (first[ks] < until)).any():
                _version_error(None, 1, 0)
        if t.epoch == INPLACE[0]:  # nothing changed in place since this tape began
            continue
        for k in t.versioned:
            x, ver = t.aux[k]
            if x._ver[0] != ver:
                s = graph.slot(t, k)
                if first is None:
                    first, saves_out = _first_savers(graph, need)
                if reach[s] and first[s] < n:
                    _version_error(x, x._ver[0], ver)
        vw = t.viewed  # (flat: entry, box, version, ...)
        for k, box, ver in zip(vw[0::3], vw[1::3], vw[2::3]):
            if box[0] != ver:
                s = graph.slot(t, k)
                if first is None:
                    first, saves_out = _first_savers(graph, need)
                if reach[s] and first[s] < n:
                    _version_error(None, box[0], ver)


# per opcode: whether its entry saves input a, input b, its output as torch does (each op's
# ``torch_saves``, ``Op.saved``): always, or when input a / input b requires grad (torch saves
# what the formulas of the inputs that require grad read: ``h @ w`` with w a constant saves
# w only); where that depends on the entry's aux, per needed entry
_VALUES = ("a", "b", "out")
_SAVES_ALWAYS, _SAVES_IF_A, _SAVES_IF_B = (
    np.array([[w in (() if callable(op.torch_saves) or by and not op.saves_by_input
                     else op.saved(grads=grads)) for w in _VALUES] for op in OPS],
             dtype=np.bool_)
    for by, grads in ((False, ()), (True, ("a",)), (True, ("b",))))
_SAVES_BY_AUX = np.array([callable(op.torch_saves) for op in OPS], dtype=np.bool_)
CONST = BY_NAME["const"].code


def _first_savers(graph, need):
    """Per slot, the first needed entry that saved its value as torch would (len(rows)
    when none), and whether each entry saved its output: one pass, so a backward after
    many in-place ops stays linear."""
    rows = graph.rows
    n = len(rows)
    codes = rows[:, 0].astype(np.int64) & ~ARRAY
    saves = _SAVES_ALWAYS[codes]
    for col, by in ((1, _SAVES_IF_A), (2, _SAVES_IF_B)):  # an input that requires grad
        src = rows[:, col].astype(np.int64)
        rg = (src >= 0) & (codes[src] != CONST)
        saves |= rg[:, None] & by[codes]
    sa, sb, so = saves[:, 0], saves[:, 1], saves[:, 2]
    for k in np.flatnonzero(_SAVES_BY_AUX[codes] & need).tolist():
        saved = OPS[codes[k]].saved(graph.aux(k))  # max(dim): torch saves the indices only
        sa[k], sb[k], so[k] = "a" in saved, "b" in saved, "out" in saved
    first = np.full(n, n, dtype=np.int64)
    idx = np.arange(n, dtype=np.int64)
    for col, saves in ((1, sa), (2, sb)):
        src = rows[:, col]
        m = need & saves & (src >= 0)
        np.minimum.at(first, src[m].astype(np.int64), idx[m])
    return first, so


def _version_error(x, now, ver):
    what = f"[{x.dtype} {list(x.shape)}]" if x is not None else "a tensor"
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {what} is at version {now}; expected version {ver} instead. "
        "Hint: change the in-place operation to an out-of-place one (x = x + y instead of "
        "x += y), or record the graph again after the change.")
