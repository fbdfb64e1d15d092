"""The work a backward skips or shortens for speed (GradBench's vectorized evals): each
shortcut gives torch's numbers and is checked to be taken."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.autograd import _tensor_backend
from tapegrad.interpreters import cpu, cpu_arrays

torch = pytest.importorskip("torch")


def _count(monkeypatch, module):
    calls = []
    real = module.sum_to
    monkeypatch.setattr(module, "sum_to", lambda g, shape: calls.append(shape) or real(g, shape))
    return calls


@pytest.mark.parametrize("create_graph", [False, True])
def test_constant_input_gradient_not_summed(monkeypatch, create_graph):
    # the broadcast of a constant's gradient is never undone: nobody reads it (kmeans'
    # points, (n, k, d) -> (n, 1, d), was most of its backward)
    calls = _count(monkeypatch, _tensor_backend if create_graph else cpu_arrays)
    rng = np.random.default_rng(0)
    c0, x0 = rng.normal(size=(5, 1, 3)), rng.normal(size=(4, 3))
    out = []
    for M in (tg, torch):
        c = M.tensor(c0)
        x = M.tensor(x0, requires_grad=True)
        d = c - x
        g, = M.autograd.grad((d * d).sum(), x, create_graph=create_graph)
        if create_graph:
            h, = M.autograd.grad(g.sum(), x)
            out.append((g.detach().numpy(), h.numpy()))
        else:
            out.append((g.numpy(),))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-14)
    assert all(tuple(s) == (4, 3) for s in calls), calls  # x's only, never c's (5, 1, 3)


SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e308, -1e308, 5e-324])


def _same_bits(r, s):
    return (r.shape == s.shape and np.array_equal(r, s, equal_nan=True)
            and np.array_equal(np.signbit(r)[~np.isnan(r)], np.signbit(s)[~np.isnan(s)]))


@pytest.mark.parametrize("n", range(1, 10))
def test_fast_sum_is_numpys_sum_bit_for_bit(n):
    # the short-last-axis sum (k-means' squared distances) adds in NumPy's order: same
    # bits, a sum of -0.0s is +0.0, infinities and NaNs as NumPy
    from tapegrad.ops.arrays import fast_sum, sum_to
    rng = np.random.default_rng(n)
    with np.errstate(all="ignore"):
        for frac in (0.0, 0.1, 0.5, 1.0):
            a = rng.normal(size=(300, 3, n)) * rng.lognormal(size=(300, 3, n)) * 10
            m = rng.random(a.shape) < frac
            a[m] = rng.choice(SPECIALS, size=m.sum())
            a[0, 0] = -0.0
            for axis, keep in ((-1, False), (2, True), ((2,), False)):
                assert _same_bits(np.sum(a, axis=axis, keepdims=keep), fast_sum(a, axis, keep))
            if n > 1:
                assert _same_bits(np.sum(a, axis=2, keepdims=True), sum_to(a, (300, 3, 1)))
    x = rng.normal(size=(300, 3, n))
    np.testing.assert_array_equal(tg.sum(tg.tensor(x), 2).numpy(), np.sum(x, axis=2))
    np.testing.assert_allclose(tg.sum(tg.tensor(x), -1).numpy(),
                               torch.sum(torch.tensor(x), -1).numpy(), rtol=1e-14, atol=1e-14)


def test_fast_sum_taken(monkeypatch):
    from tapegrad.ops import arrays
    calls = []
    real = arrays._sum_last
    monkeypatch.setattr(arrays, "_sum_last", lambda a, n: calls.append(n) or real(a, n))
    tg.sum(tg.tensor(np.ones((1000, 10, 8))), 2)
    tg.sum(tg.tensor(np.ones((1000, 10, 8))), 1)  # not the last axis: NumPy's own
    assert calls == [8]


def test_fast_sum_other_axes_unchanged():
    from tapegrad.ops.arrays import fast_sum, sum_to
    a = np.random.default_rng(0).normal(size=(300, 3, 4))
    for axis in ((0, 2), (1, 2), (0,), 1, (0, 1, 2)):
        assert _same_bits(fast_sum(a, axis, True), np.sum(a, axis=axis, keepdims=True))
    assert _same_bits(sum_to(a, (1, 3, 1)), np.sum(a, axis=(0, 2), keepdims=True))


@pytest.mark.parametrize("case", ["ties", "nan", "inf", "plain"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_full_max_gradient_shortcuts(case, create_graph):
    # max()'s gradient counts ties with count_nonzero and looks for NaNs only when the
    # result is NaN (lse's backward): torch's values, with create_graph too
    x0 = np.random.default_rng(1).normal(size=(4, 5))
    if case == "ties":
        x0[1, 2] = x0[3, 4] = x0[0, 0] = 9.0
    elif case == "nan":
        x0[2, 2] = x0[0, 1] = np.nan
    elif case == "inf":
        x0[1, 1] = np.inf
    out = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        for fn in (M.max, M.min):
            g, = M.autograd.grad(fn(x) * 3.0, x, create_graph=create_graph)
            out.append(g.detach().numpy())
            if create_graph:
                h, = M.autograd.grad((g * x).sum(), x)
                out.append(h.numpy())
    half = len(out) // 2
    for a, b in zip(out[:half], out[half:]):
        np.testing.assert_allclose(a, b, rtol=1e-15, equal_nan=True)


@pytest.mark.parametrize("name", ["add", "mul", "sub", "div"])
def test_one_sided_rules_are_the_registrys(name):
    # the sweep's per-side binary rules give the registry rule's bits, side by side
    from tapegrad.ops import NpF, OPS
    op = next(o for o in OPS if o.name == name)
    fa, fb, _ = cpu._SIDES[op.code]
    rng = np.random.default_rng(1)
    with np.errstate(all="ignore"):
        for dt in (np.float64, np.float32):
            for sa, sb in (((4, 3), (4, 3)), ((4, 3), (1, 3)), ((), (5,))):
                x = np.resize(np.r_[SPECIALS, rng.normal(size=40)], sa).astype(dt)
                y = np.resize(np.r_[rng.normal(size=40), SPECIALS], sb).astype(dt)
                g = rng.normal(size=np.broadcast_shapes(sa, sb)).astype(dt)
                want = op.vjp(NpF, g, x, y, None)
                got = (fa(g, x, y), fb(g, x, y))
                for r, s in zip(got, want):
                    assert _same_bits(np.asarray(r), np.asarray(s))


def test_one_sided_rules_taken(monkeypatch):
    # ``c * w`` with c a constant computes w's side only; ``x * x`` computes g * x once (and
    # adds it to itself: torch's numbers)
    calls = []
    for code, (fa, fb, sym) in list(cpu._SIDES.items()):
        monkeypatch.setitem(cpu._SIDES, code, (
            lambda g, x, y, f=fa, c=code: calls.append((c, "a")) or f(g, x, y),
            lambda g, x, y, f=fb, c=code: calls.append((c, "b")) or f(g, x, y), sym))
    mul = next(op.code for op in cpu.OPS if op.name == "mul")
    rng = np.random.default_rng(2)
    c0, w0 = rng.normal(size=(6, 5)), rng.normal(size=5)
    got = []
    for M in (tg, torch):
        c, w = M.tensor(c0), M.tensor(w0, requires_grad=True)
        calls.clear()
        y = c * w
        got.append((M.autograd.grad((y * y).sum(), w)[0].numpy(), list(calls)))
    np.testing.assert_allclose(got[0][0], got[1][0], rtol=1e-14)
    assert got[0][1] == [(mul, "a"), (mul, "b")], got[0][1]  # y*y once, then w's side of c*w


def test_array_unary_and_binary_record_directly(monkeypatch):
    # the eager recorder's per-op shortcuts (lstm's thousands of small-vector ops): an
    # array unary op sets no np.errstate (the context variable instead), an op on two
    # tensors records without going through _record_binary; same values, same quiet
    # overflow (no warning), same gradients as torch
    import warnings

    tensor_mod = __import__("tapegrad._recorder", fromlist=["_record_binary"])
    calls = []
    real_errstate, real_rb = np.errstate, tensor_mod._record_binary
    monkeypatch.setattr(np, "errstate", lambda **kw: calls.append("errstate")
                        or real_errstate(**kw))
    monkeypatch.setattr(tensor_mod, "_record_binary", lambda *a: calls.append("rb")
                        or real_rb(*a))
    x0, w0 = np.array([1.0, -2.0, 800.0]), np.array([0.5, 3.0, -1.0])
    out = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        w = M.tensor(w0, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = M.exp(x) * w + M.tanh(w)
            out.append([y.detach().numpy()] + [g.numpy() for g in M.autograd.grad(
                y.sum(), (x, w))])
        if M is tg:
            assert calls == [], calls
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-15)


def test_flat_mark_declined_once(monkeypatch):
    # a tape the flat path does not cover (lse's max) is marked once per call
    calls = []
    real = cpu._mark_scalar
    monkeypatch.setattr(cpu, "_mark_scalar", lambda *a: calls.append(1) or real(*a))
    x0 = np.random.default_rng(3).normal(size=50)
    got = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        a = M.max(x)
        got.append(M.autograd.grad(a + M.log(M.sum(M.exp(x - a))), (x,))[0].numpy())
    assert len(calls) == 1, calls
    np.testing.assert_allclose(got[0], got[1], rtol=1e-14)


def test_square_gradient_recorded_once():
    # create_graph through x * x (an array) records g * x once and adds it to itself
    # (kmeans' squared distances): torch's values and second derivatives
    from tapegrad.ops import OPS
    mul = next(op.code for op in OPS if op.name == "mul")
    rng = np.random.default_rng(4)
    c0, x0 = rng.normal(size=(3, 1)), rng.normal(size=(4,))
    got = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        d = M.tensor(c0) - x
        g, = M.autograd.grad(M.sum(M.sin(d * d)), x, create_graph=True)
        if M is tg:
            codes = [int(r[0]) & ~cpu.ARRAY for r in g._tape.rows()]
            assert codes.count(mul) == 3, codes  # d*d, and the rule's g*d once (+ sin's)
        h, = M.autograd.grad(M.sum(g * g), x)
        got.append((g.detach().numpy(), h.numpy()))
    for a, b in zip(*got):
        np.testing.assert_allclose(a, b, rtol=1e-13)


@pytest.mark.parametrize("dt", [np.float64, np.float32, np.int64, np.bool_])
def test_dim_reduction_dtypes_unchanged(dt):
    # a sum or mean over a dim keeps NumPy's fresh result when it already has the input's
    # dtype (no copy): the values and dtypes are torch's
    a0 = (np.random.default_rng(5).normal(size=(3, 4, 5)) * 3).astype(dt)
    for name in ("sum", "mean"):
        if name == "mean" and dt in (np.int64, np.bool_):
            continue
        got = getattr(tg, name)(tg.tensor(a0), 1)
        want = getattr(torch, name)(torch.tensor(a0), 1)
        assert str(got.dtype).split(".")[-1] == str(want.dtype).split(".")[-1]
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


def test_rule_of_g_alone_on_broadcast_gradient(monkeypatch):
    # -g of a sum's broadcast gradient runs on one copy (kmeans' recorded first derivative:
    # neg of an expanded (k, d, 1) over n points), broadcast back: torch's numbers
    sizes = []
    real = cpu.elementwise_rule
    spy = lambda op, F, g, *a: sizes.append((op.name, np.size(g))) or real(op, F, g, *a)
    for module in (cpu, cpu_arrays):  # array_vjp looks it up in cpu_arrays, the hooks in cpu
        monkeypatch.setattr(module, "elementwise_rule", spy)
    rng = np.random.default_rng(6)
    x0, w0 = rng.normal(size=(3, 2000)), rng.normal(size=(3, 1))
    got = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        w = M.tensor(w0, requires_grad=True)
        y = M.sum(-(x * w) * 3.0 + 1.0, 1)
        got.append([g.numpy() for g in M.autograd.grad(M.sum(y * y), (x, w))])
    for a, b in zip(*got):
        np.testing.assert_allclose(a, b, rtol=1e-14)
    assert ("neg", 3) in sizes and ("mulc", 3) in sizes and ("addc", 3) in sizes, sizes


def test_full_max_gradient_bits():
    # max()'s NumPy rule fills 0.0 * val and writes val where picked, for mask * val's
    # cast: the same bits as torch, -0.0 off the maximum under a negative gradient, NaN
    # everywhere when nothing matches (a NaN seed)
    x0 = np.random.default_rng(2).normal(size=(50, 40))
    x0[3, 4] = x0[7, 1] = 9.0
    for seed in (-2.5, 2.5, np.inf, np.nan):
        got = []
        for M in (tg, torch):
            x = M.tensor(x0, requires_grad=True)
            for fn in (M.max, M.min):
                g, = M.autograd.grad(fn(x), x, grad_outputs=M.tensor(seed, dtype=M.float64))
                got.append(g.numpy())
        for a, b in zip(got[:2], got[2:]):
            assert _same_bits(a, b), seed


def _extremes(rng, shape, dtype):
    a = rng.integers(-2, 3, size=shape).astype(dtype)
    a[rng.random(shape) < 0.1] = np.nan
    z = a == 0
    a[z & (rng.random(shape) < 0.5)] = -0.0
    return a


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_max_min_dim_one_pass(monkeypatch, dtype):
    # max/min over a dim of a float64 array in one compiled pass (kmeans' min over k):
    # torch's values and indices, bit for bit, with ties (the first), NaNs (the first NaN
    # wins) and signed zeros; other dtypes keep NumPy's path, with the same results
    import tapegrad._fn_reductions as fmod
    taken = []
    real = fmod.first_extreme
    monkeypatch.setattr(fmod, "first_extreme",
                        lambda a, d, m: taken.append(d) or real(a, d, m))
    rng = np.random.default_rng(3)
    for shape in [(7,), (4, 5), (3, 1, 6), (2, 5, 3, 4), (1, 1)]:
        a0 = _extremes(rng, shape, dtype)
        for d in range(-len(shape), len(shape)):
            for keepdim in (False, True):
                for name in ("max", "min"):
                    r = getattr(tg, name)(tg.tensor(a0), d, keepdim=keepdim)
                    e = getattr(torch, name)(torch.tensor(a0), d, keepdim=keepdim)
                    assert _same_bits(r.values.numpy(), e.values.numpy()), (shape, d, name)
                    assert np.array_equal(r.indices.numpy(), e.indices.numpy())
                    assert r.values.dtype == tg.float64 if dtype == np.float64 else True
    assert taken  # the compiled pass was asked every time; it declines float32 itself


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_min_dim_second_order(dim):
    # min(dim)'s rule masks the picked entries with one comparison and lets where
    # broadcast g (no expand recorded): torch's first and second derivatives
    rng = np.random.default_rng(4)
    x0 = rng.normal(size=(6, 5, 40))
    x0[2, 3, 7] = x0[4, 3, 7] = -9.0  # a tie: the first index takes the gradient
    out = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        m = M.min(x * x * x, dim).values
        g, = M.autograd.grad(M.sum(m * m), x, create_graph=True)
        h, = M.autograd.grad(M.sum(g * g), x)
        out.append((g.detach().numpy(), h.numpy()))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-13)


def test_broadcast_adjoints_added_on_one_copy(monkeypatch):
    # x + x under a sum's broadcast gradient: both sides' gradients are the same
    # zero-stride view, added on one copy and broadcast back (kmeans' second sweep through
    # the recorded 2 g x); a later gradient into that adjoint adds into a fresh array
    compact = []
    real = cpu._compact
    monkeypatch.setattr(cpu_arrays, "_compact", lambda g: compact.append(g.shape) or real(g))
    rng = np.random.default_rng(5)
    x0, w0 = rng.normal(size=(3, 2000)), rng.normal(size=(3, 2000))
    got = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        w, v = M.tensor(w0), M.tensor([1.0, -2.0, 3.0])
        only, = M.autograd.grad(M.sum(M.sum(x + x, 1) * v), x)
        both, = M.autograd.grad(M.sum((x + x) * w) + M.sum(M.sum(x + x, 1) * v), x)
        got.append((only.numpy(), both.numpy()))
    for a, b in zip(*got):
        assert _same_bits(a, b)
    assert compact == [(3, 2000)] * 2  # once per backward: the compact sum


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("case", ["plain", "zero", "nan"])
def test_sub_broadcast_gradient_summed_then_negated(monkeypatch, case, create_graph):
    # x - c, c broadcast: -sum_to(g) in place of sum_to(-g) (kmeans' centroid side, the
    # negation on 80 numbers, not 80,000): the bits of the direct way, -0.0 against +0.0
    # included (a zero or NaN sum takes the direct way), and torch's numbers
    from tapegrad.interpreters import rerecord
    taken = []
    real = cpu.neg_sum_to
    spy = lambda g, shape: taken.append(shape) or real(g, shape)
    for module in (cpu, cpu_arrays):  # the rerecording sweep calls cpu's, array_vjp its own
        monkeypatch.setattr(module, "neg_sum_to", spy)
    rng = np.random.default_rng(7)
    x0, c0 = rng.normal(size=(4, 3, 1000)), rng.normal(size=(4, 3, 1))
    w0 = rng.normal(size=(4, 3, 1000))
    if case == "zero":  # one row's gradient sums to exactly zero: +0.0 from -g's sum
        w0[1, 2, :] = np.tile([1.5, -1.5], 500)
    elif case == "nan":
        w0[2, 0, 7] = np.nan

    def run(M):
        x, c = M.tensor(x0), M.tensor(c0, requires_grad=True)
        w = M.tensor(w0, requires_grad=True)
        y = M.sum((x - c) * w)
        if create_graph:
            gc, = M.autograd.grad(y, c, create_graph=True)
            gw, = M.autograd.grad(M.sum(gc * gc * gc), w)
            return [gc.detach().numpy(), gw.numpy()]
        return [g.numpy() for g in M.autograd.grad(y, (c, w))]
    got = run(tg)
    with monkeypatch.context() as m:  # the direct way: sum_to(-g)
        m.setattr(cpu_arrays, "negated_sum_applies", lambda g, v: False)
        m.setattr(rerecord, "negated_sum_applies", lambda g, v: False)
        direct = run(tg)
    want = run(torch)
    for a, b, t in zip(got, direct, want):
        assert _same_bits(a, b)
        np.testing.assert_allclose(a, t, rtol=1e-12, atol=1e-12)
    if case == "zero":
        assert np.signbit(got[0][1, 2, 0]) == np.signbit(direct[0][1, 2, 0])
    if not create_graph:
        assert taken == [(4, 3, 1)]


@pytest.mark.parametrize("case", ["plain", "zero", "nan"])
def test_sub_scalar_gradient_summed_then_negated(monkeypatch, case):
    # x - m, m a number (lse's max): m's gradient -sum(g), the bits of sum(-g) (a zero or
    # NaN sum takes that way; a number's adjoint starts at +0.0, so a zero is +0.0 either
    # way), and torch's numbers; the one-sided rule now also when both sides are wanted
    rng = np.random.default_rng(8)
    x0 = rng.normal(size=5000)
    w0 = rng.normal(size=5000)
    if case == "zero":  # exp(x - m) is 1: m's gradient sums to exactly zero
        x0[:] = 0.5
        w0[:] = np.tile([0.25, -0.25], 2500)
    elif case == "nan":
        w0[11] = np.nan

    def run(M):
        x = M.tensor(x0, requires_grad=True)
        w = M.tensor(w0)
        m = M.max(x)
        return [g.numpy() for g in M.autograd.grad(M.sum(M.exp(x - m) * w), (x, m))]
    got = run(tg)
    with monkeypatch.context() as mp:  # the registry's rule: sum(-g)
        mp.setattr(cpu_arrays, "_SIDES", {})
        direct = run(tg)
    for a, b, t in zip(got, direct, run(torch)):
        assert _same_bits(a, b)
        np.testing.assert_allclose(a, t, rtol=1e-12, atol=1e-300)


def _specials(rng, shape):
    a = rng.normal(size=shape) * rng.lognormal(size=shape) * 10
    m = rng.random(shape) < 0.05
    a[m] = rng.choice(SPECIALS, size=int(m.sum()))
    return a


ROWS_CASES = [((1, 8, 1000), (10, 8, 1)), ((8, 1000), (10, 8, 1)), ((10, 8, 1), (8, 1000)),
              ((25, 10, 1000), (25, 10, 1)), ((300, 64), (300, 1)), ((300, 1), (300, 64)),
              ((10, 1, 2000), (1, 8, 1)), ((1, 1, 20000), (2, 1, 1)),
              ((10, 1, 1000), (10, 8, 1000)), ((10, 8, 1000), (1, 8, 1000)),
              ((300, 64), (64,)), ((1, 64), (300, 1)), ((10, 8, 1), (10, 1, 1000))]


@pytest.mark.parametrize("xs, ys", ROWS_CASES)
def test_rows_op_is_numpys_bits(xs, ys):
    # + - * with one operand broadcast along the innermost axis, compiled: NumPy's bits,
    # signed zeros, infinities and NaNs included, either operand first
    from tapegrad.ops._kernels import ADD, MUL, SUB, rows_op
    rng = np.random.default_rng(len(xs) * 100 + xs[-1])
    x, y = _specials(rng, xs), _specials(rng, ys)
    with np.errstate(all="ignore"):
        for op, f in ((ADD, np.add), (SUB, np.subtract), (MUL, np.multiply)):
            r = rows_op(op, x, y)
            assert r is not None and _same_bits(r, f(x, y)), (xs, ys, op)
            # an expanded operand (a zero-stride view: the gradient of a sum over d)
            shape = np.broadcast_shapes(xs, ys)
            xb = np.broadcast_to(x, shape)
            r = rows_op(op, xb, y)
            assert r is not None and _same_bits(r, f(xb, y)), (xs, ys, op)


def test_rows_op_declines():
    from tapegrad.ops._kernels import SUB, rows_op
    big = np.ones((10, 8, 1000))
    for x, y in [(big, big), (np.ones((4, 3, 100)), np.ones((4, 3, 1))),  # too small
                 (big.astype(np.float32), np.ones((10, 8, 1), np.float32)),
                 (big[:, :, ::2], np.ones((10, 8, 1))),  # rows not contiguous
                 (big, np.ones((3, 8, 1))),  # not broadcastable: NumPy's error
                 (np.ones((2, 10, 8, 1000)), np.ones((2, 10, 8, 1))),  # 4 dims
                 # both repeat along the rows (zero strides): no operand holds a row
                 (np.broadcast_to(np.ones((10, 8, 1)), (10, 8, 1000)),
                  np.broadcast_to(np.ones((1, 8, 1)), (10, 8, 1000)))]:
        assert rows_op(SUB, x, y) is None


def test_rows_op_taken_forward_and_gradients(monkeypatch):
    # kmeans' P[None] - C[:, :, None] goes through the compiled pass, with torch's values
    # and first and second derivatives
    import tapegrad._recorder as rec
    taken = []
    real = rec.rows_op
    monkeypatch.setattr(rec, "rows_op", lambda op, x, y: taken.append(op) or real(op, x, y))
    rng = np.random.default_rng(7)
    p0, c0 = rng.normal(size=(8, 1000)), rng.normal(size=(10, 8))
    out = []
    for M in (tg, torch):
        P, C = M.tensor(p0), M.tensor(c0, requires_grad=True)
        d = P[None, :, :] - C[:, :, None]
        e = C[:, :, None] * P[None, :, :] + C[:, :, None]
        y = M.sum(d * d * e)
        g, = M.autograd.grad(y, C, create_graph=True)
        h, = M.autograd.grad(M.sum(g * g), C)
        out.append((d.detach().numpy(), e.detach().numpy(), g.detach().numpy(), h.numpy()))
    assert _same_bits(out[0][0], out[1][0]) and _same_bits(out[0][1], out[1][1])
    for a, b in zip(out[0][2:], out[1][2:]):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    assert len(taken) >= 3, taken


@pytest.mark.parametrize("shape", [(10, 8, 1000), (3, 1, 64), (1, 300, 64), (2, 1000, 70),
                                   (2, 5000, 64), (300, 64), (5, 3, 1111)])
def test_sum_middle_is_numpys_bits(shape):
    # the sum over the middle of (k, d, n) in one pass: 0.0 plus the rows in order, NumPy's
    # add.reduce bit for bit (a sum of -0.0s is +0.0)
    from tapegrad.ops._kernels import sum_middle
    a = _specials(np.random.default_rng(shape[-1]), shape)
    a[0, ...] = -0.0
    with np.errstate(all="ignore"):
        for ax in ((1, -2, (1,)) if len(shape) == 3 else (0, -2, (0,))):
            for kd in (False, True):
                r = sum_middle(a, ax, kd)
                if a.size >= 16384:
                    assert r is not None and _same_bits(r, np.sum(a, axis=ax, keepdims=kd))
                else:
                    assert r is None


def test_sum_middle_taken(monkeypatch):
    import tapegrad._fn_reductions as fmod
    taken = []
    real = fmod.sum_middle
    monkeypatch.setattr(fmod, "sum_middle",
                        lambda a, ax, kd: taken.append(ax) or real(a, ax, kd))
    a0 = _specials(np.random.default_rng(1), (10, 8, 1000))
    for ax in (1, -2, 0, 2):
        r = tg.sum(tg.tensor(a0), ax).numpy()
        with np.errstate(all="ignore"):  # (NumPy's bits, as before the compiled pass)
            assert _same_bits(r, np.sum(a0, axis=ax))
    assert taken == [(1,), (1,), (0,), (2,)], taken


@pytest.mark.parametrize("name", ["reshape", "expand", "getitem", "transpose", "permute"])
def test_shape_rules_recorded_directly(name):
    # create_graph: a shape op's rule call (a reduction's gradient broadcast back, the
    # gradient of an index or a view) is recorded directly, with torch's first and second
    # derivatives
    assert _tensor_backend.TensorF.expand.__qualname__.startswith("_shape_op")
    rng = np.random.default_rng(5)
    x0 = rng.normal(size=(4, 3, 5))
    ops = {"reshape": lambda M, x: x.reshape(12, 5), "expand": lambda M, x: M.sum(x, 1),
           "getitem": lambda M, x: x[1:3, :, None], "transpose": lambda M, x: x.transpose(0, 2),
           "permute": lambda M, x: x.permute(2, 0, 1)}
    out = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        v = ops[name](M, x * x)
        g, = M.autograd.grad(M.sum(v * v * v), x, create_graph=True)
        h, = M.autograd.grad(M.sum(g * g), x)
        out.append((g.detach().numpy(), h.numpy()))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-13)


@pytest.mark.parametrize("idx", [(slice(None), None), (None, slice(1, 3)),
                                 (slice(None), slice(None), None)])
def test_slice_index_short_path(monkeypatch, idx):
    # x[:, :, None] (slices and new axes only) takes the short path: a view recorded as
    # the general path records it, torch's values and gradients, a plain result shares
    # its base's version counter, and too many indices raise the general path's IndexError
    import tapegrad._fn_shapes as smod
    general = []
    real = smod._index
    monkeypatch.setattr(smod, "_index", lambda i: general.append(i) or real(i))
    x0 = np.random.default_rng(6).normal(size=(4, 5))
    out = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        v = x[idx]
        g, = M.autograd.grad(M.sum(v * v * v), x, create_graph=True)
        h, = M.autograd.grad(M.sum(g * g), x)
        out.append((v.detach().numpy(), g.detach().numpy(), h.numpy()))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-14)
    p = tg.tensor(x0)
    assert p[idx]._ver is p._ver
    assert not general
    with pytest.raises(IndexError, match="too many indices"):
        tg.tensor(x0)[(slice(None),) * 3]


def test_sum_over_one_dim_short_path(monkeypatch):
    # sum over one int dim of a float64 tensor: the values, dtype and gradient of the
    # general path, and its errors
    import tapegrad._fn_reductions as fmod
    general = []
    real = fmod._dims
    monkeypatch.setattr(fmod, "_dims", lambda d, n: general.append(d) or real(d, n))
    a0 = np.random.default_rng(8).normal(size=(3, 4, 70))
    for dim in (0, 1, 2, -1, -3):
        for keepdim in (False, True):
            r = tg.sum(tg.tensor(a0), dim, keepdim=keepdim)
            e = torch.sum(torch.tensor(a0), dim, keepdim=keepdim)
            assert r.shape == tuple(e.shape) and r.dtype == tg.float64
            np.testing.assert_allclose(r.numpy(), e.numpy(), rtol=1e-14)
    x = tg.tensor(a0[0, 0], requires_grad=True)
    s = tg.sum(x * x, 0)
    assert isinstance(s.item(), float)
    g, = tg.autograd.grad(s, x)
    np.testing.assert_allclose(g.numpy(), 2 * a0[0, 0], rtol=1e-15)
    assert not general
    with pytest.raises(IndexError, match="Dimension out of range"):
        tg.sum(tg.tensor(a0), 3)


def test_expand_view_is_expands_forward():
    # create_graph's expand builds the zero-stride view directly: the values, strides and
    # read-only flag of expand's own forward, its error where shapes do not broadcast
    from tapegrad.ops import BY_NAME
    real = BY_NAME["expand"].np
    rng = np.random.default_rng(9)
    cases = [(rng.normal(size=(10, 1, 16)), (10, 8, 16)), (rng.normal(size=(1, 5)), (3, 4, 5)),
             (rng.normal(size=(5,)), (2, 5)), (rng.normal(size=(3, 1))[::2], (2, 4)),
             (np.zeros((0, 1)), (0, 3)), (2.5, (4, 3)), (rng.normal(size=(2, 3)), (2, 3)),
             (rng.normal(size=(2, 3)).astype(np.float32), (4, 2, 3))]
    for d, shape in cases:
        r, e = _tensor_backend._expand_np(d, (shape, np.shape(d))), real(d, (shape, np.shape(d)))
        assert r.shape == e.shape and r.strides == e.strides and r.dtype == e.dtype
        assert r.flags.writeable == e.flags.writeable and np.array_equal(r, e)
    for f in (_tensor_backend._expand_np, real):
        with pytest.raises(ValueError):
            f(np.ones((3, 2)), ((3, 4), (3, 2)))


def test_where_of_a_constant_gradient_records_nothing():
    # max/min(dim)'s rule on a constant gradient (a seed's, in create_graph's first sweep):
    # a plain result, no entry on the tape
    c = np.array([True, False, True])
    g = tg.tensor(np.array([1.0, 2.0, 3.0]))
    r = _tensor_backend.TensorF.where(c, g, 0.0)
    assert not r.requires_grad and r._tape is None
    assert np.array_equal(r.numpy(), [1.0, 0.0, 3.0])


def test_unary_float64_array_short_path(monkeypatch):
    # an elementwise function of a float64 array (lstm's gates) is recorded without the
    # dtype conversions; other dtypes and traces keep the general path, with torch's dtypes
    import tapegrad._recorder as rec
    general = []
    real = rec._norm_value

    def gates(M, x):
        monkeypatch.setattr(rec, "_norm_value", lambda v: general.append(v) or real(v))
        r = M.sigmoid(x), M.tanh(x), M.exp(-x)
        monkeypatch.setattr(rec, "_norm_value", real)
        return r
    x0 = np.random.default_rng(10).normal(size=14)
    out = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        s, t, e = gates(M, x)
        y = M.sum(s * t + e)
        g, = M.autograd.grad(y, x)
        out.append((y.item(), g.numpy()))
    assert not general
    monkeypatch.setattr(rec, "_norm_value", lambda v: general.append(v) or real(v))
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-14)
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-15)
    for d, want in ((np.float32, np.float32), (np.int64, np.float64), (np.bool_, np.float64)):
        r = tg.exp(tg.tensor(np.ones(3, dtype=d)))  # (an integer's: the default float dtype)
        assert r.numpy().dtype == want
    assert general


@pytest.mark.parametrize("have, want", [((10, 8, 1000), (10, 8, 1)), ((10, 8, 1000), (8, 1000)),
                                        ((10, 8, 1000), (1, 8, 1)), ((30, 4), (4,)),
                                        ((30, 4), (30, 1)), ((6, 5, 7), (5, 1)),
                                        ((300, 3, 8), (300, 3, 1)), ((2, 3), (2, 3))])
def test_create_graph_sum_to_is_sum_tos_bits(have, want):
    # create_graph's fit sums a broadcast gradient by np.sum's own add.reduce call: the
    # bits of sum_to (fast_sum's short last axis left to it)
    from tapegrad.ops.arrays import sum_to
    g = _specials(np.random.default_rng(have[-1]), have)
    with np.errstate(all="ignore"):
        r = _tensor_backend._sum_to_np(g, want)
        e = sum_to(g, want)
        assert r is None and (want == have or have[-1] <= 8 and want[-1] == 1) \
            or _same_bits(np.asarray(r), e)
        f = _tensor_backend._fit(tg.tensor(g), np.zeros(want))
        assert _same_bits(f.numpy(), e)


def test_negated_sum_test_in_python():
    # kmeans' sub rule takes -sum(g) when the summed gradient has no zero and no NaN:
    # tested in Python on a few numbers, as NumPy's all() and sum() said
    from tapegrad.interpreters.rerecord import _no_zero_or_nan
    rng = np.random.default_rng(11)
    for n in (1, 80, 256, 300):
        for special in (None, 0.0, -0.0, np.nan, np.inf, -np.inf, "both"):
            r = rng.normal(size=(n, 1))
            if special == "both":
                r[0], r[-1] = np.inf, -np.inf
            elif special is not None:
                r[n // 2] = special
            with np.errstate(all="ignore"):
                want = bool(r.all()) and not np.isnan(r.sum())
            assert _no_zero_or_nan(r) == want, (n, special)


def test_operators_on_same_shape_arrays_inline(monkeypatch):
    # x op y on two float64 arrays of one shape (lstm's gates) runs in the generated
    # operator itself: torch's values and gradients; other cases still take the fallback
    from tapegrad import _generated_eager as gen
    fallback = []
    real = gen.binary_fallback
    monkeypatch.setattr(gen, "binary_fallback",
                        lambda op, x, y: fallback.append(op.name) or real(op, x, y))
    rng = np.random.default_rng(12)
    a0, b0 = rng.normal(size=14), rng.normal(size=14) + 3.0
    out = []
    for M in (tg, torch):
        a, b = M.tensor(a0, requires_grad=True), M.tensor(b0, requires_grad=True)
        c = M.tensor(b0)  # a constant
        y = M.sum((a + b) * (a - b) / b ** c * c)
        ga, gb = M.autograd.grad(y, (a, b))
        out.append((y.item(), ga.numpy(), gb.numpy()))
    assert not fallback
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-14)
    for x, z in zip(out[0][1:], out[1][1:]):
        np.testing.assert_allclose(x, z, rtol=1e-12, atol=1e-15)
    from tapegrad._recorder import _binary_general
    from tapegrad.ops import BY_NAME
    a, b = tg.tensor(a0, requires_grad=True), tg.tensor(b0)
    for name, r in (("add", a + b), ("sub", a - b), ("mul", a * b), ("div", a / b),
                    ("pow", b ** a)):
        x, z = (b, a) if name == "pow" else (a, b)
        assert _same_bits(r.detach().numpy(),
                          _binary_general(BY_NAME[name], x, z).detach().numpy())
    with tg.no_grad():
        r = tg.tensor(a0, requires_grad=True) * tg.tensor(b0)
    assert not r.requires_grad and r._tape is None
    tg.tensor(a0) * tg.tensor(b0[:1])  # broadcast: the fallback
    tg.tensor(a0) * tg.tensor(b0.astype(np.float32))  # promotion: the fallback
    assert fallback == ["mul", "mul"]
