"""``Program.buffer`` (a one-sample call bound once to the caller's arrays, run with no
arguments) and ``Program._hvp_one`` (hvp's one-sample call): the numbers of the checked
paths to the bit, results written in place or fresh as documented, bad arrays refused at
binding with torch's exception types, guards, and threads."""
import threading

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import replay
from tapegrad.interpreters import _bound, fuse
from tapegrad.interpreters import program_arrays

torch = pytest.importorskip("torch")


def f3(a, b, c):
    return (a * b).sum() + (c.sin() * a[0]).sum() + (b * b).sum().exp() * 1e-3


def three(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=2), rng.normal(size=2), rng.normal(size=(2, 3))


def results_for(shapes):
    return tuple(np.full(s, np.nan) for s in shapes)


@pytest.fixture(scope="module")
def prog():
    return tg.trace(f3, *three(0))


def bound_and_checked(prog, seed):
    """A Buffer of ``prog`` at ``three(seed)`` and value_and_grad's answer there."""
    xs = three(seed)
    out, grads = np.full((), np.nan), results_for([x.shape for x in xs])
    call = prog.buffer(*xs, out=out, grad=grads)
    value, want = prog.value_and_grad(*xs)
    return call, xs, out, grads, value, want


@pytest.mark.parametrize("fused", [True, False])
def test_bound_calls_give_value_and_grad_to_the_bit_and_match_torch(fused, monkeypatch):
    monkeypatch.setattr(fuse, "ENABLED", fused)
    prog = tg.trace(f3, *three(0))
    call, xs, out, grads, value, want = bound_and_checked(prog, 1)
    ids = [id(a) for a in (out, *grads)]
    assert call() is None
    assert out[()] == value and [id(a) for a in (out, *grads)] == ids
    for g, w in zip(grads, want):
        np.testing.assert_array_equal(g, w)
    # the inputs are read at every call: changed in place, the next call sees them
    for x, new in zip(xs, three(2)):
        x[...] = new
    call()
    value, want = prog.value_and_grad(*three(2))
    assert out[()] == value
    for g, w in zip(grads, want):
        np.testing.assert_array_equal(g, w)
    ts = [torch.tensor(x, requires_grad=True) for x in three(2)]
    y = f3(*ts)
    np.testing.assert_allclose(out, y.item(), rtol=1e-13)
    for g, w in zip(grads, torch.autograd.grad(y, ts)):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-13, atol=1e-15)
    # a program with superinstructions runs them (``fuse``), or its rows as traced
    from tapegrad.bench.cases import rosenbrock_scalar
    x = np.linspace(-1.0, 1.5, 6)
    rb = tg.trace(lambda x: rosenbrock_scalar([x[i] for i in range(6)]), x)
    f, g = np.empty(()), np.empty(6)
    rb.buffer(x, out=f, grad=g)()
    assert (rb._code.frows is rb._code.arows) != fused
    value, want = rb.value_and_grad(x)
    assert f[()] == value
    np.testing.assert_array_equal(g, want)


def test_forward_only_gradient_only_and_tuples_of_outputs():
    def two(a, b):
        return (a * b).sum(), a.exp() * b[0]
    a, b = np.array([0.5, -1.0]), np.array([2.0, 3.0])
    prog = tg.trace(two, a, b)
    outs = (np.empty(()), np.empty(2))
    call = prog.buffer(a, b, out=outs)
    call()
    want = prog(a, b)
    assert outs[0][()] == want[0]
    np.testing.assert_array_equal(outs[1], want[1])
    with pytest.raises(RuntimeError, match="scalar output"):
        prog.buffer(a, b, grad=(np.empty(2), np.empty(2)))
    one = tg.trace(lambda a, b: (a * b).sum(), a, b)
    grads = (np.empty(2), np.empty(2))
    call = one.buffer(a, b, grad=grads)  # no outputs bound: the gradient only
    call()
    np.testing.assert_array_equal(grads[0], b)
    np.testing.assert_array_equal(grads[1], a)


