"""A traced program's code (``_Code``: rows, input and output layout), the derivative
programs built from it, and the rule of a ``program`` entry on the eager tape."""
from __future__ import annotations

import threading
from functools import partial
from operator import itemgetter

import numpy as np

from . import _notice
from .interpreters import program as _prog
from .interpreters import program_arrays as _arr
from .interpreters import replay_cpu as _cpu
from .interpreters import fuse as _fusion
from .interpreters.fuse import fuse as _fuse
from .tensor import Tensor, _plain, tensor

_F64 = np.dtype(np.float64)


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


def _layout(specs):
    """(shape, offset, size, rank) of each (shape, dtype) in a flat vector of their
    elements."""
    out, o = [], 0
    for shape, _ in specs:
        m = int(np.prod(shape))
        out.append((tuple(shape), o, m, len(shape)))
        o += m
    return tuple(out)


def _flat_one(code, xs, views):
    """Copy one sample's inputs into ``views`` (of the flat inputs, shaped like each input)
    when every input is a float64 ndarray, Tensor or float of exactly its traced shape (an
    optimization loop's call); returns whether any was a Tensor, or None for other inputs:
    ``Program._inputs`` then checks them and says what is wrong."""
    shapes = code.in_shapes
    if len(xs) != len(shapes) or not code.all_f64:
        return None
    as_tensor = False
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
        view[...] = x  # into the entry's buffer: cheaper than np.concatenate of the inputs
    return as_tensor


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


def _getter(keys, layout, single):
    """A function of flat results giving ``_wrap_one(flat, layout, False, single)``: an
    ``itemgetter`` of the keys (0.23 us for three vectors, ``_pick`` 0.53), or
    ``_wrap_one`` itself for results that need a reshape (picklable, as programs are)."""
    if keys is not None and (single or len(keys) > 1):
        return itemgetter(*keys)
    return partial(_wrap_one, layout=layout, as_tensor=False, single=single)


