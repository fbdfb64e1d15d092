"""A sum of ``exp(x - a)`` (lse's, logsumexp's shift) whose reverse is one step
(``program_arrays._exp_shift``): the exps' adjoints are neither stored nor read back, the
shift's adjoints written, not zeroed and added to. The bits of the unfused steps on every
call, within rounding of torch; the thresholds are forced down so small programs take it."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.bench.gradbench.lse import lse
from tapegrad.interpreters import program_arrays as PA

from harness import replay_forms as RF

torch = pytest.importorskip("torch")


def small(monkeypatch):
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 4)
    monkeypatch.setattr(PA, "NUMPY_BCAST_MIN", 4)
    monkeypatch.setattr(PA, "NUMPY_MIN", dict(PA.NUMPY_MIN, exp=4))


def neg_lse(M, x):  # a negative gradient into the sum: exps that underflow give -0.0 terms
    return lse(M, x) * -2.0


def neg_lse_and_zeros(M, x):  # x's adjoints added to before the shift's rule
    return lse(M, x) * -2.0 + M.sum(x * -0.0)


def logsumexp_op(M, x):  # its shift by a detached max: the shift's rule stays compiled
    return M.logsumexp(x, 0) * 3.0


def shift_read_twice(M, x):  # the shift read by exp and by a product: not fused
    d = x - M.max(x)
    return M.log(M.sum(M.exp(d))) + M.sum(d * 0.5)


def inputs():
    rng = np.random.default_rng(31)
    x = rng.normal(size=64)
    yield x
    yield np.full(64, 0.7)                       # all equal: every element ties
    z = x.copy()
    z[::3] = -0.0
    z[1::3] = 0.0
    yield z                                      # zeros of both signs (the max is 0)
    yield np.concatenate([x[:32], x[:32] - 800.0])  # exps that underflow to 0
    for bad in (np.inf, -np.inf, np.nan):
        w = x.copy()
        w[5] = bad
        yield w


def traced(f, x0, monkeypatch, fused):
    """``f`` traced with array instructions on their NumPy paths, fused or not (the
    entry is built on the first call)."""
    with RF.array_instructions(4):
        P = tg.trace(lambda x: f(tg, x), x0)
    if not fused:
        monkeypatch.setattr(PA, "_exp_shift", lambda rows, back, out, sets: (back, []))
    P.value_and_grad(x0)
    monkeypatch.undo()
    small(monkeypatch)
    return P


def torch_grad(f, x):
    xt = torch.tensor(x, requires_grad=True)
    y = f(torch, xt)
    g, = torch.autograd.grad(y, xt)
    return y.item(), g.numpy()


@pytest.mark.parametrize("f", [lse, neg_lse, neg_lse_and_zeros])
def test_fused_sum_of_exps_gives_the_unfused_bits_and_torchs_numbers(f, monkeypatch):
    small(monkeypatch)
    x0 = next(inputs())
    calls = []
    real, direct = PA._exp_shift_reverse, PA._exp_shift_direct_reverse

    def spy():  # (lse's shift writes x's adjoints directly: _exp_shift_direct)
        monkeypatch.setattr(PA, "_exp_shift_reverse", lambda *a: (calls.append(1), real(*a)))
        monkeypatch.setattr(PA, "_exp_shift_direct_reverse",
                            lambda *a: (calls.append(1), direct(*a)))
    spy()
    P = traced(f, x0, monkeypatch, True)
    Q = traced(f, x0, monkeypatch, False)
    spy()
    for x in inputs():
        calls.clear()
        a, b = P.value_and_grad(x), Q.value_and_grad(x)
        assert calls == [1]  # P's reverse took the fused step, Q's not
        np.testing.assert_array_equal(a[1].view(np.int64), b[1].view(np.int64))
        assert np.array_equal(a[0], b[0], equal_nan=True)
        y, g = torch_grad(f, x)
        np.testing.assert_allclose(a[0], y, rtol=1e-13)
        np.testing.assert_allclose(a[1], g, rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(np.signbit(a[1][a[1] == 0]), np.signbit(g[a[1] == 0]))
    # twice in a row: the shift's adjoints written anew, not added to the last call's
    np.testing.assert_array_equal(P.value_and_grad(x0)[1], P.value_and_grad(x0)[1])


@pytest.mark.parametrize("f", [shift_read_twice, logsumexp_op])
def test_a_shift_read_elsewhere_is_not_fused(f, monkeypatch):
    small(monkeypatch)
    x0 = next(inputs())
    P = traced(f, x0, monkeypatch, True)
    rows = P._code.arows
    plan = PA._plan(rows)
    out = np.asarray(P._code.out_slots, dtype=np.intp)
    back = PA._reverse_plan(rows, plan)
    assert PA._exp_shift(rows, back, out, PA._first_writers(rows, plan, out)) == (back, [])
    for x in inputs():
        a = P.value_and_grad(x)
        y, g = torch_grad(f, x)
        np.testing.assert_allclose(a[0], y, rtol=1e-13)
        np.testing.assert_allclose(a[1], g, rtol=1e-12, atol=1e-15)


def test_hvp_and_create_graph_through_the_fused_sum(monkeypatch):
    small(monkeypatch)
    rng = np.random.default_rng(32)
    x0, v = rng.normal(size=64), rng.normal(size=64)
    P = traced(lse, x0, monkeypatch, True)
    xt = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad(lse(torch, xt), xt, create_graph=True)
    hv, = torch.autograd.grad((gt * torch.tensor(v)).sum(), xt)
    np.testing.assert_allclose(P.hvp((x0,), (v,))[1], hv.numpy(), rtol=1e-10, atol=1e-13)
    xs = tg.tensor(x0, requires_grad=True)
    gx, = tg.autograd.grad(P(xs), xs, create_graph=True)
    hx, = tg.autograd.grad((gx * tg.tensor(v)).sum(), xs)
    np.testing.assert_allclose(hx.detach().numpy(), hv.numpy(), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(gx.detach().numpy(), gt.detach().numpy(), rtol=1e-12)
