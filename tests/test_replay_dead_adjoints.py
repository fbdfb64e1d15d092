"""Traced programs whose rows are read only through operands without a derivative (detach,
comparisons, guards, a max's ties): the reverse sweep ran their rules at a zero adjoint,
and 0.0 * inf gave NaN where torch's gradient is a number (``program.cut_dead``). One
sample, fused, batched, parallel, hvp, Hessians and VJPs, at the tracing inputs and at
new ones, against torch."""

import warnings

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import fuse
from tapegrad.interpreters import program as _prog

torch = pytest.importorskip("torch")


def detach_times(M, x):  # exp(x) is inf at x = 1000, read only by the detach
    return M.sum(M.exp(x).detach() * x)


def compared(M, x):  # exp(x) read only by the comparison
    return M.sum(M.where(M.exp(x) > 1.0, x * x, -x))


def chain_compared(M, x):  # exp(x) * 2 read only by the comparison, exp only by the mul
    return M.sum(M.where(M.exp(x) * 2.0 > x, x, M.zeros_like(x)))


def shifted_compared(M, x):  # x + 1 passes on what exp's rule gives it: 0 * inf
    return M.sum(M.where(M.exp(x + 1.0) > 1.0, x * x, -x))


def sign_times(M, x):  # sign's rule is 0 * g (torch too): exp's rule then gives NaN, kept
    return M.sum(M.sign(M.exp(x))) + M.sum(x)


def min_neg_square(M, x):  # the picked value is -inf; x * x is read by the ties' tests
    return M.min(-(x * x), 0)[0] if M is tg else (-(x * x)).min(0).values


CASES = {"detach_times": detach_times, "compared": compared, "chain_compared": chain_compared,
         "shifted_compared": shifted_compared,
         "sign_times": sign_times}
X_INF = np.array([1000.0, 1.0, -2.0])   # exp overflows at x[0]
X_FINITE = np.array([0.5, 1.0, -2.0])   # the tracing inputs of the new-input tests


def torch_vg(f, x0):
    xt = torch.tensor(x0, requires_grad=True)
    y = f(torch, xt)
    g, = torch.autograd.grad(y, xt)
    return y.item(), g.numpy()


def torch_hvp(f, x0, u):
    xt = torch.tensor(x0, requires_grad=True)
    g, = torch.autograd.grad(f(torch, xt), xt, create_graph=True)
    h, = torch.autograd.grad((g * torch.tensor(u)).sum(), xt, allow_unused=True)
    return np.zeros_like(x0) if h is None else h.numpy()


@pytest.mark.parametrize("traced_at", ["same", "new"])
@pytest.mark.parametrize("case", list(CASES))
def test_value_and_grad_matches_torch(case, traced_at):
    f = CASES[case]
    P = tg.trace(lambda x: f(tg, x), X_INF if traced_at == "same" else X_FINITE)
    want_v, want_g = torch_vg(f, X_INF)
    v, g = P.value_and_grad(X_INF)
    np.testing.assert_allclose(v, want_v)
    np.testing.assert_allclose(g, want_g)
    if case != "sign_times":
        assert np.isfinite(want_g[1:]).all() and not np.isnan(want_g).any()


@pytest.mark.parametrize("case", ["detach_times", "compared", "chain_compared"])
def test_fused_rows_match_torch(case, monkeypatch):
    monkeypatch.setattr(fuse, "MIN_PAIRED", 0.0)
    monkeypatch.setattr(fuse, "TIER", 0)
    f = CASES[case]
    P = tg.trace(lambda x: f(tg, x), X_FINITE)
    np.testing.assert_allclose(P.value_and_grad(X_INF)[1], torch_vg(f, X_INF)[1])


@pytest.mark.parametrize("target", ["cpu", "parallel"])
@pytest.mark.parametrize("case", list(CASES))
def test_batches_match_torch(case, target):
    f = CASES[case]
    P = tg.trace(lambda x: f(tg, x), X_FINITE, target=target)
    X = np.stack([X_INF, X_FINITE, -X_INF / 1000.0])
    values, grads = P.value_and_grad(X)
    for i, x in enumerate(X):
        want_v, want_g = torch_vg(f, x)
        np.testing.assert_allclose(values[i], want_v)
        np.testing.assert_allclose(grads[i], want_g)


