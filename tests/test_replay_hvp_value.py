"""``Program.hvp`` of array programs takes the value from the Hessian-vector program's own
run (``_program_derivs._hvp_value_code``), not from a forward run of the program: the same
bits as before (the value as the program gives it, H v as the Hessian-vector program
alone gives it), for kmeans' cost, lse's exps in NumPy, the guards' variants, Tensor
inputs and batches, and against torch."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _program_derivs as D
from tapegrad._program_code import _hvp_of

from harness import replay_forms as RF

torch = pytest.importorskip("torch")


def kmeans(M, C, PT):
    diff = PT[None, :, :] - C[:, :, None]
    return M.sum(M.min(M.sum(diff * diff, 1), 0).values)


def lse(M, x):
    a = M.max(x)
    return a + M.log(M.sum(M.exp(x - a)))


def bits(a):
    return np.asarray(a, dtype=np.float64).tobytes()


def old_hvp(P, xs, vs, monkeypatch):
    """``hvp`` as it ran before: the Hessian-vector program, then a forward for the value."""
    with monkeypatch.context() as m:
        m.setattr(D, "_hvp_run", _hvp_of)
        return P.hvp(xs, vs)


def no_forward(P, monkeypatch):
    """Any forward run of the program itself fails the test."""
    def refuse(*a, **k):
        raise AssertionError("hvp ran the program's forward for its value")
    for c in P._variants:
        monkeypatch.setattr(c, "run1", refuse)


def kmeans_program(k=4, d=3, n=50, seed=0):
    rng = np.random.default_rng(seed)
    PT0 = rng.normal(size=(d, n))
    C0 = PT0[:, :k].T.copy() + 0.01
    Pt = tg.tensor(PT0)
    P = tg.trace(lambda C: kmeans(tg, C, Pt), C0)
    return P, PT0, C0


def test_kmeans_hvp_value_from_its_own_run_same_bits(monkeypatch):
    P, PT0, C0 = kmeans_program()
    assert P._code.arrays and D._hvp_value_code(P._code) is not None
    v = np.random.default_rng(1).normal(size=C0.shape)
    for C in (C0, C0[::-1].copy(), C0 * 1.5):
        before = old_hvp(P, (C,), (v,), monkeypatch)
        with monkeypatch.context() as m:
            no_forward(P, m)
            value, hv = P.hvp((C,), (v,))
        assert type(value) is type(before[0]) and bits(value) == bits(before[0])
        assert hv.shape == C.shape and bits(hv) == bits(before[1])
        assert bits(value) == bits(P(C))
        # and torch's
        Ct = torch.tensor(C, requires_grad=True)
        y = kmeans(torch, Ct, torch.tensor(PT0))
        g, = torch.autograd.grad(y, Ct, create_graph=True)
        want, = torch.autograd.grad((g * torch.tensor(v)).sum(), Ct)
        np.testing.assert_allclose(value, y.item(), rtol=1e-13)
        np.testing.assert_allclose(hv, want.numpy(), rtol=1e-12, atol=1e-12)


def test_kmeans_hvp_tensor_inputs_and_batches(monkeypatch):
    P, _, C0 = kmeans_program(seed=2)
    v = np.ones_like(C0)
    before = old_hvp(P, (tg.tensor(C0),), (tg.tensor(v),), monkeypatch)
    value, hv = P.hvp((tg.tensor(C0),), (tg.tensor(v),))
    assert isinstance(hv, tg.Tensor) and bits(hv.numpy()) == bits(before[1].numpy())
    assert bits(float(value)) == bits(float(before[0]))
    X = np.stack([C0, C0 * 0.5])
    bv, bh = P.hvp((X,), (np.stack([v, v]),))  # (the batch's own path, as before)
    for b in range(2):
        one = P.hvp((X[b],), (v,))
        np.testing.assert_allclose(bv[b], one[0], rtol=1e-13)
        np.testing.assert_allclose(bh[b], one[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [200, 10_000])  # 10,000: the exps in NumPy
def test_lse_hvp_value_same_bits(n, monkeypatch):
    x0 = np.random.default_rng(3).normal(size=n)
    P = tg.trace(lambda x: lse(tg, x), x0)
    assert P._code.arrays
    v = np.random.default_rng(4).normal(size=n)
    before = old_hvp(P, (x0,), (v,), monkeypatch)
    value, hv = P.hvp((x0,), (v,))
    assert bits(value) == bits(before[0]) == bits(P(x0))
    assert bits(hv) == bits(before[1])


def branchy(x):
    """A program with a guard: two variants once traced at both sides of it."""
    y = tg.exp(x) * 2.0
    if y.sum() > 40.0:
        return (y * y).sum()
    return (y * x).sum()


def test_guard_variants_take_the_value_from_their_own_run(monkeypatch):
    with RF.array_instructions(4):
        P = tg.trace(branchy, np.zeros(32), retrace=True)
    assert P._code.arrays
    v = np.linspace(-1.0, 1.0, 32)
    xs = [np.full(32, 0.01), np.linspace(-2.0, -1.0, 32)]  # the second: a re-trace
    hvs = [P.hvp((x,), (v,)) for x in xs]
    assert len(P._variants) == 2
    assert all(D._hvp_value_code(c) is not None for c in P._variants)
    for x, (value, hv) in zip(xs, hvs):
        before = old_hvp(P, (x,), (v,), monkeypatch)
        assert bits(value) == bits(before[0]) == bits(P(x))
        assert bits(hv) == bits(before[1])
        xt = torch.tensor(x, requires_grad=True)
        y = branchy(tg.tensor(x))
        want = torch.autograd.functional.hvp(
            lambda t: ((torch.exp(t) * 2.0) ** 2).sum() if (
                torch.exp(t) * 2.0).sum() > 40.0 else (torch.exp(t) * 2.0 * t).sum(),
            xt, torch.tensor(v))
        np.testing.assert_allclose(value, y.item(), rtol=1e-13)
        np.testing.assert_allclose(hv, want[1].numpy(), rtol=1e-10, atol=1e-12)


def test_scalar_rows_keep_their_path_and_a_sum_of_squares(monkeypatch):
    # scalar rows (Rosenbrock): ``_with_value`` keeps the value there, nothing built here
    x0 = np.linspace(-1.0, 1.0, 10)
    P = tg.trace(lambda x: tg.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2),
                 x0)
    assert not P._code.arrays and D._hvp_value_code(P._code) is None
    v = np.ones(10)
    assert bits(P.hvp((x0,), (v,))[1]) == bits(old_hvp(P, (x0,), (v,), monkeypatch)[1])
    # a sum of squares: its value's rows are the sum alone
    with RF.array_instructions(4):
        Q = tg.trace(lambda x: (x * x).sum(), np.ones(20))
    value, hv = Q.hvp((np.arange(20.0),), (np.ones(20),))
    assert bits(value) == bits(Q(np.arange(20.0)))
    np.testing.assert_array_equal(hv, 2.0 * np.ones(20))


def test_a_value_row_that_reads_the_products_slots_is_declined(monkeypatch):
    # ``sum * min``: the value's last row (a scalar mul) reads slots that the product's
    # rows read too; its seed would add to their adjoints: the forward runs apart
    with RF.array_instructions(4):
        P = tg.trace(lambda x: tg.exp(x).sum() * tg.amin(x), np.linspace(0.0, 1.0, 16))
    assert P._code.arrays and D._hvp_value_code(P._code) is None
    x, v = np.linspace(-1.0, 2.0, 16), np.linspace(1.0, 0.5, 16)
    value, hv = P.hvp((x,), (v,))
    before = old_hvp(P, (x,), (v,), monkeypatch)
    assert bits(value) == bits(before[0]) == bits(P(x)) and bits(hv) == bits(before[1])


# --- grad_and_hvp: (value, gradient, H v) from that one run ----------------------------------

def refuse_other_runs(P, m):
    """Any forward run of the program, or its gradient, fails the test."""
    no_forward(P, m)

    def refuse(*a, **k):
        raise AssertionError("grad_and_hvp ran the gradient apart")
    m.setattr(P, "value_and_grad", refuse)


@pytest.mark.parametrize("case", ["plain", "zero_v", "inf"])
def test_kmeans_grad_and_hvp_one_run(case, monkeypatch):
    """The value, the gradient and H v of one run of the Hessian-vector program: the
    value's and H v's bits as ``hvp`` gives them (the gradient's outputs, seeded 0.0, add
    nothing to H v: -0.0 in ``v`` too), the gradient's those of the gradient program, and
    torch's numbers."""
    P, PT0, C0 = kmeans_program(k=5, d=3, n=300, seed=4)
    v = np.random.default_rng(2).normal(size=C0.shape)
    if case == "zero_v":
        v[::2] = -0.0
        v[1::3] = 0.0
    C = C0.copy()
    if case == "inf":
        C[1, 2] = np.inf
    before = old_hvp(P, (C,), (v,), monkeypatch)
    with monkeypatch.context() as m:
        refuse_other_runs(P, m)
        value, g, hv = P.grad_and_hvp((C,), (v,))
    assert g.shape == hv.shape == C.shape
    assert type(value) is type(before[0]) and bits(value) == bits(before[0]) == bits(P(C))
    assert bits(hv) == bits(P.hvp((C,), (v,))[1]) == bits(before[1])
    assert bits(g) == bits(P.grad_program()(C))
    np.testing.assert_allclose(g, P.grad(C), rtol=1e-13, atol=1e-13)
    if case == "inf":
        return
    Ct = torch.tensor(C, requires_grad=True)
    y = kmeans(torch, Ct, torch.tensor(PT0))
    gt, = torch.autograd.grad(y, Ct, create_graph=True)
    want, = torch.autograd.grad((gt * torch.tensor(v)).sum(), Ct)
    np.testing.assert_allclose(g, gt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(hv, want.numpy(), rtol=1e-12, atol=1e-12)


def test_grad_and_hvp_two_inputs_and_tensors():
    """Two inputs: tuples of each; Tensor inputs give Tensors; as ``value_and_grad`` and
    ``hvp`` give them."""
    with RF.array_instructions(4):
        P = tg.trace(lambda x, y: (tg.exp(x) * y).sum() + (y * y * x).sum(),
                     np.ones(40), np.ones(40))
    assert P._code.arrays and D._hvp_value_code(P._code) is not None
    rng = np.random.default_rng(3)
    x, y, vx, vy = (rng.normal(size=40) for _ in range(4))
    value, g, hv = P.grad_and_hvp((x, y), (vx, vy))
    want = P.value_and_grad(x, y)
    assert bits(value) == bits(want[0])
    for a, b in zip(g, want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14)
    for a, b in zip(hv, P.hvp((x, y), (vx, vy))[1]):
        assert bits(a) == bits(b)
    value, g, hv = P.grad_and_hvp((tg.tensor(x), tg.tensor(y)), (tg.tensor(vx), tg.tensor(vy)))
    assert isinstance(g[0], tg.Tensor) and isinstance(hv[1], tg.Tensor)
    np.testing.assert_allclose(g[1].numpy(), want[1][1], rtol=1e-14, atol=1e-14)


def test_grad_and_hvp_other_paths():
    """Where no one run keeps all three (scalar rows, a declined value, a batch, a guard's
    other variant): ``value_and_grad`` and ``hvp``'s numbers."""
    x0 = np.linspace(-1.0, 1.0, 10)
    R = tg.trace(lambda x: tg.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2),
                 x0)
    with RF.array_instructions(4):
        S = tg.trace(lambda x: tg.exp(x).sum() * tg.amin(x), np.linspace(0.0, 1.0, 16))

    with RF.array_instructions(4):
        G = tg.trace(branchy, np.zeros(32), retrace=True)
    X = np.stack([x0, x0 * 0.5])
    cases = [(R, x0, np.ones(10)), (S, np.linspace(-1.0, 2.0, 16), np.linspace(1.0, 0.5, 16)),
             (R, X, np.ones_like(X)), (G, np.full(32, 0.01), np.ones(32)),
             (G, np.linspace(-2.0, -1.0, 32), np.ones(32))]
    for P, x, v in cases:
        value, g, hv = P.grad_and_hvp(x, v)
        want = P.value_and_grad(x)
        assert bits(value) == bits(want[0])
        np.testing.assert_allclose(g, want[1], rtol=1e-14, atol=1e-14)
        assert bits(hv) == bits(P.hvp((x,), (v,))[1])
    assert len(G._variants) == 2
