"""Intra-op threads (``set_num_threads``): each pass split over threads gives the bits of one
thread, forward and backward, from one user thread or several at once."""
import threading
import time

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _threads
from tapegrad.ops import _kernels as K

SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, -1e308, 1e308])


@pytest.fixture(autouse=True)
def _threads_restored(monkeypatch):
    """Each test starts with no back-off (a loaded machine's earlier passes), never backs
    off (a test's chunks wait for each other: slow passes) but where it says so, and leaves
    the thread count as it found it."""
    n = tg.get_num_threads()
    _threads._backoff[:] = [0, 0]
    monkeypatch.setattr(_threads, "PAYOFF", float("inf"))
    yield
    tg.set_num_threads(n)


def _specials(rng, shape):
    a = rng.normal(size=shape) * rng.lognormal(size=shape) * 10
    m = rng.random(shape) < 0.05
    a[m] = rng.choice(SPECIALS, size=int(m.sum()))
    return a


def _same_bits(r, s):
    """The same bits, NaNs' payloads included (one pass split or not)."""
    return (r.shape == s.shape and r.dtype == s.dtype
            and np.array_equal(r.view(np.int64), s.view(np.int64)))


def _numpys_bits(r, s):
    """NumPy's numbers: NaN where it has NaN, signed zeros and infinities as it has them."""
    return (r.shape == s.shape and np.array_equal(r, s, equal_nan=True)
            and np.array_equal(np.signbit(r)[~np.isnan(r)], np.signbit(s)[~np.isnan(s)]))


def _counted(monkeypatch):
    """The chunk counts of the passes split over threads (NumPy's and compiled passes)."""
    counts = []
    real, real_compiled = K.run_chunks, K.run_compiled
    monkeypatch.setattr(K, "run_chunks", lambda fn, m: counts.append(m) or real(fn, m))
    monkeypatch.setattr(K, "run_compiled", lambda m, *a: counts.append(m) or
                        real_compiled(m, *a))
    return counts


def _by_threads(f, threads=(1, 2, 3)):
    """f()'s result at each thread count (arrays, or tuples of them)."""
    out = []
    for n in threads:
        tg.set_num_threads(n)
        r = f()
        out.append(tuple(np.array(v, copy=True) for v in (r if isinstance(r, tuple) else (r,))))
    return out


def _all_same(results, numpy=None):
    """Every thread count's results the same bits, and NumPy's numbers (``numpy``)."""
    for r in results[1:]:
        assert all(_same_bits(a, b) for a, b in zip(results[0], r))
    if numpy is not None:
        assert _numpys_bits(results[0][0], numpy)


# --- set_num_threads, get_num_threads -------------------------------------------------------


def test_default_and_round_trip():
    assert 1 <= tg.get_num_threads() <= 8
    tg.set_num_threads(3)
    assert tg.get_num_threads() == 3
    tg.set_num_threads(np.int64(1))  # an integer of any type (torch takes NumPy's)
    assert tg.get_num_threads() == 1 and type(tg.get_num_threads()) is int


@pytest.mark.parametrize("env", ["", "1", "4"])
def test_default_is_one_thread(env):
    # one thread whatever OMP_NUM_THREADS says (torch's default is the cores: ours did not
    # pay on the machines measured, so more threads are asked for, never assumed)
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "from tapegrad import _threads as t; "
                          "print(t.get_num_threads())"],
                         env=dict(os.environ, OMP_NUM_THREADS=env), capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["1"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None, 2.0])
def test_set_num_threads_errors_like_torch(bad):
    torch = pytest.importorskip("torch")
    with pytest.raises(Exception) as theirs:
        torch.set_num_threads(bad)
    before = tg.get_num_threads()
    with pytest.raises(type(theirs.value)) as ours:
        tg.set_num_threads(bad)
    assert str(ours.value) == str(theirs.value)
    assert tg.get_num_threads() == before  # nothing changed


# --- run_chunks --------------------------------------------------------------------------


def test_run_chunks_runs_each_chunk_once():
    for m in (1, 2, 3, 7):
        seen = []
        _threads.run_chunks(lambda i: seen.append(i), m)
        assert sorted(seen) == list(range(m))


