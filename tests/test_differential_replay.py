"""The replay legs of the differential harness: random programs (tests/harness/programs.py,
with Python branches and ties from tests/harness/replay_forms.py) traced once with
``tapegrad.trace`` and replayed at NEW inputs (perturbed, sign-flipped, quantized to ties),
compared to torch eager and to tapegrad eager at those inputs:

1. ``replay``: values of the loss and of every node, the gradient, a vector-Jacobian
   product of the nodes, the Jacobians and a Hessian-vector product; or ``GuardError`` (a
   branch the trace took goes the other way), and then ``retrace=True`` gives torch's
   numbers.
2. ``batched``: a batch of inputs (leading axis) equals the single calls and torch at each
   sample (a batch whose samples take different branches: retraced, a variant per
   branch); ``target="parallel"`` equals the serial batch.
3. ``cuda``: ``target="cuda"`` in numba's CUDA simulator (in a subprocess, which sets
   NUMBA_ENABLE_CUDASIM=1 before numba.cuda is imported) equals the CPU replay.
4. ``higher``: ``grad_program()`` and the grad program's own ``grad_program(w)`` (third
   order) against torch's double and triple backward.
5. ``entry``: a program called on tensors (a ``program`` entry on the eager tape), one
   sample or a batch: gradient, a create_graph Hessian-vector product and
   is_grads_batched through it, against torch.
6. ``fused``: superinstructions (tapegrad/interpreters/fuse.py) give the numbers of the rows
   they fuse, to the bit, and with fusion off the ``replay`` leg passes (fused vs unfused
   vs torch).

Never a wrong number: a failing program is shrunk and printed as runnable code with its
seed. Programs that ``trace`` refuses with a clear error count as not applicable; their
count must stay small, and every leg must run on a minimum number of programs.
"""
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import traceback
import warnings

import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")

from harness import replay_forms as RF  # noqa: E402
from harness.programs import helpers, shrink, well_defined  # noqa: E402
from test_differential import NotApplicable, compare  # noqa: E402

RTOL = 1e-10
HIGH_RTOL = 1e-8      # second and third order compound ulps of libm
SAME_RTOL = 1e-12     # replay against replay (batched vs single, parallel, cuda)
MAX_REFUSED = 0.1     # the share of programs trace may refuse (clearly)
TESTS = os.path.dirname(os.path.abspath(__file__))


# --- programs as traced functions ----------------------------------------------------------

def rg_of(prog):
    """The indices of the inputs that require grad: the traced function's arguments."""
    return [i for i, (_, r) in enumerate(prog.inputs) if r]


def at(prog, vals):
    """``prog`` with input values ``vals`` (same shapes)."""
    return dataclasses.replace(prog, inputs=[(v, r) for v, (_, r) in zip(vals, prog.inputs)])


def traced_fn(prog, M, out="y"):
    """``prog`` as a function of its inputs that require grad (the others are constants):
    returning the loss (``out="y"``) or the tuple of its intermediate nodes."""
    f = prog.function(M)
    H = helpers(M)
    rg = rg_of(prog)
    n_in = len(prog.inputs)

    def fn(*ts):
        xs = [M.tensor(v, dtype=M.float64) for v, _ in prog.inputs]
        for i, t in zip(rg, ts):
            xs[i] = t
        nodes, y = f(M, H, *xs)
        return y if out == "y" else tuple(nodes[n_in:])
    return fn


def args_of(prog, vals):
    """Replay arguments: the values of the inputs that require grad (0-d ones as floats)."""
    return [vals[i] if np.ndim(vals[i]) == 0 else np.asarray(vals[i], dtype=np.float64)
            for i in rg_of(prog)]


def directions(prog, salt):
    """Random directions shaped like the traced inputs (for hvp and vjp)."""
    rng = np.random.default_rng([prog.seed, 99, salt])
    return [np.round(rng.uniform(-1, 1, np.shape(prog.inputs[i][0])), 3) for i in rg_of(prog)]


def do_trace(fn, prog, **kw):
    """``tg.trace(fn, ...)`` at ``prog``'s inputs; NotApplicable (with the reason) when
    trace refuses the program clearly or warns that a value is frozen into it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.TraceWarning)
        try:
            return tg.trace(fn, *args_of(prog, [v for v, _ in prog.inputs]), **kw)
        except (NotImplementedError, TypeError, RuntimeError, tg.TraceWarning) as e:
            if not isinstance(e, (NotImplementedError, tg.TraceWarning)) and \
                    "trac" not in str(e):
                raise  # not a refusal that names tracing: a bug
            raise Refused(f"{type(e).__name__}: {str(e)[:70]}") from None


class Refused(NotApplicable):
    """``trace`` refused the program (a clear error or a TraceWarning)."""


def _tie_watching_helpers():
    """The harness helpers in torch, with ``H.softplus`` noting an argument at exactly its
    threshold (``beta * x == threshold``): there torch's own derivatives disagree (its
    backward takes the smooth branch, its double backward the linear one: ``<=`` against
    ``<``), so no single second derivative is torch's."""
    H = helpers(torch)
    real = H.softplus
    H.tie = False

    def softplus(x, beta, threshold):
        H.tie = H.tie or bool((x * beta == threshold).any())
        return real(x, beta, threshold)
    H.softplus = softplus
    return H


def valid_inputs(prog, modes=RF.MODES, salt=0):
    """New inputs (per mode) at which every node of ``prog`` is well defined in torch, and
    torch's first and second derivatives agree (no softplus argument at its threshold)."""
    out = []
    for mode in modes:
        vals = RF.new_inputs(prog, mode, salt)
        H = _tie_watching_helpers()
        with torch.no_grad():
            try:
                _, nodes, y = at(prog, vals).run(torch, H)
            except Exception:
                continue
        if all(well_defined(t) for t in nodes) and well_defined(y) and not H.tie:
            out.append((mode, vals))
    return out


# --- references: eager at given inputs -----------------------------------------------------

def _np(t):
    if t is None:
        return None
    if isinstance(t, torch.Tensor) and t._is_zerotensor():  # .numpy(force=True) crashes
        return np.zeros(tuple(t.shape))
    return np.array(t.detach().numpy(), dtype=np.float64)


