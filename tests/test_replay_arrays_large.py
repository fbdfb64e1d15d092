"""Large array instructions run in NumPy (tapegrad/interpreters/program_arrays.py): reduction
instructions of ``NUMPY_RED_MIN`` terms or more by NumPy's reductions, and the reverse of an
elementwise instruction whose broadcast operand takes a gradient (``NUMPY_BCAST_MIN``) by
NumPy's rules, that operand's gradient summed pairwise. What eager mode computes: within
rounding of the expansion (the same program as scalar rows) and of torch, the same bits on
every call and on every thread. The thresholds are forced down here (4 elements), so every
kind runs that way on small programs; one program at the real sizes."""

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import program_arrays as PA
from tapegrad.interpreters._codegen_emit import rule_exprs
from tapegrad.ops import BY_NAME

from harness import replay_forms as RF

torch = pytest.importorskip("torch")

SCALAR = 1 << 62  # no run is that long: scalar rows only
W = np.random.default_rng(3).normal(size=(3, 5, 6))


def reductions_and_broadcasts(M, x):
    """Every kind of reduction instruction (sums over each axis, a long sum's blocks, max,
    min, logsumexp's and softmax's shifts, matmuls with a row of stride 0 and with both
    operands strided, x @ x) and broadcast operands that take gradients (a row's mean
    and max subtracted, a sum multiplied and added)."""
    A = x.reshape(8, 9)
    X = x.reshape(3, 6, 4)
    P = M.matmul(M.tensor(W, dtype=M.float64), X)                  # (3, 5, 4)
    G = M.matmul(A.T, A)                                           # (9, 9)
    s = M.sum(x)
    Z = A - M.mean(A, 1, keepdim=True)
    return (M.sum(M.tanh(P)) + M.sum(G) * 0.01 + (x @ x) + M.sum(M.sum(A, 0) ** 2)
            + M.sum(M.sum(A, 1) ** 2) + M.amax(A) + M.amin(A, 1).sum()
            + M.logsumexp(A, 0).sum() + M.sum(M.softmax(A, 1) * A) + M.sum(Z * Z)
            + M.sum(M.exp(x - M.max(x))) + M.sum((x * s) * 0.01) + M.sum(M.log(s * s + x * x))
            + M.sum(M.exp(M.cat([x, x * 0.5, x * x]) * 0.1)))


def small(monkeypatch):
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 4)
    monkeypatch.setattr(PA, "NUMPY_BCAST_MIN", 4)


def steps(code):
    """(reduction steps in NumPy by their step's name, reverse steps in NumPy by op name)."""
    rows = code.arows
    plan = PA._plan(rows)
    red = {BY_NAME_CODE[int(rows[r0 + 1, 5])] for r0, _, _, _, op in plan if op is PA.NPRED}
    rev = {kind.name for *_, kind in PA._reverse_plan(rows, plan)
           if kind is not None and kind is not PA.RED}
    return red, rev


BY_NAME_CODE = {op.code: name for name, op in BY_NAME.items()}


def torch_derivs(f, x, v):
    xt = torch.tensor(x, requires_grad=True)
    y = f(torch, xt)
    g, = torch.autograd.grad(y, xt, create_graph=True)
    hv, = torch.autograd.grad((g * torch.tensor(v)).sum(), xt)
    return y.item(), g.detach().numpy(), hv.numpy()


def assert_near_expansion_and_torch(P, S, f, x0, v, atol):
    """``P`` (array instructions on their NumPy paths) within rounding of ``S`` (its scalar
    expansion: pairwise sums, einsum's order, not bit for bit), and torch's value, gradient
    and Hessian-vector product; returns torch's gradient and Hessian-vector product."""
    a, s = P.value_and_grad(x0), S.value_and_grad(x0)
    np.testing.assert_allclose(a[0], s[0], rtol=1e-14)
    np.testing.assert_allclose(a[1], s[1], rtol=1e-13, atol=atol)
    y, g, hv = torch_derivs(f, x0, v)
    np.testing.assert_allclose(a[0], y, rtol=1e-13)
    np.testing.assert_allclose(a[1], g, rtol=1e-12, atol=10 * atol)
    np.testing.assert_allclose(P.hvp((x0,), (v,))[1], hv, rtol=1e-10, atol=1000 * atol)
    return g, hv


