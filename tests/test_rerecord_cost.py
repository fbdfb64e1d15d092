"""The create_graph sweep's per-rule cost (issue 18): rules that read only shapes get the
values, a one-input rule call records directly, a tape a create_graph sweep grew reuses its
converted rows. Each keeps torch's numbers (second derivatives against torch)."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import tape as tape_mod
from tapegrad.interpreters import cpu

torch = pytest.importorskip("torch")


def _kmeans(M, C, P):
    diff = P[None, :, :] - C[:, :, None]
    return M.sum(M.min(M.sum(diff * diff, 1), 0).values)


def _direction(M, C0, P0):
    C = M.tensor(C0, dtype=M.float64, requires_grad=True)
    P = M.tensor(P0, dtype=M.float64)
    J = M.autograd.grad(_kmeans(M, C, P), (C,), create_graph=True)[0]
    H = M.autograd.grad(J, (C,), grad_outputs=(M.ones_like(J),))[0]
    return J.detach().numpy(), H.numpy()


@pytest.mark.parametrize("n", [16, 700])
def test_kmeans_second_order_is_torchs(n):
    rng = np.random.default_rng(n)
    P0, C0 = rng.normal(size=(8, n)), rng.normal(size=(10, 8))
    for _ in range(3):  # the later calls reuse the grown tape's rows (seen_rows)
        J, H = _direction(tg, C0, P0)
        Jt, Ht = _direction(torch, C0, P0)
        np.testing.assert_allclose(J, Jt, rtol=1e-13, atol=1e-12)
        np.testing.assert_array_equal(H, Ht)


def test_shape_only_rules_get_values_not_tensors(monkeypatch):
    """A rule of an op that saves nothing (sum, getitem, reshape, expand) reads its inputs'
    shapes only: it is given the values, no tensor is built for them; an op that saves its
    inputs (matmul) still gets tensors. The second derivatives are torch's."""
    from tapegrad.autograd._tensor_backend import TensorF
    seen = {}
    for name in ("sum", "getitem", "reshape", "expand", "matmul"):
        op = tg.ops.BY_NAME[name]
        real = op.vjp
        monkeypatch.setattr(op, "vjp", lambda F, g, v, out, aux, real=real, name=name: (
            F is TensorF and seen.setdefault(name, set()).update(type(x).__name__ for x in v),
            real(F, g, v, out, aux))[1])
    x0 = np.linspace(-1.0, 1.0, 6)
    res = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        w = M.tensor(np.array([0.5, -1.0]))
        y = ((M.exp(x.reshape(2, 3)[:, 1:]) @ w)[None, :, None]
             * x.reshape(2, 3)[None, :, 1:].expand(4, 2, 2)).sum()
        (g,) = M.autograd.grad(y, x, create_graph=True)
        (h,) = M.autograd.grad((g * g).sum(), x)
        res.append((g.detach().numpy(), h.numpy()))
    np.testing.assert_allclose(res[0][0], res[1][0], rtol=1e-14)
    np.testing.assert_allclose(res[0][1], res[1][1], rtol=1e-14)
    for name in ("sum", "getitem", "reshape", "expand"):
        assert "Tensor" not in seen[name], (name, seen[name])
    assert seen["matmul"] == {"Tensor"}


def test_shape_only_rules_under_a_trace_get_tensors(monkeypatch):
    """While tracing, rules keep tensors (the trace follows every value)."""
    kinds = []
    op = tg.ops.BY_NAME["sum"]
    real = op.vjp
    monkeypatch.setattr(op, "vjp", lambda F, g, v, out, aux: (
        kinds.extend(type(x).__name__ for x in v), real(F, g, v, out, aux))[1])

    def f(x):
        (g,) = tg.autograd.grad((x * x).sum(), x, create_graph=True)
        return (g * x).sum()
    x0 = np.array([1.0, -2.0, 3.0])
    prog = tg.trace(f, x0)
    assert kinds and set(kinds) == {"Tensor"}
    np.testing.assert_allclose(prog(x0), 2 * (x0 * x0).sum())