def _grads(M, outs, ins, grad_outputs=None, **kw):
    """autograd.grad with the unused inputs' gradients as zeros (torch's materialize_grads
    gives ZeroTensors, whose .numpy() crashed torch 2.13)."""
    gs = M.autograd.grad(outs, ins, grad_outputs, allow_unused=True, **kw)
    return [M.zeros_like(x) if g is None else g for g, x in zip(gs, ins)]


def _sum(terms):
    s = None
    for t in terms:
        s = t if s is None else s + t
    return s


def eager(M, prog, vals, dirs, cots=None, third=None):
    """Eager results in library ``M`` at ``vals``: [y, *grads, *hv] with the gradient of the
    loss in the traced inputs and the Hessian-vector product with ``dirs``; with ``cots``,
    the nodes and their VJP are added; with ``third`` (directions), the third-order
    d/dx (third . H dirs) too."""
    p = at(prog, vals)
    xs, nodes, y = p.run(M)
    rg = [xs[i] for i in rg_of(prog)]
    zeros = [np.zeros(np.shape(t.detach().numpy())) for t in rg]
    out = [_np(y)]
    if y.requires_grad:
        gs = _grads(M, y, rg, create_graph=True)
        s = _sum((g * M.tensor(d, dtype=M.float64)).sum() for g, d in zip(gs, dirs))
        hv = _grads(M, s, rg, create_graph=third is not None, retain_graph=True) \
            if s.requires_grad else None
        out += [_np(g) for g in gs]
        out += [_np(h) for h in hv] if hv is not None else zeros
    else:
        hv = None
        out += zeros + zeros
    if third is not None:
        t = _sum((h * M.tensor(d, dtype=M.float64)).sum() for h, d in zip(hv, third)) \
            if hv is not None else None
        if t is not None and t.requires_grad:
            out += [_np(h) for h in _grads(M, t, rg)]
        else:
            out += zeros
    if cots is not None:
        inner = nodes[len(prog.inputs):]
        out += [_np(t) for t in inner]
        pairs = [(t, M.tensor(c, dtype=M.float64)) for t, c in zip(inner, cots)
                 if t.requires_grad]
        if pairs:
            vjp = [_np(g) for g in _grads(M, [t for t, _ in pairs], rg,
                                          [c for _, c in pairs])]
        else:
            vjp = zeros
        out += vjp + vjp + out[1:1 + len(rg)]  # the vjp, the contracted Jacobian, the grad
    return out


def finite(results):
    """Every result finite: torch's derivatives at a singular point (0 * inf in a rule, as
    atan2 at (0, 0)) are nan where replay, which never runs the rules of elements without
    an adjoint, has 0; such inputs are not compared."""
    return all(r is None or np.all(np.isfinite(r)) for r in results)


def _flat(g, n):
    """A gradient result (single or tuple) as a list of ``n`` arrays."""
    return list(g) if n > 1 else [g]


def cotangents(prog, salt=0):
    rng = np.random.default_rng([prog.seed, 77, salt])
    return [np.round(rng.uniform(-1, 1, ins.shape), 3) for ins in prog.instrs]


# --- legs ----------------------------------------------------------------------------------
# A leg ``leg(prog, stats)`` returns None (it ran and matched, or did not apply: counted in
# stats) or a string saying what differs.

class Stats:
    def __init__(self):
        self.ran = collections.Counter()       # leg -> programs compared
        self.guards = collections.Counter()    # leg -> GuardErrors met
        self.refused = collections.Counter()   # reason -> programs trace refused
        self.skipped = collections.Counter()   # (leg, reason) -> programs not applicable


def _cmp(prog, got, want, rtol, what):
    why = compare(prog, "replay", got, want, rtol)
    return None if why is None else f"{what}: {why}"


def replay_results(P, Pn, prog, vals, dirs, cots):
    """[y, *grads, *hv, *nodes, *vjp, *cots . J, *J] from the replayed programs (loss
    ``P``, nodes ``Pn``), in ``eager``'s layout."""
    a = args_of(prog, vals)
    n = len(a)
    value, g = P.value_and_grad(*a)
    _, hv = P.hvp(a, dirs)
    out = [value] + _flat(g, n) + _flat(hv, n)
    if Pn is not None:
        nodes, vj = Pn.vjp(a, tuple(cots))
        out += list(nodes) + _flat(vj, n)
        # the Jacobians: of the nodes contracted with the cotangents (the vjp again), and
        # of the loss (the gradient again)
        J = Pn.jacobian(*a)
        out += [sum(np.tensordot(c, _flat(Jo, n)[i], axes=np.ndim(c)) for c, Jo in
                    zip(cots, J)) for i in range(n)]
        out += _flat(P.jacobian(*a), n)
    return out


def leg_replay(prog, stats, modes=RF.MODES):
    """Trace at the program's inputs, replay at new ones: values, nodes, gradient, vjp, hvp
    against torch and eager tapegrad, or GuardError (then retrace=True must be right)."""
    if not rg_of(prog):
        stats.skipped[("replay", "no input requires grad")] += 1
        return None
    P = do_trace(traced_fn(prog, tg), prog)
    Pn = do_trace(traced_fn(prog, tg, "nodes"), prog) if prog.instrs else None
    cases = valid_inputs(prog, modes)
    if not cases:
        stats.skipped[("replay", "not well defined at new inputs")] += 1
        return None
    dirs = directions(prog, 0)
    cots = cotangents(prog) if Pn is not None else None
    compared = False
    for mode, vals in cases:
        want = eager(torch, prog, vals, dirs, cots)
        if not finite(want):
            stats.skipped[("replay", "torch not finite")] += 1
            continue
        try:
            got = replay_results(P, Pn, prog, vals, dirs, cots)
        except tg.GuardError:
            stats.guards["replay"] += 1
            # the other branch: retrace=True traces it there and must give torch's numbers
            Pr = do_trace(traced_fn(prog, tg), prog, retrace=True)
            Pnr = do_trace(traced_fn(prog, tg, "nodes"), prog, retrace=True) \
                if Pn is not None else None
            got = replay_results(Pr, Pnr, prog, vals, dirs, cots)
        why = _cmp(prog, got, want, HIGH_RTOL, f"replay at {mode} inputs vs torch")
        if why:
            return why
        mine = eager(tg, prog, vals, dirs, cots)
        why = _cmp(prog, got, mine, HIGH_RTOL, f"replay at {mode} inputs vs tapegrad eager")
        if why:
            return why
        compared = True
    if compared:
        stats.ran["replay"] += 1
    return None


