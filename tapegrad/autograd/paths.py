"""Backward paths by name: force or disable one, and ask which one ran (a testing aid).

``grad``/``backward`` pick one of several sweeps for a call. The fast ones (``FAST``) are
tried first and decline whatever they cannot be sure of; the general ones (``GENERAL``)
are chosen by the call's options and take every program. The differential harness
(tests/test_differential.py) forces each path on the programs it accepts, so a fast path
is tested on everything it takes, not only on what happens to reach it.

Names (they stay the names of the strategies when paths become a list):

- ``scalar``: one compiled call over a scalar-only tape (``cpu.grad_scalar``).
- ``flat``: one compiled call over flat buffers, small arrays (``sweep_flat``).
- ``fused``: generated loops per shape for large elementwise regions (``fused``).
- ``record``: create_graph on a scalar-only tape, entries emitted compiled
  (``cpu.grad_record``).
- ``sweep``: the general NumPy sweep (``cpu.sweep``).
- ``rerecord``: create_graph, every rule re-recorded on tensors (``rerecord.sweep``).
- ``batched``: is_grads_batched without create_graph (``cpu.sweep_batched``).
- ``checked``: entry by entry, every rule's output checked (anomaly mode,
  ``cpu.sweep_checked``).

Forcing a path that declines the call raises ``PathDeclined`` (nothing runs, nothing is
freed): a forced path never silently hands the call to another one. All of this is per
thread and costs the engine one attribute read when nothing is forced.
"""
from __future__ import annotations

import contextlib
import threading

FAST = ("scalar", "flat", "fused", "record")
GENERAL = ("sweep", "rerecord", "batched", "checked")
PATHS = FAST + GENERAL


class PathDeclined(RuntimeError):
    """A forced backward path does not apply to this call (or a disabled one was the only
    one that did)."""


class _Control:
    __slots__ = ("forced", "off")

    def __init__(self, forced, off):
        self.forced = forced  # a name or None
        self.off = off        # frozenset of names

    def allows(self, name):
        if self.forced is not None:
            return name == self.forced
        return name not in self.off


class _Local(threading.local):
    def __init__(self):
        self.ctl = None   # a _Control while force/disable is active, else None
        self.last = None  # the path the last grad/backward of this thread took


STATE = _Local()


def _check(name):
    if name not in PATHS:
        raise ValueError(f"unknown backward path {name!r}; the paths are {list(PATHS)}")


@contextlib.contextmanager
def force(name):
    """Every grad/backward in this thread (inside the block) takes path ``name`` or raises
    ``PathDeclined``. ``fused`` compiles its loop at once (it normally waits for a
    structure's second sighting)."""
    _check(name)
    prev = STATE.ctl
    STATE.ctl = _Control(name, frozenset())
    try:
        yield
    finally:
        STATE.ctl = prev


@contextlib.contextmanager
def disable(*names):
    """Paths ``names`` are skipped in this thread (inside the block); a call that only they
    could take raises ``PathDeclined``."""
    for n in names:
        _check(n)
    prev = STATE.ctl
    off = frozenset(names) | (prev.off if prev is not None else frozenset())
    STATE.ctl = _Control(prev.forced if prev is not None else None, off)
    try:
        yield
    finally:
        STATE.ctl = prev


def last():
    """The name of the path the last grad/backward in this thread took (None before any)."""
    return STATE.last


def declined(name, why):
    raise PathDeclined(f"forced backward path {name!r} declined: {why}")