class _Code:
    """One traced variant: rows, input and output layout, guard sites."""

    # (pickles of programs made before these attributes: the two getters, and the rows
    # worked out with ``run``)
    frows = None
    get_vg = None
    # the seeds (ones, B x outputs) of ``Program._batch``'s largest batch so far, up to
    # ``_program_run.ONES_KEPT`` elements: a batch reads its first rows, never writes them
    _ones = None
    # a Hessian-vector program's (``_hvp_code``): the getter of H v in its results, the
    # program that also keeps the value (``_with_value``) and, in that one, the value's
    # place in its ``work``
    get_hv = None
    with_value = None
    value_at = None
    # (a pickle of a program made before ``_one_consts``: worked out at its first call)
    _one_consts = None
    # the one-sample calls' seeds of the outputs where not all ones, and the layout of the
    # gradient among the outputs: the Hessian-vector program that keeps the value and the
    # gradient (``_program_derivs._hvp_value_code``: the gradient seeded 0.0)
    seeds = None
    grad_out_layout = None

    def __init__(self, rows, in_slots, out_slots, inputs, outputs, kind, sites):
        # ``arows``: the rows as traced, with array instructions (interpreters/
        # program_arrays.py) when ``arrays``; ``rows``: their scalar rows, slot for slot,
        # for the interpreters that run scalar rows only (batches, Jacobians, CUDA)
        self.arows = np.ascontiguousarray(rows, dtype=np.float64)
        self.arrays = _arr.has_arrays(self.arows)
        if self.arrays and _arr.coverage(self.arows) < _arr.MIN_COVER:
            # mostly scalar rows: the scalar interpreters run them faster (MIN_COVER says)
            self.arows, self.arrays = _arr.expand(self.arows), False
        self._rows = None if self.arrays else self.arows
        # the values' count: the rows' count without array instructions
        self.nslots = _arr.row_slots(self.arows)[1] if self.arrays else self.arows.shape[0]
        if self.arrays:
            _arr.mark_inactive(self.arows, self.nslots, _arr.GRAD_BITS, _arr.LEAF)
        self.in_slots = np.ascontiguousarray(in_slots, dtype=np.int64)
        self.out_slots = np.ascontiguousarray(out_slots, dtype=np.int64)
        self.inputs = inputs      # [(shape, dtype)]
        self.outputs = outputs    # [(shape, dtype)]
        self.kind = kind          # "single" or "tuple"
        self.sites = sites        # [(file, line, text, taken)]
        self._derived = {}
        # (shape, offset, size) of each input and output in the flat vectors: worked out
        # once for the calls' fast paths (``_one``, ``_run_one``)
        self.in_layout = _layout(inputs)
        self.out_layout = _layout(outputs)
        self.n_in = sum(m for _, _, m, _ in self.in_layout)
        self.single_out = kind == "single"
        self.single_in = len(inputs) == 1
        self.all_f64 = all(d == _F64 for _, d in inputs + outputs)
        # the one-sample calls' entry (``replay_cpu.run_into``): the gradient's layout in
        # its results, and buffers reused across calls
        self.in_shapes = tuple(tuple(sh) for sh, _ in inputs)
        m = len(self.out_slots)
        self.grad_layout = tuple((sh, o + m, k, r) for sh, o, k, r in self.in_layout)
        self.out_keys = _keys(self.out_layout)
        self.grad_keys = _keys(self.grad_layout)
        # the results' size without and with the gradient (``run_into`` sweeps back when
        # there is room), and the functions that take the outputs and the gradient out of
        # them (``operator.itemgetter``: one C call, 0.23 us for three vectors, a Python
        # loop over the keys 0.53)
        self.res_size = (m, m + len(self.in_slots))
        self.get_out = _getter(self.out_keys, self.out_layout, self.single_out)
        self.get_grad = _getter(self.grad_keys, self.grad_layout, self.single_in)
        # (value, gradient) of value_and_grad's results: one ``itemgetter`` of both keys where
        # the value is one result and the gradient one input of rank 0 or 1 (45 ns a call
        # less than the two getters); None otherwise (the two getters then)
        self.get_vg = itemgetter(self.out_keys[0], self.grad_keys[0]) if (
            self.single_out and self.single_in and self.out_keys is not None
            and self.grad_keys is not None) else None
        self._one_consts = one_consts(self)
        self._free = []
        self.run = None  # ``replay_cpu.run_into`` for this program's arrays, set by buffers()
        # the rows ``run`` runs, set with it: ``arows``, and after ``fuse.TIER`` one-sample
        # calls (``tier_up``) scalar rows with superinstructions (``interpreters/fuse.py``:
        # ``run`` is then ``replay_cpu.run_fused``, the only interpreter that knows them)
        self.frows = None

    @property
    def args(self):
        """``Program._one``'s entry after the tier-up, for a few small 1-D inputs
        (``replay_cpu.takes_args``): (``run_args`` for this program's arrays, or None until
        the first call that runs it, the rows it runs), or None."""
        consts = self._one_consts
        return None if consts is None else consts[0][5]

    @property
    def rows(self):
        """The scalar rows (array instructions expanded on first use)."""
        r = self._rows
        if r is None:
            r = self._rows = _arr.expand(self.arows)
        return r

    def run_fresh(self, x, seeds, grad):
        """``replay_cpu.run_fresh`` of this code: (status, outputs, gradients)."""
        if self.arrays:
            return _arr.run_fresh(self.arows, self.nslots, x, self.out_slots, seeds,
                                  self.in_slots, grad)
        return _cpu.run_fresh(self.rows, x, self.out_slots, seeds, self.in_slots, grad)

    def buffers(self):
        """A free (work, flat inputs, views of them shaped like each input) of the one-sample
        calls: ``work`` is ``replay_cpu.run_into``'s, and the flat inputs are its inputs'
        part. A call pops one from ``_free`` and puts it back when done, so threads never
        share one (the compiled entry releases the GIL); only the results are new."""
        free = self._free
        if free:
            return free.pop()
        key = "arrays" if self.arrays else "replay"
        if key in _notice.PENDING:  # a cold cache compiles for seconds: say so, once
            _notice.announce(key)
        work = _cpu.new_work(self.nslots, self.out_slots, self.in_slots, self.n_in)
        if self.seeds is not None:
            work[_cpu.HEADER:_cpu.HEADER + len(self.out_slots)] = self.seeds
        if self.run is None:  # (array instructions: their interpreter, on ``arows``)
            if self.arrays:
                self.frows = self.arows
                self.run = _arr.entry(self.frows, work)
            elif _fusion.TIER <= 0:
                self.tier_up(work)
            else:  # the rows as traced until ``fuse.TIER`` calls: then superinstructions
                self.frows = self.arows
                self.run = _tiered(self, _cpu.entry(self.arows, work))
        start = _cpu.HEADER + 2 * len(self.out_slots) + len(self.in_slots)
        flat = work[start:start + self.n_in]
        views = tuple(flat[o:o + k].reshape(sh) for sh, o, k, _ in self.in_layout)
        return work, flat, views

    def tier_up(self, work=None):
        """Form the superinstructions of the scalar rows now (``fuse.fuse``) and set ``run``
        to the entry that runs them (``replay_cpu.run_fused``, compiled or loaded from the
        cache now), or to ``run_into`` when too few rows pair up: what a program's one-sample
        calls switch to after ``fuse.TIER`` calls of the rows as traced. ``run`` is set
        before ``frows``, so a thread that reads both between the two sees ``run_fused`` with
        the rows as traced (which it runs too: the same numbers), never ``run_into`` with
        fused rows (which it does not know). For a few small 1-D inputs it also sets
        ``args``, the entry that takes them as arguments (``replay_cpu.run_args``)."""
        if self.arrays or self.frows is not None and self.frows is not self.arows:
            return
        if work is None:
            work = _cpu.new_work(self.nslots, self.out_slots, self.in_slots, self.n_in)
        frows = _fuse(self.arows, outs=self.out_slots)
        if frows is self.arows:
            run = _cpu.entry(self.arows, work)
        else:  # superinstructions run in their own entry
            if "fused" in _notice.PENDING:  # a cold cache compiles it for seconds: say so
                _notice.announce("fused")
            run = _cpu.entry(frows, work, _cpu.run_fused)
        self.run = run
        self.frows = frows
        if self.all_f64 and _cpu.takes_args(self.in_shapes):
            # (compiled at ``Program._one``'s first use of it)
            self._one_consts = with_args(self._one_consts or one_consts(self), (None, frows))

    def run1(self, x, grad):
        """(status, fresh results: outputs then gradient) of one sample ``x``."""
        buf = self.buffers()
        buf[1][...] = x
        res = np.empty(self.res_size[grad])
        status = self.run(self.frows, buf[0], res)
        self._free.append(buf)
        return status, res

    def __getstate__(self):
        state = self.__dict__.copy()
        # the one-sample calls' buffers and entry (compiled code) are made again when needed
        state["_free"], state["run"], state["frows"] = [], None, None
        if state.get("_one_consts") is not None:  # (not its entry of arguments)
            state["_one_consts"] = with_args(state["_one_consts"], None)
        state.pop("_ones", None)
        return state

    def derived(self, key, build):
        c = self._derived.get(key)
        if c is None:
            c = self._derived[key] = build()
        return c


