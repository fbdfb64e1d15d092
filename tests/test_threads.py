"""Grad modes (context managers, decorators, functions; thread-local like torch's) and
recording from several threads at once."""
import sys
import threading

import numpy as np
import pytest

import tapegrad as tg


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """Every test starts and ends with grad mode on (a leak would poison later tests)."""
    tg.set_grad_enabled(True)
    yield
    tg.set_grad_enabled(True)


@pytest.fixture
def fast_switching():
    """Make the interpreter switch threads often, so that races show up."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def run_threads(targets):
    """Run each callable in its own thread, all released at once; re-raise the first error."""
    barrier = threading.Barrier(len(targets))
    results = [None] * len(targets)
    errors = []

    def wrap(i, fn):
        try:
            barrier.wait()
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=wrap, args=(i, fn)) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# --- grad modes, one thread -------------------------------------------------------------------


def test_is_grad_enabled_default():
    assert tg.is_grad_enabled() is True
    assert tg.is_inference_mode_enabled() is False


def test_no_grad_context_manager(torch):
    def run(M):
        x = M.tensor([1.0, 2.0], dtype=M.float64, requires_grad=True)
        s = M.tensor(0.5, dtype=M.float64, requires_grad=True)
        with M.no_grad():
            inside = M.is_grad_enabled()
            # (not x[0]: torch marks views of a leaf made under no_grad as requiring grad)
            ys = [x * 2.0, M.exp(x), x.sum(), x @ x, s * s, M.sin(s), M.stack([x, x]),
                  x * s, s + 1.0, (x * 3.0)[1:]]
        return inside, M.is_grad_enabled(), [y.requires_grad for y in ys], \
            [y.grad_fn is None for y in ys], [y.is_leaf for y in ys]
    assert run(tg) == run(torch)
    inside, after, rg, _, _ = run(tg)
    assert inside is False and after is True and not any(rg)


def test_no_grad_does_not_change_leaf_creation(torch):
    def run(M):
        with M.no_grad():
            x = M.tensor([1.0, 2.0], dtype=M.float64, requires_grad=True)
            z = M.zeros(2, dtype=M.float64, requires_grad=True)
        return x.requires_grad, z.requires_grad
    assert run(tg) == run(torch) == (True, True)


def test_no_grad_decorator(torch):
    def run(M):
        @M.no_grad()
        def f(x):
            return M.is_grad_enabled(), (x * x).requires_grad
        x = M.tensor(1.0, dtype=M.float64, requires_grad=True)
        return f(x), M.is_grad_enabled(), f.__name__
    assert run(tg) == run(torch) == ((False, False), True, "f")


def test_no_grad_decorator_without_parentheses(torch):
    def run(M):
        @M.no_grad
        def f(x):
            return M.is_grad_enabled(), (x * x).requires_grad
        x = M.tensor(1.0, dtype=M.float64, requires_grad=True)
        return f(x), M.is_grad_enabled()
    assert run(tg) == run(torch) == ((False, False), True)


def test_no_grad_decorator_on_a_generator(torch):
    def run(M):
        @M.no_grad()
        def gen(x):
            yield M.is_grad_enabled(), (x * x).requires_grad
            yield M.is_grad_enabled(), (x * x).requires_grad
        x = M.tensor(1.0, dtype=M.float64, requires_grad=True)
        return list(gen(x)), M.is_grad_enabled()
    assert run(tg) == run(torch) == ([(False, False), (False, False)], True)


def test_grad_mode_restored_after_an_exception(torch):
    def run(M):
        with pytest.raises(ZeroDivisionError):
            with M.no_grad():
                1 / 0
        after_ctx = M.is_grad_enabled()

        @M.no_grad()
        def f():
            raise KeyError("x")
        with pytest.raises(KeyError):
            f()
        return after_ctx, M.is_grad_enabled()
    assert run(tg) == run(torch) == (True, True)


def test_enable_grad_inside_no_grad_records(torch):
    def run(M):
        x = M.tensor([0.3, 0.6], dtype=M.float64, requires_grad=True)
        with M.no_grad():
            with M.enable_grad():
                inside = M.is_grad_enabled()
                y = (M.sin(x) * x).sum()
            after_inner = M.is_grad_enabled()
            (g,) = M.autograd.grad(y, x)   # backward works inside no_grad
        return inside, after_inner, y.requires_grad, g.detach().numpy().copy()
    (a, b, c, gt), (d, e, f, gp) = run(tg), run(torch)
    assert (a, b, c) == (d, e, f) == (True, False, True)
    np.testing.assert_allclose(gt, gp, rtol=1e-14)


def test_enable_grad_decorator_inside_no_grad(torch):
    def run(M):
        @M.enable_grad()
        def f(x):
            return M.is_grad_enabled(), (x * x).requires_grad
        x = M.tensor(1.0, dtype=M.float64, requires_grad=True)
        with M.no_grad():
            r = f(x)
            after = M.is_grad_enabled()
        return r, after
    assert run(tg) == run(torch) == ((True, True), False)


def test_set_grad_enabled_as_a_function(torch):
    def run(M):
        x = M.tensor(1.0, dtype=M.float64, requires_grad=True)
        M.set_grad_enabled(False)
        off = M.is_grad_enabled(), (x * x).requires_grad
        M.set_grad_enabled(True)
        on = M.is_grad_enabled(), (x * x).requires_grad
        return off, on
    assert run(tg) == run(torch) == ((False, False), (True, True))


def test_set_grad_enabled_as_a_context_manager(torch):
    def run(M):
        x = M.tensor(1.0, dtype=M.float64, requires_grad=True)
        out = []
        with M.set_grad_enabled(False):
            out.append((M.is_grad_enabled(), (x * x).requires_grad))
            with M.set_grad_enabled(True):
                out.append((M.is_grad_enabled(), (x * x).requires_grad))
            out.append(M.is_grad_enabled())
        out.append(M.is_grad_enabled())
        with M.no_grad():
            with M.set_grad_enabled(True):
                out.append((x * x).requires_grad)
            out.append(M.is_grad_enabled())
        return out
    assert run(tg) == run(torch)


def test_set_grad_enabled_as_a_decorator(torch):
    def run(M):
        @M.set_grad_enabled(False)
        def f(x):
            return M.is_grad_enabled(), (x * x).requires_grad
        after_decorating = M.is_grad_enabled()
        x = M.tensor(1.0, dtype=M.float64, requires_grad=True)
        return after_decorating, f(x), M.is_grad_enabled()
    assert run(tg) == run(torch) == (True, (False, False), True)


def test_set_grad_enabled_rejects_non_bool(torch):
    with pytest.raises(TypeError):
        torch.set_grad_enabled(1)
    with pytest.raises(TypeError):
        tg.set_grad_enabled(1)
    assert tg.is_grad_enabled()


def test_inference_mode(torch):
    def run(M):
        x = M.tensor([1.0, 2.0], dtype=M.float64, requires_grad=True)
        with M.inference_mode():
            inside = (M.is_grad_enabled(), M.is_inference_mode_enabled(),
                      (x * x).requires_grad, M.exp(x[0]).requires_grad)
        after = (M.is_grad_enabled(), M.is_inference_mode_enabled())
        with M.inference_mode(False):
            off = (M.is_grad_enabled(), M.is_inference_mode_enabled(), (x * x).requires_grad)
        return inside, after, off
    assert run(tg) == run(torch)
    assert run(tg)[0] == (False, True, False, False)


def test_inference_mode_decorators(torch):
    def run(M):
        @M.inference_mode()
        def f(x):
            return M.is_grad_enabled(), M.is_inference_mode_enabled(), (x * x).requires_grad

        @M.inference_mode
        def g(x):
            return M.is_grad_enabled(), M.is_inference_mode_enabled(), (x * x).requires_grad
        x = M.tensor(1.0, dtype=M.float64, requires_grad=True)
        return f(x), g(x), M.is_grad_enabled(), M.is_inference_mode_enabled()
    assert run(tg) == run(torch)


def test_in_place_update_of_a_leaf_under_no_grad(torch):
    def run(M):
        p = M.tensor([1.0, 2.0], dtype=M.float64, requires_grad=True)
        s = M.tensor(0.5, dtype=M.float64, requires_grad=True)
        (p * p * s).sum().backward()
        with M.no_grad():
            p -= 0.1 * p.grad
            s -= 0.1 * s.grad
        return p.requires_grad, p.is_leaf, s.is_leaf, p.detach().numpy().copy(), s.item()
    rt, rp = run(tg), run(torch)
    assert rt[:3] == rp[:3] == (True, True, True)
    np.testing.assert_allclose(rt[3], rp[3], rtol=1e-14)
    assert rt[4] == pytest.approx(rp[4], rel=1e-14)


# --- grad mode is thread-local ---------------------------------------------------------------


def test_no_grad_in_one_thread_does_not_affect_another():
    entered = threading.Event()
    checked = threading.Event()
    seen = {}

    def disabled():
        x = tg.tensor(1.0, requires_grad=True)
        with tg.no_grad():
            entered.set()
            assert checked.wait(10)
            seen["a"] = (tg.is_grad_enabled(), (x * x).requires_grad)

    def enabled():
        x = tg.tensor([1.0, 2.0], requires_grad=True)
        assert entered.wait(10)
        seen["b"] = (tg.is_grad_enabled(), (x * x).requires_grad,
                     tg.autograd.grad((x * x).sum(), x)[0].tolist())
        checked.set()
    run_threads([disabled, enabled])
    assert seen["a"] == (False, False)
    assert seen["b"] == (True, True, [2.0, 4.0])


def test_new_thread_starts_with_grad_enabled(torch):
    def run(M):
        out = []
        with M.no_grad():
            t = threading.Thread(target=lambda: out.append(M.is_grad_enabled()))
            t.start()
            t.join()
        return out
    assert run(tg) == run(torch) == [True]


def test_set_grad_enabled_false_in_a_thread_stays_there():
    done = threading.Event()

    def worker():
        tg.set_grad_enabled(False)
        done.set()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert done.is_set()
    assert tg.is_grad_enabled()
    x = tg.tensor(1.0, requires_grad=True)
    assert (x * x).requires_grad


# --- recording from several threads at once ---------------------------------------------------


def _program(seed, shared_w, shared_s, iters):
    """A scalar + array program; returns its values and gradients, one tuple per iteration."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(iters):
        xv = rng.standard_normal(4)
        a = tg.tensor(float(rng.uniform(0.5, 1.5)), requires_grad=True)   # own scalar leaf
        x = tg.tensor(xv, requires_grad=True)                               # own array leaf
        # scalar ops, mixing own and shared leaves
        h = tg.sin(a * shared_s) + a * a - shared_s / (a + 2.0)
        for _ in range(5):
            h = tg.tanh(h) * shared_s + a
        # array ops
        z = tg.tanh(shared_w @ x) * h + x * shared_s
        y = (z * z).sum() + z[1:3].mean() * a + tg.stack([z, x]).sum() * 0.1
        grads = tg.autograd.grad(y, [a, x, shared_w, shared_s])
        out.append((y.item(),) + tuple(np.asarray(g.numpy()).copy() for g in grads))
    return out


