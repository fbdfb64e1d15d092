"""``grad`` and ``backward``: argument checks (torch's rules), then one reverse sweep."""
from __future__ import annotations

import threading
import warnings

import numpy as np

from .. import _notice
from ..interpreters import _generated_cpu, cpu, rerecord
from ..ops import ARRAY, BY_NAME, OPS
from ..tape import INPLACE, STATE, bump, end_tape, set_grad_mode
from ..tensor import Tensor, _plain, _plain_s, _pyfloat
from ._tensor_backend import TensorF
from .anomaly import ANOMALY, nan_error
from . import hooks
from .graph import HOOKS, GradientEdge, bound_tensor, edge_tensor
from .paths import FAST as _FAST, STATE as _PATHS, STRATEGIES, Path, declined as _declined



def _tensors(x, name, allow_empty=True):
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, GradientEdge):
        return [edge_tensor(x)]
    if isinstance(x, (list, tuple)):
        out = list(x)
        for i, t in enumerate(out):
            if isinstance(t, GradientEdge):
                out[i] = edge_tensor(t)
            elif not isinstance(t, Tensor):
                raise TypeError(f"{name}[{i}] must be a Tensor or GradientEdge, got "
                                f"{type(t).__name__}")
        return out
    raise TypeError(f"{name} must be a Tensor or a sequence of Tensors, got "
                    f"{type(x).__name__}")


def _grad_outputs(outputs, grad_outputs, name="grad_outputs"):
    """Seeds (float or ndarray, one per output) from ``grad_outputs``, with torch's checks."""
    if grad_outputs is None and len(outputs) == 1 and outputs[0]._d.__class__ is _pyfloat:
        return [1.0]  # the common case: one 0-d float64 loss
    if grad_outputs is None:
        gos = [None] * len(outputs)
    elif isinstance(grad_outputs, Tensor):
        gos = [grad_outputs]
    elif isinstance(grad_outputs, (list, tuple)):
        gos = list(grad_outputs)
    else:
        raise TypeError(f"{name} must be a Tensor, None or a sequence of them, got "
                        f"{type(grad_outputs).__name__}")
    if len(gos) != len(outputs):
        raise RuntimeError(f"got {len(outputs)} tensors and {len(gos)} gradients: pass one "
                           f"{name} entry (or None) per output")
    seeds = []
    for i, (y, g) in enumerate(zip(outputs, gos)):
        if g is None:
            if y.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs "
                                   f"(output {i} has shape {list(y.shape)}); pass "
                                   f"{name}= with a tensor of that shape")
            seeds.append(1.0 if y._d.__class__ is _pyfloat else np.ones(y.shape, y.dtype.np))
            continue
        if not isinstance(g, Tensor):
            raise TypeError(f"{name}[{i}] must be a Tensor or None, got {type(g).__name__}")
        if g.shape != y.shape:
            raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of "
                               f"{list(g.shape)} and output[{i}] has a shape of "
                               f"{list(y.shape)}.")
        if g.dtype.is_complex:
            raise RuntimeError(f"For complex Tensors, both grad_output and output are required "
                               f"to have the same dtype. Mismatch in dtype: grad_output[{i}] "
                               f"has a dtype of {g.dtype} and output[{i}] has a dtype of "
                               f"{y.dtype}.")
        gv = g._d
        if y._d.__class__ is _pyfloat:
            seeds.append(float(gv))
        else:
            seeds.append(np.asarray(gv, dtype=y.dtype.np))
    return seeds