@pytest.mark.parametrize("where", [0, 1, 2])
def test_run_chunks_raises_what_a_chunk_raised(where):
    done = []

    def fn(i):
        if i == where:
            raise ValueError(f"chunk {i}")
        done.append(i)
    with pytest.raises(ValueError, match=f"chunk {where}"):
        _threads.run_chunks(fn, 3)
    assert where not in done  # (a chunk not started when one failed may be skipped)
    seen = []  # and the workers still serve the next pass
    _threads.run_chunks(lambda i: seen.append(i), 3)
    assert sorted(seen) == [0, 1, 2]


def test_a_worker_late_to_start_leaves_its_chunks_to_the_caller(monkeypatch):
    # a worker that does not come (asleep, its wake-up late: its core busy) never makes the
    # caller wait: the caller takes every chunk, and the worker, when it comes, finds none
    tg.set_num_threads(2)
    monkeypatch.setattr(_threads, "_turns", [0])  # (workers sleep at once)
    monkeypatch.setattr(_threads._pool, "workers", [])
    _threads.run_chunks(lambda i: None, 2)
    w = _threads._pool.workers[0]
    for _ in range(5000):
        if w.sleeping:
            break
        time.sleep(0.001)
    assert w.sleeping
    real, wakes = w.go, []

    class Late:  # the wake-up, held back
        def release(self):
            wakes.append(1)
    w.go = Late()
    seen = []
    _threads.run_chunks(lambda i: seen.append((i, threading.get_ident())), 5)
    assert sorted(seen) == [(i, threading.get_ident()) for i in range(5)] and wakes == [1]
    w.go = real
    real.release()  # the late wake-up: nothing left to take, it sleeps again
    for _ in range(5000):
        if w.sleeping:
            break
        time.sleep(0.001)
    assert w.sleeping
    seen.clear()
    _threads.run_chunks(seen.append, 3)
    assert sorted(seen) == [0, 1, 2]


def test_a_chunk_in_progress_is_waited_for_and_its_result_read_after():
    # the caller ends its chunks while a worker is still in one: it waits (spinning, then
    # yielding its core), and reads the result only after the worker's writes
    tg.set_num_threads(2)
    out = np.zeros(4)
    started = threading.Event()

    def fn(i):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            time.sleep(0.05)  # (longer than the caller's spin)
        elif not out.any():  # (the caller's first chunk: a worker takes one meanwhile)
            started.wait(10)
        out[i] = i + 1
    for _ in range(3):
        out[:] = 0
        started.clear()
        _threads.run_chunks(fn, 4)
        assert list(out) == [1, 2, 3, 4]


def test_an_interrupt_in_the_wait_waits_for_the_workers_chunks(monkeypatch):
    # a KeyboardInterrupt while the caller waits for a worker's chunk is raised only once
    # that chunk has ended (it writes the pass's result), and the pool serves the next pass
    tg.set_num_threads(2)
    started, ended = threading.Event(), []

    def fn(i):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            time.sleep(0.05)
            ended.append(i)
        else:
            started.wait(10)
    calls = []

    def interrupting():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
    monkeypatch.setattr(_threads.os, "sched_yield", interrupting)
    with pytest.raises(KeyboardInterrupt):
        _threads.run_chunks(fn, 2)
    assert ended and calls
    monkeypatch.undo()
    seen = []
    _threads.run_chunks(seen.append, 3)
    assert sorted(seen) == [0, 1, 2]


def test_threads_over_the_count_stay_out():
    # workers started for 3 threads take no chunk once the count is back to 2 (or 1)
    tg.set_num_threads(3)
    _threads.run_chunks(lambda i: time.sleep(0.001), 6)
    assert len(_threads._pool.workers) >= 2
    for n in (2, 1):
        tg.set_num_threads(n)
        who = set()
        _threads.run_chunks(lambda i: (time.sleep(0.002), who.add(threading.get_ident())), 8)
        assert len(who) <= n


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_runs_threaded_passes():
    # the parent's workers are not in a forked child (nor their job): the child starts its
    # own, with the parent's bits
    import multiprocessing
    tg.set_num_threads(2)
    rng = np.random.default_rng(11)
    x, y = rng.normal(size=(9, 8, 2001)), rng.normal(size=(9, 8, 1))
    want = K.rows_op(K.SUB, x, y)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_pass, args=(child, x, y))
    proc.start()
    try:
        assert parent.poll(120), "the forked child's pass did not finish"
        got = parent.recv()
        assert _same_bits(got[0], want) and _same_bits(got[1], np.sum(x, 1)) and got[2] == 1
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _child_pass(conn, x, y):
    tg.set_num_threads(2)
    r = K.rows_op(K.SUB, x, y), K.sum_middle(x, 1, False)
    conn.send(r + (len(_threads._pool.workers),))