def _shared():
    w = tg.tensor(np.arange(16.0).reshape(4, 4) / 16.0 - 0.5, requires_grad=True)
    s = tg.tensor(0.7, requires_grad=True)
    return w, s


def _assert_runs_equal(got, want):
    assert len(got) == len(want)
    for g_it, w_it in zip(got, want):
        for g, w in zip(g_it, w_it):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=0)


@pytest.mark.parametrize("shared_leaves", [False, True])
def test_recording_from_several_threads_at_once(fast_switching, shared_leaves):
    n_threads, iters = 4, 150
    w, s = _shared()
    want = [_program(seed, w, s, iters) for seed in range(n_threads)]

    def job(seed):
        if shared_leaves:
            return lambda: _program(seed, w, s, iters)
        return lambda: _program(seed, *_shared(), iters)
    got = run_threads([job(seed) for seed in range(n_threads)])
    for g, want_i in zip(got, want):
        _assert_runs_equal(g, want_i)


def test_backward_from_several_threads_accumulates_per_thread_leaves(fast_switching):
    n_threads, iters = 4, 50

    def job(seed):
        def run():
            p = tg.tensor([0.1 * seed, 0.2, 0.3], requires_grad=True)
            q = tg.tensor(0.5 + seed, requires_grad=True)
            for _ in range(iters):
                ((p * q).exp().sum() + q * q).backward()
            return p.grad.numpy().copy(), q.grad.item()
        return run
    got = run_threads([job(seed) for seed in range(n_threads)])
    for seed, (gp, gq) in enumerate(got):
        p = np.array([0.1 * seed, 0.2, 0.3])
        q = 0.5 + seed
        np.testing.assert_allclose(gp, iters * q * np.exp(p * q), rtol=1e-12)
        np.testing.assert_allclose(gq, iters * (np.sum(p * np.exp(p * q)) + 2 * q), rtol=1e-12)