def _check_outputs(outputs):
    for i, y in enumerate(outputs):
        if not y._rg:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have "
                               "a grad_fn")


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         only_inputs=True, allow_unused=None, is_grads_batched=False,
         materialize_grads=False):
    """Gradients of ``outputs`` with respect to ``inputs`` (a tuple, one per input).

    Same signature, defaults, warnings and errors as ``torch.autograd.grad``.

    Examples
    --------
    >>> import tapegrad
    >>> x = tapegrad.tensor(3.0, requires_grad=True)
    >>> tapegrad.autograd.grad(x * x, x)[0].item()
    6.0
    """
    if "gradient" in _notice.PENDING:  # a cold cache compiles for seconds: say so, once
        _notice.announce("gradient")
    if (outputs.__class__ is Tensor and not is_grads_batched and grad_outputs is None
            and allow_unused is None and not materialize_grads and only_inputs):
        # the fast strategies (paths.STRATEGIES): the first that applies runs the call
        ctl = _PATHS.ctl
        for p in (_FAST_GRAPH if retain_graph is not False else ()) if create_graph \
                else _FAST_NOGRAPH:
            if ctl is not None and not ctl.allows(p.name):
                continue
            plan = p.applies(outputs, inputs, retain_graph)
            if plan is not None:
                _PATHS.last = p.name
                return p.run(plan)
        if ctl is not None and ctl.forced in _FAST:
            _declined(ctl.forced, "the call is not one this path covers")
    if materialize_grads and allow_unused is False:
        raise ValueError("Expected allow_unused to be True or not passed when "
                         "materialize_grads=True, but got: allow_unused=False.")
    if allow_unused is None:
        allow_unused = materialize_grads
    if not only_inputs:
        warnings.warn("only_inputs argument is deprecated and is ignored now (defaults to "
                      "True). To accumulate gradient for other parts of the graph, please use "
                      "tapegrad.autograd.backward.", FutureWarning, stacklevel=2)
    outs = _tensors(outputs, "outputs")
    ins = _tensors(inputs, "inputs")
    if not ins:
        raise RuntimeError("`inputs` argument to `grad()` cannot be empty.")
    _check_outputs(outs)
    if not all([x._rg for x in ins]):
        raise RuntimeError("One of the differentiated Tensors does not require grad")
    if retain_graph is None:
        retain_graph = create_graph
    if is_grads_batched:
        seeds, batch = _batched_seeds(outs, grad_outputs)
        if create_graph:
            results, used = _run(outs, _seed_tensors(outs, seeds, grad_outputs), ins,
                                 retain_graph, record=True, batch=batch,
                                 allow_unused=allow_unused)
            return _batched_recorded(ins, results, used, batch, allow_unused,
                                     materialize_grads)
        results, used = _run(outs, seeds, ins, retain_graph, batch=batch)
        return _batched_results(ins, results, used, batch, allow_unused, materialize_grads)
    seeds = _grad_outputs(outs, grad_outputs)
    if create_graph:
        results, used = _run(outs, _seed_tensors(outs, seeds, grad_outputs), ins,
                             retain_graph, record=True, allow_unused=allow_unused)
    else:
        results, used = _run(outs, seeds, ins, retain_graph, fast=True)
    if used.__class__ is bool:  # the fast path: every input a used 0-d float64 leaf
        return tuple([_plain_s(r) for r in results])
    out = []
    for i, (x, r, u) in enumerate(zip(ins, results, used)):
        if not u:
            _check_unused(i, allow_unused)
            out.append(_zeros_for(x) if materialize_grads else None)
        elif isinstance(r, Tensor):  # create_graph
            out.append(r)
        elif x._d.__class__ is _pyfloat:
            out.append(_plain_s(float(r)))
        else:
            out.append(_as_tensor(r, x))
    return tuple(out)


def _scalar_case(y, inputs, arrays=False):
    """(tape, input slots) when ``grad(y, inputs)`` is the case the one-call paths cover:
    a 0-d float64 loss on one tape of scalar entries (no arrays, N-ary or retained entries,
    nothing freed or changed in place) and 0-d float64 leaves entered once each; else None.
    With ``arrays``, the tape and the leaves may hold arrays."""
    tape = y._tape
    if (tape is None or y._d.__class__ is not _pyfloat or (tape.arrays and not arrays)
            or tape.nary or tape.retained or tape.freed is not None or tape.reentered
            or tape.epoch != INPLACE[0] or tape.dirty or ANOMALY.enabled or HOOKS[0]):
        return None
    if inputs.__class__ is Tensor:
        inputs = (inputs,)
    elif inputs.__class__ is not list and inputs.__class__ is not tuple:
        return None
    sid = tape.sid
    slots = []
    for x in inputs:
        if (x.__class__ is not Tensor or x._sid != sid or x._tape is not None
                or (x._d.__class__ is not _pyfloat and not arrays) or not x._rg):
            return None
        slots.append(x._slot)
    if not slots:
        return None
    return tape, np.array(slots, dtype=np.int64)


def _scalar_applies(y, inputs, retain_graph):
    """``grad(y, inputs)`` with default options in one compiled call, for the case that
    dominates scalar optimization loops (``_scalar_case``, and no import on the path). None
    when anything else holds: the next path then runs (and raises whatever torch raises)."""
    case = _scalar_case(y, inputs)
    if case is None:
        return None
    tape, slots = case
    grads, need, used = cpu.grad_scalar(tape.rows(), tape.values(), slots, y._slot,
                                        cpu.SWEEPABLE,
                                        tape.imports[0] if tape.imports else y._slot)
    if not used:
        return None  # an unused input: the general path raises or returns None for it
    return tape, need, grads, retain_graph


def _scalar_run(plan):
    tape, need, grads, retain_graph = plan
    if not retain_graph:
        cpu.free_entries(tape, need)
        end_tape(tape)
    return tuple([_plain_s(v) for v in grads.tolist()])


def _flat_mark(y, inputs):
    """(tape, rows, need, lo, input slots) when the flat path may take the call
    (``_scalar_case`` with arrays, every input reached, every entry on the path one
    ``cpu.FLAT`` covers); else None."""
    tape = y._tape
    if tape is None or not tape.arrays:
        return None
    case = _scalar_case(y, inputs, arrays=True)
    if case is None:
        return None
    tape, ins = case
    rows = tape.rows()
    need, reach, lo, ok = cpu._mark_scalar(rows, ins, y._slot, cpu.FLAT,
                                           tape.imports[0] if tape.imports else y._slot)
    if not ok or not reach[ins].all():
        return None
    return tape, rows, need, lo, ins


