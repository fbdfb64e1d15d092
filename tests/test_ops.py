"""Every registered op against torch: values and first derivatives, scalar and array paths.

The table ``OP_TABLE`` says how each registered op is reached through the public API (in
tapegrad and in torch), which inputs it takes and where they are sampled.
``test_every_registered_op_is_covered`` fails when an op is registered without an entry, so
a new op cannot land untested. Internal helper ops are covered through the public API
that records them (``INDIRECT``).
"""
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as TF  # noqa: E402

import tapegrad  # noqa: E402
from tapegrad.ops import (ARRAY_OP, BINARY, BY_NAME, COMPARE, OPS, REPLAY, SPECIAL,  # noqa: E402
                          UNARY, UNARY_C)
from tapegrad.ops._registry import register  # noqa: E402

F64 = dict(rtol=1e-12, atol=1e-12)
F32 = dict(rtol=2e-5, atol=2e-6)
INF = float("inf")


# ---------------------------------------------------------------------------------------
# the two namespaces: every call in this file is written once as ``f(m, *tensors)``


class _TorchNS:
    """torch, with the few functions that live elsewhere in torch under tapegrad's names."""

    softplus = staticmethod(TF.softplus)

    def __getattr__(self, name):
        return getattr(torch, name)


TG, TH = tapegrad, _TorchNS()


# ---------------------------------------------------------------------------------------
# helpers


def _seed(*parts):
    return zlib.crc32("/".join(map(str, parts)).encode())


def _tg(a, requires_grad=False):
    a = np.asarray(a)
    if a.ndim == 0 and a.dtype == np.float64:
        return tapegrad.tensor(float(a), requires_grad=requires_grad)  # the Python-float path
    return tapegrad.tensor(a, requires_grad=requires_grad)


def _th(a, requires_grad=False):
    return torch.tensor(np.asarray(a), requires_grad=requires_grad)


def _np(t):
    return np.asarray(t.detach().numpy())


def _dtype_name(t):
    return str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else t.dtype.name


def assert_same(tg, th, tol, what="value"):
    """tapegrad tensor ``tg`` equals torch tensor ``th``: shape, dtype and values."""
    assert isinstance(tg, tapegrad.Tensor), f"{what}: expected a tapegrad.Tensor, got {tg!r}"
    assert tuple(tg.shape) == tuple(th.shape), f"{what}: shape {tg.shape} != torch {th.shape}"
    assert _dtype_name(tg) == _dtype_name(th), \
        f"{what}: dtype {_dtype_name(tg)} != torch {_dtype_name(th)}"
    np.testing.assert_allclose(_np(tg), th.detach().numpy(), equal_nan=True, err_msg=what,
                               **tol)


def check(fn, arrays, requires=None, tol=F64, seed=0, chain=False):
    """Run ``fn(m, *leaves)`` in tapegrad and torch on the same inputs; compare the values
    and the gradients (random ``grad_outputs``) with respect to the leaves that require grad.

    ``chain``: differentiate ``sum(sin(y) * y)`` instead of ``y`` (fan-out through the sweep).
    Returns the tapegrad output.
    """
    if requires is None:
        requires = [True] * len(arrays)
    tg_in = [_tg(a, r) for a, r in zip(arrays, requires)]
    th_in = [_th(a, r) for a, r in zip(arrays, requires)]
    tg_out = fn(TG, *tg_in)
    th_out = fn(TH, *th_in)
    assert_same(tg_out, th_out, tol)
    if not any(requires):
        assert not tg_out.requires_grad
        return tg_out
    assert tg_out.requires_grad == th_out.requires_grad
    tg_w = [t for t, r in zip(tg_in, requires) if r]
    th_w = [t for t, r in zip(th_in, requires) if r]
    if chain:
        tg_y, th_y = tapegrad.sin(tg_out) * tg_out, torch.sin(th_out) * th_out
    else:
        tg_y, th_y = tg_out, th_out
    g = np.random.default_rng(seed).standard_normal(tuple(th_y.shape)).astype(
        th_y.detach().numpy().dtype)
    tg_g = tapegrad.autograd.grad(tg_y, tg_w, grad_outputs=_tg(g))
    th_g = torch.autograd.grad(th_y, th_w, grad_outputs=torch.from_numpy(np.array(g)))
    assert len(tg_g) == len(th_g)
    for i, (a, b) in enumerate(zip(tg_g, th_g)):
        assert a is not None, f"gradient {i} is None"
        assert not a.requires_grad
        assert_same(a, b, tol, what=f"gradient {i}")
    return tg_out


# torch's node names where they are not the op's name (checked against torch in test_dropin)
_TORCH_NODE = {"square": "PowBackward0", "pow": "PowBackward1", "clamp": "ClampBackward1",
               "clamp_min_t": "ClampMinBackward1", "clamp_max_t": "ClampMaxBackward1",
               "mulc": "MulBackward0", "rsubc": "RsubBackward1", "divc": "DivBackward0",
               "rdivc": "MulBackward0", "powc": "PowBackward0", "powc_special": "PowBackward0",
               "rpowc": "PowBackward2"}


def _grad_fn_name(op_name):
    if op_name == "addc":  # x + c or x - c
        return ("AddBackward0", "SubBackward0")
    if op_name in _TORCH_NODE:
        return (_TORCH_NODE[op_name],)
    return ("".join(p.capitalize() for p in op_name.rstrip("_").split("_")) + "Backward0",)


# ---------------------------------------------------------------------------------------
# input domains


def U(lo, hi):
    return lambda rng, shape: np.asarray(rng.uniform(lo, hi, shape), dtype=np.float64)


def AWAY(lo, hi):
    """|x| in [lo, hi), either sign (away from a singular point at 0)."""
    return lambda rng, shape: np.asarray(
        rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape), dtype=np.float64)


REAL = U(-3.0, 3.0)
POS = U(0.2, 3.0)
NONZERO = AWAY(0.2, 3.0)
UNIT = U(-0.9, 0.9)


class Elementwise:
    """An elementwise op: call forms ``(label, f(m, *xs))`` and one domain per input."""

    def __init__(self, kind, forms, domains):
        self.kind, self.forms, self.domains = kind, forms, domains


class Covered:
    """An array op, tested by the named test functions of this module."""

    kind = ARRAY_OP

    def __init__(self, *tests):
        self.tests = tests


def _unary(name, domain, extra=()):
    return Elementwise(UNARY, [(name, lambda m, x: getattr(m, name)(x)),
                               (f"x.{name}()", lambda m, x: getattr(x, name)()),
                               *extra], [domain])


