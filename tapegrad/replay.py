"""``trace(fn, *example_inputs) -> Program``: record once, replay forward and backward at new
inputs in compiled code, with guards on the branches that tracing saw."""
from __future__ import annotations

import json

import numpy as np

from ._program_code import (  # noqa: F401  (names others import from here)
    _F64, _Code, _flat_one, _grad_code, _host, _hvp_code, _hvp_of, _is_device, _keys,
    _layout, _pick, _program_vjp_np, _program_vjp_tensor, _seed_matrix, _vjp_code, _wrap_one,
    cuda_module, program_vjp)
from ._program_buffer import Buffer
from ._program_derivs import _Derivatives
from ._program_run import _Running
from ._trace import (  # noqa: F401  (names others import from here)
    GuardError, TraceWarning, _collect_tapes, _example, _site, _stacklevel, _Trace,
    _trace_code)
from .interpreters import replay_cpu as _cpu
from .tape import STATE
from .tensor import Tensor, tensor

__all__ = ["trace", "Program", "GuardError", "TraceWarning", "load"]

FORMAT = "tapegrad-program"
FORMAT_VERSION = 1
TARGETS = ("cpu", "parallel", "cuda")


# --- the program ------------------------------------------------------------------------------
# ``Program``'s methods live in two base classes by what they do: ``_program_run._Running``
# (inputs, interpreters, guards and variants) and ``_program_derivs._Derivatives`` (gradients,
# Jacobians, Hessians); the class, its calls and its file format stay here, so that pickles
# and ``isinstance`` checks name ``tapegrad.replay.Program``.


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
    rows = max(1, variants[0].nslots)
    block = _cpu.BLOCK
    while block > 16 and rows * block * 16 > BLOCK_BYTES:
        block //= 2
    return block


class Program(_Running, _Derivatives):
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
        return self._code.nslots  # the scalar rows' count, without expanding them

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


    # -- public API -------------------------------------------------------------------------
    def __call__(self, *xs):
        """The traced function's outputs at ``xs``. Called on tensors that require grad
        (with grad mode on), the call is recorded on their tape as one entry: gradients,
        batched gradients and create_graph flow through it like through any op."""
        r = self._one(xs, False)  # plain ndarrays only: never a tensor to record on
        if r is not None:
            return r
        if STATE.grad_enabled:
            for x in xs:
                if isinstance(x, Tensor) and x._rg:
                    return self._call_recorded(xs)
        r = self._run_one(xs, False)
        if r is not None:
            code, res, _, as_tensor = r
            return _wrap_one(res, code.out_layout, as_tensor, code.single_out)
        code, outs, _, batch, as_tensor = self._run(xs)
        return self._wrap(outs, code.outputs, batch, as_tensor, code.kind)

    def buffer(self, *inputs, out=None, grad=None):
        """A one-sample call bound once to arrays you own, run with no arguments: CasADi's
        ``Function.buffer()``, for loops that evaluate thousands of times (torch has no
        such call). Each call of the returned :class:`~tapegrad._program_buffer.Buffer`
        runs the program at the current contents of ``inputs`` and writes its outputs into
        ``out`` and its gradient into ``grad``, in compiled code with no checks, copies or
        fresh arrays per call (0.2 to 0.3 us of Python, where ``value_and_grad`` takes 1.3
        us or more: see docs/fast-loops.md).

        Parameters
        ----------
        *inputs : ndarray
            One float64, C-contiguous array of the traced shape per input: read at every
            call (change their contents in place, not the variables).
        out : ndarray or tuple of ndarray, optional
            Arrays shaped like the outputs, written at every call.
        grad : ndarray or tuple of ndarray, optional
            Arrays shaped like the inputs for the gradient (scalar outputs only); without
            it the call runs forward only.

        Every bound array is checked here, once: float64 in native byte order (else
        TypeError), the traced shape, C-contiguous, and the results writable and sharing
        no memory with any other bound array (else ValueError). The call keeps them alive
        and writes only the results, only when it succeeds: a failed guard runs the other
        variants (or re-traces with ``retrace=True``) as ``value_and_grad`` does, and
        raises :class:`GuardError` with the results unchanged when none fits. One
        ``Buffer`` runs in one thread at a time (a second thread's call raises
        RuntimeError): bind one per thread.

        Examples
        --------
        >>> import numpy as np, tapegrad
        >>> prog = tapegrad.trace(lambda x: (x * x).sum(), np.ones(3))
        >>> x, f, g = np.array([1.0, 2.0, 3.0]), np.empty(()), np.empty(3)
        >>> step = prog.buffer(x, out=f, grad=g)
        >>> step()
        >>> float(f), g
        (14.0, array([2., 4., 6.]))
        >>> x -= 0.25 * g   # in place: the next call reads it
        >>> step()
        >>> float(f)
        3.5
        """
        return Buffer(self, inputs, out, grad)

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