def test_numpy_rules_are_the_registrys():
    # each rule in NumPy rounds as the registry's rule expression, element by element
    # (what the compiled loop and the expansion compute)
    rng = np.random.default_rng(0)
    a, b, out, g = (rng.normal(size=50) + 2.0 for _ in range(4))
    c0 = 1.7
    for name, rules in PA.NP_RULES.items():
        exprs = rule_exprs(BY_NAME[name])
        assert set(exprs) == set("abc"[:len(rules)]) - {n for n in "abc" if n not in exprs}
        for j, (rule, sign) in enumerate(rules):
            expr = exprs["abc"[j]]
            want = np.array([eval(expr, {"math": math}, dict(  # noqa: S307
                a=a[i], b=b[i], c=0.0, out=out[i], g=g[i], c0=c0, c1=0.0))
                for i in range(50)])
            got = rule(g, a, b, out, c0, np.empty(50)) * sign
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {'abc'[j]}")


def test_large_instructions_within_rounding_of_the_expansion_and_torch(monkeypatch):
    small(monkeypatch)
    rng = np.random.default_rng(5)
    x0, v = rng.normal(size=72), rng.normal(size=72)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: reductions_and_broadcasts(tg, x), x0)
    with RF.array_instructions(SCALAR):
        S = tg.trace(lambda x: reductions_and_broadcasts(tg, x), x0)
    red, rev = steps(P._code)
    assert red == {"add", "mul", "maximum", "minimum"}, red
    assert {"sub", "mul", "add"} <= rev, rev
    # hvp and create_graph: derivative programs of array instructions, the same paths
    g, hv = assert_near_expansion_and_torch(P, S, reductions_and_broadcasts, x0, v, 1e-15)
    np.testing.assert_allclose(P.grad_program()(x0), g, rtol=1e-12, atol=1e-14)
    xt = tg.tensor(x0, requires_grad=True)
    gx, = tg.autograd.grad(P(xt), xt, create_graph=True)
    hx, = tg.autograd.grad((gx * tg.tensor(v)).sum(), xt)
    np.testing.assert_allclose(hx.detach().numpy(), hv, rtol=1e-10, atol=1e-12)


def test_large_instructions_give_the_same_bits_every_call_and_thread(monkeypatch):
    small(monkeypatch)
    rng = np.random.default_rng(6)
    x0 = rng.normal(size=72)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: reductions_and_broadcasts(tg, x), x0)
    xs = [x0 * (1 + 0.1 * i) for i in range(8)]
    want = [P.value_and_grad(x) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(P.value_and_grad, xs))
            for (va, ga), (vb, gb) in zip(want, got):
                assert va == vb
                np.testing.assert_array_equal(ga, gb)


def test_non_contiguous_inputs_and_an_input_matrix(monkeypatch):
    small(monkeypatch)
    rng = np.random.default_rng(7)
    big = rng.normal(size=(9, 16))

    def f(M, X):  # X (8, 9): sums, a max and a matmul over a transposed input
        return M.sum(M.exp(X - M.amax(X, 1, keepdim=True))) + M.sum(X.T @ X) * 0.1
    X0 = np.ascontiguousarray(big[:, ::2].T)
    with RF.array_instructions(4):
        P = tg.trace(lambda X: f(tg, X), X0)
    red, rev = steps(P._code)
    assert red >= {"add", "maximum", "mul"} and "sub" in rev, (red, rev)
    Xn = big[:, 1::2].T  # strided, transposed: not contiguous
    assert not Xn.flags.c_contiguous
    Xt = torch.tensor(np.ascontiguousarray(Xn), requires_grad=True)
    gt, = torch.autograd.grad(f(torch, Xt), Xt)
    value, g = P.value_and_grad(Xn)
    np.testing.assert_allclose(value, f(torch, Xt).item(), rtol=1e-13)
    np.testing.assert_allclose(g, gt.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("n", [47, 48, 49])
def test_the_thresholds_at_and_around(monkeypatch, n):
    # a reduction of NUMPY_RED_MIN terms runs in NumPy, one term fewer compiled; an
    # instruction with a broadcast operand's gradient the same at NUMPY_BCAST_MIN
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 48)
    monkeypatch.setattr(PA, "NUMPY_BCAST_MIN", 48)
    x0 = np.random.default_rng(n).normal(size=n)

    def f(M, x):
        return M.sum(x * M.sum(x)) + M.sum(M.exp(x))
    with RF.array_instructions(4):
        P = tg.trace(lambda x: f(tg, x), x0)
    rows = P._code.arows
    big = [int(rows[h + 1, 4]) * int(rows[h, 4]) for h in PA.heads_of(rows).tolist()
           if rows[h, 0] == PA.RED]
    assert max(big) == n  # (one block of n terms: under 128)
    red, rev = steps(P._code)
    assert (red == {"add"}) == (n >= 48) and (rev == {"mul"}) == (n >= 48), (red, rev)
    xt = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad(f(torch, xt), xt)
    value, g = P.value_and_grad(x0)
    np.testing.assert_allclose(value, f(torch, xt).item(), rtol=1e-13)
    np.testing.assert_allclose(g, gt.numpy(), rtol=1e-12)


