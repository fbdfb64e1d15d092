"""tapegrad as a drop-in for torch.autograd: printed forms, tensor functions, nn.functional,
custom Function edge cases, graph nodes and hooks, each against torch."""
import warnings

import numpy as np
import pytest

import tapegrad

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _torch_float64():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # tapegrad's default dtype
    yield
    torch.set_default_dtype(prev)


def _same_repr(tg, th):
    assert repr(tg) == repr(th).replace("torch.", "tapegrad."), (repr(tg), repr(th))


# -- what users see printed -------------------------------------------------------------------

NODE_EXPRS = [
    "x+2", "2+x", "x-2", "2-x", "x*2", "x/2", "2/x", "x**2", "2**x", "x+x", "x.sum()",
    "x.sum(0)", "x.mean()", "m.mean(0)", "m.view(6)", "m.reshape(6)", "m[:1].squeeze()",
    "m[:1].squeeze(0)", "x.unsqueeze(0)", "m.flatten()", "(x*1)[1]", "(x*1)[1:]",
    "(x*1)[[0,1]]", "m.T", "m.t()", "m.transpose(0,1)", "m.permute(1,0)", "x.expand(2,3)",
    "x.clone()", "x.float()", "M.stack([x,x])", "M.cat([x,x])", "m@x", "m@m.T", "x@x",
    "x.max()", "x.amax(0)", "x.max(0)[0]", "x.min()", "x.norm()", "x.logsumexp(0)",
    "x.softmax(0)", "x.log_softmax(0)", "M.where(x>1,x,0.)", "x.clamp(0,1)",
    "x.clamp(min=0)", "x.prod()", "x.prod(0)", "x.relu()", "M.outer(x,x)", "M.diag(x)", "-x",
    "x.sigmoid()", "M.maximum(x,x)", "M.atan2(x,x)", "x.square()", "x.reciprocal()",
    "x.abs()", "x**x", "x-x", "x/x", "x.exp()", "M.clamp_min(x, M.zeros(3))",
    "M.tensor(2.0, requires_grad=True) * 3", "M.tensor(2.0, requires_grad=True) - 3",
    # x + c and x - c record one op: named as torch names them, whatever the sign of c
    "x+(-2.0)", "x-(-2.0)", "(-2.0)+x", "x-0.0", "x+(-0.0)", "x-(-2)", "x-float('nan')",
    "M.tensor(2.0, requires_grad=True) + (-3)", "M.tensor(2.0, requires_grad=True) - (-3.0)",
    "-3.0 + M.tensor(2.0, requires_grad=True)", "M.tensor(2.0, requires_grad=True) - 0.0",
    "M.tensor(2.0, requires_grad=True) - float('nan')"]


@pytest.mark.parametrize("expr", NODE_EXPRS)
def test_grad_fn_names(expr):
    names, reprs = [], []
    for M in (torch, tapegrad):
        x = M.tensor([1.0, 2.0, 3.0], requires_grad=True)
        m = M.ones(2, 3, requires_grad=True)
        y = eval(expr, {"M": M, "x": x, "m": m})
        names.append(y.grad_fn.name())
        reprs.append(repr(y).replace("torch.", "tapegrad."))
    assert names[0] == names[1]
    assert reprs[0] == reprs[1]


class _Twice:
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_custom_function_node_name():
    outs = []
    for M in (torch, tapegrad):
        Twice = type("Twice", (M.autograd.Function,), dict(vars(_Twice)))
        y = Twice.apply(M.tensor([1.0, 2.0], requires_grad=True))
        outs.append((repr(y).replace("torch.", "tapegrad."), y.grad_fn.name(),
                     type(y.grad_fn).__name__ if M is torch else y.grad_fn.name()))
    assert outs[0] == outs[1] == outs[0][:1] + ("TwiceBackward", "TwiceBackward")
    assert outs[0][0] == "tensor([2., 4.], grad_fn=<TwiceBackward>)"


VALUES = [2.145, [2.5, 5.0], [1.0, 2.0], [1e-5, 1.0], [1e9, 1.0], [0.0, -0.0],
          [float("nan"), 1.5, float("inf")], [[1.0, -2.25], [3.5, 4.0]], [[[1.0]]], [],
          [-1.0, 1e-3, 123.456], list(np.linspace(-3, 3, 1500)), [[0.1] * 40] * 3, 1e-9,
          -3.0, [1e-4, 1e-3]]


@pytest.mark.parametrize("value", VALUES, ids=[str(i) for i in range(len(VALUES))])
def test_tensor_repr_like_torch(value):
    _same_repr(tapegrad.tensor(value), torch.tensor(value))
    _same_repr(tapegrad.tensor(value, requires_grad=True), torch.tensor(value,
                                                                        requires_grad=True))
    _same_repr(tapegrad.tensor(value, dtype=tapegrad.float32),
               torch.tensor(value, dtype=torch.float32))


