"""target="parallel": a batch's blocks on threads (``replay_cpu.run_parallel``) give the
numbers of the serial batch, of single calls and of torch for every split of the samples
(uneven blocks, fewer samples than threads, guards failing in some samples); the threads
take blocks in turn (``_threads.Pool``), and a worker's error reaches the caller."""
import contextvars
import threading
import time

import numba
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _threads
from tapegrad.interpreters import _atomic, replay_cpu

torch = pytest.importorskip("torch")


def _rosen(x):
    f = 0.0
    for i in range(x.shape[0] - 1):
        f = f + 100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
    return f


def _torch_grad(fn, x):
    xt = torch.tensor(x, requires_grad=True)
    (g,) = torch.autograd.grad(fn(xt), (xt,))
    return g.numpy()


@pytest.fixture(autouse=True)
def _any_work_spreads(monkeypatch):
    """These small programs' batches run on the threads (``PARALLEL_WORK`` 0, no pauses
    after batches the threads did not speed up), but where a test says otherwise."""
    monkeypatch.setattr(replay_cpu, "PARALLEL_WORK", 0)
    monkeypatch.setattr(replay_cpu, "ADAPT", False)
    monkeypatch.setattr(replay_cpu, "_pause", [0, 0])
    monkeypatch.setattr(replay_cpu, "_settle", [0])


@pytest.fixture(scope="module")
def progs():
    prog = tg.trace(_rosen, np.zeros(5))
    par = prog.to("parallel")
    prog.block = par.block = 16
    return prog, par


def test_spans_split_evenly_within_the_block():
    assert replay_cpu._spans(256, 2, 128) == [(0, 128), (128, 256)]
    assert replay_cpu._spans(300, 2, 128) == [(0, 75), (75, 150), (150, 225), (225, 300)]
    assert replay_cpu._spans(17, 2, 16) == [(0, 9), (9, 17)]
    assert replay_cpu._spans(33, 2, 16) == [(0, 9), (9, 18), (18, 27), (27, 33)]
    assert replay_cpu._spans(3, 3, 16) == [(0, 1), (1, 2), (2, 3)]
    for B in (1, 2, 7, 33, 129, 1000):
        for threads in (2, 3, 4):
            spans = replay_cpu._spans(B, threads, 16)
            assert spans[0][0] == 0 and spans[-1][1] == B
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert all(0 < b1 - b0 <= 16 for b0, b1 in spans)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("B", [1, 2, 17, 33, 100])
def test_every_split_gives_the_serial_numbers(progs, monkeypatch, B, threads):
    """Blocks of 16 at most over 2 or 3 threads (more threads than cores is allowed):
    B = 1 and B below the thread count, B not a multiple of the block; bit for bit the
    serial batch, and single calls and torch to rounding."""
    prog, par = progs
    monkeypatch.setattr(replay_cpu, "_num_threads", lambda: threads)
    X = np.random.default_rng(B).normal(size=(B, 5))
    seen = []
    real = replay_cpu.run_parallel

    def spy(*args):
        seen.append(args[1].shape[0])
        return real(*args)
    monkeypatch.setattr(replay_cpu, "run_parallel", spy)
    v, g = prog.value_and_grad(X)
    vp, gp = par.value_and_grad(X)
    assert seen == ([B] if B > par.block else [])  # one block runs serially
    np.testing.assert_array_equal(vp, v)
    np.testing.assert_array_equal(gp, g)
    for j in {0, B // 2, B - 1}:
        np.testing.assert_allclose(gp[j], prog.grad(X[j]), rtol=1e-14)
        np.testing.assert_allclose(gp[j], _torch_grad(_rosen, X[j]), rtol=1e-13)
    # the threaded driver itself, below the serial cut: B = 1 and B < threads too
    code = par._code
    S = np.ones((B, 1))
    st, o, G = replay_cpu.run_parallel(code.rows, X, code.out_slots, S, code.in_slots, True, 16)
    assert not st.any()
    np.testing.assert_array_equal(o[:, 0], v)
    np.testing.assert_array_equal(G, g)


def _branchy(x):
    return (x * x).sum() if x[0] > 0 else (x.sin() * x[1]).sum()


def test_guards_failing_in_some_samples_of_a_parallel_batch(monkeypatch):
    """Samples that fail the first variant's guards, spread over the blocks of every thread,
    take the other variant (retrace=True), as in single calls and torch."""
    monkeypatch.setattr(replay_cpu, "_num_threads", lambda: 3)
    par = tg.trace(_branchy, np.ones(4), retrace=True, target="parallel")
    par.block = 16
    X = np.random.default_rng(5).normal(size=(71, 4))
    X[::7, 0] = -np.abs(X[::7, 0])
    v, g = par.value_and_grad(X)
    assert len(par._variants) == 2
    for j in range(71):
        np.testing.assert_allclose(g[j], _torch_grad(_branchy, X[j]), rtol=1e-13)
        assert v[j] == par(X[j])
    strict = tg.trace(_branchy, np.ones(4), target="parallel")
    strict.block = 16
    with pytest.raises(tg.GuardError, match="for sample 0 of the batch"):
        strict.value_and_grad(X)


def test_a_workers_error_reaches_the_caller_and_the_workers_live_on(progs, monkeypatch):
    """(Blocks through Python on the workers: ``COMPILED`` off, or ``run_block`` patched
    here would not run there.)"""
    prog, par = progs
    monkeypatch.setattr(replay_cpu, "COMPILED", False)
    real = replay_cpu.run_block
    main = threading.get_ident()

    taken = threading.Event()

    def failing(*args):
        if threading.get_ident() != main:
            taken.set()
            raise FloatingPointError("in a worker")
        # the caller's block (which stores the job's claim word) then waits for a worker to
        # take another one (on a loaded machine a worker can start after the caller has
        # taken every block)
        real(*args)
        taken.wait(10.0)
    X = np.random.default_rng(1).normal(size=(64, 5))
    par.value_and_grad(X)  # compiled and the workers started before the patch
    monkeypatch.setattr(replay_cpu, "run_block", failing)
    for _ in range(3):
        taken.clear()
        with pytest.raises(FloatingPointError, match="in a worker"):
            par.value_and_grad(X)
    monkeypatch.setattr(replay_cpu, "run_block", real)
    np.testing.assert_array_equal(par.value_and_grad(X)[1], prog.value_and_grad(X)[1])


def test_concurrent_parallel_batches_run_serially_while_the_workers_are_busy(progs):
    """One batch at a time uses the workers; another thread's batch meanwhile runs
    serially on its own thread, with the same numbers."""
    prog, par = progs
    X = np.random.default_rng(2).normal(size=(200, 5))
    want = prog.value_and_grad(X)[1]
    errors = []

    def work():
        try:
            for _ in range(20):
                np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _child_batch(conn):
    prog = tg.trace(_rosen, np.zeros(5), target="parallel")
    prog.block = 16
    X = np.random.default_rng(4).normal(size=(100, 5))
    conn.send(prog.value_and_grad(X)[1])


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_workers(progs):
    """The workers' threads are not in a forked child: it starts its own (no hang on a
    lock held by a thread that does not exist there)."""
    import multiprocessing
    prog, par = progs
    X = np.random.default_rng(4).normal(size=(100, 5))
    want = par.value_and_grad(X)[1]  # the parent's workers are up
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_batch, args=(child,))
    proc.start()
    try:
        assert parent.poll(120), "the forked child's parallel batch did not finish"
        np.testing.assert_array_equal(parent.recv(), want)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("turns", [0, 1, 1 << 20])