HVP_CASES = {"max_square": lambda M, x: M.max(x * x, 0)[0] if M is tg else
             (x * x).max(0).values,
             "min_neg_square": min_neg_square,
             "detach_times_square": lambda M, x: M.sum(M.exp(x).detach() * x * x),
             "compared": compared}


@pytest.mark.parametrize("case", list(HVP_CASES))
def test_hvp_matches_torch(case):
    f = HVP_CASES[case]
    x0 = np.array([np.inf, 2.0, 0.5]) if "square" in case and "detach" not in case else X_INF
    u = np.array([1.0, 0.5, -0.7])
    P = tg.trace(lambda x: f(tg, x), np.array([3.0, 2.0, 0.5]))
    want = torch_hvp(f, x0, u)
    np.testing.assert_allclose(P.hvp((x0,), (u,))[1], want)  # one sample (with the value)
    np.testing.assert_allclose(P.hvp((np.stack([x0, x0]),), (np.stack([u, u]),))[1],
                               np.stack([want, want]))  # a batch
    if case == "compared":  # the Hessian's program: a gradient program's Jacobian
        xt = torch.tensor(x0, requires_grad=True)
        H = torch.autograd.functional.hessian(lambda x: f(torch, x), xt)
        np.testing.assert_allclose(P.hessian(x0), H.numpy())


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_program_on_the_tape_matches_torch(create_graph):
    # a program called on the eager tape: its compiled VJP, or under create_graph its VJP
    # program
    P = tg.trace(lambda x: detach_times(tg, x), X_FINITE)
    x = tg.tensor(X_INF, requires_grad=True)
    g, = tg.autograd.grad(P(x), x, create_graph=create_graph)
    np.testing.assert_allclose(g.detach().numpy(), torch_vg(detach_times, X_INF)[1])


def test_guards_and_no_grad_regions_match_torch():
    def f(M, x):
        if (M.exp(x[0]) > 1.0).item():  # a guard reading exp, inf at x[0] = 1000
            return M.sum(x * x)
        return M.sum(x)

    P = tg.trace(lambda x: f(tg, x), X_INF)
    np.testing.assert_allclose(P.grad(X_INF), torch_vg(f, X_INF)[1])

    def g(M, x):
        with M.no_grad():
            c = M.exp(x)  # a constant of the program (a TraceWarning says so)
        return M.sum(c * x) + M.sum(M.exp(x).detach() * x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.replay.TraceWarning)
        P = tg.trace(lambda x: g(tg, x), X_INF)
    np.testing.assert_allclose(P.grad(X_INF), torch_vg(g, X_INF)[1])


def test_programs_without_such_rows_are_left_as_they_are():
    P = tg.trace(lambda x: tg.sum(tg.sin(x) * x) + tg.max(x), X_FINITE)
    rows = P._code.arows
    cut, new = _prog.cut_dead(rows, P._code.out_slots)
    assert cut is rows and new is None
    # x - x, read only by a comparison, passes g and -g: zeros, whatever x is (no detach)
    P = tg.trace(lambda x: tg.sum(tg.where((x - x) == 0.0, x * 3.0, x)), X_FINITE)
    rows = P._code.arows
    assert (rows[:, 0] == _prog.DETACH).sum() == 0
    np.testing.assert_allclose(P.grad(np.array([np.inf, 1.0, 2.0])), [1.0, 3.0, 3.0])
    # a detach where each exp row meets x's element: 3 traced, 3 cut
    Q = tg.trace(lambda x: detach_times(tg, x), X_FINITE)
    assert (Q._code.arows[:, 0] == _prog.DETACH).sum() == 6


def _kmeans_at_inf(min_run=4):
    from harness import replay_forms as RF
    from test_replay_arrays_bsums import K, D, N, kmeans
    rng = np.random.default_rng(8)
    x, v = rng.normal(size=K * D + D * N), rng.normal(size=K * D + D * N)
    x[K * D + 7] = np.inf
    with RF.array_instructions(min_run):
        P = tg.trace(lambda x: kmeans(tg, x), np.where(np.isinf(x), 1.0, x))
    return kmeans, P, x, v