def _flat_applies(y, inputs, retain_graph):
    """``grad(y, inputs)`` with default options on a tape with small arrays, in one compiled
    call over flat buffers (``cpu.flat_layout``, ``sweep_flat``): a 0-d float64 loss on one
    tape, float64 leaves, and on the path elementwise ops, 1-d slices, full sums and means.
    None when anything else holds (past the buffers' size limit: the general sweep)."""
    m = _flat_mark(y, inputs)
    if m is None:
        return None
    tape, rows, need, lo, ins = m
    layout = cpu.flat_layout(tape, rows, need, lo, y._slot + 1)
    if layout is None:
        return None
    off, size, V, p0, p1 = layout
    A = np.zeros(len(V), dtype=np.float64)
    A[y._slot] = 1.0
    if _generated_cpu.sweep_flat(rows, need, y._slot + 1, lo, off, size, V, A, p0, p1):
        return None  # broadcasting it does not run
    return tape, need, ins, off, A, retain_graph


def _flat_run(plan):
    tape, need, ins, off, A, retain_graph = plan
    out = []
    arrays = tape.arrays
    for s in ins.tolist():
        v = arrays.get(s)
        if v is None:
            out.append(_plain_s(float(A[s])))
        else:
            o = off[s]
            out.append(_plain(A[o:o + v.size].reshape(v.shape).copy()))
    if not retain_graph:
        cpu.free_entries(tape, need)
        end_tape(tape)
    return tuple(out)


def _record_applies(y, inputs, retain_graph):
    """``grad(y, inputs, create_graph=True)`` with default options in one compiled call:
    the sweep's entries are emitted by ``cpu.grad_record`` (appended to the loss's tape by
    ``_record_run``), which must be the one this thread records onto. Covers
    ``_scalar_case`` with every rule on the path recordable; None otherwise (the tensor
    sweep then records the same entries)."""
    case = _scalar_case(y, inputs)
    if case is None:
        return None
    tape, slots = case
    if STATE.tape() is not tape or STATE.trace is not None or len(tape.vals) >= tape.limit:
        return None
    base = len(tape.vals)
    rows, codes, values, gslots, gvals, ok = cpu.grad_record(
        tape.rows(), tape.values(), slots, y._slot, -1, 1.0, cpu.RECORDABLE,
        tape.imports[0] if tape.imports else y._slot, base)
    if not ok:
        return None
    return tape, rows, codes, values, gslots, gvals


def _record_run(plan):
    tape, rows, codes, values, gslots, gvals = plan
    tape.extend(rows, codes, values)
    sid, out = tape.sid, []
    for s, v in zip(gslots.tolist(), gvals.tolist()):
        if s < 0:  # a constant gradient (no path through a recorded value)
            out.append(_plain_s(v))
            continue
        t = Tensor()
        t._d = v
        t._rg = True
        t._tape = tape
        t._sid = sid
        t._slot = s
        out.append(t)
    return tuple(out)


SCALAR = Path("scalar", _scalar_applies, _scalar_run, graph=False)
FLAT = Path("flat", _flat_applies, _flat_run, graph=False)
RECORD = Path("record", _record_applies, _record_run, graph=True)
_FAST_NOGRAPH = (SCALAR, FLAT)  # create_graph off, in the order they are tried
_FAST_GRAPH = (RECORD,)                # create_graph on (and the graph retained)


def _batched_seeds(outs, grad_outputs):
    """Seeds with a leading batch axis (is_grads_batched), checked as torch checks them."""
    if grad_outputs is None:
        raise RuntimeError("is_grads_batched=True needs grad_outputs: one tensor per output "
                           "whose first dimension is the batch")
    gos = [grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs)
    if len(gos) != len(outs):
        raise RuntimeError(f"got {len(outs)} tensors and {len(gos)} gradients")
    batch, seeds = None, []
    for i, (y, g) in enumerate(zip(outs, gos)):
        if not isinstance(g, Tensor):
            raise TypeError(f"grad_outputs[{i}] must be a Tensor when is_grads_batched=True, "
                            f"got {type(g).__name__}")
        if g.ndim == 0 or tuple(g.shape[1:]) != tuple(y.shape):
            raise RuntimeError(
                "If `is_grads_batched=True`, we interpret the first dimension of each "
                "grad_output as the batch dimension. The sizes of the remaining dimensions are "
                "expected to match the shape of corresponding output, but a mismatch was "
                f"detected: grad_output[{i}] has a shape of {list(g.shape)} and output[{i}] "
                f"has a shape of {list(y.shape)}.")
        if batch is not None and g.shape[0] != batch:
            raise RuntimeError(f"is_grads_batched=True: every grad_output needs the same batch "
                               f"size, but grad_output[{i}] has {g.shape[0]} and the first "
                               f"has {batch}")
        batch = g.shape[0]
        seeds.append(np.asarray(g._d, dtype=y.dtype.np))
    return seeds, batch


def _check_unused(i, allow_unused):
    if not allow_unused:
        raise RuntimeError(f"The differentiated Tensor at index {i} appears to not have been "
                           "used in the graph. Set allow_unused=True if this is the desired "
                           "behavior.")


