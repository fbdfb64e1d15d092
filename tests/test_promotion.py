"""dtype promotion as torch.result_type (every dtype pair, 0-d tensors, Python numbers; the
results' dtypes and values, and gradients in each input's dtype), bool and integer inputs
where torch raises, and the factories' ``device=`` as torch's CPU build takes it.

torch runs with float64 as its default dtype here: tapegrad's default is float64, which is
where a Python float beside an integer tensor promotes to."""
import operator

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.tensor import result_dtype

torch = pytest.importorskip("torch")

DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
NUMBERS = {"py bool": True, "py int": 3, "py float": 2.5}


@pytest.fixture(autouse=True)
def _torch_default_float64():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(prev)


def _dt(M, name):
    return getattr(M, "bool_" if (M is tg and name == "bool") else name)


def _name(d):
    return str(d).split(".")[-1]


def make(M, spec):
    """An operand: ('int32', 'nd') a 1-d tensor, ('int32', '0d') a 0-d one, or a number."""
    if spec in NUMBERS:
        return NUMBERS[spec]
    name, kind = spec
    vals = [True, False, True] if name == "bool" else [2, 3, 1]
    return M.tensor(vals if kind == "nd" else vals[0], dtype=_dt(M, name))


OPERANDS = [(d, k) for d in DTYPES for k in ("nd", "0d")] + list(NUMBERS)
PAIRS = [(a, b) for a in OPERANDS for b in OPERANDS if a in DTYPES or not (
    a in NUMBERS and b in NUMBERS)]


def outcome(fn):
    """(dtype name, values) of a call, or the exception type it raised."""
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - compared with torch's
        return type(e), None
    return _name(r.dtype), np.asarray(r.detach().numpy() if hasattr(r, "detach") else r,
                                      dtype=np.float64)


def same(fn_tg, fn_torch, what):
    got, want = outcome(fn_tg), outcome(fn_torch)
    assert got[0] == want[0], f"{what}: tapegrad {got[0]}, torch {want[0]}"
    if got[1] is not None:
        tol = 1e-3 if got[0] == "float16" else 1e-6 if got[0] == "float32" else 1e-12
        np.testing.assert_allclose(got[1], want[1], rtol=tol, atol=tol, err_msg=what)


BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul,
    "truediv": operator.truediv, "pow": operator.pow,
    "maximum": lambda x, y, M: M.maximum(x, y), "minimum": lambda x, y, M: M.minimum(x, y),
    "atan2": lambda x, y, M: M.atan2(x, y),
    "lt": operator.lt, "eq": operator.eq,
}
TENSOR_ONLY = ("maximum", "minimum", "atan2")  # torch takes no Python number there


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_ops_promote_as_torch(name):
    f = BINARY[name]
    for a, b in PAIRS:
        if name in TENSOR_ONLY and (a in NUMBERS or b in NUMBERS):
            continue
        if name in TENSOR_ONLY:
            same(lambda: f(make(tg, a), make(tg, b), tg),
                 lambda: f(make(torch, a), make(torch, b), torch), f"{name}{a, b}")
        else:
            same(lambda: f(make(tg, a), make(tg, b)),
                 lambda: f(make(torch, a), make(torch, b)), f"{name}{a, b}")


def test_result_dtype_is_torch_result_type():
    for a, b in PAIRS:
        if a in NUMBERS and b in NUMBERS:
            continue
        x, y = make(tg, a), make(tg, b)
        xt, yt = make(torch, a), make(torch, b)
        assert _name(result_dtype(x, y)) == _name(torch.result_type(xt, yt)), (a, b)


def test_promote_types_is_torch_promote_types_with_complex():
    from tapegrad.tensor import promote_types
    names = DTYPES + ["complex64", "complex128"]
    for a in names:
        for b in names:
            got = promote_types(np.dtype(a), np.dtype(b))
            assert _name(got) == _name(torch.promote_types(getattr(torch, a),
                                                           getattr(torch, b))), (a, b)


def test_int64_times_float32_is_float32_and_its_gradient_too():
    """The report: NumPy's rule gave float64 (and a float32 gradient)."""
    for M in (tg, torch):
        i = M.tensor([1, 2, 3])
        w = M.tensor([0.5, 1.5, 2.5], dtype=M.float32, requires_grad=True)
        y = i * w
        assert _name(y.dtype) == "float32"
        (g,) = M.autograd.grad(y.sum(), w)
        assert _name(g.dtype) == "float32"
        np.testing.assert_array_equal(g.detach().numpy(), [1.0, 2.0, 3.0])


