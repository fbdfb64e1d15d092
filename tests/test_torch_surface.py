"""torch's surface against torch: //, %, fmod, linalg.norm, materialized zeros, conversions."""
import math

import numpy as np
import pytest

import tapegrad

torch = pytest.importorskip("torch")

A = np.array([7.5, -7.5, 3.0, -3.0, 0.0, -0.0, 1e300, 5.25])
B = np.array([2.0, 2.0, -1.5, 0.5, 3.0, -3.0, 7.0, -0.75])
FNS = {"//": lambda M, x, y: x // y, "%": lambda M, x, y: x % y,
       "floor_divide": lambda M, x, y: M.floor_divide(x, y),
       "remainder": lambda M, x, y: M.remainder(x, y), "fmod": lambda M, x, y: M.fmod(x, y),
       "method": lambda M, x, y: x.remainder(y), "rmod": lambda M, x, y: 7.0 % y,
       "rfloordiv": lambda M, x, y: 7.0 // y}


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same bits, NaN included


@pytest.mark.parametrize("name", sorted(FNS))
def test_values_against_torch(name):
    f = FNS[name]
    for x, y in ((A, B), (A, B[:1]), (A.reshape(2, 4), B[:4]), (A, np.zeros(8))):
        r = [f(M, M.tensor(x), M.tensor(y)).numpy() for M in (tapegrad, torch)]
        _same(*r)
    ints = np.array([7, -7, 0, 5, -5]), np.array([2, 2, -3, 3, -3])
    for M in (tapegrad, torch):
        out = f(M, M.tensor(ints[0]), M.tensor(ints[1]))
        assert str(out.dtype).endswith("int64") or name in ("rmod", "rfloordiv")
    r = [f(M, M.tensor(ints[0]), M.tensor(ints[1])).numpy() for M in (tapegrad, torch)]
    _same(*r)
    r = [f(M, M.tensor(ints[0]), 2.5).numpy() if name not in ("rmod", "rfloordiv") else 0
         for M in (tapegrad, torch)]
    _same(*r)


@pytest.mark.parametrize("name", ["%", "remainder", "fmod", "method"])
def test_derivatives_against_torch(name):
    f = FNS[name]
    res = []
    for M in (tapegrad, torch):
        x = M.tensor(A[[0, 1, 2, 3, 7]], dtype=M.float64, requires_grad=True)
        y = M.tensor([[0.75], [-1.25]], dtype=M.float64, requires_grad=True)
        r = f(M, x, y) * x
        gx, gy = M.autograd.grad(r.sum(), (x, y), create_graph=True)
        hx, hy = M.autograd.grad((gx.sum() + gy.sum()), (x, y), allow_unused=True,
                                 materialize_grads=True)
        res.append([t.detach().numpy() for t in (r, gx, gy, hx, hy)])
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-14)


def test_errors_as_torch():
    for M in (tapegrad, torch):
        x = M.tensor([3.5, -2.5], dtype=M.float64, requires_grad=True)
        q = x // 2.0  # recorded; the backward raises, as torch's
        with pytest.raises(RuntimeError, match="floor_divide is not implemented"):
            M.autograd.grad((q * x).sum(), x)
        with pytest.raises(RuntimeError, match="remainder is not implemented"):
            M.autograd.grad((7.0 % x).sum(), x)
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            M.tensor([1, 2]) // M.tensor([1, 0])
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            M.tensor([1, 2]) % 0
        with pytest.raises(NotImplementedError):
            M.tensor([True]) // M.tensor([True])
        with pytest.raises(RuntimeError):
            M.tensor([1.0, 2.0]) % M.tensor([1.0, 2.0, 3.0])


