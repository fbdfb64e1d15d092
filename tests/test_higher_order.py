"""create_graph=True: second and third derivatives of every elementwise op (scalar and array
paths) and of the array ops, against torch; Hessian-vector products; gradient penalties."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tapegrad  # noqa: E402
from test_ops import BINARY, ELEMENTWISE, TG, TH, _EW_IDS, _seed, _tg, _th  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-10)


def _np(t):
    """torch tensor -> array (torch answers some derivatives with an unallocated ZeroTensor)"""
    return np.zeros(tuple(t.shape)) if t._is_zerotensor() else t.detach().numpy()


def _close(a, b, what):
    a = None if a is None else np.asarray(a.detach().numpy() if hasattr(a, "detach") else a)
    b = None if b is None else _np(b)
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a} vs {b}"
        return
    np.testing.assert_allclose(a, b, err_msg=what, equal_nan=True, **TOL)


def higher(fn, arrays, order=3, seed=0):
    """Differentiate ``sum(fn(*xs) * w)`` ``order`` times (summing each gradient with a
    random weight before the next) in tapegrad and torch; compare every order."""
    rng = np.random.default_rng(seed)
    tg_in = [_tg(a, True) for a in arrays]
    th_in = [_th(a, True) for a in arrays]
    tg_y, th_y = fn(TG, *tg_in), fn(TH, *th_in)
    for k in range(order):
        w = rng.standard_normal(tuple(th_y.shape))
        tg_s = (tg_y * _tg(w)).sum()
        th_s = (th_y * torch.from_numpy(w)).sum()
        last = k == order - 1
        tg_g = tapegrad.autograd.grad(tg_s, tg_in, create_graph=not last, allow_unused=True)
        th_g = torch.autograd.grad(th_s, th_in, create_graph=not last, allow_unused=True)
        for i, (a, b) in enumerate(zip(tg_g, th_g)):
            if b is None and a is not None:  # torch drops derivatives built from constants
                assert not np.any(a.detach().numpy()), f"order {k + 1} input {i}"
                continue
            _close(a, b, f"order {k + 1} input {i}")
        pairs = [(a, b) for a, b in zip(tg_g, th_g) if b is not None and b.requires_grad]
        if not pairs:
            return
        tg_y = sum(a.reshape(-1).sum() * (j + 1.0) for j, (a, _) in enumerate(pairs))
        th_y = sum(b.reshape(-1).sum() * (j + 1.0) for j, (_, b) in enumerate(pairs))
        if not tg_y.requires_grad:
            # tapegrad knows this derivative is piecewise constant (relu, abs, clamp...);
            # torch keeps a graph whose derivative is zero: check that it is
            th_next = torch.autograd.grad(th_y, th_in, allow_unused=True)
            for b in th_next:
                assert b is None or not np.any(_np(b))
            return


@pytest.mark.parametrize("name,label,fn,spec", ELEMENTWISE, ids=_EW_IDS)
def test_elementwise_third_derivatives_scalar_path(name, label, fn, spec):
    rng = np.random.default_rng(_seed(name, label, "higher"))
    for i in range(2):
        higher(fn, [d(rng, ()) for d in spec.domains], seed=i)


@pytest.mark.parametrize("name,label,fn,spec", ELEMENTWISE, ids=_EW_IDS)
def test_elementwise_third_derivatives_array_path(name, label, fn, spec):
    rng = np.random.default_rng(_seed(name, label, "higher-array"))
    shapes = [(3, 4), (4,)] if spec.kind == BINARY else [(2, 3)]
    higher(fn, [d(rng, s) for d, s in zip(spec.domains, shapes)])


ARRAY_PROGRAMS = {
    "sum_mean": lambda m, x: (x * x).sum(0) + (x ** 3).mean(),
    "prod_no_zeros": lambda m, x: x.prod(1),
    "max_min": lambda m, x: (x * x).max(1).values + (x * x).min() + m.amax(x * x, 0).sum(),
    "norm": lambda m, x: m.norm(x * x, dim=1) + m.norm(x, p=3),
    "logsumexp_softmax": lambda m, x: m.logsumexp(x * x, 1) + m.softmax(x, 1)[:, 0]
                                       + m.log_softmax(x, 0).sum(0)[:2].sum(),
    "matmul": lambda m, x: (x @ x.T).sum(0) + m.outer(x[0], x[1]).sum()
                            + m.dot(x[0], x[1]),
    "shapes": lambda m, x: m.stack([x[0], x[1]], 1).reshape(-1) ** 2
                            + m.cat([x[0], x[1]]).reshape(2, 4).transpose(0, 1).reshape(-1),
    "index": lambda m, x: x[:, [0, 0, 2]].sum() * x[1, 1:] + (x[x > 0] ** 3).sum(),
    "where_clamp": lambda m, x: m.where(x > 0, x ** 3, m.sin(x)) + m.clamp(x, -0.5, 0.5) ** 2,
    "diag": lambda m, x: m.diag(x[:, :2] @ x[:, :2].T) ** 2,
    "setitem": lambda m, x: _setitem_program(x),
}


def _setitem_program(x):
    y = x.clone() * x
    y[:, 1:3] = x[:, :2] ** 3  # the value's gradient is summed from a 2-column slice
    return (y * x).sum(0)


@pytest.mark.parametrize("name", sorted(ARRAY_PROGRAMS))
def test_array_ops_third_derivatives(name):
    x = np.random.default_rng(7).uniform(-1.5, 1.5, (2, 4))
    x[np.abs(x) < 0.1] = 0.3
    higher(ARRAY_PROGRAMS[name], [x])


def rosen(m, xs):
    f = 0.0
    for i in range(len(xs) - 1):
        f = f + 100 * (xs[i + 1] - xs[i] ** 2) ** 2 + (1 - xs[i]) ** 2
    return f


def test_hessian_vector_product_by_double_backward():
    x0 = np.random.default_rng(1).uniform(-1, 1, 12)
    v = np.random.default_rng(2).standard_normal(12)
    out = []
    for m, make in ((tapegrad, lambda a: tapegrad.tensor(float(a), requires_grad=True)),
                    (torch, lambda a: torch.tensor(float(a), dtype=torch.float64,
                                                   requires_grad=True))):
        xs = [make(a) for a in x0]
        gs = m.autograd.grad(rosen(m, xs), xs, create_graph=True)
        gv = sum(g * float(vi) for g, vi in zip(gs, v))
        out.append([h.item() for h in m.autograd.grad(gv, xs)])
    np.testing.assert_allclose(out[0], out[1], rtol=1e-12)


def test_full_hessian_and_gradient_penalty():
    x0 = np.random.default_rng(3).uniform(-1, 1, (3,))
    w0 = np.random.default_rng(4).uniform(-1, 1, (3, 3))
    res = []
    for m, mk in ((tapegrad, lambda a: tapegrad.tensor(a, requires_grad=True)),
                  (torch, lambda a: torch.tensor(a, requires_grad=True))):
        x, w = mk(x0), mk(w0)
        f = m.tanh(w @ x).sum() + (x ** 4).sum()
        (g,) = m.autograd.grad(f, x, create_graph=True)
        hess = [m.autograd.grad(g[i], x, retain_graph=True)[0].detach().numpy()
                for i in range(3)]
        penalty = (g * g).sum()                     # gradient penalty, w.r.t. the weights
        (gw,) = m.autograd.grad(penalty, w)
        res.append((np.array(hess), gw.detach().numpy()))
    np.testing.assert_allclose(res[0][0], res[1][0], **TOL)
    np.testing.assert_allclose(res[0][1], res[1][1], **TOL)


def test_backward_create_graph_accumulates_a_grad_that_requires_grad():
    for m in (tapegrad, torch):
        x = m.tensor([0.5, -1.0], dtype=m.float64, requires_grad=True)
        (x ** 3).sum().backward(create_graph=True)
        assert x.grad.requires_grad
        (x ** 3).sum().backward(create_graph=True)   # accumulates out of place
        g2 = m.autograd.grad(x.grad.sum(), x)[0]
        np.testing.assert_allclose(g2.detach().numpy(), 2 * 6 * np.array([0.5, -1.0]))


def test_constant_derivatives_do_not_require_grad_and_no_grad_is_overridden():
    for m in (tapegrad, torch):
        x = m.tensor(1.5, dtype=m.float64, requires_grad=True)
        (g,) = m.autograd.grad(3.0 * x, x, create_graph=True)
        assert not g.requires_grad
        y = x * x
        with m.no_grad():
            (g,) = m.autograd.grad(y, x, create_graph=True)
        assert g.requires_grad


def test_create_graph_leaks_nothing():
    # torch documents a reference cycle for backward(create_graph=True); tapegrad makes none:
    # once the user drops the tensors, refcounting alone frees every tape
    import gc
    import weakref
    x = tapegrad.tensor([0.3, -0.7], requires_grad=True)
    refs = []
    gc.disable()
    try:
        for _ in range(200):
            y = (tapegrad.sin(x) * x).sum()
            y.backward(create_graph=True)
            (h,) = tapegrad.autograd.grad(x.grad.sum(), x)
            refs.append(weakref.ref(y._tape))
            x.grad = None
            del y, h
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


# --- the compiled recording sweep (grad(loss, leaves, create_graph=True), scalar tapes) ----

def _recording_spy(monkeypatch):
    """Count the compiled recording sweep's calls that did the work (not None)."""
    from tapegrad.autograd import _fast_paths
    real, done = _fast_paths.RECORD.applies, []
    monkeypatch.setattr(_fast_paths.RECORD, "applies", lambda *a: done.append(real(*a)) or done[-1])
    return lambda: sum(r is not None for r in done)


