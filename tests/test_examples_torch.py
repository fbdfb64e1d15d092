"""Examples of each torch.autograd API pattern, written once and run with ``M = torch`` and
``M = tapegrad``: the printed output and the numbers must agree."""
import contextlib
import io

import numpy as np
import pytest

import tapegrad

torch = pytest.importorskip("torch")


def ex_grad_basic(M):
    a = M.tensor([0.5, 1.5, -2.0], requires_grad=True)
    b = M.tensor(0.25, requires_grad=True)
    out = (a.tanh() * b).sum() + b ** 3
    ga, gb = M.autograd.grad(out, (a, b))
    print(ga, gb)


def ex_backward_accumulates(M):
    p = M.tensor([[1.0, -1.0], [2.0, 0.5]], requires_grad=True)
    for _ in range(2):
        (p @ p).trace() if hasattr(p, "trace") else None
        loss = (p.exp() * p).mean()
        loss.backward()
    print(p.grad, p.grad.shape)


def ex_retain_graph_twice(M):
    s = M.tensor(0.75, requires_grad=True)
    y = s.sin() * s
    y.backward(retain_graph=True)
    first = s.grad.clone()
    y.backward()
    print(first, s.grad)


def ex_create_graph_hvp(M):
    v = M.tensor([1.0, 2.0, 3.0], requires_grad=True)
    f = (v ** 3).sum() + v.prod()
    (g,) = M.autograd.grad(f, v, create_graph=True)
    (h,) = M.autograd.grad(g @ M.tensor([1.0, 0.0, -1.0]), v)
    print(g, h)


def ex_no_grad_and_modes(M):
    q = M.tensor([2.0, 3.0], requires_grad=True)
    with M.no_grad():
        r = q * 2
    print(r.requires_grad, M.is_grad_enabled())

    @M.no_grad()
    def halve(t):
        return t / 2
    print(halve(q).requires_grad)
    with M.set_grad_enabled(False):
        print((q + 1).requires_grad)
    with M.enable_grad():
        print((q + 1).grad_fn.name())


def ex_printing(M):
    t = M.tensor([[0.1234567, 2.0], [3.0, 4.5]], requires_grad=True)
    print(t)
    print(t.shape, t.size(), t.shape[1:], t.T.shape)
    print(t.sum(1), t.sum(), t.view(4), t.reshape(2, 2)[0].squeeze(0))
    print(t * 2, 3 - t, t[0] > 1)
    print(M.tensor(2.145), M.tensor([2.5, 5.0]), M.tensor([1e-6, 1.0, 1e6]))
    print(M.tensor([True, False]), M.tensor([1, 2, 3]), M.tensor([], dtype=M.float32))


def ex_custom_function(M):
    class Clip(M.autograd.Function):
        @staticmethod
        def forward(ctx, x, lo, hi):
            ctx.save_for_backward(x)
            ctx.lo, ctx.hi = lo, hi
            return x.clamp(lo, hi)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            inside = ((x >= ctx.lo) & (x <= ctx.hi)).to(g.dtype)
            return g * inside, None, None
    x = M.tensor([-2.0, 0.5, 3.0], requires_grad=True)
    y = Clip.apply(x, -1.0, 1.0)
    print(y, y.grad_fn.name())
    y.sum().backward()
    print(x.grad)


def ex_function_setup_context(M):
    class Mul(M.autograd.Function):
        @staticmethod
        def forward(a, b):
            return a * b

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g * b, g * a
    a = M.tensor([1.0, 2.0], requires_grad=True)
    b = M.tensor([3.0, -1.0], requires_grad=True)
    print(M.autograd.grad(Mul.apply(a, b).sum(), (a, b)))


