"""Fused backward of large elementwise regions: one generated loop per shape, no NumPy
temporaries.

On large arrays the NumPy sweep is bound by memory traffic: each rule is a few full passes
over its arrays, each pass a fresh temporary. When the needed array entries of a backward
are elementwise ops, 1-d slices and full sums or means (the flat sweep's ops, past its
size limit), the whole array part of the sweep can instead be one loop per shape: entry
``k``'s adjoint at element ``i`` is a local variable, each rule runs on scalars (the one
emitter's rendering of the registry's rule, ``render`` over ``LOOP``; sums, means and
slices run their registry ``scatter`` forms), and only the saved values a rule reads and
the adjoints of the inputs' arrays touch memory.

The loop's source depends only on the region's structure (opcodes, edges, slice steps, and
the constants a rule branches on, such as ``powc``'s exponent), not on sizes, slice
starts, other constants or scalar values, which it reads from arguments; it is generated once per
structure, written to a module file in the kernel cache directory (a directory of this
user's alone; the file only anchors Numba's on-disk cache: the module runs the text just
generated, never what the file holds) and compiled the second time a structure is swept
(``COMPILE_AFTER``): a one-off backward never pays a compile.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import stat
import sys
import threading
import types
import warnings

import numpy as np

from .._jit import njit_cached
from ..ops import ARRAY, BINARY, BY_NAME, OPS, UNARY, UNARY_C, Sym
from ..ops._backends import _src
from ._codegen_emit import TAPE_COLS, Target, render
from . import _generated_cpu

GETITEM, SUM, MEAN = (BY_NAME[n].code for n in ("getitem", "sum", "mean"))
#: a rule rendered by the one emitter with placeholders for its operands (``a@V``: a's
#: value, ``a@G``: a's adjoint), which a loop binds to its locals, views and streams
LOOP = Target(TAPE_COLS, "{n}@V", "{n}@G", index=False)
_ELEMENTWISE = frozenset(op.code for op in OPS
                         if op.kind in (UNARY, UNARY_C, BINARY) and op.vjp is not None)
_F64 = np.dtype(np.float64)
# op codes a region may hold (``plan`` declines any other): a lookup for ``plan_for``
_FUSABLE = np.zeros(len(OPS), dtype=np.bool_)
_FUSABLE[sorted(_ELEMENTWISE | {GETITEM, SUM, MEAN})] = True
#: sightings of a structure before its loop is compiled (the first backward runs NumPy)
COMPILE_AFTER = 2
MODULE_PREFIX = "tapegrad_fused_"

_seen: dict[str, int] = {}
_kernels: dict[str, object] = {}
_lock = threading.Lock()
_dir = None


@njit_cached(nogil=True)
def _downstream(rows, need, lo, hi, seeds):
    """Needed entries in ``lo .. hi-1`` that depend on a ``seeds`` entry (the region's
    sums and means), the seeds included."""
    dep = np.zeros(rows.shape[0], dtype=np.bool_)
    for s in seeds:
        dep[s] = True
    for k in range(lo, hi):
        if need[k] and not dep[k]:
            a = int(rows[k, 1])
            b = int(rows[k, 2])
            if (a >= 0 and dep[a]) or (b >= 0 and dep[b]):
                dep[k] = True
    return dep


@njit_cached(nogil=True)
def _fusable_getitems(rows, need, lo, hi, fusable, getitem):
    """(the needed getitem entries in ``lo .. hi-1``, whether there is a needed array entry
    and every one is of an op in ``fusable``)."""
    out = np.empty(hi - lo, dtype=np.int64)
    m = 0
    seen = False
    for k in range(lo, hi):
        code = int(rows[k, 0])
        if need[k] and code >= ARRAY:
            op = code & ~ARRAY
            if not fusable[op]:
                return out[:0], False
            seen = True
            if op == getitem:
                out[m] = k
                m += 1
    return out[:m], seen


class Plan:
    """One region: the generated source (its structure only) and how to gather the
    arguments from a tape (slots, not values, so a later tape of the same structure reuses
    the plan)."""

    def __init__(self):
        self.src = []          # (length, lines before, loop body, lines after) per loop
        self.vals = []         # slots whose values (1-d, C order) the loops read
        self.val_ix = {}
        self.adjs = []         # (slot, shape): adjoint arrays the loops add into
        self.adj_ix = {}
        self.P = []            # int parameters: lengths, slice starts
        self.C = []            # float parameters: (False, constant) or (True, scalar slot)
        self.red = []          # scalar slots the loops reduce into (R[j] adds to adj[slot])
        self.red_ix = {}
        self.scratch_n = []    # sizes of scratch arrays
        self.names = {}        # slot -> its number in the source's local names

    def name(self, s):
        """Slot ``s``'s number in local names (the order seen: independent of slots)."""
        j = self.names.get(s)
        if j is None:
            j = self.names[s] = len(self.names)
        return j

    def scratch(self, n):
        self.scratch_n.append(n)
        return f"T{len(self.scratch_n) - 1}"

    def val(self, s):
        j = self.val_ix.get(s)
        if j is None:
            j = self.val_ix[s] = len(self.vals)
            self.vals.append(s)
        return f"V{j}"

    def adj(self, s, shape):
        j = self.adj_ix.get(s)
        if j is None:
            j = self.adj_ix[s] = len(self.adjs)
            self.adjs.append((s, shape))
        return f"G{j}"

    def p(self, x):
        self.P.append(int(x))
        return f"p{len(self.P) - 1}"

    def c(self, x, slot=False):
        self.C.append((slot, x))
        return f"q{len(self.C) - 1}"

    def reduction(self, s):
        j = self.red_ix.get(s)
        if j is None:
            j = self.red_ix[s] = len(self.red)
            self.red.append(s)
        return f"r{j}"


