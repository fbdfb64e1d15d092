"""Backward paths: one ordered list of strategies, and by name force or disable one, and
ask which one ran (a testing aid).

``grad``/``backward`` pick one strategy (``Path``) per call from ``STRATEGIES``, in order:
the first whose ``applies`` accepts the call runs it. The fast ones (``FAST``) are tried
first and decline whatever they cannot be sure of; the general ones (``GENERAL``) are
chosen by the call's options and take every program. The differential harness
(tests/test_differential.py) forces each path on the programs it accepts, so a fast path
is tested on everything it takes, not only on what happens to reach it.

Names (they stay the names of the strategies when paths become a list):

- ``scalar``: one compiled call over a scalar-only tape (``cpu.grad_scalar``).
- ``flat``: one compiled call over flat buffers, small arrays (``sweep_flat``).
- ``fused``: the flat path's programs past its size limit: one generated loop per shape,
  each rule rendered by the one emitter (``interpreters.fused``).
- ``record``: create_graph on a scalar-only tape, entries emitted compiled
  (``cpu.grad_record``).
- ``sweep``: the general NumPy sweep (``cpu.sweep``).
- ``rerecord``: create_graph, every rule re-recorded on tensors (``rerecord.sweep``).
- ``batched``: is_grads_batched without create_graph (``cpu.sweep_batched``).
- ``hooks``: a graph with live hooks, entry by entry with the hooks run in torch's order
  (``hooks.sweep``; with create_graph each rule re-recorded, as ``rerecord``); it takes
  every hooked call (is_grads_batched: one call per sample), and no other path takes one.
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
GENERAL = ("hooks", "rerecord", "batched", "checked", "sweep")  # in the order tried
PATHS = FAST + GENERAL


class Path:
    """One backward strategy. ``applies(call)`` returns a plan, or None having changed
    nothing (no entry freed, recorded or accumulated); ``run(plan)`` finishes the call with
    that plan. ``graph`` is False for the fast paths (create_graph off), True for the fast
    path that records (create_graph on), None for the general ones (any options)."""
    __slots__ = ("name", "applies", "run", "graph")

    def __init__(self, name, applies, run, graph=None):
        _check(name)
        self.name = name
        self.applies = applies
        self.run = run
        self.graph = graph

    def __repr__(self):
        return f"Path({self.name!r})"


#: every strategy, in the order they are tried (filled in by the engine, autograd/_sweep.py)
STRATEGIES: list = []


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


def by_name(name):
    """The strategy called ``name``."""
    for p in STRATEGIES:
        if p.name == name:
            return p
    raise ValueError(f"unknown backward path {name!r}; the paths are {list(PATHS)}")


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
