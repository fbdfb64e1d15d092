"""gmm's shape in traced replay: a run of squares summed (``sum(Qxc * Qxc, 1)``,
``program_arrays._sum_squares``) is one compiled step forward and reverse that writes the
squared operand's adjoints first. It computes what the squares' and the sums' own steps
computed, to the bit, and the scalar expansion's bits where those are; where a square's
operand is read again, or its slots repeat, or the squares are read again, the steps stay
as they were. The NumPy thresholds are forced down so that small programs take gmm's
paths; torch is the oracle."""

import sys

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import program_arrays as PA

from harness import replay_forms as RF

torch = pytest.importorskip("torch")

K, D, N = 3, 4, 40
SCALAR = 1 << 62  # no run is that long: scalar rows only


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 16)
    monkeypatch.setattr(PA, "NUMPY_MM_MIN", 16)
    monkeypatch.setattr(PA, "NUMPY_BCAST_MIN", 16)


def split(M, x):
    """Q (K, D, D), mu (K, D) and the points (D, N) from one input."""
    Q = x[:K * D * D].reshape(K, D, D)
    mu = x[K * D * D:K * D * (D + 1)].reshape(K, D)
    P = x[K * D * (D + 1):].reshape(D, N)
    return Q, mu, P


def gmm(M, x):
    """gradbench.gmm's work: centred points, a batched product, the sum of its squares over
    the coordinates, logsumexp over the components."""
    Q, mu, P = split(M, x)
    xc = P[None, :, :] - mu[:, :, None]                         # (K, D, N)
    Qxc = M.matmul(Q, xc)                                       # (K, D, N)
    beta = -0.5 * M.sum(Qxc * Qxc, 1)                           # (K, N)
    return M.sum(M.logsumexp(beta, 0))


def scaled(M, x):
    """Squares of an elementwise product summed over the coordinates, then summed (with
    ``NUMPY_RED_MIN`` between the two sums' sizes, no NumPy path besides the sums of
    squares: the expansion's bits throughout)."""
    Q, mu, P = split(M, x)
    y = P[None, :, :] * mu[:, :, None]                          # (K, D, N)
    s = M.sum(y * y, 1)                                         # (K, N)
    return (s * 0.5).sum()


def transposed(M, x):
    """The squared operand strided along the outputs (a transpose: ``_sqs_forward``'s
    loop an output at a time)."""
    Q, mu, P = split(M, x)
    Z = (P.T.reshape(1, N, D) * mu[:, None, :]).transpose(1, 2)  # (K, D, N), strides (., 1, D)
    return (M.sum(Z * Z, 1) * 0.5).sum()


def kmeans(M, x):
    """gradbench.kmeans' cost: the squares one instruction (``diff`` contiguous), run in
    NumPy when ``NUMPY_MIN`` allows."""
    Q, mu, P = split(M, x)
    diff = P[None, :, :] - mu[:, :, None]
    return M.sum(M.min(M.sum(diff * diff, 1), 0).values)


def inputs_squared(M, x):
    """The input itself squared and summed (its adjoints written by the step: nothing but
    the squares reads it after them), read before by an exp."""
    X = x[:160].reshape(2, 4, 20)
    e = M.sum(M.exp(x * 0.1))
    return M.sum(M.logsumexp(-0.5 * M.sum(X * X, 1), 0)) + e


def reread_x(M, x):
    """``Qxc`` read again after its squares' sums: its adjoints get that reader's gradient
    too, so the sums of squares may not write them."""
    Q, mu, P = split(M, x)
    Qxc = M.matmul(Q, P[None, :, :] - mu[:, :, None])
    return M.sum(M.logsumexp(-0.5 * M.sum(Qxc * Qxc, 1), 0)) + M.sum(Qxc * 0.25)


def reread_squares(M, x):
    """The squares read again (by another sum): no first writer of their adjoints."""
    Q, mu, P = split(M, x)
    Qxc = M.matmul(Q, P[None, :, :] - mu[:, :, None])
    sq = Qxc * Qxc
    return M.sum(M.logsumexp(-0.5 * M.sum(sq, 1), 0)) + M.sum(sq[1] * 0.1)


