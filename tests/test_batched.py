"""is_grads_batched=True: one sweep for a batch of grad_outputs, against a loop of single
grad() calls and against torch."""
import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")

PROGRAMS = {
    "elementwise": lambda m, x: m.sin(x) * x ** 3 + m.exp(-x) / (1.0 + x * x),
    "broadcast": lambda m, x: x.reshape(2, 3) * x[:3] + x[3:].reshape(1, 3) ** 2,
    "matmul_1d": lambda m, x: m.tanh(m.tensor(np.arange(36.0).reshape(6, 6) / 36) @ x),
    "matmul_2d": lambda m, x: (x.reshape(2, 3) @ x.reshape(3, 2)).reshape(-1),
    "outer_dot": lambda m, x: m.outer(x[:2], x[2:5]).reshape(-1) * m.dot(x[:3], x[3:]),
    "reductions": lambda m, x: m.stack([x.sum(), x.mean(), x.prod(), x.max(), m.norm(x),
                                        m.logsumexp(x, 0), x.reshape(2, 3).sum(0)[1]]),
    "dim_reductions": lambda m, x: m.cat([x.reshape(2, 3).max(1).values,
                                          m.amin(x.reshape(2, 3), 0),
                                          m.softmax(x.reshape(2, 3), 1).reshape(-1),
                                          m.log_softmax(x, 0)]),
    "indexing": lambda m, x: m.cat([x[1:4] * x[[0, 0, 5]], x[x > 0.2] ** 2,
                                    x.reshape(2, 3).transpose(0, 1).reshape(-1),
                                    x.reshape(3, 2).permute(1, 0)[0]]),
    "where_clamp": lambda m, x: m.where(x > 0.0, x ** 2, m.sin(x)) + m.clamp(x, -0.2, 0.4),
    "diag": lambda m, x: m.cat([m.diag(x[:3], 1).reshape(-1) * 2.0,
                                m.diag(x.reshape(2, 3) * x[0], -1) + m.diag(x.reshape(3, 2))[0]]),
}


def x0():
    return np.random.default_rng(0).uniform(-1, 1, 6)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_batched_equals_a_loop_and_torch(name):
    fn = PROGRAMS[name]
    res = {}
    for m in (tg, torch):
        x = m.tensor(x0(), requires_grad=True)
        y = fn(m, x)
        V = np.random.default_rng(1).standard_normal((5,) + tuple(y.shape))
        (jb,) = m.autograd.grad(y, x, m.tensor(V), is_grads_batched=True, retain_graph=True)
        rows = [m.autograd.grad(y, x, m.tensor(V[i]), retain_graph=True)[0] for i in range(5)]
        np.testing.assert_allclose(jb.detach().numpy(), np.stack([r.detach().numpy()
                                                                  for r in rows]), rtol=1e-12,
                                   atol=1e-14)
        res[m.__name__] = jb.detach().numpy()
    np.testing.assert_allclose(res["tapegrad"], res["torch"], rtol=1e-12, atol=1e-14)


def test_scalar_path_multiple_outputs_and_inputs():
    res = []
    for m in (tg, torch):
        xs = [m.tensor(v, dtype=m.float64, requires_grad=True) for v in (0.3, -1.2, 0.7)]
        ys = [m.sin(xs[0]) * xs[1], xs[2] ** 2 + xs[0] * xs[2]]
        V = [m.tensor([1.0, 0.0, 2.0], dtype=m.float64),
             m.tensor([0.0, 1.0, -1.0], dtype=m.float64)]
        res.append([g.detach().numpy() for g in
                    m.autograd.grad(ys, xs, V, is_grads_batched=True)])
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-13)


def test_jacobian_of_a_vector_function():
    A = np.random.default_rng(2).standard_normal((8, 8)) / 8
    x = tg.tensor(np.random.default_rng(3).standard_normal(8), requires_grad=True)
    y = tg.tanh(tg.tensor(A) @ tg.tanh(tg.tensor(A) @ x))
    (J,) = tg.autograd.grad(y, x, tg.eye(8), is_grads_batched=True)
    xt = torch.tensor(x.detach().numpy(), requires_grad=True)
    Jt = torch.autograd.functional.jacobian(
        lambda t: torch.tanh(torch.tensor(A) @ torch.tanh(torch.tensor(A) @ t)), xt)
    np.testing.assert_allclose(J.numpy(), Jt.numpy(), rtol=1e-12)