@pytest.mark.parametrize("value", [[True, False], True, [[True], [False]], [1, -20, 3], 7,
                                   [], [[1, 2], [3, 4]]])
def test_bool_and_int_repr_like_torch(value):
    _same_repr(tapegrad.tensor(value), torch.tensor(value))
    _same_repr(tapegrad.tensor(value, dtype=tapegrad.int32),
               torch.tensor(value, dtype=torch.int32))


def test_empty_shapes_repr_like_torch():
    for shape in [(0,), (2, 0), (0, 3)]:
        _same_repr(tapegrad.zeros(*shape), torch.zeros(*shape))
        _same_repr(tapegrad.zeros(*shape, dtype=tapegrad.int64),
                   torch.zeros(*shape, dtype=torch.int64))


def test_size_is_a_tuple_that_prints_like_torch():
    s = tapegrad.zeros(4, 2).shape
    assert repr(s) == "tapegrad.Size([4, 2])" == repr(torch.zeros(4, 2).shape).replace(
        "torch", "tapegrad")
    assert str(s) == repr(s)
    assert isinstance(s, tuple) and s == (4, 2) and s[0] == 4 and len(s) == 2
    assert isinstance(s[1:], tapegrad.Size) and s[1:] == (2,)
    assert s.numel() == 8 == torch.zeros(4, 2).shape.numel()
    assert tapegrad.tensor(1.0).shape == () and repr(tapegrad.tensor(1.0).shape) == \
        "tapegrad.Size([])"
    assert tapegrad.zeros(4, 2).size() == s and tapegrad.zeros(3).size(0) == 3
    a, b = s
    assert (a, b) == (4, 2)


# -- tensor functions ---------------------------------------------------------------------------


def _grads(M, fn, arrays, create_graph=False):
    ts = [M.tensor(a, requires_grad=True) for a in arrays]
    out = fn(M, *ts)
    val = out[0] if isinstance(out, tuple) else out
    gs = M.autograd.grad((val * M.arange(val.numel()).reshape(val.shape).to(val.dtype) + 1)
                         .sum() if val.ndim else val, ts, create_graph=create_graph)
    return out, gs, ts


def _np(t):
    return t.detach().numpy() if hasattr(t, "detach") else np.asarray(t)


def _compare(fn, arrays, second=True):
    """Values, first derivatives and (``second``) the derivative of the gradient's sum
    against torch."""
    res = []
    for M in (torch, tapegrad):
        out, gs, ts = _grads(M, fn, arrays, create_graph=second)
        outs = out if isinstance(out, tuple) else (out,)
        g2 = None
        if second:
            total = sum(((g * t) ** 2).sum() for g, t in zip(gs, ts))
            g2 = M.autograd.grad(total, ts, allow_unused=True)
        res.append((outs, gs, g2))
    (o1, g1, h1), (o2, g2, h2) = res
    for a, b in zip(o1, o2):
        np.testing.assert_allclose(_np(b), _np(a), rtol=1e-12, atol=1e-12)
        assert str(_np(a).dtype) == str(_np(b).dtype)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(_np(b), _np(a), rtol=1e-10, atol=1e-12)
    if second:
        for a, b in zip(h1, h2):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(_np(b), _np(a), rtol=1e-10, atol=1e-12)


RNG = np.random.default_rng(20)
X34 = RNG.normal(size=(3, 4))


@pytest.mark.parametrize("fn", [
    lambda M, x: M.sort(x),
    lambda M, x: M.sort(x, dim=0, descending=True),
    lambda M, x: x.sort(-1, True),
    lambda M, x: M.sort(x[0]),
    lambda M, x: (M.sort(x * x, 1).values * x).sum(1),
], ids=["sort", "sort0desc", "method", "1d", "chain"])
def test_sort_values_indices_and_gradients(fn):
    _compare(fn, [X34])


def test_sort_ties_and_nan_like_torch():
    a = np.array([2.0, 1.0, 2.0, np.nan, 1.0, -np.inf, 2.0])
    for desc in (False, True):
        v1, i1 = torch.sort(torch.tensor(a), descending=desc, stable=True)
        v2, i2 = tapegrad.sort(tapegrad.tensor(a), descending=desc, stable=True)
        np.testing.assert_array_equal(v2.numpy(), v1.numpy())
        assert i2.tolist() == i1.tolist()
        assert tapegrad.argsort(tapegrad.tensor(a), descending=desc).tolist() == \
            torch.argsort(torch.tensor(a), descending=desc, stable=True).tolist()
    s = tapegrad.sort(tapegrad.tensor([3.0, 1.0]))
    assert type(s).__name__ == "sort" and s.indices.dtype is tapegrad.int64