OP_TABLE = {
    # --- unary ---
    "neg": _unary("neg", REAL, [("-x", lambda m, x: -x)]),
    "exp": _unary("exp", U(-3, 3)),
    "log": _unary("log", POS),
    "log1p": _unary("log1p", U(-0.8, 3)),
    "expm1": _unary("expm1", REAL),
    "sqrt": _unary("sqrt", POS),
    "rsqrt": _unary("rsqrt", POS),
    "sin": _unary("sin", REAL),
    "cos": _unary("cos", REAL),
    "tan": _unary("tan", U(-1.3, 1.3)),
    "asin": _unary("asin", UNIT, [("arcsin", lambda m, x: m.arcsin(x))]),
    "acos": _unary("acos", UNIT, [("arccos", lambda m, x: m.arccos(x))]),
    "atan": _unary("atan", REAL, [("arctan", lambda m, x: m.arctan(x))]),
    "sinh": _unary("sinh", REAL),
    "cosh": _unary("cosh", REAL),
    "tanh": _unary("tanh", REAL),
    "sigmoid": _unary("sigmoid", U(-6, 6)),
    "relu": _unary("relu", NONZERO),
    "erf": _unary("erf", REAL),
    "abs": _unary("abs", NONZERO, [("abs(x)", lambda m, x: abs(x))]),
    "sign": _unary("sign", NONZERO),
    "square": _unary("square", REAL),
    "reciprocal": _unary("reciprocal", NONZERO),
    "clone": _unary("clone", REAL),
    # --- unary with constants: a tensor and a Python number ---
    "addc": Elementwise(UNARY_C, [
        ("x + 2.5", lambda m, x: x + 2.5),
        ("2.5 + x", lambda m, x: 2.5 + x),
        ("x - 1.5", lambda m, x: x - 1.5),
        ("x + 3 (int)", lambda m, x: x + 3),
        ("add(x, 2.5)", lambda m, x: m.add(x, 2.5)),
        ("sub(x, 1.5)", lambda m, x: m.sub(x, 1.5)),
    ], [REAL]),
    "mulc": Elementwise(UNARY_C, [
        ("x * 3.0", lambda m, x: x * 3.0),
        ("-0.5 * x", lambda m, x: -0.5 * x),
        ("x * 2 (int)", lambda m, x: x * 2),
        ("mul(x, 1.25)", lambda m, x: m.mul(x, 1.25)),
    ], [REAL]),
    "rsubc": Elementwise(UNARY_C, [
        ("2.0 - x", lambda m, x: 2.0 - x),
        ("-1 - x (int)", lambda m, x: -1 - x),
    ], [REAL]),
    "divc": Elementwise(UNARY_C, [
        ("x / 4.0", lambda m, x: x / 4.0),
        ("x / -0.3", lambda m, x: x / -0.3),
        ("div(x, 3)", lambda m, x: m.div(x, 3)),
    ], [REAL]),
    "rdivc": Elementwise(UNARY_C, [
        ("2.0 / x", lambda m, x: 2.0 / x),
        ("1 / x (int)", lambda m, x: 1 / x),
    ], [NONZERO]),
    "powc": Elementwise(UNARY_C, [
        ("x ** 2.0", lambda m, x: x ** 2.0),
        ("x ** -1.5", lambda m, x: abs(x) ** -1.5),
        ("x ** 0", lambda m, x: x ** 0),
        ("x ** 1", lambda m, x: x ** 1),
        ("x ** 4 (int)", lambda m, x: x ** 4),
        ("pow(x, 2.5)", lambda m, x: m.pow(abs(x), 2.5)),
        ("x.pow(-1.0)", lambda m, x: x.pow(-1.0)),
    ], [NONZERO]),
    "powc_special": Elementwise(UNARY_C, [
        ("x ** 3 (int)", lambda m, x: x ** 3),
        ("x ** 0.5", lambda m, x: abs(x) ** 0.5),
        ("x ** -0.5", lambda m, x: abs(x) ** -0.5),
        ("x ** -2", lambda m, x: x ** -2),
        ("x ** 1.5", lambda m, x: abs(x) ** 1.5),
        ("x.pow(3.0)", lambda m, x: x.pow(3.0)),
        ("pow(x, 0.5)", lambda m, x: m.pow(abs(x), 0.5)),
    ], [NONZERO]),
    "rpowc": Elementwise(UNARY_C, [
        ("2.0 ** x", lambda m, x: 2.0 ** x),
        ("0.5 ** x", lambda m, x: 0.5 ** x),
        ("3 ** x (int)", lambda m, x: 3 ** x),
        ("pow(2.5, x)", lambda m, x: m.pow(2.5, x)),
    ], [REAL]),
    "clamp": Elementwise(UNARY_C, [
        ("clamp(x, -0.5, 0.5)", lambda m, x: m.clamp(x, -0.5, 0.5)),
        ("clamp(x, min=0.1)", lambda m, x: m.clamp(x, min=0.1)),
        ("clamp(x, max=-0.2)", lambda m, x: m.clamp(x, max=-0.2)),
        ("x.clamp(-1, 1)", lambda m, x: x.clamp(-1, 1)),
        ("clip(x, -2.0, 0.7)", lambda m, x: m.clip(x, -2.0, 0.7)),
        ("x.clamp_min(0.3)", lambda m, x: x.clamp_min(0.3)),
        ("x.clamp_max(0.3)", lambda m, x: x.clamp_max(0.3)),
    ], [REAL]),
    "softplus": Elementwise(UNARY_C, [
        ("softplus(x)", lambda m, x: m.softplus(x)),
        ("softplus(x, beta=2, threshold=5)", lambda m, x: m.softplus(x, beta=2.0, threshold=5.0)),
        ("softplus(x, beta=0.5, threshold=1)",
         lambda m, x: m.softplus(x, beta=0.5, threshold=1.0)),
        ("softplus(x, beta=3, threshold=-2)",
         lambda m, x: m.softplus(x, beta=3.0, threshold=-2.0)),
    ], [U(-4, 4)]),
    # --- binary (broadcasting) ---
    "add": Elementwise(BINARY, [("x + y", lambda m, x, y: x + y),
                                ("add(x, y)", lambda m, x, y: m.add(x, y)),
                                ("x.add(y)", lambda m, x, y: x.add(y))], [REAL, REAL]),
    "sub": Elementwise(BINARY, [("x - y", lambda m, x, y: x - y),
                                ("sub(x, y)", lambda m, x, y: m.sub(x, y))], [REAL, REAL]),
    "mul": Elementwise(BINARY, [("x * y", lambda m, x, y: x * y),
                                ("mul(x, y)", lambda m, x, y: m.mul(x, y))], [REAL, REAL]),
    "div": Elementwise(BINARY, [("x / y", lambda m, x, y: x / y),
                                ("div(x, y)", lambda m, x, y: m.div(x, y))], [REAL, NONZERO]),
    "pow": Elementwise(BINARY, [("x ** y", lambda m, x, y: x ** y),
                                ("pow(x, y)", lambda m, x, y: m.pow(x, y)),
                                ("x.pow(y)", lambda m, x, y: x.pow(y))], [POS, U(-2, 2)]),
    "atan2": Elementwise(BINARY, [("atan2(x, y)", lambda m, x, y: m.atan2(x, y)),
                                  ("arctan2(x, y)", lambda m, x, y: m.arctan2(x, y))],
                         [REAL, REAL]),
    "maximum": Elementwise(BINARY, [("maximum(x, y)", lambda m, x, y: m.maximum(x, y)),
                                    ("max(x, y)", lambda m, x, y: m.max(x, y))], [REAL, REAL]),
    "minimum": Elementwise(BINARY, [("minimum(x, y)", lambda m, x, y: m.minimum(x, y)),
                                    ("min(x, y)", lambda m, x, y: m.min(x, y))], [REAL, REAL]),
    "clamp_min_t": Elementwise(BINARY, [
        ("clamp(x, min=y)", lambda m, x, y: m.clamp(x, min=y)),
        ("clamp_min(x, y)", lambda m, x, y: m.clamp_min(x, y))], [REAL, REAL]),
    "clamp_max_t": Elementwise(BINARY, [
        ("clamp(x, max=y)", lambda m, x, y: m.clamp(x, max=y)),
        ("clamp(x, min=y-1, max=y)", lambda m, x, y: m.clamp(x, min=y - 1.0, max=y)),
        ("x.clamp_max(y)", lambda m, x, y: x.clamp_max(y))], [REAL, REAL]),
    # --- array ops ---
    "reshape": Covered("test_reshape_and_view"),
    "transpose": Covered("test_transpose_permute_T"),
    "permute": Covered("test_transpose_permute_T"),
    "stack": Covered("test_stack"),
    "cat": Covered("test_cat"),
    "diag": Covered("test_diag"),
    "where": Covered("test_where"),
    "sum": Covered("test_sum_mean"),
    "mean": Covered("test_sum_mean"),
    "prod": Covered("test_prod"),
    "amax": Covered("test_max_min_full", "test_max_min_dim", "test_amax_amin_dim"),
    "amin": Covered("test_max_min_full", "test_max_min_dim", "test_amax_amin_dim"),
    "norm": Covered("test_norm"),
    "logsumexp": Covered("test_logsumexp"),
    "softmax": Covered("test_softmax"),
    "log_softmax": Covered("test_softmax"),
    "matmul": Covered("test_matmul", "test_dot"),
    "outer": Covered("test_outer"),
    "cross": Covered("test_cross"),
}