def _slice_of(index, n):
    """(start, step, length) of a basic 1-d slice index, or None."""
    if index.__class__ is tuple and len(index) == 1:
        index = index[0]
    if index.__class__ is not slice:
        return None
    start, stop, step = index.indices(n)
    return start, step, len(range(start, stop, step))


def plan(tape, rows, need, lo, hi, ins):
    """The fused region of a backward from scalar entry ``hi - 1`` to the leaves ``ins``
    over the needed entries (``need``, from ``cpu._mark_scalar`` with ``cpu.FLAT``), or None
    when one loop per shape cannot run it: an array that is not float64 in C order, an
    elementwise array input of another shape than the output's (only 0-d scalar slots
    broadcast), a slice of a base that is not 1-d or is an entry of the slice's own loop, a
    sum or mean over some dims or kept as an array, or a sum or mean whose value flows back
    into the region."""
    arrays, aux = tape.arrays, tape.aux
    codes = rows[lo:hi, 0].astype(np.int64)
    idx = np.nonzero(need[lo:hi] & (codes >= ARRAY))[0]
    if not len(idx):
        return None
    wanted = need.copy()
    wanted[ins] = True
    entries = (idx + lo).tolist()
    ops = (codes[idx] & ~ARRAY).tolist()
    cls = {}      # slot -> shape of the loop it lives in (array entries and direct arrays)
    body = {}     # shape -> entries in that loop, in tape order
    seeds = []    # (sum or mean entry, its input)
    getitems = {}  # needed getitem entry -> (start, step) into its 1-d base
    for k, code in zip(entries, ops):
        a, b = int(rows[k, 1]), int(rows[k, 2])
        if code == SUM or code == MEAN:
            v = arrays.get(a)
            if v is None or aux[k][0] is not None or k in arrays:
                return None
            seeds.append((k, a))
            continue
        out = arrays.get(k)
        if out is None or out.dtype is not _F64 or out.ndim == 0:
            return None
        shape = out.shape
        if code == GETITEM:
            base = arrays.get(a)
            if base is None or base.ndim != 1 or base.dtype is not _F64 \
                    or not base.flags.c_contiguous:
                return None
            sl = _slice_of(aux[k][0], base.shape[0])
            if sl is None:
                return None
            getitems[k] = sl[:2]
        elif code not in _ELEMENTWISE:
            return None
        else:
            if not out.flags.c_contiguous:
                return None
            for s in (a, b):
                if s < 0:
                    continue
                v = arrays.get(s)
                if v is None:
                    continue  # a scalar slot: broadcasts, its adjoint is a reduction
                if v.shape != shape or v.dtype is not _F64 or not (
                        s in getitems or v.flags.c_contiguous):  # a slice reads its base
                    return None
                if cls.setdefault(s, shape) != shape:
                    return None
        if cls.setdefault(k, shape) != shape:
            return None
        body.setdefault(shape, []).append(k)
    for k, a in seeds:  # a sum of a leaf or constant array: that array gets a loop too
        v = arrays[a]
        if v.dtype is not _F64 or not v.flags.c_contiguous:
            return None
        shape = cls.setdefault(a, v.shape)
        if shape != v.shape:
            return None
        body.setdefault(shape, [])
    order = _loop_order(rows, body, cls, getitems)
    if order is None:
        return None
    # the sums' and means' adjoints must be final before the loops: nothing they feed may
    # flow back into a region entry
    tail = _downstream(rows, need, lo, hi, np.array([k for k, _ in seeds], dtype=np.int64))
    for k, code in zip(entries, ops):
        if code != SUM and code != MEAN:
            a, b = int(rows[k, 1]), int(rows[k, 2])
            if (a >= 0 and tail[a]) or (b >= 0 and tail[b]):
                return None
    p = Plan()
    p.tail = tail
    for shape in order:
        _emit_loop(p, tape, rows, shape, body[shape], cls, seeds, getitems, wanted)
    # every adjoint array a loop adds into is an input's gradient or feeds a later loop
    swept = {k for ks in body.values() for k in ks}
    if any(need[s] and s not in swept for s, _ in p.adjs):
        return None
    p.P_arr = np.array(p.P or [0], dtype=np.int64)
    p.text = source(p)
    return p


