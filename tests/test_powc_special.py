"""``x ** c`` for the exponents torch computes otherwise (``ops.elementwise.POWC_SPECIAL``: 3,
0.5, -0.5, -2 and its derivative's 1.5) is recorded as ``powc_special``, an op of its own,
so that powc's compiled branches keep only the square and pow: every path records it so
(an exponent recorded as powc would run pow, and lose torch's values and -0.0 signs), and
gives torch's numbers, the same bits on every path. The exponents 4, -1 and 2.5 reach
them in their derivatives (4 x ** 3, -(x ** -2), 2.5 x ** 1.5)."""
import json

import numpy as np
import pytest

import tapegrad as tg
from tapegrad._program_code import _hvp_of
from tapegrad.interpreters import fuse
from tapegrad.ops import BY_NAME, ARRAY
from tapegrad.ops.elementwise import POWC_SPECIAL

torch = pytest.importorskip("torch")

SPECIAL = (3.0, 0.5, -0.5, -2.0, 1.5)
THROUGH = (4.0, -1.0, 2.5)
POWC, POWC_S = BY_NAME["powc"].code, BY_NAME["powc_special"].code
inf, nan = np.inf, np.nan
X = np.array([-2.0, -0.0, 0.0, 5e-324, 1e-300, 0.3, 1.0, 4.0, 1e200, inf, -inf, nan])
N = X.shape[0]
W = np.linspace(0.5, 1.5, N)
V = np.linspace(-1.25, 0.75, N)


def _f(M, xs, c):
    s = 0.0
    for i in range(N):
        s = s + W[i] * xs[i] ** c
    return s


def _bits(a):
    """The numbers' bits (the sign of a zero too), every NaN as one (its sign differs
    between paths)."""
    a = np.array(a, dtype=np.float64).ravel()
    return np.where(np.isnan(a), nan, a).tobytes()


def _torch_like(got, want, signs=True):
    """torch's numbers: the same where they are not finite (and, with ``signs``, the signs of
    zeros), within a rounding elsewhere (its pow rule associates ``g * (c * x ** (c - 1))``)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    np.testing.assert_allclose(got.ravel(), want.ravel(), rtol=1e-13, atol=0)
    zero = want == 0.0
    assert not signs or (np.signbit(got[zero]) == np.signbit(want[zero])).all()


def _no_powc_special_exponent(rows):
    op = rows[:, 0].astype(np.int64) & ~ARRAY
    c = rows[op == POWC, 4]
    assert not np.isin(c, list(POWC_SPECIAL)).any(), c


def _torch(c):
    """torch's values, gradient and Hessian-vector product per element."""
    xt = torch.tensor(X, requires_grad=True)
    y = xt ** c
    # (the gradient without create_graph: torch's with it gives inf, not -inf, at x ** 0.5's
    # -0.0, and -0.0, not nan, at its -inf)
    g, = torch.autograd.grad((torch.tensor(W) * y).sum(), xt)
    gg, = torch.autograd.grad((torch.tensor(W) * xt ** c).sum(), xt, create_graph=True)
    h, = torch.autograd.grad(gg, xt, grad_outputs=torch.tensor(V))
    return y.detach().numpy(), g.numpy(), h.numpy()


def _eager(c):
    """Eager tapegrad on 0-d leaves: values, gradient (compiled sweep), gradient and
    Hessian-vector product (create_graph), and the tape's opcodes."""
    xs = [tg.tensor(float(v), requires_grad=True) for v in X]
    ys = [x ** c for x in xs]
    codes = [y._tape.code[5 * y._slot] for y in ys]
    g = tg.autograd.grad(_f(tg, xs, c), xs)
    gg = tg.autograd.grad(_f(tg, xs, c), xs, create_graph=True)
    h = tg.autograd.grad(gg, xs, grad_outputs=[tg.tensor(float(v)) for v in V])
    return ([float(y) for y in ys], [float(t) for t in g], [float(t) for t in gg],
            [float(t) for t in h], codes)