def test_handovers_by_lock_and_by_spin_give_the_serial_numbers(progs, monkeypatch, turns):
    """Parallel batches called back to back and with pauses (the worker spinning, asleep,
    or between the two), from two user threads at once: each result is the serial
    batch's bit for bit."""
    prog, par = progs
    X = np.random.default_rng(5).normal(size=(100, 5))
    want_v, want_g = prog.value_and_grad(X)
    par.value_and_grad(X)
    monkeypatch.setattr(_threads._pool, "workers", [])  # fresh workers with these turns
    monkeypatch.setattr(_threads, "_turns", [turns])
    monkeypatch.setattr(_threads, "SPIN_US", 1)  # turns a worker spins: ``turns``
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                v, g = par.value_and_grad(X)
                np.testing.assert_array_equal(v, want_v)
                np.testing.assert_array_equal(g, want_g)
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 0.002)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_batch_of_little_work_runs_serially(progs, monkeypatch):
    """Below ``PARALLEL_WORK`` row-samples a batch of several blocks runs serially (a
    worker's start costs more than it saves), above it in parallel; the same numbers."""
    prog, par = progs
    monkeypatch.setattr(replay_cpu, "PARALLEL_WORK", 60_000)
    seen = []
    real = replay_cpu.run_parallel

    def spy(*args):
        seen.append(args[1].shape[0])
        return real(*args)
    monkeypatch.setattr(replay_cpu, "run_parallel", spy)
    rows = par._code.rows.shape[0]
    small = replay_cpu.PARALLEL_WORK // rows - 1
    for B in (small, replay_cpu.PARALLEL_WORK // rows + 1):
        X = np.random.default_rng(B).normal(size=(B, 5))
        np.testing.assert_array_equal(par.value_and_grad(X)[1], prog.value_and_grad(X)[1])
    assert small > par.block and seen == [small + 2]


def test_batches_run_serially_for_a_while_after_the_threads_did_not_pay(progs, monkeypatch):
    """A batch the threads did not make faster than the caller's own pace (a worker taken
    off its core: here its blocks sleep) makes the next 1, then 2 ... batches run serially;
    one they sped up (the caller's blocks sleep) resets the pause. The numbers never
    change. (Blocks through Python on the workers: ``run_block`` patched here would not run
    in their compiled loop.)"""
    prog, par = progs
    monkeypatch.setattr(replay_cpu, "COMPILED", False)
    monkeypatch.setattr(replay_cpu, "ADAPT", True)
    monkeypatch.setattr(replay_cpu, "LOSS", float("inf"))  # (pauses by their loss: below)
    X = np.random.default_rng(7).normal(size=(64, 5))
    want = prog.value_and_grad(X)[1]
    par.value_and_grad(X)  # compiled
    par.value_and_grad(X)  # the workers started (a batch that starts one is not judged)
    real, main, slow = replay_cpu.run_block, threading.get_ident(), []
    taken = threading.Event()

    def blocks(*args):
        caller = threading.get_ident() == main
        real(*args)  # (the caller's first block stores the job's claim word)
        if not caller:
            taken.set()
        elif args[1].shape[0] and not serial and not taken.is_set():  # a worker takes a
            taken.wait(10.0)  # block (a loaded machine's may start after the caller's)
        if caller == (slow == ["caller"]):
            time.sleep(0.02)
    monkeypatch.setattr(replay_cpu, "run_block", blocks)
    serial = []
    real_batch = replay_cpu.run_batch
    monkeypatch.setattr(replay_cpu, "run_batch",
                        lambda *a: serial.append(1) or real_batch(*a))

    def call():
        serial.clear()
        taken.clear()
        np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
        return bool(serial)
    replay_cpu._pause[:] = [0, 0]
    replay_cpu._settle[:] = [0]
    slow.append("worker")
    # threads (a miss), serial, threads twice (the first of a try is not judged: SETTLE),
    # serial x 2, threads twice, serial x 4
    ran = [call() for _ in range(12)]
    assert ran == [False, True, False, False, True, True, False, False, True, True, True,
                   True], ran
    assert replay_cpu._pause == [0, 4] and replay_cpu._settle == [1]
    slow[:] = ["caller"]
    monkeypatch.setattr(replay_cpu, "_cpu_time", time.perf_counter)  # its sleep is work
    assert not call() and replay_cpu._pause == [0, 4]  # (the first of the try: not judged)
    assert not call() and replay_cpu._pause == [0, 0]


def test_a_job_posted_for_later_is_seen_from_the_callers_block(progs, monkeypatch):
    """``post(later=True)``: a spinning worker takes the job only once the caller's
    ``run_block`` (GIL let go) stores its claim word; a sleeping one is woken, and the word
    stored, at once."""
    prog, _ = progs
    code = prog._code
    X = np.random.default_rng(8).normal(size=(4, 5))
    st, o, G = replay_cpu._outputs(X, code.out_slots, code.in_slots, True)
    W = replay_cpu._room(code.rows, 4)
    pool = _threads._pool
    monkeypatch.setattr(pool, "workers", [])
    monkeypatch.setattr(_threads, "_turns", [1 << 16])  # (a spin of milliseconds)
    K = _threads._k()
    ran = []
    assert pool.busy.acquire(False)
    try:
        pool.fn, pool.context = ran.append, contextvars.copy_context()
        word, published = pool.post(K.JOB_PY, 2, 2, taken=1, later=True)
        if not published:  # (the worker still spinning: it was not put to sleep)
            time.sleep(0.01)
            assert ran == [] and pool.ctl[K.CLAIM] != word  # not seen yet
        replay_cpu.run_block(code.rows, X, code.out_slots, np.ones((4, 1)), code.in_slots,
                             True, st, o, G, 0, 4, *W, pool.ctl, 0 if published else word)
        pool.finish(2, _take_the_rest(K, pool, ran))
        assert ran == [1]
        np.testing.assert_array_equal(G, prog.value_and_grad(X)[1])
        worker = pool.workers[0]
        monkeypatch.setattr(_threads, "_turns", [0])  # (the next spin: none)
        for _ in range(5000):  # the worker goes to sleep on its lock
            if worker.sleeping:
                break
            time.sleep(0.001)
        assert worker.sleeping
        pool.fn, pool.context = ran.append, contextvars.copy_context()
        word, published = pool.post(K.JOB_PY, 2, 2, taken=1, later=True)
        assert published and pool.ctl[K.CLAIM] in (word, word + 1)  # asleep: stored now
        pool.finish(2, _take_the_rest(K, pool, ran))
        assert ran == [1, 1]
    finally:
        pool.busy.release()


def _take_the_rest(K, pool, ran):
    """The caller's part after its first chunk, as ``run_parallel`` does it: a chunk no
    worker took after a while (one about to sleep when the job was posted sleeps through
    it) is run here; returns the chunks the caller ran."""
    own = 1
    for _ in range(100):  # (a worker takes the chunk: usually)
        if pool.ctl[K.CLAIM] & K.IDX_MASK == 2:
            break
        time.sleep(0.001)
    i, _ = K.claim(pool.ctl)
    if i >= 0:
        ran.append(i)
        own += 1
    return own


NO_JIT = """
import numpy as np, tapegrad as tg
from tapegrad.interpreters import replay_cpu as R
R.PARALLEL_WORK, R.ADAPT = 0, False
p = tg.trace(lambda x: (x.sin() * x).sum(), np.zeros(3), target="parallel")
s = tg.trace(lambda x: (x.sin() * x).sum(), np.zeros(3))
p.block = 2
X = np.random.default_rng(0).normal(size=(9, 3))
for _ in range(3):
    assert np.array_equal(p.value_and_grad(X)[1], s.value_and_grad(X)[1])
from tapegrad import _threads
print(_threads.jit_on(), len(_threads._pool.workers))
"""


def test_parallel_batches_without_the_jit():
    """``NUMBA_DISABLE_JIT=1``: batches run serially (the hand-over's spin, in Python,
    would hold the GIL the worker needs), with the serial numbers."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", TAPEGRAD_QUIET="1", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", NO_JIT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "0"]


def test_the_counts_say_what_the_batches_did(progs, monkeypatch):
    """``_threads.stats``: a batch on the threads counts its chunks (the caller's and the
    workers', all of its spans), a paused one counts as paused; the numbers are the
    serial batch's either way."""
    prog, par = progs
    X = np.random.default_rng(9).normal(size=(40, 5))
    want = prog.value_and_grad(X)[1]
    par.value_and_grad(X)  # (compiled, the workers started)
    before = _threads.stats()
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
    after = _threads.stats()
    d = {k: after[k] - before[k] for k in _threads.counts}
    spans = len(replay_cpu._spans(40, min(numba.get_num_threads(), 40), par.block))
    assert d["batches_threads"] == 1 and d["chunks_caller"] + d["chunks_workers"] == spans
    assert d["chunks_caller"] >= 1 and d["batches_paused"] == 0
    assert after["workers"] >= 1
    monkeypatch.setattr(replay_cpu, "ADAPT", True)
    monkeypatch.setattr(replay_cpu, "_pause", [1, 1])
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
    d = {k: _threads.stats()[k] - after[k] for k in _threads.counts}
    assert d["batches_paused"] == 1 and d["batches_threads"] == 0


def test_a_batch_that_lost_time_pauses_the_threads_until_its_loss_is_small(monkeypatch):
    """``_judge``: a batch that paid ends the pause; one that did not pay but lost nothing
    pauses for 1, 2, 4 ... batches; one that took longer than the serial batch would have,
    right after another miss, pauses long enough that its loss is ``LOSS`` of the time the
    pause runs (up to ``LOSS_MAX`` batches); a lone stall among batches that paid pauses
    for one batch."""
    monkeypatch.setattr(replay_cpu, "_pause", [0, 0])
    monkeypatch.setattr(replay_cpu, "_tries", [0])
    monkeypatch.setattr(replay_cpu, "WARM_TRIES", 2)
    replay_cpu._judge(1.5, 1.0)  # the first tries: misses, not losses
    replay_cpu._judge(1.5, 1.0)
    assert replay_cpu._pause == [2, 2]
    replay_cpu._pause[:] = [0, 0]
    monkeypatch.setattr(replay_cpu, "LOSS", 0.05)
    monkeypatch.setattr(replay_cpu, "LOSS_MAX", 100)
    replay_cpu._judge(1.0, 1.0)  # no faster, no slower
    assert replay_cpu._pause == [1, 1]
    replay_cpu._judge(0.5, 1.0)
    assert replay_cpu._pause == [1, 0]  # (the pause running ends; no next one)
    replay_cpu._judge(30.0, 1.0)  # a lone stall after a batch that paid: one batch
    assert replay_cpu._pause == [1, 1]
    replay_cpu._judge(0.5, 1.0)
    replay_cpu._judge(1.0, 1.0)
    replay_cpu._judge(1.5, 1.0)  # 0.5 lost after a miss: 10 batches of 1.0 at 5%
    assert replay_cpu._pause == [10, 2]
    replay_cpu._pause[1] = 1
    replay_cpu._judge(1.5, 1.0)
    assert replay_cpu._pause == [10, 2]
    replay_cpu._judge(1.5, 1.0)  # (a worker woken through its lock or not: a loss)
    assert replay_cpu._pause == [10, 4]
    replay_cpu._judge(50.0, 1.0)
    assert replay_cpu._pause == [100, 8]  # (at most LOSS_MAX)
    replay_cpu._judge(1.0, 0.0)  # (no CPU time measured: no loss computed)
    assert replay_cpu._pause == [16, 16]  # (at most PAUSE_MAX)



def test_a_batch_that_started_a_worker_is_not_judged(progs, monkeypatch):
    """The batch that starts the pool's worker threads (their start, once, is no measure
    of the batches to come) sets no pause; the next one is judged."""
    prog, par = progs
    monkeypatch.setattr(replay_cpu, "ADAPT", True)
    X = np.random.default_rng(11).normal(size=(40, 5))
    want = prog.value_and_grad(X)[1]
    par.value_and_grad(X)  # (compiled)
    monkeypatch.setattr(_threads._pool, "workers", [])  # (fresh workers: started below)
    monkeypatch.setattr(replay_cpu, "_pause", [0, 0])
    judged = []
    monkeypatch.setattr(replay_cpu, "_judge", lambda *a: judged.append(a))
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
    assert judged == [] and len(_threads._pool.workers) >= 1
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
    assert len(judged) == 1


def test_the_first_batch_after_a_pause_is_not_judged(progs, monkeypatch):
    """A pause's end (``SETTLE``): the next threaded batch, the first of the try, finds the
    worker's caches cold or the worker just woken, and is not judged; the one after it
    is. (On a loaded machine every try judged on its first batch missed: the threads
    stayed paused for good.)"""
    prog, par = progs
    monkeypatch.setattr(replay_cpu, "ADAPT", True)
    X = np.random.default_rng(21).normal(size=(40, 5))
    want = prog.value_and_grad(X)[1]
    par.value_and_grad(X)
    par.value_and_grad(X)  # (compiled, the workers started)
    monkeypatch.setattr(replay_cpu, "_ran_caller", [True])
    judged = []
    monkeypatch.setattr(replay_cpu, "_judge", lambda *a: judged.append(a))
    monkeypatch.setattr(replay_cpu, "_pause", [1, 1])
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)  # (paused: its end)
    assert replay_cpu._pause == [0, 1] and replay_cpu._settle == [1] and judged == []
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)  # (the try's first)
    assert replay_cpu._settle == [0] and judged == []
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
    assert len(judged) == 1