def _tensor_sweep_only(monkeypatch):
    from tapegrad.autograd import _fast_paths
    monkeypatch.setattr(_fast_paths.RECORD, "applies", lambda *a: None)


_LOSSES = {
    # the op's adjoint is the constant seed (its rule folds constants, emits constant forms)
    "seed": lambda m, y, xs: y,
    # the op's adjoint is a recorded value, summed from two uses; the inputs' are sums too
    "recorded": lambda m, y, xs: y * y + m.sin(y) * xs[0] + xs[-1] * 0.5,
}


def _derivatives(m, fn, values, loss, w):
    """First derivatives (create_graph=True, default options) and the second derivatives of
    their weighted sum, as (values, requires_grad flags, second or None)."""
    xs = [_tg(v, True) if m is TG else _th(v, True) for v in values]
    gs = m.autograd.grad(_LOSSES[loss](m, fn(m, *xs), xs), xs, create_graph=True)
    first = [float(g.detach().numpy()) for g in gs]
    flags = [bool(g.requires_grad) for g in gs]
    live = [(g, wi) for g, wi in zip(gs, w) if g.requires_grad]
    second = None
    if live:
        s = sum(g * wi for g, wi in live)
        second = [None if h is None else float(_np(h) if m is TH else h.detach().numpy())
                  for h in m.autograd.grad(s, xs, allow_unused=True)]
    return first, flags, second


