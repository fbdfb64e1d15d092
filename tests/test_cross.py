"""cross / linalg.cross give torch's numbers bit for bit: torch's CPU kernel computes each
component as fma(a_p, b_q, -(a_q * b_p)), one rounding fewer than a_p * b_q - a_q * b_p, and
its rule is cross(other, g) and cross(g, input), crosses again. Ours was getitem, mul and
sub (both products rounded): an ulp off, and a tie downstream (minimum, max, sort) then
routed the gradient otherwise (slow tier, surface family, seed 46084: -0.75 vs -0.5)."""
from fractions import Fraction

import numpy as np
import pytest

import tapegrad as tg
from tapegrad._fma import fms_np, fms_py

torch = pytest.importorskip("torch")


def _pair(shape, dim=-1, seed=0, dtype=np.float64):
    """Nearly parallel vectors: the products nearly cancel, so the two roundings differ."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape)
    b = a * 1.3 + rng.standard_normal(shape) * 1e-7
    return a.astype(dtype), b.astype(dtype)


def _rounded_twice(a, b, dim):
    i, j = [1, 2, 0], [2, 0, 1]
    t = np.take
    return t(a, i, dim) * t(b, j, dim) - t(a, j, dim) * t(b, i, dim)


def test_fms_rounds_once():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(500), rng.standard_normal(500)
    c = a * b * (1 + rng.standard_normal(500) * 1e-9)
    exact = np.array([float(Fraction(x) * Fraction(y) - Fraction(z)) for x, y, z in zip(a, b, c)])
    np.testing.assert_array_equal(fms_np(a, b, c), exact)
    assert fms_py(a[3], b[3], c[3]) == exact[3]
    assert (a * b - c != exact).mean() > 0.5  # (the inputs tell the roundings apart)
    f = [x.astype(np.float32) for x in (a, b, c)]
    exact32 = np.array([np.float32(Fraction(float(x)) * Fraction(float(y)) - Fraction(float(z)))
                        for x, y, z in zip(*f)])
    r = fms_np(*f)
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r, exact32)


@pytest.mark.parametrize("shape,dim", [((40, 3), -1), ((3, 9), 0), ((4, 3, 5), 1)])
def test_eager_value_gradient_and_second_order_are_torchs(shape, dim):
    a, b = _pair(shape, dim)
    rng = np.random.default_rng(2)
    g, w = rng.standard_normal(shape), rng.standard_normal(shape)
    assert not np.array_equal(torch.linalg.cross(torch.tensor(a), torch.tensor(b), dim=dim),
                              _rounded_twice(a, b, dim))
    res = []
    for M in (tg, torch):
        x, y = M.tensor(a, requires_grad=True), M.tensor(b, requires_grad=True)
        o = M.linalg.cross(x, y, dim=dim)
        gx, gy = M.autograd.grad(o, (x, y), M.tensor(g), create_graph=True)
        s = (gx * M.tensor(w)).sum() + (gy * gy * M.tensor(w)).sum()
        hx, hy = M.autograd.grad(s, (x, y))
        res.append([t.detach().numpy() for t in (o, gx, gy, hx, hy)])
    for u, v in zip(*res):
        np.testing.assert_array_equal(u, v)


def test_eager_forms_dtypes_and_batched_grads_are_torchs():
    a, b = _pair((3, 7))
    np.testing.assert_array_equal(tg.cross(tg.tensor(a), tg.tensor(b)).numpy(),
                                  torch.cross(torch.tensor(a), torch.tensor(b), dim=0).numpy())
    np.testing.assert_array_equal(tg.tensor(a).cross(tg.tensor(b), 0).numpy(),
                                  torch.tensor(a).cross(torch.tensor(b), 0).numpy())
    a32, b32 = _pair((30, 3), dtype=np.float32)
    r = tg.linalg.cross(tg.tensor(a32), tg.tensor(b32)).numpy()
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r, torch.linalg.cross(torch.tensor(a32),
                                                        torch.tensor(b32)).numpy())
    a, b = _pair((20, 3), seed=4)
    G = np.random.default_rng(5).standard_normal((4, 20, 3))
    res = []
    for M in (tg, torch):
        x, y = M.tensor(a, requires_grad=True), M.tensor(b, requires_grad=True)
        o = M.linalg.cross(x, y)
        gs = M.autograd.grad(o, (x, y), M.tensor(G), is_grads_batched=True)
        res.append([t.detach().numpy() for t in gs])
    for u, v in zip(*res):
        np.testing.assert_array_equal(u, v)
    x = tg.tensor(a, requires_grad=True)
    assert tg.linalg.cross(x, x * 2.0).grad_fn.name() == "LinalgCrossBackward0"


@pytest.mark.parametrize("min_run", [1 << 62, 4])  # scalar rows, array instructions
def test_traced_values_are_torchs_and_gradients_within_an_ulp(min_run):
    from harness import replay_forms as RF
    a, b = _pair((12, 3), seed=6)
    w = np.random.default_rng(7).standard_normal((12, 3))
    with RF.array_instructions(min_run):
        C = tg.trace(lambda x, y: tg.linalg.cross(x, y), a, b)
        P = tg.trace(lambda x, y: (tg.linalg.cross(x, y) * tg.tensor(w)).sum(), a, b)
    a2, b2 = _pair((12, 3), seed=8)
    for x, y in ((a, b), (a2, b2)):
        want = torch.linalg.cross(torch.tensor(x), torch.tensor(y)).numpy()
        np.testing.assert_array_equal(np.asarray(C(x, y)), want)
    # a batch of samples (the batched replay)
    X, Y = np.stack([a, a2]), np.stack([b, b2])
    np.testing.assert_array_equal(np.asarray(C(X, Y)),
                                  torch.linalg.cross(torch.tensor(X), torch.tensor(Y)).numpy())
    # gradients and hvp: the scalar rows add each input's two terms rounded apart (torch's
    # rule fuses them), within an ulp of torch's
    xt, yt = torch.tensor(a2, requires_grad=True), torch.tensor(b2, requires_grad=True)
    s = (torch.linalg.cross(xt, yt) * torch.tensor(w)).sum()
    gt = torch.autograd.grad(s, (xt, yt), create_graph=True)
    d = [np.ones_like(a2), np.full_like(b2, 0.5)]
    ht = torch.autograd.grad(sum((g * torch.tensor(v)).sum() for g, v in zip(gt, d)), (xt, yt))
    _, grads = P.value_and_grad(a2, b2)
    _, hv = P.hvp([a2, b2], d)
    for u, v in zip(list(grads) + list(hv), list(gt) + list(ht)):
        np.testing.assert_allclose(np.asarray(u), v.detach().numpy(), rtol=1e-14, atol=1e-15)


def test_surface_program_of_seed_46084_passes_every_leg():
    # cross(v, v * 1.3 + 0.2) into minimum(., x2): an ulp of cross's changed which side of
    # the minimum's tie took the gradient (batched: -0.75 where torch gives -0.5)
    import test_differential_replay as T
    T.run_legs([46084], ["replay", "batched", "higher", "entry", "arrays", "fused"],
               gen=T.surface_program)


def test_broadcast_operands_give_torchs_values_and_derivatives():
    """(1, 3) against (6, 3), and (5, 1, 3) against (4, 3)... of the same ndim: values to the
    bit; the broadcast operand's gradient sums over the broadcast axis (NumPy's order, torch's
    may differ by an ulp), first and second order."""
    rng = np.random.default_rng(9)
    for sa, sb in (((1, 3), (6, 3)), ((5, 1, 3), (1, 4, 3))):
        a, b = rng.standard_normal(sa), rng.standard_normal(sb)
        shape = np.broadcast_shapes(sa, sb)
        g, w = rng.standard_normal(shape), rng.standard_normal(shape)
        res = []
        for M in (tg, torch):
            x, y = M.tensor(a, requires_grad=True), M.tensor(b, requires_grad=True)
            o = M.linalg.cross(x, y)
            gx, gy = M.autograd.grad(o, (x, y), M.tensor(g), create_graph=True)
            s = (gx * gx).sum() + (gy * M.tensor(b)).sum() + (o * M.tensor(w)).sum()
            hx, hy = M.autograd.grad(s, (x, y))
            res.append([t.detach().numpy() for t in (o, gx, gy, hx, hy)])
        np.testing.assert_array_equal(res[0][0], res[1][0])
        for u, v in zip(res[0][1:], res[1][1:]):
            assert u.shape == v.shape
            np.testing.assert_allclose(u, v, rtol=1e-13, atol=1e-14)


def test_bad_inputs_raise_torchs_error_type_and_record_nothing():
    """Mixed dtypes (torch promotes nothing), other ndims, no length 3 along dim: a
    RuntimeError as torch's, and the tape as it was."""
    def recorded():
        tape = tg.tape.current_tape()
        return 0 if tape is None else len(tape.vals)
    y = tg.tensor(np.ones((2, 3)), requires_grad=True) * 2.0
    for make in (lambda t: t.float(), lambda t: t[None], lambda t: t[:, :2]):
        with pytest.raises(RuntimeError):
            torch.linalg.cross(torch.ones(2, 3, dtype=torch.float64),
                               make(torch.ones(2, 3, dtype=torch.float64)))
        other = make(tg.tensor(np.ones((2, 3)), requires_grad=True))
        n = recorded()
        with pytest.raises(RuntimeError, match="linalg.cross"):
            tg.linalg.cross(y, other)
        with pytest.raises(RuntimeError):
            tg.cross(y, other, dim=-1)
        assert recorded() == n
    with pytest.raises(RuntimeError, match="no dimension of size 3"):
        tg.cross(tg.ones(2, 4), tg.ones(2, 4))