def test_the_programs_own_calls_and_buffers_are_untouched(prog):
    call, xs, out, grads, value, want = bound_and_checked(prog, 3)
    pool = list(prog._code._free)
    for seed in (4, 5):
        other = three(seed)
        v, g = prog.value_and_grad(*other)  # in between: its own fresh results
        call()
        assert out[()] == value and prog.value_and_grad(*other)[0] == v
        np.testing.assert_array_equal(g[2], prog.value_and_grad(*other)[1][2])
    assert all(any(b is p for p in prog._code._free) for b in pool)
    assert not any(b[0] is call._entry.args[1] for b in prog._code._free)


def test_array_programs_and_unusual_addresses_copy_in_python(monkeypatch):
    x = np.random.default_rng(4).normal(size=64)
    lse = tg.trace(lambda x: x.max() + tg.log(tg.sum(tg.exp(x - x.max()))), x)
    assert lse._code.arrays
    f, g = np.empty(()), np.empty(64)
    call = lse.buffer(x, out=f, grad=g)
    assert call._entry == call._copying
    call()
    value, grad = lse.value_and_grad(x)
    assert f[()] == value
    np.testing.assert_array_equal(g, grad)
    assert program_arrays.MIN_RUN > 1
    monkeypatch.setattr(_bound, "MAX_ADDRESS", 0)  # as if an address were past 2**53
    prog = tg.trace(f3, *three(0))
    call, xs, out, grads, value, want = bound_and_checked(prog, 6)
    assert call._entry == call._copying
    call()
    assert out[()] == value
    np.testing.assert_array_equal(grads[2], want[2])


def test_bad_arrays_are_refused_at_binding_and_say_what_to_do(prog):
    xs = three(0)
    out, grads = np.empty(()), results_for([x.shape for x in xs])
    bad = [
        ((xs[0].astype(np.float32), *xs[1:]), {"out": out}, TypeError, "dtype float32"),
        ((xs[0].astype(">f8"), *xs[1:]), {"out": out}, TypeError, "native byte order"),
        ((list(xs[0]), *xs[1:]), {"out": out}, TypeError, "must be a NumPy array"),
        ((np.zeros(3), *xs[1:]), {"out": out}, ValueError, r"shape \[3\]"),
        ((xs[0], xs[1], np.zeros((3, 2)).T), {"out": out}, ValueError, "C-contiguous"),
        (xs[:2], {"out": out}, TypeError, "takes 3 input"),
        (xs, {}, ValueError, "nothing to write"),
        (xs, {"out": np.empty(1)}, ValueError, r"out has shape \[1\]"),
        (xs, {"grad": grads[:2]}, ValueError, "grad takes 3 array"),
        (xs, {"out": out, "grad": (grads[0], grads[1], np.empty((2, 3), np.float32))},
         TypeError, r"grad\[2\] has dtype float32"),
    ]
    ro = np.empty(())
    ro.flags.writeable = False
    bad.append((xs, {"out": ro}, ValueError, "read-only"))
    bad.append((xs, {"out": out, "grad": (grads[0], xs[1], grads[2])}, ValueError,
                r"grad\[1\] shares memory with input 1"))
    bad.append((xs, {"grad": (grads[0], grads[0], grads[2])}, ValueError,
                r"grad\[1\] shares memory with grad\[0\]"))
    half = np.empty(4)
    bad.append((xs, {"grad": (half[:2], half[1:3], grads[2])}, ValueError, "shares memory"))
    for args, kw, exc, match in bad:
        with pytest.raises(exc, match=match):
            prog.buffer(*args, **kw)
    ints = tg.trace(lambda x: (x > 0).sum(), np.ones(2))
    with pytest.raises(TypeError, match="other dtypes"):
        ints.buffer(np.ones(2), out=np.empty((), np.int64))


def test_guards_run_the_other_variants_or_raise_with_the_results_unchanged():
    def f(x):
        if x.sum() > 0:
            return (x * x).sum()
        return (x * 3.0).sum()
    x = np.ones(2)
    strict = tg.trace(f, x)
    out, g = np.full((), 7.0), np.full(2, 7.0)
    call = strict.buffer(x, out=out, grad=g)
    x[...] = -1.0
    with pytest.raises(tg.GuardError, match="branch"):
        call()
    assert out[()] == 7.0 and (g == 7.0).all()
    assert call._tokens  # the call can run again
    x[...] = 2.0
    call()
    assert out[()] == 8.0 and (g == 4.0).all()
    again = tg.trace(f, np.ones(2), retrace=True)
    x[...] = 1.0
    call = again.buffer(x, out=out, grad=g)
    x[...] = -1.0
    call()  # traced again for the other branch
    assert out[()] == -6.0 and (g == 3.0).all()
    x[...] = 0.5
    call()
    assert out[()] == 0.5 and (g == 1.0).all()


