"""Anomaly detection: ``detect_anomaly`` / ``set_detect_anomaly``, as torch's.

While it is on, new tapes remember the source line that recorded each entry, and every
backward sweeps entry by entry in Python, checking each rule's outputs for NaN; the error
names the op and, when it was recorded in anomaly mode, the line that recorded it.
"""
from __future__ import annotations

import linecache
import os
import sys
import warnings

from .. import tape as _tape

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Anomaly:
    enabled = False
    check_nan = True


ANOMALY = _Anomaly()


class SourceList(list):
    """``Tape.vals`` in anomaly mode: each append notes the user's line that made it."""

    __slots__ = ("lines",)

    def __init__(self):
        super().__init__()
        self.lines = []

    def append(self, value):
        super().append(value)
        frame = sys._getframe(1)
        while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
                _PACKAGE):
            frame = frame.f_back
        if frame is None:
            self.lines.append(None)
        else:
            f, n = frame.f_code.co_filename, frame.f_lineno
            self.lines.append((f, n, linecache.getline(f, n).strip()))


def source_of(tape, k):
    """'file:line: code' of entry ``k`` when it was recorded in anomaly mode, else None."""
    lines = getattr(tape.vals, "lines", None)
    if lines is None or k >= len(lines) or lines[k] is None:
        return None
    f, n, text = lines[k]
    return f"{f}:{n}: {text}"


def is_anomaly_enabled():
    return ANOMALY.enabled


def is_anomaly_check_nan_enabled():
    return ANOMALY.check_nan


def _set(mode, check_nan):
    prev = (ANOMALY.enabled, ANOMALY.check_nan)
    if mode and not ANOMALY.enabled:
        current = _tape.STATE.tape()
        if current:  # record from here on onto a tape that notes lines
            _tape.end_tape(current)
        elif current is not False and current is not None:
            _tape.end_tape(current)
    ANOMALY.enabled, ANOMALY.check_nan = bool(mode), bool(check_nan)
    _tape.Tape.vals_factory = SourceList if mode else list
    return prev


class detect_anomaly:
    """Context manager / decorator that turns anomaly detection on."""

    def __init__(self, check_nan=True):
        self.check_nan = check_nan
        warnings.warn("Anomaly Detection has been enabled. This mode will increase the "
                      "runtime and should only be enabled for debugging.", UserWarning,
                      stacklevel=2)

    def __enter__(self):
        self._prev = _set(True, self.check_nan)
        return self

    def __exit__(self, *exc):
        _set(*self._prev)
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.__class__(self.check_nan):
                return fn(*args, **kwargs)
        return wrapper


class set_detect_anomaly:
    """Sets anomaly detection on or off, at once or for a ``with`` block."""

    def __init__(self, mode, check_nan=True):
        self._prev = _set(mode, check_nan)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _set(*self._prev)
        return False


def nan_error(graph, k, i):
    """The RuntimeError for entry ``k`` whose rule returned NaN/inf for its input ``i``."""
    from ..interpreters.cpu import backward_name
    from ..ops import ARRAY, OPS
    op = OPS[int(graph.row(k)[0]) & ~ARRAY]
    tape, local = graph.locate(k)
    where = source_of(tape, local)
    msg = f"Function '{backward_name(op)}' returned nan or inf values in its {i}th output."
    if where:
        msg += f" The forward call that recorded it: {where}"
    else:
        msg += (" Turn anomaly detection on while recording the forward pass to see the line "
                "that recorded it.")
    return RuntimeError(msg)