#: internal helper ops, covered through the public API that records them
INDIRECT = {
    "expand": ("test_expand", "test_binary_array_path"),
    "sum_to": ("test_binary_array_path", "test_expand", "test_matmul"),
    "cast": ("test_type_conversion",),
    "getitem": ("test_getitem",),
    "index_scatter": ("test_getitem", "test_diag"),
    "setitem": ("test_setitem_on_clone",),
    "prod_others": ("test_prod",),
    "function": ("test_custom_function_entries",),
    "function_out": ("test_custom_function_entries", "test_program_entries"),
    "program": ("test_program_entries",),
}


def test_custom_function_entries():
    """``function``/``function_out`` entries come from autograd.Function (tests/test_function.py
    has the full suite); here, one two-output Function against torch."""
    res = []
    for m in (tapegrad, torch):
        class TwoOut(m.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x, x.sin()

            @staticmethod
            def backward(ctx, ga, gb):
                (x,) = ctx.saved_tensors
                return 2.0 * x * ga + x.cos() * gb

        x = m.tensor(np.array([0.3, -1.2]), requires_grad=True)
        a, b = TwoOut.apply(x)
        res.append(m.autograd.grad((a * b).sum(), x)[0].detach().numpy())
    np.testing.assert_allclose(res[0], res[1], rtol=1e-12)


def test_program_entries():
    # a traced Program called on tensors records one ``program`` entry: first and second
    # derivatives and batched gradients through it, against torch on the same function
    def f(a, b):
        return (a.sin() * b).sum(), a * b + b.exp()
    rng = np.random.default_rng(3)
    x0, y0 = rng.normal(size=4), rng.normal(size=4)
    prog = tapegrad.trace(f, x0, y0)
    x = tapegrad.tensor(x0, requires_grad=True)
    xt = torch.tensor(x0, requires_grad=True)
    yt = torch.tensor(y0)
    s, v = prog(x, y0)
    st, vt = f(xt, yt)
    np.testing.assert_allclose(v.detach().numpy(), vt.detach().numpy(), rtol=1e-14)
    g, = tapegrad.autograd.grad(s * 2.0 + (v * v).sum(), x, create_graph=True)
    gt, = torch.autograd.grad(st * 2.0 + (vt * vt).sum(), xt, create_graph=True)
    np.testing.assert_allclose(g.detach().numpy(), gt.detach().numpy(), rtol=1e-12)
    h, = tapegrad.autograd.grad((g * g).sum(), x)
    ht, = torch.autograd.grad((gt * gt).sum(), xt)
    np.testing.assert_allclose(h.numpy(), ht.numpy(), rtol=1e-12)
    seeds = rng.normal(size=(3, 4))
    s, v = prog(x, y0)
    st, vt = f(xt, yt)
    gb, = tapegrad.autograd.grad(v, x, grad_outputs=tapegrad.tensor(seeds),
                                 is_grads_batched=True)
    gbt, = torch.autograd.grad(vt, xt, grad_outputs=torch.tensor(seeds), is_grads_batched=True)
    np.testing.assert_allclose(gb.numpy(), gbt.numpy(), rtol=1e-12)


def test_every_registered_op_is_covered():
    # ops only traced programs contain are covered by tests/test_replay.py
    registered = {op.name for op in OPS if op.kind not in (SPECIAL, COMPARE, REPLAY)}
    covered = set(OP_TABLE) | set(INDIRECT)
    assert not registered - covered, f"registered ops without a test: {registered - covered}"
    assert not covered - registered, f"table entries for unknown ops: {covered - registered}"
    assert not set(OP_TABLE) & set(INDIRECT)
    for name, spec in OP_TABLE.items():
        assert spec.kind == BY_NAME[name].kind, f"{name}: table kind {spec.kind} != registry"
        if isinstance(spec, Elementwise):
            arity = {UNARY: 1, UNARY_C: 1, BINARY: 2}[spec.kind]
            assert len(spec.domains) == arity
            assert spec.forms
    for name, tests in [(n, s.tests) for n, s in OP_TABLE.items() if isinstance(s, Covered)] + \
            list(INDIRECT.items()):
        for t in tests:
            assert callable(globals().get(t)), f"{name}: no test function {t}"


def test_every_differentiable_op_has_a_rule():
    # create_graph differentiates rules again, so no op may lack one (issue 3)
    missing = [op.name for op in OPS if op.kind not in (SPECIAL, COMPARE, REPLAY)
               and op.vjp is None]
    assert not missing
    with pytest.raises(ValueError, match="needs a derivative rule"):
        register("no_rule_op", ARRAY_OP, np=lambda a, aux: a)
    assert "no_rule_op" not in BY_NAME


def test_registry_torch_names_exist():
    for op in OPS:
        if op.torch is not None:
            assert hasattr(torch, op.torch) or hasattr(TF, op.torch), op


# ---------------------------------------------------------------------------------------
# elementwise ops: 0-d scalar path (compiled sweep) and array path (broadcasting)

ELEMENTWISE = [(name, label, fn, spec) for name, spec in OP_TABLE.items()
               if isinstance(spec, Elementwise) for label, fn in spec.forms]
_EW_IDS = [f"{name}[{label}]" for name, label, _, _ in ELEMENTWISE]


def _requires_sets(spec):
    if spec.kind == BINARY:
        return [(True, True), (True, False), (False, True)]
    return [(True,)]


@pytest.mark.parametrize("name,label,fn,spec", ELEMENTWISE, ids=_EW_IDS)
def test_elementwise_scalar_path(name, label, fn, spec):
    """0-d float64 inputs: Python floats on the tape, differentiated by the compiled sweep."""
    rng = np.random.default_rng(_seed(name, label, "scalar"))
    for requires in _requires_sets(spec):
        for i in range(4):
            xs = [d(rng, ()) for d in spec.domains]
            for chain in (False, True):
                out = check(fn, xs, list(requires), seed=i, chain=chain)
                assert isinstance(out._d, float), "0-d float64 result left the scalar path"
            if all(requires):
                assert out.grad_fn is not None
                assert out.grad_fn.name() in _grad_fn_name(name)


def _bcast_shapes(rng):
    nd = int(rng.integers(1, 4))
    base = [int(s) for s in rng.integers(2, 5, nd)]
    a = list(base)
    b = list(base[int(rng.integers(0, nd + 1)):])
    for s in (a, b):
        for i in range(len(s)):
            if rng.random() < 0.3:
                s[i] = 1
    return (tuple(a), tuple(b)) if rng.random() < 0.5 else (tuple(b), tuple(a))


UNARY_SHAPES = [(5,), (3, 4), (2, 3, 4), (1,), (0,)]
BINARY_SHAPES = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((4,), (2, 3, 4)), ((3, 1), (1, 4)),
                 ((), (2, 3)), ((2, 3), ()), ((2, 1, 3), (4, 1)), ((5,), (1,))] + \
    [_bcast_shapes(np.random.default_rng(s)) for s in range(4)]


@pytest.mark.parametrize("shape", UNARY_SHAPES, ids=str)
@pytest.mark.parametrize("name,label,fn,spec",
                         [e for e in ELEMENTWISE if e[3].kind != BINARY],
                         ids=[i for i, e in zip(_EW_IDS, ELEMENTWISE) if e[3].kind != BINARY])
def test_unary_array_path(name, label, fn, spec, shape):
    rng = np.random.default_rng(_seed(name, label, shape))
    out = check(fn, [spec.domains[0](rng, shape)], seed=1)
    assert out.grad_fn.name() in _grad_fn_name(name)
    check(fn, [spec.domains[0](rng, shape)], seed=2, chain=True)


@pytest.mark.parametrize("shapes", BINARY_SHAPES, ids=str)
@pytest.mark.parametrize("name,label,fn,spec",
                         [e for e in ELEMENTWISE if e[3].kind == BINARY],
                         ids=[i for i, e in zip(_EW_IDS, ELEMENTWISE) if e[3].kind == BINARY])
