"""tapegrad.autograd.functional against torch.autograd.functional."""
import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")
F_TG, F_TH = tg.autograd.functional, torch.autograd.functional


def _np(x):
    if isinstance(x, (tuple, list)):
        return [_np(i) for i in x]
    if hasattr(x, "_is_zerotensor"):  # torch
        return np.zeros(tuple(x.shape)) if x._is_zerotensor() else x.detach().numpy()
    return x.detach().numpy()


def _same(a, b):
    if isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
        return
    np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def same(a, b):
    _same(_np(a), _np(b))


def f_vec(m, x, w):
    return m.tanh(w @ x) * x.sum()


def f_scalar(m, x, w):
    return (m.sin(w @ x) ** 2).sum() + (x ** 4).sum()


def inputs(m):
    rng = np.random.default_rng(3)
    mk = tg.tensor if m is tg else torch.tensor
    return mk(rng.uniform(-1, 1, 3)), mk(rng.uniform(-1, 1, (3, 3)))


def both(name, fn, *extra, **kw):
    out = []
    for m, F in ((tg, F_TG), (torch, F_TH)):
        xs = inputs(m)
        mk = tg.tensor if m is tg else torch.tensor
        ex = [tuple(mk(np.asarray(e)) for e in e_) if isinstance(e_, tuple) else
              mk(np.asarray(e_)) for e_ in extra]
        out.append(getattr(F, name)(lambda x, w: fn(m, x, w), xs, *ex, **kw))
    return out


def test_vjp_and_jvp():
    v = np.random.default_rng(1).standard_normal(3)
    a, b = both("vjp", f_vec, v)
    same(a, b)
    u = (np.random.default_rng(2).standard_normal(3),
         np.random.default_rng(4).standard_normal((3, 3)))
    a, b = both("jvp", f_vec, u)
    same(a, b)


def test_jacobian_and_hessian():
    a, b = both("jacobian", f_vec)
    same(a, b)
    a, b = both("hessian", f_scalar)
    same(a, b)


def test_hvp_and_vhp():
    u = (np.random.default_rng(5).standard_normal(3),
         np.random.default_rng(6).standard_normal((3, 3)))
    for name in ("hvp", "vhp"):
        a, b = both(name, f_scalar, u)
        same(a, b)


def test_single_tensor_input_and_create_graph():
    for m, F in ((tg, F_TG), (torch, F_TH)):
        x = m.tensor([0.5, -0.25], dtype=m.float64, requires_grad=True)
        j = F.jacobian(lambda t: t ** 3, x, create_graph=True)
        assert j.shape == (2, 2) and j.requires_grad
        h = F.hessian(lambda t: (t ** 3).sum(), x)
        np.testing.assert_allclose(_np(h), np.diag([3.0, -1.5]))


def test_strict_mode_and_bad_arguments():
    for F in (F_TG, F_TH):
        mk = tg.tensor if F is F_TG else torch.tensor
        x = mk([1.0, 2.0])
        with pytest.raises(RuntimeError):
            F.vjp(lambda t: mk([1.0, 1.0]), x, mk([1.0, 1.0]), strict=True)
        same(F.vjp(lambda t: mk([1.0, 1.0]), x, mk([1.0, 1.0]))[1], mk([0.0, 0.0]))
        with pytest.raises(RuntimeError):
            F.vjp(lambda t: t * 2, x)          # v None for a non-scalar output
        with pytest.raises(TypeError):
            F.vjp(lambda t: t * 2, [1.0, 2.0], mk([1.0, 1.0]))