def _batched_recorded(ins, results, used, batch, allow_unused, materialize_grads):
    """``_batched_results`` for create_graph: the gradients are recorded tensors."""
    out = []
    for i, (x, r, u) in enumerate(zip(ins, results, used)):
        shape = (batch,) + tuple(x.shape)
        if not u:
            _check_unused(i, allow_unused)
            out.append(_plain(np.zeros(shape, x.dtype.np)) if materialize_grads else None)
        elif not isinstance(r, Tensor):
            out.append(_plain(np.array(np.broadcast_to(np.asarray(r, dtype=x.dtype.np),
                                                       shape))))
        else:
            out.append(r if r.shape == shape else r.expand(shape))
    return tuple(out)


def _batched_results(ins, results, used, batch, allow_unused, materialize_grads):
    out = []
    for i, (x, r, u) in enumerate(zip(ins, results, used)):
        if not u:
            _check_unused(i, allow_unused)
            out.append(_plain(np.zeros((batch,) + tuple(x.shape), x.dtype.np))
                       if materialize_grads else None)
        else:
            out.append(_plain(np.array(np.broadcast_to(np.asarray(r, dtype=x.dtype.np),
                                                       (batch,) + tuple(x.shape)))))
    return tuple(out)


def _seed_tensors(outs, seeds, grad_outputs):
    """The seeds as tensors for a recorded sweep: the user's grad_outputs themselves (they
    may require grad), cast to the output's dtype, or ones."""
    given = [grad_outputs] if isinstance(grad_outputs, Tensor) else (
        list(grad_outputs) if grad_outputs is not None else [None] * len(outs))
    out = []
    for y, raw, g in zip(outs, seeds, given):
        if g is None:
            out.append(_plain_s(raw) if raw.__class__ is float else _plain(raw))
        elif g.dtype is not y.dtype:
            out.append(g.to(y.dtype))
        else:
            out.append(g)
    return out


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
             grad_variables=None, inputs=None):
    """Accumulate the gradient of ``tensors`` into the ``.grad`` of the graph's leaves.

    Same signature and behaviour as ``torch.autograd.backward``.

    Examples
    --------
    >>> import tapegrad
    >>> w = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    >>> tapegrad.autograd.backward((w * w).sum())
    >>> w.grad.tolist()
    [2.0, 4.0]
    """
    if "gradient" in _notice.PENDING:
        _notice.announce("gradient")
    if grad_variables is not None:
        warnings.warn("'grad_variables' is deprecated. Use 'grad_tensors' instead.",
                      FutureWarning, stacklevel=2)
        if grad_tensors is not None:
            raise RuntimeError("`grad_tensors` and `grad_variables` (deprecated) arguments both "
                               "passed to `backward()`. Please only use `grad_tensors`.")
        grad_tensors = grad_variables
    outs = _tensors(tensors, "tensors")
    if inputs is not None:
        ins = _tensors(inputs, "inputs")
        if not ins:
            raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    else:
        ins = None
    _check_outputs(outs)
    seeds = _grad_outputs(outs, grad_tensors, "grad_tensors")
    if retain_graph is None:
        retain_graph = create_graph
    if create_graph:
        seeds = _seed_tensors(outs, seeds, grad_tensors)
    taken = set()  # leaves a hooked sweep accumulated itself, in torch's order
    accumulate = None
    if HOOKS[0]:
        def accumulate(x, r):
            taken.add(id(x))
            _accumulate(x, r)
            hooks.post_accumulate(x)
    if ins is not None:
        ins = list({id(x): x for x in ins}.values())
        for x in ins:
            if not x._rg:
                raise RuntimeError("One of the differentiated Tensors does not require grad")
        results, used = _run(outs, seeds, ins, retain_graph, {id(x) for x in ins},
                             record=create_graph, accumulate=accumulate)
        targets = ins
    else:
        results, used, targets = _run(outs, seeds, None, retain_graph, record=create_graph,
                                      accumulate=accumulate)
    for x, r, u in zip(targets, results, used):
        if u and id(x) not in taken:
            _accumulate(x, r)
            if HOOKS[0]:
                hooks.post_accumulate(x)


def _zeros_for(x):
    return _plain(0.0) if x._d.__class__ is _pyfloat else _plain(np.zeros(x.shape, x.dtype.np))


def _as_tensor(r, x):
    if x._d.__class__ is _pyfloat:
        return _plain_s(float(r))
    return _plain(np.array(r, dtype=x.dtype.np, copy=True).reshape(x.shape))


LEAF, CONST = BY_NAME["leaf"].code, BY_NAME["const"].code
_ACCUMULATE = threading.Lock()  # threads may run backward into the same leaves


def _accumulate(x, r):
    with _ACCUMULATE:
        _accumulate_locked(x, r)


def _accumulate_locked(x, r):
    g = getattr(x, "_grad", None)
    if isinstance(r, Tensor):  # create_graph: out of place, so .grad keeps its history
        x._grad = r if g is None else g + r
        return
    if g is None:
        x._grad = _as_tensor(r, x)
    elif g._d.__class__ is _pyfloat:
        g._d = g._d + float(r)
    else:
        v = np.asarray(r, dtype=g.dtype.np).reshape(g.shape)
        if g._d.flags.writeable:
            np.add(g._d, v, out=g._d)
            bump(g._ver)
        else:
            g._d = g._d + v


