"""The batched replay (``replay_cpu.run_block``, generated): every op, looped or in the shared
loop, gives each sample exactly what a single call gives; its compiled code stays small."""
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from tapegrad.interpreters import _codegen, _codegen_batch, _generated_replay, replay_cpu
from tapegrad.ops import OPS

# operands: signed zeros, both sides of every branch point in the rules, outside the domain
# of log/sqrt/asin, and non-finite values
VALUES = [-0.0, 0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -3.0, 1e-300, 40.0, np.inf, -np.inf, np.nan]
CONSTS = {"powc": (2.5, 0.0), "rpowc": (1.5, 0.0), "clamp": (-0.5, 0.5),
          "softplus": (1.0, 20.0), "addc": (0.25, 0.0), "mulc": (-2.0, 0.0),
          "rsubc": (1.0, 0.0), "divc": (4.0, 0.0), "rdivc": (3.0, 0.0)}


def _program(op, same):
    """Rows: three leaves, then ``op`` over them (over leaf 0 in every operand if
    ``same``), then ``op`` again over its own result: an adjoint that reaches a row through
    two paths."""
    arity = len(_codegen._inputs(op))
    c0, c1 = CONSTS.get(op.name, (0.5, 0.0))
    rows = np.full((5, 6), -1.0)
    for i in range(3):
        rows[i] = (0, -1, -1, -1, i, 0)  # leaf i
    rows[:3, 0] = _generated_replay.LEAF
    slots = [0] * 3 if same else [0, 1, 2]
    rows[3, :4] = [op.code] + [slots[i] if i < arity else -1 for i in range(3)]
    rows[3, 4:] = c0, c1
    rows[4, :4] = [op.code] + [([3, 1, 2][i] if not same else 3) if i < arity else -1
                               for i in range(3)]
    rows[4, 4:] = c0, c1
    return rows


def _samples():
    """Every pair of operand values, and a third operand cycling through them."""
    a, b = np.meshgrid(VALUES, VALUES)
    a, b = a.ravel(), b.ravel()
    c = np.resize(VALUES[::-1], a.size)
    return np.stack([a, b, c])  # inputs x samples


def _check(rows, X, S, grad=True):
    out_slots = np.array([3, 4])
    in_slots = np.array([0, 1, 2])
    # the batch runs on samples in rows (X here is inputs x samples)
    status, outs, G = replay_cpu.run_batch(rows, np.ascontiguousarray(X.T), out_slots,
                                           np.ascontiguousarray(S.T), in_slots, grad, 16)
    for j in range(X.shape[1]):
        st, o, g = replay_cpu.run(rows, np.ascontiguousarray(X[:, j]), out_slots,
                                  np.ascontiguousarray(S[:, j]), in_slots, grad)
        assert status[j] == st
        _same(outs[j], o)
        _same(G[j], g)


def _same(batched, single):
    """Equal numbers: NaNs in the same places, zeros of the same sign (a NaN's sign bit
    carries no number, and the vectorized and scalar code may set it differently)."""
    np.testing.assert_array_equal(batched, single)
    num = ~np.isnan(single)
    np.testing.assert_array_equal(np.signbit(batched[num]), np.signbit(single[num]))


@pytest.mark.parametrize("same", [False, True], ids=["distinct", "same_operand"])
@pytest.mark.parametrize("op", _codegen._replay_ops(), ids=lambda op: op.name)
def test_every_op_batched_equals_single_calls(op, same):
    """A block of samples through ``run_block`` equals the one-sample interpreter at each
    sample, for the ops with a loop of their own and those in the shared loop (the
    one-sample expressions called per sample), at signed zeros, infinities and NaNs."""
    rows = _program(op, same)
    X = _samples()
    S = np.stack([np.resize([1.0, -0.0, -2.0], X.shape[1]),
                  np.resize([0.5, -1.0, 0.0, -0.0], X.shape[1])])
    _check(rows, X, S)
    _check(rows, X, S, grad=False)