def broadcast_x(M, x):
    """The squared operand broadcast over the components: every slot of it in K squares,
    whose gradients add up (written once each, they would be lost)."""
    Q, mu, P = split(M, x)
    Pb = (P * 1.5)[None, :, :].expand(K, D, N)
    return M.sum(M.logsumexp(-0.5 * M.sum(Pb * Pb, 1), 0))


def steps(P):
    """The forward and reverse plans of ``P``'s one-sample replay (after a call)."""
    run = P._code.run
    cells = dict(zip(run.__code__.co_freevars, (c.cell_contents for c in run.__closure__)))
    return cells["plan"], cells["back"]


def fused(P):
    plan, back = steps(P)
    f = sum(type(s[4]) is tuple and s[4][0] is PA.SQS for s in plan)
    b = sum(type(s[3]) is tuple and s[3][0] is PA.SQS for s in back)
    return f, b


def squares_left_out(P):
    """No forward or reverse step but the sums of squares runs the squares' rows."""
    plan, back = steps(P)
    m0 = [s[4][1] for s in plan if type(s[4]) is tuple and s[4][0] is PA.SQS][0]
    assert not any(s[0] <= m0 < s[1] for s in plan), plan
    # (a compiled step: its last row, slot, first row; a NumPy one: first row, slot, after)
    rows_of = [(s[2], s[0] + 1) if s[3] is None or s[3] is PA.RED else (s[0], s[2])
               for s in back if not (type(s[3]) is tuple and s[3][0] is PA.SQS)]
    assert not any(a <= m0 < b for a, b in rows_of), back


def trace(f, x0, min_run=4):
    with RF.array_instructions(min_run):
        return tg.trace(lambda x: f(tg, x), x0)


def torch_derivs(f, x, v):
    xt = torch.tensor(x, requires_grad=True)
    y = f(torch, xt)
    g, = torch.autograd.grad(y, xt, create_graph=True)
    hv, = torch.autograd.grad((g * torch.tensor(v)).sum(), xt)
    return y.item(), g.detach().numpy(), hv.numpy()


def inputs(seed, case=None):
    x = np.random.default_rng(seed).normal(size=K * D * (D + 1) + D * N)
    x[:K * D * D] *= 0.3
    if case == "nan":
        x[K * D * (D + 1) + 7] = np.nan
    elif case == "inf":
        x[K * D * (D + 1) + 9] = np.inf
    elif case == "zero":  # -0.0 everywhere in Q and mu, 0.0 points: signed zeros
        x[:K * D * (D + 1)] = -0.0
        x[K * D * (D + 1):K * D * (D + 1) + N] = 0.0
    return x


def same(a, b):
    """Bit for bit, NaNs and zeros' signs included."""
    a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
    return a.view(np.int64).tolist() == b.view(np.int64).tolist()