def test_bad_operands_record_nothing_and_trace_raises():
    x = tapegrad.tensor([3.5, -2.5], requires_grad=True)
    y = x * 2
    tape = y._tape
    n = len(tape)
    for bad in (lambda: y % tapegrad.tensor([1.0, 2.0, 3.0]),
                lambda: y.long() // 0 if hasattr(y, "long") else y // tapegrad.tensor([0]) * 0):
        with pytest.raises(RuntimeError):
            bad()
    assert len(tape) == n
    with pytest.raises(NotImplementedError, match="outside the traced function"):
        tapegrad.trace(lambda v: (v % 2.0).sum(), np.ones(3))


# --- linalg.norm (torch.linalg.norm's ord: vector and matrix norms) --------------------------

NORMS = [((5,), {}), ((5,), {"ord": 1}), ((5,), {"ord": math.inf}), ((5,), {"ord": -math.inf}),
         ((5,), {"ord": 0}), ((5,), {"ord": 3}), ((5,), {"ord": -1}), ((3, 4), {}),
         ((3, 4), {"ord": "fro"}), ((3, 4), {"ord": 1}), ((3, 4), {"ord": -1}),
         ((3, 4), {"ord": math.inf}), ((3, 4), {"ord": -math.inf}),
         ((3, 4), {"ord": 1, "keepdim": True}), ((2, 3, 4), {"ord": 1, "dim": (2, 0)}),
         ((2, 3, 4), {"ord": math.inf, "dim": (-1, -2), "keepdim": True}),
         ((2, 3, 4), {"ord": 2, "dim": 1}), ((2, 3, 4), {"dim": (0, 1)})]


@pytest.mark.parametrize("shape,kw", NORMS)
def test_linalg_norm_against_torch(shape, kw):
    a = np.random.default_rng(len(shape) * 10 + len(kw)).normal(size=shape)
    res = []
    for M in (tapegrad, torch):
        x = M.tensor(a, requires_grad=True)
        y = M.linalg.norm(x, **kw)
        w = M.tensor(np.linspace(1.0, 2.0, int(np.prod(y.shape))).reshape(tuple(y.shape)))
        # ord=0 counts: torch's graph does not reach x (so allow_unused), its gradient is 0
        (g,) = M.autograd.grad((y * w).sum(), x, create_graph=True, allow_unused=True,
                               materialize_grads=True)
        out = [y.detach().numpy(), g.detach().numpy()]
        if g.requires_grad and kw.get("ord") != 0:  # 0: torch's materialized zeros, ours none
            h = M.autograd.grad((g * g).sum(), x, allow_unused=True, materialize_grads=True)[0]
            out.append((h + 0).numpy())  # + 0: torch's ZeroTensor has no array
        res.append(out)
    assert len(res[0]) == len(res[1]) or kw.get("ord") == 0
    for p, q in zip(*res):
        np.testing.assert_allclose(p, q, rtol=1e-12, atol=1e-14)


def test_linalg_norm_errors_as_torch():
    for M in (tapegrad, torch):
        for bad in (lambda: M.linalg.norm(M.ones(2, 2, 2), ord=1),
                    lambda: M.linalg.norm(M.ones(3, 3), ord=3),
                    lambda: M.linalg.norm(M.ones(3, 3), ord=1, dim=(0, 0))):
            with pytest.raises(RuntimeError):
                bad()
    with pytest.raises(NotImplementedError, match="singular values"):
        tapegrad.linalg.norm(tapegrad.ones(3, 3), ord="nuc")


def test_materialized_zeros_require_grad_under_create_graph():
    """torch: ``zeros_like(x, requires_grad=create_graph)``, a leaf of its own."""
    for M in (tapegrad, torch):
        a = M.tensor([1.0, 2.0], dtype=M.float64, requires_grad=True)
        b = M.tensor([3.0], dtype=M.float64, requires_grad=True)
        for cg in (True, False):
            ga, gb = M.autograd.grad((a * a).sum(), (a, b), allow_unused=True, create_graph=cg,
                                     materialize_grads=True)
            assert gb.requires_grad is cg and gb.is_leaf and ga.requires_grad is cg
            assert gb.tolist() == [0.0]
        (gb,) = M.autograd.grad((a * a).sum(), (b,), allow_unused=True, create_graph=True,
                                materialize_grads=True)
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            M.autograd.grad(gb.sum(), a)


def test_conversions_and_small_functions_as_torch():
    for M in (tapegrad, torch):
        for bad in (lambda: float(M.tensor([1.0, 2.0])), lambda: int(M.tensor([1, 2]))):
            with pytest.raises(ValueError, match="only one element tensors"):
                bad()
        assert float(M.tensor([[3.0]])) == 3.0 and int(M.tensor([4])) == 4
        for d in (0, -1):
            with pytest.raises(IndexError):
                M.repeat_interleave(M.tensor(1.5), 3, dim=d)
        assert M.repeat_interleave(M.tensor(1.5), 3).tolist() == [1.5] * 3
        assert tuple(M.empty(size=(2, 3)).shape) == (2, 3)
        assert tuple(M.empty(2, device="cpu").shape) == (2,)
        with pytest.raises(TypeError):
            M.empty()


def test_remainder_zero_keeps_the_sign_of_input_as_torch():
    """torch's remainder is C's fmod plus ``other`` where they differ in sign: a zero keeps
    ``input``'s sign (NumPy's takes ``other``'s, so 1 / (x % y) was +inf for torch's -inf)."""
    a = np.array([-5.0, -0.0, 5.0, 0.0, 7.5, -7.5, -1e-300, 1e-300, -6.0])
    b = np.array([2.5, 3.0, -2.5, -3.0, 2.0, 2.0, 3.0, -3.0, -3.0])
    r = [(M.tensor(a) % M.tensor(b)).numpy() for M in (tapegrad, torch)]
    _same(*r)
    assert np.signbit(r[0]).tolist() == np.signbit(r[1]).tolist()
    inv = [(1.0 / (M.tensor(a) % M.tensor(b))).numpy() for M in (tapegrad, torch)]
    _same(*inv)


def test_fmod_of_a_number_and_einsum_of_an_empty_dimension_as_torch():
    for M in (tapegrad, torch):
        with pytest.raises(TypeError):
            M.fmod(2.5, M.ones(2))
        assert tuple(M.einsum("i,i->i", M.ones(1), M.ones(0)).shape) == (0,)


@pytest.mark.parametrize("name", ["%", "fmod"])
def test_the_divisor_derivative_is_a_graph_under_create_graph(name):
    # torch's d(x % y)/dy = -floor(x / y) * g, with floor(x / y) a graph of x and y (its
    # derivative zero): under create_graph it requires grad and its derivatives are zeros,
    # not None (tapegrad's was a constant)
    f = FNS[name]
    res = []
    for M in (tapegrad, torch):
        x = M.tensor(A[[0, 1, 2, 3, 7]], dtype=M.float64, requires_grad=True)
        y = M.tensor([[0.75], [-1.25]], dtype=M.float64, requires_grad=True)
        gx, gy = M.autograd.grad(f(M, x, y).sum(), (x, y), create_graph=True)
        assert gy.requires_grad and not gx.requires_grad
        hs = M.autograd.grad(gy.sum(), (x, y), allow_unused=True)
        res.append([gy.detach().numpy()] + [None if h is None else h.numpy() for h in hs])
    for a, b in zip(*res):
        assert (a is None) == (b is None)
        _same(a, b)


@pytest.mark.parametrize("shape,kw", [((3,), {}), ((2, 3), {"dim": 1}), ((2, 3), {"dim": -2})])
def test_linalg_norm_of_order_0_has_torchs_undefined_gradient(shape, kw):
    # a count: the graph reaches x but the gradient is undefined (torch: "not used in the
    # graph", None with allow_unused, zeros materialized); tapegrad gave zeros
    for M in (tapegrad, torch):
        x = M.tensor(np.arange(6.0)[:int(np.prod(shape))].reshape(shape), dtype=M.float64,
                     requires_grad=True)
        y = M.linalg.norm(x, ord=0, **kw).sum()
        assert y.requires_grad
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            M.autograd.grad(y, x, retain_graph=True)
        assert M.autograd.grad(y, x, allow_unused=True, retain_graph=True) == (None,)
        (g,) = M.autograd.grad(y, x, allow_unused=True, materialize_grads=True,
                               create_graph=True)
        assert g.requires_grad and not np.any(g.detach().numpy())
        # beside a defined gradient, it adds nothing
        x2 = M.tensor([1.0, 0.0, -2.0], dtype=M.float64, requires_grad=True)
        (g2,) = M.autograd.grad(M.linalg.norm(x2, ord=0) + (x2 * x2).sum(), x2)
        assert g2.tolist() == [2.0, 0.0, -4.0]


def test_a_function_returning_none_gives_none_as_torch():
    res = []
    for M in (tapegrad, torch):
        class F(M.autograd.Function):
            @staticmethod
            def forward(ctx, x, y):
                return x * y

            @staticmethod
            def backward(ctx, g):
                return g, None
        x = M.ones(2, dtype=M.float64, requires_grad=True)
        y = M.ones(2, dtype=M.float64, requires_grad=True)
        res.append(M.autograd.grad(F.apply(x, y).sum(), (x, y), allow_unused=True)[1])
    assert res == [None, None]


@pytest.mark.parametrize("c", [True, False, 1, 2.5, -3])
def test_a_number_over_a_negative_zero_differentiates_as_torch(c):
    # True / x recorded an array entry on Python floats: its rule raised ZeroDivisionError
    res = []
    for M in (tapegrad, torch):
        x = M.tensor(-0.0, dtype=M.float64, requires_grad=True)
        y = c / x
        (g1,) = M.autograd.grad(y, x, create_graph=True)
        (g2,) = M.autograd.grad(c / x, x)
        (h,) = M.autograd.grad(g1, x)
        res.append([y.item(), g1.item(), g2.item(), h.item()])
    _same(*res)
    signs = [[math.copysign(1.0, v) for v in r if not math.isnan(v)] for r in res]
    assert signs[0] == signs[1]  # (a nan's sign bit is noise)


def test_matrix_norms_of_empty_matrices_as_torch():
    # the largest column (row) sum of a matrix with no columns (rows) is 0, off the graph,
    # in torch; tapegrad's amax over the empty dim raised (the harness's seed 46038)
    inf = math.inf
    for shape, kw in [((3, 0), {"ord": 1}), ((3, 0), {"ord": 1, "keepdim": True}),
                      ((0, 0), {"ord": inf}), ((0, 3), {"ord": inf}),
                      ((2, 3, 0), {"ord": 1, "dim": (1, 2)}),
                      ((2, 0, 3), {"ord": 1, "dim": (2, 1), "keepdim": True}),
                      ((2, 3, 0), {"ord": inf, "dim": (1, 2)}), ((0, 3), {"ord": 1}),
                      ((3, 0), {"ord": -1}), ((0, 3), {"ord": -inf})]:
        res = []
        for M in (tapegrad, torch):
            x = M.ones(shape, dtype=M.float64, requires_grad=True)
            try:
                y = M.linalg.norm(x, **kw)
            except IndexError:
                res.append("IndexError")
                continue
            res.append((tuple(y.shape), y.requires_grad, y.detach().numpy().tolist()))
        assert res[0] == res[1], (shape, kw)