def test_one_input_rule_call_records_directly():
    """getitem's rule (index_scatter on one tensor) records through the direct entry: the
    gradient is recorded, a constant gradient is not, and both are torch's."""
    x0 = np.arange(12.0).reshape(3, 4) / 7
    res = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        y = (x[1:, ::2] ** 3).sum() + x[0].sum()
        (g,) = M.autograd.grad(y, x, create_graph=True)
        (h,) = M.autograd.grad(g[1:, ::2].sum() + g[0, 0], x)
        res.append((g.detach().numpy(), h.numpy()))
    np.testing.assert_allclose(res[0][0], res[1][0], rtol=1e-14)
    np.testing.assert_array_equal(res[0][1], res[1][1])
    F = rerecord_backend()
    c = tg.tensor(np.ones((2, 2)))
    r = F.index_scatter(c, ((slice(0, 2), slice(1, 3)), (3, 4), True))
    assert not r.requires_grad and r.numpy().sum() == 4.0


def rerecord_backend():
    from tapegrad.autograd._tensor_backend import TensorF
    return TensorF


def test_grown_tape_rows_are_its_own(monkeypatch):
    """The rows of a tape a create_graph sweep grew come from seen_rows (the whole matrix,
    reused while the program is the same) and are the tape's own: equal to converting its
    code, also when a zero constant's sign differs from the tape seen before."""
    used = []
    real = cpu.seen_rows
    monkeypatch.setattr(cpu, "seen_rows", lambda code, n: used.append(n) or real(code, n))
    for zero in (0.0, -0.0, 0.0):
        x = tg.tensor(np.array([0.5, 2.0, -1.5]), requires_grad=True)
        y = (tg.exp(x) * x).sum() + tg.tensor(1.0) * zero
        z = x.sum() * 0.0 + (x * 1.0).sum()
        (g,) = tg.autograd.grad(y + (x * x * zero).sum() + z, x, create_graph=True)
        tape = g._tape
        s = g.sum()
        n = len(tape.vals)
        assert tape._cache is not None and tape._cache[0] < n  # grown since converted
        graph = cpu.Graph([tape])
        want = tape_mod.code_rows(tape.code, 0, n)
        assert graph.rows.shape == want.shape
        assert np.array_equal(graph.rows.view(np.int64), want.view(np.int64))
        (h,) = tg.autograd.grad(s, x)
        xd = x.detach().numpy()
        np.testing.assert_allclose(h.numpy(), np.exp(xd) * (2 + xd), rtol=1e-14)
    assert used


def test_square_rule_takes_the_rows_pass(monkeypatch):
    """x * x's recorded rule under a large expanded constant gradient (kmeans' g * diff)
    computes g*x + g*x by the compiled rows pass's MUL2 (NumPy's bits): torch's values."""
    from tapegrad.autograd import _tensor_backend
    from tapegrad.ops._kernels import MUL2
    calls = []
    real = _tensor_backend._rows_op
    monkeypatch.setattr(_tensor_backend, "_rows_op",
                        lambda *a: calls.append(a[0]) or real(*a))
    rng = np.random.default_rng(5)
    P0, C0 = rng.normal(size=(8, 400)), rng.normal(size=(10, 8))
    C = tg.tensor(C0, requires_grad=True)
    y = _kmeans(tg, C, tg.tensor(P0))
    (J,) = tg.autograd.grad(y, C, create_graph=True)
    assert calls == [MUL2]  # the rule's g * diff, doubled in the pass
    (H,) = tg.autograd.grad(J, C, grad_outputs=tg.ones_like(J))
    Jt, Ht = _direction(torch, C0, P0)
    np.testing.assert_allclose(J.detach().numpy(), Jt, rtol=1e-13, atol=1e-12)
    np.testing.assert_array_equal(H.numpy(), Ht)


def _entries(tape):
    return [tg.ops.OPS[int(c) & ~tg.ops.ARRAY].name for c in tape.code[0::5]]