def test_the_first_compiled_caller_of_a_process_is_not_judged(progs, monkeypatch):
    """The first batch whose caller runs ``_atomic.run_caller`` compiles it or loads it
    (a second, cold): no measure of the batches to come, it sets no pause, even with the
    workers started before (here by an earlier batch); the next one is judged."""
    if numba.get_num_threads() < 2 or numba.config.DISABLE_JIT or not replay_cpu.CLOCK:
        pytest.skip("needs 2 threads, the JIT and the compiled caller")
    prog, par = progs
    monkeypatch.setattr(replay_cpu, "ADAPT", True)
    X = np.random.default_rng(20).normal(size=(40, 5))
    want = prog.value_and_grad(X)[1]
    par.value_and_grad(X)
    par.value_and_grad(X)  # (compiled, the workers started)
    monkeypatch.setattr(replay_cpu, "_pause", [0, 0])
    monkeypatch.setattr(replay_cpu, "_ran_caller", [False])
    judged = []
    monkeypatch.setattr(replay_cpu, "_judge", lambda *a: judged.append(a))
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
    assert judged == [] and replay_cpu._ran_caller == [True]
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
    assert len(judged) == 1


def test_the_last_batch_of_a_pause_wakes_the_worker_for_a_while(progs, monkeypatch):
    """The last paused batch wakes a sleeping worker (``Pool.rouse``) so that the next
    batch, which tries the threads, does not wait for its wake-up; the worker spins for a
    while only, then sleeps again. The numbers are the serial batch's."""
    prog, par = progs
    monkeypatch.setattr(replay_cpu, "ADAPT", True)
    X = np.random.default_rng(12).normal(size=(40, 5))
    want = prog.value_and_grad(X)[1]
    par.value_and_grad(X)  # (compiled)
    pool = _threads._pool
    monkeypatch.setattr(pool, "workers", [])
    monkeypatch.setattr(_threads, "_turns", [1])  # (spins of a few reads)
    monkeypatch.setattr(replay_cpu, "_pause", [0, 0])
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)  # (a worker started)
    worker = pool.workers[0]

    def asleep():
        for _ in range(5000):
            if worker.sleeping:
                return True
            time.sleep(0.001)
        return False
    assert asleep()
    roused = _threads.counts["roused"]
    monkeypatch.setattr(replay_cpu, "_pause", [2, 1])
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)  # paused, 1 to go
    assert worker.sleeping and _threads.counts["roused"] == roused
    np.testing.assert_array_equal(par.value_and_grad(X)[1], want)  # the last: rouses
    assert _threads.counts["roused"] == roused + 1 and replay_cpu._pause[0] == 0
    assert asleep()  # (after the rouse's time: not spinning for good)


