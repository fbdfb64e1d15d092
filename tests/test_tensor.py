"""The Tensor API (API.md "Tensors"): factories, dtypes, attributes, conversions, operators'
dtype and error rules, each compared with torch."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tapegrad  # noqa: E402


@pytest.fixture(autouse=True)
def torch_float64_default():
    """tapegrad's default floating dtype is float64: compare with torch set the same way."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(prev)


def _name(t):
    return str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else t.dtype.name


def same_tensor(tg, th, rtol=1e-12, atol=0.0):
    assert isinstance(tg, tapegrad.Tensor)
    assert tuple(tg.shape) == tuple(th.shape)
    assert _name(tg) == _name(th), f"dtype {_name(tg)} != torch {_name(th)}"
    assert tg.requires_grad == th.requires_grad
    np.testing.assert_allclose(np.asarray(tg.detach().numpy()), th.detach().numpy(),
                               rtol=rtol, atol=atol)


class _TorchNS:
    def __getattr__(self, name):
        return getattr(torch, name)


TG, TH = tapegrad, _TorchNS()


def _builtin_base(exc_type):
    for k in exc_type.__mro__:
        if k.__module__ == "builtins":
            return k
    raise AssertionError(exc_type)


def raises_like_torch(fn):
    """``fn(m)`` raises in torch and in tapegrad, with the same (builtin) exception type."""
    with pytest.raises(Exception) as th_info:
        fn(TH)
    expected = _builtin_base(th_info.type)
    with pytest.raises(Exception) as tg_info:
        fn(TG)
    assert isinstance(tg_info.value, expected), \
        f"tapegrad raised {tg_info.type.__name__}({tg_info.value}), torch {expected.__name__}"
    assert str(tg_info.value), "the error message is empty"
    return tg_info.value


# ---------------------------------------------------------------------------------------
# factories

FACTORIES = [
    ("tensor(list of floats)", lambda m: m.tensor([[1.0, 2.0], [3.0, 4.5]])),
    ("tensor(list of ints)", lambda m: m.tensor([1, 2, 3])),
    ("tensor(list of bools)", lambda m: m.tensor([True, False])),
    ("tensor(mixed int float)", lambda m: m.tensor([1, 2.5])),
    ("tensor(float)", lambda m: m.tensor(2.5)),
    ("tensor(int)", lambda m: m.tensor(3)),
    ("tensor(bool)", lambda m: m.tensor(True)),
    ("tensor(float32 array)", lambda m: m.tensor(np.array([1.0, 2.0], dtype=np.float32))),
    ("tensor(int32 array)", lambda m: m.tensor(np.array([1, 2], dtype=np.int32))),
    ("tensor(float64 0-d array)", lambda m: m.tensor(np.array(1.5))),
    ("tensor(np.float32 scalar)", lambda m: m.tensor(np.float32(1.5))),
    ("tensor(dtype=float32)", lambda m: m.tensor([1, 2], dtype=m.float32)),
    ("tensor(dtype=int64)", lambda m: m.tensor([1.7, 2.2], dtype=m.int64)),
    ("tensor(empty list)", lambda m: m.tensor([])),
    ("tensor(requires_grad)", lambda m: m.tensor([1.0, 2.0], requires_grad=True)),
    ("tensor(0-d requires_grad)", lambda m: m.tensor(1.0, requires_grad=True)),
    ("zeros(2, 3)", lambda m: m.zeros(2, 3)),
    ("zeros((2, 3))", lambda m: m.zeros((2, 3))),
    ("zeros([2])", lambda m: m.zeros([2])),
    ("zeros()", lambda m: m.zeros(())),
    ("zeros(dtype=int32)", lambda m: m.zeros(2, dtype=m.int32)),
    ("zeros(requires_grad)", lambda m: m.zeros(2, 2, requires_grad=True)),
    ("ones(3)", lambda m: m.ones(3)),
    ("ones(dtype=float32, requires_grad)", lambda m: m.ones(2, dtype=m.float32,
                                                           requires_grad=True)),
    ("ones(dtype=bool)", lambda m: m.ones(2, dtype=m.bool)),
    ("full(float)", lambda m: m.full((2, 2), 1.5)),
    ("full(int)", lambda m: m.full((2,), 3)),
    ("full(bool)", lambda m: m.full((2,), True)),
    ("full(dtype=float32)", lambda m: m.full((2,), 3, dtype=m.float32)),
    ("full(requires_grad)", lambda m: m.full((2,), 0.5, requires_grad=True)),
    ("zeros_like(float32)", lambda m: m.zeros_like(m.ones(2, 3, dtype=m.float32))),
    ("zeros_like(int)", lambda m: m.zeros_like(m.tensor([1, 2]))),
    ("zeros_like(requires_grad)", lambda m: m.zeros_like(m.ones(2), requires_grad=True)),
    ("ones_like(dtype=float32)", lambda m: m.ones_like(m.ones(2), dtype=m.float32)),
    ("ones_like(does not inherit requires_grad)",
     lambda m: m.ones_like(m.ones(2, requires_grad=True))),
    ("arange(5)", lambda m: m.arange(5)),
    ("arange(2, 7)", lambda m: m.arange(2, 7)),
    ("arange(0, 1, 0.25)", lambda m: m.arange(0, 1, 0.25)),
    ("arange(1.0, 4.0)", lambda m: m.arange(1.0, 4.0)),
    ("arange(5, 0, -2)", lambda m: m.arange(5, 0, -2)),
    ("arange(dtype=float32)", lambda m: m.arange(4, dtype=m.float32)),
    ("arange(requires_grad)", lambda m: m.arange(0.0, 3.0, requires_grad=True)),
    ("linspace(0, 1, 5)", lambda m: m.linspace(0, 1, 5)),
    ("linspace(-2, 2, 1)", lambda m: m.linspace(-2, 2, 1)),
    ("linspace(requires_grad)", lambda m: m.linspace(0, 1, 3, requires_grad=True)),
    ("eye(3)", lambda m: m.eye(3)),
    ("eye(2, 3)", lambda m: m.eye(2, 3)),
    ("eye(requires_grad)", lambda m: m.eye(2, requires_grad=True)),
]