def test_threads_each_with_a_buffer_and_one_buffer_in_two_threads(prog):
    errors = []

    def loop(seed):
        try:
            call, xs, out, grads, _, _ = bound_and_checked(prog, seed)
            rng = np.random.default_rng(seed)
            for _ in range(300):
                for x in xs:
                    x[...] = rng.normal(size=x.shape)
                call()
                value, want = prog.value_and_grad(*xs)
                assert out[()] == value
                for g, w in zip(grads, want):
                    np.testing.assert_array_equal(g, w)
        except Exception as e:  # (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(s,)) for s in (7, 8, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # one Buffer while another thread runs it: its token is taken, so the call refuses
    call = bound_and_checked(prog, 10)[0]
    token = call._tokens.pop()
    with pytest.raises(RuntimeError, match="one thread at a time"):
        call()
    call._tokens.append(token)
    call()


def test_repr_names_the_program_and_what_is_bound(prog):
    call = bound_and_checked(prog, 11)[0]
    assert "3 input(s), outputs, gradient" in repr(call)
    assert isinstance(call, replay.Buffer)


# --- hvp's one-sample call ------------------------------------------------------------------


def test_one_sample_hvp_is_the_general_paths_to_the_bit_and_fresh(prog, monkeypatch):
    xs, vs = three(12), three(13)
    value, hv = prog.hvp(xs, vs)  # builds the Hessian-vector program, then the fast path
    # the general path's answer (the one-sample attempts refused)
    monkeypatch.setattr(replay.Program, "_hvp_one", lambda *a: None)
    want_value, want = prog.hvp(xs, vs)
    monkeypatch.undo()
    assert prog._hvp_one(xs, vs) is not None
    assert type(value) is np.float64 and value == want_value == prog(*xs)
    for h, w in zip(hv, want):
        np.testing.assert_array_equal(h, w)
    # fresh results: a second call leaves the first call's alone
    kept = [h.copy() for h in hv]
    prog.hvp(three(14), three(15))
    for h, k in zip(hv, kept):
        np.testing.assert_array_equal(h, k)
    ts = [torch.tensor(x) for x in xs]
    _, wt = torch.autograd.functional.hvp(f3, tuple(ts), tuple(torch.tensor(v) for v in vs))
    for h, w in zip(hv, wt):
        np.testing.assert_allclose(h, w.numpy(), rtol=1e-12, atol=1e-13)


def test_one_sample_hvp_of_an_output_shaped_1_returns_a_fresh_array():
    prog = tg.trace(lambda x: (x * x * x).sum().reshape(1), np.ones(2))
    x, v = np.array([1.0, 2.0]), np.array([1.0, 0.5])
    value, hv = prog.hvp(x, v)
    value2, _ = prog.hvp(x * 2.0, v)
    assert prog._hvp_one((x,), (v,)) is not None
    assert value.shape == (1,) and value[0] == 9.0 and value2[0] == 72.0
    np.testing.assert_array_equal(hv, [6.0, 6.0])


def test_one_sample_hvp_leaves_other_inputs_to_the_checked_paths(prog):
    xs, vs = three(16), three(17)
    prog.hvp(xs, vs)
    assert prog._hvp_one((xs[0].astype(np.float32),) + xs[1:], vs) is None
    assert prog._hvp_one(xs, (vs[0][:1],) + vs[1:]) is None
    assert prog._hvp_one(xs, vs[:2]) is None
    with pytest.raises(ValueError, match="v has 2 part"):
        prog.hvp(xs, vs[:2])
    t = tuple(tg.tensor(x) for x in xs)
    value, hv = prog.hvp(t, vs)
    assert value == prog.hvp(xs, vs)[0]