def test_lse_at_the_real_thresholds_against_eager_and_torch():
    # 70,000 elements: its sums and max in NumPy (blocks of 128 terms, 69,888 in all:
    # over NUMPY_RED_MIN), the shift's gradient summed pairwise (over NUMPY_BCAST_MIN)
    x0 = np.random.default_rng(8).normal(size=70_000)

    def lse(M, x):
        a = M.max(x)
        return a + M.log(M.sum(M.exp(x - a)))
    P = tg.trace(lambda x: lse(tg, x), x0)
    red, rev = steps(P._code)
    assert red == {"add", "maximum"} and rev == {"sub"}, (red, rev)
    value, g = P.value_and_grad(x0)
    xe = tg.tensor(x0, requires_grad=True)
    ge, = tg.autograd.grad(lse(tg, xe), xe)
    xt = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad(lse(torch, xt), xt)
    np.testing.assert_allclose(value, lse(torch, xt).item(), rtol=1e-14)
    np.testing.assert_allclose(g, ge.numpy(), rtol=1e-11, atol=1e-20)
    np.testing.assert_allclose(g, gt.numpy(), rtol=1e-11, atol=1e-20)
    np.testing.assert_array_equal(P.value_and_grad(x0)[1], g)


def products(M, x):
    """Batched products: (k, d, d) @ (k, d, n) with both operands taking gradients (gmm's
    ``Q @ xc``), a constant (3, 5, 6) times (3, 6, 4), and one matrix over every batch
    (its terms the same slots for each: not a batched product of distinct slots)."""
    k, d, n = 2, 5, 8
    A = x[:k * d * d].reshape(k, d, d)
    B = x[k * d * d:k * d * (d + n)].reshape(k, d, n)
    X = x[:72].reshape(3, 6, 4)
    WX = M.matmul(M.tensor(W, dtype=M.float64), X)
    return (M.sum(M.matmul(A, B) ** 2) + M.sum(M.tanh(WX))
            + M.sum(M.matmul(x[:30].reshape(5, 6), X) ** 2) * 0.1)


def test_batched_products_by_matmul(monkeypatch):
    monkeypatch.setattr(PA, "NUMPY_MM_MIN", 4)
    rng = np.random.default_rng(9)
    x0, v = rng.normal(size=130), rng.normal(size=130)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: products(tg, x), x0)
    with RF.array_instructions(SCALAR):
        S = tg.trace(lambda x: products(tg, x), x0)
    plan = PA._plan(P._code.arows)
    groups = [op[1] for *_, op in plan if type(op) is tuple]
    # (C batches, g rows, n outputs, L terms): W @ X's rows are X's columns (b's terms the
    # same for every output); the shared matrix's product, a batch at a time (its slots
    # the same in every batch: no slot twice in one view)
    assert (2, 5, 8, 5) in groups and (3, 4, 5, 6) in groups, groups
    assert all(C == 1 for C, g, n, L in groups if (g, n, L) == (4, 5, 6) and C != 3), groups
    assert sum(type(k) is tuple for *_, k in PA._reverse_plan(P._code.arows, plan)) >= 2
    assert_near_expansion_and_torch(P, S, products, x0, v, 1e-14)
    xs = [x0 * (1 + 0.1 * i) for i in range(6)]
    want = [P.value_and_grad(x) for x in xs]
    with ThreadPoolExecutor(3) as pool:
        for (va, ga), (vb, gb) in zip(want, pool.map(P.value_and_grad, xs)):
            assert va == vb
            np.testing.assert_array_equal(ga, gb)