def _run(outs, seeds, ins, retain_graph, skip_retained=(), fast=False, record=False,
         batch=None, allow_unused=True, accumulate=None):
    """One reverse sweep. With ``ins`` None (backward), the inputs are the graph's leaves
    and retained non-leaves, returned as a third value. With ``record`` (create_graph) the
    seeds are tensors and the sweep re-records every rule, so the results are tensors (an
    input ``allow_unused`` rejects is rejected before anything is recorded)."""
    path = _general_path(record, batch)
    _PATHS.last = path.name
    roots = []
    for y in outs:
        if y._tape is not None and all(y._tape is not r for r in roots):
            roots.append(y._tape)
    if not roots:
        return _leaf_outputs_only(outs, seeds, ins, batch)
    tapes = cpu.order_tapes(roots)
    graph = cpu.Graph(tapes)
    n = graph.n
    if ins is None:  # backward: every leaf on the tapes may be an input; the ones the
        # outputs reach are found after marking, so the work here is the output's graph's
        ins = slot_lists = None
        collect = True
    else:
        if len(tapes) == 1:
            tape0 = tapes[0]
            slot_lists = [tape0.leaf_slots(x) if x._tape is None else
                          ([x._slot] if x._tape is tape0 else []) for x in ins]
        else:
            slot_lists = [_slots_of(graph, x) for x in ins]
        collect = False
    if collect:
        flat = None
        is_input = (graph.rows[:, 0].astype(np.int64) & ~ARRAY) == LEAF
        fast_leaves = False
    else:
        flat = [s for sl in slot_lists for s in sl]
        # one slot per input, all 0-d float64: results come straight out of the adjoint array
        fast_leaves = (fast and not record and not batch and len(flat) == len(ins)
                       and all([x._d.__class__ is _pyfloat for x in ins])
                       and not graph.arrays_at(flat))
        is_input = np.zeros(n, dtype=np.bool_)
        is_input[flat] = True
    is_output = np.zeros(n, dtype=np.bool_)
    adj = np.zeros((n, batch) if batch else n, dtype=np.float64)
    adjd = {}
    direct = {}
    for y, s in zip(outs, seeds):
        if y._tape is None:
            direct[id(y)] = direct.get(id(y), 0.0) + s
            continue
        k = graph.slot(y._tape, y._slot)
        is_output[k] = True
        if record:
            adjd[k] = s if k not in adjd else adjd[k] + s
        elif graph.is_array(k):
            adjd[k] = s if k not in adjd else adjd[k] + s
        else:
            adj[k] += s
    need, reach, arr = cpu.mark(graph.rows, *graph.nx, is_input, is_output)
    if collect:
        ins, slot_lists = _reached_leaves(graph, outs, np.flatnonzero(reach & is_input))
        skip_retained = {id(x) for x in ins}
        flat = [s for sl in slot_lists for s in sl]
    graph.wanted = need | is_input | is_output  # slots whose gradient anyone will read
    cpu.check_not_freed(graph, need)
    _check_versions(graph, need, reach)
    # only the hooks path runs hooks
    if HOOKS[0] and hooks.graph_has_hooks(graph, ins, (need | is_input | is_output) & reach):
        if batch:  # torch vmaps the hooks over the batch: here, one sweep per sample
            return _per_sample(outs, seeds, ins, retain_graph, record, batch, allow_unused,
                               graph, need, tapes)
        path = _general_path(record, batch, hooked=True)
        fast_leaves = False
    sw = _Sweep(graph, need, reach, arr, adj, adjd, is_input, is_output, accumulate,
                batch, ins, slot_lists, direct, allow_unused)
    sw.outs, sw.record = outs, record
    _PATHS.last = path.name
    path.run(sw)
    adj, adjd, is_array = sw.adj, sw.adjd, sw.is_array
    if fast_leaves and not ANOMALY.enabled:
        flat_arr = np.array(flat, dtype=np.int64)
        if reach[flat_arr].all() and not direct:
            results = adj[flat_arr].tolist()
            _fill_retained(graph, need, reach, is_output, adj, adjd, skip_retained)
            if not retain_graph:
                graph.free(need)
                for t in tapes:
                    end_tape(t)
            return results, True
    # only the inputs' slots are read: no pass over the whole tape in Python. Batched: each
    # slot's row stays an array (an input entered on several tapes sums its rows)
    reach_l = dict(zip(flat, reach[flat].tolist()))
    adj_l = dict(zip(flat, adj[flat].tolist() if not batch else list(adj[flat])))
    if is_array is not None:
        pass
    elif len(tapes) == 1:
        is_array = tapes[0].arrays.__contains__
    else:
        is_array = graph.is_array
    results, used = [], []
    for x, sl in zip(ins, slot_lists):
        if len(sl) == 1 and not direct:  # the common case: one slot per input
            s = sl[0]
            if not reach_l[s]:
                results.append(None)
                used.append(False)
            elif is_array(s) or record:
                v = adjd.get(s)
                results.append(v if v is not None else _zeros_like_input(x, record))
                used.append(True)
            else:
                results.append(adj_l[s])
                used.append(True)
            continue
        total, u = None, False
        for s in sl:
            if reach_l[s]:
                u = True
                v = adjd.get(s) if is_array(s) else adj_l[s]
                if v is not None:
                    total = v if total is None else total + v
        if direct and id(x) in direct:
            u = True
            total = direct[id(x)] if total is None else total + direct[id(x)]
        if u and total is None:
            total = _zeros_like_input(x, record)
        results.append(total)
        used.append(u)
    _fill_retained(graph, need, reach, is_output, adj, adjd, skip_retained, record)
    if not retain_graph:
        graph.free(need)
        for t in tapes:
            end_tape(t)
    if collect:
        return results, used, ins
    return results, used


