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
import zipfile

import numpy as np

from .interpreters import program as _prog
from .interpreters import replay_cpu as _cpu
from .tape import STATE, Tape
from .tensor import Tensor, _plain, enable_grad, tensor

__all__ = ["trace", "Program", "GuardError", "TraceWarning", "load"]

FORMAT = "tapegrad-program"
FORMAT_VERSION = 1
TARGETS = ("cpu", "parallel", "cuda")
_F64 = np.dtype(np.float64)
_ONE = np.ones(1)
_PKG = os.path.dirname(os.path.abspath(__file__))


class GuardError(RuntimeError):
    """A traced program met a branch that went the other way at replay."""


class TraceWarning(UserWarning):
    """A value left the tape while tracing and is frozen into the program."""


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
        """("s", tape, slot) of a traced tensor, ("c", value) of anything else."""
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
        return self._tape_ref(t)[0] == "s"

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
        if any(r[0] == "s" for r in refs):
            self._record({"logical_and": "logical_and", "logical_or": "logical_or",
                          "logical_xor": "logical_xor"}.get(name, name), result, refs)

    def on_detach(self, result, source):
        """``source.detach()`` of a traced tensor is recorded (a ``detach`` entry, which
        eager backward sees as a constant): operations on it are recorded too, and replay
        recomputes them."""
        r = self._tape_ref(source)
        if r[0] != "s":
            return result
        from .ops import ARRAY, BY_NAME
        from .tape import current_tape
        from .tensor import _new
        tape = current_tape()
        v = result._d
        k = tape.append(BY_NAME["detach"].code | (0 if v.__class__ is float else ARRAY),
                        -1, -1, 0.0, 0.0, v, (r,))
        t = _new(Tensor)
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

    def on_bool(self, t):
        """Python needs the truth value of ``t``: record a guard when it is traced."""
        r = self.ref(t)
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
        taken = bool(np.asarray(t._d).reshape(()))
        from .tape import current_tape
        tape = current_tape()
        site = _site()
        self.sites.append(site + (taken,))
        tape.append(_prog.GUARD, -1, -1, 0.0, 0.0, 1.0 if taken else 0.0,
                    (r, 1.0 if taken else 0.0, len(self.sites) - 1))
        return taken

    def on_escape(self, t, what):
        if self._quiet:
            return
        if self.ref(t) is not None and t.numel() == 1 and t.dtype.np == np.bool_:
            self.on_bool(t)  # a truth value read as a number: a guard, not a frozen value
            return
        if not self.traced(t):
            return
        f, line, text = _site()
        msg = (f"{what} on a traced tensor at {f}:{line} ({text!r}) takes its value out of "
               f"the tape: the program replays it as the constant it was while tracing. Keep "
               f"the computation in tapegrad ops (use where() instead of a Python branch on "
               f"it) to have it recomputed at new inputs.")
        if self.strict:
            raise RuntimeError(msg + " (trace(..., strict=True) makes this an error)")
        warnings.warn(msg, TraceWarning, stacklevel=3)

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
        # one float64 input, one float64 scalar output: value_and_grad's fast path
        self.fast = (len(inputs) == 1 and inputs[0][1] == _F64 and len(self.out_slots) == 1
                     and kind == "single" and outputs[0] == ((), _F64))

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