@pytest.mark.parametrize("min_run", [4, 16])
def test_hvp_of_an_array_program_at_inf(min_run):
    # the distances x * x of kmeans' Hessian-vector program are read only by the min's
    # ties there: a dead instruction, cut from its operands whole (``_cut_arrays``)
    kmeans, P, x, v = _kmeans_at_inf(min_run)
    from tapegrad._program_code import _hvp_of
    assert _hvp_of(P._code).arrays  # cut as instructions: the array plan is kept
    xt = torch.tensor(x, requires_grad=True)
    g, = torch.autograd.grad(kmeans(torch, xt), xt, create_graph=True)
    hv, = torch.autograd.grad((g * torch.tensor(v)).sum(), xt)
    np.testing.assert_allclose(P.hvp((x,), (v,))[1], hv.numpy(), rtol=1e-10, atol=1e-12)
    X, V = np.stack([x, -x, x]), np.stack([v, v, -v])  # a batch (the expansion's rows)
    got = P.hvp((X,), (V,))[1]
    for i in range(3):
        xt = torch.tensor(X[i], requires_grad=True)
        g, = torch.autograd.grad(kmeans(torch, xt), xt, create_graph=True)
        hv, = torch.autograd.grad((g * torch.tensor(V[i])).sum(), xt)
        np.testing.assert_allclose(got[i], hv.numpy(), rtol=1e-10, atol=1e-12)


def test_gradient_program_of_an_array_program_at_inf():
    kmeans, P, x, _ = _kmeans_at_inf()
    G = P.grad_program()
    assert G._code.arrays  # cut as instructions: the array plan is kept
    want = torch_vg(kmeans, x)[1]
    np.testing.assert_allclose(G(x), want, rtol=1e-12)
    np.testing.assert_allclose(P.grad(x), want, rtol=1e-12)
    X = np.stack([x, np.where(np.isinf(x), -np.inf, x)])
    got = G(X)  # a batch: the expansion of the cut instructions
    for i in range(2):
        np.testing.assert_allclose(got[i], torch_vg(kmeans, X[i])[1], rtol=1e-12)
    # a program of it on the eager tape, under create_graph: its VJP program
    xt = tg.tensor(x, requires_grad=True)
    g, = tg.autograd.grad(P(xt), xt, create_graph=True)
    np.testing.assert_allclose(g.detach().numpy(), want, rtol=1e-12)


X20 = np.linspace(-1.0, 1.0, 20)  # runs of 16 or more: array instructions
X20_INF = np.where(np.arange(20) == 3, 1000.0, X20)


