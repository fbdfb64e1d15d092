"""A max or min of a run of slots as one flat NumPy extreme (``program_arrays._flat_extremes``:
its tree of maxima runs only when that extreme is zero or NaN), and a max's ties and their
count as one NumPy mask kept for the reverse, the picks' sum and rule one step
(``program_arrays._ties``). The expansion's bits (zeros' signs too) where it computes in
order, torch's numbers, on small programs with the thresholds forced down and on large
ones at the defaults."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.bench.gradbench.lse import lse
from tapegrad.interpreters import program_arrays as PA

from harness import replay_forms as RF

torch = pytest.importorskip("torch")


def small(monkeypatch):
    monkeypatch.setattr(PA, "FLAT_MIN", 4)
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 4)
    monkeypatch.setattr(PA, "NUMPY_BCAST_MIN", 4)
    monkeypatch.setattr(PA, "NUMPY_MIN", dict.fromkeys(PA.NUMPY_MIN, 4))


def max3(M, x):
    return M.max(x) * 3.0


def min_neg(M, x):
    return M.min(x) * -2.0


def amax_sq(M, x):  # amax: no element ties with a NaN maximum (all-NaN gradient)
    return M.amax(x) * 3.0 + M.sum(x * x)


def amax3(M, x):
    return M.amax(x) * 3.0


def amin2(M, x):
    return M.amin(x) * 0.5


def spread(M, x):
    return M.max(x) - M.min(x)


def neg_lse(M, x):  # a negative gradient into the picks
    return lse(M, x) * -2.0


EXACT = [max3, min_neg, amax3, amin2, spread]  # computed in order: the expansion's bits


def inputs(n, seed=41):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    yield x
    y = x.copy()
    y[[3, n // 2, n - 1]] = x.max() + 1.0
    y[[4, n - 2]] = x.min() - 1.0
    yield y                                   # ties at the max and at the min
    yield np.full(n, 0.7)                     # all equal: every element ties
    z = -np.abs(x)
    z[::7] = -0.0
    z[3::7] = 0.0
    yield z                                   # a zero maximum of both signs: the tree
    z = -np.abs(x) - 1.0
    z[[2, n - 3]] = -0.0
    yield z                                   # -0.0 the maximum
    z = np.abs(x) + 1.0
    z[[2, n - 3]] = 0.0
    z[5] = -0.0
    yield z                                   # 0.0 and -0.0 the minimum
    for bad in (np.inf, -np.inf, np.nan):
        w = x.copy()
        w[5] = bad
        yield w
    w = x.copy()
    w[[1, n - 1]] = np.nan
    yield w                                   # two NaNs: they share a max's gradient
    yield np.full(n, -np.inf)
    yield np.full(n, np.inf)


def spies(monkeypatch):
    """{name: [results]} of the new steps' calls."""
    seen = {"xred": [], "ties": [], "tiesrev": []}
    for name, key in (("_xred_forward", "xred"), ("_ties_forward", "ties"),
                      ("_ties_reverse", "tiesrev")):
        real = getattr(PA, name)

        def spy(*a, _real=real, _key=key):
            r = _real(*a)
            seen[_key].append(r)
            return r
        monkeypatch.setattr(PA, name, spy)
    return seen


def torch_grad(f, x):
    xt = torch.tensor(x, requires_grad=True)
    y = f(torch, xt)
    g, = torch.autograd.grad(y, xt)
    return y.item(), g.numpy()


