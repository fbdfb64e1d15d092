"""A ``Program``'s derivatives: gradients, VJPs, Jacobians, Hessians, Hessian-vector
products and the gradient program."""
from __future__ import annotations

import numpy as np

from . import _notice
from ._program_code import _Code, _grad_code, _host, _hvp_of, _is_device, _wrap_one
from .interpreters import program as _prog
from .interpreters import program_arrays as _arr
from .interpreters import replay_cpu as _cpu
from .tensor import Tensor, _plain


def _hvp_value_code(code):
    """``code``'s Hessian-vector program of array instructions that keeps the value too, as
    a second output (built once; None where it cannot, then ``hvp`` runs the value apart):
    the Hessian-vector program's rows (``_hvp_code``'s, in their order) with the rows that
    only the value reads left in, so that one run gives both (kmeans' ``dir``: a forward
    of the cost, 0.2 ms, saved). Its results: (H.v's dot, value, the gradient, gradient
    in (x, v)): the gradient's slots are outputs too (seeded 0.0), for ``grad_and_hvp``. The
    value's instructions are flagged as ``mark_inactive`` flags those that pass no
    gradient (the reverse sweep skips them), and its scalar rows read only the value's
    slots, so the value's seed (1.0) reaches only the value's adjoints, which the
    product's rows never read: every number they compute is the Hessian-vector
    program's. Declined (None) for scalar rows (``_with_value`` keeps the value there)
    and where a value's scalar row reads another's slot."""
    c = code._derived.get("hvp_value")
    if c is not None:
        return c or None
    c = code._derived["hvp_value"] = _build_hvp_value(code) or False
    return c or None


def _build_hvp_value(code):
    h = _hvp_of(code)
    if not h.arrays or len(code.out_slots) != 1:
        return None
    from .ops.lowering import reduce  # (the Hessian-vector rows, as ``_hvp_code`` makes them)
    nin = len(code.in_slots)
    L = _prog.Builder()
    L._blocks.append(code.arows.copy())
    L.n = code.nslots
    vs = L.inputs(nin, (nin,))
    rows = L.rows()
    L2, grads = _prog.grad_rows(rows, code.out_slots, [1.0], code.in_slots)
    prods = L2.op("mul", np.array([int(g) for g in grads], dtype=np.int64), vs)
    dot = int(np.asarray(reduce(L2, "add", prods, None, False, 0.0)))
    rows = L2.rows()
    f = int(code.out_slots[0])
    g = np.array([int(s) for s in grads], dtype=np.int64)
    n1 = _prog.prune(rows, np.array([dot], dtype=np.int64))[1]
    p2, n2 = _prog.prune(rows, np.array([dot, f], dtype=np.int64))
    if (n1[g] < 0).any():  # (a gradient the product does not read: not kept as an output)
        return None
    # (cut as the Hessian-vector program is: the value's rows are dead to the product's
    # reverse sweep, which ran the rules of rows only they read at 0 * inf, ``cut_dead``)
    p2, cut = _prog.cut_dead(p2, n2[[dot]])
    if cut is not None:
        n2 = np.where(n2 >= 0, cut[np.maximum(n2, 0)], -1)
    ins = np.concatenate([code.in_slots, vs])
    w = _Code(p2, n2[ins], n2[np.concatenate([[dot, f], g])], h.inputs,
              [((), np.dtype(np.float64))] * 2 + list(code.inputs), "tuple", h.sites)
    if not w.arrays:
        return None
    # the gradient's slots are outputs too, seeded 0.0 (``grad_and_hvp`` reads them): the
    # product's reverse sweep adds to their adjoints what it added before (0.0 + 0.0 is
    # the zeroed adjoint's 0.0), so H v keeps its bits
    w.seeds = np.array([1.0, 1.0] + [0.0] * len(g))
    w.grad_out_layout = tuple((sh, o + 2, k, r) for sh, o, k, r in code.in_layout)
    r = w.arows
    at, ns = _arr.row_slots(r)
    only = np.zeros(ns, dtype=np.bool_)  # the slots that only the value reads
    only[n2[(n2 >= 0) & (n1 < 0)]] = True
    if not only[int(w.out_slots[1])] or only[int(w.out_slots[0])]:
        return None
    heads = _arr.heads_of(r)
    inst = np.zeros(r.shape[0], dtype=np.bool_)
    for j in range(_arr.META + 1):
        inst[heads + j] = True
    # the value's instructions flagged as ``mark_inactive`` flags those whose gradient
    # reaches no input: the reverse sweep skips them, and their adjoints are not zeroed
    mine = heads[only[at[heads].astype(np.int64)]]
    r[mine + _arr.META, 5] = 1.0
    for q in np.nonzero(~inst)[0].tolist():
        if only[int(at[q])]:
            ops = r[q, 1:4]
            ops = ops[ops >= 0].astype(np.int64)
            if not only[ops].all():
                return None
    return w