@pytest.mark.parametrize("min_run", [4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_array_programs_match_torch(case, min_run):
    # the same rows as array instructions: a dead instruction is cut whole
    from harness import replay_forms as RF
    f = CASES[case]
    with RF.array_instructions(min_run):
        P = tg.trace(lambda x: f(tg, x), X20)
        Q = tg.trace(lambda x: f(tg, x), X20, target="parallel")
    assert P._code.arrays
    want_v, want_g = torch_vg(f, X20_INF)
    v, g = P.value_and_grad(X20_INF)
    np.testing.assert_allclose(v, want_v)
    np.testing.assert_allclose(g, want_g)
    if case != "sign_times":  # (derivative programs fold sign's 0 * g: 1 where torch NaN)
        np.testing.assert_allclose(P.grad_program()(X20_INF), want_g)
    X = np.stack([X20_INF, X20, -X20_INF])
    for R in (P, Q):
        got = R.grad(X)
        for i in range(3):
            np.testing.assert_allclose(got[i], torch_vg(f, X[i])[1])
    xt = tg.tensor(X20_INF, requires_grad=True)
    for create_graph in (False, True)[:1 if case == "sign_times" else 2]:
        # its program entry's VJP, and its VJP program
        g, = tg.autograd.grad(P(xt), xt, create_graph=create_graph)
        np.testing.assert_allclose(g.detach().numpy(), want_g)
    if case in ("compared", "shifted_compared"):  # (the others are linear: torch raises)
        u = np.linspace(0.5, -0.5, 20)
        np.testing.assert_allclose(P.hvp((X20_INF,), (u,))[1], torch_hvp(f, X20_INF, u))


def test_the_cuda_target_matches_torch():
    # (numba's simulator in CI, tests/conftest.py: Python's math.exp(1000) raises, so inf)
    pytest.importorskip("numba_cuda", reason="the CUDA target needs pip install 'tapegrad[cuda]'")
    f, u = detach_times, np.array([1.0, 0.5, -0.7])
    P = tg.trace(lambda x: f(tg, x), X_FINITE, target="cuda")
    X = np.stack([np.array([np.inf, 1.0, -2.0]), X_FINITE])
    with warnings.catch_warnings():  # (the simulator's NumPy scalars: the cut rows' 0 * inf)
        warnings.simplefilter("ignore", RuntimeWarning)
        grads = P.value_and_grad(X)[1]
    for i, x in enumerate(X):
        np.testing.assert_allclose(grads[i], torch_vg(f, x)[1])
    g = HVP_CASES["max_square"]
    Q = tg.trace(lambda x: g(tg, x), X_FINITE, target="cuda")
    x0 = np.array([np.inf, 2.0, 0.5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        hv = Q.hvp((x0[None],), (u[None],))[1][0]
    np.testing.assert_allclose(hv, torch_hvp(g, x0, u))


@pytest.mark.parametrize("cover", [0.0, 1.0])
def test_a_cut_inside_a_span_an_instruction_reads_goes_before_the_span(cover, monkeypatch):
    # exp(x_i) rows (dead: read only by the detach after each) sit between the detach rows
    # that one instruction reads with stride 2: the detach rows the cut inserts go before
    # the span, which shifts whole (inserted inside it, the instruction would read them)
    from tapegrad._program_code import _Code
    from tapegrad.interpreters import program_arrays as PA
    from tapegrad.ops import BY_NAME
    monkeypatch.setattr(PA, "MIN_COVER", cover)  # 0: the array interpreter; 1: expanded
    A, T, code = PA.ARR, PA.TAIL, lambda n: BY_NAME[n].code
    rows = [[A, -1, -1, -1, 0, 0], [T, -1, -1, -1, 8, _prog.LEAF], [T, -1, -1, -1, 0, 0],
            [T, -1, -1, -1, 0, 0]]
    for i in range(4):  # slot 8 + 2i: exp(x_i); 9 + 2i: its detach
        rows += [[code("exp"), i, -1, -1, 0, 0], [_prog.DETACH, 8 + 2 * i, -1, -1, 0, 0]]
    rows += [[A, 9, 0, -1, 0, 0], [T, -1, -1, -1, 4, code("mul")], [T, -1, -1, -1, 2, 1],
             [T, -1, -1, -1, 0, 0]]  # slots 16..19: detach(exp(x_i)) * x_i
    rows = np.array(rows, dtype=np.float64)
    roots = np.arange(16, 20)
    out, new = _prog.cut_dead(rows, roots)
    assert PA.has_arrays(out) and (out[:, 0] == _prog.DETACH).sum() == 8
    ins = [((8,), np.dtype(np.float64))]
    outs = [((4,), np.dtype(np.float64))]
    x = np.array([0.5, 1.0, 1000.0, -2.0, 0.0, 0.0, 0.0, 0.0])
    got = _Code(out, new[np.arange(8)], new[roots], ins, outs, "single", []).run_fresh(
        x, np.ones(4), True)
    xt = torch.tensor(x[:4], requires_grad=True)
    want, = torch.autograd.grad((torch.exp(xt).detach() * xt).sum(), xt)
    np.testing.assert_array_equal(got[2][:4], want.numpy())  # exp(1000) = inf, not NaN
    uncut = _Code(rows, np.arange(8), roots, ins, outs, "single", []).run_fresh(
        x, np.ones(4), True)
    assert np.isnan(uncut[2][2])  # (what the cut keeps out)


def test_the_cuda_target_runs_cut_array_instructions():
    pytest.importorskip("numba_cuda", reason="the CUDA target needs pip install 'tapegrad[cuda]'")
    from harness import replay_forms as RF
    X = np.stack([np.where(X20_INF > 100.0, np.inf, X20), X20])  # (the simulator: inf)
    for case in ("detach_times", "compared"):
        f = CASES[case]
        with RF.array_instructions(4):
            P = tg.trace(lambda x: f(tg, x), X20, target="cuda")
        assert P._code.arrays  # the instructions' expansion, with the cut's detach rows
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            grads = P.value_and_grad(X)[1]
        for i in range(2):
            np.testing.assert_allclose(grads[i], torch_vg(f, X[i])[1])