@pytest.mark.slow
def test_fuzz_pauses_rouses_and_user_threads_keep_the_serial_numbers(progs, monkeypatch):
    """Seeded: batches of random sizes from two user threads at once, with the pauses on,
    random pause states (a pause about to end rouses the worker), random spins (the
    worker asleep or spinning when a job comes) and sleeps between calls: every result is
    the serial batch's bit for bit, and no call hangs."""
    prog, par = progs
    monkeypatch.setattr(replay_cpu, "ADAPT", True)
    monkeypatch.setattr(_threads, "SPIN_US", 1)
    rng = np.random.default_rng(2024)
    sizes = [int(b) for b in rng.integers(1, 200, 12)]
    data = {B: np.random.default_rng(B).normal(size=(B, 5)) for B in sizes}
    want = {B: prog.value_and_grad(X) for B, X in data.items()}
    errors = []

    def work(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(150):
                B = sizes[r.integers(len(sizes))]
                if r.random() < 0.2:
                    replay_cpu._pause[:] = [int(r.integers(0, 3)), int(r.integers(0, 8))]
                if r.random() < 0.2:
                    _threads._turns[0] = int(r.choice([0, 1, 1 << 12]))
                v, g = par.value_and_grad(data[B])
                np.testing.assert_array_equal(v, want[B][0])
                np.testing.assert_array_equal(g, want[B][1])
                if r.random() < 0.1:
                    time.sleep(r.random() * 0.002)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    monkeypatch.setattr(_threads, "_turns", [1])
    before = dict(_threads.counts)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and errors == []
    d = {k: _threads.counts[k] - before[k] for k in before}
    assert d["batches_threads"] > 0 and d["batches_paused"] > 0, d


_LOADED_BEFORE_START = """
import threading, numpy as np, numba, tapegrad as tg
from tapegrad import _threads
K = _threads._k()
fns = (_threads._K[1].serve, K.claim, K.chunk_done, K.wait_done, K.publish, K.take_rest)
assert not any(f.overloads for f in fns), "loaded already: the check below says nothing"
seen = []
start = threading.Thread.start
def spy(self):
    seen.append([bool(f.overloads) for f in fns])
    start(self)
threading.Thread.start = spy
numba.set_num_threads(2)
tg.set_num_threads(2)
_threads.run_chunks(lambda i: None, 4)
assert seen and all(all(s) for s in seen), seen
print("ok")
"""


@pytest.mark.skipif(numba.config.DISABLE_JIT or numba.config.NUMBA_NUM_THREADS < 2,
                    reason="needs the JIT and 2 threads")
def test_the_handover_is_loaded_before_a_worker_starts():
    """A fresh process's first job loads the workers' compiled functions (``serve`` ...) on
    the calling thread before it starts one (``_threads._load``): loaded by the worker, they
    took it seconds (llvmlite lets the GIL go in each call, and the caller held it), and the
    batches of that while found no worker."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(tg.__file__)))
    res = subprocess.run([sys.executable, "-c", _LOADED_BEFORE_START], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TAPEGRAD_QUIET="1"))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_the_counts_say_how_late_the_workers_came(progs, monkeypatch):
    """``lag_workers`` and ``lag_ns`` (``Pool.lag``): a worker that took a block adds
    itself and its lag from the post to its first claim, a positive time; a batch no worker
    took a block of adds nothing. (Blocks through Python: a worker's compiled loop has no
    clock.)"""
    if numba.get_num_threads() < 2:
        pytest.skip("needs 2 threads")
    monkeypatch.setattr(replay_cpu, "COMPILED", False)
    prog, par = progs
    X = np.random.default_rng(12).normal(size=(64, 5))
    want = prog.value_and_grad(X)[1]
    par.value_and_grad(X)  # (compiled, the workers started)
    for _ in range(200):  # (a worker comes in time in most batches on an idle machine)
        before = _threads.stats()
        np.testing.assert_array_equal(par.value_and_grad(X)[1], want)
        d = {k: _threads.stats()[k] - before[k] for k in _threads.counts}
        assert d["lag_workers"] == (d["chunks_workers"] > 0)  # (one worker on 2 threads)
        assert (d["lag_ns"] > 0) == (d["chunks_workers"] > 0)
        if d["chunks_workers"]:
            break
    else:
        pytest.skip("no worker came in 200 batches (a busy machine)")


@numba.njit(nogil=True)
def _raising_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0, b1, Vw, Aw,
                   signal, number):  # pragma: no cover (compiled)
    if b0 > 0:
        raise FloatingPointError("in a worker's block")


def test_a_compiled_block_that_raised_on_a_worker_raises_in_the_caller(progs, monkeypatch):
    """A block that raised in a worker's compiled loop (``_atomic.block_job``: its status)
    is run again by the caller, which raises its error (here none: a RuntimeError that says
    so); the caller's blocks were its own, the job ends (no hang) and the workers live on."""
    if numba.get_num_threads() < 2 or numba.config.DISABLE_JIT:
        pytest.skip("needs 2 threads and the JIT")
    prog, par = progs
    X = np.random.default_rng(13).normal(size=(64, 5))
    want = prog.value_and_grad(X)
    par.value_and_grad(X)  # (compiled, the workers started)
    _raising_block.compile(replay_cpu._BLOCK_SIG)
    cres = _raising_block.overloads[replay_cpu._BLOCK_SIG]
    address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    monkeypatch.setattr(replay_cpu, "_address", lambda form: address)
    for _ in range(200):
        before = _threads.stats()["chunks_workers"]
        try:
            got = par.value_and_grad(X)
        except RuntimeError as e:
            assert "raised on a worker thread" in str(e)  # (a worker ran a block)
            break
        assert _threads.stats()["chunks_workers"] == before  # (the caller ran every block)
        np.testing.assert_array_equal(got[1], want[1])
    else:
        pytest.skip("no worker came in 200 batches (a busy machine)")
    monkeypatch.undo()
    monkeypatch.setattr(replay_cpu, "PARALLEL_WORK", 0)
    monkeypatch.setattr(replay_cpu, "ADAPT", False)
    for _ in range(5):
        got = par.value_and_grad(X)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@numba.njit(nogil=True)
def _raising_everywhere(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0, b1, Vw,
                        Aw, signal, number):  # pragma: no cover (compiled)
    raise FloatingPointError("in any block")


def test_a_compiled_block_that_raised_on_the_caller_raises(progs, monkeypatch):
    """The caller's own blocks run compiled too (``_atomic.run_caller``): one that raised
    there (block 0 is always the caller's) is run again through Python, which raises; a
    batch never returns numbers a block did not write, and the next batch is right."""
    if numba.get_num_threads() < 2 or numba.config.DISABLE_JIT or not replay_cpu.CLOCK:
        pytest.skip("needs 2 threads, the JIT and the compiled caller")
    prog, par = progs
    X = np.random.default_rng(19).normal(size=(64, 5))
    want = prog.value_and_grad(X)
    par.value_and_grad(X)
    par.value_and_grad(X)  # (compiled, the workers started)
    _raising_everywhere.compile(replay_cpu._BLOCK_SIG)
    cres = _raising_everywhere.overloads[replay_cpu._BLOCK_SIG]
    address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    monkeypatch.setattr(replay_cpu, "_address", lambda form: address)
    for _ in range(5):
        with pytest.raises(RuntimeError, match=r"samples \d+ to \d+ .* but not when run again"):
            par.value_and_grad(X)
        assert not _threads._pool.busy.locked()
    monkeypatch.undo()
    monkeypatch.setattr(replay_cpu, "PARALLEL_WORK", 0)
    monkeypatch.setattr(replay_cpu, "ADAPT", False)
    got = par.value_and_grad(X)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_the_compiled_caller_gives_the_serial_numbers_with_and_without_the_gradient(
        progs, monkeypatch):
    """``_atomic.run_caller`` (the caller's blocks compiled, the program's part of the job
    described once, ``_desc``): forward-only batches and ``value_and_grad`` batches, of two
    sizes one after the other (another block size: the description is kept or renewed as
    it must), give the serial batch's numbers bit for bit."""
    if numba.get_num_threads() < 2 or numba.config.DISABLE_JIT or not replay_cpu.CLOCK:
        pytest.skip("needs 2 threads, the JIT and the compiled caller")
    prog, par = progs
    calls = []
    real = replay_cpu._run_caller
    monkeypatch.setattr(replay_cpu, "_run_caller", lambda *a: calls.append(1) or real(*a))
    for B in (64, 40, 64, 200):
        X = np.random.default_rng(B).normal(size=(B, 5))
        for _ in range(3):
            np.testing.assert_array_equal(par(X), prog(X))
            got, want = par.value_and_grad(X), prog.value_and_grad(X)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    assert calls


def test_the_thread_count_is_numbas(monkeypatch):
    """``_num_threads`` (Numba's C function, 0.09 us) reads what ``numba.get_num_threads``
    does, ``numba.set_num_threads`` in this thread included."""
    n = numba.get_num_threads()
    assert replay_cpu._num_threads() == n
    numba.set_num_threads(1)
    try:
        assert replay_cpu._num_threads() == 1
    finally:
        numba.set_num_threads(n)
    assert replay_cpu._num_threads() == n


@pytest.mark.parametrize("how", ["readonly", "fortran", "compiled"])
def test_blocks_through_python_or_compiled_give_the_serial_numbers(progs, monkeypatch, how):
    """Inputs of other types than the interpreter's usual ones (read-only) run their
    workers' blocks through Python (``_plain``); plain ones in compiled code
    (``_atomic.block_job``, the interpreter at its address, ``_address``): the serial
    batch's numbers, bit for bit, either way."""
    prog, par = progs
    X = np.random.default_rng(14).normal(size=(200, 5))
    if how == "readonly":
        X.flags.writeable = False
    elif how == "fortran":
        X = np.asfortranarray(X)
    want = prog.value_and_grad(np.ascontiguousarray(X))
    used = []
    real = replay_cpu._address
    monkeypatch.setattr(replay_cpu, "_address", lambda form: used.append(form) or real(form))
    for _ in range(20):
        got = par.value_and_grad(X)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    if numba.get_num_threads() >= 2 and not numba.config.DISABLE_JIT:
        assert bool(used) == (how != "readonly")  # (Fortran order: copied by the call)


def test_the_workers_loop_reads_the_jobs_layout_of_the_kernels():
    """``_atomic.serve`` (the workers' loop) and ``_kernels`` (the callers' side) read one
    layout of the job: the same numbers under the same names, and kinds apart."""
    from tapegrad.interpreters import _atomic
    from tapegrad.ops import _kernels
    for name in ("CLAIM", "DONE", "KIND", "ALLOWED", "PARAMS", "IDX_BITS", "IDX_MASK",
                 "JOB_PY"):
        assert getattr(_atomic, name) == getattr(_kernels, name), name
    assert _atomic.JOB_BLOCKS not in (_kernels.JOB_ROWS, _kernels.JOB_SUM_MIDDLE)
    assert _threads._ALLOWED == _atomic.ALLOWED and _threads._RUN_CHUNK == _atomic.RUN_CHUNK
    assert _threads._SEQ_MASK == _kernels.SEQ_MASK and _threads._IDX_BITS == _kernels.IDX_BITS
    assert _kernels.ALLOWED < _atomic.RUN_CHUNK < _kernels.PARAMS
    assert _kernels.PARAMS + _atomic.BLOCK_PARAMS <= _threads._pool.ctl.shape[0]


def test_the_workers_cpu_time_is_counted(progs, monkeypatch):
    """``stats()["worker_cpu_ns"]``: the workers' threads' CPU clocks, which move while
    they run blocks or spin (the evidence of what a batch cost on a busy machine, where
    wall times move with the load)."""
    import os
    if numba.get_num_threads() < 2 or not hasattr(time, "pthread_getcpuclockid") \
            or numba.config.DISABLE_JIT or not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs 2 threads, the JIT and per-thread CPU clocks")
    prog, par = progs
    X = np.random.default_rng(15).normal(size=(64, 5))
    par.value_and_grad(X)  # (compiled)
    monkeypatch.setattr(_threads._pool, "workers", [])  # (this test's own, started now)
    monkeypatch.setattr(_threads, "_turns", [1 << 12])  # (and spinning)
    par.value_and_grad(X)
    assert len(_threads._pool.workers) >= 1
    before = _threads.stats()["worker_cpu_ns"]
    # batches until a worker ran (on a loaded machine, CI's with other test processes on
    # its 2 cores, 50 batches passed before the worker's thread was scheduled once)
    deadline = time.monotonic() + 30.0
    while _threads.stats()["worker_cpu_ns"] <= before and time.monotonic() < deadline:
        for _ in range(50):
            par.value_and_grad(X)
        time.sleep(0.001)
    assert _threads.stats()["worker_cpu_ns"] > before


def test_a_try_that_woke_its_worker_counts_its_loss(progs, monkeypatch):
    """A try whose worker was asleep (woken through its lock) and lost time pauses the
    threads by its loss like any other (``_judge``): on a busy machine those are the tries,
    and exempted, they ran every 16 batches and lost 20% (the suite's row at a load of 8)."""
    if numba.get_num_threads() < 2 or numba.config.DISABLE_JIT:
        pytest.skip("needs 2 threads and the JIT")
    prog, par = progs
    X = np.random.default_rng(16).normal(size=(64, 5))
    par.value_and_grad(X)  # (compiled)
    par.value_and_grad(X)  # (the workers started)
    monkeypatch.setattr(replay_cpu, "ADAPT", True)
    monkeypatch.setattr(_threads._pool, "roused", 0.0)
    ticks = iter(range(1 << 30))  # (the caller's CPU clock: 1 ns a read, a tiny serial time)
    monkeypatch.setattr(replay_cpu, "_cpu_time", lambda: next(ticks) * 1e-9)
    real = replay_cpu._run_caller

    def tiny(*args):  # (the compiled caller's clock: 1 ns for its blocks)
        own = real(*args)
        args[-1][_atomic.T_CPU] = 1
        return own
    monkeypatch.setattr(replay_cpu, "_run_caller", tiny)
    monkeypatch.setattr(replay_cpu, "LOSS_MAX", 77)
    for _ in range(100):
        time.sleep(0.02)  # (the worker's spin ends: it sleeps on its lock)
        if _threads.stats()["workers_asleep"] == len(_threads._pool.workers) > 0:
            break
    monkeypatch.setattr(replay_cpu, "_tries", [100])
    monkeypatch.setattr(replay_cpu, "_pause", [0, 1])  # (a miss before: "again")
    before = _threads.stats()
    np.testing.assert_array_equal(par.value_and_grad(X)[1], prog.value_and_grad(X)[1])
    assert _threads.stats()["woken"] > before["woken"], (before, _threads.stats())
    assert replay_cpu._pause == [77, 2], (_threads.stats(), replay_cpu._tries)


@pytest.mark.parametrize("where", ["python", "before", "after"])
def test_a_keyboard_interrupt_in_the_callers_block_ends_the_batch(progs, monkeypatch, where):
    """A KeyboardInterrupt raised in the caller's block (a signal between two blocks; with
    the caller's blocks compiled, ``_atomic.run_caller``, a signal before that call, where
    the job is not described yet, or after it) reaches the caller once the workers' blocks
    (compiled, without the GIL) have ended: no hang, no worker runs a block of a job not
    described, the workers free for the next batch, which gives the serial numbers."""
    prog, par = progs
    X = np.random.default_rng(17).normal(size=(96, 5))
    want = prog.value_and_grad(X)
    par.value_and_grad(X)
    par.value_and_grad(X)  # (compiled, the workers started)
    main = threading.get_ident()
    if where == "python":  # (the caller's blocks through Python)
        monkeypatch.setattr(replay_cpu, "CLOCK", 0)
        name = "run_block"
    else:
        name = "_run_caller"
    real = getattr(replay_cpu, name)

    def interrupted(*args):
        if where != "before":
            real(*args)
        if threading.get_ident() == main:
            raise KeyboardInterrupt
    monkeypatch.setattr(replay_cpu, name, interrupted)
    for _ in range(3):
        before = _threads.stats()["chunks_workers"]
        with pytest.raises(KeyboardInterrupt):
            par.value_and_grad(X)
        assert not _threads._pool.busy.locked()
        if where == "before":
            assert _threads.stats()["chunks_workers"] == before
    monkeypatch.setattr(replay_cpu, name, real)
    got = par.value_and_grad(X)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_two_workers_of_one_index_each_run_blocks_in_their_own_room(progs, monkeypatch):
    """Each worker thread has its own room (``_Worker.room``, grown as ``serve`` asks): a
    second worker of the same index (the pool's list replaced, as tests do, while the first
    still spins on the job) never shares one; every batch gives the serial numbers."""
    prog, par = progs
    X = np.random.default_rng(18).normal(size=(256, 5))
    want = prog.value_and_grad(X)
    par.value_and_grad(X)
    par.value_and_grad(X)  # (compiled, a worker started)
    monkeypatch.setattr(_threads, "_turns", [1 << 12])  # (long spins: both come)
    old = list(_threads._pool.workers)
    monkeypatch.setattr(_threads._pool, "workers", [])
    for _ in range(100):
        got = par.value_and_grad(X)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    # the rooms that workers grew are theirs alone (which worker took chunks is the
    # scheduler's: a new worker may never have run one while the first took them all)
    rooms = [w.room for w in old + _threads._pool.workers if w.room.shape[0] > 0]
    assert rooms or _threads.stats()["chunks_workers"] == 0
    assert not any(np.shares_memory(a, b) for i, a in enumerate(rooms) for b in rooms[i + 1:])
