"""``Program.buffer``: a one-sample call bound once to the caller's arrays (CasADi's
``Function.buffer()``), then run with no arguments."""
from __future__ import annotations

from functools import partial

import numpy as np

from ._program_code import _F64
from .interpreters import _bound
from .interpreters import replay_cpu as _cpu

_ND = np.ndarray


def _parts(arrays, specs, what, hint):
    """``arrays`` (one array, a tuple or list, or None) as a tuple, one per spec."""
    if arrays is None:
        return None
    parts = tuple(arrays) if isinstance(arrays, (tuple, list)) else (arrays,)
    if len(parts) != len(specs):
        raise ValueError(f"buffer: {what} takes {len(specs)} array(s) ({hint}), got "
                         f"{len(parts)}")
    return parts


def _check(a, shape, what, writable):
    """A bound array must be what the compiled entry reads or writes in place: a float64
    ndarray of exactly ``shape``, C-contiguous and aligned (and writable for results)."""
    if not isinstance(a, _ND):
        raise TypeError(f"buffer: {what} must be a NumPy array (float64 of shape "
                        f"{list(shape)}), got {type(a).__name__}")
    if a.dtype != _F64 or not a.dtype.isnative:
        raise TypeError(f"buffer: {what} has dtype {a.dtype}, but a bound array must be "
                        f"float64 in native byte order: bind np.empty({list(shape)})")
    if a.shape != tuple(shape):
        raise ValueError(f"buffer: {what} has shape {list(a.shape)}, but the program's "
                         f"{'input' if what.startswith('input') else 'result'} has shape "
                         f"{list(shape)} (np.empty({tuple(shape)}) is one)")
    if not (a.flags.c_contiguous and a.flags.aligned):
        raise ValueError(f"buffer: {what} is not C-contiguous (a strided view?): bind "
                         f"np.ascontiguousarray(...) of it, and read or write that one")
    if writable and not a.flags.writeable:
        raise ValueError(f"buffer: {what} is read-only: bind a writable array")