def _stack(prog, samples):
    """Batched arguments: every traced input with a leading batch axis."""
    per = [args_of(prog, vals) for vals in samples]
    return [np.stack([np.asarray(p[k], dtype=np.float64) for p in per])
            for k in range(len(per[0]))]


def leg_batched(prog, stats, parallel=False):
    """A batch of new inputs: equals the single calls (values, gradient, hvp) and torch at
    each sample; ``parallel``: the parallel target equals the serial batch."""
    if not rg_of(prog):
        return None
    P = do_trace(traced_fn(prog, tg), prog)
    cases = valid_inputs(prog, ("noise", "flip", "ties"), salt=1) + \
        valid_inputs(prog, ("noise",), salt=2)
    if len(cases) < 2:
        stats.skipped[("batched", "not well defined at new inputs")] += 1
        return None
    dirs = directions(prog, 1)
    samples = [vals for _, vals in cases if finite(eager(torch, prog, vals, dirs))]
    if len(samples) < 2:
        stats.skipped[("batched", "torch not finite")] += 1
        return None
    n = len(dirs)
    X = _stack(prog, samples)
    V = [np.stack([d] * len(samples)) for d in dirs]
    singles, guarded = [], []
    for vals in samples:
        try:
            singles.append(replay_results(P, None, prog, vals, dirs, None))
        except tg.GuardError:
            guarded.append(vals)
    if guarded:
        stats.guards["batched"] += 1
        try:
            P.value_and_grad(*X)
        except tg.GuardError as e:
            if "sample" not in str(e):
                return f"batched GuardError names no sample: {e}"
        else:
            return "a sample's single call raised GuardError, the batched call did not"
        # retrace=True: a variant per branch; the samples that fail the first variant's
        # guards run the others (values, gradient, hvp, Jacobian)
        Pr = do_trace(traced_fn(prog, tg), prog, retrace=True)
        value, g = Pr.value_and_grad(*X)
        _, hv = Pr.hvp(X, V)
        J = _flat(Pr.jacobian(*X), n)
        got = [value] + _flat(g, n) + _flat(hv, n)
        for b, vals in enumerate(samples):
            mine = [r[b] for r in got]
            why = _cmp(prog, mine, eager(torch, prog, vals, dirs), HIGH_RTOL,
                       f"retraced batch sample {b} vs torch") or \
                _cmp(prog, [j[b] for j in J], mine[1:1 + n], SAME_RTOL,
                     f"retraced batch sample {b}: jacobian vs gradient")
            if why:
                return why
        stats.ran["batched_retrace"] += 1
        return None
    value, g = P.value_and_grad(*X)
    _, hv = P.hvp(X, V)
    got = [value] + _flat(g, n) + _flat(hv, n)
    why = _cmp(prog, _flat(P.jacobian(*X), n), _flat(g, n), SAME_RTOL,
               "batched jacobian vs batched gradient")
    if why:
        return why
    for b, (vals, one) in enumerate(zip(samples, singles)):
        mine = [r[b] for r in got]
        why = _cmp(prog, mine, one, SAME_RTOL, f"batched sample {b} vs a single call")
        if why:
            return why
        why = _cmp(prog, mine, eager(torch, prog, vals, dirs), HIGH_RTOL,
                   f"batched sample {b} vs torch")
        if why:
            return why
    if parallel:
        # blocks of one sample: the batch (a few samples) spreads over the thread pool, as a
        # batch above one default block does (one block runs serially)
        Pp = P.to("parallel")
        Pp.block = 1
        from tapegrad.interpreters import replay_cpu  # a batch of any work spreads here
        saved = replay_cpu.PARALLEL_WORK, replay_cpu.ADAPT
        replay_cpu.PARALLEL_WORK, replay_cpu.ADAPT = 0, False
        try:
            value_p, g_p = Pp.value_and_grad(*X)
            _, hv_p = Pp.hvp(X, V)
            jac_p = Pp.jacobian(*X)
        finally:
            replay_cpu.PARALLEL_WORK, replay_cpu.ADAPT = saved
        why = _cmp(prog, [value_p] + _flat(g_p, n) + _flat(hv_p, n) +
                   _flat(jac_p, n), got + _flat(g, n), SAME_RTOL,
                   "parallel target vs serial batch")
        if why:
            return why
        stats.ran["parallel"] += 1
    stats.ran["batched"] += 1
    return None


def leg_higher(prog, stats):
    """grad_program(): its value is the gradient, its vjp with w is H w; the grad
    program's own grad_program(w) is H w as a program, whose vjp with u is the third-order
    d/dx (u . H w): against torch's double and triple backward at new inputs."""
    if not rg_of(prog):
        return None
    P = do_trace(traced_fn(prog, tg), prog)
    cases = valid_inputs(prog, ("noise", "ties"), salt=3)
    if not cases:
        stats.skipped[("higher", "not well defined at new inputs")] += 1
        return None
    w, u = directions(prog, 3), directions(prog, 4)
    n = len(w)
    compared = False
    for mode, vals in cases:
        want = eager(torch, prog, vals, w, third=u)
        if not finite(want):
            stats.skipped[("higher", "torch not finite")] += 1
            continue
        a = args_of(prog, vals)
        try:
            G = P.grad_program()
            g = G(*a)
            _, hw = G.vjp(a, tuple(w) if n > 1 else w[0])
            G2 = G.grad_program(tuple(w) if n > 1 else w[0])
            hw2 = G2(*a)
            _, third = G2.vjp(a, tuple(u) if n > 1 else u[0])
        except tg.GuardError:
            stats.guards["higher"] += 1
            continue
        got = [want[0]] + _flat(g, n) + _flat(hw, n) + _flat(third, n)
        # torch rounds the gradients through a float32 cast to float32, replay computes in
        # float64: third order amplifies that difference
        why = _cmp(prog, got, want, 1e-3 if prog.has_cast else HIGH_RTOL,
                   f"grad_program at {mode} inputs vs torch")
        if why:
            return why
        why = _cmp(prog, _flat(hw2, n), _flat(hw, n), HIGH_RTOL,
                   "grad_program(w) of the grad program vs its vjp with w")
        if why:
            return why
        compared = True
    if compared:
        stats.ran["higher"] += 1
    return None