def _loop_order(rows, body, cls, getitems):
    """The loops' shapes in the order they run: a slice's loop before the loop of its
    base's entry (None: a slice of an entry of its own loop, or a cycle)."""
    after = {shape: set() for shape in body}
    for k in getitems:
        base = int(rows[k, 1])
        if base in body.get(cls.get(base), ()):
            if cls[base] == cls[k]:
                return None
            after[cls[base]].add(cls[k])
    order, done = [], set()
    while len(order) < len(body):
        ready = [s for s in body if s not in done and after[s] <= done]
        if not ready:
            return None
        ready.sort(key=lambda s: -max(body[s], default=-1))
        order.append(ready[0])
        done.add(ready[0])
    return order


_plans: dict = {}
_NO_PLAN = object()


def plan_for(tape, rows, need, lo, hi, ins):
    """``plan``, reused for a tape of the same structure (entries, needed mask, inputs,
    arrays' shapes and slices) as one seen before."""
    arrays, aux = tape.arrays, tape.aux
    # what ``plan`` declines at once, found before the key (one item per array of the
    # tape, a long tuple for a long tape) in one compiled pass: a needed array entry of an
    # op no loop runs, or a needed getitem that is not a 1-d slice (ba's gathers, lstm's
    # rows)
    getitems, ok = _fusable_getitems(rows, need, lo, hi, _FUSABLE, GETITEM)
    if not ok:
        return None
    for k in getitems.tolist():
        index = aux[k][0]
        if index.__class__ is tuple and len(index) == 1:
            index = index[0]
        if index.__class__ is not slice:
            return None
    codes = rows[lo:hi, 0].astype(np.int64) & ~ARRAY
    special = (np.nonzero((codes == GETITEM) | (codes == SUM) | (codes == MEAN))[0] + lo)
    key = (rows[lo:hi].tobytes(), need[lo:hi].tobytes(), ins.tobytes(), lo, hi,
           tuple([(k, v.shape, v.dtype.char, v.flags.c_contiguous)
                  for k, v in arrays.items()]),
           tuple([repr(aux[k][0]) for k in special.tolist()]))
    p = _plans.get(key)
    if p is None:
        if len(_plans) > 256:
            _plans.clear()
        p = _plans[key] = plan(tape, rows, need, lo, hi, ins) or _NO_PLAN
    return None if p is _NO_PLAN else p