class Buffer:
    """A program's one-sample call bound to arrays the caller owns: made by
    :meth:`Program.buffer <tapegrad.replay.Program.buffer>`; calling it with no arguments
    runs the program at the inputs' current contents and writes the outputs into ``out``
    and the gradient into ``grad``. Returns None.

    Not thread-safe by design: the call runs in the buffers made for it, so a second thread
    calling the same ``Buffer`` while it runs raises ``RuntimeError`` (bind one per
    thread: separate ``Buffer`` s of one program run at once). A failed guard runs the other
    variants (or re-traces, with ``retrace=True``) as ``value_and_grad`` would, and raises
    ``GuardError`` with the arrays unchanged when none fits.
    """

    def __init__(self, program, inputs, out, grad):
        code = program._code
        if program._cuda is not None:
            raise ValueError("buffer: a bound call runs one sample on the CPU; this program's "
                             "target is 'cuda': use program.to('cpu').buffer(...)")
        if not code.all_f64:
            raise TypeError("buffer: bound arrays are float64, but this program has inputs "
                            "or outputs of other dtypes: call the program instead")
        if len(inputs) != len(code.inputs):
            raise TypeError(f"buffer: this program takes {len(code.inputs)} input(s), got "
                            f"{len(inputs)}")
        outs = _parts(out, code.outputs, "out", "one per output")
        grads = _parts(grad, code.inputs, "grad", "one per input")
        if outs is None and grads is None:
            raise ValueError("buffer: nothing to write: pass out= (arrays for the outputs) "
                             "or grad= (arrays for the gradient), or both")
        if grads is not None and len(code.out_slots) != 1:
            raise RuntimeError(f"buffer: grad= needs a scalar output; this program returns "
                               f"{len(code.out_slots)} values. Use program.vjp(xs, v) or "
                               f"program.jacobian(*xs)")
        for i, (a, (shape, _)) in enumerate(zip(inputs, code.inputs)):
            _check(a, shape, f"input {i}", False)
        results, names = [], []  # (array, offset in the entry's results), their names
        for i, (a, (shape, _), (_, o, _, _)) in enumerate(zip(outs or (), code.outputs,
                                                               code.out_layout)):
            names.append(f"out[{i}]" if len(code.outputs) > 1 else "out")
            _check(a, shape, names[-1], True)
            results.append((a, o))
        for i, (a, (_, o, _, _)) in enumerate(zip(grads or (), code.grad_layout)):
            names.append(f"grad[{i}]" if len(code.inputs) > 1 else "grad")
            _check(a, code.inputs[i][0], names[-1], True)
            results.append((a, o))
        # a result array that shares memory with another bound array would be overwritten
        # by the call, or change an input it reads: refused
        bound = [(f"input {i}", a) for i, a in enumerate(inputs)]
        for name, (a, _) in zip(names, results):
            for other, b in bound:
                if np.may_share_memory(a, b):
                    raise ValueError(f"buffer: {name} shares memory with {other}: bind "
                                     f"separate arrays")
            bound.append((name, a))
        self.program = program
        self.inputs = tuple(inputs)
        self.out = outs
        self.grad = grads
        self._results = tuple(results)
        self._grad = grads is not None
        # one token: a call takes it and puts it back (a list's pop is atomic under the GIL:
        # 30 ns a call, where a Lock's acquire and release took 200)
        self._tokens = [True]
        self._bind()

    def _bind(self):
        """``_entry``: the compiled entry with its rows, a ``work`` of its own with the
        arrays' addresses past its values and adjoints (``_bound``: the entry reads and
        writes them) and a results buffer, as one ``partial``; or, for programs whose entry
        does not read addresses (array instructions) or addresses a float cannot hold,
        ``_copying``, the same buffers filled and read in Python."""
        code = self.program._code
        if not code.arrays:
            # a loop's entry now: superinstructions, no tier of 64 calls; before
            # ``buffers``, which would compile (or load) the entry of rows as traced too
            # (1.5 s of a cold first bound call, 5.8 s in all, for an entry it never runs)
            code.tier_up()
        # a work of its own (never back in the program's pool); compiles or loads the entry
        work, _, views = code.buffers()
        addresses = [a.ctypes.data for a in self.inputs] + \
            [a.ctypes.data for a, _ in self._results]
        res = np.empty(code.res_size[self._grad])
        run, rows = code.run, code.frows
        # (without the JIT, NUMBA_DISABLE_JIT=1, the entry cannot read addresses either)
        if code.arrays or any(p >= _bound.MAX_ADDRESS for p in addresses) \
                or not hasattr(_cpu.run_bound, "compile"):
            self._views, self._res, self._work, self._run_rows = views, res, work, (run, rows)
            self._pairs = tuple((a.reshape(-1), res[o:o + a.size]) for a, o in self._results)
            self._entry = self._copying
            return
        desc = [len(self.inputs)]
        for a in self.inputs:
            desc += [a.ctypes.data, a.size]
        desc.append(len(self._results))
        for a, o in self._results:
            desc += [a.ctypes.data, a.size, o]
        work = np.concatenate([work, np.array(desc, dtype=np.float64)])
        # the entry that copies the bound arrays in and out: of the rows as traced, or of
        # superinstructions (``tier_up``)
        bound = _cpu.run_bound if rows is code.arows else _cpu.run_bound_fused
        self._entry = partial(_cpu.entry(rows, work, bound), rows, work, res)

    def _copying(self):
        """``_entry`` in Python: the inputs copied in, the entry, the results copied out
        when it succeeded; its status."""
        for view, a in zip(self._views, self.inputs):
            view[...] = a
        run, rows = self._run_rows
        status = run(rows, self._work, self._res)
        if not status:
            for a, r in self._pairs:
                a[...] = r
        return status

    def __call__(self):
        tokens = self._tokens
        try:
            token = tokens.pop()
        except IndexError:
            raise RuntimeError("buffer: this bound call is running in another thread; a "
                               "Buffer runs in one thread at a time: bind one per "
                               "thread") from None
        try:
            if self._entry():
                self._again()
        finally:
            tokens.append(token)

    def _again(self):
        """A guard failed in the first variant: the general path's answer (the other
        variants, a re-trace, or ``GuardError``) copied into the bound arrays."""
        prog = self.program
        xs = tuple(a.copy() for a in self.inputs)
        if self._grad:
            value, grad = prog.value_and_grad(*xs)
            got = ((value,) if prog._code.single_out else tuple(value)) + \
                ((grad,) if len(prog._code.inputs) == 1 else tuple(grad))
            got = got if self.out is not None else got[len(prog._code.outputs):]
        else:
            value = prog(*xs)
            got = (value,) if prog._code.single_out else tuple(value)
        for (a, _), g in zip(self._results, got):
            a[...] = g

    def __repr__(self):
        return (f"<tapegrad.Buffer of {self.program!r}: {len(self.inputs)} input(s), "
                f"{'outputs' if self.out is not None else 'no outputs'}"
                f"{', gradient' if self._grad else ''}>")
