"""``trace(fn, *example_inputs) -> Program``: record once, replay forward and backward at new
inputs in compiled code, with guards on the branches that tracing saw."""
from __future__ import annotations

import contextlib
import json
import linecache
import os
import sys
import warnings
import weakref

import numpy as np

from . import _notice
from .interpreters import program as _prog
from .interpreters import replay_cpu as _cpu
from .tape import STATE, Tape
from .tensor import Tensor, _plain, enable_grad, tensor

__all__ = ["trace", "Program", "GuardError", "TraceWarning", "load"]

FORMAT = "tapegrad-program"
FORMAT_VERSION = 1
TARGETS = ("cpu", "parallel", "cuda")
_F64 = np.dtype(np.float64)
_PKG = os.path.dirname(os.path.abspath(__file__))


class GuardError(RuntimeError):
    """A traced program met a branch that went the other way at replay."""


class TraceWarning(UserWarning):
    """A value left the tape while tracing and is frozen into the program."""


def cuda_module():
    """``interpreters.replay_cuda``, once numba-cuda and a GPU (or numba's CUDA simulator)
    are known to be there; otherwise ImportError or RuntimeError saying what to do."""
    import importlib.util
    if importlib.util.find_spec("numba_cuda") is None:
        raise ImportError("target='cuda' needs numba's CUDA target, the numba-cuda package: "
                          "install it with pip install 'tapegrad[cuda]'")
    from numba import config, cuda
    if not config.ENABLE_CUDASIM and not cuda.is_available():
        raise RuntimeError(
            "target='cuda' found no usable NVIDIA GPU (numba.cuda.is_available() is False: "
            "no GPU, or no driver; numba.cuda.detect() says more). Use target='parallel' to "
            "spread a batch over the CPU cores, or set NUMBA_ENABLE_CUDASIM=1 before "
            "importing tapegrad to run the CUDA kernels in numba's simulator (slow: for "
            "testing)")
    from .interpreters import replay_cuda
    return replay_cuda


def _is_device(x):
    """A GPU array (``__cuda_array_interface__``, or the CUDA simulator's device array)."""
    return hasattr(x, "__cuda_array_interface__") or type(x).__name__ == "FakeCUDAArray"


def _host(x):
    """``x`` as a host array (GPU arrays copied back)."""
    x = getattr(x, "_d", x)
    if _is_device(x):
        return cuda_module().as_device(x).copy_to_host()
    return np.asarray(x)


def _stacklevel():
    """``warnings.warn``'s stacklevel for the innermost frame outside tapegrad."""
    f, level = sys._getframe(2), 2
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PKG):
        f, level = f.f_back, level + 1
    return level


def _site():
    """(file, line, source text) of the innermost frame outside tapegrad."""
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PKG):
        f = f.f_back
    if f is None:
        return ("<unknown>", 0, "")
    fn, line = f.f_code.co_filename, f.f_lineno
    return (fn, line, linecache.getline(fn, line).strip())


# --- tracing ----------------------------------------------------------------------------------