#: the points where every path's derivatives match torch's to a rounding (at zeros and
#: infinities the replayed adjoints' sums give +0.0 for -0.0, and torch's create_graph
#: gives x ** 0.5's second derivative other infinities and zeros than its first's)
REGULAR = np.isfinite(X) & (np.abs(X) > 1e-300)


def _codes(tape):
    code = np.array(tape.code, dtype=np.float64).reshape(-1, 5)
    return np.c_[code[:, 0], code[:, 1:3], np.zeros(len(code)), code[:, 3:]]


@pytest.mark.parametrize("c", SPECIAL + THROUGH)
def test_special_exponents_on_every_path_give_torch_s_numbers(c):
    yt, gt, ht = _torch(c)
    y, g, gg, h, codes = _eager(c)
    assert set(codes) == {POWC_S if c in POWC_SPECIAL else POWC}
    # eager: torch's values exactly (-0.0, nan at -inf), its gradient to a rounding, the
    # create_graph gradient the compiled sweep's bits, and the tape they recorded
    # (the exponents through them: the compiled sweep's adjoints sum a -0.0 to +0.0, and
    # its rule's pow(x, 3) of x ** 4 is an ulp off x * x * x, torch's and create_graph's)
    exact = c in POWC_SPECIAL
    assert _bits(y) == _bits(yt)
    _torch_like(g, gt, signs=exact)
    _torch_like(gg, gt)
    assert _bits(gg) == _bits(g) or not exact
    _torch_like(np.array(h)[REGULAR], ht[REGULAR])
    xs = [tg.tensor(float(v), requires_grad=True) for v in X]
    gs = tg.autograd.grad(_f(tg, xs, c), xs, create_graph=True)
    _no_powc_special_exponent(_codes(gs[5]._tape))
    # eager on an array (its NumPy forward and rules, and create_graph through them)
    xa = tg.tensor(X, requires_grad=True)
    ya = xa ** c
    assert ya._tape.code[5 * ya._slot] & ~ARRAY == (POWC_S if c in POWC_SPECIAL else POWC)
    assert _bits(ya.detach().numpy()) == _bits(y) or not exact  # (np.power's x ** 4)
    ga, = tg.autograd.grad((tg.tensor(W) * ya).sum(), xa, create_graph=True)
    ha, = tg.autograd.grad(ga, xa, grad_outputs=tg.tensor(V))
    assert _bits(ga.detach().numpy()) == _bits(gg) and _bits(ha.numpy()) == _bits(h)
    _no_powc_special_exponent(_codes(ga._tape))

    # traced programs of scalar rows: the values (a program of the powers), the gradient
    # and the Hessian-vector product (of the weighted sum), and their programs' rows
    Q = tg.trace(lambda x: tuple(x[i] ** c for i in range(N)), np.linspace(0.5, 2.0, N))
    P = tg.trace(lambda x: _f(tg, [x[i] for i in range(N)], c), np.linspace(0.5, 2.0, N))
    G = P.grad_program()
    for prog in (Q, P, G, G.grad_program(V)):
        _no_powc_special_exponent(prog._code.rows)
    _no_powc_special_exponent(_hvp_of(P._code).rows)
    assert (Q._code.rows[:, 0] == POWC_S).any() == (c in POWC_SPECIAL)
    # one sample as traced, then past the tier-up (superinstructions, inputs as arguments)
    for _ in range(fuse.TIER + 2):
        assert _bits(Q(X)) == _bits(y)
        val, grad = P.value_and_grad(X)
        _torch_like(grad, gt, signs=False)
    assert _bits(np.asarray(G(X))) == _bits(gg)  # (rows recorded as create_graph records)
    val, hv = P.hvp((X,), (V,))
    _torch_like(hv[REGULAR], ht[REGULAR])
    # a batch, serial and on threads (blocks of samples): each sample's single call
    B = np.stack([X, X[::-1], -X, 0.5 * X] * 3)
    yb = np.asarray(Q(B))
    vb, gb = P.value_and_grad(B)
    Qp, Pp = Q.to("parallel"), P.to("parallel")
    Qp.block = Pp.block = P.block = Q.block = 4
    vp, gp = Pp.value_and_grad(B)
    assert _bits(Qp(B)) == _bits(yb)
    assert _bits(vp) == _bits(vb) and _bits(gp) == _bits(gb)
    for b in range(B.shape[0]):
        v1, g1 = P.value_and_grad(B[b])
        assert _bits(gb[b]) == _bits(g1) and _bits(vb[b]) == _bits(v1)
        assert _bits(np.asarray(yb).reshape(-1, B.shape[0]).T[b]) == _bits(Q(B[b])) or \
            _bits(np.asarray(yb).reshape(B.shape[0], -1)[b]) == _bits(Q(B[b]))
    _, hb = P.hvp((B,), (np.broadcast_to(V, B.shape).copy(),))
    assert _bits(hb[0]) == _bits(hv)

    # a program of array instructions (x ** c over the whole vector)
    A = tg.trace(lambda x: (tg.tensor(W) * x ** c).sum(), np.linspace(0.5, 2.0, N))
    for prog in (A, A.grad_program()):
        _no_powc_special_exponent(prog._code.rows)
    va, gra = A.value_and_grad(X)
    _torch_like(gra, gt, signs=False)
    _, hva = A.hvp((X,), (V,))
    _torch_like(hva[REGULAR], ht[REGULAR])