def _emit_loop(p, tape, rows, shape, ks, cls, seeds, getitems, wanted):
    """Append the loop over the arrays of ``shape`` to plan ``p``: entries ``ks`` (tape
    order) swept last first, element ``i``'s adjoints in locals. Slices are read and
    written through views made before the loop (unit-stride indexing vectorizes). An array
    outside the loop gets its parts through streams, one per (array, start, step): the
    first stream of an array adds into its adjoint in the loop; the others store to a
    scratch array, added after the loop (two read-modify-write streams into one array at
    offsets unknown when compiling would keep the loop from vectorizing)."""
    arrays = tape.arrays
    size = int(np.prod(shape))
    n = p.p(size)
    pre, init, loop, post = [], [], [], []
    in_loop = set(ks)
    streams = {}  # (slot, start, step) -> local name
    views = {}

    def view(arr, start, step):
        """A local name for ``arr[start::step][:n]`` (made before the loop)."""
        key = (arr, start, step)
        w = views.get(key)
        if w is None:
            w = views[key] = f"W{len(p.src)}_{len(views)}"
            pre.append(f"{w} = {arr}[{p.p(start)}::{step}][:{n}]")
        return w

    def value(s):
        if s in getitems:
            start, step = getitems[s]
            return f"{view(p.val(int(rows[s, 1])), start, step)}[i]"
        if s not in arrays:
            return p.c(s, slot=True)
        return f"{p.val(s)}[i]"

    def add(s, expr, start=0, step=1):
        """Add ``expr`` (element ``i``'s part) to slot ``s``'s adjoint at ``start + i * step``."""
        if s in in_loop:
            loop.append(f"g{p.name(s)} += {expr}")
        elif not wanted[s]:
            return
        elif s in arrays:
            h = streams.get((s, start, step))
            if h is None:
                h = streams[(s, start, step)] = f"h{len(streams)}"
                init.append(f"{h} = 0.0")
            loop.append(f"{h} += {expr}")
        else:
            loop.append(f"{p.reduction(s)} += {expr}")

    # each loop entry's adjoint: what slices of it in earlier loops gathered, and the seeds
    for s in ks:
        init.append(f"g{p.name(s)} = " + (f"{p.adj(s, arrays[s].shape)}[i]"
                                          if s in p.adj_ix else "0.0"))
    for k, a in seeds:
        if cls.get(a) == shape:
            # the op's scatter form (the registry's): every element gets the same part
            seed = f"S{p.name(k)}"
            pre.append(f"{seed} = {_scatter(int(rows[k, 0]) & ~ARRAY, f'adj[{p.p(k)}]', n)}")
            add(a, seed)
    for k in reversed(ks):
        code = int(rows[k, 0]) & ~ARRAY
        a, b = int(rows[k, 1]), int(rows[k, 2])
        g = f"g{p.name(k)}"
        if code == GETITEM:  # its scatter form, at the slice's elements of the base
            add(a, _scatter(code, g, n), *getitems[k])
            continue
        names = {"a": a, "b": b, "out": k}
        for kind, nm, e in _rule(code):
            if kind == "read":
                if names[nm] >= 0:
                    loop.append(f"{nm} = {value(names[nm])}")
            elif kind == "const":
                c = float(rows[k, 3 if nm == "c0" else 4])
                # a constant the rule branches on is written into the source, so the loop
                # keeps only the branch taken (and can vectorize)
                loop.append(f"{nm} = {c!r}" if e and math.isfinite(c) else
                            f"{nm} = {p.c(c)}")
            elif kind == "g":
                loop.append(f"g = {g}")
            elif names[nm] >= 0:
                add(names[nm], e)
    first = set()
    for (s, start, step), h in streams.items():
        w = view(p.adj(s, arrays[s].shape), start, step)
        if s not in first:
            first.add(s)
            loop.append(f"{w}[i] += {h}")
        else:
            T = p.scratch(size)
            loop.append(f"{T}[i] = {h}")
            post.append(f"for i in range({n}):")
            post.append(f"    {w}[i] += {T}[i]")
    p.src.append((n, pre, init + loop, post))