def test_binary_array_path(name, label, fn, spec, shapes):
    rng = np.random.default_rng(_seed(name, label, shapes))
    xs = [d(rng, s) for d, s in zip(spec.domains, shapes)]
    out = check(fn, xs, seed=3)
    assert out.grad_fn.name() in _grad_fn_name(name)
    for requires in ([True, False], [False, True]):
        check(fn, xs, requires, seed=4)


@pytest.mark.parametrize("name,label,fn,spec", ELEMENTWISE, ids=_EW_IDS)
def test_elementwise_float32(name, label, fn, spec):
    rng = np.random.default_rng(_seed(name, label, "f32"))
    shapes = [(3, 4), (4,)][:len(spec.domains)]
    xs = [d(rng, s).astype(np.float32) for d, s in zip(spec.domains, shapes)]
    check(fn, xs, tol=F32, seed=5)
    xs0 = [d(rng, ()).astype(np.float32) for d in spec.domains]  # 0-d float32
    check(fn, xs0, tol=F32, seed=6)


_BINARY_EW = [e for e in ELEMENTWISE if e[3].kind == BINARY]
_BINARY_IDS = [i for i, e in zip(_EW_IDS, ELEMENTWISE) if e[3].kind == BINARY]


@pytest.mark.parametrize("name,label,fn,spec", _BINARY_EW, ids=_BINARY_IDS)
def test_binary_float32_with_float64_scalar(name, label, fn, spec):
    """A float32 array beside a 0-d float64 tensor stays float32 (torch's 0-d rule), and the
    0-d leaf's gradient is float64."""
    rng = np.random.default_rng(_seed(name, label, "mixed"))
    x32, y64 = spec.domains[0](rng, (3, 4)).astype(np.float32), spec.domains[1](rng, ())
    check(fn, [x32, y64], tol=F32, seed=7)
    x64, y32 = spec.domains[0](rng, ()), spec.domains[1](rng, (4,)).astype(np.float32)
    check(fn, [x64, y32], tol=F32, seed=8)
    x0, y0 = spec.domains[0](rng, ()).astype(np.float32), spec.domains[1](rng, ())
    check(fn, [x0, y0], tol=F32, seed=9)  # both 0-d: float64 wins


@pytest.mark.parametrize("name,label,fn,spec", _BINARY_EW, ids=_BINARY_IDS)
@pytest.mark.parametrize("shape", [(), (3, 2)], ids=str)
def test_binary_same_input_twice(name, label, fn, spec, shape):
    """``f(x, x)``: both gradients land on one leaf (one slot read twice by one entry)."""
    rng = np.random.default_rng(_seed(name, label, "twice", shape))
    dom = spec.domains[1] if spec.domains[0] is REAL else spec.domains[0]
    check(lambda m, a: fn(m, a, a), [dom(rng, shape)], seed=12)
    check(lambda m, a: fn(m, a, a), [dom(rng, shape)], seed=13, chain=True)


#: binary ops torch also accepts with a Python number operand (atan2, maximum... do not)
_NUMBER_OK = ("add", "sub", "mul", "div", "pow")


@pytest.mark.parametrize("name,label,fn,spec",
                         [e for e in _BINARY_EW if e[0] in _NUMBER_OK],
                         ids=[i for i, e in zip(_BINARY_IDS, _BINARY_EW) if e[0] in _NUMBER_OK])
@pytest.mark.parametrize("shape", [(), (3, 2)], ids=str)
def test_binary_python_number_operand(name, label, fn, spec, shape):
    """A Python number on either side of a binary op (scalar and array paths)."""
    rng = np.random.default_rng(_seed(name, label, "number", shape))
    x, y = spec.domains[0](rng, shape), float(spec.domains[1](rng, ()))
    check(lambda m, a: fn(m, a, y), [x], seed=9)
    check(lambda m, a: fn(m, a, int(round(y)) or 1), [x], seed=10)
    if label.startswith("x "):  # an operator: the number may sit on the left
        x0, yy = float(spec.domains[0](rng, ())), spec.domains[1](rng, shape)
        check(lambda m, b: fn(m, x0, b), [yy], seed=11)


# ---------------------------------------------------------------------------------------
# reductions

REDUCE_CASES = [((), None, False), ((), 0, False), ((), -1, True), ((0,), None, False),
                ((2, 0), 1, False), ((2, 0), 0, True), ((5,), None, False), ((5,), 0, False),
                ((5,), 0, True),
                ((3, 4), None, False), ((3, 4), 1, False), ((3, 4), -1, True),
                ((3, 4), 0, True), ((2, 3, 4), (0, 2), False), ((2, 3, 4), (2, 0), True),
                ((2, 3, 4), 1, False), ((2, 3, 4), None, True), ((2, 3, 4), (-1,), False)]


@pytest.mark.parametrize("shape,dim,keepdim", REDUCE_CASES, ids=str)
@pytest.mark.parametrize("fname", ["sum", "mean"])
def test_sum_mean(fname, shape, dim, keepdim):
    rng = np.random.default_rng(_seed(fname, shape, dim, keepdim))
    x = REAL(rng, shape)
    if dim is None and not keepdim:
        check(lambda m, a: getattr(m, fname)(a), [x], seed=1)
        check(lambda m, a: getattr(a, fname)(), [x], seed=2)
    check(lambda m, a: getattr(m, fname)(a, dim=dim, keepdim=keepdim), [x], seed=3)
    check(lambda m, a: getattr(a, fname)(dim, keepdim), [x], seed=4)
    check(lambda m, a: getattr(m, fname)(a, dim=dim, keepdim=keepdim),
          [x.astype(np.float32)], tol=F32, seed=5)


@pytest.mark.parametrize("fname", ["sum", "mean"])
def test_sum_mean_dtype_argument(fname):
    x = REAL(np.random.default_rng(23), (3, 4))
    check(lambda m, a: getattr(m, fname)(a, dtype=m.float32), [x], tol=F32)
    check(lambda m, a: getattr(a, fname)(1, dtype=m.float32), [x], tol=F32)
    check(lambda m, a: getattr(m, fname)(a, 0, dtype=m.float64), [x.astype(np.float32)],
          tol=F32)


PROD_ARRAYS = {
    "random": REAL(np.random.default_rng(0), (3, 4)),
    "one_zero": np.array([[1.5, 0.0, 2.0, -3.0], [0.5, 2.0, -1.0, 4.0], [1.0, 1.0, 1.0, 1.0]]),
    "two_zeros_in_a_row": np.array([[0.0, 2.0, 0.0, 3.0], [1.0, -2.0, 0.5, 4.0],
                                    [2.0, 0.0, 1.5, 1.0]]),
    "all_zero": np.zeros((3, 4)),
    "zero_column": np.array([[0.0, 2.0, 1.0, 3.0], [0.0, -2.0, 0.5, 4.0],
                             [0.0, 1.0, 1.5, 1.0]]),
}


@pytest.mark.parametrize("dim,keepdim", [(None, False), (0, False), (1, False), (-1, True),
                                         (0, True)], ids=str)
@pytest.mark.parametrize("which", list(PROD_ARRAYS))
def test_prod(which, dim, keepdim):
    x = PROD_ARRAYS[which]
    if dim is None:
        check(lambda m, a: m.prod(a), [x], seed=1)
        check(lambda m, a: a.prod(), [x], seed=2)
    else:
        check(lambda m, a: m.prod(a, dim, keepdim=keepdim), [x], seed=3)
        check(lambda m, a: a.prod(dim=dim, keepdim=keepdim), [x], seed=4)
    for shape in [(), (5,)]:
        check(lambda m, a: m.prod(a), [REAL(np.random.default_rng(1), shape)], seed=5)