def entry_results(M, prog, vals, dirs, batch=None):
    """A program (in torch: the function itself) traced at ``prog``'s inputs, called on
    tensors at ``vals`` inside eager code: the loss after it, the gradient and a
    create_graph Hessian-vector product through the ``program`` entry. ``batch``: a list
    of input values called as one batch (leading axis; torch calls the function per
    sample)."""
    fn = traced_fn(prog, M, "nodes")
    P = fn if M is torch else do_trace(fn, prog)
    if batch is None:
        xs = [M.tensor(v, dtype=M.float64, requires_grad=True) for v in args_of(prog, vals)]
        outs = P(*xs)
    else:
        xs = [M.tensor(v, dtype=M.float64, requires_grad=True) for v in _stack(prog, batch)]
        if M is torch:
            per = [fn(*[x[b] for x in xs]) for b in range(len(batch))]
            outs = [torch.stack(list(o)) for o in zip(*per)]
        else:
            outs = P(*xs)
    rng = np.random.default_rng([prog.seed, 55])
    loss = _sum(M.sin(o * float(rng.uniform(0.5, 1.5))).sum() for o in outs)
    if not loss.requires_grad:
        raise NotApplicable("the nodes do not depend on an input that requires grad")
    gs = _grads(M, loss, xs, create_graph=True)
    if batch is not None:
        dirs = [np.stack([d] * len(batch)) for d in dirs]
    s = _sum((g * M.tensor(d, dtype=M.float64)).sum() for g, d in zip(gs, dirs))
    hv = _grads(M, s, xs) if s.requires_grad else [M.zeros_like(x) for x in xs]
    return [_np(loss)] + [_np(g) for g in gs] + [_np(h) for h in hv]


def entry_grads_batched(M, prog, vals, keep):
    """Gradients of the nodes ``keep`` (a traced program's outputs, called on tensors)
    seeded with a batch of 3 cotangents each (is_grads_batched: the program entry's batch
    rule)."""
    fn = traced_fn(prog, M, "nodes")
    P = fn if M is torch else do_trace(fn, prog)
    xs = [M.tensor(v, dtype=M.float64, requires_grad=True) for v in args_of(prog, vals)]
    outs = [o for k, o in enumerate(P(*xs)) if k in keep]
    if not outs:
        raise NotApplicable("no node requires grad")
    rng = np.random.default_rng([prog.seed, 56])
    seeds = [M.tensor(np.round(rng.uniform(-1, 1, (3,) + tuple(o.shape)), 3),
                      dtype=M.float64) for o in outs]
    gs = M.autograd.grad(outs, xs, seeds, is_grads_batched=True, allow_unused=True)
    return [np.zeros((3,) + tuple(x.shape)) if g is None else _np(g) for g, x in zip(gs, xs)]


def leg_entry(prog, stats):
    if not rg_of(prog) or not prog.instrs:
        return None
    cases = valid_inputs(prog, ("noise", "flip"), salt=5)
    if not cases:
        stats.skipped[("entry", "not well defined at new inputs")] += 1
        return None
    dirs = directions(prog, 5)
    compared = False
    for mode, vals in cases:
        try:
            want = entry_results(torch, prog, vals, dirs)
        except NotApplicable as e:
            stats.skipped[("entry", str(e)[:60])] += 1
            return None
        if not finite(want):
            stats.skipped[("entry", "torch not finite")] += 1
            continue
        try:
            got = entry_results(tg, prog, vals, dirs)
        except tg.GuardError:
            stats.guards["entry"] += 1
            continue
        why = _cmp(prog, got, want, HIGH_RTOL, f"program entry at {mode} inputs vs torch")
        if why:
            return why
        compared = True
    if compared and len(cases) > 1:  # a batched call on tensors (a batched program entry)
        batch = [vals for _, vals in cases]
        want = entry_results(torch, prog, None, dirs, batch)
        try:
            got = entry_results(tg, prog, None, dirs, batch)
        except tg.GuardError:
            stats.guards["entry"] += 1
        else:
            if finite(want):
                why = _cmp(prog, got, want, HIGH_RTOL, "a batched program entry vs torch")
                if why:
                    return why
                stats.ran["entry_batched"] += 1
    if compared:
        vals = cases[0][1]
        with torch.enable_grad():  # the nodes that depend on the inputs, as torch says
            nodes = traced_fn(prog, torch, "nodes")(
                *[torch.tensor(v, dtype=torch.float64, requires_grad=True)
                  for v in args_of(prog, vals)])
        keep = {k for k, o in enumerate(nodes) if o.requires_grad}
        try:
            want = entry_grads_batched(torch, prog, vals, keep)
        except Exception:  # torch's vmap does not cover every op
            want = None
        if want is not None and finite(want):
            try:
                got = entry_grads_batched(tg, prog, vals, keep)
            except tg.GuardError:
                got = None
            if got is not None:
                why = _cmp(prog, got, want, RTOL, "is_grads_batched through a program entry")
                if why:
                    return why
                stats.ran["entry_grads_batched"] += 1
    if compared:
        stats.ran["entry"] += 1
    return None


