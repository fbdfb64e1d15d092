"""Tracing for ``tapegrad.trace``: what is recorded while ``fn`` runs (comparisons, guards,
detached values, warnings) and its lowering to a program's code."""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
import warnings
import weakref

import numpy as np

from ._program_code import _Code
from .interpreters import program as _prog
from .tape import STATE, Tape
from .tensor import Tensor, _plain, enable_grad, tensor

_PKG = os.path.dirname(os.path.abspath(__file__))


class GuardError(RuntimeError):
    """A traced program met a branch that went the other way at replay."""


class TraceWarning(UserWarning):
    """A value left the tape while tracing and is frozen into the program."""
# the errors users catch are tapegrad.replay's, where they were first defined
GuardError.__module__ = TraceWarning.__module__ = "tapegrad.replay"


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
    # (rows whose adjoint stays zero read their operands through detach rows: their rules'
    # 0 * inf gave NaN gradients, ``cut_dead``)
    pruned, new = _prog.prune_live(rows, flat_out.astype(np.int64))
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