def test_run_chunks_nested_runs_inline():
    seen = []

    def inner(i):
        _threads.run_chunks(lambda j: seen.append((i, j)), 2)
    _threads.run_chunks(inner, 2)
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]


# --- each threaded pass: the bits of one thread ------------------------------------------

# (x shape, y shape) around the thresholds: the result of PAR_MIN numbers is split (NumPy's
# passes; JOB_EDGE for the compiled ones), one less is not; odd sizes, either operand
# broadcast, the split on the outer axis or the rows'
EDGE = K.PAR_MIN
JOB_EDGE = K.JOB_SPLIT_MIN


@pytest.mark.parametrize("xs, ys, split", [
    ((25, 10, 1000), (25, 10, 1), True), ((1, 10, 1000), (25, 10, 1), True),
    ((25, 10, 1), (1, 10, 1000), True), ((7, 11, 1703), (7, 1, 1703), True),
    ((1, 2, JOB_EDGE // 2), (1, 2, 1), True), ((1, 2, JOB_EDGE // 2 - 1), (1, 2, 1), False),
    ((2, 1, JOB_EDGE // 2), (2, 3, 1), True), ((JOB_EDGE // 64, 64), (JOB_EDGE // 64, 1), True),
    ((JOB_EDGE // 64 - 1, 64), (JOB_EDGE // 64 - 1, 1), False),
    ((1, 1, 3 * JOB_EDGE), (2, 1, 1), True), ((1, 3, 77777), (1, 1, 1), True),
    ((1, 8, 1000), (10, 8, 1), False), ((10, 1, 1000), (10, 8, 1000), False)])  # (kmeans')
def test_rows_op_threads_bits(monkeypatch, xs, ys, split):
    counts = _counted(monkeypatch)
    rng = np.random.default_rng(sum(xs))
    x, y = _specials(rng, xs), _specials(rng, ys)
    with np.errstate(all="ignore"):
        for op, f in ((K.ADD, np.add), (K.SUB, np.subtract), (K.MUL, np.multiply)):
            _all_same(_by_threads(lambda: K.rows_op(op, x, y)), f(x, y))
            xb = np.broadcast_to(x, np.broadcast_shapes(xs, ys))  # an expanded operand
            _all_same(_by_threads(lambda: K.rows_op(op, xb, y)), f(xb, y))
    assert bool(counts) == split and all(2 <= m <= 3 * K.JOB_PER_THREAD for m in counts)


@pytest.mark.parametrize("shape, split", [((25, 10, 1000), True), ((3, 7, 9999), True),
                                          ((2, 1, JOB_EDGE // 2), True),
                                          ((2, 3, JOB_EDGE // 6 - 1), False),
                                          ((10, 8, 1000), False),  # (kmeans' passes)
                                          ((JOB_EDGE // 64, 64), False)])  # (2 dims: one row)
def test_sum_middle_threads_bits(monkeypatch, shape, split):
    counts = _counted(monkeypatch)
    a = _specials(np.random.default_rng(shape[-1]), shape)
    a[0, ...] = -0.0
    with np.errstate(all="ignore"):
        for kd in (False, True):
            res = _by_threads(lambda: K.sum_middle(a, -2, kd))
            _all_same(res, np.sum(a, axis=-2, keepdims=kd))
    assert bool(counts) == split


@pytest.mark.parametrize("case", ["batch", "transposed", "broadcast_a", "broadcast_b",
                                  "strided", "small"])
def test_matmul_threads_bits(monkeypatch, case):
    counts = _counted(monkeypatch)
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(25, 10, 10)), rng.normal(size=(25, 10, 1003))
    if case == "transposed":  # gmm's g @ xc^T: a transposed view
        a, b = rng.normal(size=(25, 10, 1003)), rng.normal(size=(25, 10, 1003)).transpose(0, 2, 1)
    elif case == "broadcast_a":
        a = a[:1]
    elif case == "broadcast_b":
        a, b = rng.normal(size=(13, 1001, 10)), rng.normal(size=(1, 10, 12))
    elif case == "strided":
        b = rng.normal(size=(25, 10, 2006))[:, :, ::2]
    elif case == "small":
        b = b[:, :, :EDGE // 250 - 1]
    a[0, 0, 0], b[-1, 0, 0] = np.nan, -0.0
    _all_same(_by_threads(lambda: K.matmul(a, b)), np.matmul(a, b))
    assert bool(counts) == (case != "small")


@pytest.mark.parametrize("xs, ys", [((25, 10, 1000), (25, 10, 1000)), ((7, 3, 9001), (7, 1, 9001)),
                                    ((3, EDGE // 3 + 1), (1, EDGE // 3 + 1))])
def test_par_ufunc_bits(xs, ys):
    rng = np.random.default_rng(4)
    x, y = _specials(rng, xs), _specials(rng, ys)
    xt = _specials(rng, xs[::-1]).T  # a non-contiguous operand
    with np.errstate(all="ignore"):
        for f in (np.add, np.multiply):
            for u, v in ((x, y), (xt, y), (np.broadcast_to(y, xs), x)):
                res = _by_threads(lambda: K.par_ufunc(f, u, v), threads=(2, 3))
                _all_same(res, f(u, v))
    tg.set_num_threads(1)
    assert K.par_ufunc(np.add, x, y) is None  # one thread: the caller's one call


@pytest.mark.parametrize("shape", [(25, 10, 1000), (3, 7, 9999), (EDGE, 1), (2, EDGE // 2),
                                   (EDGE // 2 - 1, 2)])
def test_sum_last_threads_bits(shape):
    a = _specials(np.random.default_rng(5), shape)
    a[0] = -0.0
    with np.errstate(all="ignore"):
        for kd in (False, True):
            res = _by_threads(lambda: K.sum_last(a, kd), threads=(2, 3))
            if shape[0] * (shape[1] if len(shape) > 2 else 1) < 2 or a.size < EDGE:
                assert res[0][0].shape == ()  # (declined: None)
                continue
            _all_same(res, np.sum(a, axis=-1, keepdims=kd))


# --- whole evaluations ---------------------------------------------------------------------


def _gmm_grad(M, seed=0, k=25, d=10, n=1000):
    from tapegrad.bench.gradbench import gmm
    rng = np.random.default_rng(seed)
    xT = rng.normal(size=(d, n))
    ps = [M.tensor(v, requires_grad=True) for v in (
        rng.normal(size=k), rng.normal(size=(k, d)), 0.1 * rng.normal(size=(k, d)),
        0.1 * rng.normal(size=(k, d * (d - 1) // 2)))]
    y = gmm.objective(M, *ps, M.tensor(xT), 0, 1.0)
    return (y.detach().numpy(),) + tuple(g.numpy() for g in M.autograd.grad(y, ps))


def test_gmm_gradient_bits_on_threads(monkeypatch):
    # gmm's forward and gradient: the same bits on 1, 2 and 3 threads, with passes split
    # forward (x - mu, Q @ xc, the sum over d) and backward (g * Qxc doubled, both
    # products, the sum over the points)
    counts = _counted(monkeypatch)
    _all_same(_by_threads(lambda: _gmm_grad(tg)))
    assert len(counts) == 2 * 7, counts


def test_gmm_gradient_matches_torch_on_threads():
    torch = pytest.importorskip("torch")
    tg.set_num_threads(2)
    for a, b in zip(_gmm_grad(tg, 1), _gmm_grad(torch, 1)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_square_gradient_of_a_broadcast_gradient():
    # x * x under a sum over the middle axis (g broadcast along it) and under a plain
    # gradient (g contiguous): the rows pass and the threaded multiply, NumPy's bits
    torch = pytest.importorskip("torch")
    x0 = _specials(np.random.default_rng(6), (9, 5, 3001))
    x0[np.isnan(x0) | np.isinf(x0)] = 1.5  # (torch's gradient of inf * inf is nan here too)
    w0 = np.random.default_rng(7).normal(size=(9, 5, 3001))
    for f in (lambda M, x: M.sum(M.sum(x * x, 1) ** 2), lambda M, x: M.sum(x * x * M.tensor(w0))):
        res = _by_threads(lambda: tuple(
            M.autograd.grad(f(M, x), x)[0].numpy()
            for M in (tg,) for x in (M.tensor(x0, requires_grad=True),)))
        _all_same(res)
        x = torch.tensor(x0, requires_grad=True)
        ref, = torch.autograd.grad(f(torch, x), x)
        np.testing.assert_allclose(res[0][0], ref.numpy(), rtol=1e-12)


def test_square_gradient_in_one_pass_is_the_sums_bits(monkeypatch):
    # x * x under a broadcast g: g * x + g * x in one compiled pass (MUL2), the bits of the
    # sweep's two additions of g * x; taken only for the first gradient of x (a later one
    # adds to what is there, in the sweep's order)
    from tapegrad.interpreters import cpu_arrays
    x0 = _specials(np.random.default_rng(8), (6, 5, 3001))
    c0 = np.random.default_rng(9).normal(size=(6, 5, 3001))
    fs = (lambda x: tg.sum(tg.sum(x * x, 1) * tg.tensor(c0[:, 0])),
          lambda x: tg.sum(tg.sum(x * x, 1)) + tg.sum(x * tg.tensor(c0)))
    real = cpu_arrays.rows_op
    for f in fs:
        res = []
        for fused in (True, False):
            ops = []
            monkeypatch.setattr(cpu_arrays, "rows_op", lambda op, x, y: (
                None if op == K.MUL2 and not fused else ops.append(op) or real(op, x, y)))
            for n in (1, 2):
                tg.set_num_threads(n)
                x = tg.tensor(x0, requires_grad=True)
                res.append(tg.autograd.grad(f(x), x)[0].numpy())
            assert (K.MUL2 in ops) == (fused and f is fs[0])  # (fs[1]: x * c's first)
        assert all(_same_bits(res[0], r) for r in res[1:])


def test_user_threads_at_once():
    # several user threads evaluating gmm's gradient at once while passes run on the
    # workers: each result is the one-thread result, bit for bit (the interpreter switching
    # threads often, so that races show up)
    import sys
    old = sys.getswitchinterval()
    tg.set_num_threads(1)
    want = [_gmm_grad(tg, s, k=6, n=3000) for s in range(4)]
    tg.set_num_threads(2)
    got, errors = {}, []

    def work(s):
        try:
            for _ in range(3):
                got.setdefault(s, []).append(_gmm_grad(tg, s, k=6, n=3000))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    sys.setswitchinterval(1e-6)
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    for s in range(4):
        for r in got[s]:
            assert all(_same_bits(a, b) for a, b in zip(r, want[s]))


def test_an_idle_worker_keeps_no_reference_to_its_last_job():
    # a worker's last job (its arrays: a pass's output, a batch's results) must not live
    # until the next one: after a backward, the tape's saved arrays were held by it
    import gc
    import weakref
    tg.set_num_threads(2)

    class Held:
        pass
    held, ran = Held(), []
    ref = weakref.ref(held)

    def fn(i, h=held):
        ran.append(threading.current_thread() is threading.main_thread())
        if ran[-1]:
            time.sleep(0.01)  # (the worker takes a chunk too)
    _threads.run_chunks(fn, 2)
    del fn, held
    gc.collect()
    assert ref() is None


def test_passes_run_alone_for_a_while_after_the_threads_did_not_pay(monkeypatch):
    # a pass slower than the caller's own pace would be (a worker taken off its core: here
    # the clock says so) makes the next 1, then 2, 4 ... passes (up to BACKOFF_MAX) run on
    # the calling thread alone; a pass on time ends that. The results never change
    tg.set_num_threads(2)
    monkeypatch.setattr(_threads, "PAYOFF", 0.95)
    monkeypatch.setattr(_threads, "BACKOFF_MAX", 4)
    monkeypatch.setattr(_threads, "_backoff", [0, 0])
    slow = [True]
    ticks = iter(range(0, 10 ** 9, 10 ** 6))  # (each reading a second after the last)
    monkeypatch.setattr(_threads, "_clock", lambda: next(ticks) if slow[0] else 0.0)
    # the caller's own chunks judged as if it took one or more (a caller that loads a
    # kernel or is descheduled while the workers take every chunk is not judged: here
    # the clock alone must decide)
    judge = _threads._judge
    monkeypatch.setattr(_threads, "_judge", lambda t0, cpu, own, m:
                        judge(t0, max(cpu, 1e-9), max(own, 1), m))
    rng = np.random.default_rng(12)
    x, y = rng.normal(size=(9, 8, 2001)), rng.normal(size=(9, 8, 1))
    want = x - y

    def run():  # whether the pass went to the threads
        n = _threads.counts["passes_split"]
        assert _same_bits(K.rows_op(K.SUB, x, y), want)
        return _threads.counts["passes_split"] > n
    ran = [run() for _ in range(8)]  # threads, alone, threads, alone x 2, threads, alone x 2
    assert ran == [True, False, True, False, False, True, False, False], ran
    assert _threads._backoff == [2, 4]
    _threads._backoff[0] = 0
    assert run() and _threads._backoff == [4, 4]  # (capped at BACKOFF_MAX)
    slow[0] = False
    _threads._backoff[0] = 0
    assert run() and _threads._backoff == [0, 0]
    assert run()


def _wait_until(cond, seconds=5.0):
    end = time.perf_counter() + seconds
    while not cond() and time.perf_counter() < end:
        time.sleep(0.001)
    return cond()


def test_a_worker_leaving_its_spin_while_a_job_is_coming_spins_again():
    """A job posted ``later`` (the caller stores its claim word from inside its first
    block) finds no thread asleep, so it wakes none: a worker then leaving its spin must
    not sleep through it, but spin again until the job ends (``Pool.coming``)."""
    if not _threads.jit_on():
        pytest.skip("the hand-over is compiled only with the JIT")
    tg.set_num_threads(2)
    pool = _threads._pool
    _threads.run_chunks(lambda i: None, 2)  # the worker started
    w = pool.workers[0]
    assert _wait_until(lambda: w.sleeping)  # no job: asleep after its spin
    with pool.mutex:
        pool.coming = True
        w.sleeping = False
        w.go.release()
    time.sleep(0.02)  # 400 spins' time: it left its spin many times
    assert not w.sleeping
    with pool.mutex:
        pool.coming = False  # (as finish does)
    assert _wait_until(lambda: w.sleeping)
    assert pool.coming is False


def test_a_roused_worker_takes_the_next_pass_without_a_post(monkeypatch):
    # after a split pass the worker spins (ROUSE_S) in compiled code: the next pass is
    # described, posted and run by the caller's one compiled call (no Pool.post), and a
    # worker that took chunks of it gave the same bits as one thread
    tg.set_num_threads(2)
    monkeypatch.setattr(_threads, "ROUSE_S", 0.05)
    monkeypatch.setattr(_threads._pool, "roused", 0.0)  # (restored after: no spin left over)
    rng = np.random.default_rng(13)
    x, y = _specials(rng, (9, 8, 2001)), _specials(rng, (9, 8, 1))
    with np.errstate(all="ignore"):
        want = x - y
        assert _same_bits(K.rows_op(K.SUB, x, y), want)  # (starts or wakes the worker)
        w = _threads._pool.workers[0]
        assert _wait_until(lambda: not w.sleeping)
        posts = []
        real = _threads.Pool.post
        monkeypatch.setattr(_threads.Pool, "post", lambda self, *a, **k: posts.append(1) or
                            real(self, *a, **k))
        n = _threads.counts["passes_split"]
        got = [K.rows_op(K.SUB, x, y) for _ in range(5)]
        sums = [K.sum_middle(x, 1, False) for _ in range(5)]
        want_sum = np.sum(x, 1)
    assert all(_same_bits(g, want) for g in got)
    assert all(_same_bits(s, want_sum) for s in sums)
    assert _threads.counts["passes_split"] == n + 10
    assert len(posts) < 10  # (a worker taken off its core past ROUSE_S sleeps: posted)
    assert 0 < _threads.last_pass[0] and 0 <= _threads.last_pass[1] <= _threads.last_pass[0]


def test_an_interrupt_before_the_compiled_call_leaves_no_job(monkeypatch):
    # a KeyboardInterrupt raised before the caller's compiled call ran (a signal handler's):
    # no chunk of a job never described is taken, the pass raises, the next one runs
    tg.set_num_threads(2)
    rng = np.random.default_rng(14)
    x, y = rng.normal(size=(9, 8, 2001)), rng.normal(size=(9, 8, 1))

    def interrupted(*a):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        _threads.run_compiled(4, interrupted, x, y)
    assert not _threads._pool.busy.locked()
    assert _same_bits(K.rows_op(K.SUB, x, y), x - y)


def test_the_default_is_one_constant():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "from tapegrad import _threads as t; "
                          "t.DEFAULT_THREADS == t.get_num_threads() == 1 or exit(1)"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
