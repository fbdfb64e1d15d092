"""Each derivative stated once, in the registry: the one sum-to-broadcast axis rule, what
torch saves (each op's ``torch_saves``), and the elementwise forms of scatter rules
(``scatter``) that the flat sweep and the array sweep's views run; each checked against
torch, the op's own rule, or the general sweep."""
import itertools

import numpy as np
import pytest

import tapegrad
from tapegrad.autograd import paths
from tapegrad.interpreters import _codegen, cpu
from tapegrad.ops import BY_NAME, OPS, NpF
from tapegrad.ops.arrays import sum_axes, sum_to

torch = pytest.importorskip("torch")

_SHAPES = [(), (1,), (3,), (1, 3), (2, 1), (2, 3), (4, 2, 3), (4, 1, 3), (1, 1, 1)]


@pytest.mark.parametrize("want,have", [(w, h) for w, h in itertools.product(_SHAPES, _SHAPES)
                                       if np.broadcast_shapes(w, h) == h])
def test_sum_to_is_broadcasting_in_reverse(want, have):
    """sum_to(g, want) is the adjoint of broadcasting ``want`` to ``have``, as torch's
    sum_to_size; with a leading batch axis kept (``keep=1``) the same axes shifted by one."""
    g = np.arange(1.0, 1.0 + np.prod(have)).reshape(have)
    ref = torch.tensor(g).sum_to_size(want).numpy() if want else g.sum()
    np.testing.assert_array_equal(sum_to(g, want), ref)
    axes = sum_axes((5,) + have, (5,) + want, 1)
    assert axes == tuple(a + 1 for a in sum_axes(have, want))


# --- what torch saves: an in-place change after recording raises exactly where torch's does


def _saved_case(M, name, which):
    x = M.tensor(np.array([[0.3, -0.7, 1.2], [0.5, 0.1, -0.4]]), requires_grad=True)
    h = x * 1.0
    if name == "relu":
        r = M.relu(h)
    elif name == "rdivc":
        r = 2.0 / h
    elif name == "softmax":
        r = M.softmax(h, 1)
    elif name == "log_softmax":
        r = M.log_softmax(h, 1)
    elif name == "matmul":  # w requires grad: h is saved for w's gradient
        r = M.matmul(h, M.tensor(np.ones((3, 2)), requires_grad=True))
    elif name == "matmul_const":  # w does not: torch saves w only
        r = M.matmul(h, M.tensor(np.ones((3, 2))))
    elif name == "outer_const":
        r = M.outer(h[0], M.tensor(np.ones(2)))
    elif name == "mul_const":  # h * w saves w only, where w does not require grad
        r = h * M.tensor(np.full(3, 1.5))
    elif name == "mul_both":
        r = h * (x * 2.0)
    elif name == "div_const":  # h / w saves w only; w / h saves both
        r = h / M.tensor(np.full(3, 1.5))
    elif name == "rdiv_tensor":
        r = M.tensor(np.full(3, 1.5)) / h
    elif name == "pow_const":  # h ** w: torch saves h, w and the result
        r = h ** M.tensor(np.full(3, 2.0))
    elif name == "amax_dim":
        r = M.amax(h, 1)
    elif name == "max_dim":
        r = M.max(h, 1)[0]
    elif name == "amax":
        r = M.max(h)
    elif name == "prod":
        r = M.prod(h)
    elif name == "logsumexp":
        r = M.logsumexp(h, 1)
    y = r.sum()
    with M.no_grad():
        (h if which == "in" else r).mul_(2.0)
    try:
        y.backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        return "raised"
    return x.grad.numpy()


#: a known difference: an elementwise op saves what its whole rule reads, where torch's
#: ``h * w`` with w a constant saves w only; tapegrad raises after h changes (composites
#: such as binary_cross_entropy_with_logits, whose torch kernel saves its input, rely on it)
_SAVES_BOTH = {("mul_const", "in"), ("div_const", "in")}


@pytest.mark.parametrize("name", ["relu", "rdivc", "softmax", "log_softmax", "matmul",
                                  "matmul_const", "outer_const", "mul_both", "rdiv_tensor",
                                  "pow_const", "amax_dim", "max_dim", "amax", "prod",
                                  "logsumexp", "mul_const", "div_const"])
@pytest.mark.parametrize("which", ["in", "out"])
def test_inplace_change_raises_where_torch_saved_it(name, which):
    ref = _saved_case(torch, name, which)
    got = _saved_case(tapegrad, name, which)
    if (name, which) in _SAVES_BOTH:
        assert not isinstance(ref, str) and got == "raised"
    elif isinstance(ref, str):
        assert got == ref
    else:
        assert not isinstance(got, str), f"raised where torch ({name}, {which}) did not"
        np.testing.assert_allclose(got, ref, rtol=1e-13, atol=1e-15)


def test_torch_saves_is_declared_per_op():
    """The engine's table is the ops' fields: an op without one saves what its rule reads."""
    assert BY_NAME["relu"].saved() == {"out"}
    assert BY_NAME["exp"].saved() == {"out"}
    assert BY_NAME["mul"].saved() == {"a", "b"}
    assert BY_NAME["matmul"].saved(grads=("b",)) == {"a"}  # b's gradient reads a
    assert BY_NAME["matmul"].saved(grads=()) == frozenset()
    assert BY_NAME["amax"].saved((None, False, np.array([0]))) == frozenset()
    assert BY_NAME["amax"].saved((None, False, None)) == {"a", "out"}
    for op in OPS:
        if op.torch_saves is not None and not callable(op.torch_saves):
            assert op.saved() <= {"a", "b", "out"}, op