@pytest.mark.parametrize("loss", sorted(_LOSSES))
@pytest.mark.parametrize("name,label,fn,spec", ELEMENTWISE, ids=_EW_IDS)
def test_compiled_recording_sweep_equals_the_tensor_sweep_and_torch(name, label, fn, spec, loss,
                                                                    monkeypatch):
    rng = np.random.default_rng(_seed(name, label, "record"))
    values = [d(rng, ()) for d in spec.domains]
    w = rng.standard_normal(len(values)).tolist()
    taken = _recording_spy(monkeypatch)
    fast = _derivatives(TG, fn, values, loss, w)
    assert taken() == 1  # the compiled sweep recorded the first derivatives
    monkeypatch.undo()
    _tensor_sweep_only(monkeypatch)
    general = _derivatives(TG, fn, values, loss, w)
    # the same entries' values, in the same order of operations: bit for bit
    assert fast[0] == general[0] or np.allclose(fast[0], general[0], rtol=0, atol=0,
                                                equal_nan=True)
    assert fast[1] == general[1]
    assert (fast[2] is None) == (general[2] is None)
    if fast[2] is not None:
        np.testing.assert_array_equal(np.array(fast[2], dtype=float),
                                      np.array(general[2], dtype=float))
    want = _derivatives(TH, fn, values, loss, w)
    np.testing.assert_allclose(fast[0], want[0], **TOL)
    if fast[2] is not None and want[2] is not None:
        for a, b in zip(fast[2], want[2]):
            if b is None:  # torch drops derivatives built from constants
                assert a is None or a == 0.0
            else:
                np.testing.assert_allclose(0.0 if a is None else a, b, **TOL)