def leg_cuda(prog, stats):
    """target="cuda" (run where NUMBA_ENABLE_CUDASIM=1 was set before numba.cuda was
    imported: the subprocess of test_replay_leg_cuda) equals the CPU replay: a batch and a
    single sample, values, gradient, hvp and Jacobian; a guard fails on both or neither."""
    if not rg_of(prog):
        return None
    P = do_trace(traced_fn(prog, tg), prog)
    samples = [vals for _, vals in valid_inputs(prog, ("noise", "flip"), salt=6)]
    if len(samples) < 2:
        stats.skipped[("cuda", "not well defined at new inputs")] += 1
        return None
    dirs = directions(prog, 6)
    n = len(dirs)
    X = _stack(prog, samples)
    V = [np.stack([d] * len(samples)) for d in dirs]
    Pc = P.to("cuda")
    results = []
    for prg in (P, Pc):
        try:
            value, g = prg.value_and_grad(*X)
            _, hv = prg.hvp(X, V)
            v1, g1 = prg.value_and_grad(*args_of(prog, samples[0]))
            results.append([value] + _flat(g, n) + _flat(hv, n) + [v1] + _flat(g1, n) +
                           _flat(prg.jacobian(*X), n))
        except tg.GuardError:
            results.append("GuardError")
    if results[0] == "GuardError" or results[1] == "GuardError":
        if results[0] != results[1]:
            return f"cuda: {'cpu' if results[0] == 'GuardError' else 'cuda'} alone raised " \
                   f"GuardError"
        stats.guards["cuda"] += 1
        return None
    why = _cmp(prog, results[1], results[0], SAME_RTOL, "cuda target vs cpu target")
    if why:
        return why
    stats.ran["cuda"] += 1
    return None


def _arrays_of(P):
    return any(c.arrays for c in P._variants)


def leg_arrays(prog, stats):
    """Array instructions (tapegrad/interpreters/program_arrays.py): the program traced
    with every run of 4 elements or more as one instruction (1) equals the same program
    traced as scalar rows (values, gradient, hvp, Jacobian, grad_program and its vjp, a
    batch), and (2) passes the replay, batched and higher legs against torch."""
    if not rg_of(prog):
        return None
    with RF.array_instructions(4):
        P = do_trace(traced_fn(prog, tg), prog)
    if not _arrays_of(P):
        stats.skipped[("arrays", "no run of 4 elements")] += 1
        return None
    with RF.array_instructions(1 << 62):
        S = do_trace(traced_fn(prog, tg), prog)
    assert not _arrays_of(S)
    cases = valid_inputs(prog, ("noise", "ties"), salt=6)
    if not cases:
        stats.skipped[("arrays", "not well defined at new inputs")] += 1
        return None
    dirs = directions(prog, 6)
    n = len(dirs)

    def results(Q, a):
        value, g = Q.value_and_grad(*a)
        _, hv = Q.hvp(a, dirs)
        G = Q.grad_program()
        _, hw = G.vjp(a, tuple(dirs) if n > 1 else dirs[0])
        return [value] + _flat(g, n) + _flat(hv, n) + _flat(Q.jacobian(*a), n) + \
            _flat(G(*a), n) + _flat(hw, n)
    for mode, vals in cases:
        a = args_of(prog, vals)
        try:
            got, want = results(P, a), results(S, a)
        except tg.GuardError:
            stats.guards["arrays"] += 1
            continue
        why = _cmp(prog, got, want, HIGH_RTOL, f"array instructions at {mode} inputs vs "
                   f"scalar rows")
        if why:
            return why
    X = _stack(prog, [vals for _, vals in cases])
    try:
        got = [P.value_and_grad(*X)[0]] + _flat(P.grad(*X), n)
        want = [S.value_and_grad(*X)[0]] + _flat(S.grad(*X), n)
    except tg.GuardError:
        got = want = []
    why = _cmp(prog, got, want, SAME_RTOL, "batch of array instructions vs scalar rows")
    if why:
        return why
    with RF.array_instructions(4):
        for leg in (leg_replay, leg_batched, leg_higher):
            why = leg(prog, Stats())
            if why:
                return why
    stats.ran["arrays"] += 1
    return None


def _fused_results(prog, cases, dirs, fused):
    """The one-sample results of ``prog`` traced and first called with superinstructions
    on or off (tapegrad/interpreters/fuse.py): value, gradient, hvp, the gradient program's
    outputs per case ("guard" where a guard fails), and whether any row pair was fused."""
    from tapegrad.interpreters import fuse
    saved = fuse.ENABLED, fuse.MIN_PAIRED, fuse.TIER
    fuse.ENABLED, fuse.MIN_PAIRED, fuse.TIER = fused, 0.0, 0  # every pair, at the first call
    try:
        Q = do_trace(traced_fn(prog, tg), prog)
        n, out = len(dirs), []
        for _, vals in cases:
            a = args_of(prog, vals)
            try:
                value, g = Q.value_and_grad(*a)
                _, hv = Q.hvp(a, dirs)
                out += [value] + _flat(g, n) + _flat(hv, n) + _flat(Q.grad_program()(*a), n)
            except tg.GuardError:
                out.append("guard")
        any_fused = any(c.frows is not None and (c.frows[:, 0] >= fuse.BASE).any()
                        for c in Q._variants)
        return out, any_fused
    finally:
        fuse.ENABLED, fuse.MIN_PAIRED, fuse.TIER = saved


def leg_fused(prog, stats):
    """Superinstructions: a program whose one-sample calls run fused row pairs gives the
    numbers of the same program run as traced, to the bit (the same operations in the same
    order), and with fusion off the replay leg passes against torch (the other legs run
    fused rows: the default)."""
    from tapegrad.interpreters import fuse
    if not rg_of(prog):
        return None
    cases = valid_inputs(prog, ("noise", "ties"), salt=7)
    if not cases:
        stats.skipped[("fused", "not well defined at new inputs")] += 1
        return None
    dirs = directions(prog, 7)
    got, fused = _fused_results(prog, cases, dirs, True)
    want, _ = _fused_results(prog, cases, dirs, False)
    for a, b in zip(got, want):
        if isinstance(a, str) or isinstance(b, str):
            same = a == b
        else:
            a, b = np.asarray(a), np.asarray(b)
            same = a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
        if not same:
            return f"fused rows vs rows as traced: {a!r} != {b!r}"
    saved, fuse.ENABLED = fuse.ENABLED, False
    try:
        why = leg_replay(prog, Stats())
    finally:
        fuse.ENABLED = saved
    if why:
        return f"rows as traced (no superinstructions): {why}"
    if fused:
        stats.ran["fused"] += 1
    else:
        stats.skipped[("fused", "no row pair to fuse")] += 1
    return None


