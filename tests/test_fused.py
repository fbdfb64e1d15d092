"""The fused backward of large elementwise regions (``interpreters/fused.py``): one generated
loop per shape past the flat sweep's size limit, against torch and the NumPy sweep."""
import os
import sys

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.autograd import _fast_paths as _engine, paths
from tapegrad.interpreters import cpu, fused

N = cpu.FLAT_MAX + 1001  # past the flat buffers' limit: the fused path's sizes


@pytest.fixture
def kernels(monkeypatch, tmp_path_factory):
    """Compile on first sight, into a fresh cache directory; returns the list of
    ``FUSED.applies`` results (None: declined)."""
    d = str(tmp_path_factory.mktemp("fused"))
    monkeypatch.setattr(fused, "COMPILE_AFTER", 1)
    monkeypatch.setattr(fused, "_dir", d)
    monkeypatch.syspath_prepend(d)
    real, done = _engine.FUSED.applies, []
    monkeypatch.setattr(_engine.FUSED, "applies", lambda *a: done.append(real(*a)) or done[-1])
    return done


def leaf(M, data):
    return M.tensor(data, dtype=M.float64, requires_grad=True)


def arr(t):
    return None if t is None else np.asarray(t.detach().numpy())


PROGRAMS = {
    # slices of one leaf at three offsets: two streams into its gradient, a scratch array
    "rosenbrock": lambda M, x, s: (100 * (x[1:] - x[:-1] ** 2) ** 2 + (s - x[:-1]) ** 2).sum(),
    # a 0-d leaf broadcast into the loop (its gradient is a reduction), scalar entries
    # before and after the region
    "scalar leaf": lambda M, x, s: (M.sin(x) * s ** 2 + x * M.exp(s)).sum() * s + s * s,
    # a slice of an entry of another shape: two loops, the longer one after
    "two loops": lambda M, x, s: (((x * 2.0 + s)[1:] - (x * 2.0 + s)[:-1]) ** 2).mean(),
    # where-style rules (relu, clamp, maximum), division, pow with a tensor exponent
    "rules": lambda M, x, s: (M.relu(x) + M.clamp(x, -0.5, 0.5) * M.maximum(x, s)
                              + x / (2.0 + x * x) + M.pow(M.abs(x) + 1.0, s)
                              + M.atan2(x, s + 2.0)).sum(),
    # the leaf summed directly and in several sums and means
    "sums": lambda M, x, s: x.sum() * x.mean() + (x * x).sum() - M.tanh(x).mean() * s,
    # constants a rule branches on, at their special values (pow 0 and 2, and others)
    "constants": lambda M, x, s: (x ** 0 + x ** 2 + x ** 3 + (x * x + 1.0) ** 0.5
                                  + 2.0 ** x).sum() * s,
}


def _steps(M, x, s):
    """Steps, a reversed slice of a same-shape leaf, and the leaf used directly."""
    rev = x[::-1] if M is tg else x.flip(0)  # torch has no negative steps
    back = x[-3::-2] if M is tg else x.flip(0)[2::2]
    return (x[:-1:2] * x[1::2]).sum() + (x * rev).sum() + (back * s).sum()


PROGRAMS["steps"] = _steps


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_fused_path_equals_torch_and_the_numpy_sweep(name, torch, kernels, monkeypatch):
    x0 = np.random.default_rng(len(name)).uniform(-1.2, 1.2, N)

    def run(M):
        x, s = leaf(M, x0), leaf(M, 0.7)
        return M.autograd.grad(PROGRAMS[name](M, x, s), [x, s])
    got = run(tg)
    assert kernels and kernels[-1] is not None  # the fused loops computed these
    again = run(tg)  # the plan and the kernel reused
    assert len(kernels) == 2 and kernels[-1] is not None
    monkeypatch.setattr(_engine.FUSED, "applies", lambda *a: None)
    numpy_sweep = run(tg)
    want = run(torch)
    for g in (got, again, numpy_sweep):
        for a, w in zip(g, want):
            np.testing.assert_allclose(arr(a), arr(w), rtol=1e-12, atol=1e-13)
            assert tuple(a.shape) == tuple(w.shape) and str(a.dtype) == "tapegrad.float64"


DECLINED = {
    # a mean that flows back into the region: its adjoint is not final before the loop
    "centred": lambda M, x: ((x - x.mean()) ** 2).sum(),
    "outer broadcast": lambda M, x: (x[:300].reshape(300, 1) * x[:300].reshape(1, 300)).sum()
    + (x * x).sum(),
    "sum over a dim": lambda M, x: (x * x).reshape(-1, 1).sum(0).sum(),
    "float32": lambda M, x: (x.to(M.float32) ** 2).sum().to(M.float64),
    "slice of same-shape entry": lambda M, x: ((x * 2.0)[::-1] * (x * 2.0)).sum(),
}


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_fused_path_leaves_other_programs_to_the_numpy_sweep(name, torch, kernels):
    x0 = np.linspace(-1.0, 1.3, N)

    def run(M):
        x = leaf(M, x0)
        if name == "slice of same-shape entry" and M is not tg:
            return M.autograd.grad(((x * 2.0).flip(0) * (x * 2.0)).sum(), x)
        return M.autograd.grad(DECLINED[name](M, x), x)
    got = run(tg)
    assert kernels in ([], [None])  # declined (or never asked): the NumPy sweep ran
    np.testing.assert_allclose(arr(got[0]), arr(run(torch)[0]), rtol=1e-6, atol=1e-12)


def test_fused_path_frees_the_graph_like_torch(torch, kernels):
    for M in (tg, torch):
        x = leaf(M, np.linspace(-1.0, 1.0, N))
        y = (M.sin(x[1:]) * x[:-1]).sum()
        (g1,) = M.autograd.grad(y, x, retain_graph=True)
        (g2,) = M.autograd.grad(y, x)
        np.testing.assert_array_equal(arr(g1), arr(g2))
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            M.autograd.grad(y, x)
    assert kernels[:2] != [None, None] and kernels[0] is not None


