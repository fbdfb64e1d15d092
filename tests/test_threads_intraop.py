"""Intra-op threads (``set_num_threads``): each pass split over threads gives the bits of one
thread, forward and backward, from one user thread or several at once."""
import threading

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _threads
from tapegrad.ops import _kernels as K

SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, -1e308, 1e308])


@pytest.fixture(autouse=True)
def _threads_restored():
    """Each test starts with no back-off (a loaded machine's earlier passes) and leaves the
    thread count as it found it."""
    n = tg.get_num_threads()
    _threads._backoff[:] = [0, _threads.BACKOFF]
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
    """The chunk counts of the passes split over threads."""
    counts = []
    real = K.run_chunks
    monkeypatch.setattr(K, "run_chunks", lambda fn, m: counts.append(m) or real(fn, m))
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


def test_late_worker_backs_off(monkeypatch):
    # a chunk withdrawn (its worker busy: no core in time) runs on the caller, and the next
    # BACKOFF passes run on the calling thread alone; the one after uses the workers again
    import time
    monkeypatch.setattr(_threads, "BACKOFF", 3)
    monkeypatch.setattr(_threads, "_backoff", [0, 3])
    monkeypatch.setattr(_threads, "PAY_SLACK", 1.0)  # (the pass's time: the other test)
    monkeypatch.setattr(_threads, "LATE", 0.005)  # (the caller's chunk sleeps twice that)
    _threads.run_chunks(lambda i: None, 2)  # (the worker exists)
    w = _threads._pool.workers[0]
    release = threading.Event()
    blocker = release.wait
    w.post(blocker)
    while w.job is not None:  # until the worker is inside the blocker
        time.sleep(0.001)
    _threads._backoff[:] = [0, 3]  # (the first pass may have found its new worker late)
    names = []

    def fn(i):
        names.append((i, threading.current_thread() is threading.main_thread()))
        if i == 0:
            time.sleep(2 * _threads.LATE)  # (a chunk of that length: the worker is late)
    _threads.run_chunks(fn, 2)
    release.set()
    w.finish(blocker)
    assert sorted(names) == [(0, True), (1, True)] and _threads._backoff[0] == 3
    posted = []
    real_post = _threads._Worker.post
    monkeypatch.setattr(_threads._Worker, "post", lambda w, job: posted.append(1) or
                        real_post(w, job))
    for _ in range(3):
        names.clear()
        _threads.run_chunks(fn, 2)
        assert sorted(names) == [(0, True), (1, True)]
    assert not posted and _threads._backoff[0] == 0
    _threads.run_chunks(fn, 2)
    assert posted == [1]
    _threads._backoff[0] = 0


def test_stalled_worker_backs_off_doubling(monkeypatch):
    # a worker that took its chunk but ends it long after the caller (taken off its core
    # midway), a pass that saved little, backs off too; each late pass after a back-off
    # doubles the next one (up to BACKOFF_MAX), a pass on time resets it
    import time
    monkeypatch.setattr(_threads, "BACKOFF", 2)
    monkeypatch.setattr(_threads, "BACKOFF_MAX", 5)
    monkeypatch.setattr(_threads, "_backoff", [0, 2])
    _threads.run_chunks(lambda i: None, 2)  # (the worker exists)
    _threads._backoff[:] = [0, 2]  # (that first pass may have been judged late)
    taken = []
    started = threading.Event()

    def fn(i):
        if i == 1:
            taken.append(threading.current_thread() is not threading.main_thread())
            started.set()
            time.sleep(20 * _threads.STALL)
        else:  # (the caller's chunk waits for the worker to start its own)
            started.wait(1.0)
    lengths = []
    for _ in range(3):
        _threads._backoff[0] = 0  # (each pass a probe)
        started.clear()
        _threads.run_chunks(fn, 2)
        lengths.append(_threads._backoff[0])
    assert taken == [True] * 3 and lengths == [2, 4, 5]
    _threads._backoff[0] = 0
    _threads.run_chunks(lambda i: None, 1)  # (one chunk: no workers, no change)
    assert _threads._backoff == [0, 5]
    # a pass on time (the thresholds out of reach: a loaded machine cannot make it late)
    monkeypatch.setattr(_threads, "LATE", 3600.0)
    monkeypatch.setattr(_threads, "STALL", 3600.0)
    monkeypatch.setattr(_threads, "PAY_SLACK", 3600.0)
    _threads._backoff[0] = 0
    _threads.run_chunks(lambda i: None, 2)
    assert _threads._backoff == [0, 2]


def test_short_chunk_withdrawn_without_back_off(monkeypatch):
    # a caller's chunk shorter than LATE: a withdrawn chunk says nothing of the machine's
    # load (an idle core takes about that long to wake a thread), no back-off (the pass's
    # time, the other test, aside)
    monkeypatch.setattr(_threads, "_backoff", [0, _threads.BACKOFF])
    monkeypatch.setattr(_threads, "PAY_SLACK", 1.0)
    monkeypatch.setattr(_threads, "LATE", 0.5)  # (a loaded machine cannot make it late)
    _threads.run_chunks(lambda i: None, 2)
    import time
    w = _threads._pool.workers[0]
    release = threading.Event()
    blocker = release.wait
    w.post(blocker)
    while w.job is not None:
        time.sleep(0.001)
    _threads._backoff[0] = 0
    seen = []
    _threads.run_chunks(seen.append, 2)
    release.set()
    w.finish(blocker)
    assert sorted(seen) == [0, 1] and _threads._backoff[0] == 0


