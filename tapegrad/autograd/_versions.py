"""Torch's check that no value saved for a backward was changed in place since it was recorded."""
from __future__ import annotations

import numpy as np

from ..ops import ARRAY, OPS
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
        for k, box, ver in t.viewed:
            if box[0] != ver:
                s = graph.slot(t, k)
                if first is None:
                    first, saves_out = _first_savers(graph, need)
                if reach[s] and first[s] < n:
                    _version_error(None, box[0], ver)


# what torch saves for backward where that differs from what the op's rule reads (its
# ``uses``; an array op's are all of a, b and out): torch raises after an in-place change
# of a saved value only, and a tape entry keeps the old value, so the rest computes right
_TORCH_SAVES = {"relu": {"out"}, "rdivc": set(), "softmax": {"out"}, "log_softmax": {"out"},
                "matmul": {"a", "b"}, "outer": {"a", "b"}, "prod": {"a", "out"},
                "amax": {"a", "out"}, "amin": {"a", "out"}, "norm": {"a", "out"},
                "logsumexp": {"a", "out"}}
# per opcode: whether its entry saves input a, input b, its output
_SAVES_A, _SAVES_B, _SAVES_OUT = (
    np.array([w in _TORCH_SAVES.get(op.name, op.uses) for op in OPS], dtype=np.bool_)
    for w in ("a", "b", "out"))


_MAX_LIKE = np.array([op.name in ("amax", "amin") for op in OPS], dtype=np.bool_)


def _first_savers(graph, need):
    """Per slot, the first needed entry that saved its value as torch would (len(rows)
    when none), and whether each entry saved its output: one pass, so a backward after
    many in-place ops stays linear."""
    rows = graph.rows
    n = len(rows)
    codes = rows[:, 0].astype(np.int64) & ~ARRAY
    sa, sb, so = _SAVES_A[codes], _SAVES_B[codes], _SAVES_OUT[codes]
    for k in np.flatnonzero(_MAX_LIKE[codes] & need).tolist():
        how = graph.aux(k)[2]
        if how is not None and not isinstance(how, str):  # max(dim): torch saves indices
            sa[k] = so[k] = False
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