def test_every_replay_op_reaches_the_batch_block():
    """Each replay op has a loop of its own or is marked for the shared loop, whose
    gradient bits are the inputs its rule gives gradients to."""
    for op in _codegen._replay_ops():
        exprs = _codegen.rule_exprs(op)
        bits = sum(1 << i for i, n in enumerate("abc") if n in exprs)
        if op.name in _codegen_batch.BATCH_LOOPED:
            assert not _generated_replay.SHARED[op.code], op.name
            if op.name in _codegen_batch.SIGNED:  # a loop with a sign, shared
                assert re.search(rf"op == {op.code}\b.*# .*\b{op.name}\b", _block_source()), \
                    op.name
            else:
                assert f"op == {op.code}:  # {op.name}" in _block_source(), op.name
        else:
            assert _generated_replay.SHARED[op.code], op.name
            assert _generated_replay.GRADS[op.code] == bits, op.name
    assert not any(_generated_replay.SHARED[op.code] for op in OPS
                   if op not in _codegen._replay_ops())


def _block_source():
    import inspect
    return inspect.getsource(_generated_replay.run_block.py_func)


def test_batch_block_stays_small():
    """Each loop over a block's samples costs about 0.1 s of a cold compile: the batch
    code has the looped ops' loops and one shared loop a sweep, not one per op (the 120
    loops of one per op made the first batched call compile 15 s cold on 2 cores)."""
    loops = _block_source().count("for j in range(u):")
    assert loops <= 2 * len(_codegen_batch.BATCH_LOOPED) + 10, loops


COLD = """
import resource, numpy as np, tapegrad
prog = tapegrad.trace(lambda x: (x.sin() * x).sum() + (x[0] - x[1]) ** 2, np.zeros(3))
r0 = resource.getrusage(resource.RUSAGE_SELF)
X = np.random.default_rng(0).normal(size=(300, 3))
v, g = prog.value_and_grad(X)
r1 = resource.getrusage(resource.RUSAGE_SELF)
assert np.allclose(g[7], prog.grad(X[7]))
print(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
"""