@pytest.mark.parametrize("label,fn", FACTORIES, ids=[f[0] for f in FACTORIES])
def test_factory(label, fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tg, th = fn(TG), fn(TH)
    same_tensor(tg, th)
    assert tg.is_leaf and tg.grad_fn is None and tg.grad is None


@pytest.mark.parametrize("name", ["rand", "randn"])
def test_random_factories(name):
    fn = getattr(tapegrad, name)
    x = fn(2, 3)
    assert x.shape == (2, 3) and x.dtype is tapegrad.float64 and not x.requires_grad
    y = fn((4,), requires_grad=True)
    assert y.shape == (4,) and y.requires_grad and y.is_leaf
    z = fn(3, dtype=tapegrad.float32)
    assert z.dtype is tapegrad.float32
    assert fn(()).shape == ()
    if name == "rand":
        v = fn(1000).numpy()
        assert v.min() >= 0.0 and v.max() < 1.0
    tapegrad.manual_seed(7)
    a = fn(5).numpy().copy()
    tapegrad.manual_seed(7)
    np.testing.assert_array_equal(a, fn(5).numpy())


def test_tensor_copies_its_data():
    a = np.array([1.0, 2.0])
    x = tapegrad.tensor(a)
    a[0] = 10.0
    assert x.tolist() == [1.0, 2.0]
    lst = [1.0, 2.0]
    y = tapegrad.tensor(lst)
    lst[0] = 5.0
    assert y.tolist() == [1.0, 2.0]


def test_tensor_from_tensor_warns_and_copies():
    x = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    with pytest.warns(UserWarning):
        y = tapegrad.tensor(x)
    assert not y.requires_grad and y.is_leaf
    with tapegrad.no_grad():
        y += 1.0
    assert x.tolist() == [1.0, 2.0]


def test_as_tensor_shares_memory():
    for m in (torch, tapegrad):
        a = np.array([1.0, 2.0, 3.0])
        x = m.as_tensor(a)
        a[0] = 10.0
        assert x.tolist()[0] == 10.0, m.__name__
        b = np.array([1, 2], dtype=np.int32)
        y = m.as_tensor(b)
        assert _name(y) == "int32"
        b[1] = 7
        assert y.tolist() == [1, 7]


def test_as_tensor_dtype_and_tensor_input():
    for m in (torch, tapegrad):
        a = np.array([1.0, 2.0])
        x = m.as_tensor(a, dtype=m.float32)
        assert _name(x) == "float32"
        a[0] = 10.0
        assert x.tolist()[0] == 1.0, m.__name__  # converted: a copy
        t = m.tensor([1.0, 2.0], requires_grad=True)
        assert m.as_tensor(t) is t
        lst = [1.0, 2.0]
        c = m.as_tensor(lst)
        assert _name(c) == "float64"


def test_from_numpy_shares_memory_both_ways():
    for m in (torch, tapegrad):
        a = np.arange(4.0)
        x = m.from_numpy(a)
        assert _name(x) == "float64" and not x.requires_grad
        a[1] = 9.0
        assert x.tolist() == [0.0, 9.0, 2.0, 3.0], m.__name__
        with m.no_grad():
            x += 1.0
        np.testing.assert_array_equal(a, [1.0, 10.0, 3.0, 4.0], err_msg=m.__name__)
        x.numpy()[0] = -1.0
        assert a[0] == -1.0
        f = np.ones(3, dtype=np.float32)
        assert _name(m.from_numpy(f)) == "float32"


def test_from_numpy_0d_shares_memory():
    for m in (torch, tapegrad):
        a = np.array(1.5)
        x = m.from_numpy(a)
        a[...] = 4.0
        assert x.item() == 4.0, f"{m.__name__}: from_numpy of a 0-d array does not share memory"


@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([object()]),
                                 [1.0, 2.0], 1.5], ids=["str", "object", "list", "float"])
def test_from_numpy_bad_input_type_error(bad):
    raises_like_torch(lambda m: m.from_numpy(bad))


# ---------------------------------------------------------------------------------------
# dtypes


def test_default_dtype_float64():
    assert tapegrad.tensor([1.0]).dtype is tapegrad.float64
    assert tapegrad.tensor(1.0).dtype is tapegrad.float64
    assert tapegrad.zeros(2).dtype is tapegrad.float64
    assert tapegrad.float64.is_floating_point and not tapegrad.int64.is_floating_point
    assert repr(tapegrad.float32) == "tapegrad.float32"
    assert tapegrad.double is tapegrad.float64 and tapegrad.float is tapegrad.float32
    assert tapegrad.long is tapegrad.int64


def test_float32_kept():
    x = tapegrad.tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    y = (x * 2.0 + 1).exp().sum()
    assert y.dtype is tapegrad.float32
    (g,) = tapegrad.autograd.grad(y, x)
    assert g.dtype is tapegrad.float32