def _hvp_run(code):
    """``hvp``'s program of ``code`` for one sample: the one that keeps the value where it
    can be made (``_hvp_value_code``), else the Hessian-vector program; the choice kept
    (one lookup a call: Rosenbrock's Hessian-vector product takes 13 us)."""
    c = code._derived.get("hvp_run")
    if c is None:
        c = code._derived["hvp_run"] = _hvp_value_code(code) or _hvp_of(code)
    return c


class _Derivatives:
    """``Program``'s derivative methods (a base class of ``replay.Program``)."""

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
        r = self._one(xs, True)  # optimization loops: one sample, on the CPU
        if r is not None:
            return r
        if len(self._variants[0].out_slots) == 1:
            r = self._run_one(xs, True)
            if r is not None:
                code, res, _, as_tensor = r
                if not as_tensor:
                    return code.get_out(res), code.get_grad(res)
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
        if (code.kind != "tuple" and isinstance(v, tuple) and len(v) == 1
                and (isinstance(v[0], (np.ndarray, Tensor)) or _is_device(v[0]))):
            vs = v  # one output's cotangent in a 1-tuple, as torch.autograd.functional takes
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
        from .replay import Program  # (replay imports this module)
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
        xs = tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)
        vs = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        r = self._hvp_one(xs, vs)  # optimization loops: one sample, on the CPU
        if r is not None:
            return r
        self._scalar_check("hvp")
        nin = len(self._code.inputs)
        if len(xs) == len(vs) == nin:  # one sample on the CPU: exact shapes are checked
            r = self._run_one(xs + vs, True, _hvp_run)
            if r is not None:
                code, hres, x, as_tensor = r
                if code.seeds is not None:  # (``_hvp_value_code``: the value kept)
                    base = self._variants[0]
                    return (_wrap_one(hres[1:2], base.out_layout, as_tensor, base.single_out),
                            _wrap_one(hres, code.grad_layout[:nin], as_tensor, nin == 1))
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


    def grad_and_hvp(self, xs, v):
        """(value, gradient, Hessian-vector product) at ``xs`` with ``v`` (shaped like the
        inputs; tuples for several inputs): ``value_and_grad`` and ``hvp`` in one call, from
        one run of the Hessian-vector program where it keeps the value and the gradient
        (one sample of an array program on the CPU: the forward and the gradient that the
        product computes anyway, not run again); the two calls otherwise.

        Examples
        --------
        >>> import numpy as np, tapegrad
        >>> prog = tapegrad.trace(lambda x: (x * x * x).sum(), np.ones(2))
        >>> value, g, hv = prog.grad_and_hvp(np.array([1.0, 2.0]), np.ones(2))
        >>> float(value), g, hv
        (9.0, array([ 3., 12.]), array([ 6., 12.]))
        """
        xs = tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)
        vs = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        nin = len(self._code.inputs)
        if len(xs) == len(vs) == nin and len(self._code.out_slots) == 1:
            r = self._run_one(xs + vs, True, _hvp_run)
            if r is not None and r[0].seeds is not None:
                code, res, _, as_tensor = r
                base = self._variants[0]  # (every variant's layout of the value)
                return (_wrap_one(res[1:2], base.out_layout, as_tensor, base.single_out),
                        _wrap_one(res, code.grad_out_layout, as_tensor, nin == 1),
                        _wrap_one(res, code.grad_layout[:nin], as_tensor, nin == 1))
        value, g = self.value_and_grad(*xs)
        return (value, g) + (self.hvp(xs, vs)[1],)
