"""torch's conventions at ties and singular points, checked against torch itself.

Each case runs on the 0-d scalar path (Python floats, compiled sweep) and on the array
path (all the case's points in one array), and compares values and gradients with torch,
nan and inf positions included.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as TF  # noqa: E402

import tapegrad  # noqa: E402

NAN, INF = float("nan"), float("inf")
TOL = dict(rtol=1e-12, atol=1e-300)


class _TorchNS:
    softplus = staticmethod(TF.softplus)

    def __getattr__(self, name):
        return getattr(torch, name)


TG, TH = tapegrad, _TorchNS()


def _tg(a, requires_grad):
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 0:
        return tapegrad.tensor(float(a), requires_grad=requires_grad)
    return tapegrad.tensor(a, requires_grad=requires_grad)


def _th(a, requires_grad):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=requires_grad)


def _close(tg, th, what):
    assert tuple(tg.shape) == tuple(th.shape), what
    np.testing.assert_allclose(np.asarray(tg.detach().numpy(), dtype=np.float64),
                               th.detach().numpy(), equal_nan=True, err_msg=what, **TOL)


def compare(fn, arrays, requires=None, grad_output=None):
    """Values and gradients of ``fn(m, *leaves)`` in tapegrad and torch, nan/inf included."""
    requires = requires or [True] * len(arrays)
    tg_in = [_tg(a, r) for a, r in zip(arrays, requires)]
    th_in = [_th(a, r) for a, r in zip(arrays, requires)]
    tg_out, th_out = fn(TG, *tg_in), fn(TH, *th_in)
    _close(tg_out, th_out, f"value at {arrays}")
    g = np.ones(tuple(th_out.shape)) if grad_output is None else np.asarray(grad_output)
    tg_w = [t for t, r in zip(tg_in, requires) if r]
    th_w = [t for t, r in zip(th_in, requires) if r]
    tg_g = tapegrad.autograd.grad(tg_out, tg_w, grad_outputs=_tg(g, False))
    th_g = torch.autograd.grad(th_out, th_w, grad_outputs=torch.tensor(g))
    for i, (a, b) in enumerate(zip(tg_g, th_g)):
        _close(a, b, f"gradient {i} at {arrays}")
    return tg_out, tg_g


# ---------------------------------------------------------------------------------------
# elementwise conventions: (label, fn(m, *xs), points); a point is one value per input

ELEMENTWISE = [
    # ties
    ("maximum ties half each", lambda m, x, y: m.maximum(x, y),
     [(1.0, 1.0), (0.0, -0.0), (2.0, 1.0), (1.0, 2.0), (-3.0, -3.0), (NAN, 1.0), (1.0, NAN)]),
    ("minimum ties half each", lambda m, x, y: m.minimum(x, y),
     [(1.0, 1.0), (0.0, -0.0), (2.0, 1.0), (1.0, 2.0), (-3.0, -3.0), (NAN, 1.0), (1.0, NAN)]),
    ("max(x, y) ties half each", lambda m, x, y: m.max(x, y), [(1.0, 1.0), (2.0, 1.0)]),
    # clamp passes the gradient at its bounds
    ("clamp(x, -1, 1) at bounds", lambda m, x: m.clamp(x, -1.0, 1.0),
     [(-1.0,), (1.0,), (0.0,), (2.0,), (-2.0,), (NAN,), (INF,), (-INF,)]),
    ("clamp(x, min=0.5) at bound", lambda m, x: m.clamp(x, min=0.5), [(0.5,), (0.4,), (0.6,)]),
    ("clamp(x, max=0.5) at bound", lambda m, x: m.clamp(x, max=0.5), [(0.5,), (0.4,), (0.6,)]),
    ("clamp(x, 1, -1) min above max", lambda m, x: m.clamp(x, 1.0, -1.0),
     [(0.0,), (2.0,), (-2.0,), (1.0,), (-1.0,)]),
    ("clamp(x, 1, 1) degenerate", lambda m, x: m.clamp(x, 1.0, 1.0), [(1.0,), (0.0,), (2.0,)]),
    ("clamp(x, min=y) at bound", lambda m, x, y: m.clamp(x, min=y),
     [(1.0, 1.0), (0.0, 1.0), (2.0, 1.0)]),
    ("clamp(x, max=y) at bound", lambda m, x, y: m.clamp(x, max=y),
     [(1.0, 1.0), (0.0, 1.0), (2.0, 1.0)]),
    # gradient 0 at 0
    ("relu at 0", lambda m, x: m.relu(x), [(0.0,), (-0.0,), (1.0,), (-1.0,), (INF,), (-INF,)]),
    ("abs at 0", lambda m, x: m.abs(x), [(0.0,), (-0.0,), (2.0,), (-2.0,), (-INF,)]),
    ("sign gradient is zero", lambda m, x: m.sign(x),
     [(0.0,), (-0.0,), (2.0,), (-3.0,), (NAN,), (INF,)]),
    # pow at a zero base
    ("pow(x, y) at x == 0", lambda m, x, y: x ** y,
     [(0.0, 2.0), (0.0, 0.0), (0.0, 0.5), (0.0, 1.0), (0.0, 3.0), (0.0, -1.0), (0.0, -2.0),
      (0.0, -0.5), (-0.0, 2.0), (-0.0, 3.0)]),
    ("x ** 0 at 0", lambda m, x: x ** 0.0, [(0.0,), (-1.0,), (2.0,)]),
    ("x ** 2 at 0", lambda m, x: x ** 2.0, [(0.0,), (-0.0,)]),
    ("x ** 0.5 at 0", lambda m, x: x ** 0.5, [(0.0,)]),
    ("x ** 1 at 0", lambda m, x: x ** 1.0, [(0.0,)]),
    ("x ** -1 at 0", lambda m, x: x ** -1.0, [(0.0,), (-0.0,)]),
    ("x ** -2 at 0", lambda m, x: x ** -2.0, [(0.0,)]),
    ("0 ** y", lambda m, y: 0.0 ** y, [(2.0,), (0.0,), (0.5,), (-1.0,), (-0.0,)]),
    ("pow(0, y)", lambda m, y: m.pow(0.0, y), [(2.0,), (0.0,), (-1.0,)]),
    # pow of a negative base
    ("pow(x, y) negative base", lambda m, x, y: x ** y,
     [(-2.0, 0.5), (-8.0, 1.0 / 3.0), (-2.0, 3.0), (-2.0, 2.0), (-2.0, -1.5), (-2.0, -2.0)]),
    ("x ** 0.5 negative", lambda m, x: x ** 0.5, [(-4.0,)]),
    ("x ** 3 negative", lambda m, x: x ** 3.0, [(-2.0,)]),
    ("x ** -1.5 negative", lambda m, x: x ** -1.5, [(-2.0,)]),
    ("(-2) ** y", lambda m, y: (-2.0) ** y, [(0.5,), (3.0,), (2.0,)]),
    # atan2 at the origin
    ("atan2 at the origin", lambda m, y, x: m.atan2(y, x),
     [(0.0, 0.0), (-0.0, 0.0), (0.0, -0.0), (0.0, 1.0), (1.0, 0.0), (0.0, -1.0), (-1.0, 0.0)]),
    # where lets NaN from the unselected branch through
    ("where(x > 0, sqrt(x), 0)", lambda m, x: m.where(x > 0, m.sqrt(x), 0.0),
     [(-1.0,), (0.0,), (4.0,)]),
    ("where(x != 0, 1 / x, 0)", lambda m, x: m.where(x != 0, 1.0 / x, 0.0), [(0.0,), (2.0,)]),
    ("where(x > 0, log(x), x)", lambda m, x: m.where(x > 0, m.log(x), x),
     [(0.0,), (-1.0,), (2.0,)]),
    ("where(x > 0, x, log(x))", lambda m, x: m.where(x > 0, x, m.log(x)), [(0.0,), (2.0,)]),
    ("where(x < 1, 0, asin(x))", lambda m, x: m.where(x < 1, 0.0, m.asin(x)),
     [(0.0,), (2.0,)]),
    # sqrt, log and friends at and past their singular points
    ("sqrt at 0 and below", lambda m, x: m.sqrt(x), [(0.0,), (-0.0,), (-1.0,), (INF,)]),
    ("rsqrt at 0 and below", lambda m, x: m.rsqrt(x), [(0.0,), (-0.0,), (-1.0,), (INF,)]),
    ("log at 0 and below", lambda m, x: m.log(x), [(0.0,), (-0.0,), (-1.0,), (INF,)]),
    ("log1p at -1 and below", lambda m, x: m.log1p(x), [(-1.0,), (-2.0,), (INF,)]),
    ("asin at and past 1", lambda m, x: m.asin(x), [(1.0,), (-1.0,), (2.0,)]),
    ("acos at and past 1", lambda m, x: m.acos(x), [(1.0,), (-1.0,), (-2.0,)]),
    ("reciprocal at 0", lambda m, x: m.reciprocal(x), [(0.0,), (-0.0,), (INF,)]),
    # division by zero
    ("x / y by zero", lambda m, x, y: x / y,
     [(1.0, 0.0), (-1.0, 0.0), (0.0, 0.0), (1.0, -0.0), (INF, 0.0), (1.0, INF)]),
    ("x / 0", lambda m, x: x / 0.0, [(1.0,), (-1.0,), (0.0,)]),
    ("x / -0", lambda m, x: x / -0.0, [(1.0,), (0.0,)]),
    ("1 / x at 0", lambda m, x: 1.0 / x, [(0.0,), (-0.0,)]),
    ("0 / x at 0", lambda m, x: 0.0 / x, [(0.0,), (1.0,)]),
    # overflow and infinities
    ("exp overflow", lambda m, x: m.exp(x), [(1000.0,), (-1000.0,), (709.0,), (710.0,),
                                             (INF,), (-INF,), (NAN,)]),
    ("expm1 overflow", lambda m, x: m.expm1(x), [(1000.0,), (-1000.0,), (INF,)]),
    ("sinh overflow", lambda m, x: m.sinh(x), [(1000.0,), (-1000.0,)]),
    ("cosh overflow", lambda m, x: m.cosh(x), [(1000.0,), (-1000.0,)]),
    ("sigmoid saturates", lambda m, x: m.sigmoid(x),
     [(1000.0,), (-1000.0,), (-745.0,), (40.0,), (INF,), (-INF,)]),
    ("tanh saturates", lambda m, x: m.tanh(x), [(1000.0,), (-1000.0,), (INF,)]),
    ("softplus large", lambda m, x: m.softplus(x), [(1000.0,), (-1000.0,), (20.0,)]),
    ("softplus beta large", lambda m, x: m.softplus(x, beta=100.0, threshold=5.0),
     [(10.0,), (0.05,), (0.049,)]),
    ("erf saturates", lambda m, x: m.erf(x), [(1000.0,), (-30.0,)]),
    ("atan of inf", lambda m, x: m.atan(x), [(INF,), (-INF,)]),
    ("square overflow", lambda m, x: m.square(x), [(1e200,)]),
    ("x ** 2 overflow", lambda m, x: x ** 2.0, [(1e200,), (-1e200,)]),
    ("x ** 3 overflow", lambda m, x: x ** 3.0, [(-1e200,)]),
    ("2 ** x overflow", lambda m, x: 2.0 ** x, [(2000.0,), (-2000.0,)]),
    ("x * y overflow", lambda m, x, y: x * y, [(1e200, 1e200), (1e200, 0.0)]),
    ("x + y with infinities", lambda m, x, y: x + y, [(INF, -INF), (INF, 1.0)]),
    ("exp(x) * 0", lambda m, x: m.exp(x) * 0.0, [(1000.0,)]),
]

_IDS = [e[0] for e in ELEMENTWISE]


@pytest.mark.parametrize("label,fn,points", ELEMENTWISE, ids=_IDS)
def test_scalar_path(label, fn, points):
    """Each point alone, as 0-d Python floats: the compiled scalar sweep."""
    for p in points:
        compare(fn, list(p))
        if len(p) == 2:  # one side a constant (scalar const entry or const-folded form)
            compare(fn, list(p), [True, False])
            compare(fn, list(p), [False, True])


@pytest.mark.parametrize("label,fn,points", ELEMENTWISE, ids=_IDS)
def test_array_path(label, fn, points):
    """All the points in one array per input: the array path."""
    arrays = [np.array(col, dtype=np.float64) for col in zip(*points)]
    compare(fn, arrays)
    if len(arrays) == 2:
        compare(fn, arrays, [True, False])
        compare(fn, arrays, [False, True])
    compare(fn, [a.reshape(-1, 1) for a in arrays])  # 2-D as well


@pytest.mark.parametrize("label,fn,points", ELEMENTWISE, ids=_IDS)
def test_random_grad_output(label, fn, points):
    """A seed other than 1 (scaling of inf/nan gradients, signs)."""
    arrays = [np.array(col, dtype=np.float64) for col in zip(*points)]
    g = np.linspace(-1.5, 2.0, len(points))
    compare(fn, arrays, grad_output=g)


# ---------------------------------------------------------------------------------------
# the conventions API.md spells out, checked against both torch and the numbers


def test_maximum_minimum_tie_numbers():
    for fn in (tapegrad.maximum, tapegrad.minimum):
        for shape in ((), (3,)):
            x = _tg(np.full(shape, 2.0), True)
            y = _tg(np.full(shape, 2.0), True)
            gx, gy = tapegrad.autograd.grad(fn(x, y).sum(), [x, y])
            np.testing.assert_array_equal(np.asarray(gx.numpy()), np.full(shape, 0.5))
            np.testing.assert_array_equal(np.asarray(gy.numpy()), np.full(shape, 0.5))


def test_clamp_bounds_numbers():
    x = _tg(np.array([-1.0, 1.0, 0.0, 2.0]), True)
    (g,) = tapegrad.autograd.grad(tapegrad.clamp(x, -1.0, 1.0).sum(), x)
    np.testing.assert_array_equal(g.numpy(), [1.0, 1.0, 1.0, 0.0])
    for v in (-1.0, 1.0):
        s = _tg(v, True)
        (g,) = tapegrad.autograd.grad(tapegrad.clamp(s, -1.0, 1.0), s)
        assert g.item() == 1.0


@pytest.mark.parametrize("fn", [tapegrad.relu, tapegrad.abs, tapegrad.sign,
                                lambda x: tapegrad.norm(x.reshape(-1))],
                         ids=["relu", "abs", "sign", "norm"])
def test_zero_gradient_at_zero(fn):
    for v in (0.0, np.zeros(3)):
        x = _tg(v, True)
        y = fn(x)
        (g,) = tapegrad.autograd.grad(y.sum() if y.ndim else y, x)
        assert np.all(np.asarray(g.numpy()) == 0.0)


def test_pow_exponent_gradient_zero_at_zero_base():
    for b in (0.0, 0.5, 2.0):
        x, y = _tg(0.0, True), _tg(b, True)
        _, gy = tapegrad.autograd.grad(x ** y, [x, y])
        assert gy.item() == 0.0
        (gy,) = tapegrad.autograd.grad(0.0 ** y, y)
        assert gy.item() == 0.0


def test_atan2_origin_gradient_zero():
    for shape in ((), (2,)):
        y, x = _tg(np.zeros(shape), True), _tg(np.zeros(shape), True)
        gy, gx = tapegrad.autograd.grad(tapegrad.atan2(y, x).sum(), [y, x])
        assert np.all(np.asarray(gy.numpy()) == 0.0) and np.all(np.asarray(gx.numpy()) == 0.0)


def test_where_lets_nan_through():
    for v in (-1.0, np.array([-1.0, 4.0])):
        x = _tg(v, True)
        y = tapegrad.where(x > 0, tapegrad.sqrt(x), 0.0)
        (g,) = tapegrad.autograd.grad(y.sum() if y.ndim else y, x)
        assert np.isnan(np.asarray(g.numpy()).reshape(-1)[0])


# ---------------------------------------------------------------------------------------
# reductions: ties and singular points (array path; 0-d where torch allows it)

FULL_TIES = {
    "three-way tie": np.array([1.0, 3.0, 3.0, 0.0, 3.0]),
    "all equal": np.full((2, 3), 2.0),
    "2-D tie": np.array([[1.0, 5.0], [5.0, -1.0]]),
    "negative ties": np.array([-1.0, -1.0, -4.0, -4.0]),
    "nan": np.array([1.0, NAN, 3.0]),
    "two nans": np.array([1.0, NAN, 3.0, NAN]),
    "inf ties": np.array([INF, 1.0, INF, -INF, -INF]),
    "0-d": np.array(2.5),
}


@pytest.mark.parametrize("which", list(FULL_TIES))
@pytest.mark.parametrize("fname", ["max", "min", "amax", "amin"])
def test_full_max_min_split_ties_evenly(fname, which):
    x = FULL_TIES[which]
    compare(lambda m, a: getattr(m, fname)(a), [x])
    compare(lambda m, a: getattr(m, fname)(a), [x], grad_output=np.array(-2.0))


def test_full_max_split_numbers():
    x = _tg(np.array([1.0, 3.0, 3.0, 0.0, 3.0]), True)
    (g,) = tapegrad.autograd.grad(tapegrad.max(x), x)
    np.testing.assert_allclose(g.numpy(), [0, 1 / 3, 1 / 3, 0, 1 / 3], rtol=1e-15)


DIM_TIES = {
    "row ties": np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0], [0.0, -1.0, 0.0]]),
    "nan in a row": np.array([[1.0, NAN, 3.0], [2.0, 2.0, NAN], [NAN, NAN, 0.0]]),
    "inf ties": np.array([[INF, INF, 1.0], [-INF, -INF, -INF]]),
}


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("which", list(DIM_TIES))
@pytest.mark.parametrize("fname", ["max", "min"])
def test_max_min_dim_tie_to_first_index(fname, which, dim):
    x = DIM_TIES[which]
    if x.shape[dim] == 0:
        pytest.skip("empty")
    compare(lambda m, a: getattr(m, fname)(a, dim).values, [x])
    compare(lambda m, a: getattr(m, fname)(a, dim, keepdim=True).values, [x])
    tg_i = getattr(tapegrad, fname)(_tg(x, False), dim).indices
    th_i = getattr(torch, fname)(_th(x, False), dim).indices
    np.testing.assert_array_equal(tg_i.numpy(), th_i.numpy())


def test_max_dim_first_index_numbers():
    x = _tg(np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]), True)
    (g,) = tapegrad.autograd.grad(tapegrad.max(x, 1).values.sum(), x)
    np.testing.assert_array_equal(g.numpy(), [[0, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize("p", [2, 1, INF, 3, 0.5], ids=str)
@pytest.mark.parametrize("x", [np.zeros(3), np.array([0.0, 2.0, -1.0]), np.zeros((2, 2)),
                               np.array([-2.0, 2.0, 1.0])], ids=["zeros", "one zero",
                                                                   "zeros 2-D", "inf tie"])
def test_norm_singular_points(p, x):
    def fn(m, a):
        if m is TG:
            return tapegrad.norm(a, p)
        return torch.linalg.vector_norm(a, p)
    compare(fn, [x])
    if x.ndim == 2:
        def fn_dim(m, a):
            if m is TG:
                return tapegrad.norm(a, p, dim=1)
            return torch.linalg.vector_norm(a, p, dim=1)
        compare(fn_dim, [x])


def test_norm_0d_zero():
    compare(lambda m, a: m.norm(a), [np.array(0.0)])
    compare(lambda m, a: m.norm(a, 1), [np.array(0.0)])


LSE_SPECIAL = {
    "all -inf": np.array([-INF, -INF]),
    "one +inf": np.array([INF, 1.0]),
    "one -inf": np.array([-INF, 1.0]),
    "nan": np.array([NAN, 1.0]),
    "huge": np.array([1e308, 1e308]),
}


@pytest.mark.parametrize("which", list(LSE_SPECIAL))
def test_logsumexp_special(which):
    compare(lambda m, a: m.logsumexp(a, 0), [LSE_SPECIAL[which]])


@pytest.mark.parametrize("which", ["one -inf", "huge"])
@pytest.mark.parametrize("fname", ["softmax", "log_softmax"])
def test_softmax_special(fname, which):
    compare(lambda m, a: getattr(m, fname)(a, 0), [LSE_SPECIAL[which]])


@pytest.mark.parametrize("x", [np.array([0.0, 2.0, 3.0]), np.array([0.0, 0.0, 3.0]),
                               np.array([INF, 2.0, 0.0]), np.array([NAN, 2.0, 1.0])],
                         ids=["one zero", "two zeros", "inf and zero", "nan"])
def test_prod_singular_points(x):
    compare(lambda m, a: m.prod(a), [x])
    compare(lambda m, a: m.prod(a.reshape(1, 3), 1), [x])


@pytest.mark.parametrize("x", [np.array([1000.0, 0.0]), np.array([-1000.0, 0.0])], ids=str)
def test_sum_of_overflowing_exp(x):
    compare(lambda m, a: m.exp(a).sum(), [x])
    compare(lambda m, a: (m.exp(a) * a).mean(), [x])


def test_internal_modules_do_not_import_public_ones_that_import_them():
    # optim imports interpreters.optim_loop; optim_loop must not import optim back (a cycle):
    # what both need lives in the internal _optim_math
    import ast
    import pathlib
    src = pathlib.Path(__file__).parent.parent / "tapegrad" / "interpreters" / "optim_loop.py"
    mods = {n.module for n in ast.walk(ast.parse(src.read_text()))
            if isinstance(n, ast.ImportFrom)}
    assert "optim" not in mods and "_optim_math" in mods


def test_constant_operand_forms_live_in_the_registry():
    # each binary op declares its float-constant forms in its register(...) call, so the code
    # generator reads the registry, not the Tensor layer
    import pathlib
    from tapegrad.ops import BY_NAME, const_ops
    forms = const_ops()
    assert forms["sub"] == ((BY_NAME["addc"], -1.0), (BY_NAME["rsubc"], 1.0))
    assert set(forms) == {"add", "sub", "mul", "div", "pow"}
    src = (pathlib.Path(__file__).parent.parent / "tapegrad" / "interpreters"
           / "_codegen.py").read_text()
    assert "from ..tensor import" not in src