def test_batched_errors():
    x = tg.tensor([0.5, 1.0], requires_grad=True)
    y = x * 2.0
    with pytest.raises(RuntimeError, match="first dimension of each grad_output"):
        tg.autograd.grad(y, x, tg.ones(2), is_grads_batched=True)
    with pytest.raises(RuntimeError, match="same batch"):
        tg.autograd.grad([y, x * 3.0], x, [tg.ones(3, 2), tg.ones(4, 2)],
                         is_grads_batched=True)
    with pytest.raises(RuntimeError):
        tg.autograd.grad(y, x, None, is_grads_batched=True)
    with pytest.raises(RuntimeError, match="first dimension of each grad_output"):
        tg.autograd.grad(y, x, tg.ones(2), is_grads_batched=True, create_graph=True)
    xt = torch.tensor([0.5, 1.0], requires_grad=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(xt * 2.0, xt, torch.ones(2), is_grads_batched=True)


EXTRA_CG = {
    "setitem": lambda m, x: _setitem(m, x),
    "expand_cast": lambda m, x: (x[:3].reshape(1, 3).expand(2, 3) * x[3:]).reshape(-1),
    "norm_dim": lambda m, x: m.norm(x.reshape(2, 3), dim=1) * m.amax(x.reshape(3, 2), 1)[:2],
}


def _setitem(m, x):
    y = x.clone() * 1.0
    y[1:3] = x[:2] ** 2
    return y * x


@pytest.mark.parametrize("name", sorted(PROGRAMS) + sorted(EXTRA_CG))
def test_batched_with_create_graph_against_torch(name):
    # is_grads_batched=True, create_graph=True: the batch of gradients is recorded, and its
    # own gradient (a weighted sum over the batch) matches torch
    fn = PROGRAMS.get(name) or EXTRA_CG[name]
    res = {}
    for m in (tg, torch):
        x = m.tensor(x0(), requires_grad=True)
        y = fn(m, x)
        V = np.random.default_rng(1).standard_normal((5,) + tuple(y.shape))
        W = np.random.default_rng(2).standard_normal((5, 6))
        (jb,) = m.autograd.grad(y, x, m.tensor(V), is_grads_batched=True, create_graph=True)
        obj = (jb * m.tensor(W)).sum() + (jb ** 2).sum() + (x ** 3).sum()
        (h,) = m.autograd.grad(obj, x)
        res[m.__name__] = (jb.detach().numpy(), h.numpy())
    np.testing.assert_allclose(res["tapegrad"][0], res["torch"][0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(res["tapegrad"][1], res["torch"][1], rtol=1e-12, atol=1e-13)


def test_batched_with_create_graph_scalar_path_and_third_order():
    res = []
    for m in (tg, torch):
        xs = [m.tensor(v, dtype=m.float64, requires_grad=True) for v in (0.3, -1.2, 0.7)]
        ys = [m.sin(xs[0]) * xs[1], xs[2] ** 2 + xs[0] * xs[2]]
        V = [m.tensor([1.0, 0.0, 2.0], dtype=m.float64),
             m.tensor([0.0, 1.0, -1.0], dtype=m.float64)]
        gs = m.autograd.grad(ys, xs, V, is_grads_batched=True, create_graph=True)
        h = m.autograd.grad((gs[0] * gs[1]).sum(), xs, create_graph=True)
        t = m.autograd.grad(h[0] * h[2], xs[0])
        res.append([g.detach().numpy() for g in gs + h + t])
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_every_array_op_batches():
    # the batched sweep runs each array op's rule once for the whole batch: none may lack it
    # (custom Functions and traced programs aside, whose rules are the user's or compiled)
    from tapegrad.ops import ARRAY_OP, OPS
    assert [op.name for op in OPS if op.kind == ARRAY_OP and op.batch is None] == ["function"]


def test_batched_with_create_graph_through_functions_says_so():
    class Sq(tg.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2.0 * x * g
    x = tg.tensor([0.5, 1.0], requires_grad=True)
    with pytest.raises(NotImplementedError, match="custom Function"):
        tg.autograd.grad(Sq.apply(x), x, tg.eye(2), is_grads_batched=True, create_graph=True)
