"""Flat Wengert tapes: the entry arrays, the per-thread recorder state, and a readable dump.

A tape is data. Entry ``k`` is row ``k`` of a flat list of ``ROW`` numbers
``(opcode, k - a, k - b, c0, c1)`` and it produces slot ``k``: ``a``/``b`` are the slots
of its inputs on the same tape, stored relative to ``k`` (0 when absent: small offsets are
Python's cached ints, which keeps a recorded op near 100 bytes), ``c0``/``c1`` its float
constants. ``Tape.rows()`` gives the matrix with absolute slots (-1 when absent). Scalar
outputs' values sit in ``vals[k]``; array outputs in ``arrays[k]``; non-float constants
(shapes, dims, index arrays, N-ary input lists, imported tapes) in ``aux[k]``.
Everything needed to run an entry's forward again is in the tape.

Each thread records onto its own current tape. A tape lives while a tensor that can reach
it lives: non-leaf tensors hold their tape, and a tape holds the tapes it imported values
from. The recorder starts a new tape when the current one is long, so a loop of forward
passes whose outputs are dropped keeps memory flat.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
import operator
import struct
import sys
import threading
import weakref

import numpy as np

from ._jit import njit_cached
from .ops import ARRAY, BY_NAME, OPS, ROW

ROLLOVER = 1 << 15  # entries per tape before the recorder starts a new one
MAX_BYTES = 1 << 25  # bytes of saved arrays per tape before the recorder starts a new one

LEAF = BY_NAME["leaf"].code
CONST = BY_NAME["const"].code
IMPORT = BY_NAME["import_"].code

_sids = itertools.count(1)

_CHUNK = 4000
_PACK_INTO = struct.Struct(f"{_CHUNK}d").pack_into


def f64(items, start=0, stop=None):
    """``items[start:stop]`` (Python floats and ints) as a new float64 array. ``struct``
    packs numbers about twice as fast as ``np.array`` converts a list; chunks of a few
    thousand keep the argument tuple in cache."""
    stop = len(items) if stop is None else stop
    n = stop - start
    out = np.empty(n, dtype=np.float64)
    if n <= _CHUNK:
        struct.pack_into(f"{n}d", out, 0, *items[start:stop])
        return out
    i = 0
    while n - i >= _CHUNK:
        _PACK_INTO(out, 8 * i, *items[start + i:start + i + _CHUNK])
        i += _CHUNK
    if i < n:
        struct.pack_into(f"{n - i}d", out, 8 * i, *items[start + i:stop])
    return out

_ROWS = 800  # rows packed per struct call
_ROW_FMT = "qqqdd"  # opcode and relative slots as int64 bits, constants as float64
_PACK_ROWS = struct.Struct(_ROW_FMT * _ROWS).pack_into
_pack_tail = {}


@njit_cached(nogil=True)
def _decode_rows(m, bits, start):
    """Rows packed as (int64, int64, int64, float64, float64) bits -> float64 matrix with
    absolute slots (-1 when absent); ``start``: the first row's slot."""
    for r in range(m.shape[0]):
        op, da, db = bits[r, 0], bits[r, 1], bits[r, 2]  # read before m overwrites them
        m[r, 0] = op
        m[r, 1] = -1.0 if da == 0 else start + r - da
        m[r, 2] = -1.0 if db == 0 else start + r - db


def code_rows(code, start, stop):
    """Rows ``start:stop`` of a tape's flat ``code`` list as a float64 (rows, ROW) matrix
    with absolute slots. ``struct`` packs the ints as int64 (cheaper than converting each to
    a float) and the constants as float64; a compiled pass turns the ints into floats."""
    n = stop - start
    m = np.empty((n, ROW), dtype=np.float64)
    i = 0
    while n - i >= _ROWS:
        _PACK_ROWS(m, 8 * ROW * i, *code[(start + i) * ROW:(start + i + _ROWS) * ROW])
        i += _ROWS
    if i < n:
        pack = _pack_tail.get(n - i)
        if pack is None:
            pack = _pack_tail[n - i] = struct.Struct(_ROW_FMT * (n - i)).pack_into
        pack(m, 8 * ROW * i, *code[(start + i) * ROW:stop * ROW])
    _decode_rows(m, m.view(np.int64), start)
    return m


#: rows of the tapes converted last, by entry count: [copy of the code list, float matrix,
#: (getter, packer) of the zero constants whose sign a rule could read, their packed bits].
#: Optimization loops record the same program every step: a list comparison (identical
#: small ints and constant objects compare by identity) costs a tenth of packing the rows.
_SEEN = {}
_SEEN_MAX = 4
#: per opcode, whether its forward or rule reads c0, c1 (the others are 0.0 placeholders)
_READS = np.array([("c0" in op.uses, "c1" in op.uses) for op in OPS], dtype=bool)