def test_interrupted_wait_drops_the_worker():
    # a wait for a worker's chunk cut short (KeyboardInterrupt) leaves its locks out of
    # step with its jobs: that worker is never handed another chunk, and the next pass
    # waits for every chunk it hands out (no result read before it is written)
    import time
    _threads.run_chunks(lambda i: None, 2)
    w = _threads._pool.workers[0]
    real = w.done

    class Interrupting:
        def acquire(self, *args):
            raise KeyboardInterrupt

        def release(self):
            real.release()
    started, release = threading.Event(), threading.Event()

    def fn(i):
        if i == 1:
            started.set()
            release.wait(5)
        else:
            started.wait(5)
    w.done = Interrupting()
    _threads._backoff[0] = 0
    try:
        with pytest.raises(KeyboardInterrupt):
            _threads.run_chunks(fn, 2)
        assert w not in _threads._pool.workers
    finally:
        release.set()
        if w in _threads._pool.workers:  # (a failed check: not left to the other tests)
            _threads._pool.workers.remove(w)
    _threads._backoff[0] = 0
    out = np.zeros(2)

    def slow(i):
        if i == 1:
            time.sleep(0.01)
        out[i] = i + 1
    for _ in range(3):
        out[:] = 0
        _threads._backoff[0] = 0
        _threads.run_chunks(slow, 2)
        assert list(out) == [1, 2]


def test_run_chunks_nested_runs_inline():
    seen = []

    def inner(i):
        _threads.run_chunks(lambda j: seen.append((i, j)), 2)
    _threads.run_chunks(inner, 2)
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]


# --- each threaded pass: the bits of one thread ------------------------------------------

# (x shape, y shape) around the threshold: the result of PAR_MIN numbers is split, one less
# is not; odd sizes, either operand broadcast, the split on the outer axis or the rows'
EDGE = K.PAR_MIN


@pytest.mark.parametrize("xs, ys, split", [
    ((25, 10, 1000), (25, 10, 1), True), ((1, 10, 1000), (25, 10, 1), True),
    ((25, 10, 1), (1, 10, 1000), True), ((7, 11, 1703), (7, 1, 1703), True),
    ((1, 2, EDGE // 2), (1, 2, 1), True), ((1, 2, EDGE // 2 - 1), (1, 2, 1), False),
    ((2, 1, EDGE // 2), (2, 3, 1), True), ((EDGE // 64, 64), (EDGE // 64, 1), True),
    ((EDGE // 64 - 1, 64), (EDGE // 64 - 1, 1), False), ((1, 1, 3 * EDGE), (2, 1, 1), True)])
def test_rows_op_threads_bits(monkeypatch, xs, ys, split):
    counts = _counted(monkeypatch)
    rng = np.random.default_rng(sum(xs))
    x, y = _specials(rng, xs), _specials(rng, ys)
    with np.errstate(all="ignore"):
        for op, f in ((K.ADD, np.add), (K.SUB, np.subtract), (K.MUL, np.multiply)):
            _all_same(_by_threads(lambda: K.rows_op(op, x, y)), f(x, y))
            xb = np.broadcast_to(x, np.broadcast_shapes(xs, ys))  # an expanded operand
            _all_same(_by_threads(lambda: K.rows_op(op, xb, y)), f(xb, y))
    assert bool(counts) == split and all(m in (2, 3) for m in counts)


@pytest.mark.parametrize("shape, split", [((25, 10, 1000), True), ((3, 7, 9999), True),
                                          ((2, 1, EDGE // 2), True), ((2, 3, EDGE // 6 - 1),
                                                                        False),
                                          ((EDGE // 64, 64), False)])  # (2 dims: one row)
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


def _last_job_released(worker, post, finish):
    """Run one job on ``worker`` (taken by its thread, not withdrawn), then check that the
    idle thread keeps nothing the job referenced alive."""
    import gc
    import weakref

    class Held:
        pass
    held, ran = Held(), threading.Event()
    ref = weakref.ref(held)

    def job(h=held):
        ran.set()
    token = post(job)
    assert ran.wait(30), "the worker never took the job"
    finish(job, token)
    del job, held
    gc.collect()
    return ref() is None


def test_an_idle_worker_keeps_no_reference_to_its_last_job():
    # a worker's last job (its arrays: a pass's output, a batch's results) must not live
    # until the next one: after a backward, the tape's saved arrays were held by it
    from tapegrad import _threads
    from tapegrad.interpreters import replay_cpu
    w = _threads._Worker()
    assert _last_job_released(w, lambda job: w.post(job), lambda job, _: w.finish(job))
    r = replay_cpu._Worker()
    assert _last_job_released(r, r.post, r.finish)