def test_compiled_recording_sweep_gives_third_derivatives(monkeypatch):
    # grad(create_graph=True) twice through the compiled sweep, then a plain grad: every
    # order comes from entries the sweep recorded, against torch
    x0 = np.random.default_rng(5).uniform(-1, 1, 6)
    u, v = np.random.default_rng(6).standard_normal((2, 6)).tolist()
    taken = _recording_spy(monkeypatch)
    out = []
    for m in (TG, TH):
        xs = [_tg(a, True) if m is TG else _th(a, True) for a in x0]
        g = m.autograd.grad(rosen(m, xs) + m.exp(xs[0] * xs[1]), xs, create_graph=True)
        h = m.autograd.grad(sum(gi * vi for gi, vi in zip(g, v)), xs, create_graph=True)
        t = m.autograd.grad(sum(hi * ui for hi, ui in zip(h, u)), xs)
        out.append([[float(z.detach().numpy()) for z in r] for r in (g, h, t)])
    assert taken() == 2
    np.testing.assert_allclose(out[0], out[1], rtol=1e-11, atol=1e-11)


def test_compiled_recording_sweep_leaves_other_cases_to_the_tensor_sweep(monkeypatch):
    # each case runs the tensor sweep (and must still agree with torch): a loss whose tape
    # is not the one being recorded onto, grad_outputs, retain_graph=False, an unused input
    taken = _recording_spy(monkeypatch)
    for m in (TG, TH):
        x = _tg(0.7, True) if m is TG else _th(0.7, True)
        y = m.sin(x) * x
        with m.no_grad():
            (g,) = m.autograd.grad(y, x, create_graph=True)
        assert g.requires_grad
        (g2,) = m.autograd.grad(m.sin(x) * x, x, grad_outputs=_tg(2.0) if m is TG
                                else _th(2.0), create_graph=True)
        (g3,) = m.autograd.grad(m.sin(x) * x, x, create_graph=True, retain_graph=False)
        np.testing.assert_allclose(float(g2.detach().numpy()), 2 * float(g.detach().numpy()))
        np.testing.assert_allclose(float(g3.detach().numpy()), float(g.detach().numpy()))
    assert taken() == 0


def test_create_graph_records_nothing_when_it_raises(monkeypatch):
    # an unused input raises before the sweep records anything, on both sweeps; an array
    # case (the tensor sweep) too
    for tensor_sweep in (False, True):
        if tensor_sweep:
            _tensor_sweep_only(monkeypatch)
        for make in (lambda: tapegrad.tensor(0.5, requires_grad=True),
                     lambda: tapegrad.tensor([0.5, -1.5], requires_grad=True)):
            x, u = make(), tapegrad.tensor(0.7, requires_grad=True)
            y = (tapegrad.sin(x) * x).sum()
            n = len(y._tape)
            with pytest.raises(RuntimeError, match="not have been used in the graph"):
                tapegrad.autograd.grad(y, [x, u], create_graph=True)
            assert len(y._tape) == n


COMPOSITIONS = {
    "trig_exp": lambda m, x, y: m.sin(x * y) * m.exp(0.3 * x) + x ** 3 * m.tanh(y),
    "rational_log": lambda m, x, y: m.log1p(x * x + 1.0) / (1.5 + m.cos(y)) - m.sqrt(y * y + x),
    "sigmoid_atan2": lambda m, x, y: m.sigmoid(x - y) * m.atan2(x, y + 2.0) + m.softplus(x * y),
}