@pytest.mark.parametrize("shape", [(3, 5), (6, 4, 700)])
def test_square_under_a_constant_gradient_is_one_entry(shape):
    """x * x under a constant gradient g records one entry, mul(2g, x), not g * x and an
    add: its value has the bits of g*x + g*x (the sweep's, torch's), and its derivatives
    of every order are torch's (the second backward's h * 2g rounds 2hg as (h + h) * g)."""
    rng = np.random.default_rng(len(shape))
    x0 = rng.normal(size=shape)
    w0 = rng.normal(size=shape[:-2] + (1,) + shape[-1:])  # (broadcast: g expanded)
    res = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        w = M.tensor(w0)
        (J,) = M.autograd.grad((w * (x * x)).sum(), x, create_graph=True)
        if M is tg:
            names = _entries(J._tape)
            assert names.count("add") == 0 and names.count("mul") == 3, names
        z = (M.sin(J) * J).sum()
        (H,) = M.autograd.grad(z, x, create_graph=True)
        (T3,) = M.autograd.grad((H * H).sum(), x)
        res.append([J.detach().numpy(), H.detach().numpy(), T3.numpy()])
    g = np.broadcast_to(w0, shape)
    np.testing.assert_array_equal(res[0][0], g * x0 + g * x0)
    np.testing.assert_array_equal(res[0][0], res[1][0])
    np.testing.assert_allclose(res[0][1], res[1][1], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(res[0][2], res[1][2], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("big", [1e308, np.inf, np.nan])
def test_square_under_a_gradient_whose_double_overflows_is_torchs(big):
    """A constant gradient with a number whose double overflows (or is inf or NaN) takes
    the two entries: g*0 + g*0 is 0 where 2g * 0 would be NaN. Torch's numbers, second
    derivative too."""
    x0 = np.array([0.0, 1.5, -2.0, 0.0])
    w0 = np.array([big, 1.0, 2.0, -3.0])
    res = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        (J,) = M.autograd.grad((M.tensor(w0) * (x * x)).sum(), x, create_graph=True)
        (H,) = M.autograd.grad(J, x, grad_outputs=M.tensor(np.array([0.0, 1.0, 2.0, 0.5])))
        res.append((J.detach().numpy(), H.numpy()))
    np.testing.assert_array_equal(res[0][0], res[1][0])
    np.testing.assert_array_equal(res[0][1], res[1][1])


def test_square_under_a_gradient_that_requires_grad_is_differentiable_in_it():
    """A gradient that requires grad (grad_outputs a leaf: a Hessian-vector product's
    vector) keeps g * x recorded with g an input: derivatives in g are torch's."""
    x0, v0 = np.array([0.5, -1.0, 2.0]), np.array([1.0, 3.0, -0.5])
    res = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        v = M.tensor(v0, requires_grad=True)
        (J,) = M.autograd.grad(x * x, x, grad_outputs=v, create_graph=True)
        gx, gv = M.autograd.grad((J * J).sum(), (x, v))
        res.append((J.detach().numpy(), gx.numpy(), gv.numpy()))
    for a, b in zip(*res):
        np.testing.assert_array_equal(a, b)


#: what x op w's create_graph rule records (w a constant), by (op, x on the left): only
#: x's side (before: w's too, as neg, mul or neg/mul/div entries nobody read)
_ONE_SIDE = {("add", True): [], ("add", False): [], ("sub", True): [],
             ("sub", False): ["neg"], ("mul", True): ["const", "mul"],
             ("mul", False): ["const", "mul"], ("div", True): ["const", "div"],
             ("div", False): ["neg", "const", "div", "div", "mul"]}  # -g ((w / y) / y), torch's


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_rule_with_a_constant_records_only_the_read_side(op):
    """x op w with w a constant: the create_graph rule records x's side only (w's side, a
    product or quotient nobody reads, was an entry and a pass); every order is torch's."""
    import operator
    f = getattr(operator, "truediv" if op == "div" else op)
    x0, w0 = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -3.0]]), np.array([2.0, -0.5, 3.0])
    res = []
    for M in (tg, torch):
        for left in (True, False):
            x = M.tensor(x0, requires_grad=True)
            w = M.tensor(w0)
            y = M.sin(x)
            (J,) = M.autograd.grad((f(y, w) if left else f(w, y)).sum() ** 2, x,
                                   create_graph=True)
            if M is tg:
                names = _entries(J._tape)
                names = names[len(names) - names[::-1].index("leaf") - 1:]  # this call's
                rule = names[names.index("expand") + 1:names.index("cos")]
                assert rule == _ONE_SIDE[op, left], names
            (H,) = M.autograd.grad((J * J).sum(), x)
            res.append((J.detach().numpy(), H.numpy()))
    for a, b in zip(res[:2], res[2:]):
        np.testing.assert_allclose(a[0], b[0], rtol=1e-15)
        np.testing.assert_allclose(a[1], b[1], rtol=1e-14)