def test_prod_float32():
    x = PROD_ARRAYS["one_zero"].astype(np.float32)
    check(lambda m, a: m.prod(a, 1), [x], tol=F32)
    check(lambda m, a: m.prod(a), [x], tol=F32)


MAXMIN_ARRAYS = {
    "distinct": REAL(np.random.default_rng(3), (3, 4)),
    "ties": np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, -5.0, -5.0, 4.0]]),
    "ties_3d": np.random.default_rng(4).integers(0, 3, (2, 3, 4)).astype(np.float64),
    "vector": np.array([0.5, -2.0, 7.0, 7.0, -2.0]),
}


@pytest.mark.parametrize("which", list(MAXMIN_ARRAYS))
@pytest.mark.parametrize("fname", ["max", "min"])
def test_max_min_full(fname, which):
    x = MAXMIN_ARRAYS[which]
    check(lambda m, a: getattr(m, fname)(a), [x], seed=1)
    check(lambda m, a: getattr(a, fname)(), [x], seed=2)
    check(lambda m, a: getattr(m, "a" + fname)(a), [x], seed=3)
    check(lambda m, a: getattr(m, fname)(a), [x.astype(np.float32)], tol=F32, seed=4)


def test_max_min_full_0d():
    for fname in ("max", "min"):
        check(lambda m, a: getattr(m, fname)(a), [np.asarray(1.25)])


@pytest.mark.parametrize("dim,keepdim", [(0, False), (1, False), (-1, False), (0, True),
                                         (1, True), (-1, True)], ids=str)
@pytest.mark.parametrize("which", list(MAXMIN_ARRAYS))
@pytest.mark.parametrize("fname", ["max", "min"])
def test_max_min_dim(fname, which, dim, keepdim):
    x = MAXMIN_ARRAYS[which]
    if x.ndim == 1 and dim not in (0, -1):
        pytest.skip("1-D input has one dim")
    check(lambda m, a: getattr(m, fname)(a, dim, keepdim).values, [x], seed=1)
    check(lambda m, a: getattr(a, fname)(dim=dim, keepdim=keepdim)[0], [x], seed=2)
    tg_idx = getattr(tapegrad, fname)(_tg(x), dim, keepdim).indices
    th_idx = getattr(torch, fname)(_th(x), dim, keepdim).indices
    assert_same(tg_idx, th_idx, dict(rtol=0, atol=0), what="indices")


@pytest.mark.parametrize("dim,keepdim", [(0, False), (1, False), (-1, True), ((0, 1), False),
                                         ((1, 0), True)], ids=str)
@pytest.mark.parametrize("which", [w for w in MAXMIN_ARRAYS if w != "vector"])
@pytest.mark.parametrize("fname", ["amax", "amin"])
def test_amax_amin_dim(fname, which, dim, keepdim):
    """torch's amax/amin split the gradient evenly over ties (unlike max(dim))."""
    x = MAXMIN_ARRAYS[which]
    check(lambda m, a: getattr(m, fname)(a, dim, keepdim), [x], seed=1)
    check(lambda m, a: getattr(a, fname)(dim=dim, keepdim=keepdim), [x], seed=2)


NORM_PS = [2, 1, INF, -INF, 3, 0.5, 0, "fro"]
NORM_DIMS = [(None, False), (0, False), (1, True), (-1, False), ((0, 1), False),
             ((0, 1), True)]


@pytest.mark.parametrize("dim,keepdim", NORM_DIMS, ids=str)
@pytest.mark.parametrize("p", NORM_PS, ids=str)
def test_norm(p, dim, keepdim):
    rng = np.random.default_rng(_seed("norm", p, dim, keepdim))
    x = NONZERO(rng, (3, 4))
    ord_ = 2 if p == "fro" else p

    def tg_fn(m, a):
        return tapegrad.norm(a, p=p, dim=dim, keepdim=keepdim)

    def th_fn(m, a):
        return torch.linalg.vector_norm(a, ord=ord_, dim=dim, keepdim=keepdim)

    def both(m, a):
        return (tg_fn if m is TG else th_fn)(m, a)
    if p == 0:  # a count: its graph reaches x, but the gradient is undefined (torch's None)
        tg_x = _tg(x, True)
        assert_same(tg_fn(TG, tg_x), th_fn(TH, _th(x)), F64)
        out = tg_fn(TG, tg_x)
        assert out.requires_grad
        go = tapegrad.ones_like(out)
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            tapegrad.autograd.grad(out, tg_x, grad_outputs=go, retain_graph=True)
        assert tapegrad.autograd.grad(out, tg_x, go, retain_graph=True,
                                      allow_unused=True) == (None,)
        g = tapegrad.autograd.grad(out, tg_x, go, allow_unused=True, materialize_grads=True)[0]
        assert g.tolist() == np.zeros(g.shape).tolist()
        return
    check(both, [x], seed=1)
    check(both, [x.astype(np.float32)], tol=F32, seed=2)
    if dim is None or isinstance(dim, int):
        check(lambda m, a: m.norm(a, p, dim, keepdim), [x], seed=3)  # torch.norm itself


@pytest.mark.parametrize("p", [2, 1, INF, 3], ids=str)
def test_norm_vector_and_0d(p):
    rng = np.random.default_rng(_seed("normv", p))
    check(lambda m, a: m.norm(a, p), [NONZERO(rng, (5,))])
    check(lambda m, a: a.norm(p), [NONZERO(rng, (5,))])
    check(lambda m, a: m.norm(a, p), [np.asarray(-1.5)])


LSE_CASES = [((5,), 0, False), ((3, 4), 1, False), ((3, 4), -1, True), ((3, 4), 0, True),
             ((2, 3, 4), (0, 2), False), ((2, 3, 4), (1, 2), True), ((), 0, False)]


@pytest.mark.parametrize("shape,dim,keepdim", LSE_CASES, ids=str)
def test_logsumexp(shape, dim, keepdim):
    rng = np.random.default_rng(_seed("lse", shape, dim, keepdim))
    x = REAL(rng, shape)
    check(lambda m, a: m.logsumexp(a, dim, keepdim), [x], seed=1)
    check(lambda m, a: a.logsumexp(dim, keepdim=keepdim), [x], seed=2)
    check(lambda m, a: m.logsumexp(a, dim, keepdim), [x + 1000.0], seed=3)  # stability
    check(lambda m, a: m.logsumexp(a, dim, keepdim), [x.astype(np.float32)], tol=F32, seed=4)


SOFTMAX_CASES = [((5,), 0), ((3, 4), 1), ((3, 4), 0), ((3, 4), -1), ((2, 3, 4), 1), ((), 0)]


@pytest.mark.parametrize("shape,dim", SOFTMAX_CASES, ids=str)
@pytest.mark.parametrize("fname", ["softmax", "log_softmax"])
def test_softmax(fname, shape, dim):
    rng = np.random.default_rng(_seed(fname, shape, dim))
    x = REAL(rng, shape)
    check(lambda m, a: getattr(m, fname)(a, dim), [x], seed=1)
    check(lambda m, a: getattr(a, fname)(dim), [x], seed=2)
    check(lambda m, a: getattr(m, fname)(a, dim), [x * 300.0], seed=3)  # stability
    check(lambda m, a: getattr(m, fname)(a, dim), [x.astype(np.float32)], tol=F32, seed=4)


# ---------------------------------------------------------------------------------------
# linear algebra

MATMUL_SHAPES = [((4,), (4,)), ((4,), (4, 3)), ((3, 4), (4,)), ((3, 4), (4, 5)),
                 ((2, 3, 4), (2, 4, 5)), ((2, 3, 4), (1, 4, 5)), ((1, 3, 4), (2, 4, 5)),
                 ((3, 4), (2, 4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)),
                 ((2, 3, 4), (4,)), ((4,), (2, 4, 5)), ((1, 4), (4, 1)),
                 ((3, 0), (0, 4)), ((0, 3), (3,)), ((2, 0, 3), (3, 2))]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul(shapes):
    rng = np.random.default_rng(_seed("matmul", shapes))
    a, b = (REAL(rng, s) for s in shapes)
    check(lambda m, x, y: m.matmul(x, y), [a, b], seed=1)
    check(lambda m, x, y: x @ y, [a, b], seed=2)
    check(lambda m, x, y: x.matmul(y), [a, b], [True, False], seed=3)
    check(lambda m, x, y: x @ y, [a, b], [False, True], seed=4)
    check(lambda m, x, y: x @ y, [a.astype(np.float32), b.astype(np.float32)], tol=F32, seed=5)