class _Trace:
    """What tapegrad records while ``trace`` runs ``fn``, besides the usual tape entries:
    comparisons and logic (recomputed at replay), the branches they decided (guards),
    detached values, and warnings for values that leave the tape."""

    def __init__(self, inputs, strict):
        self.first_sid = None
        self.inputs = {id(t) for t in inputs}
        self.strict = strict
        self.refs = {}     # id(tensor) -> (tensor, ref): bool results and detached values
        self.sites = []    # guard sites: (file, line, text, taken)
        self.detached = set()  # ids of recorded detach results (they may leave the tape)
        self._quiet = 0

    def _tape_ref(self, t):
        """("s", tape, slot) of a traced tensor, ("u", why) of an untraceable one (see
        ``untraceable``), ("c", value) of anything else."""
        if isinstance(t, Tensor):
            r = self.refs.get(id(t))
            if r is not None and r[0] is t:
                return r[1]
            if t._rg:
                if t._tape is not None and t._tape.sid >= self.first_sid:
                    return ("s", t._tape, t._slot)
                if t._tape is None and id(t) in self.inputs:
                    from .tape import current_tape
                    tape = current_tape()
                    k = t._slot if t._sid == tape.sid else tape.enter(t)
                    return ("s", tape, k)
            return ("c", t._d)
        return ("c", np.asarray(t, dtype=np.float64) if not isinstance(t, (float, int, bool))
                else float(t))

    def ref(self, t):
        """The tape reference of a traced bool tensor or detached value, else None."""
        r = self.refs.get(id(t))
        return r[1] if r is not None and r[0] is t else None

    def traced(self, t):
        """Whether ``t`` depends on the traced inputs."""
        return self._tape_ref(t)[0] != "c"

    def _record(self, name, result, refs, extra=()):
        from .ops import BY_NAME, ARRAY
        from .tape import current_tape
        tape = current_tape()
        v = result._d
        value = float(v) if np.ndim(v) == 0 else np.asarray(v)
        code = BY_NAME[name].code | (0 if value.__class__ is float else ARRAY)
        k = tape.append(code, -1, -1, 0.0, 0.0, value, tuple(refs) + tuple(extra))
        self.refs[id(result)] = (result, ("s", tape, k))
        return k

    def on_logic(self, name, result, *operands):
        refs = [self._tape_ref(o) for o in operands]
        for r in refs:
            if r[0] == "u":
                self.refs[id(result)] = (result, r)
                return
        if any(r[0] == "s" for r in refs):
            self._record({"logical_and": "logical_and", "logical_or": "logical_or",
                          "logical_xor": "logical_xor"}.get(name, name), result, refs)

    def on_detach(self, result, source):
        """``source.detach()`` of a traced tensor is recorded (a ``detach`` entry, which
        eager backward sees as a constant): operations on it are recorded too, and replay
        recomputes them."""
        r = self._tape_ref(source)
        if r[0] == "u":
            self._mark(result, r)
        if r[0] != "s":
            return result
        from .ops import ARRAY, BY_NAME
        from .tape import current_tape
        tape = current_tape()
        v = result._d
        k = tape.append(BY_NAME["detach"].code | (0 if v.__class__ is float else ARRAY),
                        -1, -1, 0.0, 0.0, v, (r,))
        t = Tensor()
        t._d, t._rg, t._tape, t._sid, t._slot = v, True, tape, tape.sid, k
        if v.__class__ is not float:
            t._ver = [0]
        self.detached.add(id(t))
        self.refs[id(t)] = (t, ("s", tape, k))
        return t

    def on_no_grad(self):
        f, line, text = _site()
        msg = (f"grad mode disabled while tracing at {f}:{line} ({text!r}): values computed "
               f"without grad are not recorded, and the program replays them as the "
               f"constants they were while tracing. Use .detach() on the values instead.")
        if self.strict:
            raise RuntimeError(msg + " (trace(..., strict=True) makes this an error)")
        warnings.warn(msg, TraceWarning, stacklevel=4)

    # -- values kept off the tape ------------------------------------------------------------
    # Comparison results and what follows from them (counts, all/any, casts) do not require
    # grad, so eager mode does not record them; tracing does, and keeps a reference to the
    # entry in ``refs``. Values that depend on the inputs but cannot be recorded (argmax,
    # a float cast to int) are marked ("u", why): using one in the program, or reading it in
    # Python, refuses to trace rather than replay it as a constant.

    def untraceable(self, result, why, *sources):
        """Mark ``result`` as depending on the traced ``sources`` without being recorded."""
        if any(isinstance(t, Tensor) and (self.traced(t) or self.ref(t) is not None)
               for t in sources):
            self._mark(result, ("u", why))
        return result

    def _mark(self, t, ref):
        if t._d.__class__ is float:  # off the Python-float fast paths, which record only
            t._d, t._ver = np.asarray(t._d), [0]  # tensors that require grad
        self.refs[id(t)] = (t, ref)

    def taped(self, t):
        """``t`` as a tensor on the tape, so that an op on it is recorded: its stand-in when
        it is a traced value kept off the tape, else a constant entry."""
        if t._rg:
            return t
        if self.ref(t) is not None:
            return self._proxy(t)
        from .tape import current_tape
        tape = current_tape()
        k = tape.enter(t)
        p = Tensor()
        p._d, p._rg, p._tape, p._sid, p._slot = t._d, True, tape, tape.sid, k
        if t._d.__class__ is not float:
            p._ver = t._ver
        return p

    def _proxy(self, t):
        """A stand-in for ``t`` that is on the tape at its reference's entry, so that
        operations on it are recorded."""
        _, tape, k = self.ref(t)
        p = Tensor()
        p._d, p._rg, p._tape, p._sid, p._slot = t._d, True, tape, tape.sid, k
        if t._d.__class__ is not float:
            p._ver = t._ver
        return p

    def _unproxy(self, out):
        if isinstance(out, tuple):
            return type(out)(self._unproxy(o) for o in out) if type(out) is tuple else \
                type(out)(*[self._unproxy(o) for o in out])
        if not isinstance(out, Tensor):
            return out
        if not out._rg or out._tape is None:  # not recorded after all: never a constant
            if self.ref(out) is None:
                self._mark(out, ("u", "an operation on a traced comparison's result that "
                                      "tapegrad does not record"))
            return out
        res = _plain(out._d)
        self._mark(res, ("s", out._tape, out._slot))
        return res

    def plain_op(self, run, inputs, result):
        """An op gave the plain ``result`` (nothing required grad): when an input is a traced
        value kept off the tape, run it again (``run(*inputs)``) on stand-ins so that it is
        recorded, and return that result; when an input is untraceable, so is the result."""
        why, lift = None, False
        for t in inputs:
            if t.__class__ is Tensor:
                r = self.refs.get(id(t))
                if r is not None and r[0] is t:
                    if r[1][0] == "u":
                        why = why or r[1][1]
                    else:
                        lift = True
        if why is None and lift:
            if STATE.grad_enabled:
                return self._unproxy(run(*[self._proxy(t) if t.__class__ is Tensor and
                                           self.ref(t) is not None else t for t in inputs]))
            why = "a value computed from a traced comparison with grad disabled"
        if why is not None:
            self._mark(result, ("u", why))
        return result

    def rebind(self, x, res):
        """``x`` now holds ``res``'s value (an in-place op on a tensor that needs no grad)."""
        r = self.ref(res)
        if r is not None:
            self._mark(x, r)
        elif self.ref(x) is not None:
            del self.refs[id(x)]

    def written(self, x, value, what):
        """``x[...] = value`` wrote in place without recording: mark ``x`` untraceable when
        ``value`` or ``x`` was a traced value."""
        if self.ref(x) is not None or isinstance(value, Tensor) and (
                self.ref(value) is not None or self.traced(value)):
            self._mark(x, ("u", f"{what} into a tensor that does not require grad"))

    # -- Python reading traced values: guards ----------------------------------------------

    def _refuse(self, t, what, why):
        f, line, text = _site()
        raise RuntimeError(
            f"tapegrad.trace: {what} at {f}:{line} ({text!r}) reads a value that depends on "
            f"the traced inputs ({why}) but that the program cannot recompute, so it would "
            f"replay the value it had while tracing. Compute it with tapegrad ops on the "
            f"inputs (tapegrad.where instead of a Python branch), or outside the traced "
            f"function")

    def _guard(self, t, r, truth, desc):
        """Record a guard: replay checks that every element of traced ``t`` (reference
        ``r``) still has its truth value (``truth``) or its value; returns the site."""
        from .tape import current_tape
        v = np.asarray(t._d)
        expected = (v != 0).astype(np.float64) if truth else v.astype(np.float64)
        site = _site()
        if v.size == 1 and truth:
            taken = bool(expected.reshape(()))
        else:
            taken = desc if v.size > 8 else f"{desc} == {v.tolist()!r}"
        self.sites.append(site + (taken,))
        tape = current_tape()
        tape.append(_prog.GUARD, -1, -1, 0.0, 0.0, float(expected.reshape(-1)[0])
                    if v.size else 0.0,
                    (r, float(expected.reshape(())) if v.size == 1 and truth else expected,
                     len(self.sites) - 1) + (() if truth else ("value",)))
        return site

    def on_bool(self, t):
        """Python needs the truth value of ``t``: record a guard when it is traced."""
        r = self.ref(t)
        if r is not None and r[0] == "u":
            self._refuse(t, "bool()", r[1])
        if r is None:
            if not self.traced(t) or t.numel() != 1:
                return None
            # ``if x:`` on a traced number: the guard is on x != 0
            b = _plain(np.asarray(np.asarray(t._d) != 0))
            self._record("ne", b, [self._tape_ref(t), ("c", 0.0)])
            r = self.ref(b)
            t = b
        if t.numel() != 1:
            return None  # the eager error follows
        self._guard(t, r, True, "")
        return bool(np.asarray(t._d).reshape(()))

    def on_escape(self, t, what):
        """Python reads the value of ``t`` (``item()``, ``int()``, ``tolist()``...). A traced
        truth value becomes a guard; any other traced value is frozen into the program, with
        guards that it is the same at replay, and a TraceWarning (an error when strict)."""
        if self._quiet:
            return
        r = self.ref(t)
        if r is not None and r[0] == "u":
            self._refuse(t, what, r[1])
        if r is None:
            if not self.traced(t):
                return
            r = self._tape_ref(t)
        if t.dtype.np == np.bool_:
            self._guard(t, r, True, f"{what} of a traced truth value")
            return
        f, line, text = _site()
        msg = (f"{what} on a traced tensor at {f}:{line} ({text!r}) takes its value out of "
               f"the tape: the program replays it as the constant it was while tracing, and "
               f"raises GuardError (or traces again, with retrace=True) at inputs where it "
               f"differs. Keep the computation in tapegrad ops (use where() instead of a "
               f"Python branch on it) to have it recomputed at new inputs.")
        if self.strict:
            raise RuntimeError(msg + " (trace(..., strict=True) makes this an error)")
        warnings.warn(msg, TraceWarning, stacklevel=_stacklevel())
        self._guard(t, r, False, f"{what}")

    def on_index(self, idx, what="x[i]"):
        """Tensors in an index (``x[mask]``, ``x[i]``) choose elements while tracing: guard
        that a boolean mask is the same at replay, element by element; an integer index is
        a value read out of the tape (on_escape)."""
        for i in (idx if isinstance(idx, tuple) else (idx,)):
            if not isinstance(i, Tensor):
                continue
            r = self.ref(i)
            if r is not None and r[0] == "u":
                self._refuse(i, what, r[1])
            if r is None:
                if not self.traced(i):
                    continue
                r = self._tape_ref(i)
            if i.dtype.np == np.bool_:
                self._guard(i, r, True, f"the boolean mask in {what}")
            else:
                self.on_escape(i, f"the index tensor in {what}")

    @contextlib.contextmanager
    def quiet(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1


def _example(x, i):
    if isinstance(x, Tensor):
        if not x.dtype.is_floating_point:
            raise TypeError(f"trace: example input {i} has dtype {x.dtype}; traced inputs "
                            f"are floating point (float64 or float32)")
        return tensor(np.array(x._d, copy=True) if not isinstance(x._d, float) else x._d,
                      dtype=x.dtype, requires_grad=True)
    if isinstance(x, (list, tuple)) or (isinstance(x, (int, float)) and
                                        not isinstance(x, bool)):
        x = np.asarray(x, dtype=np.float64)
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            raise TypeError(f"trace: example input {i} has dtype {x.dtype}; traced inputs are "
                            f"floating point: pass x.astype(np.float64)")
        return tensor(x.copy(), requires_grad=True)
    if isinstance(x, np.floating):
        return tensor(np.asarray(x), requires_grad=True)
    raise TypeError(f"trace: example input {i} is a {type(x).__name__}; pass NumPy arrays, "
                    f"Python floats or tapegrad Tensors")


def _trace_code(fn, examples, strict):
    """Run ``fn`` on leaves made from ``examples`` and lower what it recorded to a _Code."""
    leaves = [_example(x, i) for i, x in enumerate(examples)]
    tr = _Trace(leaves, strict)
    st = STATE
    if st.trace is not None:
        raise RuntimeError("tapegrad.trace cannot be called while another trace is running")
    tape = Tape()
    tape.limit = sys.maxsize  # one tape for the whole trace (large arrays may still start more)
    tr.first_sid = tape.sid
    with enable_grad():
        saved = st.tape  # this thread's tape while grad is enabled (restored before exit)
        st.tape = weakref.ref(tape)
        st.trace = tr
        try:
            out = fn(*leaves)
        finally:
            st.trace = None
            st.tape = saved
    if isinstance(out, (tuple, list)):
        outs, kind = list(out), "tuple"
    else:
        outs, kind = [out], "single"
    for i, o in enumerate(outs):
        if not isinstance(o, (Tensor, float, int)):
            raise TypeError(f"trace: fn returned a {type(o).__name__} (output {i}); return "
                            f"tensors, numbers or a tuple of them")
    tapes = _collect_tapes(outs, tr)
    L, in_slots, out_slots = _prog.lower(tapes, leaves, outs, tr.refs)
    rows = L.rows()
    flat_out = np.concatenate([np.asarray(s).reshape(-1) for s in out_slots]) if outs else \
        np.zeros(0, np.int64)
    pruned, new = _prog.prune(rows, flat_out.astype(np.int64))
    in_flat = np.concatenate([s.reshape(-1) for s in in_slots]) if in_slots else \
        np.zeros(0, np.int64)
    code = _Code(pruned, new[in_flat], new[flat_out],
                 [(tuple(np.shape(t._d)), np.dtype(t.dtype.np)) for t in leaves],
                 [(tuple(np.shape(o._d)) if isinstance(o, Tensor) else (),
                   np.dtype(o.dtype.np) if isinstance(o, Tensor) else np.dtype(np.float64))
                  for o in outs], kind, tr.sites)
    return code


def _collect_tapes(outs, tr):
    """The tapes recorded during the trace, in recording order."""
    seen, stack = {}, [o._tape for o in outs if isinstance(o, Tensor) and o._tape is not None]
    for r in tr.refs.values():
        if r[1][0] == "s":
            stack.append(r[1][1])
    while stack:
        t = stack.pop()
        if t.sid < tr.first_sid or t.sid in seen:
            continue
        seen[t.sid] = t
        for k in t.imports:
            stack.append(t.aux[k][0])
    return [seen[s] for s in sorted(seen)]


def _layout(specs):
    """(shape, offset, size, rank) of each (shape, dtype) in a flat vector of their
    elements."""
    out, o = [], 0
    for shape, _ in specs:
        m = int(np.prod(shape))
        out.append((tuple(shape), o, m, len(shape)))
        o += m
    return tuple(out)


def _flat_one(code, xs, flat):
    """(flat float64 inputs, whether any was a Tensor) of one sample when every input is a
    float64 ndarray, Tensor or float of exactly its traced shape (an optimization loop's
    call); None otherwise: ``Program._inputs`` then checks them and says what is wrong.
    ``flat``: (buffer, views of it shaped like each input) that the inputs are copied into
    (the view is None for one input of rank 1 or more, which is passed as it is, or made
    contiguous)."""
    shapes = code.in_shapes
    if len(xs) != len(shapes) or not code.all_f64:
        return None
    as_tensor = False
    buf, views = flat
    for x, shape, view in zip(xs, shapes, views):
        cls = x.__class__
        if cls is not np.ndarray:
            if cls is float:
                if shape:
                    return None
                view[()] = x
                continue
            if not isinstance(x, Tensor):
                return None
            as_tensor = True
            x = x._d
            if x.__class__ is float:
                if shape:
                    return None
                view[()] = x
                continue
        # another float64 dtype object (byte order, metadata) takes the general path too
        if x.dtype is not _F64 or x.shape != shape:
            return None  # a batch, or a wrong input: the general path
        if view is None:  # one input: passed as it is (the interpreters only read it)
            # C-contiguous: a strided vector would compile the entry again for its layout
            return (np.ascontiguousarray(x) if len(shape) == 1 else x.reshape(-1)), as_tensor
        view[...] = x  # into views made once: cheaper than np.concatenate of the inputs
    return buf, as_tensor


def _wrap_one(flat, layout, as_tensor, single):
    """``Program._wrap`` of one sample's float64 results: views of ``flat`` (a fresh array
    of each call, never reused), 0-d results as NumPy or Python floats."""
    out = []
    for shape, o, m, rank in layout:
        if rank == 0:
            v = flat[o]
            out.append(_plain(float(v)) if as_tensor else v)
            continue
        if rank == 1:
            v = flat if len(layout) == 1 and flat.shape[0] == m else flat[o:o + m]
        else:
            v = flat[o:o + m].reshape(shape)
        out.append(_plain(v) if as_tensor else v)
    return out[0] if single else tuple(out)


def _keys(layout):
    """The index of each result in the flat results (an int for a 0-d result, a slice for a
    vector), for ``_pick``; None when a result needs a reshape."""
    if any(rank > 1 for _, _, _, rank in layout):
        return None
    return tuple(slice(o, o + m) if rank else o for _, o, m, rank in layout)


def _pick(flat, keys, single):
    """``_wrap_one`` of NumPy results of rank 0 or 1 (fewer Python steps: indexing by keys
    made once)."""
    return flat[keys[0]] if single else tuple(map(flat.__getitem__, keys))


class _Code:
    """One traced variant: rows, input and output layout, guard sites."""

    def __init__(self, rows, in_slots, out_slots, inputs, outputs, kind, sites):
        self.rows = np.ascontiguousarray(rows, dtype=np.float64)
        self.in_slots = np.ascontiguousarray(in_slots, dtype=np.int64)
        self.out_slots = np.ascontiguousarray(out_slots, dtype=np.int64)
        self.inputs = inputs      # [(shape, dtype)]
        self.outputs = outputs    # [(shape, dtype)]
        self.kind = kind          # "single" or "tuple"
        self.sites = sites        # [(file, line, text, taken)]
        self._derived = {}
        # (shape, offset, size) of each input and output in the flat vectors: worked out
        # once for the calls' fast paths (``_run_one``)
        self.in_layout = _layout(inputs)
        self.out_layout = _layout(outputs)
        self.n_in = sum(m for _, _, m, _ in self.in_layout)
        self.single_out = kind == "single"
        self.single_in = len(inputs) == 1
        self.all_f64 = all(d == _F64 for _, d in inputs + outputs)
        # the one-sample calls' entry (``replay_cpu.run_into``): output then input slots,
        # the gradient's layout in its results, and buffers reused across calls (a list
        # of free ones: a call pops one and puts it back, so threads never share one)
        self.slots = np.concatenate((self.out_slots, self.in_slots))
        self.in_shapes = tuple(tuple(sh) for sh, _ in inputs)
        m = len(self.out_slots)
        self.grad_layout = tuple((sh, o + m, k, r) for sh, o, k, r in self.in_layout)
        self.out_keys = _keys(self.out_layout)
        self.grad_keys = _keys(self.grad_layout)
        # one float64 vector in, NumPy results of rank <= 1: ``Program._run_vec``'s case
        self.vec = len(inputs) == 1 and len(self.in_shapes[0]) == 1 and self.all_f64 and \
            self.out_keys is not None
        self._work, self._flat = [], []

    def new_work(self):
        """A ``work`` buffer of ``replay_cpu.run_into``: the seeds of value_and_grad (ones),
        then room for the values and adjoints."""
        work = np.empty(len(self.out_slots) + 2 * self.rows.shape[0])
        work[:len(self.out_slots)] = 1.0
        return work

    def run1(self, x, grad):
        """(status, fresh results: outputs then gradient) of one sample ``x``."""
        free = self._work
        work = free.pop() if free else self.new_work()
        res = np.empty(self.slots.shape[0])
        status = _cpu.run_into(self.rows, self.slots, x, work, res, grad)
        free.append(work)
        return status, res

    def flat_buffer(self):
        """(flat inputs, views of it shaped like each input) for ``_flat_one``."""
        buf = np.empty(self.n_in)
        if len(self.in_layout) == 1 and self.in_layout[0][3]:
            return buf, (None,)
        return buf, tuple(buf[o:o + k].reshape(sh) for sh, o, k, _ in self.in_layout)

    def derived(self, key, build):
        c = self._derived.get(key)
        if c is None:
            c = self._derived[key] = build()
        return c


def _grad_code(code, seeds=None):
    """The program of ``code``'s gradient (of ``sum(seeds * outputs)``): its rows followed by
    the reverse sweep re-recorded as rows; outputs: the gradient's elements."""
    seeds = [1.0] * len(code.out_slots) if seeds is None else [float(s) for s in seeds]
    L, grads = _prog.grad_rows(code.rows, code.out_slots, seeds, code.in_slots)
    rows = L.rows()
    out = np.array([int(g) for g in grads], dtype=np.int64)
    pruned, new = _prog.prune(rows, out)
    return _Code(pruned, new[code.in_slots], new[out], code.inputs,
                 [(s, d) for s, d in code.inputs], "tuple" if len(code.inputs) > 1 else
                 "single", code.sites)


def _hvp_code(code):
    """A program of (x, v) whose value is ``grad(f)(x) . v``: its gradient in x is H v."""
    nin = len(code.in_slots)
    L = _prog.Builder()
    L._blocks.append(code.rows.copy())
    L.n = code.rows.shape[0]
    vs = L.inputs(nin, (nin,))
    rows = L.rows()
    L2, grads = _prog.grad_rows(rows, code.out_slots, [1.0] * len(code.out_slots),
                                code.in_slots)
    prods = L2.op("mul", np.array([int(g) for g in grads], dtype=np.int64), vs)
    from .ops.lowering import reduce
    dot = int(np.asarray(reduce(L2, "add", prods, None, False, 0.0)))
    rows = L2.rows()
    pruned, new = _prog.prune(rows, np.array([dot], dtype=np.int64))
    return _Code(pruned, new[np.concatenate([code.in_slots, vs])], new[[dot]],
                 code.inputs + code.inputs, [((), np.dtype(np.float64))], "single",
                 code.sites)


def _hvp_of(code):
    """``code``'s Hessian-vector program, built once."""
    return code.derived("hvp", lambda: _hvp_code(code))


def _vjp_code(code):
    """A program of (x, v) whose outputs are ``v^T J(x)`` (v shaped like the outputs): the
    rule of a ``program`` entry under create_graph, so derivatives of any order stay
    compiled."""
    nout = len(code.out_slots)
    L = _prog.Builder()
    L._blocks.append(code.rows.copy())
    L.n = code.rows.shape[0]
    vs = L.inputs(len(code.in_slots), (nout,))
    rows = L.rows()
    L2, grads = _prog.grad_rows(rows, code.out_slots, [int(v) for v in vs], code.in_slots)
    out = np.array([int(g) for g in grads], dtype=np.int64)
    pruned, new = _prog.prune(L2.rows(), out)
    return _Code(pruned, new[np.concatenate([code.in_slots, vs])], new[out],
                 code.inputs + code.outputs, list(code.inputs),
                 "tuple" if len(code.inputs) > 1 else "single", code.sites)


# --- traced programs on the eager tape -------------------------------------------------------
# ``program(*tensors)`` records one ``program`` entry (and a ``function_out`` per output), so
# a program composes with eager code: its backward is its compiled VJP, batched for
# is_grads_batched (one forward, many seeds), and a call of its VJP program under
# create_graph.


def _seed_matrix(g, code, batch, B=None):
    """The output gradients ``g`` ({index: grad}) as the flat seed matrix: (nout,) or
    (nout, batch) per sample; with a batch of ``B`` seeds, (nout, samples * B) with sample
    ``b``'s seed ``s`` in column ``b * B + s``."""
    parts = []
    for i, (shape, _) in enumerate(code.outputs):
        lead = (() if B is None else (B,)) + (() if batch is None else (batch,))
        gi = g.get(i) if g else None
        gi = np.zeros(lead + shape) if gi is None else np.broadcast_to(
            np.asarray(getattr(gi, "_d", gi), dtype=np.float64), lead + shape)
        m = int(np.prod(shape))
        if B is not None and batch is not None:
            gi = np.swapaxes(gi, 0, 1)  # (samples, seeds, ...)
        # the lead's size spelled out: an empty output (m = 0) cannot infer it
        parts.append(gi.reshape(int(np.prod(gi.shape[:len(lead)])), m).T if lead else
                     gi.reshape(-1))
    return np.ascontiguousarray(np.concatenate(parts, axis=0) if parts else np.zeros(0))


def _program_vjp_np(g, values, aux):
    """Gradients of a ``program`` entry's inputs on plain values (batched when ``aux`` ends
    with the seed batch size)."""
    prog, code, x, batch = aux[:4]
    B = aux[4] if len(aux) > 4 else None
    S = _seed_matrix(g, code, batch, B)
    if B is None:
        _, _, G = prog._execute(code, x, batch, S, True)
        G = _host(G)
    else:
        G = prog._vjp_many(code, x if batch is not None else x.reshape(-1, 1), S, B)
        if batch is not None:  # (nin, samples * B) -> (nin, B * samples), seed-major
            G = G.reshape(-1, batch, B).transpose(0, 2, 1).reshape(-1, batch * B)
    lead = None if B is None and batch is None else (
        B * (batch or 1) if B is not None else batch)
    parts = prog._wrap(G, code.inputs, lead, False, "tuple")
    if B is not None and batch is not None:
        parts = tuple(p.reshape((B, batch) + p.shape[1:]) for p in parts)
    return tuple(parts)


def _program_vjp_tensor(g, inputs, aux):
    """The rule of a ``program`` entry under create_graph: a recorded call of the program's
    VJP program, itself differentiable."""
    prog, code, x, batch = aux[:4]
    vcode = code.derived("vjp", lambda: _vjp_code(code))
    vprog = Program([vcode], None, False, prog.strict, prog.target, prog.block)
    lead = () if batch is None else (batch,)
    cot = []
    for i, (shape, dtype) in enumerate(code.outputs):
        gi = g.get(i) if g else None
        cot.append(gi if gi is not None else tensor(np.zeros(lead + shape, dtype)))
    res = vprog(*inputs, *cot)
    return res if isinstance(res, tuple) else (res,)


def program_vjp(F, g, values, aux):
    """The rule of a ``program`` entry (registered in ops/arrays.py): the compiled VJP on
    plain values; on the tensor backend (create_graph) a recorded call of the VJP program."""
    from .autograd._tensor_backend import TensorF
    return (_program_vjp_tensor if F is TensorF else _program_vjp_np)(g, values, aux)


# --- the program ------------------------------------------------------------------------------


#: bytes of a block's values and adjoints (rows x block x 2 float64): the blocks run in
#: buffers reused from block to block, so the budget is the L3 cache, not a core's L2 (more
#: samples a row spread the interpreter's cost of the row). Measured on 2-core EPYC (1 MiB
#: L2 a core, 32 MiB L3), CPU time of value_and_grad over 256 samples: 8,992 rows (n=1000
#: Rosenbrock) 7.8 ms in blocks of 16, 6.0 in 64, 6.2 in 128, 9.4 in 256 (single calls 9.8);
#: 892 rows 0.68 ms in 16, 0.54 in 32, 0.39 in 128 (single calls 1.49)
BLOCK_BYTES = 1 << 24


def _block_for(variants):
    """Samples a block for a batch of this program: the largest power of two from 16 to
    ``replay_cpu.BLOCK`` whose values and adjoints fit in ``BLOCK_BYTES`` (blocks only
    split the samples: every block size gives the same numbers)."""
    if not variants:
        return _cpu.BLOCK
    rows = max(1, variants[0].rows.shape[0])
    block = _cpu.BLOCK
    while block > 16 and rows * block * 16 > BLOCK_BYTES:
        block //= 2
    return block


class Program:
    """A traced function: call it, or ask for gradients, at new inputs without re-recording.

    Made by :func:`trace`. Inputs are NumPy arrays (or Python floats, or tapegrad Tensors)
    of the traced shapes; a leading extra axis on every input is a batch of samples.

    Examples
    --------
    >>> import numpy as np, tapegrad
    >>> prog = tapegrad.trace(lambda x: (x * x).sum(), np.ones(3))
    >>> prog.grad(np.array([1.0, 2.0, 3.0]))
    array([2., 4., 6.])
    """

    def __init__(self, variants, fn=None, retrace=False, strict=False, target="cpu",
                 block=None):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        self._cuda = cuda_module() if target == "cuda" else None
        self._variants = variants
        self._fn = fn
        self.retrace = retrace
        self.strict = strict
        self.target = target
        self.block = block or _block_for(variants)

    # -- description ------------------------------------------------------------------------
    @property
    def _code(self):
        return self._variants[0]

    @property
    def input_shapes(self):
        return [s for s, _ in self._code.inputs]

    @property
    def output_shapes(self):
        return [s for s, _ in self._code.outputs]

    def __len__(self):
        return self._code.rows.shape[0]

    def __repr__(self):
        ins = ", ".join(str(list(s)) for s in self.input_shapes)
        return (f"<tapegrad.Program: {len(self)} rows, inputs ({ins}), "
                f"{len(self._variants)} variant(s), target={self.target!r}>")

    def dump(self, limit=None):
        """A readable listing of the program's rows."""
        from .ops import OPS
        rows = self._code.rows
        n = len(rows) if limit is None else min(limit, len(rows))
        lines = [repr(self)]
        for k in range(n):
            op, a, b, c, c0, c1 = rows[k]
            name = OPS[int(op)].name
            args = [f"%{int(s)}" for s in (a, b, c) if s >= 0]
            if name == "leaf":
                args = [f"x[{int(c0)}]"]
            elif name == "const":
                args = [repr(float(c0))]
            elif c0 or c1:
                args += [f"c0={float(c0)!r}", f"c1={float(c1)!r}"]
            lines.append(f"%{k:<5} = {name}({', '.join(args)})")
        return "\n".join(lines)

    def to(self, target):
        """This program for another target ("cpu", "parallel" or "cuda")."""
        return Program(self._variants, self._fn, self.retrace, self.strict, target,
                       self.block)

    # -- inputs and outputs -----------------------------------------------------------------
    def _inputs(self, xs, code=None):
        """Flat float64 inputs: (x (nin,), None) for one sample or (X (nin, B), B)."""
        code = code or self._code
        if len(xs) != len(code.inputs):
            raise TypeError(f"this program takes {len(code.inputs)} input(s) (traced with "
                            f"{len(code.inputs)} example input(s)), got {len(xs)}")
        arrs, batch, as_tensor, device = [], None, False, False
        for i, (x, (shape, dtype)) in enumerate(zip(xs, code.inputs)):
            if isinstance(x, Tensor):
                as_tensor = True
                x = np.asarray(x._d)
            elif isinstance(x, (float, int)) and not isinstance(x, bool):
                x = np.asarray(float(x), dtype=dtype)
            elif _is_device(x):
                if self._cuda is None:
                    raise TypeError(f"input {i} is a CUDA device array, but this program's "
                                    f"target is {self.target!r}: use program.to('cuda'), or "
                                    f"copy the input to the host")
                x = self._cuda.as_device(x)
                device = True
            else:
                x = np.asarray(x)
            if x.dtype != dtype:
                raise TypeError(f"input {i} has dtype {x.dtype}, but the program was traced "
                                f"with {dtype}: convert it with .astype(np.{dtype})")
            if x.shape == shape:
                b = None
            elif x.shape[1:] == shape and x.ndim == len(shape) + 1:
                b = x.shape[0]
            else:
                raise ValueError(f"input {i} has shape {list(x.shape)}, but the program was "
                                 f"traced with shape {list(shape)} (or pass a batch of shape "
                                 f"[B, {', '.join(map(str, shape))}])".replace(", ]", "]"))
            if i and (b is None) != (batch is None) or b is not None and batch is not None \
                    and b != batch:
                raise ValueError(f"inputs disagree on the batch: input {i} has shape "
                                 f"{list(x.shape)}; give every input the same leading batch "
                                 f"size, or none")
            batch = b
            arrs.append(x)
        if device:
            return self._cuda.pack(arrs, batch), batch, as_tensor
        if batch is None:
            flat = np.concatenate([a.reshape(-1) for a in arrs]).astype(np.float64) \
                if arrs else np.zeros(0)
        else:
            flat = np.ascontiguousarray(np.concatenate(
                [a.reshape(batch, -1) for a in arrs], axis=1).T, dtype=np.float64) \
                if arrs else np.zeros((0, batch))
        return flat, batch, as_tensor

    def _wrap(self, flat, specs, batch, as_tensor, kind):
        """Split flat results into arrays shaped by ``specs``."""
        out, i = [], 0
        for shape, dtype in specs:
            m = int(np.prod(shape))
            if not isinstance(flat, np.ndarray):  # results on the GPU stay there
                out.append(self._cuda.unpack(flat, i, m, batch, shape, dtype))
                i += m
                continue
            if batch is None:
                v = flat[i:i + m].reshape(shape).astype(dtype)
                v = v[()] if shape == () and not as_tensor else v
            else:
                v = np.ascontiguousarray(flat[i:i + m].T.reshape((batch,) + shape),
                                         dtype=dtype)
            out.append(_plain(v if np.ndim(v) or not isinstance(v, np.ndarray) else
                              float(v) if dtype == np.float64 else v) if as_tensor else v)
            i += m
        return out[0] if kind == "single" else tuple(out)

    # -- running ----------------------------------------------------------------------------
    def _execute(self, code, x, batch, seeds, grad):
        if self._cuda is not None:
            return self._execute_cuda(code, x, batch, seeds, grad)
        # a cold cache compiles for seconds: say so, once (a set lookup on the hot path)
        if batch is None:
            if "replay" in _notice.PENDING:
                _notice.announce("replay")
            return _cpu.run_fresh(code.rows, x, code.out_slots, seeds, code.in_slots, grad)
        # one block has nothing to spread over the cores, and starting the threads costs
        # more than the block (tens of ms on a busy machine): it runs serially
        parallel = self.target == "parallel" and batch > self.block
        if _notice.PENDING:
            _notice.announce("parallel" if parallel else "batch")
        fn = _cpu.run_parallel if parallel else _cpu.run_batch
        return fn(code.rows, x, code.out_slots, seeds, code.in_slots, grad, self.block)

    def _execute_cuda(self, code, x, batch, seeds, grad):
        """``_execute`` on the GPU: one sample is a batch of one. Results stay on the
        device when the inputs came from it, and come back to the host otherwise."""
        host = isinstance(x, np.ndarray)
        X = x.reshape(-1, 1) if batch is None and host else x
        S = seeds.reshape(-1, 1) if batch is None and isinstance(seeds, np.ndarray) else seeds
        status, outs, grads = self._cuda.run(code, X, S, grad)
        if grads is None:
            grads = np.zeros((len(code.in_slots), X.shape[1]))
        elif host:
            grads = grads.copy_to_host()
        if host:
            outs = outs.copy_to_host()
            if batch is None:
                outs, grads = outs[:, 0], grads[:, 0]
        return (status[0] if batch is None else status), outs, grads

    def _run_vec(self, xs, grad):
        """``_run_one`` for an optimization loop's call, in fewer Python steps: one float64
        vector of the traced shape in (the interpreters read it as it is), on the CPU.
        (code, fresh results) or None."""
        code = self._variants[0]
        if not code.vec or len(xs) != 1 or self._cuda is not None:
            return None
        x = xs[0]
        if x.__class__ is not np.ndarray or x.dtype is not _F64 or \
                x.shape != code.in_shapes[0]:
            return None
        x = np.ascontiguousarray(x)  # x itself, unless strided (a compile for its layout)
        if "replay" in _notice.PENDING:  # a cold cache compiles for seconds: say so, once
            _notice.announce("replay")
        for c in self._variants:
            works = c._work
            work = works.pop() if works else c.new_work()
            res = np.empty(c.slots.shape[0])
            status = _cpu.run_into(c.rows, c.slots, x, work, res, grad)
            works.append(work)
            if status == 0:
                return c, res
        return None

    def _run_one(self, xs, grad, select=None):
        """``_run`` of one sample on the CPU, for inputs that ``_flat_one`` takes: (code,
        fresh results (outputs, then the gradient at ``code.grad_layout``), a copy of the
        flat inputs when ``select`` is given, as_tensor), or None when the general path must
        run (other inputs, a CUDA target, or a guard that failed in every variant: ``_run``
        then says which or re-traces)."""
        if self._cuda is not None:
            return None
        code = self._variants[0]
        if select is not None:
            code = select(code)
        # buffers are popped from a list of free ones and put back: threads never share one
        # (the compiled calls release the GIL), and nothing is allocated but the results
        free = code._flat
        flat = free.pop() if free else code.flat_buffer()
        try:
            f = _flat_one(code, xs, flat)
            if f is None:
                return None
            x, as_tensor = f
            if "replay" in _notice.PENDING:  # a cold cache compiles for seconds: say so, once
                _notice.announce("replay")
            for variant in self._variants:
                c = variant if select is None else select(variant)
                works = c._work
                work = works.pop() if works else c.new_work()
                res = np.empty(c.slots.shape[0])
                status = _cpu.run_into(c.rows, c.slots, x, work, res, grad)
                works.append(work)
                if status == 0:
                    return c, res, None if select is None else x.copy(), as_tensor
            return None
        finally:
            free.append(flat)

    def _run(self, xs, seeds=None, grad=False, select=lambda c: c):
        """Run the right variant; returns (code, outs, grads, batch, as_tensor)."""
        base = select(self._code)
        x, batch, as_tensor = self._inputs(xs, base)
        nout = len(base.out_slots)
        if seeds is None:
            seeds = np.ones(nout) if batch is None else np.ones((nout, batch))
        if batch is None:
            for variant in self._variants:
                code = select(variant)
                status, outs, grads = self._execute(code, x, batch, seeds, grad)
                if status == 0:
                    return code, outs, grads, batch, as_tensor
            self._no_variant(code, int(status) - 1, xs)  # raises, or adds a variant
            return self._run(xs, seeds, grad, select)
        code = base
        status, outs, grads = self._execute(code, x, batch, seeds, grad)
        failed = np.nonzero(status)[0].tolist()
        if failed and not isinstance(x, np.ndarray):  # GPU results: patched on the host
            x, seeds = _host(x), _host(seeds)
            outs, grads = _host(outs), _host(grads)
            outs_dev = True
        else:
            outs_dev = False
        # the samples that failed the first variant's guards: try the others one by one
        for b in failed:
            xb, sb = np.ascontiguousarray(x[:, b]), np.ascontiguousarray(seeds[:, b])
            for variant in self._variants[1:]:
                c = select(variant)
                st, o, g = _cpu.run_fresh(c.rows, xb, c.out_slots, sb, c.in_slots, grad)
                if st == 0:
                    outs[:, b], grads[:, b] = o, g
                    break
            else:
                self._no_variant(code, int(status[b]) - 1, [_host(a)[b] for a in xs],
                                 sample=b)
                return self._run(xs, seeds, grad, select)
        if outs_dev:
            outs, grads = self._cuda.to_device(outs), self._cuda.to_device(grads)
        return code, outs, grads, batch, as_tensor

    def _no_variant(self, code, row, xs, sample=None):
        """A guard failed in every variant: re-trace (retrace=True) or raise GuardError."""
        site = int(code.rows[row, 5])
        f, line, text, taken = code.sites[site]
        where = "" if sample is None else f" for sample {sample} of the batch"
        if self.retrace and self._fn is not None:
            examples = [x.detach() if isinstance(x, Tensor) else x for x in xs]
            self._variants.append(_trace_code(self._fn, examples, self.strict))
            return
        hint = ("pass retrace=True to tapegrad.trace to trace and cache a variant for each "
                "branch" if self._fn is not None or not self.retrace else
                "this program was loaded from a file, so it cannot re-trace: trace the "
                "function again")
        if isinstance(taken, bool):
            raise GuardError(f"the traced program took a branch at {f}:{line} ({text!r}) "
                             f"that was {taken} while tracing and is {not taken} at this "
                             f"input{where}. Replaying it would give a wrong result; {hint}.")
        raise GuardError(f"the traced program read a value at {f}:{line} ({text!r}) while "
                         f"tracing ({taken}); it differs at this input{where}. Replaying it "
                         f"would give a wrong result; {hint}.")

    # -- public API -------------------------------------------------------------------------
    def __call__(self, *xs):
        """The traced function's outputs at ``xs``. Called on tensors that require grad
        (with grad mode on), the call is recorded on their tape as one entry: gradients,
        batched gradients and create_graph flow through it like through any op."""
        if STATE.grad_enabled:
            for x in xs:
                if isinstance(x, Tensor) and x._rg:
                    return self._call_recorded(xs)
        r = self._run_vec(xs, False)
        if r is not None:
            return _pick(r[1], r[0].out_keys, r[0].single_out)
        r = self._run_one(xs, False)
        if r is not None:
            code, res, _, as_tensor = r
            return _wrap_one(res, code.out_layout, as_tensor, code.single_out)
        code, outs, _, batch, as_tensor = self._run(xs)
        return self._wrap(outs, code.outputs, batch, as_tensor, code.kind)

    def _call_recorded(self, xs):
        from .ops import BY_NAME
        from .tensor import array_op
        if STATE.trace is not None:
            raise NotImplementedError("calling a traced Program inside tapegrad.trace is not "
                                      "supported: trace the Python function it came from")
        code, outs, _, batch, _ = self._run(xs)
        x, _, _ = self._inputs(xs, code)
        if not isinstance(x, np.ndarray):
            x = _host(x)
        values = self._wrap(_host(outs), code.outputs, batch, False, "tuple")
        inputs = [a if isinstance(a, Tensor) else tensor(np.asarray(_host(a)))
                  for a in xs]
        node = array_op(BY_NAME["program"], inputs, 0.0, (self, code, x, batch))
        out = BY_NAME["function_out"]
        res = tuple(array_op(out, [node], v if np.ndim(v) else
                             (float(v) if v.dtype == _F64 else np.asarray(v)), (i,))
                    for i, v in enumerate(values))
        return res[0] if code.kind == "single" else res

    def _vjp_many(self, code, X, S, reps):
        """Gradients (nin, samples * reps) on the host for ``reps`` seeds per sample (columns
        of ``S``, sample-major), with one forward per sample where the target allows."""
        if self._cuda is not None:
            return _host(self._cuda.run(code, X, S, True, reps)[2])
        if X.shape[1] == 1:
            return _cpu.vjp_multi(code.rows, np.ascontiguousarray(X[:, 0]), code.out_slots,
                                  S, code.in_slots)[2]
        Xr = np.ascontiguousarray(np.repeat(X, reps, axis=1))
        return self._execute(code, Xr, Xr.shape[1], S, True)[2]

    def _scalar_check(self, what):
        code = self._code
        if len(code.out_slots) != 1:
            raise RuntimeError(f"{what}: grad can be implicitly created only for scalar "
                               f"outputs; this program returns {len(code.out_slots)} values. "
                               f"Use program.vjp(xs, v) or program.jacobian(*xs)")

    def value_and_grad(self, *xs):
        """(value, gradient) at ``xs``: the gradient has the inputs' shapes (a tuple when
        there are several inputs)."""
        if len(self._variants[0].out_slots) == 1:  # optimization loops: one sample, on the CPU
            r = self._run_vec(xs, True)
            if r is not None:
                code, res = r
                return _pick(res, code.out_keys, code.single_out), res[code.grad_keys[0]]
            r = self._run_one(xs, True)
            if r is not None:
                code, res, _, as_tensor = r
                if not as_tensor and code.out_keys is not None and \
                        code.grad_keys is not None:
                    return (_pick(res, code.out_keys, code.single_out),
                            _pick(res, code.grad_keys, code.single_in))
                return (_wrap_one(res, code.out_layout, as_tensor, code.single_out),
                        _wrap_one(res, code.grad_layout, as_tensor, code.single_in))
        self._scalar_check("value_and_grad")
        code, outs, grads, batch, as_tensor = self._run(xs, grad=True)
        value = self._wrap(outs, code.outputs, batch, as_tensor, code.kind)
        return value, self._wrap(grads, code.inputs, batch, as_tensor,
                                 "single" if len(code.inputs) == 1 else "tuple")

    def grad(self, *xs):
        """The gradient of the (scalar) output at ``xs``."""
        return self.value_and_grad(*xs)[1]

    def vjp(self, xs, v):
        """(outputs, v^T J): the outputs at ``xs`` and the vector-Jacobian product with
        cotangents ``v`` shaped like the outputs (with the batch axis when batched)."""
        xs = xs if isinstance(xs, (tuple, list)) else (xs,)
        code = self._code
        vs = v if isinstance(v, (tuple, list)) and code.kind == "tuple" else (v,)
        _, batch, _ = self._inputs(xs)
        seeds = self._seeds(vs, code, batch)
        code, outs, grads, batch, as_tensor = self._run(xs, seeds=seeds, grad=True)
        return (self._wrap(outs, code.outputs, batch, as_tensor, code.kind),
                self._wrap(grads, code.inputs, batch, as_tensor,
                           "single" if len(code.inputs) == 1 else "tuple"))

    def _seeds(self, vs, code, batch):
        if len(vs) != len(code.outputs):
            raise ValueError(f"vjp: expected {len(code.outputs)} cotangent(s), got {len(vs)}")
        parts, device = [], False
        for i, (v, (shape, _)) in enumerate(zip(vs, code.outputs)):
            v = v._d if isinstance(v, Tensor) else v
            if _is_device(v) and self._cuda is not None:
                v, device = self._cuda.as_device(v), True
            else:
                v = np.asarray(v, dtype=np.float64)
            want = shape if batch is None else (batch,) + shape
            if v.shape != want:
                raise ValueError(f"vjp: cotangent {i} has shape {list(v.shape)}, expected "
                                 f"{list(want)}")
            parts.append(v)
        if device:
            return self._cuda.pack(parts, batch)
        parts = [v.reshape(-1) if batch is None else v.reshape(batch, -1) for v in parts]
        if batch is None:
            return np.concatenate(parts)
        return np.ascontiguousarray(np.concatenate(parts, axis=1).T)

    def jacobian(self, *xs):
        """The Jacobian at ``xs``: shape output shape + input shape (a tuple per input when
        there are several; a tuple of those per output when there are several outputs);
        with a batch axis on the inputs, one Jacobian per sample (leading batch axis)."""
        x, batch, as_tensor = self._inputs(xs)
        code = self._code
        m, nin = len(code.out_slots), len(code.in_slots)
        B = 1 if batch is None else batch
        on_device = not isinstance(x, np.ndarray)
        J_dev = False
        if self._cuda is not None:
            status, _, G = self._cuda.jacobian(code, x if on_device else x.reshape(nin, -1))
            if on_device and not status.any():
                J, J_dev = G, True
            else:  # (nin, B * m) with sample-major columns -> (B, m, nin)
                J = _host(G).reshape(nin, B, m).transpose(1, 2, 0).copy()
                x = _host(x).reshape(nin, B)
        elif batch is None:
            if "jacobian" in _notice.PENDING:
                _notice.announce("jacobian")
            st, _, J = _cpu.jacobian(code.rows, x, code.out_slots, code.in_slots)
            status, J, x = np.array([st]), J[None], x.reshape(-1, 1)
        else:
            if "jacobian_batch" in _notice.PENDING:
                _notice.announce("jacobian_batch")
            status, J = _cpu.jacobian_batch(code.rows, x, code.out_slots, code.in_slots)
        # samples that failed the first variant's guards: the other variants, one by one
        for b in np.nonzero(status)[0].tolist():
            xb = np.ascontiguousarray(x[:, b])
            for c in self._variants[1:]:
                st, _, Jb = _cpu.jacobian(c.rows, xb, c.out_slots, c.in_slots)
                if st == 0:
                    J[b] = Jb
                    break
            else:
                sample = [_host(a) if batch is None else _host(a)[b] for a in xs]
                self._no_variant(code, int(status[b]) - 1, sample,
                                 sample=None if batch is None else b)
                return self.jacobian(*xs)
        lead = () if batch is None else (batch,)
        res, i = [], 0
        for oshape, _ in code.outputs:
            mo = int(np.prod(oshape))
            per, j = [], 0
            for ishape, dtype in code.inputs:
                n = int(np.prod(ishape))
                shape = lead + oshape + ishape
                if J_dev:
                    block = self._cuda.jacobian_block(J, max(m, 1), i, j, mo, n, B,
                                                      dtype).reshape(shape)
                else:
                    block = J[:, i:i + mo, j:j + n].reshape(shape).astype(dtype)
                    if on_device:
                        block = self._cuda.to_device(block)
                per.append(_plain(block) if as_tensor else block)
                j += n
            res.append(per[0] if len(per) == 1 else tuple(per))
            i += mo
        return res[0] if code.kind == "single" else tuple(res)

    def grad_program(self, v=None):
        """The program of this program's gradient: a new :class:`Program` of the same
        inputs whose outputs are the gradient (of ``sum(v * outputs)`` when ``v``, constant
        cotangents shaped like the outputs, is given; the output must be a scalar when it is
        not). Differentiate it again for higher derivatives, in compiled code."""
        if v is None:
            self._scalar_check("grad_program")
            seeds = None
        else:
            vs = v if isinstance(v, (tuple, list)) and self._code.kind == "tuple" else (v,)
            seeds = self._seeds(vs, self._code, None)
        return Program([_grad_code(c, seeds) for c in self._variants], None, False,
                       self.strict, self.target, self.block)

    def hessian(self, *xs):
        """The Hessian of the scalar output at ``xs`` (one input: shape input + input)."""
        return self.grad_program().jacobian(*xs)

    def hvp(self, xs, v):
        """(value, Hessian-vector product) at ``xs`` with ``v`` (shaped like the inputs;
        tuples for several inputs), as ``torch.autograd.functional.hvp``; batched when the
        inputs carry a batch axis."""
        self._scalar_check("hvp")
        xs = tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)
        vs = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        nin = len(self._code.inputs)
        if len(xs) == len(vs) == nin:  # one sample on the CPU: exact shapes are checked
            r = self._run_one(xs + vs, True, _hvp_of)
            if r is not None:
                code, hres, x, as_tensor = r
                base = self._variants[0]
                for c in self._variants:  # the value: the variant hvp ran
                    if c._derived.get("hvp") is code:
                        base = c
                st, res = base.run1(x[:base.n_in], False)
                if st == 0:  # H v: the gradient of the hvp program at its first inputs
                    return (_wrap_one(res, base.out_layout, as_tensor, base.single_out),
                            _wrap_one(hres, code.grad_layout[:nin], as_tensor, nin == 1))
        if len(vs) != len(xs):
            raise ValueError(f"hvp: v has {len(vs)} part(s) for {len(xs)} input(s)")
        for i, (a, b) in enumerate(zip(xs, vs)):
            if np.shape(getattr(a, "_d", a)) != np.shape(getattr(b, "_d", b)):
                raise ValueError(f"hvp: v[{i}] has shape {list(np.shape(getattr(b, '_d', b)))}"
                                 f" but input {i} has shape "
                                 f"{list(np.shape(getattr(a, '_d', a)))}")
        code, outs, grads, batch, as_tensor = self._run(xs + vs, grad=True, select=_hvp_of)
        value = self(*xs)
        part = grads[:len(code.in_slots) // 2]
        return value, self._wrap(part, code.inputs[:nin], batch, as_tensor,
                                 "single" if nin == 1 else "tuple")

    # -- files ------------------------------------------------------------------------------
    def save(self, path):
        """Save to ``path`` (NumPy ``.npz``: the rows and a JSON header; no pickled code)."""
        from .ops import OPS
        from . import __version__
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "tapegrad": __version__,
                "ops": [op.name for op in OPS], "variants": []}
        arrays = {}
        for i, c in enumerate(self._variants):
            meta["variants"].append({
                "inputs": [[list(s), str(d)] for s, d in c.inputs],
                "outputs": [[list(s), str(d)] for s, d in c.outputs],
                "kind": c.kind, "sites": [list(s) for s in c.sites]})
            arrays[f"rows{i}"] = c.rows
            arrays[f"in{i}"] = c.in_slots
            arrays[f"out{i}"] = c.out_slots
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        with open(path, "wb") as f:
            np.savez(f, **arrays)