class _Sweep:
    """What a general path's ``run`` reads and writes: the marked graph, the adjoints (0-d
    in ``adj``, arrays and tensors in ``adjd``), and for the results ``is_array`` (None: the
    tape's own test)."""
    __slots__ = ("graph", "need", "reach", "arr", "adj", "adjd", "is_input", "is_output",
                 "accumulate", "batch", "ins", "slot_lists", "direct", "allow_unused",
                 "is_array", "outs", "record")

    def __init__(self, graph, need, reach, arr, adj, adjd, is_input, is_output, accumulate,
                 batch, ins, slot_lists, direct, allow_unused):
        self.graph, self.need, self.reach, self.arr = graph, need, reach, arr
        self.adj, self.adjd, self.is_input, self.is_output = adj, adjd, is_input, is_output
        self.accumulate, self.batch, self.ins = accumulate, batch, ins
        self.slot_lists, self.direct, self.allow_unused = slot_lists, direct, allow_unused
        self.is_array = None
        self.outs = ()  # the call's outputs (a leaf output's hooks see its whole gradient)
        self.record = False  # create_graph: the rules are re-recorded on tensors


def _general_path(record, batch, hooked=False):
    """The general strategy for a sweep's options: the first of ``_GENERAL`` whose
    ``applies`` takes them. Under ``paths.force``/``disable`` it must be allowed: a forced
    ``checked`` takes whatever ``sweep`` takes; otherwise ``PathDeclined``."""
    call = (record, batch, hooked)
    for p in _GENERAL:
        if p.applies(call):
            break
    ctl = _PATHS.ctl
    if ctl is None or ctl.allows(p.name):
        return p
    if ctl.forced == "checked" and p is SWEEP:
        return CHECKED  # the checked sweep takes whatever the general one takes
    _declined(ctl.forced or p.name, f"this call takes the {p.name!r} path")


def _hooks_run(sw):
    leaves = {id(y): y for y in sw.outs if y._tape is None}
    if not sw.record:
        hooks.sweep(sw.graph, sw.need, sw.adj, sw.adjd, sw.is_input, sw.is_output, sw.reach,
                    sw.accumulate, sw.direct, leaves)
        return
    graph = sw.graph

    def run(adjd):
        hooks.sweep(graph, sw.need, sw.adj, adjd, sw.is_input, sw.is_output, sw.reach,
                    sw.accumulate, sw.direct, leaves,
                    rec=(TensorF, _slot_tensors(graph), lambda u, v: u + v))
        return adjd
    # no rollback: the hooks' own code ran, and may hold what it recorded (a .grad
    # accumulated before a later hook raised, a logged tensor), as it may in torch
    _recorded(sw, run, rollback=False)


def _rerecord_run(sw):
    graph = sw.graph
    _recorded(sw, lambda adjd: rerecord.sweep(graph, sw.need, adjd, TensorF,
                                              _slot_tensors(graph), lambda u, v: u + v,
                                              batch=sw.batch))


def _recorded(sw, sweep, rollback=True):
    """Run ``sweep(seeds) -> adjoints`` recording (create_graph): unused inputs are
    rejected first, and (with ``rollback``) a sweep that fails part way leaves nothing
    recorded."""
    if not sw.allow_unused:  # raise before recording anything
        for i, sl in enumerate(sw.slot_lists):
            if not any(sw.reach[s] for s in sl) and id(sw.ins[i]) not in sw.direct:
                _check_unused(i, False)
    prev = STATE.grad_enabled
    set_grad_mode(True)  # create_graph wins over an enclosing no_grad, as in torch
    tape = STATE.tape()
    start = len(tape.vals) if tape else 0
    graph = sw.graph
    try:
        sw.adjd = sweep(sw.adjd)
    except BaseException:
        if tape and rollback:  # a rule that failed part way leaves nothing recorded
            tape.truncate(start)
        raise
    finally:
        set_grad_mode(prev)
    sw.is_array = sw.adjd.__contains__  # every adjoint is a tensor in adjd
    sw.adj = np.zeros(graph.n)


def _per_sample(outs, seeds, ins, retain_graph, record, batch, allow_unused, graph, need,
                tapes):
    """is_grads_batched through a graph with hooks: one hooked sweep per sample, stacked.
    torch calls each hook once under vmap, on one sample's gradient; the values are the
    same, a hook is called once per sample here (docs/differences.md)."""
    per = [_run(outs, [sd[i] for sd in seeds], ins, True, record=record,
                allow_unused=allow_unused) for i in range(batch)]
    used = per[0][1]
    results = []
    for j, u in enumerate(used):
        if not u:
            results.append(None)
        elif record:
            from ..functions import stack
            results.append(stack([p[0][j] for p in per]))
        else:
            results.append(np.stack([np.asarray(p[0][j]) for p in per]))
    if not retain_graph:
        graph.free(need)
        for t in tapes:
            end_tape(t)
    return results, used