def test_dot():
    rng = np.random.default_rng(11)
    a, b = REAL(rng, (6,)), REAL(rng, (6,))
    check(lambda m, x, y: m.dot(x, y), [a, b])
    check(lambda m, x, y: x.dot(y), [a, b], [False, True], chain=True)
    check(lambda m, x, y: m.dot(x, y), [a.astype(np.float32), b.astype(np.float32)], tol=F32)


def test_outer():
    rng = np.random.default_rng(12)
    a, b = REAL(rng, (4,)), REAL(rng, (3,))
    check(lambda m, x, y: m.outer(x, y), [a, b])
    check(lambda m, x, y: x.outer(y), [a, b], [True, False])
    check(lambda m, x, y: m.outer(x, y), [a, b], [False, True])
    check(lambda m, x, y: m.outer(x, y), [a.astype(np.float32), b.astype(np.float32)], tol=F32)


def test_cross():  # (bit for bit: tests/test_cross.py)
    rng = np.random.default_rng(13)
    a, b = REAL(rng, (4, 3)), REAL(rng, (4, 3))
    check(lambda m, x, y: m.linalg.cross(x, y), [a, b], chain=True)
    check(lambda m, x, y: m.cross(x, y, dim=0), [a.T.copy(), b.T.copy()], [True, False])
    check(lambda m, x, y: x.cross(y, 1), [a[:1], b], [False, True])
    check(lambda m, x, y: m.linalg.cross(x, y), [a.astype(np.float32), b.astype(np.float32)],
          tol=F32)


# ---------------------------------------------------------------------------------------
# shapes

RESHAPES = [
    ("reshape(6, 4)", (2, 3, 4), lambda m, a: m.reshape(a, (6, 4))),
    ("reshape(-1)", (2, 3, 4), lambda m, a: a.reshape(-1)),
    ("reshape(4, -1)", (2, 3, 4), lambda m, a: a.reshape(4, -1)),
    ("view(3, 8)", (2, 3, 4), lambda m, a: a.view(3, 8)),
    ("view((2, 12))", (2, 3, 4), lambda m, a: a.view((2, 12))),
    ("0-d reshape(1)", (), lambda m, a: a.reshape(1)),
    ("reshape to 0-d", (1, 1), lambda m, a: a.reshape(())),
    ("flatten", (2, 3, 4), lambda m, a: m.flatten(a)),
    ("flatten(1)", (2, 3, 4), lambda m, a: a.flatten(1)),
    ("squeeze", (2, 1, 3, 1), lambda m, a: a.squeeze()),
    ("squeeze(1)", (2, 1, 3), lambda m, a: m.squeeze(a, 1)),
    ("unsqueeze(0)", (2, 3), lambda m, a: a.unsqueeze(0)),
    ("unsqueeze(-1)", (2, 3), lambda m, a: m.unsqueeze(a, -1)),
    ("view_as", (2, 3, 4), lambda m, a: a.view_as(m.zeros(4, 6))),
]


@pytest.mark.parametrize("label,shape,fn", RESHAPES, ids=[r[0] for r in RESHAPES])
def test_reshape_and_view(label, shape, fn):
    x = REAL(np.random.default_rng(_seed(label)), shape)
    check(fn, [x], seed=1)
    check(fn, [x.astype(np.float32)], tol=F32, seed=2)


TRANSPOSES = [
    ("transpose(0, 2)", (2, 3, 4), lambda m, a: m.transpose(a, 0, 2)),
    ("transpose(-1, 0)", (2, 3, 4), lambda m, a: a.transpose(-1, 0)),
    ("transpose(0, 1) 2-D", (3, 4), lambda m, a: a.transpose(0, 1)),
    ("transpose(0, 0)", (3, 4), lambda m, a: a.transpose(0, 0)),
    ("permute(2, 0, 1)", (2, 3, 4), lambda m, a: m.permute(a, (2, 0, 1))),
    ("x.permute(1, 2, 0)", (2, 3, 4), lambda m, a: a.permute(1, 2, 0)),
    ("permute(-1, 0, 1)", (2, 3, 4), lambda m, a: a.permute(-1, 0, 1)),
    ("T 2-D", (3, 4), lambda m, a: a.T),
    ("T 1-D", (4,), lambda m, a: a.T * 1.0),
    ("t()", (3, 4), lambda m, a: a.t()),
    ("t(x)", (3, 4), lambda m, a: m.t(a)),
    ("mT", (2, 3, 4), lambda m, a: a.mT),
    ("T then matmul", (3, 4), lambda m, a: a.T @ a),
]


@pytest.mark.filterwarnings("ignore:The use of `x.T`:UserWarning")
@pytest.mark.parametrize("label,shape,fn", TRANSPOSES, ids=[r[0] for r in TRANSPOSES])
def test_transpose_permute_T(label, shape, fn):
    x = REAL(np.random.default_rng(_seed(label)), shape)
    check(fn, [x], seed=1)
    check(fn, [x.astype(np.float32)], tol=F32, seed=2)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
@pytest.mark.parametrize("requires", [(True, True, True), (True, False, True)], ids=str)
def test_stack(dim, requires):
    rng = np.random.default_rng(_seed("stack", dim))
    xs = [REAL(rng, (3, 4)) for _ in range(3)]
    check(lambda m, *ts: m.stack(list(ts), dim), xs, list(requires), seed=1)
    check(lambda m, *ts: m.stack(ts, dim=dim), [x.astype(np.float32) for x in xs],
          list(requires), tol=F32, seed=2)


def test_stack_0d_scalar_path():
    """Python-float leaves into an array op, and back to 0-d through indexing."""
    rng = np.random.default_rng(13)
    xs = [REAL(rng, ()) for _ in range(4)]
    check(lambda m, *ts: m.stack(list(ts)), xs, seed=1)
    check(lambda m, a, b, c, d: (m.stack([a * b, c, m.sin(d)]) ** 2).sum() * a, xs, seed=2)
    check(lambda m, a, b, c, d: m.stack([a, b, c, d])[2] * c, xs, seed=3)


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("requires", [(True, True, True), (False, True, False)], ids=str)
def test_cat(dim, requires):
    rng = np.random.default_rng(_seed("cat", dim))
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for i, n in enumerate((1, 2, 3)):
        shapes[i][dim] = n
    xs = [REAL(rng, tuple(s)) for s in shapes]
    check(lambda m, *ts: m.cat(list(ts), dim), xs, list(requires), seed=1)
    check(lambda m, *ts: m.cat(ts, dim=dim), [x.astype(np.float32) for x in xs],
          list(requires), tol=F32, seed=2)
    check(lambda m, *ts: m.concat(list(ts), dim), xs, list(requires), seed=3)


def test_cat_with_empty():
    rng = np.random.default_rng(21)
    check(lambda m, a, b: m.cat([a, b, a]), [REAL(rng, (2,)), REAL(rng, (0,))])
    check(lambda m, a, b: m.cat([a, b], 1), [REAL(rng, (2, 3)), REAL(rng, (2, 0))])


REDUCE_0D = [
    ("prod(x, 0)", lambda m, a: m.prod(a, 0)),
    ("max(x, 0)", lambda m, a: m.max(a, 0).values),
    ("min(x, -1, keepdim)", lambda m, a: m.min(a, -1, keepdim=True).values),
    ("amax(x, 0)", lambda m, a: m.amax(a, 0)),
    ("norm(x, 2, 0)", lambda m, a: m.norm(a, 2, 0)),
    ("logsumexp(x, -1)", lambda m, a: m.logsumexp(a, -1)),
    ("softmax(x, -1)", lambda m, a: m.softmax(a, -1)),
    ("log_softmax(x, 0)", lambda m, a: m.log_softmax(a, 0)),
]


