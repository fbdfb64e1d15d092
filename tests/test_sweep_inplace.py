"""The array sweep writes adjoints in place and hands owned ones out without a copy: no
result, .grad, retained gradient or hook argument may share memory with another, or change
after it was handed out; each against torch."""
import numpy as np
import pytest

import tapegrad
from tapegrad.autograd import paths

torch = pytest.importorskip("torch")

N = 5000  # past the sweep's large-array thresholds (4096), under the flat path's limit
PATHS = ("sweep", "fused")


def _x0(seed=0):
    return np.random.default_rng(seed).uniform(-1.0, 1.0, N)


def _rosen(M, x):
    return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


def _torch_grad(f, *x0):
    xs = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in x0]
    return [g.numpy() for g in torch.autograd.grad(f(torch, *xs), xs)]


def _arr(t):
    return t._d if isinstance(t._d, np.ndarray) else np.asarray(t._d)


def _independent(*ts):
    arrs = [_arr(t) for t in ts]
    for i, a in enumerate(arrs):
        assert a.flags.writeable
        for b in arrs[i + 1:]:
            assert not np.shares_memory(a, b)


@pytest.mark.parametrize("path", PATHS)
def test_grad_twice_with_retain_graph_results_do_not_alias(path):
    x = tapegrad.tensor(_x0(), requires_grad=True)
    y = _rosen(tapegrad, x)
    with paths.force(path):
        (g1,) = tapegrad.autograd.grad(y, x, retain_graph=True)
        assert paths.last() == path
        want = g1.numpy().copy()
        if path == "sweep":  # (an in-place op makes the one-call paths decline)
            g1.mul_(0.0)  # the caller owns its result: the second sweep must not see this
        (g2,) = tapegrad.autograd.grad(y, x)
        assert paths.last() == path
    g1.mul_(0.0)  # nor may the second result see it
    np.testing.assert_allclose(g2.numpy(), _torch_grad(_rosen, _x0())[0], rtol=1e-12)
    np.testing.assert_array_equal(g2.numpy(), want)
    _independent(g1, g2)


@pytest.mark.parametrize("path", PATHS)
def test_same_input_twice_gets_two_arrays(path):
    x = tapegrad.tensor(_x0(), requires_grad=True)
    with paths.force(path):
        g1, g2 = tapegrad.autograd.grad(_rosen(tapegrad, x), (x, x))
    _independent(g1, g2)
    np.testing.assert_array_equal(g1.numpy(), g2.numpy())
    g1.add_(1.0)
    assert not np.array_equal(g1.numpy(), g2.numpy())


def _shared(M, x, w):
    """x used three times (an owned adjoint added into in place), w twice, x * x."""
    u = x * w
    return (u * u + x * x + (x + x) * w + u.exp()).sum()


@pytest.mark.parametrize("path", PATHS)
def test_inputs_used_several_times_against_torch(path):
    x0, w0 = _x0(1), _x0(2)
    x = tapegrad.tensor(x0, requires_grad=True)
    w = tapegrad.tensor(w0, requires_grad=True)
    with paths.force(path):
        gx, gw = tapegrad.autograd.grad(_shared(tapegrad, x, w), (x, w))
    tx, tw = _torch_grad(_shared, x0, w0)
    np.testing.assert_allclose(gx.numpy(), tx, rtol=1e-12)
    np.testing.assert_allclose(gw.numpy(), tw, rtol=1e-12)
    _independent(gx, gw, x, w)


@pytest.mark.parametrize("path", PATHS)
def test_a_sums_broadcast_gradient_is_a_writable_copy(path):
    x = tapegrad.tensor(_x0(), requires_grad=True)
    with paths.force(path):
        (g,) = tapegrad.autograd.grad((x + x).sum(), x)
        (h,) = tapegrad.autograd.grad(x.sum(), x)
    _independent(g, h, x)
    np.testing.assert_array_equal(g.numpy(), np.full(N, 2.0))
    np.testing.assert_array_equal(h.numpy(), np.ones(N))


@pytest.mark.parametrize("path", PATHS)
def test_backward_twice_accumulates_into_grad_without_aliasing(path):
    x = tapegrad.tensor(_x0(), requires_grad=True)
    y = _rosen(tapegrad, x)
    y.backward(retain_graph=True)  # (backward() takes the general sweep)
    first = x.grad
    first_values = first.numpy().copy()
    with paths.force(path):
        (g,) = tapegrad.autograd.grad(y, x, retain_graph=True)
    y.backward()
    assert x.grad is first  # accumulated in place, as torch does
    np.testing.assert_allclose(x.grad.numpy(), 2 * first_values, rtol=1e-15)
    np.testing.assert_array_equal(g.numpy(), first_values)
    _independent(g, x.grad)


def _hooked(M, x, log):
    a = x[:-1] * 3.0
    b = a * a
    a.register_hook(lambda g: log.append(g))  # keeps what it was passed
    b.register_hook(lambda g: log.append(g))
    a.retain_grad()
    return (b + a).sum(), a


def test_hook_arguments_and_retained_grads_are_not_written_later():
    x0 = _x0(3)
    log, tlog = [], []
    x = tapegrad.tensor(x0, requires_grad=True)
    y, a = _hooked(tapegrad, x, log)
    (g,) = tapegrad.autograd.grad(y, x)
    tx = torch.tensor(x0, requires_grad=True)
    ty, ta = _hooked(torch, tx, tlog)
    (tg,) = torch.autograd.grad(ty, tx)
    np.testing.assert_allclose(g.numpy(), tg.numpy(), rtol=1e-12)
    assert len(log) == len(tlog) == 2
    for mine, theirs in zip(log, tlog):
        np.testing.assert_allclose(mine.numpy(), theirs.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(a.grad.numpy(), ta.grad.numpy(), rtol=1e-12)
    _independent(g, a.grad, *log)