def same_bits(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert np.array_equal(a, b, equal_nan=True)
    np.testing.assert_array_equal(np.signbit(a[~np.isnan(a)]), np.signbit(b[~np.isnan(b)]))


def trace(f, x0, min_run):
    with RF.array_instructions(min_run):
        return tg.trace(lambda x: f(tg, x), x0)


@pytest.mark.parametrize("n", [64, 300])  # 300: blocks of 128, then the rest's 44 terms
@pytest.mark.parametrize("f", EXACT)
def test_flat_extremes_and_ties_give_the_expansions_bits(f, n, monkeypatch):
    small(monkeypatch)
    x0 = next(inputs(n))
    seen = spies(monkeypatch)
    P = trace(f, x0, 4)
    S = trace(f, x0, 1 << 40)  # scalar rows only
    for x in inputs(n):
        for k in seen:
            seen[k].clear()
        a, b = P.value_and_grad(x), S.value_and_grad(x)
        same_bits(a[0], b[0])
        same_bits(a[1], b[1])
        assert seen["xred"]  # the flat extreme was tried, and taken but for 0 and NaN
        m = np.nanmax(x) if f in (max3, amax3) else None
        if m is not None:
            assert seen["xred"][0] == (m != 0.0 and not np.isnan(x).any())
        if f not in (spread,):  # (one max or min: its ties' steps ran)
            assert len(seen["ties"]) == 1 and len(seen["tiesrev"]) == 1
        same_bits(P(x), a[0])  # the value alone: the same steps forward
        y, g = torch_grad(f, x)
        np.testing.assert_allclose(a[0], y, rtol=1e-14)
        np.testing.assert_allclose(a[1], g, rtol=1e-14, atol=0)
    # twice in a row: nothing kept from the last call but the same bits
    same_bits(P.value_and_grad(x0)[1], P.value_and_grad(x0)[1])


@pytest.mark.parametrize("f", [lse, neg_lse])
def test_lse_through_the_new_steps_gives_torchs_numbers(f, monkeypatch):
    small(monkeypatch)
    n = 300
    x0 = next(inputs(n))
    seen = spies(monkeypatch)
    P = trace(f, x0, 4)
    E = tg.tensor(x0, requires_grad=True)
    for x in inputs(n):
        a = P.value_and_grad(x)
        assert seen["ties"] and seen["tiesrev"]
        y, g = torch_grad(f, x)
        np.testing.assert_allclose(a[0], y, rtol=1e-13)
        np.testing.assert_allclose(a[1], g, rtol=1e-12, atol=1e-15)
        E = tg.tensor(x, requires_grad=True)
        ge, = tg.autograd.grad(f(tg, E), E)  # eager tapegrad
        np.testing.assert_allclose(a[1], ge.numpy(), rtol=1e-13, atol=1e-16)


def test_large_programs_at_the_default_thresholds():
    n = 140_000  # above NUMPY_RED_MIN: the ties' and the flat max's NumPy steps
    rng = np.random.default_rng(43)
    x0 = rng.normal(size=n)
    P = trace(lse, x0, 16)
    Q = trace(amax_sq, x0, 16)
    xs = [x0, np.where(rng.random(n) < 0.01, x0.max(), x0)]
    for x in xs:
        for f, prog in ((lse, P), (amax_sq, Q)):
            v, g = prog.value_and_grad(x)
            y, gt = torch_grad(f, x)
            np.testing.assert_allclose(v, y, rtol=1e-13)
            np.testing.assert_allclose(g, gt, rtol=1e-12, atol=1e-15)
            np.testing.assert_array_equal(g, prog.value_and_grad(x)[1])


def test_a_comparison_with_the_max_read_elsewhere_stays_slots(monkeypatch):
    """The user's own ``x == max(x)`` (an ``eq`` of the same run and slot, read by a
    product) is not taken for the max's ties: its values are read."""
    small(monkeypatch)

    def f(M, x):
        m = M.max(x)
        return m * M.sum((x == m) * x)
    x0 = next(inputs(64))
    seen = spies(monkeypatch)
    P = trace(f, x0, 4)
    S = trace(f, x0, 1 << 40)
    for x in inputs(64):
        seen["ties"].clear()
        a, b = P.value_and_grad(x), S.value_and_grad(x)
        assert len(seen["ties"]) == 1  # the max's own ties only
        np.testing.assert_allclose(a[0], b[0], rtol=1e-14)
        np.testing.assert_allclose(a[1], b[1], rtol=1e-14)
        if np.isfinite(x).all():  # (a non-finite g times a tie of 0.0 is NaN in replay)
            y, g = torch_grad(f, x)
            np.testing.assert_allclose(a[0], y, rtol=1e-14)
            np.testing.assert_allclose(a[1], g, rtol=1e-14)


@pytest.mark.parametrize("f", [lse, max3, amax_sq])
def test_hvp_and_create_graph_through_the_max(f, monkeypatch):
    small(monkeypatch)
    rng = np.random.default_rng(44)
    n = 300
    x0, v = rng.normal(size=n), rng.normal(size=n)
    x0[[7, 90]] = x0.max() + 0.5  # a tie at the max
    P = trace(f, x0, 4)
    xt = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad(f(torch, xt), xt, create_graph=True)
    if gt.requires_grad:
        hv, = torch.autograd.grad((gt * torch.tensor(v)).sum(), xt, allow_unused=True)
    hv = np.zeros(n) if not gt.requires_grad or hv is None else hv.numpy()
    np.testing.assert_allclose(P.hvp((x0,), (v,))[1], hv, rtol=1e-10, atol=1e-13)
    xs = tg.tensor(x0, requires_grad=True)
    gx, = tg.autograd.grad(P(xs), xs, create_graph=True)
    np.testing.assert_allclose(gx.detach().numpy(), gt.detach().numpy(), rtol=1e-12)
    if f is lse:
        hx, = tg.autograd.grad((gx * tg.tensor(v)).sum(), xs)
        np.testing.assert_allclose(hx.detach().numpy(), hv, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("f", [max3, amax3, neg_lse])
def test_a_compiled_rest_after_the_blocks(f, monkeypatch):
    """The blocks' sums in NumPy, the rest's (44 terms) compiled, as at n = 200,000 with
    the default thresholds: the rest's sum writes its terms' adjoints too
    (``_first_writers``, its reverse step split out), so that the picks are skipped, the
    ties are one step and lse's exp and shift one reverse step (``_exp_shift``); the
    detach that the rest's sum reads runs only before the tree's steps (a zero maximum)."""
    small(monkeypatch)
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 200)
    n = 300
    x0 = next(inputs(n))
    seen = spies(monkeypatch)
    assigned = []
    real = PA._red_assign
    monkeypatch.setattr(PA, "_red_assign", lambda rows, h, k, adj: (
        assigned.append(int(rows[h, 4])), real(rows, h, k, adj)))
    fused = []

    def counted(real):
        return lambda *a: (fused.append(1), real(*a))
    for name in ("_exp_shift_reverse", "_exp_shift_direct_reverse"):
        monkeypatch.setattr(PA, name, counted(getattr(PA, name)))
    P = trace(f, x0, 4)
    S = trace(f, x0, 1 << 40)
    for x in inputs(n):
        for k in seen:
            seen[k].clear()
        assigned.clear()
        fused.clear()
        a, b = P.value_and_grad(x), S.value_and_grad(x)
        assert len(seen["ties"]) == 1 and len(seen["tiesrev"]) == 1
        if f is neg_lse:  # (the exps' rest: compiled, written first, read by the fused
            assert 44 in assigned and fused == [1]  # step of the exp and its shift)
            y, g = torch_grad(f, x)
            np.testing.assert_allclose(a[0], y, rtol=1e-13)
            np.testing.assert_allclose(a[1], g, rtol=1e-12, atol=1e-15)
        else:
            same_bits(a[0], b[0])
            same_bits(a[1], b[1])