def one_consts(code):
    """``code._one_consts``: ``Program._one``'s constants without and with the gradient,
    each (the number of float64 ndarrays it takes (-1: none, when the program has an input
    or output of another dtype, or for value_and_grad of several outputs, which the general
    path refuses), their shapes, the results' size, the getter of the results or None,
    (the getter of the outputs, of the gradient), and the entry of arguments (``_Code.args``;
    None until the tier-up): in each, as the call unpacks them (a read of it apart cost 20
    to 30 ns of every call). One attribute: a 30th attribute of a ``_Code``
    would make each of its attribute reads slower (Python 3.11 keeps 29 in the instance's
    own values: 10 reads took 95 ns with 29 attributes, 109 with 30)."""
    nf = len(code.inputs) if code.all_f64 else -1
    get_vg = code.get_vg
    return ((nf, code.in_shapes, code.res_size[0], code.get_out, None, None),
            (nf if len(code.out_slots) == 1 else -1, code.in_shapes, code.res_size[1], get_vg,
             None if get_vg is not None else (code.get_out, code.get_grad), None))


def with_args(consts, args):
    """``consts`` (``one_consts``) with the entry of arguments ``args``."""
    return tuple(c[:5] + (args,) for c in consts)


def _tiered(code, plain):
    """``code.run`` for its first ``fuse.TIER`` one-sample calls: ``plain`` (``run_into``
    for ``code.arows``) on the rows as traced, whatever rows it is given (a caller may have
    read ``code.frows`` after the switch); the call after them switches ``code`` to its
    superinstructions (``code.tier_up``) and runs them. One thread switches while the others
    go on with ``plain`` (they do not wait for the compile); a caller that read this
    function before the switch is sent to the new entry."""
    rows, calls, lock = code.arows, [0], threading.Lock()

    def run(_rows, work, res):
        if code.run is not run:  # switched since the caller read ``code.run``
            return code.run(code.frows, work, res)
        calls[0] += 1
        if calls[0] > _fusion.TIER and lock.acquire(False):
            try:
                if code.run is run:
                    code.tier_up(work)
            finally:
                lock.release()
            return code.run(code.frows, work, res)
        return plain(rows, work, res)
    return run