@pytest.mark.parametrize("call", ["backward", "grad"])
def test_concurrent_backward_into_shared_leaves_loses_nothing(fast_switching, call):
    # torch's AccumulateGrad locks each leaf: gradients from concurrent backward calls all
    # land in .grad
    n_threads, iters = 4, 300
    p = tg.tensor([0.1, 0.2, 0.3], requires_grad=True)
    q = tg.tensor(0.5, requires_grad=True)

    def run():
        for _ in range(iters):
            y = (p * q).exp().sum() + q * q
            if call == "backward":
                y.backward()
            else:
                gp, gq = tg.autograd.grad(y, [p, q])
                assert gq.item() == pytest.approx(np.sum(p.detach().numpy() * np.exp(
                    p.detach().numpy() * 0.5)) + 1.0, rel=1e-13)
    run_threads([run] * n_threads)
    if call == "grad":
        assert p.grad is None and q.grad is None
        return
    pv, qv = np.array([0.1, 0.2, 0.3]), 0.5
    total = n_threads * iters
    np.testing.assert_allclose(p.grad.numpy(), total * qv * np.exp(pv * qv), rtol=1e-10)
    assert q.grad.item() == pytest.approx(total * (np.sum(pv * np.exp(pv * qv)) + 2 * qv),
                                          rel=1e-10)