def test_int_tensors():
    x = tapegrad.tensor([1, 2, 3])
    assert x.dtype is tapegrad.int64 and not x.requires_grad
    assert (x + 1).dtype is tapegrad.int64
    assert (x * x).tolist() == [1, 4, 9]
    assert x.sum().dtype is tapegrad.int64
    assert not x.is_floating_point()


INT_REQUIRES_GRAD = [
    ("tensor(int, requires_grad)", lambda m: m.tensor([1, 2], requires_grad=True)),
    ("tensor(bool, requires_grad)", lambda m: m.tensor([True], requires_grad=True)),
    ("requires_grad_()", lambda m: m.tensor([1, 2]).requires_grad_()),
    ("requires_grad = True", lambda m: setattr(m.tensor([1, 2]), "requires_grad", True)),
    ("zeros(int64, requires_grad)", lambda m: m.zeros(2, dtype=m.int64, requires_grad=True)),
    ("arange(int, requires_grad)", lambda m: m.arange(5, requires_grad=True)),
    ("full(int, requires_grad)", lambda m: m.full((2,), 3, requires_grad=True)),
    ("ones_like(int, requires_grad)",
     lambda m: m.ones_like(m.tensor([1, 2]), requires_grad=True)),
    ("0-d int requires_grad_()", lambda m: m.tensor(3).requires_grad_()),
]


@pytest.mark.parametrize("label,fn", INT_REQUIRES_GRAD, ids=[i[0] for i in INT_REQUIRES_GRAD])
def test_integer_requires_grad_raises(label, fn):
    err = raises_like_torch(fn)
    assert isinstance(err, RuntimeError)
    assert "only tensors of floating point" in str(err).lower()


def test_integer_requires_grad_message_matches_torch_case():
    """torch's own text: 'Only Tensors of floating point...' from the factory,
    'only Tensors of floating point...' from requires_grad_()."""
    for fn in (lambda m: m.tensor([1, 2], requires_grad=True),
               lambda m: m.tensor([1, 2]).requires_grad_()):
        with pytest.raises(RuntimeError) as th:
            fn(torch)
        with pytest.raises(RuntimeError) as tg:
            fn(tapegrad)
        n = len("only Tensors of floating point")
        assert str(tg.value)[:n] == str(th.value)[:n]


@pytest.mark.parametrize("fn", [
    lambda: tapegrad.tensor([1 + 2j]),
    lambda: tapegrad.tensor([1.0], dtype=tapegrad.complex128),
    lambda: tapegrad.zeros(2, dtype=tapegrad.complex64),
    lambda: tapegrad.from_numpy(np.ones(2, dtype=np.complex128)),
    lambda: tapegrad.as_tensor(np.ones(2, dtype=np.complex64)),
    lambda: tapegrad.tensor(1j),
], ids=["list", "dtype=complex128", "zeros complex64", "from_numpy", "as_tensor", "scalar"])
def test_complex_raises_type_error(fn):
    with pytest.raises(TypeError, match="(?i)complex"):
        fn()


def test_tensor_class_is_not_a_constructor():
    """Tensors come from tapegrad.tensor and the factories: Tensor(data) raises TypeError, and
    a bare Tensor() says how to make one when printed."""
    with pytest.raises(TypeError, match="no arguments"):
        tapegrad.Tensor([1.0, 2.0])
    assert "tapegrad.tensor(data)" in repr(tapegrad.Tensor())


def test_complex_dtypes_exist():
    assert tapegrad.complex64.is_complex and tapegrad.complex128.is_complex


# ---------------------------------------------------------------------------------------
# attributes and methods


def test_shape_ndim_size_numel():
    for shape in [(), (3,), (2, 3), (2, 1, 4)]:
        a = np.zeros(shape)
        tg, th = tapegrad.tensor(a), torch.tensor(a)
        assert tg.shape == tuple(th.shape)
        assert tg.ndim == th.ndim and tg.dim() == th.dim()
        assert tuple(tg.size()) == tuple(th.size())
        assert tg.numel() == th.numel()
        for d in range(-len(shape), len(shape)):
            assert tg.size(d) == th.size(d)
    raises_like_torch(lambda m: m.zeros(2, 3).size(2))
    raises_like_torch(lambda m: m.zeros(2, 3).size(-3))


def test_requires_grad_flag():
    x = tapegrad.tensor([1.0, 2.0])
    assert x.requires_grad is False
    assert x.requires_grad_() is x and x.requires_grad is True
    x.requires_grad_(False)
    assert x.requires_grad is False
    x.requires_grad = True
    assert x.requires_grad
    y = x * 2.0
    assert y.requires_grad and not y.is_leaf
    for m in (torch, tapegrad):  # a non-leaf cannot be switched off
        z = m.tensor([1.0], requires_grad=True) * 2.0
        with pytest.raises(RuntimeError):
            z.requires_grad_(False)
        assert z.requires_grad_(True) is z


def test_grad_attribute():
    for m in (torch, tapegrad):
        x = m.tensor([1.0, 2.0], requires_grad=True)
        assert x.grad is None
        x.grad = m.tensor([0.5, 0.5])
        assert x.grad.tolist() == [0.5, 0.5]
        x.grad = None
        assert x.grad is None
        (x * x).sum().backward()
        assert x.grad.tolist() == [2.0, 4.0]
        del x.grad
        assert x.grad is None


@pytest.mark.parametrize("value", [
    lambda m: np.ones(2), lambda m: [1.0, 1.0], lambda m: 1.0,
    lambda m: m.ones(3), lambda m: m.ones(2, 1), lambda m: m.ones(2, dtype=m.float32),
], ids=["ndarray", "list", "float", "wrong size", "wrong shape", "wrong dtype"])
def test_grad_assignment_checks(value):
    def assign(m):
        x = m.tensor([1.0, 2.0], requires_grad=True)
        x.grad = value(m)
    raises_like_torch(assign)