def test_a_run_that_is_no_batched_product_is_looked_at_once(monkeypatch):
    # matmul rows of one shared matrix (its slots in every batch: no batched product):
    # the plan looks at the run once, not from each of its rows (quadratic in its length)
    monkeypatch.setattr(PA, "NUMPY_MM_MIN", 4)
    x0 = np.random.default_rng(10).normal(size=320)

    def f(M, x):
        return M.sum(M.matmul(x[:30].reshape(5, 6), x[:300].reshape(10, 6, 5)) ** 2)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: f(tg, x), x0)
    rows = P._code.arows
    heads = [h for h in PA.heads_of(rows).tolist() if rows[h, 0] == PA.RED
             and rows[h + 1, 5] == PA.MUL]
    calls = []
    real = PA._mm_group
    monkeypatch.setattr(PA, "_mm_group", lambda *a: calls.append(a[1]) or real(*a))
    plan = PA._plan(rows)
    assert len(heads) >= 20 and len(calls) <= len(heads) // 5, (len(heads), calls)
    xt = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad(f(torch, xt), xt)
    np.testing.assert_allclose(P.grad(x0), gt.numpy(), rtol=1e-12, atol=1e-13)
    assert plan


def _lse_and_reads(M, x):
    """lse (a sum of exps and of picks, whose terms only the sum reads) and a sum of
    squares whose terms are read again (an element, and another sum)."""
    q = x * x
    return (M.max(x) + M.log(M.sum(M.exp(x - M.max(x)))) + M.sum(q) * 0.1 + q[3]
            + M.sum(q * 0.5))


def test_sums_that_write_their_terms_adjoints_first(monkeypatch):
    # a sum whose terms no other row reads, and a NumPy rule whose operand nothing after
    # it reads, write their adjoints (no zeroing first): the
    # bits of the same steps adding into zeroed adjoints, on every call (the adjoints left
    # by the last call are overwritten, not added to), within rounding of the expansion and
    # torch; terms read elsewhere are added to as before
    small(monkeypatch)
    rng = np.random.default_rng(21)
    x0 = rng.normal(size=64)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: _lse_and_reads(tg, x), x0)
        Q = tg.trace(lambda x: _lse_and_reads(tg, x), x0)
    rows = P._code.arows
    plan = PA._plan(rows)
    out = np.asarray(P._code.out_slots, dtype=np.intp)
    sets = PA._first_writers(rows, plan, out)
    nsum = [r0 for r0, _, _, _, op in plan if op is PA.NPRED and rows[r0 + 3, 5] != 1.0
            and int(rows[r0 + 1, 5]) == PA.ADD]
    # the exps', the picks', q * 0.5's... sums write; sum(q) adds (q[3], q * 0.5 read q)
    q = int(PA.row_slots(rows)[0][PA.heads_of(rows)[1]])  # x * x: after the inputs'
    assert len(sets) >= 3 and [h for h in nsum if h not in sets] == [
        h for h in nsum if int(rows[h, 1]) == q], (sets, nsum)
    # the shift x - max(x) writes x's adjoints (nothing after it reads x); q's not
    firsts = PA._first_operands(rows, PA._reverse_plan(rows, plan), out)
    assert [r for f in firsts.values() for r in f] == [(0, 64)], firsts
    monkeypatch.setattr(PA, "_first_writers", lambda *a: {})  # Q: all added, zeroed first
    monkeypatch.setattr(PA, "_first_operands", lambda *a: {})
    Q.value_and_grad(x0)
    monkeypatch.undo()
    small(monkeypatch)
    for x in (x0, rng.normal(size=64), x0 * 3.0):
        a, b = P.value_and_grad(x), Q.value_and_grad(x)
        np.testing.assert_array_equal(a[1], b[1])
        assert a[0] == b[0]
        y, g, _ = torch_derivs(_lse_and_reads, x, x)
        np.testing.assert_allclose(a[1], g, rtol=1e-12, atol=1e-15)