def test_pow_of_a_0d_tensor_and_a_number_is_torch_s():
    """``tg.pow(x, c)`` and ``x.pow_(c)`` on a 0-d float (the recorder's binary path) give
    torch's pow(x, c): sqrt's -0.0 and nan at -inf, rsqrt's -inf at -0.0 (they ran
    ``math.pow``: 0.0, inf and inf, 0.0)."""
    for c in SPECIAL + THROUGH + (2.0, 0.0, 1.0):
        for v in (-0.0, 0.0, -inf, inf, -2.0, 0.3):
            want = torch.pow(torch.tensor(v, dtype=torch.float64), c).item()
            x = tg.tensor(v, requires_grad=True)
            for got in (tg.pow(x, c), tg.tensor(v).pow_(c), x ** c):
                assert _bits(float(got)) == _bits(want), (c, v)
                assert np.signbit(float(got)) == np.signbit(want) or want != want
            assert tg.pow(x, c)._tape.code[5 * tg.pow(x, c)._slot] == \
                (POWC_S if c in POWC_SPECIAL else POWC)


def test_a_file_from_before_powc_special_loads_its_exponents_as_powc_special(tmp_path):
    """A program file whose rows say powc for these exponents (written before the op was
    made) runs them as powc_special: torch's values, not pow's."""
    P = tg.trace(lambda x: (x[0] ** 3 + x[1] ** 0.5) * x[2] ** -0.5 + x[2] ** 2.5,
                 np.array([0.5, 1.0, 2.0]))
    path = tmp_path / "p.npz"
    P.save(path)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    # as an older writer wrote it: powc rows, and no powc_special among the op names
    meta = json.loads(arrays["meta"].tobytes().decode())
    meta["ops"].remove("powc_special")
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    rows = arrays["rows0"]
    assert (rows[:, 0] == POWC_S).sum() == 3
    rows[rows[:, 0] == POWC_S, 0] = POWC
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    L = tg.load(path)
    assert (L._code.rows[:, 0] == POWC_S).sum() == 3
    _no_powc_special_exponent(L._code.rows)
    for x in (np.array([0.7, -0.0, 3.1]), np.array([-inf, 4.0, -0.0]), np.array([1.3, 0.2, 0.9])):
        assert _bits(L(x)) == _bits(P(x))
        assert _bits(L.value_and_grad(x)[1]) == _bits(P.value_and_grad(x)[1])
