"""How a ``Program`` runs: its inputs checked and flattened, the CPU, parallel or CUDA
interpreter chosen, and the variants tried when a guard fails."""
from __future__ import annotations

from math import prod

import numpy as np

from . import _notice
from ._program_code import _F64, _flat_one, _host, _hvp_of, _is_device
from ._program_code import one_consts as _one_consts, with_args as _with_args
from ._trace import GuardError, _trace_code
from .interpreters import replay_cpu as _cpu
from .tensor import Tensor, _plain

_ND, _empty, _count_nonzero = np.ndarray, np.empty, np.count_nonzero
_NO_X = _cpu.NO_X


def _same_code(code):
    """``_run``'s ``select`` of the code itself."""
    return code


def _fast_grad(code):
    """How many inputs ``Program._one`` takes with the gradient (-1: none)."""
    consts = code._one_consts
    return (consts if consts is not None else _one_consts(code))[1][0]


def _args_entry(code, rows, work):
    """``code.args``' entry (``replay_cpu.run_args`` for its arrays), compiled or loaded from
    Numba's cache at its first call rather than at the tier-up: a program bound to arrays
    (``Program.buffer``) or a Hessian-vector program's (``hvp``) tiers up too, and never
    calls it (about 1 s of cold compile)."""
    if "args" in _notice.PENDING:  # a cold cache compiles it for about a second: say so
        _notice.announce("args")
    entry = _cpu.entry_args(rows, work, rows is not code.arows)
    code._one_consts = _with_args(code._one_consts, (entry, rows))
    return entry


ONES_KEPT = 1 << 16  # seeds a program keeps for its batches (``_batch``): 512 KB at most