def test_a_structure_compiles_on_its_second_sight_and_is_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setattr(fused, "_dir", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(fused, "COMPILE_AFTER", 2)
    monkeypatch.setattr(fused, "_kernels", {})
    monkeypatch.setattr(fused, "_seen", {})
    x = leaf(tg, np.linspace(-1.0, 1.0, N))
    f = (x[1:] * x[:-1] * 3.25).sum()
    tape, rows = f._tape, f._tape.rows()
    ins = np.array([x._slot])
    need, reach, lo, ok = cpu._mark_scalar(rows, ins, f._slot, cpu.FLAT, f._slot)
    p = fused.plan_for(tape, rows, need, lo, f._slot + 1, ins)
    assert p is fused.plan_for(tape, rows, need, lo, f._slot + 1, ins)  # reused
    assert "3.25" not in p.text  # sizes and constants are arguments, not source
    src = p.text + "# a structure no other test uses\n"
    assert fused.kernel(src) is None  # a one-off backward compiles nothing
    assert os.listdir(tmp_path) == []
    fn = fused.kernel(src)
    assert fn is not None and fused.kernel(src) is fn
    (mod,) = [m for m in os.listdir(tmp_path) if m.endswith(".py")]
    assert mod.startswith(fused.MODULE_PREFIX) and mod[:-3] in sys.modules
    fused._kernels.clear()  # a new process finds the module on disk: no second sighting
    assert fused.kernel(src) is not None


def test_fused_path_gives_an_input_listed_twice_two_gradients(torch, kernels):
    x0 = np.linspace(-1.0, 1.0, N)
    got = {}
    for M in (tg, torch):
        x = leaf(M, x0)
        got[M] = M.autograd.grad((M.sin(x[1:]) * x[:-1]).sum(), [x, x])
    assert kernels and kernels[-1] is not None
    a, b = got[tg]
    np.testing.assert_allclose(arr(a), arr(got[torch][0]), rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(arr(a), arr(b))
    a.numpy()[0] += 1.0  # separate memory
    assert arr(b)[0] != arr(a)[0]


@pytest.mark.parametrize("index", ["gather", "row", "matmul"])
def test_fused_plan_declined_before_its_key(monkeypatch, index, torch):
    # a backward the fused loops cannot run (a gather through an index array, as ba's; a
    # row of a 2-d leaf, as lstm's; an op no loop runs) is declined before its plan key is
    # built (one item per array on the tape) or a plan tried; the gradient is torch's
    tried = []
    real = fused.plan
    monkeypatch.setattr(fused, "plan", lambda *a: tried.append(1) or real(*a))
    monkeypatch.setattr(fused, "_plans", {})
    n = cpu.FLAT_MAX + 1001
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=(2, n))
    idx = rng.integers(0, n, size=n)
    out = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        if index == "gather":
            y = (x[0][M.tensor(idx)] * 2.0 + x[1]).sum()
        elif index == "row":
            y = (x[0] * x[1] + 1.0).sum()
        else:
            y = (x @ M.tensor(x0.T)).sum()
        out.append(M.autograd.grad(y, x)[0].numpy())
    np.testing.assert_allclose(out[0], out[1], rtol=1e-12)
    assert not tried


def test_the_flat_paths_mark_is_reused_by_the_fused_path_of_the_same_call_only(
        torch, kernels, monkeypatch):
    # a 0-d input and a large constant: the flat path marks, finds its buffers too small
    # and declines; the fused path takes that mark instead of marking again, and a later
    # call (forced, or with another output) never sees it
    marks = []
    real = _engine._flat_mark
    monkeypatch.setattr(_engine, "_flat_mark", lambda *a: marks.append(1) or real(*a))
    c0 = np.linspace(-1.0, 1.0, N)
    got = []
    for M in (tg, torch):
        s, c = leaf(M, 0.7), M.tensor(c0, dtype=M.float64)
        y = (M.sin(c * s) * c).sum()
        got.append(M.autograd.grad(y, [s])[0].item())
        if M is tg:
            assert kernels[-1] is not None and len(marks) == 1
            assert _engine._MARKED.v is None  # nothing kept after the call
            y2 = (M.cos(c * s) * c).sum()
            with paths.force("fused"):
                got.append(M.autograd.grad(y2, [s])[0].item())
            assert len(marks) == 2 and paths.last() == "fused"
    assert got[0] == pytest.approx(got[2], rel=1e-12)
    assert got[1] == pytest.approx(float(np.sum(-np.sin(c0 * 0.7) * c0 * c0)), rel=1e-12)


def test_a_call_the_flat_path_finds_no_mark_for_is_not_marked_again(monkeypatch):
    # an op neither path runs (matmul): the flat path's marking fails, the fused path
    # declines on what it found (a small program's grad pays one marking, as without it)
    marks, fused_tried = [], []
    real, applies = _engine._flat_mark, _engine.FUSED.applies
    monkeypatch.setattr(_engine, "_flat_mark", lambda *a: marks.append(1) or real(*a))
    monkeypatch.setattr(_engine.FUSED, "applies",
                        lambda *a: fused_tried.append(1) or applies(*a))
    x = leaf(tg, np.linspace(-1.0, 1.0, 6).reshape(2, 3))
    (g,) = tg.autograd.grad((x @ x.T).sum(), x)
    assert paths.last() == "sweep" and fused_tried == [1] and marks == [1]
    np.testing.assert_allclose(g.numpy(), 2 * np.ones((2, 2)) @ arr(x), rtol=1e-15)