def test_max_min_over_a_dim_rule_gets_values(monkeypatch):
    """max/min over a dim save only their indices: the create_graph rule is given the
    values; over everything (ties read the input and the result) it gets tensors."""
    from tapegrad.autograd._tensor_backend import TensorF
    kinds = {}
    for name in ("amin", "amax"):
        op = tg.ops.BY_NAME[name]
        real = op.vjp
        monkeypatch.setattr(op, "vjp", lambda F, g, v, out, aux, real=real: (
            F is TensorF and kinds.setdefault(isinstance(aux[2], (str, type(None))), set())
            .update(type(x).__name__ for x in v + [out]), real(F, g, v, out, aux))[1])
    x0 = np.array([[1.0, 3.0, 2.0], [0.5, -1.0, 4.0]])
    res = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        y = (M.min(x * x, 0).values * x[0]).sum() + M.max(x * x)
        (g,) = M.autograd.grad(y, x, create_graph=True)
        (h,) = M.autograd.grad((g * g).sum(), x)
        res.append((g.detach().numpy(), h.numpy()))
    np.testing.assert_allclose(res[0][0], res[1][0], rtol=1e-14)
    np.testing.assert_allclose(res[0][1], res[1][1], rtol=1e-14)
    assert "Tensor" not in kinds[False] and kinds[True] == {"Tensor"}


def test_array_rules_read_shapes_without_numpy_dispatch(monkeypatch):
    """The array rules read shapes and ranks by ``_shape``/``_ndim`` (np.shape's own steps
    without its dispatch, a microsecond a call on a tensor): the same objects np.shape and
    np.ndim give, and a kmeans create_graph sweep calls neither NumPy function."""
    from tapegrad.ops import arrays
    t = tg.tensor(np.ones((2, 3)))
    for x in (1.5, 3, [1.0, 2.0], [[1], [2]], np.float64(2.0), np.zeros((4, 1)), t,
              tg.tensor(2.0)):
        assert arrays._shape(x) == np.shape(x) and type(arrays._shape(x)) is \
            type(np.shape(x))
        assert arrays._ndim(x) == np.ndim(x)
    rng = np.random.default_rng(3)
    P0, C0 = rng.normal(size=(8, 16)), rng.normal(size=(10, 8))
    Jt, Ht = _direction(torch, C0, P0)
    before = _direction(tg, C0, P0)  # (also compiles before NumPy's functions go)

    def boom(*a, **k):
        raise AssertionError("np.shape/np.ndim called in an array rule")
    monkeypatch.setattr(np, "shape", boom)
    monkeypatch.setattr(np, "ndim", boom)
    got = _direction(tg, C0, P0)
    monkeypatch.undo()
    for g, w in zip(got, before):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_allclose(got[0], Jt, rtol=1e-13, atol=1e-12)
    np.testing.assert_array_equal(got[1], Ht)


def test_node_hooks_see_every_gradient_of_the_fused_rules():
    """A node post-hook (grad_inputs, grad_outputs) on x * x and on x * w (w a constant)
    under create_graph sees one gradient per input, as torch's: the one-entry forms (x * x
    under a constant gradient, the read side only) stay out of the hooked sweep."""
    x0, w0 = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -3.0]]), np.array([2.0, -0.5, 3.0])
    res = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        w = M.tensor(w0)
        sq, xw = x * x, x * w
        seen = []
        for node in (sq.grad_fn, xw.grad_fn):
            node.register_hook(lambda gi, go: seen.append(
                [None if t is None else t.detach().numpy().copy() for t in gi]))
        (J,) = M.autograd.grad((sq + xw).sum(), x, create_graph=True)
        (H,) = M.autograd.grad((J * J).sum(), x)
        res.append((seen, J.detach().numpy(), H.numpy()))
    (seen, J, H), (seen_t, Jt, Ht) = res
    assert [len(s) for s in seen] == [len(s) for s in seen_t] == [2, 2]
    for s, st in zip(seen, seen_t):
        for a, b in zip(s, st):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(J, Jt)
    np.testing.assert_allclose(H, Ht, rtol=1e-15)
