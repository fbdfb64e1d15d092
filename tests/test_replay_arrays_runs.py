"""Runs of elementwise instructions as one NumPy call (tapegrad/interpreters/
program_arrays.py ``_ew_group``): consecutive instructions of one op and shape whose
operands step evenly (gmm's ``x - mu``, one instruction per component and coordinate) run
an exp's or log's forward, and a broadcast operand's reverse, over (C, g, n) views. What
eager mode computes: within rounding of the expansion and of torch, the forward of the
arithmetic ones (compiled) bit for bit, the same bits on every call and thread. The
threshold is forced down here, above one instruction's length and below a run's."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import program_arrays as PA

from harness import replay_forms as RF
from test_replay_arrays_large import SCALAR, assert_near_expansion_and_torch

torch = pytest.importorskip("torch")

K, D, N = 3, 4, 20  # 12 instructions of 20 elements in each run


def runs(monkeypatch):
    # a run of 240 elements is one call, one instruction (20) is not
    monkeypatch.setattr(PA, "NUMPY_MIN", dict.fromkeys(PA.NUMPY_MIN, 100))


def mixture(M, x):
    """gmm's shapes over one input vector: centres (K, D), points (D, N), both taking
    gradients; the points' rows again for each centre (a run in batches), the centres
    broadcast along the points (their gradients summed), an exp and a log of runs."""
    mu = x[:K * D].reshape(K, D)
    X = x[K * D:].reshape(D, N)
    xc = X[None, :, :] - mu[:, :, None]                   # (K, D, N)
    e = M.exp(xc.permute(1, 0, 2))                         # (D, K, N) of (K, D, N) slots
    z = M.log((xc * xc + 1.0).permute(1, 0, 2))
    return M.sum(e * 0.1) + M.sum(z) + M.sum(xc * mu[:, :, None])


def grp_steps(code):
    rows = code.arows
    plan = PA._plan(rows)
    fw = [op for *_, op in plan if type(op) is tuple and op[0] is PA.GRP]
    rv = [k for *_, k in PA._reverse_plan(rows, plan) if type(k) is tuple and k[0] is PA.GRP]
    return fw, rv


def trace_both(f, x0):
    with RF.array_instructions(4):
        P = tg.trace(lambda x: f(tg, x), x0)
    with RF.array_instructions(SCALAR):
        S = tg.trace(lambda x: f(tg, x), x0)
    return P, S


def test_runs_within_rounding_of_the_expansion_and_torch(monkeypatch):
    runs(monkeypatch)
    rng = np.random.default_rng(11)
    x0, v = rng.normal(size=K * D + D * N), rng.normal(size=K * D + D * N)
    P, S = trace_both(mixture, x0)
    fw, rv = grp_steps(P._code)
    shapes = {(op[1].name, op[2]) for op in fw}
    # x - mu: 3 batches (centres) of 4 rows (coordinates); the exps and logs of the
    # permuted slots: 4 batches (coordinates) of 3 rows
    assert ("sub", (K, D, N)) in shapes and ("exp", (D, K, N)) in shapes, shapes
    assert ("log", (D, K, N)) in shapes, shapes
    # reverse in NumPy: x - mu (both operands: the points' rows summed over the centres,
    # mu over the points), xc * mu; not the exps (no broadcast operand: compiled)
    assert {k[1].name for k in rv} == {"sub", "mul"}, rv
    assert_near_expansion_and_torch(P, S, mixture, x0, v, 1e-14)
    # the arithmetic runs' forward is compiled: their values are the expansion's, bit for
    # bit; the exps' and logs' NumPy's, within rounding (checked above)
    xt = tg.tensor(x0, requires_grad=True)
    gx, = tg.autograd.grad(P(xt), xt, create_graph=True)   # create_graph through them
    hx, = tg.autograd.grad((gx * tg.tensor(v)).sum(), xt)
    np.testing.assert_allclose(hx.detach().numpy(), P.hvp((x0,), (v,))[1], rtol=1e-12,
                               atol=1e-13)


def test_runs_without_exp_are_the_expansions_bits_forward(monkeypatch):
    runs(monkeypatch)

    def f(M, x):
        mu = x[:K * D].reshape(K, D)
        X = x[K * D:].reshape(D, N)
        xc = X[None, :, :] - mu[:, :, None]
        return M.sum(xc * xc)
    x0 = np.random.default_rng(12).normal(size=K * D + D * N)
    P, S = trace_both(f, x0)
    fw, rv = grp_steps(P._code)
    assert [op[1].name for op in fw] == ["sub"] and not fw[0][-1] and rv, (fw, rv)
    assert P(x0) == S(x0)
    a, s = P.value_and_grad(x0), S.value_and_grad(x0)
    assert a[0] == s[0]
    np.testing.assert_allclose(a[1], s[1], rtol=1e-13)
    xt = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad(f(torch, xt), xt)
    np.testing.assert_allclose(a[1], gt.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("special", ["nan", "inf", "negzero"])
def test_runs_with_nan_inf_and_negative_zero(monkeypatch, special):
    runs(monkeypatch)
    x0 = np.random.default_rng(13).normal(size=K * D + D * N)
    P, S = trace_both(mixture, x0)
    x = x0.copy()
    x[[1, K * D + 3, K * D + 45]] = {"nan": np.nan, "inf": np.inf, "negzero": -0.0}[special]
    a, s = P.value_and_grad(x), S.value_and_grad(x)
    np.testing.assert_allclose(a[0], s[0], rtol=1e-13)
    np.testing.assert_allclose(a[1], s[1], rtol=1e-12, atol=1e-14)
    assert np.array_equal(np.isnan(a[1]), np.isnan(s[1]))
    assert np.array_equal(np.signbit(a[1]), np.signbit(s[1]))
    xt = torch.tensor(x, requires_grad=True)
    gt, = torch.autograd.grad(mixture(torch, xt), xt)
    np.testing.assert_allclose(a[1], gt.numpy(), rtol=1e-12, atol=1e-14)


def test_runs_non_contiguous_input_and_the_same_bits_every_call_and_thread(monkeypatch):
    runs(monkeypatch)
    rng = np.random.default_rng(14)
    big = rng.normal(size=2 * (K * D + D * N))
    P, S = trace_both(mixture, np.ascontiguousarray(big[::2]))
    xs = [(big * (1 + 0.1 * i))[1::2] for i in range(6)]  # strided: not contiguous
    assert not xs[0].flags.c_contiguous
    want = [P.value_and_grad(x) for x in xs]
    np.testing.assert_allclose(want[0][1], S.value_and_grad(xs[0])[1], rtol=1e-12)
    with ThreadPoolExecutor(3) as pool:
        for _ in range(2):
            for (va, ga), (vb, gb) in zip(want, pool.map(P.value_and_grad, xs)):
                assert va == vb
                np.testing.assert_array_equal(ga, gb)


def test_a_run_whose_gradients_overlap_is_no_run(monkeypatch):
    # A - A[:, :1]: each row less its first element, both operands taking gradients, the
    # broadcast one's slot inside the other's grid: added in the compiled loop's order
    # only there, so the instructions stay compiled; the gradient is the expansion's
    runs(monkeypatch)

    def f(M, x):
        A = x.reshape(D * K, N)
        t = A - A[:, :1]
        return M.sum(t * t * 0.5)
    x0 = np.random.default_rng(15).normal(size=D * K * N)
    P, S = trace_both(f, x0)
    assert grp_steps(P._code) == ([], [])
    a, s = P.value_and_grad(x0), S.value_and_grad(x0)
    assert a[0] == s[0]
    np.testing.assert_array_equal(a[1], s[1])
    xt = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad(f(torch, xt), xt)
    np.testing.assert_allclose(a[1], gt.numpy(), rtol=1e-12, atol=1e-14)


def lse(M, x):
    a = M.max(x)
    return a + M.log(M.sum(M.exp(x - a)))


@pytest.mark.parametrize("case", ["ties", "nan", "inf", "negzero"])
def test_a_max_s_picks_not_run_give_the_same_bits(monkeypatch, case):
    # the picks (-0.0 each) that only their sum reads are not run, the sum written -0.0:
    # the same bits as running them, ties, NaN, inf and -0.0 included; and torch's
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 4)
    monkeypatch.setattr(PA, "NUMPY_MIN", dict.fromkeys(PA.NUMPY_MIN, 4))
    x = np.random.default_rng(16).normal(size=300)
    x[[3, 100, 299]] = {"ties": x.max() + 1.0, "nan": np.nan, "inf": np.inf,
                        "negzero": -0.0}[case]
    if case == "negzero":
        x = -np.abs(x)
        x[[3, 100]] = 0.0
    with RF.array_instructions(4):
        P = tg.trace(lambda x: lse(tg, x), x)
    a = P.value_and_grad(x)
    rows = P._code.arows
    calls = []
    real = PA._skip_picks  # Q runs its picks: the plan without them only recorded
    monkeypatch.setattr(PA, "_skip_picks", lambda *args: calls.append(
        real(*args)) or args[1])
    with RF.array_instructions(4):
        Q = tg.trace(lambda x: lse(tg, x), x)
    b = Q.value_and_grad(x)
    assert calls and any(type(op) is tuple and op[0] is PA.FILL for *_, op in calls[0])
    assert rows.shape == Q._code.arows.shape
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    # (zeros' signs; not a NaN's: the compiled rule's vectorized body and its remainder
    # give NaN + NaN different signs, and the ties' step, ``_ties``, adds in NumPy)
    ok = ~np.isnan(a[1])
    assert np.array_equal(np.signbit(a[1][ok]), np.signbit(b[1][ok]))
    xt = torch.tensor(x, requires_grad=True)
    y = lse(torch, xt)
    gt, = torch.autograd.grad(y, xt)
    np.testing.assert_allclose(a[0], y.item(), rtol=1e-13)
    np.testing.assert_allclose(a[1], gt.numpy(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("case", ["plain", "nan", "inf", "negzero"])
def test_a_square_s_reverse_in_a_register_is_the_expansions_bits(case):
    # x * x (one operand twice, strided too): its reverse adds both rules' g * a to the
    # slot in a register, in the loop's order: the expansion's bits, hvp and torch's
    def f(M, x):
        A = x.reshape(6, 20)
        y = A * 0.7 - 0.1
        s = (y * y).sum() + (A[:, ::2] * A[:, ::2] * A[:, 1::2]).sum()
        return s + ((y * y) * (y * y)).sum() * 0.01
    x = np.random.default_rng(17).normal(size=120)
    if case != "plain":
        x[[5, 60]] = {"nan": np.nan, "inf": np.inf, "negzero": -0.0}[case]
    P, S = trace_both(f, x)
    a, s = P.value_and_grad(x), S.value_and_grad(x)
    np.testing.assert_array_equal(a[0], s[0])
    np.testing.assert_array_equal(a[1], s[1])
    assert np.array_equal(np.signbit(a[1]), np.signbit(s[1]))
    xt = torch.tensor(x, requires_grad=True)
    gt, = torch.autograd.grad(f(torch, xt), xt)
    np.testing.assert_allclose(a[1], gt.numpy(), rtol=1e-12, atol=1e-14)
    if case == "plain":
        v = np.random.default_rng(18).normal(size=120)
        np.testing.assert_allclose(P.hvp((x,), (v,))[1], S.hvp((x,), (v,))[1], rtol=1e-12)


@pytest.mark.parametrize("reread", [False, True])
def test_a_batched_product_writes_its_operand_s_adjoints_first(monkeypatch, reread):
    # Q @ xc, xc = x - mu read by the product alone: its reverse writes xc's adjoints
    # (0.0 + A^T G), not zeroed first: the same bits as adding to zeros; read again after
    # the product (reread), it adds as before
    monkeypatch.setattr(PA, "NUMPY_MM_MIN", 4)

    def f(M, x):
        Q = x[:K * D * D].reshape(K, D, D)
        mu = x[K * D * D:K * D * D + K * D].reshape(K, D)
        X = x[K * D * D + K * D:].reshape(D, N)
        xc = X[None, :, :] - mu[:, :, None]
        y = M.matmul(Q, xc)
        s = M.sum(y * y)
        return s + M.sum(xc * 0.5) if reread else s
    size = K * D * D + K * D + D * N
    x = np.random.default_rng(19).normal(size=size)
    x[K * D * D + K * D + 7] = -0.0
    P, S = trace_both(f, x)
    rows = P._code.arows
    plan = PA._plan(rows)
    back = PA._reverse_plan(rows, plan)
    assert any(type(k) is tuple and k[0] is PA.MM for *_, k in back)
    firsts = PA._mm_first(rows, back, P._code.out_slots)
    assert bool(firsts) != reread, firsts
    a = P.value_and_grad(x)
    monkeypatch.setattr(PA, "_mm_first", lambda *args: {})
    P2, _ = trace_both(f, x)
    b = P2.value_and_grad(x)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    s = S.value_and_grad(x)
    np.testing.assert_allclose(a[1], s[1], rtol=1e-12, atol=1e-14)
    xt = torch.tensor(x, requires_grad=True)
    gt, = torch.autograd.grad(f(torch, xt), xt)
    np.testing.assert_allclose(a[1], gt.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("reread", [False, True])
def test_a_run_of_sums_as_one_call(monkeypatch, reread):
    # sum(sq, 1) of sq (K, D, N): K sums of N outputs of D terms each, one np.add.reduce
    # (within rounding of the expansion: its sums in order along a strided axis); their
    # reverse writes the terms' adjoints when nothing after reads the terms (the same bits
    # as adding to zeros), and adds when something does (reread)
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 4)

    def f(M, x):
        mu = x[:K * D].reshape(K, D)
        X = x[K * D:].reshape(D, N)
        xc = X[None, :, :] - mu[:, :, None]
        sq = xc * xc
        b = M.sum(sq, 1)                                    # (K, N)
        out = M.sum(M.exp(-0.1 * b))
        return out + M.sum(sq * 0.01) if reread else out
    x = np.random.default_rng(20).normal(size=K * D + D * N)
    x[K * D + 9] = np.inf if reread else -0.0
    P, S = trace_both(f, x)
    rows = P._code.arows
    plan = PA._plan(rows)
    back = PA._reverse_plan(rows, plan)
    runs_ = [op for *_, op in plan if type(op) is tuple and op[0] is PA.RGRP]
    assert runs_ and runs_[0][2] == (1, K, N, D), runs_
    firsts = PA._rgrp_first(rows, back, P._code.out_slots)
    assert bool(firsts) != reread, firsts
    a = P.value_and_grad(x)
    monkeypatch.setattr(PA, "_rgrp_first", lambda *args: {})
    P2, _ = trace_both(f, x)
    b = P2.value_and_grad(x)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    s = S.value_and_grad(x)
    np.testing.assert_allclose(a[0], s[0], rtol=1e-13)
    np.testing.assert_allclose(a[1], s[1], rtol=1e-12, atol=1e-14)
    xt = torch.tensor(x, requires_grad=True)
    y = f(torch, xt)
    gt, = torch.autograd.grad(y, xt)
    np.testing.assert_allclose(a[0], y.item(), rtol=1e-13)
    np.testing.assert_allclose(a[1], gt.numpy(), rtol=1e-12, atol=1e-13)
    if not reread:
        v = np.random.default_rng(21).normal(size=x.size)
        x2 = np.random.default_rng(22).normal(size=x.size)
        np.testing.assert_allclose(P.hvp((x2,), (v,))[1], S.hvp((x2,), (v,))[1], rtol=1e-10,
                                   atol=1e-12)


def test_distinct_slot_grids_by_strides_as_np_unique():
    # the derivative program's check that a rule's slot grid holds no slot twice, by its
    # strides when affine (negative, zero, overlapping), by np.unique otherwise
    from tapegrad.interpreters.program import _distinct
    grids = [np.arange(12).reshape(3, 4), np.arange(12).reshape(3, 4)[::-1],
             np.arange(12).reshape(4, 3).T, 5 + np.zeros((3, 4), dtype=np.int64),
             np.arange(4)[None, :] + 2 * np.arange(3)[:, None],       # overlapping rows
             np.arange(4)[None, :] * 3 + np.arange(3)[:, None],       # interleaved
             np.arange(4)[None, :] - 4 * np.arange(3)[:, None] + 20,  # negative stride
             np.array([[1, 2, 9], [4, 1, 7]]), np.array([[1, 2, 9], [4, 5, 7]]),
             np.arange(5)[None, :], np.arange(5)[:, None], np.zeros((0, 3), dtype=np.int64)]
    for S in grids:
        assert _distinct(S) == (np.unique(S).size == S.size), S