@pytest.mark.slow
def test_first_batched_call_compiles_in_seconds_cold():
    """With an empty Numba cache the first batched call compiles in about 5 s of CPU on
    2 cores (15 s before run_block was one function with a shared loop for rare ops);
    8 s leaves room for a loaded machine. A second process loads it from the cache."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d, TAPEGRAD_QUIET="1", PYTHONPATH=root)
        cold = float(subprocess.run([sys.executable, "-c", COLD], env=env, check=True,
                                    capture_output=True, text=True).stdout)
        warm = float(subprocess.run([sys.executable, "-c", COLD], env=env, check=True,
                                    capture_output=True, text=True).stdout)
    assert cold < 8.0, cold
    assert warm < 0.5, warm


def _mixed(x):
    a, b, c = x[0], x[1], x[2]
    return (a.sin() * b.exp() + (c * c + 1.0).sqrt().log() - a.tanh() / (b.sigmoid() + 1.0)
            + a ** 2 + b ** 3.0 - (1.0 - c) * 2.0 - (-a) / 4.0 + c.atan() + b.abs()
            + a.cos() * c ** 2)


@pytest.mark.parametrize("target", ["cpu", "parallel"])
@pytest.mark.parametrize("B", [1, 15, 16, 17, 31, 33, 37])
def test_block_edges_give_single_calls_bit_for_bit(target, B):
    """Blocks of 16: one sample, block - 1, block, block + 1, odd sizes; every sample's
    value and gradient equal a single call's bit for bit (the block's values sit at flat
    offsets ``row * samples + j``, so a block narrower than the others must use its own
    width), over the looped ops, powc at 2 (its own loop) and at 3, and the shared loop."""
    import tapegrad as tg
    prog = tg.trace(_mixed, np.array([0.3, -0.2, 0.7]), target=target)
    prog.block = 16
    X = np.random.default_rng(B).normal(size=(B, 3))
    X[0, 0] = -0.0
    v, g = prog.value_and_grad(X)
    single = tg.trace(_mixed, np.array([0.3, -0.2, 0.7]))
    for j in range(B):
        vj, gj = single.value_and_grad(X[j])
        _same(np.array([v[j]]), np.array([vj]))
        _same(g[j], gj)


@pytest.mark.parametrize("c0", [2.0, -0.0, 0.0, 1.0, 3.0, -2.0])
def test_powc_loops_give_single_calls(c0):
    """powc's loops for c0 == 2.0 (the test folded away) and for the other exponents give
    the one-sample numbers, at signed zeros, infinities and NaNs."""
    op = next(op for op in OPS if op.name == "powc")
    rows = _program(op, False)
    rows[3:, 4] = c0
    X = _samples()
    S = np.ones((2, X.shape[1]))
    _check(rows, X, S)


# --- the call of a batch (``Program._batch``): the general path's results, without its steps


def _two_in(a, b):
    return (a * b[0, 1] + b.sum() * a.sin()) ** 2


def _two_out(a, b):
    return (a * b).sum(), b * a.sum()


def _general(prog, xs, grad):
    """What ``_run`` and ``_wrap`` give for ``xs`` (the path batches took before)."""
    code, outs, grads, batch, _ = prog._run(xs, grad=grad)
    value = prog._wrap(outs, code.outputs, batch, False, code.kind)
    if not grad:
        return value
    return value, prog._wrap(grads, code.inputs, batch, False,
                             "single" if len(code.inputs) == 1 else "tuple")


def _same_results(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, tuple):
            _same_results(g, w)
            continue
        assert type(g) is type(w) and g.shape == w.shape and g.dtype == w.dtype
        assert g.flags.c_contiguous
        _same(g.ravel(), w.ravel())


@pytest.mark.parametrize("target", ["cpu", "parallel"])
@pytest.mark.parametrize("B", [1, 3, 40])
def test_batched_calls_skip_the_one_sample_paths_and_give_the_general_path(target, B,
                                                                         monkeypatch):
    """A batch of float64 ndarrays goes from ``_one`` straight to the batch interpreter (not
    through ``_run_one`` and ``_inputs``: 3 to 4 us of a small batch's call) and gives what
    the general path gives, bit for bit, shapes and layout too: one input and several,
    several outputs, C-ordered, Fortran-ordered and strided inputs, a batch of one."""
    import tapegrad as tg
    rng = np.random.default_rng(B)
    p1 = tg.trace(_mixed, np.array([0.3, -0.2, 0.7]), target=target)
    p1.block = 16
    p2 = tg.trace(_two_in, np.array(0.5), np.ones((2, 3)), target=target)
    p3 = tg.trace(_two_out, np.ones(4), np.ones(4), target=target)
    X = rng.normal(size=(B, 3))
    A, Bm = rng.normal(size=B), rng.normal(size=(B, 2, 3))
    P, Q = rng.normal(size=(B, 8))[:, ::2], np.asfortranarray(rng.normal(size=(B, 4)))
    cases = [(p1, (X,), True), (p1, (np.asfortranarray(X),), True), (p1, (X,), False),
             (p2, (A, Bm), True), (p2, (A, Bm), False), (p3, (P, Q), False)]
    want = [_general(p, xs, grad) for p, xs, grad in cases]

    def boom(*args, **kwargs):
        raise AssertionError("a batch went through the one-sample or the general path")
    for p, _, _ in cases:
        monkeypatch.setattr(p, "_run_one", boom)
        monkeypatch.setattr(p, "_inputs", boom)
    for (p, xs, grad), w in zip(cases, want):
        _same_results(p.value_and_grad(*xs) if grad else p(*xs), w)


def test_batch_results_do_not_alias_the_kept_seeds_or_the_inputs():
    """The seeds a program keeps for its batches are never a result: writing into one
    call's results changes neither the next call's nor the seeds; results are fresh."""
    import tapegrad as tg
    prog = tg.trace(_mixed, np.array([0.3, -0.2, 0.7]))
    X = np.random.default_rng(0).normal(size=(8, 3))
    v0, g0 = (a.copy() for a in prog.value_and_grad(X))
    v, g = prog.value_and_grad(X)
    ones = prog._code._ones
    assert ones is not None and not any(np.shares_memory(a, b) for a in (v, g)
                                        for b in (ones, X))
    v[...], g[...] = 7.0, 7.0
    v2, g2 = prog.value_and_grad(X[:5])
    _same(v2, v0[:5])
    _same(g2.ravel(), g0[:5].ravel())
    assert (prog._code._ones == 1.0).all()
    v3, _ = prog.value_and_grad(np.concatenate([X, X, X]))  # a larger batch: more seeds
    _same(v3, np.concatenate([v0, v0, v0]))


def test_a_batch_of_one_is_a_batch_and_one_sample_is_not():
    import tapegrad as tg
    prog = tg.trace(_mixed, np.array([0.3, -0.2, 0.7]))
    x = np.array([0.1, -1.5, 2.0])
    v, g = prog.value_and_grad(x)
    vb, gb = prog.value_and_grad(x[None])
    assert isinstance(v, float) and g.shape == (3,)
    assert vb.shape == (1,) and gb.shape == (1, 3)
    _same(vb, np.array([v]))
    _same(gb[0], g)
    assert prog(x[None]).shape == (1,) and isinstance(prog(x), float)


def test_wrong_batches_raise_as_before():
    """Inputs the batch path does not take fall to the general path, which says what is
    wrong: batches that disagree, wrong trailing shapes, another dtype, an empty batch."""
    import tapegrad as tg
    prog = tg.trace(_two_in, np.array(0.5), np.ones((2, 3)))
    with pytest.raises(ValueError, match="inputs disagree on the batch"):
        prog.value_and_grad(np.ones(3), np.ones((4, 2, 3)))
    with pytest.raises(ValueError, match=r"input 1 has shape \[3, 3, 2\]"):
        prog.value_and_grad(np.ones(3), np.ones((3, 3, 2)))
    with pytest.raises(TypeError, match="has dtype float32"):
        prog(np.ones(3), np.ones((3, 2, 3), dtype=np.float32))
    # an empty batch: a ValueError that says so (NumPy's reshape error before)
    for p in (prog, tg.trace(_mixed, np.array([0.3, -0.2, 0.7]))):
        xs = (np.ones(0), np.ones((0, 2, 3))) if p is prog else (np.ones((0, 3)),)
        for run in (p.value_and_grad, p):
            with pytest.raises(ValueError, match="is an empty batch .* at least one sample"):
                run(*xs)


def _branchy(x):
    return x[0] * 2.0 if x[1] > 0 else x[0] * 3.0


def test_batch_samples_that_fail_a_guard_take_the_other_variants(monkeypatch):
    """Samples that fail the first variant's guards run in the others (or raise, or
    re-trace), and the batch itself runs once."""
    import tapegrad as tg
    from tapegrad import GuardError
    X = np.array([[1.0, 1.0], [1.0, -1.0], [2.0, 1.0]])
    with pytest.raises(GuardError, match="for sample 1 of the batch"):
        tg.trace(_branchy, np.array([1.0, 1.0])).value_and_grad(X)
    prog = tg.trace(_branchy, np.array([1.0, 1.0]), retrace=True)
    v, g = prog.value_and_grad(X)
    _same(v, np.array([2.0, 3.0, 4.0]))
    _same(g.ravel(), np.array([2.0, 0.0, 3.0, 0.0, 2.0, 0.0]))
    runs, run_batch = [], replay_cpu.run_batch
    monkeypatch.setattr(replay_cpu, "run_batch", lambda *a: runs.append(1) or run_batch(*a))
    v, g = prog.value_and_grad(X)  # both variants now
    _same(v, np.array([2.0, 3.0, 4.0]))
    _same(g.ravel(), np.array([2.0, 0.0, 3.0, 0.0, 2.0, 0.0]))
    _same(prog(X[::-1]), np.array([4.0, 3.0, 2.0]))
    assert len(runs) == 2 and g.flags.c_contiguous


def _valued(x):
    return (x * x).sum() if float(x[0]) > 0 else x.cos().sum()


@pytest.mark.filterwarnings("ignore:float\\(\\) on a traced tensor")  # (its guard, meant)
def test_batch_samples_that_each_retrace_do_not_recurse():
    """A float() guard holds at one value only, so each sample of a retrace=True batch
    traces its own variant; the batch went on by running itself again, a recursion per
    such sample (a RecursionError at about 330 samples). Each sample's numbers are eager's."""
    import tapegrad as tg
    X = np.random.default_rng(4).normal(size=(150, 3))
    prog = tg.trace(_valued, np.array([0.5, 0.1, 0.2]), retrace=True)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(300)  # the old recursion needed about 3 frames per sample
    try:
        v, g = prog.value_and_grad(X)
    finally:
        sys.setrecursionlimit(limit)
    for i in range(len(X)):
        x = tg.tensor(X[i], requires_grad=True)
        y = _valued(x)
        (gx,) = tg.autograd.grad(y, x)
        _same(np.array([v[i]]), np.array([y.item()]))
        _same(g[i], gx.numpy())