# --- scatter forms: the flat sweep's and a view's adjoint, from the registry -------------


def _index_cases():
    rng = np.random.default_rng(0)
    a = rng.normal(size=9)
    for index in (slice(1, 7), slice(None, None, 2), slice(8, 0, -3), 4, -2, (slice(2, 5),)):
        yield a, index
    yield rng.normal(size=(3, 4)), (1, slice(0, 3))
    yield rng.normal(size=(3, 4)), (slice(None), 2)


@pytest.mark.parametrize("name", [op.name for op in OPS if op.scatter is not None])
def test_scatter_form_is_the_rule(name):
    """Each op's ``scatter`` form, added into zeros, gives its ``vjp``'s gradient bit for
    bit (the flat sweep and a view's adjoint run that form, the other sweeps ``vjp``)."""
    op = BY_NAME[name]
    at, f = op.scatter
    rng = np.random.default_rng(1)
    if at == "all":
        cases = [(rng.normal(size=s), (None, False)) for s in [(), (5,), (3, 4), (2, 3, 2)]]
    else:
        cases = [(a, (i, a.shape, True)) for a, i in _index_cases()]
    for a, aux in cases:
        out = op.np(a, aux)
        g = rng.normal(size=np.shape(out))
        (ref,) = op.vjp(NpF, g, [a], out, aux)
        ref = np.broadcast_to(ref, a.shape)
        got = np.zeros(a.shape)
        if at == "all":
            got += f(g, a.size)
        else:
            got[aux[0]] += f(g, a.size)
        np.testing.assert_array_equal(got, ref)


def test_flat_sweep_is_generated_from_the_scatter_forms(monkeypatch):
    """The flat sweep states no derivative of its own: its branch of an op is that op's
    ``scatter`` form (changing the form changes the generated branch), and the ops it runs
    are the elementwise ones and those with a form."""
    text = _codegen._flat_source()
    for op in OPS:
        if op.scatter is not None:
            branch = "".join(f"            {x}\n" for x in _codegen.render_scatter(op))
            assert branch in text, op
            assert cpu.FLAT[op.code | 256]
        elif op.kind == "array":
            assert not cpu.FLAT[op.code | 256], op
    monkeypatch.setattr(BY_NAME["mean"], "scatter", ("all", lambda g, n: g * 3.0 / n))
    assert "(A[oout] * 3.0) / size[ia]" in _codegen._flat_source()


def test_view_adjoint_runs_the_registry_form(monkeypatch):
    """The array sweep adds a basic index's gradient in place through the op's
    ``scatter`` form, not a rule of its own: a changed form changes that gradient."""
    def grad():
        x = tapegrad.tensor(np.linspace(0.1, 0.9, 300), requires_grad=True)
        with paths.force("sweep"):
            (g,) = tapegrad.autograd.grad((x[10:20] * x[5:15]).sum() + x.sum(), (x,))
        return g.numpy()
    ref = grad()
    monkeypatch.setattr(BY_NAME["getitem"], "scatter", ("index", lambda g, n: g * 2.0))
    changed = grad()
    np.testing.assert_array_equal(changed[20:], ref[20:])
    assert not np.array_equal(changed[5:20], ref[5:20])


def _program(M, x):
    # slices and integers of a 1-d array, full sums and means, elementwise ops between
    y = (x[1:6] * x[::2][:5]).sum() + x[3] * M.sin(x[-1]) + x[1:8:3].exp().mean()
    z = (x * x).mean() * (x[2:] - x[:-2]).sum()
    return y + z + x[0] * x[0]


@pytest.mark.parametrize("n", [9, 40])
def test_flat_path_matches_sweep_and_torch(n):
    x0 = np.random.default_rng(n).normal(size=n)
    xt = torch.tensor(x0, requires_grad=True)
    (ref,) = torch.autograd.grad(_program(torch, xt), (xt,))
    got = {}
    for path in ("flat", "sweep"):
        x = tapegrad.tensor(x0, requires_grad=True)
        with paths.force(path):
            (g,) = tapegrad.autograd.grad(_program(tapegrad, x), (x,))
        assert paths.last() == path
        got[path] = g.numpy()
    np.testing.assert_allclose(got["flat"], ref.numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(got["sweep"], ref.numpy(), rtol=1e-13, atol=1e-14)


def test_one_sided_rules_are_generated_from_the_registry():
    """The array sweep's per-side binary rules are the registry's rules, generated (every
    binary rule that is arithmetic on g, a and b), not written in the sweep."""
    names = {OPS[code].name for code in cpu._SIDES}
    assert names == {"add", "sub", "mul", "div"}
    from tapegrad.interpreters._codegen import rule_exprs
    for code, (fa, fb, symmetric) in cpu._SIDES.items():
        exprs = rule_exprs(OPS[code], keep_zero=True)
        g, a, b = 0.3, 1.7, -2.9
        assert fa(g, a, b) == eval(exprs["a"]) and fb(g, a, b) == eval(exprs["b"])
        assert symmetric == (OPS[code].name in ("add", "mul"))  # x * x: g * x once
