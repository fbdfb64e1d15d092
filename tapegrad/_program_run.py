"""How a ``Program`` runs: its inputs checked and flattened, the CPU, parallel or CUDA
interpreter chosen, and the variants tried when a guard fails."""
from __future__ import annotations

import numpy as np

from . import _notice
from ._program_code import _F64, _flat_one, _host, _is_device
from ._trace import GuardError, _trace_code
from .interpreters import replay_cpu as _cpu
from .tensor import Tensor, _plain


class _Running:
    """``Program``'s methods that run its code (a base class of ``replay.Program``)."""

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
            return code.run_fresh(x, seeds, grad)
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
            status, res = c.run1(x, grad)
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
                status, res = c.run1(x, grad)
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
                st, o, g = c.run_fresh(xb, sb, grad)
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