@pytest.mark.parametrize("label,fn", REDUCE_0D, ids=[r[0] for r in REDUCE_0D])
def test_reductions_over_0d_with_dim(label, fn):
    """torch accepts dim 0 / -1 on a 0-d tensor."""
    check(fn, [np.asarray(-0.75)])


def test_cat_same_tensor_twice():
    check(lambda m, a: m.cat([a, a * 2.0, a], 0), [REAL(np.random.default_rng(14), (3,))])


DIAG_CASES = [((4,), 0), ((4,), 1), ((4,), -1), ((4,), 3), ((4,), -2), ((1,), 0),
              ((4, 4), 0), ((4, 4), 1), ((4, 4), -2), ((3, 5), 0), ((3, 5), 2), ((3, 5), -1),
              ((5, 3), 0), ((5, 3), -3), ((5, 3), 1)]


@pytest.mark.parametrize("shape,k", DIAG_CASES, ids=str)
def test_diag(shape, k):
    x = REAL(np.random.default_rng(_seed("diag", shape, k)), shape)
    check(lambda m, a: m.diag(a, k), [x], seed=1)
    check(lambda m, a: a.diag(diagonal=k), [x], seed=2)
    check(lambda m, a: m.diag(a, k), [x.astype(np.float32)], tol=F32, seed=3)


def test_diag_roundtrip():
    check(lambda m, a: m.diag(m.diag(a)) * a, [REAL(np.random.default_rng(15), (4, 4))])


# ---------------------------------------------------------------------------------------
# where, broadcasting, dtype conversion


WHERE_CASES = [
    ("tensors", [(3, 4), (3, 4), (3, 4)], lambda m, c, x, y: m.where(c, x, y)),
    ("broadcast", [(3, 1), (4,), (3, 4)], lambda m, c, x, y: m.where(c, x, y)),
    ("broadcast_cond", [(3, 4), (1, 4), (3, 1)], lambda m, c, x, y: m.where(c, x, y)),
    ("0-d branch", [(3, 4), (), (3, 4)], lambda m, c, x, y: m.where(c, x, y)),
    ("number other", [(3, 4), (3, 4), (3, 4)], lambda m, c, x, y: m.where(c, x, 0.0) + y),
    ("number input", [(3, 4), (3, 4), (3, 4)], lambda m, c, x, y: m.where(c, -1.5, y) * x),
    ("cond from compare", [(3, 4), (3, 4), (3, 4)],
     lambda m, c, x, y: m.where(x > y, x, y * 2.0)),
    ("same tensor", [(3, 4), (3, 4), (3, 4)], lambda m, c, x, y: m.where(c, x, x * y)),
    ("x.where", [(3, 4), (3, 4), (3, 4)], lambda m, c, x, y: m.where(c, x.exp(), y.sin())),
]


@pytest.mark.parametrize("label,shapes,fn", WHERE_CASES, ids=[w[0] for w in WHERE_CASES])
def test_where(label, shapes, fn):
    rng = np.random.default_rng(_seed("where", label))
    c = rng.random(shapes[0]) < 0.5
    x, y = REAL(rng, shapes[1]), REAL(rng, shapes[2])

    def f(m, a, b):
        return fn(m, m.tensor(c), a, b)
    check(f, [x, y], seed=1)
    check(f, [x, y], [True, False], seed=2)
    check(f, [x.astype(np.float32), y.astype(np.float32)], tol=F32, seed=3)


def test_where_0d_scalar_path():
    check(lambda m, a, b: m.where(a > b, a * b, m.sin(b)), [np.asarray(1.5), np.asarray(-0.5)])
    check(lambda m, a, b: m.where(a < b, a * b, m.sin(b)), [np.asarray(1.5), np.asarray(-0.5)])


EXPANDS = [
    ("broadcast_to", (3, 1), lambda m, a: m.broadcast_to(a, (2, 3, 4))),
    ("expand", (3, 1), lambda m, a: a.expand(3, 4)),
    ("expand -1", (1, 4), lambda m, a: a.expand(2, 3, -1)),
    ("expand_as", (4,), lambda m, a: a.expand_as(m.zeros(3, 4))),
    ("expand 0-d", (), lambda m, a: a.expand(2, 3)),
    ("broadcast in add", (3, 1), lambda m, a: a + m.ones(2, 3, 4, dtype=a.dtype)),
    ("broadcast in mul", (1, 4), lambda m, a: a * m.ones(3, 1, dtype=a.dtype) * a),
]


@pytest.mark.parametrize("label,shape,fn", EXPANDS, ids=[e[0] for e in EXPANDS])
def test_expand(label, shape, fn):
    x = REAL(np.random.default_rng(_seed(label)), shape)
    check(fn, [x], seed=1)
    check(fn, [x.astype(np.float32)], tol=F32, seed=2)


CASTS = [
    ("float()", np.float64, lambda m, a: a.float() * 2.5),
    ("double()", np.float32, lambda m, a: a.double() * 2.5),
    ("float().double()", np.float64, lambda m, a: a.float().double() ** 2),
    ("to(float32)", np.float64, lambda m, a: a.to(m.float32).exp()),
    ("to(float64)", np.float32, lambda m, a: a.to(m.float64).sin()),
    ("float() mixed", np.float64, lambda m, a: a.float() * a),
    ("double() same", np.float64, lambda m, a: a.double() * a),
]


@pytest.mark.parametrize("label,dtype,fn", CASTS, ids=[c[0] for c in CASTS])
@pytest.mark.parametrize("shape", [(), (3, 4)], ids=str)
def test_type_conversion(label, dtype, fn, shape):
    x = REAL(np.random.default_rng(_seed(label)), shape).astype(dtype)
    check(fn, [x], tol=F32, seed=1)


def test_type_conversion_keeps_leaf_grad_dtype():
    x = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    (g,) = tapegrad.autograd.grad((x.float() * 3.0).sum(), x)
    assert g.dtype is tapegrad.float64
    y = tapegrad.tensor(np.array([1.0, 2.0], dtype=np.float32), requires_grad=True)
    (g,) = tapegrad.autograd.grad((y.double() * 3.0).sum(), y)
    assert g.dtype is tapegrad.float32


# ---------------------------------------------------------------------------------------
# indexing


MASK = np.array([[True, False, True, True], [False, False, True, False],
                 [True, True, False, False]])