def test_argsort_2d():
    for d in (0, 1):
        assert tapegrad.argsort(tapegrad.tensor(X34), d).tolist() == \
            torch.argsort(torch.tensor(X34), d).tolist()
        assert tapegrad.tensor(X34).argsort(dim=d, descending=True).tolist() == \
            torch.tensor(X34).argsort(dim=d, descending=True).tolist()


def test_mm_and_errors():
    _compare(lambda M, a, b: M.mm(a, b), [X34, X34.T.copy()])
    _compare(lambda M, a, b: a.mm(b), [X34.T.copy(), X34])
    for bad in [(np.ones(3), np.ones((3, 2))), (np.ones((2, 3)), np.ones((2, 3)))]:
        for M in (torch, tapegrad):
            with pytest.raises(RuntimeError):
                M.mm(M.tensor(bad[0]), M.tensor(bad[1]))


def test_equal():
    for a, b in [([1.0, 2.0], [1.0, 2.0]), ([1.0, 2.0], [1.0, 3.0]), ([1.0], [1.0, 1.0]),
                 ([float("nan")], [float("nan")]), ([[1, 2]], [[1, 2]]), (3.0, 3.0)]:
        assert tapegrad.equal(tapegrad.tensor(a), tapegrad.tensor(b)) == \
            torch.equal(torch.tensor(a), torch.tensor(b))
        assert tapegrad.tensor(a).equal(tapegrad.tensor(b)) is torch.equal(torch.tensor(a),
                                                                            torch.tensor(b))


def _index_add_fn(dim, index, alpha=1):
    def fn(M, x, s):
        y = x * 1.0
        y.index_add_(dim, M.tensor(index), s * s, alpha=alpha)
        return y
    return fn


@pytest.mark.parametrize("dim,index,alpha", [(0, [0, 2, 0], 1), (1, [3, 3, 1], 2.5),
                                             (-1, [0, 1, 2], -1)])
def test_index_add(dim, index, alpha):
    x = RNG.normal(size=(3, 4))
    shape = list(x.shape)
    shape[dim] = len(index)
    s = RNG.normal(size=shape)
    _compare(_index_add_fn(dim, index, alpha), [x, s])
    _compare(lambda M, a, b: M.index_add(a, dim, M.tensor(index), b, alpha=alpha), [x, s])
    y = tapegrad.tensor(x, requires_grad=True) * 1.0
    assert repr(y.index_add_(dim, tapegrad.tensor(index), tapegrad.tensor(s))).endswith(
        "grad_fn=<IndexAddBackward0>)")


def test_index_add_errors_record_nothing():
    for M in (torch, tapegrad):
        x = M.zeros(3, 2, requires_grad=True)
        with pytest.raises(RuntimeError):  # in place on a leaf that requires grad
            x.index_add_(0, M.tensor([0]), M.ones(1, 2))
        y = M.zeros(3, 2)
        with pytest.raises((RuntimeError, IndexError)):
            y.index_add_(0, M.tensor([0, 1]), M.ones(1, 2))  # source of the wrong shape
        with pytest.raises((RuntimeError, IndexError)):
            y.index_add_(0, M.tensor([5]), M.ones(1, 2))  # out of range
        assert y.sum().item() == 0.0


# -- tapegrad.nn --------------------------------------------------------------------------------


def test_parameter():
    for M in (torch, tapegrad):
        base = M.ones(2)
        p = M.nn.Parameter(base)
        assert p.requires_grad and p.is_leaf and isinstance(p, M.nn.Parameter)
        assert isinstance(p, M.Tensor) and not isinstance(base, M.nn.Parameter)
        assert not M.nn.Parameter(M.ones(2), requires_grad=False).requires_grad
        with M.no_grad():
            p -= 0.5
        assert base.tolist() == [0.5, 0.5]  # shares memory with the data
    _same_repr(tapegrad.nn.Parameter(tapegrad.tensor([1.5, 2.0])),
               torch.nn.Parameter(torch.tensor([1.5, 2.0])))


X43 = RNG.normal(size=(4, 3)) * 3
T43 = RNG.uniform(size=(4, 3))
W3 = RNG.uniform(0.5, 2.0, size=3)
IDX = np.array([0, 2, 1, 2])