GRAD_OPS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
    "pow": lambda x, y: abs(x) ** y, "maximum": lambda x, y: torch_or_tg(x).maximum(x, y),
    "atan2": lambda x, y: torch_or_tg(x).atan2(x, y),
}


def torch_or_tg(x):
    return tg if isinstance(x, tg.Tensor) else torch


GRAD_SPECS = [(d, k) for d in ("float32", "float64") for k in ("nd", "0d")] + [
    ("int64", "nd"), ("int32", "0d"), "py int", "py float"]


def _grad_operand(M, spec):
    if spec in NUMBERS:
        return NUMBERS[spec], False
    name, kind = spec
    vals = [0.7, 1.3, 2.1] if kind == "nd" else 1.1
    if name.startswith("int"):
        return M.tensor([2, 3, 1] if kind == "nd" else 2, dtype=getattr(M, name)), False
    return M.tensor(vals, dtype=getattr(M, name), requires_grad=True), True


@pytest.mark.parametrize("name", list(GRAD_OPS))
def test_gradients_come_back_in_each_inputs_dtype(name):
    f = GRAD_OPS[name]
    for a in GRAD_SPECS:
        for b in GRAD_SPECS:
            if a in NUMBERS and b in NUMBERS:
                continue
            if name in ("maximum", "atan2") and (a in NUMBERS or b in NUMBERS):
                continue
            res = {}
            for M in (tg, torch):
                x, xr = _grad_operand(M, a)
                y, yr = _grad_operand(M, b)
                ins = [t for t, r in ((x, xr), (y, yr)) if r]
                if not ins:
                    continue
                out = f(x, y)
                gs = M.autograd.grad(out.sum(), ins)
                res[M] = (_name(out.dtype), [_name(g.dtype) for g in gs],
                          [g.detach().numpy().astype(np.float64) for g in gs])
            if not res:
                continue
            got, want = res[tg], res[torch]
            what = f"{name}{a, b}"
            assert got[0] == want[0], what
            assert got[1] == want[1], what
            # torch's rules read a float32 input as saved (atan2's x * x rounds to float32
            # beside a float64 y); tapegrad's read it converted, as the forward computed
            low = any(s not in NUMBERS and s[0] == "float32" for s in (a, b))
            for g, t in zip(got[2], want[2]):
                tol = 1e-5 if low else 1e-12
                np.testing.assert_allclose(g, t, rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("fn", ["where", "cat", "stack"])
def test_where_cat_stack_promote_as_torch(fn):
    for a in DTYPES:
        for b in DTYPES:
            for kinds in (("nd", "nd"), ("nd", "0d"), ("0d", "nd")) if fn == "where" else \
                    (("nd", "nd"),):
                def run(M):
                    x, y = make(M, (a, kinds[0])), make(M, (b, kinds[1]))
                    if fn == "where":
                        return M.where(M.tensor([True, False, True]), x, y)
                    return getattr(M, fn)([x, y])
                same(lambda: run(tg), lambda: run(torch), f"{fn}({a} {kinds[0]}, {b} {kinds[1]})")
    for num in NUMBERS.values():  # where with a Python number: the 0-d category rule
        for a in DTYPES:
            same(lambda: tg.where(tg.tensor([True, False, True]), make(tg, (a, "nd")), num),
                 lambda: torch.where(torch.tensor([True, False, True]), make(torch, (a, "nd")),
                                     num), f"where({a}, {num!r})")


UNARY = ["exp", "log", "sqrt", "sin", "tanh", "sigmoid", "relu", "abs", "sign", "square",
         "reciprocal", "neg", "clone"]


def test_unary_ops_on_bool_and_integer_tensors_as_torch():
    for d in DTYPES:
        for name in UNARY:
            same(lambda: getattr(tg, name)(make(tg, (d, "nd"))),
                 lambda: getattr(torch, name)(make(torch, (d, "nd"))), f"{name}({d})")
        same(lambda: -make(tg, (d, "nd")), lambda: -make(torch, (d, "nd")), f"-({d})")


REDUCTIONS = [("sum", {}), ("sum", {"dim": 0}), ("sum", {"dtype": "float32"}), ("mean", {}),
              ("mean", {"dtype": "float32"}), ("prod", {}), ("prod", {"dim": 0}),
              ("amax", {}), ("max", {}), ("min", {"dim": 0}), ("norm", {}),
              ("logsumexp", {"dim": 0}), ("softmax", {"dim": 0}),
              ("log_softmax", {"dim": 0}), ("softmax", {"dim": 0, "dtype": "float64"})]


def test_reductions_keep_or_promote_dtypes_as_torch():
    for d in DTYPES:
        for name, kw in REDUCTIONS:
            def run(M):
                k = {key: (getattr(M, v) if key == "dtype" else v) for key, v in kw.items()}
                r = getattr(M, name)(make(M, (d, "nd")), **k)
                return r[0] if isinstance(r, tuple) else r
            same(lambda: run(tg), lambda: run(torch), f"{name}({d}, {kw})")


def test_bool_subtraction_negation_and_pow_raise_as_torch():
    for fn, exc, match in [
        (lambda M: make(M, ("bool", "nd")) - make(M, ("bool", "nd")), RuntimeError,
         "Subtraction, the `-` operator, with two bool"),
        (lambda M: make(M, ("int64", "nd")) - True, RuntimeError, "with a bool tensor"),
        (lambda M: make(M, ("bool", "0d")) - 1.5, RuntimeError, "with a bool tensor"),
        (lambda M: M.tensor(1.5) - True, RuntimeError, "with a bool tensor"),
        (lambda M: -make(M, ("bool", "nd")), RuntimeError, "Negation"),
        (lambda M: make(M, ("bool", "nd")) ** make(M, ("bool", "nd")), NotImplementedError,
         "pow"),
    ]:
        for M in (tg, torch):
            with pytest.raises(exc, match=match):
                fn(M)


INPLACE = ["add_", "sub_", "mul_", "div_", "__iadd__", "__imul__", "__itruediv__"]


def test_in_place_ops_cast_into_self_as_torch():
    specs = ["bool", "int32", "int64", "float32", "float64"]
    for name in INPLACE:
        for a in specs:
            for b in specs + ["py int", "py float"]:
                def run(M):
                    x = make(M, (a, "nd"))
                    y = make(M, b) if b in NUMBERS else make(M, (b, "nd"))
                    getattr(x, name)(y)
                    return x
                same(lambda: run(tg), lambda: run(torch), f"{a}.{name}({b})")


def test_complex_numbers_raise_a_clear_type_error():
    x = tg.tensor([1.0, 2.0])
    for fn in (lambda: x * 1j, lambda: 1j + x, lambda: tg.mul(x, 2j), lambda: x ** 1j):
        with pytest.raises(TypeError, match="complex"):
            fn()


# --- device= --------------------------------------------------------------------------------

FACTORIES = {
    "tensor": lambda M, d: M.tensor([1.0, 2.0], device=d),
    "as_tensor": lambda M, d: M.as_tensor([1.0, 2.0], device=d),
    "zeros": lambda M, d: M.zeros(2, device=d),
    "ones": lambda M, d: M.ones(2, 3, device=d),
    "rand": lambda M, d: M.rand(2, device=d),
    "randn": lambda M, d: M.randn(2, device=d),
    "full": lambda M, d: M.full((2,), 1.5, device=d),
    "zeros_like": lambda M, d: M.zeros_like(M.ones(2), device=d),
    "ones_like": lambda M, d: M.ones_like(M.ones(2), device=d),
    "arange": lambda M, d: M.arange(3, device=d),
    "linspace": lambda M, d: M.linspace(0.0, 1.0, 3, device=d),
    "eye": lambda M, d: M.eye(2, device=d),
    "to": lambda M, d: M.ones(2).to(d),
}
DEVICES = [None, "cpu", "cpu:0", "cpu:1", "cuda", "cuda:0", "xpu", "mps", "hip", "foo", "CPU",
           " cpu", "cuda:x", "cpu:-1", 0, -1, 1.5]


@pytest.mark.parametrize("factory", list(FACTORIES))
def test_factories_take_device_as_torchs_cpu_build(factory):
    make_ = FACTORIES[factory]
    for d in DEVICES:
        if factory == "to" and (d is None or not isinstance(d, str)):
            continue
        want = None
        try:
            make_(torch, d)
        except Exception as e:  # noqa: BLE001 - compared with tapegrad's
            want = type(e)
        if want is None:
            assert make_(tg, d).device == "cpu", (factory, d)
        else:
            with pytest.raises(want):
                make_(tg, d)
    # torch.device objects too
    assert make_(tg, torch.device("cpu")).device == "cpu"


@pytest.mark.parametrize("factory", list(FACTORIES))
def test_meta_device_is_refused_clearly(factory):
    """torch makes shape-only tensors on 'meta'; tapegrad has none and must not silently make
    a CPU tensor instead."""
    assert FACTORIES[factory](torch, "meta").device.type == "meta"
    with pytest.raises(NotImplementedError, match="meta tensors .* not supported"):
        FACTORIES[factory](tg, "meta")
    with pytest.raises(NotImplementedError, match="meta"):
        FACTORIES[factory](tg, torch.device("meta"))


def test_device_errors_say_what_to_do():
    with pytest.raises(AssertionError, match="device='cpu'"):
        tg.tensor([1.0], device="cuda")
    with pytest.raises(RuntimeError, match="Expected one of cpu, cuda"):
        tg.zeros(2, device="gpu")
    with pytest.raises(TypeError, match="argument 'device' must be"):
        tg.ones(2, device=1.5)


@pytest.mark.parametrize("name", ["and_", "or_", "xor"])
def test_bitwise_operators_as_torch(name):
    """Logical on bools, bitwise on integers (6 & 3 is 2, not True), refused on floats."""
    f = getattr(operator, name)
    specs = [(d, k) for d in ("bool", "uint8", "int8", "int32", "int64", "float32", "float64")
             for k in ("nd", "0d")]
    for a in specs:
        for b in specs + [True, 3, 2.5]:
            def run(M):
                x = M.tensor([6, 0, 5] if a[1] == "nd" else 6, dtype=_dt(M, a[0]))
                y = b if not isinstance(b, tuple) else M.tensor(
                    [3, 1, 0] if b[1] == "nd" else 3, dtype=_dt(M, b[0]))
                return f(x, y)
            same(lambda: run(tg), lambda: run(torch), f"{name}({a}, {b!r})")


def test_result_dtype_with_python_complex_is_torch_result_type():
    for spec in OPERANDS:
        if spec in NUMBERS or spec[0] == "float16":  # torch's complex32: NumPy has none
            continue
        assert _name(result_dtype(make(tg, spec), 1j)) == _name(
            torch.result_type(make(torch, spec), 1j)), spec


def test_python_ints_wrap_into_integer_dtypes_as_torch():
    """NumPy raises OverflowError for uint8 + -1; torch wraps (a C cast)."""
    for fn in (lambda M: M.tensor([3], dtype=M.uint8) + (-1),
               lambda M: 300 + M.tensor([3], dtype=M.uint8),
               lambda M: M.tensor([3], dtype=M.int8) * 200,
               lambda M: M.tensor([3], dtype=M.uint8) - 5,
               lambda M: M.tensor([3], dtype=M.uint8) ** 9,
               lambda M: M.tensor(3, dtype=M.int16) * 70000,
               lambda M: M.tensor([3]) * 2 ** 63,
               lambda M: M.tensor([3], dtype=M.uint8) + 2 ** 70):
        same(lambda: fn(tg), lambda: fn(torch), "python int")


def test_max_and_min_with_other_are_elementwise():
    for name in ("max", "min"):
        def run(M):
            return getattr(M, name)(M.tensor([1, 2, 3]), other=M.tensor(
                [1.5, 1.5, 1.5], dtype=M.float32))
        same(lambda: run(tg), lambda: run(torch), name)


def test_softplus_refuses_integers_as_torch():
    for d in ("int64", "bool", "uint8"):
        with pytest.raises(NotImplementedError):
            torch.nn.functional.softplus(make(torch, (d, "nd")))
        with pytest.raises(NotImplementedError, match="softplus"):
            tg.softplus(make(tg, (d, "nd")))


def test_a_promoted_traced_mask_still_replays():
    """A bool mask times a float64 input promotes; the trace must still follow the mask."""
    for f in (lambda x: x * (x > 0), lambda x: (x > 0) * x):
        p = tg.trace(f, tg.tensor([1.0, -1.0, 2.0]))
        x2 = tg.tensor([-1.0, 1.0, 0.5])
        np.testing.assert_array_equal(p(x2).numpy(), f(x2).numpy())