_READ = re.compile(r"(a|b|out) = \1@V")
_CONST = re.compile(r"(c0|c1) = rows\[k, \d\]")
_ADD = re.compile(r"(a|b)@G \+= (.*)")


@functools.cache
def _rule(code):
    """Opcode ``code``'s rule as the one emitter renders it (``render`` over ``LOOP``), one
    (kind, name, detail) per statement: ("const", c0 or c1, whether the rule branches on
    it), ("read", a, b or out, None), ("g", "out", None): the entry's adjoint is ``g``,
    ("add", a or b, the gradient expression)."""
    lines = render(OPS[code], LOOP) or []
    text = " ".join([m.group(2) for x in lines if (m := _ADD.fullmatch(x))])  # the gradients
    out = []
    for x in lines:
        if m := _CONST.fullmatch(x):
            n = m.group(1)
            out.append(("const", n, re.search(rf"\b{n}\s*[=!<>]=?|[=!<>]=?\s*{n}\b",
                                             text) is not None))
        elif m := _READ.fullmatch(x):
            out.append(("read", m.group(1), None))
        elif x == "g = out@G":
            out.append(("g", "out", None))
        elif m := _ADD.fullmatch(x):
            out.append(("add", m.group(1), m.group(2)))
        else:  # a statement a loop cannot place: not an op these loops run
            raise AssertionError(f"{OPS[code].name}: unexpected rendered statement {x!r}")
    return tuple(out)


def _scatter(code, g, n):
    """The source of an op's ``scatter`` form (sum, mean, getitem: the registry's) for one
    element, given the source ``g`` of its output's adjoint and ``n`` of the input's size."""
    return _src(OPS[code].scatter[1](Sym(g), Sym(n)))


def source(p):
    """The generated module's text for plan ``p`` (its structure only)."""
    lines = ['"""GENERATED by tapegrad/interpreters/fused.py: one fused backward."""',
             "import math", "", "import numpy as np", "from tapegrad._jit import njit_cached",
             "", "",
             '@njit_cached(error_model="numpy", nogil=True)',
             "def fused(V, G, T, P, C, adj, R):"]
    lines += [f"    V{j} = V[{j}]" for j in range(len(p.vals))]
    lines += [f"    G{j} = G[{j}]" for j in range(len(p.adjs))]
    lines += [f"    T{j} = T[{j}]" for j in range(len(p.scratch_n))]
    lines += [f"    p{j} = P[{j}]" for j in range(len(p.P))]
    lines += [f"    q{j} = C[{j}]" for j in range(len(p.C))]
    lines += [f"    r{j} = 0.0" for j in range(len(p.red))]
    for n, pre, loop, post in p.src:
        lines += [f"    {x}" for x in pre]
        lines.append(f"    for i in range({n}):")
        lines += [f"        {x}" for x in loop]
        lines += [f"    {x}" for x in post]
    lines += [f"    R[{j}] += r{j}" for j in range(len(p.red))]
    lines.append("    return 0")
    return "\n".join(lines) + "\n"


def _trusted(d):
    """Whether directory ``d`` is ours alone: owned by this user, writable by no one else."""
    st = os.stat(d)
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _trusted_parent(d):
    """Whether no one else can swap directory ``d``'s entries: owned by this user or root
    and writable by no one else, or sticky (as /tmp: others cannot rename our entries)."""
    st = os.stat(d)
    return st.st_uid in (os.geteuid(), 0) and (
        not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_mode & stat.S_ISVTX)