def _zero_constants(m):
    """Flat ``code`` positions of the zero constants in matrix ``m`` that an op reads:
    ``==`` holds between 0.0 and -0.0, so a reused matrix checks their bits."""
    reads = _READS[m[:, 0].astype(np.int64) & ~ARRAY]
    r, c = np.nonzero((m[:, 3:] == 0.0) & reads)
    return (r * ROW + 3 + c).tolist()


def seen_rows(code, n):
    """``code_rows(code, 0, n)``, reusing the matrix of an earlier tape with equal code (and
    the same bits in every zero constant a rule reads). Never write into the result."""
    hit = _SEEN.get(n)
    if hit is not None and hit[0] == code:
        if hit[2] is None:  # first reuse: find the zero constants to check from now on
            zs = _zero_constants(hit[1])
            get = (lambda c, i=zs[0]: (c[i],)) if len(zs) == 1 else (
                operator.itemgetter(*zs) if zs else None)
            hit[2] = (get, struct.Struct(f"{len(zs)}d"))
            hit[3] = hit[2][1].pack(*get(hit[0])) if get else b""
        get, fmt = hit[2]
        if get is None or fmt.pack(*get(code)) == hit[3]:
            return hit[1]
    m = code_rows(code, 0, n)
    if n <= ROLLOVER:  # not the long tapes of traces and create_graph (no limit)
        if len(_SEEN) >= _SEEN_MAX and n not in _SEEN:
            try:  # the oldest; another thread may change the dict meanwhile
                del _SEEN[next(iter(_SEEN))]
            except (RuntimeError, StopIteration, KeyError):
                pass
        _SEEN[n] = [code[:n * ROW], m, None, None]
    return m


#: [whether tune_allocator ran]; arrays of _BIG bytes or more are the ones glibc would map
ALLOCATOR = [False]
_BIG = 1 << 17