def test_grad_fn_and_is_leaf():
    for m in (torch, tapegrad):
        x = m.tensor([1.0, 2.0], requires_grad=True)
        c = m.tensor([1.0, 2.0])
        assert x.grad_fn is None and x.is_leaf
        assert c.grad_fn is None and c.is_leaf
        y = x * c
        assert y.grad_fn is not None and not y.is_leaf
        z = c * 2.0  # no grad: a leaf
        assert z.grad_fn is None and z.is_leaf
        with m.no_grad():
            w = x * 2.0
        assert w.grad_fn is None and w.is_leaf and not w.requires_grad
        s = m.tensor(1.0, requires_grad=True)
        assert (s * s).grad_fn is not None  # the 0-d scalar path too


def test_grad_fn_name_like_torch():
    x = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    t = torch.tensor([1.0, 2.0], requires_grad=True)
    for f in (lambda a: a * a, lambda a: a.exp(), lambda a: a.sum(), lambda a: a + a):
        assert f(x).grad_fn.name() == f(t).grad_fn.name()


def test_retain_grad():
    for m in (torch, tapegrad):
        x = m.tensor([1.0, 2.0], requires_grad=True)
        y = x * 3.0
        assert not y.retains_grad and not x.retains_grad
        y.retain_grad()
        assert y.retains_grad
        (y * y).sum().backward()
        assert y.grad.tolist() == [6.0, 12.0], m.__name__
        x.retain_grad()  # a no-op on leaves
        assert not x.retains_grad
        with pytest.raises(RuntimeError):
            m.tensor([1.0]).retain_grad()


def test_nonleaf_grad_warns():
    for m in (torch, tapegrad):
        y = m.tensor([1.0], requires_grad=True) * 2.0
        with pytest.warns(UserWarning):
            assert y.grad is None


def test_detach():
    for m in (torch, tapegrad):
        x = m.tensor([1.0, 2.0], requires_grad=True)
        y = x * 2.0
        d = y.detach()
        assert not d.requires_grad and d.is_leaf and d.grad_fn is None
        assert d.tolist() == [2.0, 4.0]
        dx = x.detach()
        dx += 1.0  # shares memory with x
        assert x.tolist() == [2.0, 3.0], m.__name__
        assert x.requires_grad


def test_detach_():
    for m in (torch, tapegrad):
        x = m.tensor([1.0, 2.0], requires_grad=True)
        y = x * 2.0
        assert y.detach_() is y
        assert not y.requires_grad and y.is_leaf and y.grad_fn is None
        assert y.tolist() == [2.0, 4.0]


def test_item():
    for m in (torch, tapegrad):
        assert m.tensor(2.5).item() == 2.5
        assert m.tensor([3]).item() == 3 and isinstance(m.tensor([3]).item(), int)
        assert m.tensor([[1.5]], requires_grad=True).item() == 1.5
        assert m.tensor(True).item() is True
    raises_like_torch(lambda m: m.tensor([1.0, 2.0]).item())


def test_numpy():
    for m in (torch, tapegrad):
        x = m.tensor([1.0, 2.0])
        a = x.numpy()
        assert isinstance(a, np.ndarray) and a.dtype == np.float64
        a[0] = 5.0  # shares memory
        assert x.tolist()[0] == 5.0, m.__name__
        assert m.tensor(1.5).numpy().shape == ()
        assert m.tensor([1, 2], dtype=m.int32).numpy().dtype == np.int32
    raises_like_torch(lambda m: m.tensor([1.0], requires_grad=True).numpy())
    raises_like_torch(lambda m: m.tensor(1.0, requires_grad=True).numpy())
    raises_like_torch(lambda m: (m.tensor([1.0], requires_grad=True) * 2).numpy())
    assert tapegrad.tensor([1.0], requires_grad=True).detach().numpy().tolist() == [1.0]


def test_tolist():
    for data in [[[1.0, 2.0], [3.0, 4.0]], 2.5, [1, 2], [True, False], []]:
        assert tapegrad.tensor(data).tolist() == torch.tensor(data).tolist()
    assert tapegrad.tensor([1.0], requires_grad=True).tolist() == [1.0]


def test_clone():
    for m in (torch, tapegrad):
        x = m.tensor([1.0, 2.0], requires_grad=True)
        y = x.clone()
        assert not y.is_leaf and y.requires_grad
        (g,) = m.autograd.grad((y * y).sum(), x)
        assert g.tolist() == [2.0, 4.0]
        c = m.tensor([1.0, 2.0])
        d = c.clone()
        d += 1.0  # not shared
        assert c.tolist() == [1.0, 2.0]
        assert m.clone(c).tolist() == [1.0, 2.0]


def test_array_protocol():
    x = tapegrad.tensor([[1.0, 2.0]])
    a = np.asarray(x)
    assert a.shape == (1, 2) and a.dtype == np.float64
    assert np.asarray(x, dtype=np.float32).dtype == np.float32
    assert np.asarray(tapegrad.tensor(2.0)).shape == ()
    assert np.array(tapegrad.tensor([1, 2])).dtype == np.int64


def test_array_protocol_refuses_requires_grad_like_torch():
    raises_like_torch(lambda m: np.asarray(m.tensor([1.0], requires_grad=True)))


COMPARISONS = [
    ("==", lambda a, b: a == b), ("!=", lambda a, b: a != b), ("<", lambda a, b: a < b),
    ("<=", lambda a, b: a <= b), (">", lambda a, b: a > b), (">=", lambda a, b: a >= b),
]