LEGS = {"replay": leg_replay, "batched": leg_batched, "higher": leg_higher,
        "entry": leg_entry, "cuda": leg_cuda, "arrays": leg_arrays,
        "fused": leg_fused}


# --- running, shrinking, reporting ---------------------------------------------------------

def check(leg, prog, stats, **kw):
    """None, or how ``leg`` fails on ``prog`` (an unexpected exception is a failure)."""
    try:
        return LEGS[leg](prog, stats, **kw)
    except Refused as e:
        stats.refused[str(e)] += 1
        return None
    except NotApplicable as e:
        stats.skipped[(leg, str(e)[:60])] += 1
        return None
    except Exception as e:
        return "raised " + "".join(traceback.format_exception_only(e)).strip()[:400]


DRIVER = '''\
rg = {rg}
new = {new}
dirs = {dirs}


def fn(*ts):
    xs = [M.tensor(v, dtype=M.float64) for v in {old}]
    for i, t in zip(rg, ts):
        xs[i] = t
    return program(M, H, *xs)[1]


if M is tapegrad:
    P = tapegrad.trace(fn, *[np.asarray(xs[i].detach().numpy()) for i in rg])
    a = [np.asarray(new[i]) for i in rg]
    print("replay", P.value_and_grad(*a), P.hvp(a, [np.asarray(d) for d in dirs]))
ts = [M.tensor(new[i], dtype=M.float64, requires_grad=True) for i in rg]
y = fn(*ts)
gs = M.autograd.grad(y, ts, create_graph=True, allow_unused=True, materialize_grads=True)
s = sum((g * M.tensor(d, dtype=M.float64)).sum() for g, d in zip(gs, dirs))
print(M.__name__, y, gs, M.autograd.grad(s, ts, allow_unused=True, materialize_grads=True))'''


def report(leg, prog, why, **kw):
    """The assertion message: the seed, the failure, the shrunk program as code."""
    small = shrink(prog, lambda p: check(leg, p, Stats(), **kw) is not None, budget=120)
    why_small = check(leg, small, Stats(), **kw) or why
    m = re.search(r"at (\w+) inputs", why_small)
    mode = m.group(1) if m and m.group(1) in RF.MODES else "noise"
    vals = RF.new_inputs(small, mode, {"replay": 0, "higher": 3, "entry": 5}.get(leg, 1))
    driver = DRIVER.format(rg=rg_of(small), old=[np.asarray(v).tolist() for v, _ in
                                                  small.inputs],
                           new=[np.asarray(v).tolist() for v in vals],
                           dirs=[d.tolist() for d in directions(small, 0)])
    return (f"seed {prog.seed}: replay leg {leg!r}: {why}\n--- shrunk to {len(small.instrs)} "
            f"instructions ({why_small}); driver at the {mode!r} inputs ---\n"
            f"{small.code(driver)}")


def program_for(seed, n_ops):
    """The program of ``seed``: every third one has 0-d inputs only (scalar programs,
    where Python branches compare a node directly)."""
    if seed % 3 == 0:
        return RF.generate(seed, n_ops, shapes=[()])
    return RF.generate(seed, n_ops)


def run_legs(seeds, legs, n_ops=(5, 14), parallel=0, gen=None):
    """Every leg in ``legs`` on the programs of ``seeds`` (``gen(seed, n_ops)``, default
    ``program_for``); fails with a shrunk reproducer."""
    stats = Stats()
    lo, hi = n_ops
    progs = 0
    for seed in seeds:
        prog = (gen or program_for)(seed, lo + seed % (hi - lo + 1))
        progs += 1
        for leg in legs:
            kw = {}
            if leg == "batched" and stats.ran["parallel"] < parallel:
                kw["parallel"] = True
            why = check(leg, prog, stats, **kw)
            if why is not None:
                pytest.fail(report(leg, prog, why, **kw), pytrace=False)
    refused = sum(stats.refused.values())
    assert refused <= MAX_REFUSED * progs * len(legs), (
        f"trace refused {refused} of {progs} programs x legs: {dict(stats.refused)}")
    return stats


def assert_ran(stats, minimum):
    short = {leg: (stats.ran[leg], m) for leg, m in minimum.items() if stats.ran[leg] < m}
    assert not short, (f"replay legs ran on fewer programs than required (ran, minimum): "
                       f"{short}; skipped: {dict(stats.skipped)}; refused: "
                       f"{dict(stats.refused)}; guards: {dict(stats.guards)}")


CUDA_SCRIPT = """
import json, sys
import test_differential_replay as T
stats, fails = T.Stats(), []
for seed in SEEDS:
    prog = T.program_for(seed, 4 + seed % 7)
    why = T.check("cuda", prog, stats)
    if why is not None:
        fails.append([seed, why])
print("RESULT " + json.dumps({"ran": stats.ran["cuda"], "fails": fails,
                              "refused": dict(stats.refused),
                              "skipped": {str(k): v for k, v in stats.skipped.items()}}))
"""