def unfused(f, x0, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(PA, "FUSE_SQUARES", False)
        Q = trace(f, x0)
        Q.value_and_grad(x0)  # (its replay's steps are made at the first call)
    assert fused(Q) == (0, 0)
    return Q


def test_gmm_sums_of_squares_are_one_step(small, monkeypatch):
    x0 = inputs(0)
    P = trace(gmm, x0)
    v, g = P.value_and_grad(x0)
    assert fused(P) == (1, 1)
    squares_left_out(P)
    U = unfused(gmm, x0, monkeypatch)
    for case in (None, "nan", "inf", "zero"):
        for seed in range(3):
            x = inputs(seed, case)
            a, b = P.value_and_grad(x), U.value_and_grad(x)
            assert same(a[0], b[0]) and same(a[1], b[1]), (case, seed)
    w = np.random.default_rng(9).normal(size=x0.shape)
    y, gt, hv = torch_derivs(gmm, x0, w)
    assert np.isclose(v, y, rtol=1e-13)
    np.testing.assert_allclose(g, gt, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(P.hvp((x0,), (w,))[1], hv, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("f", [scaled, transposed])
def test_the_step_gives_the_expansions_bits(monkeypatch, f):
    # (the sums of squares in one step alone, K * N * D = 480 terms: the last sum's 120 and
    # mu's broadcast gradient summed in order)
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 200)
    x0 = inputs(1)
    P = trace(f, x0)
    S = trace(f, x0, SCALAR)
    for case in (None, "nan", "inf", "zero"):
        x = inputs(2, case)
        a, s = P.value_and_grad(x), S.value_and_grad(x)
        assert same(a[0], s[0]) and same(a[1], s[1]), case
    assert fused(P) == (1, 1)
    y, gt, _ = torch_derivs(f, x0, x0)
    v, g = P.value_and_grad(x0)
    assert np.isclose(v, y, rtol=1e-13)
    np.testing.assert_allclose(g, gt, rtol=1e-12, atol=1e-14)


def test_an_inputs_adjoints_written_by_the_step(small, monkeypatch):
    x0 = inputs(7)
    P = trace(inputs_squared, x0)
    v, g = P.value_and_grad(x0)
    assert fused(P) == (1, 1)
    U = unfused(inputs_squared, x0, monkeypatch)
    for case in (None, "nan", "inf", "zero"):
        x = inputs(8, case)
        a, b = P.value_and_grad(x), U.value_and_grad(x)
        assert same(a[0], b[0]) and same(a[1], b[1]), case
    y, gt, _ = torch_derivs(inputs_squared, x0, x0)
    assert np.isclose(v, y, rtol=1e-13)
    np.testing.assert_allclose(g, gt, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("f", [reread_x, reread_squares, broadcast_x])
def test_no_step_where_the_slots_are_read_again_or_repeat(small, f):
    x0 = inputs(3)
    P = trace(f, x0)
    v, g = P.value_and_grad(x0)
    y, gt, _ = torch_derivs(f, x0, x0)
    assert np.isclose(v, y, rtol=1e-13)
    np.testing.assert_allclose(g, gt, rtol=1e-11, atol=1e-13)
    assert fused(P) == (0, 0)


def test_the_same_bits_every_call_and_between_samples(small):
    x0 = inputs(4)
    P = trace(gmm, x0)
    xs = [inputs(s) for s in range(4)]
    want = [P.value_and_grad(x) for x in xs]
    for _ in range(2):
        for x, (v, g) in zip(xs, want):
            a = P.value_and_grad(x)
            assert same(a[0], v) and same(a[1], g)


def test_kmeans_squares_in_numpy_are_left_out_of_the_forward(small, monkeypatch):
    monkeypatch.setitem(PA.NUMPY_MIN, "mul", 16)
    x0 = inputs(5)
    P = trace(kmeans, x0)
    v, g = P.value_and_grad(x0)
    assert fused(P) == (1, 1)
    squares_left_out(P)
    U = unfused(kmeans, x0, monkeypatch)
    for case in (None, "nan", "inf", "zero"):
        x = inputs(6, case)
        a, b = P.value_and_grad(x), U.value_and_grad(x)
        assert same(a[0], b[0]) and same(a[1], b[1]), case
    w = np.ones_like(x0)
    y, gt, hv = torch_derivs(kmeans, x0, w)
    assert np.isclose(v, y, rtol=1e-13)
    np.testing.assert_allclose(g, gt, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(P.hvp((x0,), (w,))[1], hv, rtol=1e-9, atol=1e-11)



def test_adjoints_left_unzeroed_are_written_every_call(small, monkeypatch):
    # enough points that the replay zeroes slices, not all adjoints (``_live``): the
    # squared operand's adjoints are in none of them, and each call writes them all (a
    # slot left unwritten would keep the last call's gradient)
    monkeypatch.setattr(sys.modules[__name__], "N", 3000)
    x0 = inputs(10)
    P = trace(gmm, x0)
    P.value_and_grad(x0)
    run = P._code.run
    live = PA.zeroed(run)
    assert live is not None and fused(P) == (1, 1)
    plan, _ = steps(P)
    ranges = [r for s in plan if type(s[4]) is tuple and s[4][0] is PA.SQS for r in s[4][-1]]
    assert sum(b - a for a, b in ranges) == K * D * 3000
    assert not any(sl.start < b and a < sl.stop for sl in live for a, b in ranges)
    U = unfused(gmm, x0, monkeypatch)
    xs = [inputs(s, case) for s, case in ((11, None), (12, "zero"), (13, "nan"), (11, None))]
    for x in xs:
        a, b = P.value_and_grad(x), U.value_and_grad(x)
        assert same(a[0], b[0]) and same(a[1], b[1])
    y, gt, _ = torch_derivs(gmm, xs[0], xs[0])
    np.testing.assert_allclose(P.value_and_grad(xs[0])[1], gt, rtol=1e-10, atol=1e-12)


def _fuzz_program(rng):
    """A random program around a run of squares summed: shapes, the squared operand's
    layout (a product's output, a transpose, the input, a broadcast), and whether the
    operand or the squares are read again, and where."""
    k, d, n = int(rng.integers(2, 5)), int(rng.integers(2, 6)), int(rng.integers(16, 60))
    layout = ["mm", "ew", "transposed", "input", "broadcast"][int(rng.integers(0, 5))]
    reread = ["none", "x_after", "squares_after", "x_before"][int(rng.integers(0, 4))]
    axis = int(rng.integers(1, 3)) if layout != "broadcast" else 1
    size = k * d * d + k * d + d * n + k * d * n

    def f(M, x):
        Q = x[:k * d * d].reshape(k, d, d)
        mu = x[k * d * d:k * d * (d + 1)].reshape(k, d)
        P = x[k * d * (d + 1):k * d * (d + 1) + d * n].reshape(d, n)
        R = x[k * d * (d + 1) + d * n:].reshape(k, d, n)
        extra = 0.0
        if reread == "x_before":
            extra = M.sum(M.exp(R * 0.1))
        if layout == "mm":
            X = M.matmul(Q, P[None, :, :] - mu[:, :, None])
        elif layout == "ew":
            X = P[None, :, :] * mu[:, :, None]
        elif layout == "transposed":
            X = (R.transpose(1, 2) * 1.5).transpose(1, 2)
        elif layout == "input":
            X = R
        else:
            X = (P * 1.5)[None, :, :].expand(k, d, n)
        sq = X * X
        out = M.sum(M.logsumexp(-0.5 * M.sum(sq, axis), 0))
        if reread == "x_after":
            out = out + M.sum(X[0] * 0.25)
        elif reread == "squares_after":
            out = out + M.sum(sq[-1] * 0.1)
        return out + extra
    return f, size, (k, d, n, layout, reread, axis)


@pytest.mark.slow
def test_fuzz_sums_of_squares(monkeypatch):
    # seeded: random shapes, layouts and readers, thresholds forced down at random; the
    # fused replay against the old steps' bits and torch
    rng = np.random.default_rng(2026)
    taken = 0
    for case in range(200):
        f, size, what = _fuzz_program(rng)
        with monkeypatch.context() as m:
            m.setattr(PA, "NUMPY_RED_MIN", int(rng.choice([16, 200, 65536])))
            m.setattr(PA, "NUMPY_MM_MIN", int(rng.choice([16, 65536])))
            m.setattr(PA, "NUMPY_BCAST_MIN", int(rng.choice([16, 8192])))
            m.setitem(PA.NUMPY_MIN, "mul", int(rng.choice([16, 65536])))
            x0 = rng.normal(size=size) * 0.5
            P = trace(f, x0)
            P.value_and_grad(x0)
            taken += fused(P)[1]
            U = unfused(f, x0, m)
            for special in (None, "nan", "zero"):
                x = x0 * (1 + 0.1 * rng.normal(size=size))
                if special == "nan":
                    x[int(rng.integers(0, size))] = np.nan
                elif special == "zero":
                    x[:size // 3] = -0.0
                a, b = P.value_and_grad(x), U.value_and_grad(x)
                if what[-1] == 1:  # (terms strided: NumPy's sum adds them in order too)
                    assert same(a[0], b[0]) and same(a[1], b[1]), (case, what, special)
                else:  # (contiguous: NumPy's pairwise, the step's in order)
                    np.testing.assert_allclose(a[0], b[0], rtol=1e-13)
                    np.testing.assert_allclose(a[1], b[1], rtol=1e-12, atol=1e-14)
            y, gt, _ = torch_derivs(f, x0, x0)
            np.testing.assert_allclose(P.value_and_grad(x0)[1], gt, rtol=1e-10, atol=1e-12,
                                       err_msg=str((case, what)))
    assert taken >= 30, taken  # (39 of the 200 with this seed)
