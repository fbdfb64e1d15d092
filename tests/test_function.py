"""tapegrad.autograd.Function against torch.autograd.Function."""
import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")


def make(M):
    class Sq(M.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.save_for_backward(x)
            ctx.k = k
            ctx.seen = ctx.needs_input_grad
            return x * x * k, x + 1

        @staticmethod
        def backward(ctx, g1, g2):
            (x,) = ctx.saved_tensors
            return g1 * 2 * x * ctx.k + g2, None

    class ExpSavesOutput(M.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x.exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * y

    return Sq, ExpSavesOutput


def leaf(M, v):
    return M.tensor(v, dtype=M.float64, requires_grad=True)


def np_(t):
    return t.detach().numpy()


def test_forward_backward_and_double_backward_match_torch():
    res = []
    for M in (tg, torch):
        Sq, Exp = make(M)
        x = leaf(M, [1.0, -2.0, 0.5])
        a, b = Sq.apply(x, 3.0)
        y = (a * b).sum() + Exp.apply(x * 0.5).sum()
        (g,) = M.autograd.grad(y, x, create_graph=True)
        (h,) = M.autograd.grad((g * g).sum(), x)
        res.append((np_(a), np_(b), np_(g), np_(h)))
    for u, v in zip(*res):
        np.testing.assert_allclose(u, v, rtol=1e-12)


def test_scalar_path_mixes_with_the_compiled_sweep():
    res = []
    for M in (tg, torch):
        Sq, Exp = make(M)
        s = leaf(M, 1.5)
        y = M.sin(Sq.apply(s * 2.0, 2.0)[0]) * s + Exp.apply(s)
        res.append(M.autograd.grad(y, s)[0].item())
    np.testing.assert_allclose(res[0], res[1], rtol=1e-12)


def test_ctx_needs_input_grad_and_non_tensor_args():
    Sq, _ = make(tg)
    x = leaf(tg, [1.0])
    Sq.apply(x, 2.0)[0].sum().backward()
    assert x.grad.tolist() == [4.0 + 0.0]


def test_mark_non_differentiable_and_once_differentiable():
    for M in (tg, torch):
        class SortLike(M.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                idx = M.tensor([1, 0])
                ctx.mark_non_differentiable(idx)
                return x * 2.0, idx

            @staticmethod
            @M.autograd.function.once_differentiable if M is torch else \
                tg.autograd.once_differentiable
            def backward(ctx, g, gi):
                return g * 2.0

        x = leaf(M, [1.0, 2.0])
        y, idx = SortLike.apply(x)
        assert not idx.requires_grad and y.requires_grad
        (g,) = M.autograd.grad(y.sum(), x, create_graph=True)
        np.testing.assert_allclose(np_(g), [2.0, 2.0])
        assert not g.requires_grad


def test_setup_context_style():
    for M in (tg, torch):
        class Cube(M.autograd.Function):
            @staticmethod
            def forward(x):
                return x ** 3

            @staticmethod
            def setup_context(ctx, inputs, output):
                ctx.save_for_backward(inputs[0])

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 3.0 * x * x * g

        x = leaf(M, [1.0, 2.0])
        np.testing.assert_allclose(np_(M.autograd.grad(Cube.apply(x).sum(), x)[0]),
                                   [3.0, 12.0])


def test_errors_like_torch():
    for M in (tg, torch):
        class Bad(M.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2.0

            @staticmethod
            def backward(ctx, g):
                return g, g

        x = leaf(M, [1.0])
        with pytest.raises(RuntimeError, match="incorrect number of gradients"):
            Bad.apply(x).sum().backward()
        _, Exp = make(M)
        y = Exp.apply(x).sum()
        y.backward()
        with pytest.raises(RuntimeError):
            y.backward()  # its saved values were freed


def test_no_recording_without_grad():
    Sq, _ = make(tg)
    x = tg.tensor([1.0, 2.0])
    a, b = Sq.apply(x, 1.0)
    assert not a.requires_grad and a.grad_fn is None