def test_non_leaf_from_another_thread_can_be_used(torch):
    x = tg.tensor([0.2, 0.4], requires_grad=True)
    h = tg.exp(x) * 2.0                      # recorded by the main thread

    def worker():
        y = (tg.sin(h) * h).sum()            # recorded by the worker, importing h
        return tg.autograd.grad(y, [x, h])
    gx, gh = run_threads([worker])[0]
    xt = torch.tensor([0.2, 0.4], dtype=torch.float64, requires_grad=True)
    ht = torch.exp(xt) * 2.0
    yt = (torch.sin(ht) * ht).sum()
    gxt, ght = torch.autograd.grad(yt, [xt, ht])
    np.testing.assert_allclose(gx.numpy(), gxt.numpy(), rtol=1e-13)
    np.testing.assert_allclose(gh.numpy(), ght.numpy(), rtol=1e-13)


def test_graph_built_by_two_threads_in_turn(torch):
    # main -> worker -> main: each thread's tape imports from the other's; torch's graph is
    # one DAG whichever thread recorded each node
    def run(M):
        x = M.tensor([1.0, 2.0], dtype=M.float64, requires_grad=True)
        a = x * 2.0                                  # main thread
        b = run_threads([lambda: M.sin(a) * 3.0])[0]  # worker thread, uses a
        c = (b * a).sum()                            # main thread, uses b and a
        return M.autograd.grad(c, x)[0]
    np.testing.assert_allclose(run(tg).numpy(), run(torch).numpy(), rtol=1e-13)


def test_each_thread_records_on_its_own_tape():
    tapes = {}
    go = threading.Barrier(2)

    def job(name):
        def run():
            x = tg.tensor(1.0, requires_grad=True)
            y = x * 2.0
            go.wait()
            z = y + 1.0
            tapes[name] = (y._tape, z._tape)
            return z.item()
        return run
    run_threads([job("a"), job("b")])
    (ya, za), (yb, zb) = tapes["a"], tapes["b"]
    assert ya is za and yb is zb and ya is not yb