def test_a_large_leaf_instruction_is_the_inputs_in_place(monkeypatch):
    # the first instruction copying the inputs in order is not run: the values begin at the
    # inputs (a new input each call, the input array itself untouched)
    monkeypatch.setattr(PA, "NUMPY_MIN", dict(PA.NUMPY_MIN, leaf=4))
    ran = []
    np_forward = PA._np_forward
    monkeypatch.setattr(PA, "_np_forward", lambda op, *a: (ran.append(op.name),
                                                           np_forward(op, *a)))
    rng = np.random.default_rng(22)
    x0 = rng.normal(size=40)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: _lse_and_reads(tg, x), x0)
    assert PA._plan(P._code.arows)[0][4] is BY_NAME["leaf"]
    for x in (x0, rng.normal(size=40)):
        keep = x.copy()
        value, g = P.value_and_grad(x)
        y, gt, _ = torch_derivs(_lse_and_reads, x, x)
        np.testing.assert_allclose(g, gt, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(value, y, rtol=1e-13)
        np.testing.assert_array_equal(x, keep)
    assert "leaf" not in ran


def test_a_detach_only_maxima_read_is_left_out(monkeypatch):
    # a max's detached copy, read only by the max (its ties test the operand), is not
    # made: the max reads the operand's slots, the same numbers as with the copy
    small(monkeypatch)
    monkeypatch.setattr(PA, "NUMPY_MIN", dict(PA.NUMPY_MIN, detach=4))
    rng = np.random.default_rng(23)
    x0 = rng.normal(size=50)
    x0[[4, 9]] = 5.0  # a tie
    f = (lambda M, x: M.max(x) * 2.0 + M.sum(M.amax(x.reshape(5, 10), 1))
         + M.sum(M.exp(x - M.max(x))))
    with RF.array_instructions(4):
        P = tg.trace(lambda x: f(tg, x), x0)
        Q = tg.trace(lambda x: f(tg, x), x0)
    rows = P._code.arows
    plan = PA._plan(rows)
    out = np.asarray(P._code.out_slots, dtype=np.intp)
    dt = BY_NAME["detach"]
    assert any(op is dt for *_, op in plan)
    assert not any(op is dt for *_, op in PA._skip_detach(rows, plan, out))
    monkeypatch.setattr(PA, "_skip_detach", lambda rows, plan, out: plan)
    Q.value_and_grad(x0)
    monkeypatch.undo()
    small(monkeypatch)
    for x in (x0, rng.normal(size=50), np.where(np.arange(50) == 7, np.nan, x0)):
        a, b = P.value_and_grad(x), Q.value_and_grad(x)
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[0], b[0])
    y, g, _ = torch_derivs(f, x0, x0)
    np.testing.assert_allclose(P.value_and_grad(x0)[1], g, rtol=1e-12, atol=1e-15)


def test_inputs_in_place_only_when_the_leaf_instruction_is_all_of_them(monkeypatch):
    # a leaf instruction of the first input only: the values begin after the inputs, as
    # before (slots after it could overwrite inputs that later leaf rows read), the
    # expansion's numbers
    monkeypatch.setattr(PA, "NUMPY_MIN", dict(PA.NUMPY_MIN, leaf=4))
    rng = np.random.default_rng(24)
    x0, y0 = rng.normal(size=40), rng.normal(size=40)

    def f(x, s, y):
        return tg.sum(tg.exp(x * s)) + s * s + tg.sum(y * x)
    with RF.array_instructions(4):
        P = tg.trace(f, x0, 0.5, y0)
    with RF.array_instructions(SCALAR):
        S = tg.trace(f, x0, 0.5, y0)
    assert PA._plan(P._code.arows)[0][4] is BY_NAME["leaf"]
    for s in (0.5, -0.7):
        a, b = P.value_and_grad(x0 * 2, s, y0), S.value_and_grad(x0 * 2, s, y0)
        assert a[0] == b[0]
        for u, w in zip(a[1], b[1]):
            np.testing.assert_array_equal(u, w)