def tune_allocator():
    """Keep freed memory for reuse in this process (glibc only; once, on the first large
    array a tape records; ``TAPEGRAD_MALLOC_TUNING=0`` turns it off).

    A tape keeps every array of a forward pass until its backward, then frees them all at
    once. With glibc's start-up settings each such array is mapped afresh and the freed
    heap top is given back to the system after every step, so the next step pays a page
    fault per 4 KiB it touches (1,500 per step of the 1e5-element Rosenbrock, 2.5x its time
    here). glibc raises these thresholds itself once a large mapped block is freed (up to
    32 MiB), which is why a process that has imported torch never sees it; this sets that
    state from the start: blocks under 32 MiB come from the heap, and up to 64 MiB of free
    heap top is kept."""
    ALLOCATOR[0] = True
    if os.environ.get("TAPEGRAD_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD


#: bumped by every in-place change to a tensor's value; a tape made after the last bump
#: has nothing to re-check for in-place changes
INPLACE = [0]


def bump(box):
    """Count an in-place change of the value whose version box is ``box``."""
    box[0] += 1
    INPLACE[0] += 1


class Tape:
    """One flat tape (see the module docstring)."""

    __slots__ = ("sid", "code", "vals", "arrays", "aux", "leaves", "freed", "retained",
                 "imports", "nary", "versioned", "viewed", "dirty", "limit", "nbytes", "epoch",
                 "reentered", "_cache", "_vcache", "hooks", "__weakref__")

    vals_factory = list  # anomaly mode swaps in a list that notes source lines

    def __init__(self):
        self.sid = next(_sids)
        self.code = []
        self.vals = self.vals_factory()
        self.arrays = {}
        self.aux = {}
        self.leaves = {}      # id(leaf tensor) -> its entry, or a list when entered again
        self.freed = None     # bool array: entry freed by a backward without retain_graph
        self.retained = {}    # entry -> weakref to a non-leaf tensor that retains grad
        self.imports = []     # entries that import a value from another tape
        self.nary = []        # entries whose inputs are listed in their aux
        self.versioned = []   # leaf/constant entries: aux (tensor, version) to check
        self.dirty = {}       # slot -> entry of the in-place op that replaced its tensor
        self.viewed = []      # entry, base's version box, version, ...: entries saving a
        # view, flat (a tuple per view kept thousands of objects for the collector to scan)
        self._cache = None    # (n, float matrix) of the rows converted so far
        self._vcache = None   # (n, float64 array) of the scalar values converted so far
        self.reentered = False  # a leaf was entered more than once (it has several slots)
        self.limit = ROLLOVER  # the recorder moves on once len(self) reaches this
        self.epoch = INPLACE[0]
        self.nbytes = 0
        self.hooks = None     # entry -> its node's hooks and metadata (autograd.graph)

    def __len__(self):
        return len(self.vals)

    def __repr__(self):
        return f"<Tape #{self.sid}: {len(self.vals)} entries>"

    def append(self, op, a, b, c0, c1, value, aux=None):
        """Append one entry; returns its slot. ``value`` is a float or an array."""
        k = len(self.vals)
        if value.__class__ is float:
            self.vals.append(value)
        else:
            self.vals.append(math.nan)
            self.arrays[k] = value
            self.nbytes += value.nbytes
            if self.nbytes > MAX_BYTES:
                self.limit = 0
            if value.nbytes >= _BIG and not ALLOCATOR[0]:
                tune_allocator()
        self.code += (op, k - a if a >= 0 else 0, k - b if b >= 0 else 0, c0, c1)
        if aux is not None:
            self.aux[k] = aux
        return k

    def enter(self, t):
        """Slot of tensor ``t`` on this tape, entering it (leaf, constant or import) if new."""
        value = t._d
        src = t._tape
        if src is not None and src is not self:
            return self._import(t, src, value)
        # leaves and constants keep (tensor, version): a backward checks the version to
        # catch in-place changes to a value it saved
        try:
            ver = t._ver[0]
        except AttributeError:
            t._ver = [0]
            ver = 0
        vals = self.vals
        k = len(vals)
        rg = t._rg
        if value.__class__ is float:  # the common case, written out
            vals.append(value)
            self.code += (LEAF if rg else CONST, 0, 0, 0.0, 0.0)
            self.aux[k] = (t, ver)
        else:
            self.append((LEAF if rg else CONST) | ARRAY, -1, -1, 0.0, 0.0, value, (t, ver))
        if rg:
            ks = self.leaves.setdefault(id(t), k)  # k itself (this very object) when new
            if ks is not k:  # entered before: the entries become a list
                self.leaves[id(t)] = (ks if ks.__class__ is list else [ks]) + [k]
                self.reentered = True
        self.versioned.append(k)
        t._sid = self.sid
        t._slot = k
        return k

    def leaf_slots(self, t):
        """The entries that entered leaf ``t`` on this tape, as a list (empty: none)."""
        ks = self.leaves.get(id(t))
        return [] if ks is None else ks if ks.__class__ is list else [ks]

    def leaf_items(self):
        """(id of leaf tensor, list of its entries) for every leaf entered on this tape."""
        for key, ks in self.leaves.items():
            yield key, ks if ks.__class__ is list else [ks]

    def _import(self, t, src, value):
        """Enter non-leaf ``t`` from tape ``src`` as an import entry."""
        # seal the source: whoever records next on it starts a new tape, so tapes
        # importing from each other always form an order (threads taking turns)
        src.limit = 0
        k = self.append(IMPORT if value.__class__ is float else IMPORT | ARRAY,
                        -1, -1, 0.0, 0.0, value, (src, t._slot))
        self.imports.append(k)
        return k

    def extend(self, rows, codes, values):
        """Append entries made by a compiled sweep: ``rows`` as ``rows()`` gives them
        (absolute slots), ``codes`` their (opcode, k - a, k - b) and ``values`` their scalar
        values. The converted caches grow with them instead of being rebuilt."""
        n, m = len(self.vals), len(values)
        flat = [0.0] * (ROW * m)
        for col in range(3):
            flat[col::ROW] = codes[:, col].tolist()
        flat[3::ROW] = rows[:, 3].tolist()
        flat[4::ROW] = rows[:, 4].tolist()
        self.code += flat
        self.vals += values.tolist()
        c, v = self._cache, self._vcache
        if c is not None and c[0] == n:
            self._cache = (n + m, np.concatenate([c[1], rows]))
        if v is not None and v[0] == n:
            self._vcache = (n + m, np.concatenate([v[1], values]))

    def truncate(self, n):
        """Drop entries ``n`` onwards: a recording that failed part way leaves nothing."""
        if n >= len(self.vals):
            return
        del self.code[n * ROW:]
        del self.vals[n:]
        for k in self.versioned:  # a leaf or constant entered after n enters anew
            if k >= n:
                t = self.aux[k][0]
                if t._sid == self.sid and t._slot >= n:
                    t._sid = -1
        for k in [k for k in self.arrays if k >= n]:
            self.nbytes -= self.arrays.pop(k).nbytes
        for d in (self.aux, self.retained):
            for k in [k for k in d if k >= n]:
                del d[k]
        for k in [k for k, e in self.dirty.items() if k >= n or e >= n]:
            del self.dirty[k]
        self.imports = [k for k in self.imports if k < n]
        self.nary = [k for k in self.nary if k < n]
        self.versioned = [k for k in self.versioned if k < n]
        vw = self.viewed
        self.viewed = [x for i in range(0, len(vw), 3) if vw[i] < n for x in vw[i:i + 3]]
        for key, ks in list(self.leaf_items()):
            ks = [k for k in ks if k < n]
            if ks:
                self.leaves[key] = ks
            else:
                del self.leaves[key]
        if self._cache is not None and self._cache[0] > n:
            self._cache = (n, self._cache[1][:n])
        if self._vcache is not None and self._vcache[0] > n:
            self._vcache = (n, self._vcache[1][:n])

    def rows(self):
        """The entries as an (n, ROW) float64 matrix (converted once, extended as it grows)."""
        n = len(self.vals)
        c = self._cache
        if c is not None and c[0] == n:
            return c[1]
        if c is None:
            m = seen_rows(self.code, n)
        else:
            m = np.concatenate([c[1], code_rows(self.code, c[0], n)])
        self._cache = (n, m)
        return m

    def values(self):
        """The scalar values as a float64 array (NaN where an array sits; converted once,
        extended as the tape grows)."""
        n = len(self.vals)
        c = self._vcache
        if c is not None and c[0] == n:
            return c[1]
        start = 0 if c is None else c[0]
        # a short list: NumPy's conversion (0.7 us for 8 numbers to f64's 1.6, the same
        # float64 of each Python float); struct's packing is the faster from about 64 on
        v = np.array(self.vals[start:n], dtype=np.float64) if n - start <= 48 else \
            f64(self.vals, start, n)
        if start:
            v = np.concatenate([c[1], v])
        self._vcache = (n, v)
        return v

    def entry(self, k):
        """Row ``k`` as (opcode, a, b, c0, c1) with absolute slots."""
        op, da, db, c0, c1 = self.code[k * ROW:k * ROW + ROW]
        return op, k - da if da else -1, k - db if db else -1, c0, c1

    def dump(self, limit=None):
        """A readable listing of the entries, one per line."""
        lines = [repr(self)]
        n = len(self.vals) if limit is None else min(limit, len(self.vals))
        for k in range(n):
            op, a, b, c0, c1 = self.entry(k)
            name = OPS[int(op) & ~ARRAY].name
            kind = "A" if int(op) & ARRAY else "S"
            args = [f"%{int(x)}" for x in (a, b) if x >= 0]
            if c0 or c1:
                args += [f"c0={c0!r}", f"c1={c1!r}"]
            if k in self.aux and name not in ("leaf",):
                args.append(f"aux={_short(self.aux[k])}")
            shape = np.shape(self.arrays[k]) if k in self.arrays else ()
            lines.append(f"%{k:<4} = {kind} {name}({', '.join(args)})  {list(shape)}")
        return "\n".join(lines)


def _short(x):
    s = repr(x) if not isinstance(x, tuple) else "(" + ", ".join(_short(i) for i in x) + ")"
    return s if len(s) < 40 else s[:37] + "..."


def _no_tape():
    return None


def _grad_disabled():
    return False


class _State(threading.local):
    """Per-thread recorder state: the current tape (held weakly: the tensors recorded on
    it keep it alive, so a forward pass whose outputs are dropped leaves nothing) and the
    grad mode.

    ``tape()`` returns the tape, None when there is none yet, or False while grad is
    disabled, so the recorder's hot path needs one thread-local lookup, not two."""

    def __init__(self):
        self.tape = _no_tape
        self.held = _no_tape  # the tape reference put aside while grad is disabled
        self.grad_enabled = True
        self.inference = False
        self.trace = None  # the tracing context of tapegrad.trace (replay.py), when tracing


STATE = _State()


def set_grad_mode(enabled):
    """Turn recording on or off for this thread."""
    st = STATE
    if enabled == st.grad_enabled:
        return
    if not enabled and st.trace is not None:
        st.trace.on_no_grad()
    if enabled:
        st.tape, st.held = st.held, _no_tape
    else:
        st.tape, st.held = _grad_disabled, st.tape
    st.grad_enabled = enabled


def current_tape():
    """This thread's tape to record onto (a new one when none or the current one is long)."""
    tape = STATE.tape()
    if tape is None or len(tape.vals) >= tape.limit:
        tape = Tape()
        STATE.tape = weakref.ref(tape)
    return tape


def all_or_nothing(fn):
    """``fn``, a function built of several recorded ops, records all of its entries or none:
    when it raises part way (a check that needs an intermediate value), what it recorded on
    this thread's tape is dropped, so a bad input leaves the tape as it was."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tape = STATE.tape()
        start = len(tape.vals) if tape is not None else 0
        try:
            return fn(*args, **kwargs)
        except BaseException:
            if tape is not None and STATE.tape() is tape:
                tape.truncate(start)
            raise
    return wrapper


def end_tape(tape):
    """Stop recording onto ``tape`` (after a backward freed it)."""
    if STATE.tape() is tape:
        STATE.tape = _no_tape
    elif STATE.held() is tape:
        STATE.held = _no_tape