def run_cuda(seeds):
    """The cuda leg in a subprocess with numba's CUDA simulator (set before numba.cuda is
    imported); returns its result dict."""
    pytest.importorskip("numba_cuda", reason="the CUDA target needs pip install "
                                             "'tapegrad[cuda]'")
    root = os.path.dirname(TESTS)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([root, TESTS, os.environ.get("PYTHONPATH", "")]))
    code = CUDA_SCRIPT.replace("SEEDS", repr(list(seeds)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, cwd=root, timeout=1200)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


# --- tiers ---------------------------------------------------------------------------------

def test_replay_forms_reach_branches_and_ties():
    progs = [RF.generate(s, 12) for s in range(40)]
    forms = collections.Counter(i.form for p in progs for i in p.instrs)
    assert forms["branch"] >= 5 and forms["tie"] >= 5, forms
    # the extra forms are registered only while the replay legs generate
    from harness import programs
    assert "branch" not in programs.ARRAY_FORMS


DEFAULT = {"replay": 150, "batched": 60, "higher": 60, "entry": 80, "fused": 60}


@pytest.mark.parametrize("leg", list(DEFAULT))
def test_replay_leg(leg):
    n = DEFAULT[leg]
    stats = run_legs(range(40_000, 40_000 + n), [leg], parallel=12)
    extra = {"batched": {"parallel": 12, "batched_retrace": 2},
             "entry": {"entry_batched": n // 3, "entry_grads_batched": n // 3}}.get(leg, {})
    assert_ran(stats, {leg: int(n * 0.6), **extra})
    if leg == "replay":  # the programs flip branches: some guards must have fired
        assert stats.guards["replay"] >= 1, dict(stats.guards)


def surface_program(seed, n_ops):
    """A program of torch's wider surface (einsum, linalg.norm, sort, cross, repeat_interleave,
    in-place methods...) that a trace can hold, with the replay forms."""
    from harness import programs as P
    return RF.generate(seed, n_ops, forms=RF.SURFACE_REPLAY_FORMS + ["branch", "tie", "reduce",
                                                                     "getitem"],
                       shapes=P.FAMILIES["surface"]["shapes"])


SURFACE_DEFAULT = {"replay": 50, "higher": 25, "entry": 25}


@pytest.mark.parametrize("leg", list(SURFACE_DEFAULT))
def test_replay_leg_surface(leg):
    n = SURFACE_DEFAULT[leg]
    stats = run_legs(range(45_000, 45_000 + n), [leg], gen=surface_program)
    assert_ran(stats, {leg: int(n * 0.6)})


@pytest.mark.slow
@pytest.mark.parametrize("leg", list(DEFAULT))
def test_replay_leg_surface_slow(leg):
    stats = run_legs(range(46_000, 46_300), [leg], gen=surface_program)
    assert_ran(stats, {leg: 150})


@pytest.mark.parametrize("form", ["remainder", "multigammaln"])
def test_untraceable_surface_forms_raise_a_clear_error(form):
    # custom Functions computed by NumPy: trace says so and records nothing
    from harness import programs as P
    assert form in P.UNTRACEABLE_SURFACE
    fn = {"remainder": [lambda v: (v % 2.0).sum(), lambda v: tg.fmod(v, 2.0).sum(),
                        lambda v: (v // 2.0).sum(), lambda v: tg.remainder(v, v.exp()).sum()],
          "multigammaln": [lambda v: tg.special.multigammaln(v.exp(), 2).sum()]}[form]
    for f in fn:
        with pytest.raises(NotImplementedError, match="compute it outside the traced function"):
            tg.trace(f, np.ones(3))


def test_replay_leg_arrays():
    stats = run_legs(range(43_000, 43_060), ["arrays"])
    assert_ran(stats, {"arrays": 20})


def test_replay_leg_arrays_found_by_the_slow_tier():
    # seed 44074: the reverse plan tested a step of reductions and the scalar adds after
    # them for inactive reductions before checking it held reductions only, reading a
    # head past the rows' end (IndexError)
    run_legs([44074], ["arrays"])
    # seed 44098: prune_arrays marked the last slot needed through an absent operand's span
    # (-1, -1), so a dropped last instruction's slot was numbered past the kept ones and the
    # dead-adjoint cut's renumbering indexed past its end (IndexError)
    run_legs([44098], ["arrays"])


@pytest.mark.slow
def test_replay_leg_arrays_slow():
    stats = run_legs(range(44_000, 44_500), ["arrays"])
    assert_ran(stats, {"arrays": 150})


def _cuda_tier(seeds, minimum):
    got = run_cuda(seeds)
    for seed, why in got["fails"]:
        prog = program_for(seed, 4 + seed % 7)
        rerun = (f"PYTHONPATH=.:tests NUMBA_ENABLE_CUDASIM=1 python -c 'import "
                 f"test_differential_replay as T; print(T.check(\"cuda\", "
                 f"T.program_for({seed}, {4 + seed % 7}), T.Stats()))'")
        pytest.fail(f"seed {seed}: replay leg 'cuda': {why}\n--- rerun it from the "
                    f"repository root: {rerun} ---\n{prog.code()}", pytrace=False)
    assert got["ran"] >= minimum, got


def test_replay_leg_cuda():
    _cuda_tier(range(60_000, 60_006), 4)


@pytest.mark.slow
def test_replay_leg_cuda_slow():
    _cuda_tier(range(61_000, 61_150), 100)


@pytest.mark.slow
@pytest.mark.parametrize("block", range(4))
@pytest.mark.parametrize("leg", list(DEFAULT))
def test_replay_leg_slow(leg, block):
    base = 500_000 + block * 500
    stats = run_legs(range(base, base + 500), [leg], parallel=20)
    assert_ran(stats, {leg: 250})


# --- regressions: what the replay legs found -----------------------------------------------

def _replay_vs_torch(fn, examples, new, dirs):
    """(replay, torch) results: value, gradient and hvp of ``fn`` traced at ``examples``
    and called at ``new``."""
    P = tg.trace(lambda *xs: fn(tg, *xs), *examples)
    v, g = P.value_and_grad(*new)
    _, hv = P.hvp(list(new), list(dirs))
    n = len(new)
    got = [v] + _flat(g, n) + _flat(hv, n)
    ts = [torch.tensor(x, requires_grad=True) for x in new]
    y = fn(torch, *ts)
    gs = torch.autograd.grad(y, ts, create_graph=True)
    s = _sum((gi * torch.tensor(d)).sum() for gi, d in zip(gs, dirs))
    hs = torch.autograd.grad(s, ts)
    return got, [_np(y)] + [_np(t) for t in gs] + [_np(t) for t in hs]


def test_setitem_with_a_repeated_index_gives_each_occurrence_the_gradient():
    # seed 40126: v[[2, 1, 2]] = value: torch (and eager) give the value the gradient of
    # every occurrence (3 g), replay gave it per position written (2 g)
    def f(M, x, z):
        v = x.clone()
        v[[2, 1, 2]] = M.tanh(z).mean()
        w = x.clone()
        w[[0, 0]] = z[:2] * z[:2]  # an array value: the first occurrence's gradient too
        return (v * v).sum() + (w * x).sum()
    got, want = _replay_vs_torch(f, (np.zeros(3), np.zeros(3)),
                                 (np.array([0.3, -0.2, 0.5]), np.array([0.1, 0.7, -0.4])),
                                 (np.array([0.2, 0.1, -0.3]), np.array([0.5, -0.1, 0.2])))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)

    def g(M, x):  # seed 40332: rows of a broadcast (not C-contiguous) value
        v = x.expand((2, 4)).clone()
        v[[0, 0, 0]] = M.tanh(x).mean()
        return (v * v).sum()
    got, want = _replay_vs_torch(g, (np.zeros(4),), (np.array([0.3, -0.2, 0.5, 0.1]),),
                                 (np.array([0.2, 0.1, -0.3, 0.4]),))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_where_of_constants_on_a_traced_condition_is_recomputed():
    # seed 500094: where(x0 > c, a, b) with a and b independent of the inputs was not
    # recorded: replay returned the branch chosen while tracing at every input
    a, b = np.array([1.0, 2.0]), np.array([-3.0, 4.0])

    def f(x):
        return (tg.where(x > -0.13, tg.tensor(a), tg.tensor(b)) * x).sum() + \
            tg.where(x.sum() > 0.0, tg.tensor(2.0), tg.tensor(5.0))
    P = tg.trace(f, np.array([0.9, -0.5]))
    for x in (np.array([0.9, -0.5]), np.array([-0.9, 0.5]), np.array([-1.0, -2.0])):
        xt = torch.tensor(x, requires_grad=True)
        want = (torch.where(xt > -0.13, torch.tensor(a), torch.tensor(b)) * xt).sum() + \
            torch.where(xt.sum() > 0.0, torch.tensor(2.0), torch.tensor(5.0))
        v, g = P.value_and_grad(x)
        assert v == pytest.approx(want.item(), rel=1e-14)
        np.testing.assert_allclose(g, torch.autograd.grad(want, xt)[0].numpy(), rtol=1e-14)


def test_batched_program_entry_with_an_empty_output_under_create_graph():
    # seed 40046: an output with no elements made the seed matrix reshape(-1, 0) fail
    P = tg.trace(lambda x: (x[tg.tensor([False, False])], (x * x).sum()), np.zeros((2, 1)))
    X = np.array([[[0.5], [0.1]], [[-0.3], [0.2]]])
    x = tg.tensor(X, requires_grad=True)
    empty, s = P(x)
    assert tuple(empty.shape) == (2, 0, 1)
    (g,) = tg.autograd.grad(empty.sum() + (s * s).sum(), x, create_graph=True)
    (h,) = tg.autograd.grad(g.sum(), x)
    np.testing.assert_allclose(g.detach().numpy(), 4 * X * (X * X).sum(axis=(1, 2), keepdims=True),
                               rtol=1e-14)
    xt = torch.tensor(X, requires_grad=True)
    gt, = torch.autograd.grad(((xt * xt).sum((1, 2)) ** 2).sum(), xt, create_graph=True)
    np.testing.assert_allclose(h.numpy(), torch.autograd.grad(gt.sum(), xt)[0].numpy(),
                               rtol=1e-13)


def test_reductions_over_an_empty_kept_dim_trace():
    # seed 502133: log_softmax over dim 1 of a (0, 3) value: lowering's reduce could not
    # infer the reduced size (reshape(0, -1)) and trace raised ValueError
    def f(M, x):
        e = x[M.tensor([False, False])]
        return M.log_softmax(e, 1).sum() + M.softmax(e, 1).sum() + e.sum(1).sum() + \
            M.logsumexp(e, 1).sum() + (x * x).sum()
    got, want = _replay_vs_torch(f, (np.zeros((2, 3)),), (np.arange(6.0).reshape(2, 3),),
                                 (np.ones((2, 3)),))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-14)


def test_a_cast_to_float32_rounds_in_replay():
    # seed 520299: replay dropped x.to(float32).to(float64), so x - round32(x) was 0 in
    # replay but 1e-7 eagerly, and atan2 of it gave pi instead of 6e-10; the gradient
    # through the cast is rounded to float32 too (torch's rule)
    def f(M, x):
        r = x.to(M.float32).to(M.float64)
        return ((r - x) * 1e8).sum() + (M.sin(r) * x).sum()
    x = np.array([9.393583189861767, 0.1, 1.0 / 3.0])
    got, want = _replay_vs_torch(f, (np.zeros(3),), (x,), (np.ones(3),))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    with pytest.raises(NotImplementedError, match="float16"):
        tg.trace(lambda x: x.to(tg.float16).to(tg.float64).sum(), np.zeros(2))


def test_amax_amin_of_an_empty_input_over_non_empty_dims():
    # seed 522199: amin(0) of a (2, 0, 3) value raised (torch gives a (0, 3) result); only a
    # reduction over a dim of size 0 (or over all dims) has no value, with torch's errors
    for M in (tg, torch):
        x = M.zeros(2, 0, 3, dtype=M.float64, requires_grad=True)
        assert tuple(M.amin(x, 0).shape) == (0, 3)
        assert tuple(M.amax(x, (0, 2), keepdim=True).shape) == (1, 0, 1)
        assert tuple(M.autograd.grad(M.amin(x, 0).sum(), x)[0].shape) == (2, 0, 3)
        with pytest.raises(RuntimeError, match="Expected reduction dim to be specified"):
            M.amin(x)
        with pytest.raises(IndexError, match="reduction dim 1 to have non-zero size"):
            M.amax(x, (0, 1))
    P = tg.trace(lambda x: tg.stack([x[tg.tensor([False])]] * 2).amin(0).sum() + x.sum(),
                 np.zeros((1, 3)))
    assert P.value_and_grad(np.ones((1, 3)))[0] == 3.0