def cache_dir():
    """Where generated kernels live: ``$TAPEGRAD_CACHE_DIR/fused``, else
    ``~/.cache/tapegrad/fused`` (``$XDG_CACHE_HOME``). None, and the NumPy sweep runs,
    when it cannot be written or is not ours alone (another user's, or writable by group
    or others): Numba's cache files there are unpickled, so a directory someone else can
    write would run their code in this process. There is no shared fallback such as a
    temporary directory, for the same reason."""
    global _dir
    if _dir is None:
        base = os.environ.get("TAPEGRAD_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "tapegrad")
        d = os.path.join(base, "fused")
        _dir = False  # decided once per process, as a directory found usable
        try:
            os.makedirs(base, mode=0o700, exist_ok=True)
            os.makedirs(d, mode=0o700, exist_ok=True)
            if not os.access(d, os.W_OK):
                return None  # nowhere to write: the NumPy sweep runs
            if not (_trusted(d) and _trusted_parent(base)):
                from .._jit import CacheWarning
                warnings.warn(f"tapegrad: not using the kernel cache {d}: it (or {base}) is "
                              "another user's or writable by others, so code planted there "
                              "could run here; the fused backward of large arrays is off. "
                              "Make it yours alone (chmod 700) or set TAPEGRAD_CACHE_DIR.",
                              CacheWarning, stacklevel=2)
                return None
        except OSError:
            return None
        _dir = d
    return _dir or None


def _load(name, path, src):
    """Module ``name`` made from ``src`` (the text just generated, never what the file
    holds) with ``path`` as its file, so Numba caches its function next to it (the file
    is rewritten first when its content differs: Numba's cache is keyed on it)."""
    try:
        with open(path, "rb") as f:
            same = f.read() == src.encode()
    except OSError:
        same = False
    if not same:  # missing, cut short or damaged: write it again
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(src)
        os.replace(tmp, path)
    mod = types.ModuleType(name)
    mod.__file__ = path
    # registered first: Numba's cache rebuilds a function's environment by module name
    sys.modules[name] = mod
    try:
        exec(compile(src, path, "exec"), mod.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def kernel(src, force=False):
    """The compiled loop for ``src``: None until it has been asked for ``COMPILE_AFTER``
    times in this process (or at once when an earlier process wrote it, or ``force``)."""
    fn = _kernels.get(src)
    if fn is not None:
        return fn
    key = hashlib.sha1(src.encode()).hexdigest()[:20]
    fn = _kernels.get(key)
    if fn is not None:
        return fn
    name = MODULE_PREFIX + key
    with _lock:
        fn = _kernels.get(key)
        if fn is not None:
            return fn
        d = cache_dir()
        if d is None:
            return None
        path = os.path.join(d, name + ".py")
        seen = _seen[key] = _seen.get(key, 0) + 1
        if not (force or seen >= COMPILE_AFTER or os.path.exists(path)):
            return None
        try:
            mod = _load(name, path, src)
        except OSError:  # the file cannot be written (disk full...): the NumPy sweep runs
            return None
        fn = _kernels[key] = _kernels[src] = mod.fused
    return fn


def run(p, fn, tape, rows, vals, need, lo, hi, adj):
    """Sweep a backward with plan ``p``'s loops (compiled ``fn``): the scalar entries its
    sums feed, the loops, then the other scalar entries. Returns {slot: adjoint array}."""
    tail = p.tail
    _generated_cpu.sweep(rows, vals, adj, need & tail, hi, lo)
    arrays = tape.arrays
    G = tuple([np.zeros(shape).reshape(-1) for _, shape in p.adjs]) or _ONE
    V = tuple([arrays[s].reshape(-1) for s in p.vals]) or _ONE
    T = tuple([np.empty(m) for m in p.scratch_n]) or _ONE
    C = np.array([tape.vals[x] if slot else x for slot, x in p.C] or _NONE)
    R = np.zeros(max(len(p.red), 1))
    fn(V, G, T, p.P_arr, C, adj, R)
    for j, s in enumerate(p.red):
        adj[s] += R[j]
    _generated_cpu.sweep(rows, vals, adj, need & ~tail, hi, lo)
    return {s: G[j] for j, (s, _) in enumerate(p.adjs)}


_ONE = (np.zeros(1),)
_NONE = [0.0]