def ex_function_numpy_forward(M):
    class Sorted(M.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            order = np.argsort(x.numpy())
            ctx.order = order
            return M.tensor(x.numpy()[order])

        @staticmethod
        def backward(ctx, g):
            out = M.zeros(g.shape)
            out[M.tensor(ctx.order)] = g
            return out
    x = M.tensor([3.0, 1.0, 2.0], requires_grad=True)
    y = Sorted.apply(x)
    (y * M.tensor([1.0, 10.0, 100.0])).sum().backward()
    print(y, x.grad)


def ex_mark_dirty(M):
    class AddOneInPlace(M.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.add_(1.0)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g
    a = M.tensor([1.0, 2.0], requires_grad=True)
    b = a * 2
    c = AddOneInPlace.apply(b)
    print(c is b, c)
    (c * c).sum().backward()
    print(a.grad)


def ex_graph_nodes(M):
    x = M.tensor([1.0, 2.0], requires_grad=True)
    y = (x.exp() * 3).sum()
    node = y.grad_fn
    print(isinstance(node, M.autograd.graph.Node), node.name())
    while node is not None and node.next_functions:
        nxt = node.next_functions[0][0]
        print(nxt.name() if nxt is not None else None)
        node = nxt if nxt is not None and nxt.next_functions else None
    e = x.exp()
    print(M.equal(e.grad_fn._saved_result, e))


def ex_tensor_hooks(M):
    w = M.tensor([1.0, -4.0, 0.5], requires_grad=True)
    seen = []
    w.register_hook(lambda g: seen.append(g.clone()))
    handle = w.register_hook(lambda g: g.clamp(-1.0, 1.0))
    ((w - 2.0) ** 2).sum().backward()
    print(w.grad, seen)
    handle.remove()
    w.grad = None
    ((w - 2.0) ** 2).sum().backward()
    print(w.grad, len(seen))


def ex_node_hooks(M):
    a = M.tensor([1.0, 2.0], requires_grad=True)
    b = a * a
    b.grad_fn.register_prehook(lambda gos: (gos[0] * 10,))
    b.grad_fn.register_hook(lambda gis, gos: print("post", gis, gos))
    b.sum().backward()
    print(a.grad)


def ex_post_accumulate_sgd(M):
    lr = 0.1
    p = M.tensor([1.0, 2.0], requires_grad=True)
    p.register_post_accumulate_grad_hook(lambda t: t.data.sub_(lr * t.grad) if False else
                                         print("accumulated", t.grad))
    (p * p).sum().backward()


def ex_retain_grad(M):
    x = M.tensor([1.0, 3.0], requires_grad=True)
    h = x * x
    h.retain_grad()
    h.register_hook(lambda g: g * 2)
    h.sum().backward()
    print(h.grad, x.grad, h.retains_grad)


def ex_saved_tensors_hooks(M):
    count = []

    class Exp(M.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x.exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * y
    x = M.tensor([0.0, 1.0], requires_grad=True)
    with M.autograd.graph.saved_tensors_hooks(lambda t: count.append("p") or t,
                                              lambda t: count.append("u") or t):
        y = Exp.apply(x)
    y.sum().backward()
    print(x.grad, count)


def ex_optimization_loop(M):
    F = M.nn.functional
    M.manual_seed(0)
    X = M.tensor(np.linspace(-2, 2, 12).reshape(6, 2))
    labels = M.tensor([0, 1, 2, 1, 0, 2])
    W = M.nn.Parameter(M.tensor(np.full((2, 3), 0.1)))
    bias = M.nn.Parameter(M.zeros(3))
    for step in range(5):
        logits = X @ W + bias
        loss = F.cross_entropy(logits, labels) + 0.01 * F.mse_loss(W, M.zeros(2, 3))
        W.grad = None
        bias.grad = None
        loss.backward()
        with M.no_grad():
            W -= 0.5 * W.grad
            bias -= 0.5 * bias.grad
    print(loss, W)


def ex_binary_logits(M):
    F = M.nn.functional
    z = M.tensor([-3.0, 0.0, 2.5, 40.0], requires_grad=True)
    t = M.tensor([0.0, 1.0, 1.0, 0.0])
    loss = F.binary_cross_entropy_with_logits(z, t, pos_weight=M.tensor(2.0))
    loss.backward()
    print(loss, z.grad, F.logsigmoid(z), F.softplus(z, beta=0.5))


def ex_sort_and_friends(M):
    v = M.tensor([[3.0, -1.0, 2.0], [0.5, 4.0, -2.0]], requires_grad=True)
    vals, idx = M.sort(v, dim=1, descending=True)
    top2 = vals[:, :2].sum()
    top2.backward()
    print(vals, idx, v.grad, M.argsort(v.detach(), dim=0))
    m = M.mm(v, v.T)
    print(m, M.equal(m, m.T))
    acc = M.zeros(3, 2)
    acc.index_add_(0, M.tensor([0, 2, 0]), M.ones(3, 2))
    print(acc)


def ex_functional_api(M):
    def f(x):
        return (x ** 2).sum() * x[0]
    x = M.tensor([1.0, 2.0])
    print(M.autograd.functional.jacobian(f, x), M.autograd.functional.hessian(f, x))


def ex_gradient_edge(M):
    x = M.tensor([1.0, 2.0], requires_grad=True)
    mid = x * 3
    out = (mid ** 2).sum()
    print(M.autograd.grad(out, M.autograd.graph.get_gradient_edge(mid)))


EXAMPLES = [v for k, v in dict(globals()).items() if k.startswith("ex_")]


def _run(ex, M):
    buf = io.StringIO()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # tapegrad's default floating dtype
    try:
        with contextlib.redirect_stdout(buf):
            ex(M)
    finally:
        torch.set_default_dtype(prev)
    return buf.getvalue().replace("torch.", "tapegrad.").replace("torch::autograd::", "")


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda f: f.__name__[3:])
def test_example_prints_the_same(ex):
    assert _run(ex, tapegrad) == _run(ex, torch)
