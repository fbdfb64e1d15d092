"""trace() -> Program: replay equals eager mode, guards, batches, derivatives, files."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.ops import COMPARE, OPS, REPLAY

from harness.programs import generate, helpers

#: the differential harness's array forms that replay covers today (the replay legs of
#: tests/test_differential.py will take every form)
REPLAY_FORMS = ("reduce", "reshape", "transpose", "getitem", "stack", "matmul", "expand",
                "where", "softmax", "cat")

RTOL = 1e-12


def rosen(x):
    s = 0.0
    for i in range(x.shape[0] - 1):
        a, b = x[i], x[i + 1]
        s = s + 100.0 * (b - a * a) ** 2 + (1.0 - a) ** 2
    return s


def eager(fn, *xs):
    """(value, gradients) of ``fn`` in eager tapegrad."""
    ts = [tg.tensor(np.asarray(x, dtype=np.float64), requires_grad=True) for x in xs]
    y = fn(*ts)
    gs = tg.autograd.grad(y, ts, allow_unused=True, materialize_grads=True)
    return y.detach().numpy(), [g.numpy() for g in gs]


def close(a, b, rtol=RTOL, atol=1e-13):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, np.float64),
                               rtol=rtol, atol=atol)


# --- replay equals eager ----------------------------------------------------------------------


def test_rosenbrock_value_grad_and_new_inputs():
    x0 = np.linspace(-1.0, 1.0, 12)
    prog = tg.trace(rosen, x0)
    for x in (x0, np.random.default_rng(0).normal(size=12)):
        v, g = prog.value_and_grad(x)
        ve, (ge,) = eager(rosen, x)
        close(v, ve)
        close(g, ge)
        close(prog(x), ve)
        close(prog.grad(x), ge)


@pytest.mark.parametrize("name,fn,shapes", [
    ("matmul", lambda a, b: (a @ b).tanh().sum(), [(3, 4), (4, 2)]),
    ("matvec", lambda a, b: (a @ b).sin().sum(), [(3, 4), (4,)]),
    ("vecmat", lambda a, b: (a @ b).sin().sum(), [(4,), (4, 3)]),
    ("dot", lambda a, b: tg.dot(a, b) * 2.0, [(5,), (5,)]),
    ("batched_matmul", lambda a, b: (a @ b).exp().mean(), [(2, 3, 4), (4, 2)]),
    ("outer", lambda a, b: tg.outer(a, b).cos().sum(), [(3,), (2,)]),
    ("softmax", lambda a: (tg.softmax(a, 1) * tg.arange(4.0)).sum(), [(3, 4)]),
    ("log_softmax", lambda a: (tg.log_softmax(a, 0) ** 2).sum(), [(3, 4)]),
    ("logsumexp", lambda a: tg.logsumexp(a, 1).sum() + tg.logsumexp(a, (0, 1)), [(3, 4)]),
    ("norm2", lambda a: tg.norm(a) + tg.norm(a, dim=1).sum(), [(3, 4)]),
    ("norm1_inf_p", lambda a: tg.norm(a, 1) + tg.norm(a, float("inf")) + tg.norm(a, 3.0),
     [(5,)]),
    ("prod", lambda a: a.prod() + a.prod(1).sum(), [(2, 3)]),
    ("mean_sum_keepdim", lambda a: (a.mean(0, keepdim=True) * a).sum(), [(3, 4)]),
    ("amax_amin", lambda a: tg.amax(a, 1).sum() + tg.amin(a) * 2.0, [(3, 4)]),
    ("max_dim", lambda a: (a.max(1).values * 3.0).sum() + a.max(), [(3, 4)]),
    ("getitem", lambda a: a[1:, ::2].sum() + a[[0, 0, 2], 1].sum() + a[a.detach() > 0].sum(),
     [(3, 4)]),
    ("setitem", lambda a: _setitem(a), [(3, 4)]),
    ("stack_cat", lambda a, b: (tg.stack([a, b]) ** 2).sum() + tg.cat([a, b], 0).sin().sum(),
     [(2, 3), (2, 3)]),
    ("shapes", lambda a: (a.reshape(4, 3).t() @ a.transpose(0, 1)).sum()
     + a.permute(1, 0).unsqueeze(0).expand(2, 4, 3).sum(), [(3, 4)]),
    ("diag", lambda a, b: (tg.diag(a) * 2.0).sum() + (tg.diag(b) @ b).sum(), [(3, 3), (3,)]),
    ("where_traced", lambda a: tg.where(a > 0.1, a * a, -a).sum(), [(5,)]),
    ("broadcast", lambda a, b: (a * b + a).pow(2.0).sum(), [(3, 1), (4,)]),
    ("clamp_abs_relu_max", lambda a, b: (a.clamp(-0.5, 0.5) + a.abs() + a.relu()
                                         + tg.maximum(a, b)).sum(), [(6,), (6,)]),
])
def test_array_ops_replay_equals_eager(name, fn, shapes):
    rng = np.random.default_rng(abs(hash(name)) % 1000)
    xs = [rng.normal(size=s) for s in shapes]
    prog = tg.trace(fn, *xs)
    for trial in range(3):
        x = xs if trial == 0 else [rng.normal(size=s) for s in shapes]
        if name == "getitem" and trial:  # the boolean mask is a traced-time constant
            break
        v, g = prog.value_and_grad(*x)
        ve, ge = eager(fn, *x)
        close(v, ve, rtol=1e-11)
        for a, b in zip(g if isinstance(g, tuple) else (g,), ge):
            close(a, b, rtol=1e-11)


def _setitem(a):
    b = a * 1.0
    b[1] = a[0] * 2.0
    b[:, 0] = 0.5
    return (b ** 2).sum()


def test_tie_and_singular_conventions_match_eager():
    cases = [
        (lambda a: a.max(), np.array([1.0, 3.0, 3.0, 3.0])),       # ties share evenly
        (lambda a: a.max(0).values, np.array([2.0, 5.0, 5.0])),    # first index
        (lambda a: tg.amax(a, 0).sum(), np.array([[1.0, 2.0], [1.0, 0.0]])),
        (lambda a: tg.norm(a), np.zeros(3)),                       # 0 at 0
        (lambda a: a.abs().sum() + a.relu().sum(), np.zeros(2)),
        (lambda a: a.clamp(0.0, 1.0).sum(), np.array([0.0, 1.0, 0.5])),
        (lambda a: tg.maximum(a, a * 1.0).sum(), np.array([1.0, -2.0])),
        (lambda a: (a ** 2.0).sum() + (0.0 ** a).sum(), np.array([0.0, 1.0])),
        (lambda a: a.prod(), np.array([0.0, 2.0, 3.0])),
        (lambda a: tg.atan2(a, a * 0.0).sum(), np.array([0.0])),
    ]
    for fn, x in cases:
        v, g = tg.trace(fn, x).value_and_grad(x)
        ve, (ge,) = eager(fn, x)
        close(v, ve)
        close(g, ge)


@pytest.mark.parametrize("c", [0, 0.0, 1, -3, 2.5, -0.0])
def test_a_subtracted_constant_keeps_its_sign_in_replay(c):
    """x - c records x + (-c): for an int 0 that is -0.0, as float arithmetic gives, so the
    replay at x = -0.0 divides by -0.0 as the eager forward does."""
    fn = (lambda a: 1.0 / (a - c))
    prog = tg.trace(fn, np.array(1.0))
    for x in (-0.0, 0.0, 2.0):
        want = 1.0 / (np.float64(x) - c) if (x - c) != 0 else np.copysign(np.inf, x - c)
        got = np.asarray(prog(np.array(x)))
        assert got == want and np.signbit(got) == np.signbit(want)


def test_square_by_pow_is_bit_identical_to_torch_and_eager(torch):
    """``x ** 2`` replays as ``x * x``, as torch and eager tapegrad compute it: libm's
    ``pow(x, 2.0)`` is an ulp off on about 0.1% of inputs (these are such inputs)."""
    import math
    a = np.random.default_rng(17).standard_normal(20_000) * 3.0
    x = a[[i for i, v in enumerate(a) if math.pow(v, 2.0) != v * v][:8]]
    assert len(x) == 8
    want = (torch.tensor(x) ** 2).numpy()
    assert np.array_equal(want, x * x)
    prog = tg.trace(lambda t: t ** 2, x)
    assert np.array_equal(prog(x), want)
    assert np.array_equal(prog(np.stack([x, x]))[1], want)  # the batched sweep
    assert np.array_equal(prog.to("parallel").jacobian(x).diagonal(), 2.0 * x)
    for v in x:  # eager: Python floats through the tensor method and tg.pow
        t = tg.tensor(float(v), requires_grad=True)
        assert (t ** 2).item() == v * v and tg.pow(t, 2.0).item() == v * v
    scalar = tg.trace(lambda t: t[0] ** 2 + t[1] ** 2.0, x[:2])
    assert scalar(x[:2]) == x[0] * x[0] + x[1] * x[1]
    # x ** 3 is x * x * x in torch (pow is an ulp off on about a quarter of inputs)
    assert np.array_equal(tg.trace(lambda t: t ** 3.0, x)(x), (torch.tensor(x) ** 3.0).numpy())


def test_branch_free_ops_replay_across_the_branch():
    fn = lambda x: (tg.where(x > 0, x.sqrt(), -x) + x.abs() + tg.maximum(x, 0.3 * x)  # noqa
                    + x.clamp(-0.2, 0.2)).sum()
    prog = tg.trace(fn, np.array([0.5, 0.7]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in (np.array([-0.5, 0.7]), np.array([0.1, -3.0]), np.array([-1.0, -0.1])):
            v, g = prog.value_and_grad(x)
            ve, (ge,) = eager(fn, x)
            close(v, ve)
            close(g, ge)


def _traced_random(prog):
    """(fn(*leaves) -> loss, leaf values) for a harness program (tests/harness)."""
    f, H = prog.function(tg), helpers(tg)

    def fn(*leaves):
        it = iter(leaves)
        xs = [next(it) if rg else tg.tensor(v, dtype=tg.float64) for v, rg in prog.inputs]
        return f(tg, H, *xs)[1]
    return fn, [v for v, rg in prog.inputs if rg]


@pytest.mark.parametrize("arrays", [False, True])
def test_random_programs_replay_equals_eager(arrays):
    """Replay over the core issue's random-program generator, at the traced inputs and at
    new ones, against eager tapegrad."""
    assert _replay_random(range(40), arrays) >= 40


@pytest.mark.slow
@pytest.mark.parametrize("arrays", [False, True])
def test_random_programs_replay_equals_eager_slow(arrays):
    assert _replay_random(range(40, 640), arrays) >= 600


def _replay_random(seeds, arrays):
    checked = 0
    for seed in seeds:
        program = generate(50_000 + seed + 1000 * arrays, 8 + seed % 9, arrays=arrays,
                           forms=REPLAY_FORMS)
        if any(0 in s for s in program.shapes):
            continue  # empty values: replay's lowering of their reductions fails (open)
        fn, xs = _traced_random(program)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                ve, ge = eager(fn, *xs)
            except Exception:
                continue
            if not (np.all(np.isfinite(ve)) and all(np.all(np.isfinite(g)) for g in ge)):
                continue
            prog = tg.trace(fn, *xs)
            rng = np.random.default_rng(seed)
            for trial in range(2):
                x = xs if trial == 0 else [np.asarray(v) + rng.normal(scale=0.05,
                                                                        size=np.shape(v))
                                           for v in xs]
                ve, ge = eager(fn, *x)
                if not (np.all(np.isfinite(ve)) and all(np.all(np.isfinite(g)) for g in ge)):
                    continue
                v, g = prog.value_and_grad(*x)
                g = g if isinstance(g, tuple) else (g,)
                scale = max([1.0] + [float(np.max(np.abs(a))) for a in ge])
                close(v, ve, rtol=1e-12, atol=1e-12 * max(1.0, abs(float(np.max(ve)))))
                for a, b in zip(g, ge):
                    close(a, b, rtol=1e-12, atol=1e-12 * scale)
                checked += 1
    return checked


def test_every_traced_only_op_appears_in_a_replayed_program():
    """Registry-driven: comparison, logic and replay ops all run in some traced program."""
    fns = [
        lambda x: tg.where((x < 0.1) & (x <= 0.2) | (x > 3.0), x, 2.0 * x).sum(),
        lambda x: tg.where((x >= 0.0) ^ (x == 0.5), x, x * x).sum()
        + tg.where(~(x != 0.25), x, -x).sum(),
        lambda x: tg.where((x > 0).logical_not(), x, x.exp()).sum() + x.max()
        + x.detach().sum() * x.sum() + x.amax(0),  # (max()'s pick_where, amax's pick)
        lambda x: (x.to(tg.float32).to(tg.float64) * x).sum(),
        lambda x: (tg.linalg.cross(x[:3], x[2:]) * x[1:4]).sum(),  # (fms)
    ]
    seen = set()
    x = np.array([0.5, -0.3, 0.25, 0.9, 0.9])
    for fn in fns:
        prog = tg.trace(fn, x)
        seen |= {OPS[int(c)].name for c in prog._code.rows[:, 0]}
        for xx in (x, -x, x * 3):
            v, g = prog.value_and_grad(xx)
            ve, (ge,) = eager(fn, xx)
            close(v, ve)
            close(g, ge)
    prog = tg.trace(lambda x: x * 2.0 if x > 0 else -x, 1.0)
    seen |= {OPS[int(c)].name for c in prog._code.rows[:, 0]}
    # an array instruction's rows (tapegrad/interpreters/program_arrays.py)
    from tapegrad.interpreters import program_arrays
    saved, program_arrays.MIN_COVER = program_arrays.MIN_COVER, 0.0  # (its sum is rows)
    try:
        prog = tg.trace(lambda x: (x.exp() * x).sum(), np.linspace(0.0, 1.0, 32))
    finally:
        program_arrays.MIN_COVER = saved
    seen |= {OPS[int(c)].name for c in prog._code.arows[:, 0]}
    traced_only = {op.name for op in OPS if op.kind in (COMPARE, REPLAY)}
    assert traced_only <= seen, traced_only - seen


# --- guards -----------------------------------------------------------------------------------


def branchy(x):
    if x.sum() > 0:
        return (x * x).sum()
    return x.sin().sum()


def test_guard_raises_naming_the_line():
    prog = tg.trace(branchy, np.array([1.0, 2.0]))
    close(prog(np.array([0.5, 0.1])), 0.26)
    with pytest.raises(tg.GuardError, match=r"test_replay.py:\d+ \('if x.sum\(\) > 0:'\)"):
        prog(np.array([-1.0, -2.0]))
    with pytest.raises(tg.GuardError, match="retrace=True"):
        prog.grad(np.array([-1.0, -2.0]))


def test_retrace_caches_a_variant_per_branch():
    prog = tg.trace(branchy, np.array([1.0, 2.0]), retrace=True)
    x = np.array([-1.0, -2.0])
    close(prog.grad(x), np.cos(x))
    close(prog.grad(-x), -2 * x)
    assert len(prog._variants) == 2
    X = np.array([[1.0, 2.0], [-1.0, -0.5], [0.3, 0.1]])
    v, g = prog.value_and_grad(X)
    for i in range(3):
        ve, (ge,) = eager(branchy, X[i])
        close(v[i], ve)
        close(g[i], ge)
    assert len(prog._variants) == 2


def test_batched_guard_error_names_the_sample():
    prog = tg.trace(branchy, np.array([1.0, 2.0]))
    with pytest.raises(tg.GuardError, match="sample 1 of the batch"):
        prog(np.array([[1.0, 2.0], [-1.0, -2.0]]))


def test_while_loop_unrolls_with_guards():
    def newton_sqrt(a):
        x = a * 1.0
        while ((x * x - a).abs() > 1e-10).item():
            x = 0.5 * (x + a / x)
        return x
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a truth value read by .item() is a guard, not a warning
        prog = tg.trace(newton_sqrt, 2.0)
    ve, (ge,) = eager(newton_sqrt, 2.0)
    close(prog(2.0), ve)
    close(prog.grad(2.0), ge)
    close(prog(2.0 + 1e-9), np.sqrt(2.0 + 1e-9), rtol=1e-9)
    with pytest.raises(tg.GuardError):
        prog(100.0)  # needs more iterations


def test_bool_of_a_traced_number_is_a_guard():
    prog = tg.trace(lambda x: x * 2.0 if x else x - 1.0, 1.0)
    assert prog(3.0) == 6.0
    with pytest.raises(tg.GuardError):
        prog(0.0)


def test_escaping_values_warn_or_raise_when_strict():
    def f(x):
        c = x.sum().item()
        return x * c
    with pytest.warns(tg.TraceWarning, match=r"item\(\) on a traced tensor at .*test_replay"):
        prog = tg.trace(f, np.array([1.0, 2.0]))
    close(prog(np.array([2.0, 1.0])), [6.0, 3.0])  # frozen at 3.0, as the warning says
    with pytest.raises(tg.GuardError, match=r"read a value .*item\(\) == 3.0"):
        prog(np.array([2.0, 2.0]))  # and guarded: never replayed where it differs
    with pytest.raises(RuntimeError, match="strict=True"):
        tg.trace(f, np.array([1.0, 2.0]), strict=True)
    with pytest.warns(tg.TraceWarning, match=r"float\(\)"):
        tg.trace(lambda x: x * float(x), 1.0)


def test_trace_leaves_no_tracing_state_behind():
    with pytest.raises(ZeroDivisionError):
        tg.trace(lambda x: 1 / 0, 1.0)
    from tapegrad.tape import STATE
    assert STATE.trace is None
    x = tg.tensor(1.0, requires_grad=True)
    assert bool(x > 0) is True


# --- inputs, outputs, errors ------------------------------------------------------------------


def test_tuple_outputs_constants_and_several_inputs():
    def f(a, b):
        return a * b, (a + b).sum(), 3.0
    prog = tg.trace(f, np.ones(2), np.ones(2))
    p, s, c = prog(np.array([1.0, 2.0]), np.array([3.0, 4.0]))
    close(p, [3.0, 8.0])
    assert s == 10.0 and c == 3.0
    J = prog.jacobian(np.array([1.0, 2.0]), np.array([3.0, 4.0]))
    close(J[0][0], np.diag([3.0, 4.0]))
    close(J[1][1], [1.0, 1.0])
    with pytest.raises(RuntimeError, match="scalar outputs"):
        prog.grad(np.ones(2), np.ones(2))
    g = tg.trace(lambda a, b: (a * b).sum(), np.ones(2), np.ones(2)).grad(
        np.array([1.0, 2.0]), np.array([3.0, 4.0]))
    assert isinstance(g, tuple)
    close(g[0], [3.0, 4.0])
    close(g[1], [1.0, 2.0])


def test_tensor_inputs_give_tensor_outputs():
    prog = tg.trace(lambda x: (x ** 2).sum(), tg.ones(3))
    v, g = prog.value_and_grad(tg.tensor([1.0, 2.0, 3.0]))
    assert isinstance(v, tg.Tensor) and isinstance(g, tg.Tensor)
    close(g.numpy(), [2.0, 4.0, 6.0])


def test_bad_inputs_raise_clear_errors():
    prog = tg.trace(lambda x: (x ** 2).sum(), np.ones(3))
    with pytest.raises(ValueError, match=r"shape \[2\].*traced with shape \[3\]"):
        prog(np.ones(2))
    with pytest.raises(TypeError, match="float32.*astype"):
        prog(np.ones(3, dtype=np.float32))
    with pytest.raises(TypeError, match="takes 1 input"):
        prog(np.ones(3), np.ones(3))
    two = tg.trace(lambda a, b: (a * b).sum(), np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match="batch"):
        two(np.ones((4, 3)), np.ones((5, 3)))
    with pytest.raises(TypeError, match="floating point"):
        tg.trace(lambda x: x, np.arange(3))
    with pytest.raises(TypeError, match="callable"):
        tg.trace(3.0, 1.0)
    with pytest.raises(ValueError, match="target"):
        tg.trace(lambda x: x, 1.0, target="tpu")


def test_custom_function_cannot_be_traced():
    class Sq(tg.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * x

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(NotImplementedError, match="custom autograd.Function"):
        tg.trace(lambda x: Sq.apply(x).sum(), np.ones(2))


# --- batches ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["cpu", "parallel"])
def test_batched_replay_equals_the_loop(target):
    prog = tg.trace(rosen, np.zeros(6), target=target)
    X = np.random.default_rng(1).normal(size=(300, 6))
    v, g = prog.value_and_grad(X)
    assert v.shape == (300,) and g.shape == (300, 6)
    for i in (0, 137, 299):
        vi, gi = prog.value_and_grad(X[i])
        close(v[i], vi)
        close(g[i], gi)
    close(prog(X), v)


def test_batched_vjp_and_hvp():
    prog = tg.trace(lambda x: x.sin() * x.sum(), np.ones(3))
    X = np.random.default_rng(2).normal(size=(5, 3))
    V = np.random.default_rng(3).normal(size=(5, 3))
    out, vj = prog.vjp(X, V)
    for i in range(5):
        J = prog.jacobian(X[i])
        close(vj[i], V[i] @ J)
    # one output's cotangent in a 1-tuple, as torch.autograd.functional.vjp takes it
    out1, vj1 = prog.vjp(X, (V,))
    np.testing.assert_array_equal(vj1, vj)
    s = tg.trace(lambda x: (x * x).sum() * x[0], np.ones(3))
    _, g = s.vjp((np.ones(3),), (np.full((), 2.0),))
    np.testing.assert_array_equal(g, s.vjp(np.ones(3), np.full((), 2.0))[1])
    with pytest.raises(ValueError, match="cotangent"):
        s.vjp(np.ones(3), (np.ones(()), np.ones(())))
    sc = tg.trace(rosen, np.zeros(4))
    _, H = sc.hvp(X[:, :3].repeat(2, axis=1)[:, :4], V.repeat(2, axis=1)[:, :4])
    for i in range(5):
        close(H[i], sc.hessian(X[i, :3].repeat(2)[:4]) @ V[i].repeat(2)[:4], rtol=1e-11)


# --- derivatives against torch -----------------------------------------------------------------


def test_hvp_hessian_and_higher_orders_against_torch(torch):
    x0 = np.linspace(-1.2, 1.0, 7)
    prog = tg.trace(rosen, x0)
    xt = torch.tensor(x0, requires_grad=True)
    H = torch.autograd.functional.hessian(rosen, xt).numpy()
    close(prog.hessian(x0), H, rtol=1e-11)
    v = np.arange(7.0)
    val, hv = prog.hvp(x0, v)
    close(hv, H @ v, rtol=1e-11)
    close(val, rosen(xt).item())
    # third derivatives: d/dx of the Hessian's rows, each a program of its own
    f = lambda x: (x.sin() * x.exp()).sum() + (x[0] * x[1] * x[2]) ** 2  # noqa: E731
    grad = tg.trace(f, x0).grad_program()
    xt = torch.tensor(x0, requires_grad=True)
    T = torch.autograd.functional.jacobian(
        lambda x: torch.autograd.functional.hessian(f, x, create_graph=True), xt).numpy()
    for i in range(7):
        row = grad.grad_program(v=np.eye(7)[i])
        close(row.jacobian(x0), T[i], rtol=1e-10, atol=1e-12)
    # fourth: the Hessian of a Hessian entry
    h01 = grad.grad_program(v=np.eye(7)[0]).grad_program(v=np.eye(7)[1])
    T4 = torch.autograd.functional.hessian(
        lambda x: torch.autograd.functional.hessian(f, x, create_graph=True)[0, 1], xt)
    close(h01.jacobian(x0), T4.numpy(), rtol=1e-10, atol=1e-12)


# --- files ------------------------------------------------------------------------------------


def test_save_load_in_another_process(tmp_path):
    prog = tg.trace(branchy, np.array([1.0, 2.0]), retrace=True)
    prog.grad(np.array([-1.0, -2.0]))  # two variants
    path = tmp_path / "prog.npz"
    prog.save(path)
    x = np.array([0.3, -0.1])
    expect = prog.value_and_grad(x)
    code = ("import numpy as np, tapegrad as tg, sys\n"
            f"p = tg.load({str(path)!r})\n"
            "v, g = p.value_and_grad(np.array([0.3, -0.1]))\n"
            "v2 = p(np.array([-0.3, -0.1]))\n"
            "print(repr(float(v)), repr(float(v2)), *[repr(float(a)) for a in g])\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root}, check=True).stdout.split()
    assert float(out[0]) == expect[0]
    assert float(out[1]) == prog(np.array([-0.3, -0.1]))
    assert [float(a) for a in out[2:]] == expect[1].tolist()


def test_load_rejects_corrupt_and_incompatible_files(tmp_path):
    prog = tg.trace(rosen, np.zeros(3))
    good = tmp_path / "good.npz"
    prog.save(good)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ValueError, match="not a readable tapegrad program"):
        tg.load(bad)
    junk = tmp_path / "junk.npz"
    np.savez(junk, a=np.ones(3))
    with pytest.raises(ValueError, match="not a tapegrad program"):
        tg.load(junk)
    import json
    with np.load(good) as z:
        files = {k: z[k] for k in z.files}
    meta = json.loads(files["meta"].tobytes())
    for change, msg in ((dict(version=99), "format version 99"),
                        (dict(ops=["leaf", "const", "warp"] + meta["ops"][3:]),
                         "incompatible version")):
        m = {**meta, **change}
        f2 = dict(files, meta=np.frombuffer(json.dumps(m).encode(), np.uint8))
        if "ops" in change:
            f2["rows0"] = files["rows0"].copy()
            f2["rows0"][-1, 0] = 2.0
        p = tmp_path / "v.npz"
        np.savez(p, **f2)
        with pytest.raises(ValueError, match=msg):
            tg.load(p)
    f3 = dict(files)
    f3["rows0"] = files["rows0"].copy()
    f3["rows0"][-1, 1] = 10_000
    np.savez(tmp_path / "c.npz", **f3)
    with pytest.raises(ValueError, match="corrupt"):
        tg.load(tmp_path / "c.npz")


def test_float32_programs_compute_in_float64_and_return_float32():
    x = np.linspace(-1, 1, 5).astype(np.float32)
    prog = tg.trace(lambda x: (x.sin() * x).sum(), x)
    v, g = prog.value_and_grad(x)
    assert v.dtype == np.float32 and g.dtype == np.float32
    t = tg.tensor(x, requires_grad=True)
    y = (t.sin() * t).sum()
    np.testing.assert_allclose(v, y.item(), rtol=1e-6)
    np.testing.assert_allclose(g, tg.autograd.grad(y, t)[0].numpy(), rtol=1e-6)
    vb, gb = prog.value_and_grad(np.stack([x, 2 * x]))
    assert vb.dtype == np.float32 and gb.shape == (2, 5)


def test_generated_replay_interpreters_are_not_stale():
    from tapegrad.interpreters import _codegen
    for made, target in ((_codegen.generate_replay(), _codegen.REPLAY_TARGET),
                         (_codegen.generate_cuda(), _codegen.CUDA_TARGET)):
        assert made == target.read_text(), (
            f"tapegrad/interpreters/{target.name} is stale: run "
            "python -m tapegrad.interpreters._codegen")


def test_tracing_in_several_threads_at_once():
    import threading
    errors = {}

    def work(i):
        x0 = np.full(5, 0.1 * (i + 1))
        f = lambda x: (x.sin() * x * (i + 1)).sum()  # noqa: E731
        prog = tg.trace(f, x0)
        _, (ge,) = eager(f, x0)
        errors[i] = float(np.abs(prog.grad(x0) - ge).max())
    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == {i: 0.0 for i in range(6)}


@pytest.mark.parametrize("name", ["softmax", "logsumexp", "norm", "where", "max_dim",
                                  "amax", "clamp_abs"])
def test_second_derivatives_through_replay_only_ops_against_torch(torch, name):
    """select, pick, detach and comparisons re-record into the gradient program: Hessians
    of the array ops lowered with them match torch."""
    fns = {
        "softmax": lambda M, x: (M.softmax(x.reshape(2, 3), 1) * M.sin(x.reshape(2, 3))).sum(),
        "logsumexp": lambda M, x: M.logsumexp(x * x, 0) * x.sum(),
        "norm": lambda M, x: M.norm(x) ** 3 + M.norm(x.reshape(2, 3), dim=1).prod(),
        "where": lambda M, x: M.where(x > 0.1, x ** 3, M.exp(x)).sum(),
        "max_dim": lambda M, x: (x.reshape(2, 3).max(1).values ** 2).sum() * x.sum(),
        "amax": lambda M, x: M.amax(x.reshape(3, 2) ** 2, 0).sum() ** 2,
        "clamp_abs": lambda M, x: (x.clamp(-0.5, 0.5) * x.abs() * x).sum(),
    }
    f = fns[name]
    x0 = np.array([0.3, -0.8, 1.1, 0.45, -0.2, 0.7])
    H = tg.trace(lambda x: f(tg, x), x0).hessian(x0)
    Ht = torch.autograd.functional.hessian(lambda x: f(torch, x), torch.tensor(x0)).numpy()
    close(H, Ht, rtol=1e-11, atol=1e-12)


def test_bad_target_fails_before_fn_runs():
    calls = []
    with pytest.raises(ValueError, match="target"):
        tg.trace(lambda x: calls.append(1) or x, 1.0, target="tpu")
    assert calls == []


@pytest.mark.parametrize("target", ["cpu", "parallel"])
def test_batched_jacobian_is_each_samples_jacobian(target):
    prog = tg.trace(lambda a, b: (a.sin() * b, (a @ b.exp()).sum()), np.zeros((2, 3)),
                    np.zeros(3), target=target)
    rng = np.random.default_rng(5)
    A, B = rng.normal(size=(4, 2, 3)), rng.normal(size=(4, 3))
    J = prog.jacobian(A, B)
    for b in range(4):
        Jb = prog.jacobian(A[b], B[b])
        for out, outb in zip(J, Jb):
            for blk, blkb in zip(out, outb):
                assert blk.shape == (4,) + blkb.shape
                np.testing.assert_allclose(blk[b], blkb, rtol=1e-14)


def test_program_calls_on_tensors_are_recorded(torch):
    def f(x):
        return (x.sin() * x).sum(), x * x
    prog = tg.trace(f, np.zeros(4))
    X = np.random.default_rng(6).normal(size=(3, 4))
    # no grad wanted: plain results, nothing recorded
    s, v = prog(tg.tensor(X))
    assert not s.requires_grad and s.shape == (3,)
    # a batched call on a tensor that requires grad, then a batch of seeds through it
    x = tg.tensor(X, requires_grad=True)
    s, v = prog(x)
    assert s.requires_grad and s.grad_fn is not None
    seeds = np.random.default_rng(7).normal(size=(2, 3))
    gb, = tg.autograd.grad(s, x, grad_outputs=tg.tensor(seeds), is_grads_batched=True,
                           retain_graph=True)
    xt = torch.tensor(X, requires_grad=True)
    st = (xt.sin() * xt).sum(1)
    gbt, = torch.autograd.grad(st, xt, grad_outputs=torch.tensor(seeds), is_grads_batched=True)
    np.testing.assert_allclose(gb.numpy(), gbt.numpy(), rtol=1e-12)
    (s.sum() + v.sum()).backward()
    np.testing.assert_allclose(x.grad.numpy(), np.sin(X) + X * np.cos(X) + 2 * X, rtol=1e-12)
    with pytest.raises(RuntimeError, match="'program'"):
        s.sum().backward()  # the graph was freed by the first backward
    with pytest.raises(NotImplementedError, match="inside tapegrad.trace"):
        tg.trace(lambda y: prog(y)[0], np.zeros(4))