def _batched_run(sw):
    cpu.sweep_batched(sw.graph, sw.need, sw.adj, sw.adjd, sw.arr)


def _checked_run(sw):
    graph = sw.graph
    cpu.sweep_checked(graph, sw.need, sw.adj, sw.adjd, lambda k, i: nan_error(graph, k, i))


def _sweep_run(sw):
    cpu.sweep(sw.graph, sw.need, sw.adj, sw.adjd, sw.arr)


# the general strategies: ``applies`` reads (create_graph, batch size, hooked) and says
# yes before anything is swept; the sweep itself is ``run``. Tried in this order.
HOOKS_PATH = Path("hooks", lambda c: c[2], _hooks_run)
RERECORD = Path("rerecord", lambda c: c[0], _rerecord_run)
BATCHED = Path("batched", lambda c: bool(c[1]), _batched_run)
CHECKED = Path("checked", lambda c: ANOMALY.enabled and ANOMALY.check_nan, _checked_run)
SWEEP = Path("sweep", lambda c: True, _sweep_run)
_GENERAL = (HOOKS_PATH, RERECORD, BATCHED, CHECKED, SWEEP)
STRATEGIES[:] = _FAST_NOGRAPH + _FAST_GRAPH + _GENERAL


def _zeros_like_input(x, record):
    if record:
        return _zeros_for(x)
    return 0.0 if x._d.__class__ is _pyfloat else np.zeros(x.shape, x.dtype.np)


def _slot_tensors(graph):
    """``as_tensor(slot)`` for the re-recording sweep: the leaf or constant itself, or a
    non-leaf tensor bound to the slot (so rules record on top of the recorded graph)."""
    cache = {}
    leafish = (LEAF, CONST)
    single = graph.tapes[0] if len(graph.tapes) == 1 else None

    def as_tensor(s):
        t = cache.get(s)
        if t is None:
            tape, k = (single, s) if single is not None else graph.locate(s)
            code = tape.code[k * 5] & ~ARRAY
            if code == CONST:
                # the value recorded, not the tensor: an in-place op with grad since then
                # (``c *= x``, c not requiring grad) rebinds that tensor to its result
                v = graph.value(s)
                t = _plain_s(v) if v.__class__ is _pyfloat else _plain(v)
            elif code in leafish:
                t = tape.aux[k][0]
                if t is None:  # a constant a backward released (cpu._release): its shape
                    t = _plain(graph.value(s))
            else:
                t = bound_tensor(tape, k, graph.value(s))
            cache[s] = t
        return t
    return as_tensor


def _fill_retained(graph, need, reach, is_output, adj, adjd, skip, record=False):
    """retain_grad is a hook, as in torch: every sweep that computes a retaining non-leaf's
    gradient accumulates it into that tensor's ``.grad`` (grad() included)."""
    for t in graph.tapes:
        if not t.retained:
            continue
        off = graph.slot(t, 0)
        for k, ref in list(t.retained.items()):
            x = ref()
            if x is None or x._tape is not t or x._slot != k:
                del t.retained[k]
                continue
            if id(x) in skip:  # backward() accumulates into it as an input already
                continue
            s = off + k
            if reach[s] and (need[s] or is_output[s]):
                v = adjd.get(s) if (record or graph.is_array(s)) else adj[s]
                _accumulate(x, v if v is not None else _zeros_like_input(x, record))


def _slots_of(graph, x):
    if len(graph.tapes) == 1 and x._tape is None:
        return graph.tapes[0].leaf_slots(x)
    if x._tape is not None:
        s = graph.slot(x._tape, x._slot)
        return [] if s is None else [s]
    out = []
    for t in graph.tapes:
        ks = t.leaf_slots(x)
        if ks:
            off = graph.slot(t, 0)
            out.extend(off + k for k in ks)
    return out


def _graph_inputs(graph, outs):
    """Leaves of the graph (in entering order) and non-leaves that retain grad."""
    ins, slots, seen = [], [], {}
    for t in graph.tapes:
        off = graph.slot(t, 0)
        for key, ks in t.leaf_items():
            leaf = t.aux[ks[0]][0]
            if key not in seen:
                seen[key] = len(ins)
                ins.append(leaf)
                slots.append([])
            slots[seen[key]].extend(off + k for k in ks)
    for y in outs:  # a leaf output (backward on a leaf itself)
        if y._tape is None and id(y) not in seen:
            seen[id(y)] = len(ins)
            ins.append(y)
            slots.append([])
    return ins, slots