# --- the program ------------------------------------------------------------------------------


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
        if target == "cuda":
            raise NotImplementedError(
                "target='cuda' (numba.cuda kernels for batched replay, installed with "
                "pip install 'tapegrad[cuda]') is not built yet; use target='parallel' to "
                "spread a batch over the CPU cores")
        self._variants = variants
        self._fn = fn
        self.retrace = retrace
        self.strict = strict
        self.target = target
        self.block = block or _cpu.BLOCK

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
        arrs, batch, as_tensor = [], None, False
        for i, (x, (shape, dtype)) in enumerate(zip(xs, code.inputs)):
            if isinstance(x, Tensor):
                as_tensor = True
                x = np.asarray(x._d)
            elif isinstance(x, (float, int)) and not isinstance(x, bool):
                x = np.asarray(float(x), dtype=dtype)
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
        if batch is None:
            return _cpu.run(code.rows, x, code.out_slots, seeds, code.in_slots, grad)
        if self.target == "cuda":
            from .interpreters import cuda as _cuda
            return _cuda.run_batch(code, x, seeds, grad)
        fn = _cpu.run_parallel if self.target == "parallel" else _cpu.run_batch
        return fn(code.rows, x, code.out_slots, seeds, code.in_slots, grad, self.block)

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
        # the samples that failed the first variant's guards: try the others one by one
        for b in np.nonzero(status)[0].tolist():
            xb, sb = np.ascontiguousarray(x[:, b]), np.ascontiguousarray(seeds[:, b])
            for variant in self._variants[1:]:
                c = select(variant)
                st, o, g = _cpu.run(c.rows, xb, c.out_slots, sb, c.in_slots, grad)
                if st == 0:
                    outs[:, b], grads[:, b] = o, g
                    break
            else:
                self._no_variant(code, int(status[b]) - 1,
                                 [np.asarray(getattr(a, "_d", a))[b] for a in xs], sample=b)
                return self._run(xs, seeds, grad, select)
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
        raise GuardError(f"the traced program took a branch at {f}:{line} ({text!r}) that "
                         f"was {taken} while tracing and is {not taken} at this input{where}. "
                         f"Replaying it would give a wrong result; {hint}.")

    # -- public API -------------------------------------------------------------------------
    def __call__(self, *xs):
        """The traced function's outputs at ``xs``."""
        code, outs, _, batch, as_tensor = self._run(xs)
        return self._wrap(outs, code.outputs, batch, as_tensor, code.kind)

    def _scalar_check(self, what):
        code = self._code
        if len(code.out_slots) != 1:
            raise RuntimeError(f"{what}: grad can be implicitly created only for scalar "
                               f"outputs; this program returns {len(code.out_slots)} values. "
                               f"Use program.vjp(xs, v) or program.jacobian(*xs)")

    def value_and_grad(self, *xs):
        """(value, gradient) at ``xs``: the gradient has the inputs' shapes (a tuple when
        there are several inputs)."""
        code = self._code
        if len(xs) == 1 and code.fast:  # the optimization-loop case, with little Python
            x = xs[0]
            xc = x.__class__
            d = x if xc is np.ndarray else x._d if xc is Tensor else None
            if d.__class__ is np.ndarray and d.dtype == _F64 and d.shape == code.inputs[0][0]:
                st, outs, grads = _cpu.run(code.rows, d.reshape(-1), code.out_slots, _ONE,
                                           code.in_slots, True)
                if st == 0:
                    g = grads.reshape(d.shape)
                    if xc is np.ndarray:
                        return outs[0], g
                    return _plain(float(outs[0])), _plain(g)
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
        parts = []
        for i, (v, (shape, _)) in enumerate(zip(vs, code.outputs)):
            v = np.asarray(v._d if isinstance(v, Tensor) else v, dtype=np.float64)
            want = shape if batch is None else (batch,) + shape
            if v.shape != want:
                raise ValueError(f"vjp: cotangent {i} has shape {list(v.shape)}, expected "
                                 f"{list(want)}")
            parts.append(v.reshape(-1) if batch is None else v.reshape(batch, -1))
        if batch is None:
            return np.concatenate(parts)
        return np.ascontiguousarray(np.concatenate(parts, axis=1).T)

    def jacobian(self, *xs):
        """The Jacobian at ``xs``: shape output shape + input shape (a tuple per input when
        there are several; a tuple of those per output when there are several outputs)."""
        x, batch, as_tensor = self._inputs(xs)
        if batch is not None:
            raise ValueError("jacobian takes one sample; for a batch, use vjp with a batch "
                             "of cotangents")
        for code in self._variants:
            status, outs, J = _cpu.jacobian(code.rows, x, code.out_slots, code.in_slots)
            if status == 0:
                break
        else:
            self._no_variant(code, int(status) - 1, xs)  # raises, or adds a variant
            return self.jacobian(*xs)
        res, i = [], 0
        for oshape, _ in code.outputs:
            m = int(np.prod(oshape))
            per, j = [], 0
            for ishape, dtype in code.inputs:
                n = int(np.prod(ishape))
                block = J[i:i + m, j:j + n].reshape(oshape + ishape).astype(dtype)
                per.append(_plain(block) if as_tensor else block)
                j += n
            res.append(per[0] if len(per) == 1 else tuple(per))
            i += m
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
        if len(vs) != len(xs):
            raise ValueError(f"hvp: v has {len(vs)} part(s) for {len(xs)} input(s)")
        for i, (a, b) in enumerate(zip(xs, vs)):
            if np.shape(getattr(a, "_d", a)) != np.shape(getattr(b, "_d", b)):
                raise ValueError(f"hvp: v[{i}] has shape {list(np.shape(getattr(b, '_d', b)))}"
                                 f" but input {i} has shape "
                                 f"{list(np.shape(getattr(a, '_d', a)))}")
        nin = len(self._code.inputs)

        def select(c):
            return c.derived("hvp", lambda: _hvp_code(c))
        code, outs, grads, batch, as_tensor = self._run(xs + vs, grad=True, select=select)
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

    Raises ValueError when the file is not a tapegrad program, is corrupt, or was written
    by an incompatible version.
    """
    from .ops import BY_NAME
    try:
        with np.load(path, allow_pickle=False) as z:
            files = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path} is not a readable tapegrad program file ({e})") from None
    try:
        meta = json.loads(files["meta"].tobytes().decode())
    except (KeyError, UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path} is not a tapegrad program file (no valid header)") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a tapegrad program file")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} was written in program format version "
                         f"{meta.get('version')} (tapegrad {meta.get('tapegrad')}); this "
                         f"tapegrad reads version {FORMAT_VERSION}: trace the function again")
    names = meta.get("ops", [])
    missing = [n for n in set(names) if n not in BY_NAME]
    remap = np.array([BY_NAME[n].code if n in BY_NAME else -1 for n in names] or [0],
                     dtype=np.float64)
    variants = []
    for i, vm in enumerate(meta["variants"]):
        try:
            rows = np.array(files[f"rows{i}"], dtype=np.float64)
            ins, outs = files[f"in{i}"].astype(np.int64), files[f"out{i}"].astype(np.int64)
        except KeyError as e:
            raise ValueError(f"{path} is corrupt: missing {e}") from None
        _check_rows(path, rows, ins, outs, len(names))
        codes = remap[rows[:, 0].astype(np.int64)]
        if (codes < 0).any():
            raise ValueError(f"{path} uses ops this tapegrad does not have "
                             f"({', '.join(sorted(missing))}): it comes from an incompatible "
                             f"version (tapegrad {meta.get('tapegrad')})")
        rows[:, 0] = codes
        variants.append(_Code(rows, ins, outs,
                              [(tuple(s), np.dtype(d)) for s, d in vm["inputs"]],
                              [(tuple(s), np.dtype(d)) for s, d in vm["outputs"]],
                              vm["kind"], [tuple(s) for s in vm["sites"]]))
    if not variants:
        raise ValueError(f"{path} is corrupt: no program in it")
    return Program(variants, None, False, False, target)


def _check_rows(path, rows, ins, outs, nops):
    n = rows.shape[0]
    if rows.ndim != 2 or rows.shape[1] != _prog.NCOL or not np.isfinite(rows[:, :4]).all():
        raise ValueError(f"{path} is corrupt: bad row table")
    ops = rows[:, 0]
    if (ops < 0).any() or (ops >= nops).any() or (ops != np.floor(ops)).any():
        raise ValueError(f"{path} is corrupt: bad opcodes")
    k = np.arange(n)[:, None]
    s = rows[:, 1:4]
    if ((s != -1) & ((s < 0) | (s >= k))).any():
        raise ValueError(f"{path} is corrupt: a row reads a slot that is not computed before it")
    for a in (ins, outs):
        if ((a < 0) | (a >= n)).any():
            raise ValueError(f"{path} is corrupt: input or output slots out of range")


def trace(fn, *example_inputs, retrace=False, strict=False, target="cpu"):
    """Record ``fn(*example_inputs)`` once and return a :class:`Program` that replays it.

    Parameters
    ----------
    fn : callable
        Takes tensors shaped like ``example_inputs``; returns a tensor, a number or a tuple.
    *example_inputs : ndarray, float or Tensor
        Inputs to trace at (floating point). The program takes inputs of these shapes.
    retrace : bool
        When a branch that depended on the inputs goes the other way at replay, trace
        ``fn`` again there and keep both variants (default: raise :class:`GuardError`).
    strict : bool
        Make values that leave the tape while tracing (``.item()``, ``float(t)``) errors
        instead of :class:`TraceWarning` s.
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