GETITEMS = [
    ("int", (4, 5), lambda m: 1),
    ("negative int", (4, 5), lambda m: -1),
    ("slice", (6,), lambda m: slice(1, 5)),
    ("slice step", (7,), lambda m: slice(0, 7, 2)),
    ("slice negative bounds", (7,), lambda m: slice(-5, -1)),
    ("slices 2-D", (4, 5), lambda m: (slice(1, 3), slice(None, None, 2))),
    ("int and slice", (4, 5), lambda m: (2, slice(1, 4))),
    ("two ints", (4, 5), lambda m: (2, -2)),
    ("empty slice", (4,), lambda m: slice(2, 2)),
    ("int list with repeats", (5,), lambda m: [0, 2, 2, 4, 0]),
    ("int tensor with repeats", (5, 3), lambda m: m.tensor([3, 3, 1, 3])),
    ("negative int tensor", (5,), lambda m: m.tensor([-1, 0, -1])),
    ("2-D int tensor index", (5,), lambda m: m.tensor([[0, 1], [1, 4]])),
    ("paired int tensors with repeats", (4, 5),
     lambda m: (m.tensor([0, 0, 3, 0]), m.tensor([1, 1, 4, 1]))),
    ("int tensor then slice", (3, 4, 5), lambda m: (slice(None), m.tensor([0, 2, 2]),
                                                    slice(1, 3))),
    ("separated int tensors", (3, 4, 5), lambda m: (m.tensor([0, 1]), slice(None),
                                                    m.tensor([2, 2]))),
    ("0-d int tensor", (4, 3), lambda m: m.tensor(2)),
    ("two int lists", (3, 4), lambda m: ([0, 2, 2], [1, 3, 1])),
    ("numpy int array", (5,), lambda m: np.array([0, 2, 2])),
    ("bool list", (3, 4), lambda m: [True, False, True]),
    ("bool mask", (3, 4), lambda m: m.tensor(MASK)),
    ("bool mask rows", (3, 4), lambda m: m.tensor([True, False, True])),
    ("bool mask all false", (3, 4), lambda m: m.tensor(np.zeros((3, 4), dtype=bool))),
    ("bool mask from compare", (3, 4), lambda m: m.tensor(MASK) | m.tensor(MASK.T[:3, :1])),
    ("None", (3, 4), lambda m: (None, slice(None))),
    ("None middle", (3, 4), lambda m: (slice(None), None, slice(1, 3))),
    ("Ellipsis", (2, 3, 4), lambda m: (Ellipsis, 1)),
    ("int Ellipsis None", (2, 3, 4), lambda m: (0, Ellipsis, None)),
    ("Ellipsis alone", (2, 3), lambda m: Ellipsis),
    ("0-d Ellipsis", (), lambda m: Ellipsis),
    ("0-d None", (), lambda m: None),
]


@pytest.mark.parametrize("label,shape,index", GETITEMS, ids=[g[0] for g in GETITEMS])
def test_getitem(label, shape, index):
    x = REAL(np.random.default_rng(_seed("getitem", label)), shape)
    check(lambda m, a: a[index(m)], [x], seed=1)
    check(lambda m, a: a[index(m)] * 2.0 + a[index(m)], [x], seed=2)  # two reads accumulate
    check(lambda m, a: a[index(m)], [x.astype(np.float32)], tol=F32, seed=3)


def test_getitem_of_result_and_scalar_chain():
    x = REAL(np.random.default_rng(16), (3, 4))
    check(lambda m, a: m.sin(a * 2.0)[1:, ::2].sum() * a[0, 0], [x])
    check(lambda m, a: a[1, 2] * a[0, 0] + m.exp(a[2, 3]), [x], chain=True)


SETITEMS = [
    ("int", (4, 5), lambda m: 1, (5,)),
    ("int broadcast value", (4, 5), lambda m: 1, (1,)),
    ("slice", (6,), lambda m: slice(1, 4), (3,)),
    ("slice broadcast value", (4, 5), lambda m: slice(1, 3), (5,)),
    ("2-D slices", (4, 5), lambda m: (slice(1, 3), slice(None, None, 2)), (2, 3)),
    ("element", (4, 5), lambda m: (2, 3), ()),
    ("0-d value into row", (4, 5), lambda m: (0, slice(None)), ()),
    ("int list", (5,), lambda m: [0, 3], (2,)),
    ("repeated int list, 0-d value", (5,), lambda m: [0, 0, 2], ()),
    ("int tensor rows", (5, 3), lambda m: m.tensor([4, 1]), (2, 3)),
    ("bool mask", (3, 4), lambda m: m.tensor(MASK), (int(MASK.sum()),)),
    ("bool mask scalar value", (3, 4), lambda m: m.tensor(MASK), ()),
    ("Ellipsis", (2, 3, 4), lambda m: (Ellipsis, 0), (2, 3)),
    ("None", (3, 4), lambda m: (None, 1), (1, 4)),
    ("0-d Ellipsis", (), lambda m: Ellipsis, ()),
    ("0-d empty tuple", (), lambda m: (), ()),
]


@pytest.mark.parametrize("label,shape,index,vshape", SETITEMS, ids=[s[0] for s in SETITEMS])
def test_setitem_on_clone(label, shape, index, vshape):
    rng = np.random.default_rng(_seed("setitem", label))
    x, v = REAL(rng, shape), REAL(rng, vshape)

    def f(m, a, b):
        y = a.clone()
        y[index(m)] = b
        return y * y

    check(f, [x, v], seed=1)
    check(f, [x, v], [True, False], seed=2)
    check(f, [x, v], [False, True], seed=3)
    check(f, [x.astype(np.float32), v.astype(np.float32)], tol=F32, seed=4)

    def number(m, a):
        y = a * 1.0
        y[index(m)] = 0.5
        return y.exp()
    check(number, [x], seed=5)


def test_setitem_twice_and_read_back():
    x = REAL(np.random.default_rng(17), (4, 3))

    def f(m, a, b):
        y = a.clone()
        y[0] = b
        y[1:3, 1] = b[:2] * 2.0
        return y[0:2] * y[2:4]
    check(f, [x, REAL(np.random.default_rng(18), (3,))])


# ---------------------------------------------------------------------------------------
# in-place ops on non-leaves

INPLACE = [
    ("+=", lambda y, z: y.__iadd__(z)),
    ("-=", lambda y, z: y.__isub__(z)),
    ("*=", lambda y, z: y.__imul__(z)),
    ("/=", lambda y, z: y.__itruediv__(z)),
]


@pytest.mark.parametrize("shapes", [((), ()), ((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 4), ())],
                         ids=str)
@pytest.mark.parametrize("label,op", INPLACE, ids=[i[0] for i in INPLACE])
def test_inplace_on_nonleaf(label, op, shapes):
    rng = np.random.default_rng(_seed("inplace", label, shapes))
    x, z = REAL(rng, shapes[0]), NONZERO(rng, shapes[1])

    def f(m, a, b):
        y = a * 1.5
        r = op(y, b)
        assert r is y
        return y * a

    def number(m, a):
        y = m.sin(a)
        r = op(y, 2.5)
        assert r is y
        return y

    check(f, [x, z], seed=1)
    check(f, [x, z], [True, False], seed=2)
    check(f, [x, z], [False, True], seed=3)
    check(number, [x], seed=4)
    check(f, [x.astype(np.float32), z.astype(np.float32)], tol=F32, seed=5)


@pytest.mark.parametrize("label,op", INPLACE, ids=[i[0] for i in INPLACE])
def test_inplace_through_index(label, op):
    """``y[idx] op= v``: Python reads y[idx], updates it in place, assigns it back."""
    rng = np.random.default_rng(_seed("inplace index", label))

    def f(m, a, b):
        y = a * 1.0
        r = y[1:3]
        y[1:3] = op(r, b)
        return y * a

    check(f, [REAL(rng, (4, 3)), NONZERO(rng, (3,))])


def test_inplace_on_view_writes_through():
    """A basic-slice view shares memory with its base, like torch's: an in-place change
    through the view shows in the base and in the base's gradient."""
    rng = np.random.default_rng(22)

    def f(m, a, b):
        y = a * 2.0
        v = y[0]
        v += b
        return y

    check(f, [REAL(rng, (3, 2)), REAL(rng, (2,))])


def test_inplace_on_view_writes_through_no_grad():
    rng = np.random.default_rng(24)

    def g(m, a):
        with m.no_grad():
            y = a * 2.0
            v = y[1:]
            v *= 0.0
            w = y.reshape(6)
            w[0] = 7.0
        return y * a
    check(g, [REAL(rng, (3, 2))])


def test_inplace_chain():
    rng = np.random.default_rng(19)

    def f(m, a, b):
        y = a * 2.0 + 1.0  # nothing saved: torch allows changing it in place
        y += b
        y *= a
        y -= 1.0
        y /= b * b + 1.0
        return y

    check(f, [REAL(rng, (3, 4)), REAL(rng, (3, 4))])
    check(f, [REAL(rng, ()), REAL(rng, ())])


def test_inplace_method_forms():
    rng = np.random.default_rng(20)

    def f(m, a, b):
        y = a * 1.0
        y.add_(b).mul_(b).sub_(0.5).div_(2.0)
        return y
    check(f, [REAL(rng, (3,)), REAL(rng, (3,))])