def test_hvps_program_keeps_the_value_after_the_product_and_the_sweep_skips_it():
    from tapegrad._program_code import _hvp_of
    from tapegrad.bench.cases import rosenbrock_scalar
    n = 8
    x, v = np.linspace(-1.0, 1.2, n), np.linspace(0.5, -0.5, n)
    prog = tg.trace(lambda x: rosenbrock_scalar([x[i] for i in range(n)]), x)
    value, hv = prog.hvp(x, v)
    h = _hvp_of(prog._code)
    w = h.with_value
    # the value's own rows (the sum of the terms) come after the product, the output
    assert len(w.arows) > len(h.arows) and w.out_slots[0] < len(w.arows) - 1
    assert value == prog(x)
    H = prog.hessian(x)
    np.testing.assert_allclose(hv, H @ v, rtol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_the_reverse_sweep_starts_at_the_last_output(fused, monkeypatch):
    # rows past the output read no output: their adjoints are zero, and their rules are
    # not run (a log of 0 there would add 0 / 0 = NaN to the gradient)
    from tapegrad.ops import BY_NAME
    from tapegrad.replay import _Code
    monkeypatch.setattr(fuse, "ENABLED", fused)
    monkeypatch.setattr(fuse, "TIER", 0)
    monkeypatch.setattr(fuse, "MIN_PAIRED", 0.0)
    op = {k: BY_NAME[k].code for k in ("leaf", "sub", "powc", "mulc", "log")}
    rows = np.array([
        [op["leaf"], -1, -1, -1, 0, 0],
        [op["leaf"], -1, -1, -1, 1, 0],
        [op["sub"], 0, 1, -1, 0, 0],      # x0 - x1
        [op["powc"], 2, -1, -1, 2.0, 0],  # (x0 - x1) ** 2: the output
        [op["mulc"], 0, -1, -1, 0.0, 0],  # 0 * x0, read by no output
        [op["log"], 4, -1, -1, 0, 0],     # log(0)
    ], dtype=np.float64)
    f64 = np.dtype(np.float64)
    code = _Code(rows, [0, 1], [3], [((), f64), ((), f64)], [((), f64)], "single", [])
    prog = replay.Program([code])
    value, (g0, g1) = prog.value_and_grad(np.array(3.0), np.array(1.0))
    assert (prog._code.frows is not prog._code.arows) == fused
    assert value == 4.0 and g0 == 4.0 and g1 == -4.0


def test_the_buffer_rows_note_gives_the_bound_calls_python_side():
    pytest.importorskip("casadi")
    from tapegrad.bench import __main__ as cli, cases, vm
    name = "replay_rosenbrock_scalar_n100_buffer_vs_casadi"
    case = cases.SPEED_CASES[name]
    case.make("tapegrad")()
    case.make("casadi")()
    row = cli.Row(name, "speed", "s", ">= 1x", tapegrad=3e-6, torch=5e-6, ratio=1.67,
                  passed=True)
    vm.finish(name, row)
    note = row.extra["note"]
    assert "CasADi 1589 instructions" in note and "the bound call" in note
    assert "Python side" in note and "its compiled entry" in note


def test_one_sample_hvp_from_threads_at_once(prog):
    cases = [(three(s), three(s + 50)) for s in (20, 21, 22)]
    prog.hvp(*cases[0])
    want = [prog.hvp(xs, vs) for xs, vs in cases]
    errors = []

    def loop(i):
        try:
            for k in range(200):
                xs, vs = cases[(i + k) % 3]
                value, hv = prog.hvp(xs, vs)
                w = want[(i + k) % 3]
                assert value == w[0]
                for h, ww in zip(hv, w[1]):
                    np.testing.assert_array_equal(h, ww)
        except Exception as e:  # (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _branchy(a, as_tuple):
    y = (a * a * a).sum() if a[0] > 0 else (a * a).sum()
    return (y,) if as_tuple else y


def _torch_hvp(x, v):
    fn = lambda a: _branchy(a, False)  # noqa: E731
    return torch.autograd.functional.hvp(fn, torch.tensor(x), torch.tensor(v))


def test_buffer_of_a_tuple_output_after_a_failed_guard_retraces_into_the_bound_arrays():
    """A function returning ``(y,)``: the re-traced variant's value and gradient land in
    the bound arrays (the value was wrapped in a second tuple: ValueError)."""
    x = np.array([0.5, -1.2, 2.0])
    p = tg.trace(lambda a: _branchy(a, True), x, retrace=True)
    X, out, grad = x.copy(), np.empty(()), np.empty(3)
    call = p.buffer(X, out=out, grad=grad)
    call()
    X[0] = -1.0
    call()
    t = torch.tensor(X, requires_grad=True)
    (t * t).sum().backward()
    assert out == pytest.approx(float((t * t).sum().detach()))
    np.testing.assert_array_equal(grad, t.grad.numpy())
    fwd = p.buffer(X, out=out)  # forward only, the same wrapping
    X[0] = 2.0
    fwd()
    assert out == pytest.approx(float(np.sum(X ** 3)))


def test_hvp_of_a_tuple_output_is_a_tuple_on_every_path():
    x, v = np.array([0.5, -1.2, 2.0]), np.array([1.0, 2.0, -1.0])
    p = tg.trace(lambda a: _branchy(a, True), x)
    one = p.hvp(x, v)  # the one-sample path
    general = p.hvp(tg.tensor(x), tg.tensor(v))  # the general path
    assert isinstance(one[0], tuple) and isinstance(general[0], tuple)
    assert one[0][0] == float(general[0][0])
    np.testing.assert_array_equal(one[1], general[1].numpy())


def test_hvp_of_a_retracing_program_traces_the_function_with_its_own_inputs():
    """A failed guard re-traces with x alone (v was passed to the function too: TypeError)
    and gives torch's Hessian-vector product of the other branch."""
    x, v = np.array([0.5, -1.2, 2.0]), np.array([1.0, 2.0, -1.0])
    p = tg.trace(lambda a: _branchy(a, False), x, retrace=True)
    p.hvp(x, v)
    xn = x.copy()
    xn[0] = -1.0
    for value, hv in (p.hvp(xn, v), p.hvp(xn[None], v[None])):  # one sample, a batch
        want = _torch_hvp(xn, v)
        assert np.asarray(value).ravel()[0] == pytest.approx(float(want[0]))
        np.testing.assert_allclose(np.asarray(hv).reshape(-1), want[1].numpy(), rtol=1e-15)
    assert len(p._variants) == 2


def test_binding_a_fresh_program_compiles_no_entry_of_rows_as_traced(monkeypatch):
    """A bound call runs superinstructions from its first call: binding a program that was
    never called asks ``replay_cpu.entry`` only for the fused entries (the entry of rows as
    traced, ``run_into``, was 1.5 s of a cold first bound call), with the checked path's
    numbers."""
    from tapegrad.interpreters import replay_cpu
    asked, real = [], replay_cpu.entry
    monkeypatch.setattr(replay_cpu, "entry",
                        lambda rows, work, fn=None: asked.append(fn) or real(rows, work, fn))
    x0 = np.linspace(-0.9, 1.2, 7)
    fresh = tg.trace(lambda x: sum(100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
                                   for i in range(6)), x0)
    g, out = np.full(7, np.nan), np.full((), np.nan)
    fresh.buffer(x0, out=out, grad=g)()
    assert asked and all(fn in (replay_cpu.run_fused, replay_cpu.run_bound_fused)
                         for fn in asked), asked
    assert fresh._code.frows is not fresh._code.arows  # (fused: the calls' rows too)
    value, grad = fresh.value_and_grad(x0)
    assert out == value
    np.testing.assert_array_equal(g, grad)
    xt = torch.tensor(x0, requires_grad=True)
    y = sum(100.0 * (xt[i + 1] - xt[i] ** 2) ** 2 + (1.0 - xt[i]) ** 2 for i in range(6))
    (gt,) = torch.autograd.grad(y, xt)
    np.testing.assert_allclose(g, gt.numpy(), rtol=1e-13)


NO_JIT = """
import numpy as np, tapegrad as tg
p = tg.trace(lambda x: (x * x).sum() + x[0] * x[1], np.ones(3))
x, f, g = np.array([1.0, 2.0, 3.0]), np.empty(()), np.empty(3)
call = p.buffer(x, out=f, grad=g)
call()
v, want = p.value_and_grad(x)
print(float(f) == v, np.array_equal(g, want), g.tolist())
"""


def test_bound_calls_without_the_jit():
    """``NUMBA_DISABLE_JIT=1``: the entry cannot read the bound arrays by their addresses (an
    intrinsic), so the call copies them in Python, with value_and_grad's numbers."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", TAPEGRAD_QUIET="1", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", NO_JIT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "[4.0,", "5.0,", "6.0]"]