@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
@pytest.mark.parametrize("shape", [(), (3,)], ids=["scalar", "array"])
def test_fourth_derivatives_of_compositions(name, shape):
    rng = np.random.default_rng(_seed(name, "fourth", len(shape)))
    arrays = [rng.uniform(0.3, 1.2, shape), rng.uniform(0.3, 1.2, shape)]
    higher(COMPOSITIONS[name], arrays, order=4, seed=len(shape))


def test_fourth_derivative_by_repeated_default_grad(monkeypatch):
    # grad(f, x, create_graph=True) three times (the compiled recording sweep each time:
    # the loss is one 0-d value on the current tape), then a plain grad: d4/dx4 of f at x
    taken = _recording_spy(monkeypatch)
    out = []
    for m in (TG, TH):
        x = _tg(0.7, True) if m is TG else _th(0.7, True)
        d = COMPOSITIONS["trig_exp"](m, x, x * 0.5 + 0.2)
        for _ in range(3):
            (d,) = m.autograd.grad(d, x, create_graph=True)
        out.append(float(m.autograd.grad(d, x)[0]))
    assert taken() == 3
    np.testing.assert_allclose(out[0], out[1], rtol=1e-11)


PROD_ZEROS = {  # where a (2, 3, 2) input is exactly 0
    "one": [(0, 1, 0)],
    "two_in_one_slice": [(0, 1, 0), (0, 2, 0)],
    "two_in_all_slices": [(0, 0, 0), (1, 2, 1)],
    "three": [(0, 0, 0), (0, 0, 1), (1, 1, 1)],
}
PROD_PROGRAMS = {
    "all": lambda m, x: x.prod(),
    "dim0": lambda m, x: x.prod(0),
    "dim1_keepdim": lambda m, x: m.prod(x, 1, keepdim=True),
    "dim2_times": lambda m, x: x.prod(2) * x.sum(2) + x.prod() * x[0, 0, 0],
    "of_square": lambda m, x: (x * x).prod(1).sum(0),
}


@pytest.mark.parametrize("zeros", sorted(PROD_ZEROS))
@pytest.mark.parametrize("name", sorted(PROD_PROGRAMS))
def test_prod_at_exact_zeros_fourth_derivatives(name, zeros):
    # prod's gradient at a zero is an exclusive product (prod_others), itself differentiable
    x = np.random.default_rng(3).uniform(0.5, 1.5, (2, 3, 2))
    for z in PROD_ZEROS[zeros]:
        x[z] = 0.0
    higher(PROD_PROGRAMS[name], [x], order=4)


@pytest.mark.parametrize("zeros", sorted(PROD_ZEROS))
@pytest.mark.parametrize("vectorize", [False, True])
def test_hessian_of_prod_at_exact_zeros(zeros, vectorize):
    x = np.random.default_rng(4).uniform(0.5, 1.5, (2, 3, 2))
    for z in PROD_ZEROS[zeros]:
        x[z] = 0.0
    for fn in (lambda m, a: a.prod(), lambda m, a: (a.prod(1) ** 2).sum()):
        h = tapegrad.autograd.functional.hessian(lambda a: fn(TG, a), _tg(x),
                                                 vectorize=vectorize)
        ht = torch.autograd.functional.hessian(lambda a: fn(TH, a), _th(x),
                                               vectorize=vectorize)
        _close(h, ht, f"hessian {zeros}")


def test_batched_gradient_of_a_full_prod_with_a_zero():
    # a full reduction over a 2-d input seen through a batch axis reduces several dims
    a = np.array([[1.0, 0.0, 3.0], [2.0, 5.0, 4.0]])
    w, seeds = np.array([1.0, 2.0]), np.eye(2)
    out = []
    for m in (TG, TH):
        x = (_tg if m is TG else _th)(a, True)
        y = x.prod().reshape(1).expand(2) * (_tg if m is TG else _th)(w)
        out.append(m.autograd.grad(y, x, (_tg if m is TG else _th)(seeds),
                                   is_grads_batched=True)[0])
    _close(out[0], out[1], "batched prod gradient")
    assert out[0][0, 0, 1].item() == 120.0