def load(path, target="cpu"):
    """Load a program saved with :meth:`Program.save`.

    Raises ValueError, saying which field or row is wrong, when the file is not a tapegrad
    program, is damaged, or was written by an incompatible version: every field is checked
    before the compiled interpreters (which do no bounds checks) see the program.
    """
    from . import _program_file
    Program([], target=target)  # a bad target fails before the file is read
    variants = [_Code(*v) for v in _program_file.read(path)]
    return Program(variants, None, False, False, target)


def trace(fn, *example_inputs, retrace=False, strict=False, target="cpu"):
    """Record ``fn(*example_inputs)`` once and return a :class:`Program` that replays it.

    Parameters
    ----------
    fn : callable
        Takes tensors shaped like ``example_inputs``; returns a tensor, a number or a tuple.
    *example_inputs : ndarray, float or Tensor
        Inputs to trace at (floating point). The program takes inputs of these shapes.
    retrace : bool
        When a guard fails at replay (a branch that depended on the inputs goes the other
        way, or a value Python read while tracing differs), trace ``fn`` again there and
        keep both variants (default: raise :class:`GuardError`).
    strict : bool
        Make values that leave the tape while tracing (``.item()``, ``float(t)``,
        ``int(t)``, ``.tolist()``, ``.numpy()``) errors instead of :class:`TraceWarning` s
        and value guards. Truth values (``if``, ``bool``, ``all()``, boolean masks) are
        guarded either way.
    target : {"cpu", "parallel", "cuda"}
        Where batched calls run.

    Examples
    --------
    >>> import numpy as np, tapegrad
    >>> f = tapegrad.trace(lambda x: (x.sin() * x).sum(), np.zeros(2))
    >>> value, grad = f.value_and_grad(np.array([0.5, 1.0]))
    """
    if not callable(fn):
        raise TypeError(f"trace: fn must be callable, got {type(fn).__name__}")
    Program([], target=target)  # a bad target fails before fn runs
    code = _trace_code(fn, example_inputs, strict)
    return Program([code], fn, retrace, strict, target)