def _grad_code(code, seeds=None):
    """The program of ``code``'s gradient (of ``sum(seeds * outputs)``): its rows followed by
    the reverse sweep re-recorded as rows; outputs: the gradient's elements."""
    seeds = [1.0] * len(code.out_slots) if seeds is None else [float(s) for s in seeds]
    L, grads = _prog.grad_rows(code.arows, code.out_slots, seeds, code.in_slots)
    rows = L.rows()
    out = np.array([int(g) for g in grads], dtype=np.int64)
    pruned, new = _prog.prune_live(rows, out)
    return _Code(pruned, new[code.in_slots], new[out], code.inputs,
                 [(s, d) for s, d in code.inputs], "tuple" if len(code.inputs) > 1 else
                 "single", code.sites)


def _hvp_code(code):
    """A program of (x, v) whose value is ``grad(f)(x) . v``: its gradient in x is H v."""
    nin = len(code.in_slots)
    L = _prog.Builder()
    L._blocks.append(code.arows.copy())
    L.n = code.nslots
    vs = L.inputs(nin, (nin,))
    rows = L.rows()
    L2, grads = _prog.grad_rows(rows, code.out_slots, [1.0] * len(code.out_slots),
                                code.in_slots)
    prods = L2.op("mul", np.array([int(g) for g in grads], dtype=np.int64), vs)
    from .ops.lowering import reduce
    dot = int(np.asarray(reduce(L2, "add", prods, None, False, 0.0)))
    rows = L2.rows()
    pruned, new = _prog.prune_live(rows, np.array([dot], dtype=np.int64))
    ins = np.concatenate([code.in_slots, vs])
    h = _Code(pruned, new[ins], new[[dot]], code.inputs + code.inputs,
              [((), np.dtype(np.float64))], "single", code.sites)
    nin = len(code.inputs)
    layout = h.grad_layout[:nin]
    h.get_hv = _getter(_keys(layout), layout, nin == 1)
    h.with_value = _with_value(rows, dot, int(code.out_slots[0]), ins, h)
    return h


def _with_value(rows, dot, f, ins, h):
    """``h``, the Hessian-vector program, keeping the function's value too, for one-sample
    calls (``Program._hvp_one``): the rows that only the value reads (the sum of
    Rosenbrock's terms: 495 rows at n=100, 2,280 in all) moved after the product, where
    the reverse sweep, which starts at the last output, never runs them; ``value_at``: the
    value's place in its ``work``. None where it has array instructions (their entry
    sweeps every row). Measured at n=100, CPU time: one run of it 7.8 us, against 8.5 for
    ``h`` and a forward of the program for the value."""
    pruned, new = _prog.prune(rows, np.array([dot, f], dtype=np.int64))
    c = _Code(pruned, new[ins], new[[dot]], h.inputs, h.outputs, "single", h.sites)
    if c.arrays or h.arrays:
        return None
    r = c.arows
    keep = _prog.prune(r, c.out_slots)[1] >= 0  # the product's rows (and guards, leaves)
    order = np.concatenate([np.nonzero(keep)[0], np.nonzero(~keep)[0]])
    at = np.empty(r.shape[0], dtype=np.int64)
    at[order] = np.arange(r.shape[0])
    moved = r[order]  # (a copy) the value's rows last, both parts in their order
    operands = moved[:, 1:4]
    used = operands >= 0
    operands[used] = at[operands[used].astype(np.int64)]
    # (the product's rows cut as in ``h``; the value's, after them, never run backward)
    moved, cut = _prog.cut_dead(moved, at[c.out_slots], upto=int(np.count_nonzero(keep)))
    if cut is not None:
        at = cut[at]
    w = _Code(moved, at[c.in_slots], at[c.out_slots], h.inputs, h.outputs, "single", h.sites)
    w.get_hv = h.get_hv
    m = len(w.out_slots)
    w.value_at = _cpu.HEADER + 2 * m + len(w.in_slots) + w.n_in + int(at[new[f]])
    return w


def _hvp_of(code):
    """``code``'s Hessian-vector program, built once."""
    return code.derived("hvp", lambda: _hvp_code(code))


def _vjp_code(code):
    """A program of (x, v) whose outputs are ``v^T J(x)`` (v shaped like the outputs): the
    rule of a ``program`` entry under create_graph, so derivatives of any order stay
    compiled."""
    nout = len(code.out_slots)
    L = _prog.Builder()
    L._blocks.append(code.arows.copy())
    L.n = code.nslots
    vs = L.inputs(len(code.in_slots), (nout,))
    rows = L.rows()
    L2, grads = _prog.grad_rows(rows, code.out_slots, [int(v) for v in vs], code.in_slots)
    out = np.array([int(g) for g in grads], dtype=np.int64)
    pruned, new = _prog.prune_live(L2.rows(), out)
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
    from .replay import Program  # (replay imports this module)
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