def _reached_leaves(graph, outs, slots):
    """The leaves at ``slots`` (the leaf entries the outputs reach) in entering order, with
    their slots, and leaf outputs (backward on a leaf itself): the inputs of a backward.
    Leaves the outputs do not reach get no gradient, so they are not looked at."""
    ins, lists, seen = [], [], {}
    single = graph.tapes[0] if len(graph.tapes) == 1 else None
    for s in slots.tolist():
        tape, k = (single, s) if single is not None else graph.locate(s)
        leaf = tape.aux[k][0]
        i = seen.get(id(leaf))
        if i is None:
            seen[id(leaf)] = len(ins)
            ins.append(leaf)
            lists.append([s])
        else:
            lists[i].append(s)
    for y in outs:
        if y._tape is None and id(y) not in seen:
            seen[id(y)] = len(ins)
            ins.append(y)
            lists.append([])
    return ins, lists


def _leaf_outputs_only(outs, seeds, ins, batch=None):
    collect = ins is None
    if collect:
        ins = []
        for y in outs:
            if all(y is not x for x in ins):
                ins.append(y)
    results, used = [], []
    for x in ins:
        total = None
        for y, s in zip(outs, seeds):
            if y is x:
                total = s if total is None else total + s
        if HOOKS[0] and total is not None:  # a leaf's own hooks, on its seed
            total = hooks.leaf_output_hooks(x, total, batch)
        results.append(total)
        used.append(total is not None)
    return (results, used, ins) if collect else (results, used)


def _check_versions(graph, need, reach):
    """Raise, as torch does, when a value saved for this backward was changed in place
    after it was recorded."""
    first = None  # per slot: the first needed entry that saved it (built when needed)
    n = len(graph.rows)
    for t in graph.tapes:
        # an in-place op with grad rebinds its tensor (tape.dirty) without a version bump
        if t.dirty:
            if first is None:
                first, saves_out = _first_savers(graph, need)
            off = graph.slot(t, 0)
            ks = np.fromiter(t.dirty.keys(), dtype=np.int64, count=len(t.dirty)) + off
            until = np.fromiter(t.dirty.values(), dtype=np.int64, count=len(t.dirty)) + off
            if ((need[ks] & saves_out[ks]) | (first[ks] < until)).any():
                _version_error(None, 1, 0)
        if t.epoch == INPLACE[0]:  # nothing changed in place since this tape began
            continue
        for k in t.versioned:
            x, ver = t.aux[k]
            if x._ver[0] != ver:
                s = graph.slot(t, k)
                if first is None:
                    first, saves_out = _first_savers(graph, need)
                if reach[s] and first[s] < n:
                    _version_error(x, x._ver[0], ver)
        for k, box, ver in t.viewed:
            if box[0] != ver:
                s = graph.slot(t, k)
                if first is None:
                    first, saves_out = _first_savers(graph, need)
                if reach[s] and first[s] < n:
                    _version_error(None, box[0], ver)


# per opcode: whether its entry saves input a, input b, its output as torch does (each op's
# ``torch_saves``, ``Op.saved``): always, or when input a / input b requires grad (torch saves
# what the formulas of the inputs that require grad read: ``h @ w`` with w a constant saves
# w only); where that depends on the entry's aux, per needed entry
_VALUES = ("a", "b", "out")
_SAVES_ALWAYS, _SAVES_IF_A, _SAVES_IF_B = (
    np.array([[w in (() if callable(op.torch_saves) or by and not op.saves_by_input
                     else op.saved(grads=grads)) for w in _VALUES] for op in OPS],
             dtype=np.bool_)
    for by, grads in ((False, ()), (True, ("a",)), (True, ("b",))))
_SAVES_BY_AUX = np.array([callable(op.torch_saves) for op in OPS], dtype=np.bool_)


def _first_savers(graph, need):
    """Per slot, the first needed entry that saved its value as torch would (len(rows)
    when none), and whether each entry saved its output: one pass, so a backward after
    many in-place ops stays linear."""
    rows = graph.rows
    n = len(rows)
    codes = rows[:, 0].astype(np.int64) & ~ARRAY
    saves = _SAVES_ALWAYS[codes]
    for col, by in ((1, _SAVES_IF_A), (2, _SAVES_IF_B)):  # an input that requires grad
        src = rows[:, col].astype(np.int64)
        rg = (src >= 0) & (codes[src] != CONST)
        saves |= rg[:, None] & by[codes]
    sa, sb, so = saves[:, 0], saves[:, 1], saves[:, 2]
    for k in np.flatnonzero(_SAVES_BY_AUX[codes] & need).tolist():
        saved = OPS[codes[k]].saved(graph.aux(k))  # max(dim): torch saves the indices only
        sa[k], sb[k], so[k] = "a" in saved, "b" in saved, "out" in saved
    first = np.full(n, n, dtype=np.int64)
    idx = np.arange(n, dtype=np.int64)
    for col, saves in ((1, sa), (2, sb)):
        src = rows[:, col]
        m = need & saves & (src >= 0)
        np.minimum.at(first, src[m].astype(np.int64), idx[m])
    return first, so


def _version_error(x, now, ver):
    what = f"[{x.dtype} {list(x.shape)}]" if x is not None else "a tensor"
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {what} is at version {now}; expected version {ver} instead. "
        "Hint: change the in-place operation to an out-of-place one (x = x + y instead of "
        "x += y), or record the graph again after the change.")