class _Running:
    """``Program``'s methods that run its code (a base class of ``replay.Program``)."""

    # -- inputs and outputs -----------------------------------------------------------------
    def _inputs(self, xs, code=None, rows_major=False):
        """Flat float64 inputs: (x (nin,), None) for one sample or (X (nin, B), B); with
        ``rows_major`` on the host, ``X`` is the transpose of a C-contiguous (B, nin) array
        (what the CPU batch runs on: no copy of the inputs' layout)."""
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
                if b == 0:
                    raise ValueError(f"input {i} is an empty batch (shape {list(x.shape)}): "
                                     f"pass at least one sample")
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
        elif rows_major:  # one float64 input is read where it is (the batch only reads it)
            flat = np.ascontiguousarray(np.concatenate(
                [a.reshape(batch, -1) for a in arrs], axis=1) if len(arrs) > 1 else
                arrs[0].reshape(batch, -1), dtype=np.float64).T \
                if arrs else np.zeros((batch, 0)).T
        else:
            flat = np.ascontiguousarray(np.concatenate(
                [a.reshape(batch, -1) for a in arrs], axis=1).T, dtype=np.float64) \
                if arrs else np.zeros((0, batch))
        return flat, batch, as_tensor

    def _wrap(self, flat, specs, batch, as_tensor, kind):
        """Split flat results into arrays shaped by ``specs``."""
        out, i = [], 0
        for shape, dtype in specs:
            m = prod(shape)  # (np.prod of a tuple: 2 to 5 us, a fifth of a small batch)
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
            key = "arrays" if code.arrays else "replay"
            if key in _notice.PENDING:
                _notice.announce(key)
            return code.run_fresh(x, seeds, grad)
        # one block has nothing to spread over the cores, and starting the threads costs
        # more than the block (tens of ms on a busy machine): it runs serially, as does a
        # batch of less work than a worker's start can pay for (``PARALLEL_WORK``)
        parallel = self.target == "parallel" and batch > self.block \
            and batch * code.rows.shape[0] >= _cpu.PARALLEL_WORK
        if _notice.PENDING:
            _notice.announce("parallel" if parallel else "batch")
        fn = _cpu.run_parallel if parallel else _cpu.run_batch
        # the batch runs on samples in rows: x and seeds (nin or nout, B) are transposed
        # views of such arrays when they come from _inputs and _run (no copy), and the
        # results go back as views too (transposing 256 x 1,000 inputs in and gradients out
        # took a quarter of an n=1000 Rosenbrock batch, and serial time from the cores)
        status, outs, G = fn(code.rows, np.ascontiguousarray(x.T), code.out_slots,
                             np.ascontiguousarray(seeds.T), code.in_slots, grad, self.block)
        return status, outs.T, G.T

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

    def _one(self, xs, grad):
        """An optimization loop's call in the fewest Python steps: the outputs, or with
        ``grad`` (value, gradient), of one sample of float64 ndarrays of exactly the traced
        shapes on the CPU, as ``_run`` and ``_wrap`` give them (fresh arrays), or of a batch
        of them (``_batch``); None for other inputs (``_run_one`` or the general path takes
        them, or says what is wrong),
        and when a guard failed in every variant (``_run`` says which, or re-traces).
        Measured: the steps of a call of 3 inputs cost 0.1 to 0.25 us each; the code's
        constants of this call come in one tuple (``_one_consts``: one attribute read)."""
        code = self._variants[0]
        consts = code._one_consts
        if consts is None:  # (a program pickled before it)
            consts = code._one_consts = _one_consts(code)
        n, shapes, size, get, get2, args = consts[grad]
        if len(xs) != n or self._cuda is not None:
            return None
        free = code._free
        if free:
            buf = free.pop()
        else:
            # the first call (or threads at once): the buffers compile the one-sample entry,
            # which a batch's call must not do (seconds of a cold first batch)
            if code.run is None and any(x.__class__ is not _ND or x.shape != s
                                        for x, s in zip(xs, shapes)):
                return self._batch(code, xs, grad)
            buf = code.buffers()
        try:
            if args is not None:
                # a few small 1-D inputs (``replay_cpu.takes_args``), after the tier-up:
                # passed to the entry as they are, which copies them into its buffer
                # (``run_args``: 0.13 us an input cheaper than the copy below); each count
                # of inputs checked without a loop (90 ns of a call of three)
                if n == 1:
                    x0 = xs[0]
                    if x0.__class__ is not _ND or x0.dtype is not _F64 or x0.shape != shapes[0]:
                        return self._batch(code, xs, grad)  # a batch, or the general path
                    x1 = x2 = _NO_X
                elif n == 2:
                    x0, x1 = xs
                    if x0.__class__ is not _ND or x1.__class__ is not _ND \
                            or x0.dtype is not _F64 or x1.dtype is not _F64 \
                            or (x0.shape, x1.shape) != shapes:
                        return self._batch(code, xs, grad)
                    x2 = _NO_X
                else:
                    x0, x1, x2 = xs
                    if x0.__class__ is not _ND or x1.__class__ is not _ND \
                            or x2.__class__ is not _ND or x0.dtype is not _F64 \
                            or x1.dtype is not _F64 or x2.dtype is not _F64 \
                            or (x0.shape, x1.shape, x2.shape) != shapes:
                        return self._batch(code, xs, grad)
                res = _empty(size)
                entry, rows = args
                if entry is None:  # its first call: compiled (or loaded) now
                    entry = _args_entry(code, rows, buf[0])
                status = entry(rows, buf[0], res, x0, x1, x2)
            else:
                views = buf[2]
                if n == 1:  # one input: no loop (60 ns of a call)
                    x = xs[0]
                    # another float64 dtype object (byte order, metadata) takes the general
                    # path
                    if x.__class__ is not _ND or x.dtype is not _F64 or x.shape != shapes[0]:
                        return self._batch(code, xs, grad)  # a batch, or the general path
                    views[0][...] = x  # into the entry's buffer: strided inputs too
                else:
                    # indexing two tuples: 40 ns an input cheaper than a zip of three
                    i = 0
                    for x in xs:
                        if x.__class__ is not _ND or x.dtype is not _F64 \
                                or x.shape != shapes[i]:
                            return self._batch(code, xs, grad)
                        views[i][...] = x
                        i += 1
                res = _empty(size)
                status = code.run(code.frows, buf[0], res)
            if status:  # a guard failed: the other variants (the inputs are in buf[1])
                if status < 0:
                    raise RuntimeError("tapegrad: the inputs' sizes did not add up in the "
                                       "one-sample entry (a bug: please report it)")
                for c in self._variants[1:]:
                    status, res = c.run1(buf[1], grad)
                    if status == 0:
                        break  # (the results' layout is every variant's: the same getters)
                else:
                    return None
        finally:
            free.append(buf)
        if get is not None:
            return get(res)
        return get2[0](res), get2[1](res)

    def _hvp_one(self, xs, vs):
        """``hvp``'s optimization-loop call: (value, H v) of one sample of float64 ndarrays
        of exactly the traced shapes on the CPU, as the general path gives them (a fresh
        H v), from one run of the Hessian-vector program that keeps the value
        (``_program_code._with_value``; 13.2 us at n=100 Rosenbrock, CPU time, where a
        second run of the program gave the value and ``_run_one`` took the inputs, 10.4 us
        with that run on a fast path, now 9.8 to 10). None for other inputs, a failed guard (the
        general path then tries the variants, raises or re-traces), or a Hessian-vector
        program with array instructions; the first call builds it."""
        code = self._variants[0]
        n = len(code.in_shapes)
        if len(xs) != n or len(vs) != n or _fast_grad(code) < 0 or self._cuda is not None:
            return None
        h = (code._derived.get("hvp") or _hvp_of(code)).with_value
        if h is None:
            return None
        free = h._free
        buf = free.pop() if free else h.buffers()
        try:
            shapes, views, i = code.in_shapes, buf[2], 0
            for x in xs + vs:  # (v's shapes are x's)
                if x.__class__ is not _ND or x.dtype is not _F64 or x.shape != shapes[i % n]:
                    return None
                views[i][...] = x
                i += 1
            res = _empty(h.res_size[True])
            if h.run(h.frows, buf[0], res):
                return None
            value = buf[0][h.value_at]  # (a NumPy float: a copy)
        finally:
            free.append(buf)
        value = value if code.outputs[0][0] == () else np.full(code.outputs[0][0], value)
        # a function that returned ``(y,)``: the value as the general path gives it
        return (value if code.single_out else (value,)), h.get_hv(res)

    def _batch(self, code, xs, grad):
        """``_one`` of a batch on the CPU: what the general path (``_run``, ``_wrap``) gives
        for float64 ndarrays that all have one leading batch axis of the same size ``B`` over
        the traced shapes, without its one-sample attempts (``_run_one``: 1.5 us), input
        checks (1.7 us) and seeds (0.9 us) on each call; None for other inputs. Samples that
        fail a guard go on as in ``_run`` (``_patch``). ``code`` is ``self._variants[0]``
        and takes ``len(xs)`` inputs (``_one`` checked both)."""
        if code.single_in:  # (one input: no loop, 0.3 us of a call)
            x, shape = xs[0], code.in_shapes[0]
            if x.__class__ is not _ND or x.dtype is not _F64 or x.ndim != len(shape) + 1 \
                    or x.shape[1:] != shape or not x.shape[0]:
                return None  # an empty batch or a wrong input: the general path's answer
            B = x.shape[0]
            X = np.ascontiguousarray(x.reshape(B, -1))  # read where it is when C-contiguous
        else:
            B = None
            for x, shape in zip(xs, code.in_shapes):
                if x.__class__ is not _ND or x.dtype is not _F64 or x.ndim != len(shape) + 1 \
                        or x.shape[1:] != shape or B is not None and x.shape[0] != B:
                    return None
                B = x.shape[0]
            if not B:
                return None
            X = np.concatenate([x.reshape(B, -1) for x in xs], axis=1)
        rows = code.rows
        parallel = self.target == "parallel" and B > self.block \
            and B * rows.shape[0] >= _cpu.PARALLEL_WORK
        key = "parallel" if parallel else "batch"
        if key in _notice.PENDING:  # a cold cache compiles for seconds: say so, once
            _notice.announce(key)
        # the seeds (all ones) of this program's batches, kept per program and only read
        S = code._ones
        if S is None or S.shape[0] < B:
            S = np.ones((B, len(code.out_slots)))
            if S.size <= ONES_KEPT:
                code._ones = S
        fn = _cpu.run_parallel if parallel else _cpu.run_batch
        status, outs, G = fn(rows, X, code.out_slots, S[:B], code.in_slots, grad, self.block)
        if _count_nonzero(status):  # (np.any: 1.1 us, this 0.2) the samples that failed a
            # guard: the other variants, as ``_run`` does (results in samples x values)
            code, outs, G, _, _ = self._patch(code, xs, X.T, S[:B].T, status, outs.T, G.T,
                                              B, False, grad, _same_code)
            outs, G = outs.T, G.T
        # as ``_wrap`` splits them: fresh C-contiguous arrays, views of ``outs`` and ``G``
        # where a result is all of their columns
        if code.single_out:
            value = outs.reshape((B,) + code.outputs[0][0])
        else:
            value = tuple(np.ascontiguousarray(outs[:, o:o + m].reshape((B,) + sh))
                          for sh, o, m, _ in code.out_layout)
        if not grad:
            return value
        if code.single_in:
            return value, G.reshape((B,) + shape)
        return value, tuple(np.ascontiguousarray(G[:, o:o + m].reshape((B,) + sh))
                            for sh, o, m, _ in code.in_layout)

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
        if code.run is None:  # the buffers compile the one-sample entry: not for a batch
            flat = np.empty(code.n_in)
            if _flat_one(code, xs, tuple(flat[o:o + k].reshape(sh)
                                         for sh, o, k, _ in code.in_layout)) is None:
                return None
        buf = code.buffers()
        try:
            as_tensor = _flat_one(code, xs, buf[2])
            if as_tensor is None:
                return None
            x = buf[1]
            res = np.empty(code.res_size[grad])
            if code.run(code.frows, buf[0], res) == 0:
                return code, res, None if select is None else x.copy(), as_tensor
            for variant in self._variants[1:]:
                c = variant if select is None else select(variant)
                status, res = c.run1(x, grad)
                if status == 0:
                    return c, res, None if select is None else x.copy(), as_tensor
            return None
        finally:
            code._free.append(buf)

    def _run(self, xs, seeds=None, grad=False, select=lambda c: c):
        """Run the right variant; returns (code, outs, grads, batch, as_tensor)."""
        base = select(self._code)
        x, batch, as_tensor = self._inputs(xs, base, rows_major=self._cuda is None)
        nout = len(base.out_slots)
        if seeds is None:
            seeds = np.ones(nout) if batch is None else np.ones((batch, nout)).T
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
        return self._patch(code, xs, x, seeds, status, outs, grads, batch, as_tensor, grad,
                           select)

    def _patch(self, code, xs, x, seeds, status, outs, grads, batch, as_tensor, grad, select):
        """``_run``'s end for a batch that ran with the first variant ``code``: the samples
        whose guards failed run in the other variants (into ``outs`` and ``grads``, inputs x
        samples like ``x`` and ``seeds``), or ``_no_variant`` raises or adds one and the
        batch runs again."""
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
                st, o, g = c.run_fresh(xb, sb, grad)
                if st == 0:
                    outs[:, b], grads[:, b] = o, g
                    break
            else:  # re-traced at this sample (or raised): its variant runs it, and the
                # loop goes on (running the batch again recursed once per such sample: a
                # RecursionError for a batch of thousands of distinct float() guards)
                self._no_variant(code, int(status[b]) - 1, [_host(a)[b] for a in xs],
                                 sample=b)
                st, o, g = select(self._variants[-1]).run_fresh(xb, sb, grad)
                if st != 0:
                    raise GuardError(f"sample {b} of the batch fails the guards of the "
                                     "program re-traced at it: the traced function does "
                                     "not trace the same way twice at one input")
                outs[:, b], grads[:, b] = o, g
        if outs_dev:
            outs, grads = self._cuda.to_device(outs), self._cuda.to_device(grads)
        return code, outs, grads, batch, as_tensor

    def _no_variant(self, code, row, xs, sample=None):
        """A guard failed in every variant: re-trace (retrace=True) or raise GuardError."""
        site = int(code.rows[row, 5])
        f, line, text, taken = code.sites[site]
        where = "" if sample is None else f" for sample {sample} of the batch"
        if self.retrace and self._fn is not None:
            # the function's own inputs: a derived program's (hvp's) come after them
            examples = [x.detach() if isinstance(x, Tensor) else x
                        for x in xs[:len(self._code.inputs)]]
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
