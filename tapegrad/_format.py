"""How tensors print: torch's layout (fixed precision 4, scientific when the range asks for
it, summaries past 1000 elements), over NumPy values."""
from __future__ import annotations

import math

import numpy as np

PRECISION, THRESHOLD, EDGEITEMS, LINEWIDTH = 4, 1000, 3, 80


class _Formatter:
    def __init__(self, a):
        self.floating = a.dtype.kind == "f"
        self.int_mode, self.sci_mode, self.max_width = True, False, 1
        flat = a.reshape(-1)
        if not self.floating:
            for v in flat.tolist():
                self.max_width = max(self.max_width, len(_plain(v)))
            return
        vals = flat[np.isfinite(flat) & (flat != 0)].astype(np.float64)
        if vals.size == 0:
            return
        absv = np.abs(vals)
        lo, hi = absv.min(), absv.max()
        self.int_mode = bool(np.all(vals == np.ceil(vals)))
        self.sci_mode = bool(hi / lo > 1000.0 or hi > 1.0e8 or lo < 1.0e-4)
        for v in vals.tolist():
            if self.sci_mode:
                w = len(f"{v:.{PRECISION}e}")
            elif self.int_mode:
                w = len(f"{v:.0f}") + 1
            else:
                w = len(f"{v:.{PRECISION}f}")
            self.max_width = max(self.max_width, w)

    def format(self, v):
        if self.floating:
            if self.sci_mode:
                s = f"{v:{self.max_width}.{PRECISION}e}"
            elif self.int_mode:
                s = f"{v:.0f}"
                if not (math.isinf(v) or math.isnan(v)):
                    s += "."
            else:
                s = f"{v:.{PRECISION}f}"
        else:
            s = _plain(v)
        return (self.max_width - len(s)) * " " + s


def _plain(v):
    return str(v)


def _summarized(a):
    if a.ndim == 0:
        return a
    if a.ndim == 1:
        return np.concatenate((a[:EDGEITEMS], a[-EDGEITEMS:])) if len(a) > 2 * EDGEITEMS else a
    rows = list(a[:EDGEITEMS]) + list(a[-EDGEITEMS:]) if len(a) > 2 * EDGEITEMS else list(a)
    return np.stack([_summarized(r) for r in rows])


def _vector(a, indent, summarize, fmt):
    per_line = max(1, math.floor((LINEWIDTH - indent) / (fmt.max_width + 2)))
    if summarize and len(a) > 2 * EDGEITEMS:
        data = ([fmt.format(v) for v in a[:EDGEITEMS].tolist()] + [" ..."]
                + [fmt.format(v) for v in a[-EDGEITEMS:].tolist()])
    else:
        data = [fmt.format(v) for v in a.tolist()]
    lines = [", ".join(data[i:i + per_line]) for i in range(0, len(data), per_line)]
    return "[" + (",\n" + " " * (indent + 1)).join(lines) + "]"


def _nested(a, indent, summarize, fmt):
    if a.ndim == 0:
        return fmt.format(a.item())
    if a.ndim == 1:
        return _vector(a, indent, summarize, fmt)
    n = len(a)
    if summarize and n > 2 * EDGEITEMS:
        parts = ([_nested(a[i], indent + 1, summarize, fmt) for i in range(EDGEITEMS)] + ["..."]
                 + [_nested(a[i], indent + 1, summarize, fmt) for i in range(n - EDGEITEMS, n)])
    else:
        parts = [_nested(a[i], indent + 1, summarize, fmt) for i in range(n)]
    return "[" + ("," + "\n" * (a.ndim - 1) + " " * (indent + 1)).join(parts) + "]"


def body(a, indent):
    """The values part of ``tensor(...)``, as torch lays it out."""
    if a.size == 0:
        return "[]"
    summarize = a.size > THRESHOLD
    fmt = _Formatter(_summarized(a) if summarize else a)
    return _nested(a, indent, summarize, fmt)


def with_suffixes(text, suffixes, indent):
    """``text`` and ``suffixes`` joined as torch joins them (a new line past 80 columns)."""
    out = [text]
    last = len(text) - text.rfind("\n") + 1
    for s in suffixes:
        if last + len(s) + 2 > LINEWIDTH:
            out.append(",\n" + " " * indent + s)
            last = indent + len(s)
        else:
            out.append(", " + s)
            last += len(s) + 2
    out.append(")")
    return "".join(out)