@pytest.mark.parametrize("label,op", COMPARISONS, ids=[c[0] for c in COMPARISONS])
@pytest.mark.parametrize("other", ["tensor", "number", "0-d", "broadcast"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_comparisons(label, op, other, requires_grad):
    a = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    b = {"tensor": np.array([[1.0, 3.0, 2.0], [3.0, 1.0, 1.0]]), "number": 2.0,
         "0-d": np.array(2.0), "broadcast": np.array([1.0, 2.0, 2.5])}[other]
    tg_b = b if other == "number" else tapegrad.tensor(b, requires_grad=requires_grad)
    th_b = b if other == "number" else torch.tensor(b, requires_grad=requires_grad)
    tg = op(tapegrad.tensor(a, requires_grad=requires_grad), tg_b)
    th = op(torch.tensor(a, requires_grad=requires_grad), th_b)
    same_tensor(tg, th)
    assert tg.dtype is tapegrad.bool_ and not tg.requires_grad and tg.grad_fn is None


def test_comparisons_0d():
    for op in (c[1] for c in COMPARISONS):
        tg = op(tapegrad.tensor(1.0, requires_grad=True), tapegrad.tensor(2.0))
        th = op(torch.tensor(1.0, requires_grad=True), torch.tensor(2.0))
        same_tensor(tg, th)
        assert not tg.requires_grad


# ---------------------------------------------------------------------------------------
# in-place rules

INPLACE_ON_LEAF = [
    ("+=", lambda x: x.__iadd__(1.0)), ("-=", lambda x: x.__isub__(1.0)),
    ("*=", lambda x: x.__imul__(2.0)), ("/=", lambda x: x.__itruediv__(2.0)),
    ("add_", lambda x: x.add_(1.0)), ("mul_", lambda x: x.mul_(2.0)),
    ("setitem", lambda x: x.__setitem__(0, 5.0)),
    ("+= tensor", lambda x: x.__iadd__(x.detach() * 0 + 1.0)),
]


@pytest.mark.parametrize("label,op", INPLACE_ON_LEAF, ids=[i[0] for i in INPLACE_ON_LEAF])
@pytest.mark.parametrize("shape", [(2,), ()], ids=["1-D", "0-d"])
def test_inplace_on_leaf_requiring_grad(label, op, shape):
    if label == "setitem" and shape == ():
        pytest.skip("no index into a 0-d tensor")
    a = np.full(shape, 4.0)
    raises_like_torch(lambda m: op(m.tensor(a, requires_grad=True)))
    for m in (torch, tapegrad):
        x = m.tensor(a, requires_grad=True)
        with m.no_grad():
            r = op(x)
        if label != "setitem":
            assert r is x
        assert x.requires_grad and x.is_leaf and x.grad_fn is None
    tg = tapegrad.tensor(a, requires_grad=True)
    th = torch.tensor(a, requires_grad=True)
    with tapegrad.no_grad():
        op(tg)
    with torch.no_grad():
        op(th)
    same_tensor(tg, th)


def test_inplace_on_leaf_then_backward():
    for m in (torch, tapegrad):
        x = m.tensor([1.0, 2.0], requires_grad=True)
        with m.no_grad():
            x *= 3.0
        (x * x).sum().backward()
        assert x.grad.tolist() == [6.0, 12.0], m.__name__


def test_inplace_dtype_rules():
    raises_like_torch(lambda m: m.tensor([1, 2]).__iadd__(1.5))  # float into int
    for m in (torch, tapegrad):
        x = m.tensor([1.0, 2.0], dtype=m.float32)
        x += m.tensor([1.0, 1.0], dtype=m.float64)
        assert _name(x) == "float32"
        i = m.tensor([1, 2])
        i += 1
        assert _name(i) == "int64" and i.tolist() == [2, 3]
    raises_like_torch(lambda m: m.ones(2).__iadd__(m.ones(3, 2)))  # result shape differs


# ---------------------------------------------------------------------------------------
# type promotion

PROMOTIONS = [
    ("f32 array + f64 0-d", lambda m: m.ones(3, dtype=m.float32) + m.tensor(2.0)),
    ("f64 0-d + f32 array", lambda m: m.tensor(2.0) * m.ones(3, dtype=m.float32)),
    ("f32 0-d + f64 0-d", lambda m: m.tensor(1.0, dtype=m.float32) + m.tensor(2.0)),
    ("f32 array + f64 array", lambda m: m.ones(3, dtype=m.float32) + m.ones(3)),
    ("f32 array + float", lambda m: m.ones(3, dtype=m.float32) + 2.5),
    ("f32 array * int", lambda m: m.ones(3, dtype=m.float32) * 2),
    ("int array + float", lambda m: m.tensor([1, 2]) + 1.5),
    ("int array * float", lambda m: 2.5 * m.tensor([1, 2])),
    ("int array + f64 0-d", lambda m: m.tensor([1, 2]) + m.tensor(1.5)),
    ("int array + f32 0-d", lambda m: m.tensor([1, 2]) + m.tensor(1.5, dtype=m.float32)),
    ("int 0-d + f32 array", lambda m: m.tensor(3) + m.ones(2, dtype=m.float32)),
    ("int32 array + int64 0-d", lambda m: m.tensor([1, 2], dtype=m.int32) + m.tensor(5)),
    ("int32 array + int", lambda m: m.tensor([1, 2], dtype=m.int32) + 5),
    ("int32 array + int64 array", lambda m: m.tensor([1, 2], dtype=m.int32) + m.tensor([1, 2])),
    ("int / int", lambda m: m.tensor([1, 2]) / m.tensor([2, 2])),
    ("int / number", lambda m: m.tensor([1, 3]) / 2),
    ("int ** 2", lambda m: m.tensor([1, 2]) ** 2),
    ("bool + int", lambda m: m.tensor([True, False]) + 1),
    ("bool + float", lambda m: m.tensor([True, False]) + 0.5),
    ("bool * bool", lambda m: m.tensor([True, False]) * m.tensor([True, True])),
    ("int array + bool", lambda m: m.tensor([1, 2]) + True),
    ("f32 array - f64 0-d requires_grad",
     lambda m: m.ones(2, dtype=m.float32) - m.tensor(1.5, requires_grad=True)),
    ("f32 array where f64 0-d", lambda m: m.where(m.tensor([True, False]),
                                                  m.ones(2, dtype=m.float32), m.tensor(0.5))),
    ("maximum f32 and f64 0-d", lambda m: m.maximum(m.ones(2, dtype=m.float32),
                                                    m.tensor(0.5))),
    ("exp of int", lambda m: m.exp(m.tensor([1, 2]))),
    ("sqrt of int 0-d", lambda m: m.sqrt(m.tensor(4))),
    ("sum of bool", lambda m: m.tensor([True, True, False]).sum()),
    ("sum of int32", lambda m: m.tensor([1, 2], dtype=m.int32).sum()),
    ("mean of float32", lambda m: m.ones(3, dtype=m.float32).mean()),
    ("cat f32 and f64", lambda m: m.cat([m.ones(2, dtype=m.float32), m.ones(1)])),
    ("stack int and float", lambda m: m.stack([m.tensor([1, 2]), m.tensor([0.5, 1.5])])),
    ("float()", lambda m: m.tensor([1, 2]).float()),
    ("double()", lambda m: m.ones(2, dtype=m.float32).double()),
    ("long()", lambda m: m.tensor([1.7, -1.7]).long()),
    ("int()", lambda m: m.tensor([1.7, 2.2]).int()),
    ("bool()", lambda m: m.tensor([0.0, 2.0]).bool()),
    ("to(float32)", lambda m: m.tensor([1.0]).to(m.float32)),
    ("relu of int", lambda m: m.relu(m.tensor([-1, 2]))),
    ("abs of int", lambda m: m.abs(m.tensor([-1, 2]))),
    ("neg of int", lambda m: -m.tensor([-1, 2])),
    ("clamp of int", lambda m: m.clamp(m.tensor([-3, 0, 5]), -1, 2)),
    ("tensor + ndarray", lambda m: m.ones(3) + np.ones(3, dtype=np.float32)),
    ("f32 tensor + np.float64", lambda m: m.ones(2, dtype=m.float32) + np.float64(1.5)),
    ("int matmul", lambda m: m.tensor([[1, 2]]) @ m.tensor([[3], [4]])),
    ("where 0-d cond", lambda m: m.where(m.tensor(True), m.ones(2), m.zeros(2))),
]


@pytest.mark.parametrize("label,fn", PROMOTIONS, ids=[p[0] for p in PROMOTIONS])
def test_type_promotion(label, fn):
    same_tensor(fn(tapegrad), fn(torch), rtol=1e-6)


def test_promotion_of_float32_grad():
    for m in (torch, tapegrad):
        x = m.ones(3, dtype=m.float32, requires_grad=True)
        s = m.tensor(2.0, requires_grad=True)
        y = (x * s).sum()
        assert _name(y) == "float32"
        gx, gs = m.autograd.grad(y, [x, s])
        assert _name(gx) == "float32" and _name(gs) == "float64", m.__name__


# ---------------------------------------------------------------------------------------
# errors for bad arguments: the same exception types as torch

BAD_TYPES = [
    ("exp(list)", lambda m: m.exp([1.0])),
    ("sum(ndarray)", lambda m: m.sum(np.ones(2))),
    ("tensor + str", lambda m: m.ones(2) + "a"),
    ("str * tensor", lambda m: "a" * m.ones(2)),
    ("tensor(str)", lambda m: m.tensor("abc")),
    ("tensor(ragged)", lambda m: m.tensor([[1.0], [1.0, 2.0]])),
    ("zeros(str)", lambda m: m.zeros("a")),
    ("zeros(float size)", lambda m: m.zeros(2.5)),
    ("sum(dim=float)", lambda m: m.ones(2, 2).sum(dim=1.5)),
    ("stack(tensor)", lambda m: m.stack(m.ones(2))),
    ("cat(list with number)", lambda m: m.cat([m.ones(2), 1.0])),
    ("reshape(float)", lambda m: m.ones(4).reshape(2.0, 2)),
    ("matmul(list)", lambda m: m.matmul(m.ones(2), [1.0, 2.0])),
    ("transpose(float)", lambda m: m.ones(2, 2).transpose(0.0, 1)),
    ("requires_grad_(str)", lambda m: m.ones(2).requires_grad_("yes")),
    ("index by float", lambda m: m.ones(3)[1.5]),
    ("index by float tensor", lambda m: m.ones(3)[m.tensor([0.0])]),
    ("clamp(min=str)", lambda m: m.clamp(m.ones(2), min="a")),
    ("len of 0-d", lambda m: len(m.tensor(1.0))),
    ("iterate 0-d", lambda m: list(m.tensor(1.0))),
]


@pytest.mark.parametrize("label,fn", BAD_TYPES, ids=[b[0] for b in BAD_TYPES])
def test_bad_argument_types(label, fn):
    raises_like_torch(fn)


SHAPE_MISMATCH = [
    ("add", lambda m: m.ones(2, 3) + m.ones(4)),
    ("mul 0-d ok then bad", lambda m: m.ones(2, 3) * m.ones(2)),
    ("add requires_grad", lambda m: m.ones(2, 3, requires_grad=True) - m.ones(3, 2)),
    ("maximum", lambda m: m.maximum(m.ones(2, 3), m.ones(4))),
    ("pow", lambda m: m.pow(m.ones(2, 3), m.ones(2))),
    ("atan2", lambda m: m.atan2(m.ones(3), m.ones(2))),
    ("where", lambda m: m.where(m.ones(2, 3) > 0, m.ones(4), 0.0)),
    ("clamp tensor bounds", lambda m: m.clamp(m.ones(3), min=m.zeros(2))),
    ("matmul", lambda m: m.matmul(m.ones(2, 3), m.ones(4))),
    ("matmul 2-D", lambda m: m.ones(2, 3) @ m.ones(2, 3)),
    ("matmul batch", lambda m: m.ones(2, 2, 3) @ m.ones(3, 3, 4)),
    ("matmul 0-d", lambda m: m.matmul(m.tensor(1.0), m.ones(2))),
    ("dot sizes", lambda m: m.dot(m.ones(2), m.ones(3))),
    ("dot 2-D", lambda m: m.dot(m.ones(2, 2), m.ones(2))),
    ("reshape", lambda m: m.ones(2, 3).reshape(4, 2)),
    ("view", lambda m: m.ones(6).view(4, -1)),
    ("stack", lambda m: m.stack([m.ones(2), m.ones(3)])),
    ("cat", lambda m: m.cat([m.ones(2, 2), m.ones(3, 3)], 0)),
    ("cat 0-d", lambda m: m.cat([m.tensor(1.0), m.tensor(2.0)])),
    ("broadcast_to", lambda m: m.ones(3).broadcast_to((2, 4))),
    ("setitem value shape", lambda m: m.ones(3, 2).__setitem__(0, m.ones(3))),
    ("compare", lambda m: m.ones(2, 3) < m.ones(4)),
    ("permute length", lambda m: m.ones(2, 3).permute(0, 1, 2)),
    ("grad_outputs shape", lambda m: (lambda x: m.autograd.grad(
        x * 2.0, [x], grad_outputs=m.ones(3)))(m.ones(2, requires_grad=True))),
    ("diag 3-D", lambda m: m.diag(m.ones(2, 2, 2))),
    ("item of many", lambda m: m.ones(2).item()),
    ("bool of many", lambda m: bool(m.ones(2))),
    ("int ** negative int", lambda m: m.tensor([1, 2]) ** -1),
    ("matmul int and float", lambda m: m.tensor([[1, 2]]) @ m.ones(2, 1)),
    ("mean of int", lambda m: m.tensor([1, 2]).mean()),
    ("where non-bool condition", lambda m: m.where(m.ones(2), m.ones(2), m.zeros(2))),
    ("max of empty", lambda m: m.max(m.ones(0))),
    ("clamp without bounds", lambda m: m.clamp(m.ones(2))),
]


@pytest.mark.parametrize("label,fn", SHAPE_MISMATCH, ids=[s[0] for s in SHAPE_MISMATCH])
def test_shape_mismatch_errors(label, fn):
    raises_like_torch(fn)


BAD_DIMS = [
    ("sum", lambda m: m.ones(2, 3).sum(dim=2)),
    ("sum negative", lambda m: m.ones(2, 3).sum(dim=-3)),
    ("sum tuple", lambda m: m.ones(2, 3).sum(dim=(0, 5))),
    ("mean", lambda m: m.ones(2, 3).mean(3)),
    ("prod", lambda m: m.ones(2, 3).prod(2)),
    ("max", lambda m: m.max(m.ones(2, 3), 2)),
    ("min", lambda m: m.ones(3).min(1)),
    ("norm", lambda m: m.norm(m.ones(2, 3), dim=4)),
    ("logsumexp", lambda m: m.logsumexp(m.ones(2), 1)),
    ("softmax", lambda m: m.softmax(m.ones(2, 3), 5)),
    ("log_softmax", lambda m: m.log_softmax(m.ones(2, 3), -3)),
    ("transpose", lambda m: m.ones(2, 3).transpose(0, 3)),
    ("permute", lambda m: m.ones(2, 3).permute(0, 2)),
    ("unsqueeze", lambda m: m.ones(2).unsqueeze(3)),
    ("squeeze", lambda m: m.ones(2, 1).squeeze(2)),
    ("stack", lambda m: m.stack([m.ones(2), m.ones(2)], 2)),
    ("cat", lambda m: m.cat([m.ones(2), m.ones(2)], 1)),
    ("size", lambda m: m.ones(2).size(1)),
    ("flatten", lambda m: m.ones(2, 3).flatten(0, 2)),
    ("0-d sum dim 1", lambda m: m.tensor(1.0).sum(1)),
]


@pytest.mark.parametrize("label,fn", BAD_DIMS, ids=[b[0] for b in BAD_DIMS])
def test_bad_dim_index_error(label, fn):
    err = raises_like_torch(fn)
    assert isinstance(err, IndexError)


BAD_INDEX = [
    ("int", lambda m: m.ones(3)[3]),
    ("negative int", lambda m: m.ones(3)[-4]),
    ("second dim", lambda m: m.ones(2, 3)[0, 3]),
    ("slice then int", lambda m: m.ones(2, 3)[:, 5]),
    ("too many indices", lambda m: m.ones(2, 3)[0, 0, 0]),
    ("int list", lambda m: m.ones(3)[[0, 5]]),
    ("int tensor", lambda m: m.ones(3)[m.tensor([5])]),
    ("negative int tensor", lambda m: m.ones(3)[m.tensor([-4])]),
    ("bool mask shape", lambda m: m.ones(3)[m.tensor([True, False])]),
    ("0-d int", lambda m: m.tensor(1.0)[0]),
    ("0-d requires_grad", lambda m: m.tensor(1.0, requires_grad=True)[0]),
    ("requires_grad int", lambda m: m.ones(3, requires_grad=True)[3]),
    ("setitem", lambda m: m.ones(3).__setitem__(3, 1.0)),
    ("setitem 2-D", lambda m: m.ones(2, 2).__setitem__((0, 2), 1.0)),
    ("float 0-d tensor index", lambda m: m.ones(3)[m.tensor(1.0)]),
]


@pytest.mark.parametrize("label,fn", BAD_INDEX, ids=[b[0] for b in BAD_INDEX])
def test_index_out_of_range(label, fn):
    err = raises_like_torch(fn)
    assert isinstance(err, IndexError)


def test_bad_input_raises_before_recording():
    """A failing op leaves no entry behind: later backward passes are unaffected."""
    x = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2.0
    with pytest.raises(RuntimeError):
        y + tapegrad.ones(3)
    with pytest.raises(IndexError):
        y.sum(dim=3)
    (g,) = tapegrad.autograd.grad(y.sum(), x)
    assert g.tolist() == [2.0, 2.0]


def test_to_unknown_device_and_bad_softplus_args_raise_like_torch():
    tg = tapegrad
    x = tg.ones(2)
    xt = torch.ones(2)
    for fn_tg, fn_torch, exc in [
        (lambda: x.to("nope"), lambda: xt.to("nope"), RuntimeError),
        (lambda: tg.softplus(x, beta="a"),
         lambda: torch.nn.functional.softplus(xt, beta="a"), TypeError),
    ]:
        with pytest.raises(exc):
            fn_torch()
        with pytest.raises(exc):
            fn_tg()
    assert x.to(tg.float32).dtype == tg.float32
    assert x.to("cpu") is x


def test_zero_fill_copy_overwrite_inf_and_nan(torch):
    """zero_/fill_/copy_ write the new values even over inf and NaN (not ``x * 0``), and an
    overwritten non-leaf keeps requiring grad, as torch."""
    import numpy as np
    import tapegrad as tg
    res = []
    for M in (tg, torch):
        a = M.tensor([np.inf, np.nan, -np.inf], dtype=M.float64)
        b, c, d = a.clone(), a.clone(), a.clone()
        b.zero_()
        c.fill_(2.0)
        d.copy_(M.tensor([1.0, 2.0, 3.0], dtype=M.float64))
        x = M.tensor([1.0, 2.0], dtype=M.float64, requires_grad=True)
        y = x * 2.0
        y.zero_()
        e = x * 1.0
        e.copy_(x * 3.0)
        g = M.autograd.grad((y + e).sum(), x)[0]
        res.append((b.tolist(), c.tolist(), d.tolist(), y.requires_grad, g.tolist()))
    assert res[0] == res[1]


# --- the float64 array operators' fast path (tensor._binary_general, warnings off by quiet) --

_F64_CASES = [
    ("a / b", lambda a, b: a / b), ("a ** b", lambda a, b: a ** b),
    ("a - 1", lambda a, b: a - 1), ("2 / a", lambda a, b: 2 / a), ("a ** 2", lambda a, b: a ** 2),
    ("0.5 - a", lambda a, b: 0.5 - a), ("a * s", lambda a, b: a * b.sum()),
    ("s ** a", lambda a, b: b.sum() ** a), ("a[:1] + b", lambda a, b: a[:1] + b),
]


@pytest.mark.parametrize("expr, f", _F64_CASES, ids=[c[0] for c in _F64_CASES])
def test_float64_array_operators_match_torch_without_warnings(expr, f):
    """Zeros, negatives and infinities where the forward divides by zero or takes a power of
    a negative base: values, requires_grad and gradients as torch's, and no NumPy warning."""
    av = np.array([0.0, -1.5, 2.0, np.inf, 3.0])
    bv = np.array([0.0, 0.5, -2.0, 1.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = []
        for M in (tapegrad, torch):
            a = M.tensor(av, dtype=M.float64, requires_grad=True)
            b = M.tensor(bv, dtype=M.float64, requires_grad=True)
            y = f(a, b)
            gs = M.autograd.grad(y.sum(), (a, b), allow_unused=True)
            ours.append((y, gs))
    (y, gs), (yt, gts) = ours
    same_tensor(y, yt)
    for g, gt in zip(gs, gts):
        assert (g is None) == (gt is None)
        if g is not None:
            np.testing.assert_allclose(g.numpy(), gt.numpy(), rtol=1e-12)


def test_float64_array_operators_without_grad_and_shape_errors():
    a = tapegrad.tensor([1.0, 2.0], dtype=tapegrad.float64, requires_grad=True)
    with tapegrad.no_grad():
        y = a * 3
    assert not y.requires_grad and y.grad_fn is None
    z = tapegrad.tensor([1.0, 2.0]) - 1  # nothing requires grad
    assert not z.requires_grad and z.tolist() == [0.0, 1.0]
    tape = (a * 1.0)._tape
    n = len(tape)
    with pytest.raises(RuntimeError, match="size of tensor a"):
        a + tapegrad.tensor([1.0, 2.0, 3.0])
    assert len(tape) == n  # nothing half-recorded