LOSSES = {
    "mse": (lambda M, a, b: M.nn.functional.mse_loss(a, b), [X43, T43]),
    "mse_none": (lambda M, a, b: M.nn.functional.mse_loss(a, b, reduction="none"), [X43, T43]),
    "mse_sum": (lambda M, a, b: M.nn.functional.mse_loss(a, b, reduction="sum"), [X43, T43]),
    "bce": (lambda M, a, b: M.nn.functional.binary_cross_entropy_with_logits(a, b),
            [X43 * 10, T43]),
    "bce_extreme": (lambda M, a, b: M.nn.functional.binary_cross_entropy_with_logits(a, b),
                    [np.array([[-800.0, -30.0, 0.0], [1e-3, 25.0, 800.0]]), T43[:2]]),
    "logsigmoid_extreme": (lambda M, a: M.nn.functional.logsigmoid(a),
                           [np.array([-800.0, -30.0, 0.0, 1e-3, 25.0, 800.0])]),
    "bce_weights": (lambda M, a, b: M.nn.functional.binary_cross_entropy_with_logits(
        a, b, weight=M.tensor(W3), pos_weight=M.tensor(W3[::-1].copy()), reduction="sum"),
        [X43, T43]),
    "ce": (lambda M, a: M.nn.functional.cross_entropy(a, M.tensor(IDX)), [X43]),
    "ce_weight_ignore": (lambda M, a: M.nn.functional.cross_entropy(
        a, M.tensor(IDX), weight=M.tensor(W3), ignore_index=1), [X43]),
    "ce_smoothing": (lambda M, a: M.nn.functional.cross_entropy(
        a, M.tensor(IDX), weight=M.tensor(W3), label_smoothing=0.2), [X43]),
    "ce_none": (lambda M, a: M.nn.functional.cross_entropy(a, M.tensor(IDX),
                                                           reduction="none"), [X43]),
    "ce_probs": (lambda M, a, b: M.nn.functional.cross_entropy(
        a, b.softmax(1), label_smoothing=0.1), [X43, T43]),
    "ce_1d": (lambda M, a: M.nn.functional.cross_entropy(a[0], M.tensor(2)), [X43]),
    "ce_kdim": (lambda M, a: M.nn.functional.cross_entropy(
        a.reshape(2, 3, 2), M.tensor([[0, 2], [1, 1]])), [X43]),
    "nll": (lambda M, a: M.nn.functional.nll_loss(a.log_softmax(1), M.tensor(IDX),
                                                  weight=M.tensor(W3)), [X43]),
    "softplus": (lambda M, a: M.nn.functional.softplus(a, beta=2, threshold=3), [X43]),
    "logsigmoid": (lambda M, a: M.nn.functional.logsigmoid(a * 10), [X43]),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_functional_losses(name):
    fn, arrays = LOSSES[name]
    _compare(fn, arrays)
    names = [fn(M, *[M.tensor(a, requires_grad=True) for a in arrays]).grad_fn.name()
             for M in (torch, tapegrad)]
    if name not in ("ce_probs",):
        assert names[0] == names[1]


def test_losses_batched_and_traced():
    F = tapegrad.nn.functional
    x = tapegrad.tensor(X43, requires_grad=True)
    loss = F.cross_entropy(x, tapegrad.tensor(IDX)) + F.mse_loss(x, tapegrad.tensor(T43))
    (g,) = tapegrad.autograd.grad(loss, x, create_graph=True)
    vs = tapegrad.tensor(RNG.normal(size=(5, 4, 3)))
    (h,) = tapegrad.autograd.grad(g, x, vs, is_grads_batched=True)
    xt = torch.tensor(X43, requires_grad=True)
    lt = torch.nn.functional.cross_entropy(xt, torch.tensor(IDX)) + \
        torch.nn.functional.mse_loss(xt, torch.tensor(T43))
    (gt,) = torch.autograd.grad(lt, xt, create_graph=True)
    (ht,) = torch.autograd.grad(gt, xt, torch.tensor(vs.numpy()), is_grads_batched=True)
    np.testing.assert_allclose(h.numpy(), ht.numpy(), rtol=1e-10, atol=1e-12)

    def f(w):
        return F.binary_cross_entropy_with_logits(w, tapegrad.tensor(T43)) + \
            F.logsigmoid(w).sum()
    prog = tapegrad.trace(f, tapegrad.tensor(X43))
    for s in range(2):
        w = RNG.normal(size=(4, 3))
        wt = torch.tensor(w, requires_grad=True)
        lt = torch.nn.functional.binary_cross_entropy_with_logits(wt, torch.tensor(T43)) + \
            torch.nn.functional.logsigmoid(wt).sum()
        (gt,) = torch.autograd.grad(lt, wt)
        np.testing.assert_allclose(prog.grad(w), gt.numpy(), rtol=1e-10, atol=1e-12)


def test_loss_errors():
    F = tapegrad.nn.functional
    x = tapegrad.ones(4, 3, requires_grad=True)
    with pytest.warns(UserWarning, match="different to the input size"):  # as torch
        F.mse_loss(x, tapegrad.ones(3))
    with pytest.raises(ValueError):
        F.mse_loss(x, tapegrad.ones(4, 3), reduction="avg")
    with pytest.raises(IndexError):
        F.cross_entropy(x, tapegrad.tensor([0, 1, 2, 3]))
    with pytest.raises(RuntimeError):
        F.binary_cross_entropy_with_logits(x, x.detach(), weight=tapegrad.ones(3,
                                                                          requires_grad=True))


# -- custom Function edge cases -----------------------------------------------------------------


def _fn_classes(M):
    class Scale(M.autograd.Function):  # backward returns Nones for the non-tensor arguments
        @staticmethod
        def forward(ctx, x, k, note):
            ctx.k = k
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k, None, None, None, None

    class BadExtra(M.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2, g

    class TripleInPlace(M.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(3.0)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g * 3.0

    class NumpyCube(M.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return M.tensor(x.numpy() ** 3)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x * x * g
    return Scale, BadExtra, TripleInPlace, NumpyCube


@pytest.mark.parametrize("value", [[1.0, -2.0], 1.5])
def test_function_edge_cases_like_torch(value):
    res = []
    for M in (torch, tapegrad):
        Scale, BadExtra, TripleInPlace, NumpyCube = _fn_classes(M)
        a = M.tensor(value, requires_grad=True)
        y = Scale.apply(a, 2.5, "note")
        (ga,) = M.autograd.grad(y.sum(), a)
        with pytest.raises(RuntimeError, match="incorrect number of gradients"):
            M.autograd.grad(BadExtra.apply(a).sum(), a)
        b = a.clone()
        z = TripleInPlace.apply(b)
        same = z is b
        name = b.grad_fn.name()
        (gb,) = M.autograd.grad((z * z).sum(), a)
        with pytest.raises(RuntimeError, match="leaf Variable"):
            TripleInPlace.apply(M.tensor(value, requires_grad=True))
        c = NumpyCube.apply(a)
        (gc,) = M.autograd.grad(c.sum(), a)
        res.append((ga.tolist(), same, name, gb.tolist(), c.tolist(), gc.tolist(), repr(c)))
    assert res[0] == res[1]


def test_mark_dirty_must_return_the_tensor():
    class Forgot(tapegrad.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.add_(1.0)
            ctx.mark_dirty(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2
    with pytest.raises(RuntimeError, match="does not return"):
        Forgot.apply(tapegrad.tensor([1.0], requires_grad=True).clone())


def test_numpy_under_no_grad_like_torch():
    for M in (torch, tapegrad):
        x = M.tensor([1.0, 2.0], requires_grad=True)
        with pytest.raises(RuntimeError, match="requires grad"):
            x.numpy()
        with M.no_grad():
            assert x.numpy().tolist() == [1.0, 2.0]
            assert np.asarray(x).tolist() == [1.0, 2.0]


# -- graph nodes ------------------------------------------------------------------------------


def _walk(fn, seen=None):
    """(name, [children...]) of a node, with leaves as ('leaf', index of variable)."""
    if fn is None:
        return None
    nexts = [(_walk(n) if not hasattr(n, "variable")
              else ("AccumulateGrad", tuple(n.variable.shape)))
             for n, _ in fn.next_functions]
    return (fn.name(), nexts)


@pytest.mark.parametrize("expr", ["(x * w).sum()", "(x.exp() + w).sin().mean(0)",
                                  "M.stack([x, w]).max()", "x * 2 + 1", "(x @ w) * x.sum()",
                                  "(x - 2) / 3 - 1", "2 - x ** 2"])
def test_node_graph_like_torch(expr):
    graphs = []
    for M in (torch, tapegrad):
        x = M.tensor([1.0, 2.0, 3.0], requires_grad=True)
        w = M.tensor([0.5, -1.0, 2.0], requires_grad=True)
        y = eval(expr, {"M": M, "x": x, "w": w})
        assert isinstance(y.grad_fn, M.autograd.graph.Node)
        assert not isinstance(x, M.autograd.graph.Node) and x.grad_fn is None
        graphs.append(_walk(y.grad_fn))
    assert graphs[0] == graphs[1]


def test_node_accumulate_grad_and_metadata():
    for M in (torch, tapegrad):
        x = M.tensor([1.0, 2.0], requires_grad=True)
        c = M.tensor([3.0, 4.0])
        y = x * c
        (acc, i), (none, j) = y.grad_fn.next_functions
        assert acc.variable is x and i == 0 and none is None and j == 0
        assert isinstance(acc, M.autograd.graph.Node) and acc.next_functions == ()
        assert y.grad_fn.metadata == {}
        y.grad_fn.metadata["tag"] = 7
        assert y.grad_fn.metadata == {"tag": 7}  # kept by the node across accesses


def test_saved_tensors_like_torch():
    for M in (torch, tapegrad):
        x = M.tensor([1.0, 2.0], requires_grad=True)
        w = M.tensor([3.0, 4.0], requires_grad=True)
        y = x * w
        assert y.grad_fn._saved_self is x and y.grad_fn._saved_other is w
        e = x.exp()
        assert M.equal(e.grad_fn._saved_result, e)
        s = (x * 2).sin()
        assert M.equal(s.grad_fn._saved_self, x * 2)
        with pytest.raises(AttributeError):
            e.grad_fn._saved_other
        s.sum().backward()
        with pytest.raises(RuntimeError, match="freed"):
            s.grad_fn._saved_self


# -- hooks ----------------------------------------------------------------------------------


def _tl(t):
    return None if t is None else np.round(np.asarray(t.tolist(), dtype=float), 10).tolist()


def _hooks_basic(M, x0):
    log = []
    x = M.tensor(x0, requires_grad=True)
    w = M.tensor(np.full(np.shape(x0), 0.5) if np.ndim(x0) else 0.5, requires_grad=True)
    x.register_hook(lambda g: log.append(("x", _tl(g))))
    x.register_hook(lambda g: g * 10)
    x.register_post_accumulate_grad_hook(lambda p: log.append(("x post", _tl(p.grad))))
    y = x * w
    y.register_hook(lambda g: log.append(("y", _tl(g))) or g * 2)
    y.retain_grad()
    z = y.sin() + y
    z.grad_fn.register_prehook(lambda gos: log.append(("z pre", [_tl(g) for g in gos])))
    z.grad_fn.register_hook(lambda gis, gos: log.append(("z post", [_tl(g) for g in gis])))
    y.grad_fn.register_hook(lambda gis, gos: (gis[0] * 3, gis[1]))
    h = w.register_hook(lambda g: log.append(("w", _tl(g))))
    loss = z.sum() if np.ndim(x0) else z
    loss.register_hook(lambda g: log.append(("loss", _tl(g))))
    loss.backward(retain_graph=True)
    log.append(("grads", _tl(x.grad), _tl(w.grad), _tl(y.grad)))
    h.remove()
    g = M.autograd.grad(loss, [x, y])
    log.append(("grad()", [_tl(t) for t in g]))
    return log


def _hooks_prehook_replaces(M, x0):
    log = []
    a = M.tensor(x0, requires_grad=True)
    b = a.clone()
    h = b.grad_fn.register_prehook(lambda gos: (gos[0] * 2,))
    b.sum().backward(retain_graph=True)
    log.append(_tl(a.grad))
    h.remove()
    a.grad = None
    b.sum().backward()
    log.append(_tl(a.grad))
    return log


def _hooks_leaf_used_twice(M, x0):
    log = []
    x = M.tensor(x0, requires_grad=True)
    x.register_hook(lambda g: log.append(("x", _tl(g))) or g.clamp(-1.0, 1.0))
    y = (x * x).sum() + (x.exp() * 3).sum()
    (g,) = M.autograd.grad(y, x)
    log.append(("grad", _tl(g)))
    y2 = (x * 3).sum() * (x * 2).sum()
    y2.backward()
    log.append(("x.grad", _tl(x.grad)))
    return log


def _hooks_function(M, x0):
    log = []

    class Cube(M.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x ** 3

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x * x * g
    x = M.tensor(x0, requires_grad=True)
    y = Cube.apply(x * 2)
    y.register_hook(lambda g: log.append(("y", _tl(g))) or g + 1)
    y.grad_fn.register_prehook(lambda gos: log.append(("pre", [_tl(g) for g in gos])))
    y.grad_fn.register_hook(lambda gis, gos: log.append(("post", [_tl(g) for g in gis])))
    (y.sum() if np.ndim(x0) else y).backward()
    log.append(("x.grad", _tl(x.grad)))
    return log


def _hooks_clip_and_count(M, x0):
    calls = []
    w = M.tensor(x0, requires_grad=True)
    w.register_hook(lambda g: calls.append(1) or g.clamp(-0.5, 0.5))
    for _ in range(3):
        loss = ((w - 3.0) ** 2).sum()
        loss.backward()
        with M.no_grad():
            w -= 0.1 * w.grad
        w.grad = None
    return [len(calls), _tl(w)]


def _hooks_node_post_on_leaf_inputs(M, x0):
    log = []
    x = M.tensor(x0, requires_grad=True)
    c = M.tensor(np.ones(np.shape(x0)) * 2 if np.ndim(x0) else 2.0)
    y = (x * c + x / 3.0 - 1.0) * x
    for node in (y.grad_fn, y.grad_fn.next_functions[0][0]):
        node.register_hook(lambda gis, gos, n=node.name(): log.append(  # noqa: B008
            (n, [_tl(g) for g in gis], [_tl(g) for g in gos])))
    (y.sum() if np.ndim(x0) else y).backward()
    log.append(_tl(x.grad))
    return log


def _hooks_on_leaf_output(M, x0):
    log = []
    x = M.tensor(x0, requires_grad=True)
    x.register_hook(lambda g: log.append(_tl(g)) or g * 3)
    x.register_post_accumulate_grad_hook(lambda p: log.append(("post", _tl(p.grad))))
    x.backward(M.ones_like(x) * 2)
    log.append(_tl(x.grad))
    log.append(_tl(M.autograd.grad(x, x, M.ones_like(x))[0]))
    return log


def _hooks_on_leaf_output_next_to_non_leaf(M, x0):
    # the leaf's hooks see its whole gradient once: its own seed plus what y gives it
    log = []
    x = M.tensor(x0, requires_grad=True)
    z = M.tensor(x0, requires_grad=True)
    x.register_hook(lambda g: log.append(("x", _tl(g))) or g * 3)
    z.register_hook(lambda g: log.append(("z", _tl(g))) or g * 5)
    x.register_post_accumulate_grad_hook(lambda p: log.append(("post", _tl(p.grad))))
    y = (x * 2).sum()
    seed = M.ones_like(x) * 0.5
    log.append([_tl(t) for t in M.autograd.grad([y, x, z], [x, z],
                                                 [M.tensor(1.0), seed, seed],
                                                 retain_graph=True)])
    M.autograd.backward([y, x, z], [M.tensor(1.0), seed, seed])
    log.append((_tl(x.grad), _tl(z.grad)))
    return log


HOOK_SCENARIOS = [_hooks_on_leaf_output, _hooks_on_leaf_output_next_to_non_leaf, _hooks_basic,
                  _hooks_prehook_replaces, _hooks_leaf_used_twice, _hooks_function,
                  _hooks_clip_and_count, _hooks_node_post_on_leaf_inputs]


@pytest.mark.parametrize("x0", [1.5, [1.0, 2.0, -0.5]], ids=["scalar", "array"])
@pytest.mark.parametrize("scenario", HOOK_SCENARIOS, ids=lambda f: f.__name__)
def test_hooks_order_count_and_values_like_torch(scenario, x0):
    assert scenario(tapegrad, x0) == scenario(torch, x0)


def _hooks_inputs_and_many_tapes(M):
    log = []
    x = M.tensor([1.0, 2.0], requires_grad=True)
    w = M.tensor([3.0, -1.0], requires_grad=True)
    x.register_hook(lambda g: log.append(("x", _tl(g))) or g * 2)
    w.register_hook(lambda g: log.append(("w", _tl(g))))
    w.register_post_accumulate_grad_hook(lambda p: log.append(("w post", _tl(p.grad))))
    m = (x * w).exp() * x
    m.register_hook(lambda g: log.append(("m", _tl(g))))
    m.sum().backward(inputs=[w], retain_graph=True)
    log.append((x.grad, _tl(w.grad)))
    log.append([_tl(t) for t in M.autograd.grad(m.sum(), [m, x])])
    s = M.tensor(0.5, requires_grad=True)
    s.register_hook(lambda g: log.append(("s", round(g.item(), 8))))
    v = s
    for _ in range(300):  # over several tapes in tapegrad (the rollover is lowered)
        v = v * 0.999 + 0.001 * s.sin()
    v.backward()
    log.append(round(s.grad.item(), 8))
    return log


def test_hooks_with_inputs_and_across_tapes(monkeypatch):
    expected = _hooks_inputs_and_many_tapes(torch)
    monkeypatch.setattr(tapegrad.tape, "ROLLOVER", 200)
    assert _hooks_inputs_and_many_tapes(tapegrad) == expected


@pytest.mark.usefixtures("frozen_heap")  # cheap gc.collect() calls
def test_hooks_removed_leave_fast_paths():
    import gc

    from tapegrad.autograd.graph import HOOKS
    gc.collect()  # hooks of earlier tests whose tensors are gone leave the count
    before = HOOKS[0]
    x = tapegrad.tensor(2.0, requires_grad=True)
    h = x.register_hook(lambda g: g * 2)
    assert HOOKS[0] == before + 1
    assert tapegrad.autograd.grad(x * x, x)[0].item() == 8.0
    h.remove()
    h.remove()  # a second remove does nothing, as in torch
    assert HOOKS[0] == before
    assert tapegrad.autograd.grad(x * x, x)[0].item() == 4.0
    y = x * 3
    y.register_hook(lambda g: g)
    x.register_hook(lambda g: g)
    assert HOOKS[0] == before + 2
    del x, y  # hooks die with their tensors and tapes: the fast paths come back
    gc.collect()
    assert HOOKS[0] == before


def test_hook_errors():
    x = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2
    for M, t in ((tapegrad, tapegrad.tensor([1.0])), (torch, torch.tensor([1.0]))):
        with pytest.raises(RuntimeError):
            t.register_hook(lambda g: g)  # does not require grad
        with pytest.raises(RuntimeError):
            (M.tensor([1.0], requires_grad=True) * 2).register_post_accumulate_grad_hook(
                lambda p: None)
    h = y.register_hook(lambda g: tapegrad.ones(3))
    with pytest.raises(RuntimeError, match="shape"):
        y.sum().backward(retain_graph=True)
    h.remove()
    h = y.register_hook(lambda g: g * 3)  # create_graph runs hooks (tests/test_hooks_recorded)
    assert tapegrad.autograd.grad(y.sum(), x, create_graph=True)[0].tolist() == [6.0, 6.0]
    h.remove()
    assert tapegrad.autograd.grad(y.sum(), x, create_graph=True)[0].tolist() == [2.0, 2.0]


def test_saved_tensors_hooks_on_functions():
    for M in (torch, tapegrad):
        log = []

        class Square(M.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 2 * x * g

        def pack(t):
            log.append("pack")
            return ("box", t.detach().clone() if M is torch else t)

        def unpack(p):
            log.append("unpack")
            return p[1]
        x = M.tensor([1.0, 3.0], requires_grad=True)
        with M.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = Square.apply(x)
        y.sum().backward()
        assert log == ["pack", "unpack"] and x.grad.tolist() == [2.0, 6.0]
        with M.autograd.graph.save_on_cpu():
            z = Square.apply(x)
        assert M.autograd.grad(z.sum(), x)[0].tolist() == [2.0, 6.0]


def test_saved_tensors_hooks_warn_for_builtin_ops():
    x = tapegrad.tensor([1.0, 3.0], requires_grad=True)
    with pytest.warns(UserWarning, match="built-in ops"):
        with tapegrad.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = (x * x).sum()
    assert tapegrad.autograd.grad(y, x)[0].tolist() == [2.0, 6.0]


# -- in-place changes under no_grad keep a non-leaf's history (torch) ---------------------------


@pytest.mark.parametrize("value", [[1.0, 2.0], 1.5])
@pytest.mark.parametrize("change", [lambda t: t.mul_(2), lambda t: t.__setitem__(..., 5.0),
                                    lambda t: t.zero_(), lambda t: t.add_(t * 0 + 1)],
                         ids=["mul_", "setitem", "zero_", "add_"])
def test_no_grad_inplace_on_non_leaf_like_torch(value, change):
    res = []
    for M in (torch, tapegrad):
        a = M.tensor(value, requires_grad=True)
        y = a * 2
        y.retain_grad()
        with M.no_grad():
            change(y)
        (g1,) = M.autograd.grad((y * 3).sum(), a, retain_graph=True)
        (y * y + a).sum().backward()
        res.append((_tl(y), y.is_leaf, y.grad_fn.name(), _tl(g1), _tl(a.grad), _tl(y.grad)))
    assert res[0] == res[1]


def test_grad_fn_is_the_same_object_like_torch():
    res = []
    for M in (torch, tapegrad):
        x = M.tensor([1.0, 2.0], requires_grad=True)
        a = x * 2
        y = a.sin()
        res.append((y.grad_fn is y.grad_fn, y.grad_fn.next_functions[0][0] is a.grad_fn,
                    y.grad_fn is a.grad_fn, len({y.grad_fn, y.grad_fn, a.grad_fn})))
    assert res[1] == res[0] == (True, True, False, 2)


def test_mse_loss_of_other_shapes_warns_and_broadcasts_as_torch():
    a = np.linspace(-1, 1, 6).reshape(2, 3)
    b = np.array([0.5, -0.25, 2.0])
    out = []
    for M in (tapegrad, torch):
        x = M.tensor(a, dtype=M.float64, requires_grad=True)
        with pytest.warns(UserWarning, match="different to the input size"):
            y = M.nn.functional.mse_loss(x, M.tensor(b, dtype=M.float64))
        out.append((y.item(), M.autograd.grad(y, x)[0].tolist()))
        with pytest.raises(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            M.nn.functional.mse_loss(x, M.ones(4, dtype=M.float64))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-14)
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-14)


def test_composite_functions_that_raise_leave_the_tape_as_it_was():
    # the check that fails needs a value computed part way: what was recorded is dropped
    from tapegrad.tape import STATE
    x = tapegrad.tensor(np.arange(6.).reshape(2, 3), requires_grad=True)
    y = (x * 2).sum()
    n = len(STATE.tape().vals)
    with pytest.raises(IndexError):
        tapegrad.nn.functional.cross_entropy(x, tapegrad.tensor([5, 0]))
    with pytest.raises(RuntimeError):
        tapegrad.repeat_interleave(x, -1)
    assert len(STATE.tape().vals) == n
    assert tapegrad.autograd.grad(y, x)[0].tolist() == [[2.0] * 3] * 2
