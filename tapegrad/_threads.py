"""Intra-op threads: ``set_num_threads``/``get_num_threads`` and ``run_chunks``, which runs
the chunks of one large pass on persistent worker threads beside the calling thread."""
from __future__ import annotations

import contextvars
import functools
import os
import threading
import time

# one thread unless the user asks for more: on the 2-core machines measured, splitting a
# pass never paid (idle: gmm's gradient 1.49 ms on one thread, 1.55 on two; the batched
# 64-row Jacobian 206 us, 232 on two), because the caller waits for Python's lock around
# each compiled call while a worker holds it (docs/gradbench.md)
_num = [1]


def set_num_threads(n):
    """Set the number of threads tapegrad runs a large array pass on (as
    ``torch.set_num_threads``). 1 runs every pass on the calling thread.

    Passes over 131,072 numbers or more (gmm's ``(k, d, n)`` broadcasts, products and their
    gradients) are split into contiguous chunks, each computed as on one thread: the
    result is the same, bit for bit, whatever the number of threads.

    Parameters
    ----------
    n : int
        A positive number of threads; the default is 1 (unlike torch's, which is the
        number of cores: on the 2-core machines measured the threads did not pay, see
        docs/gradbench.md).

    Examples
    --------
    >>> import tapegrad
    >>> tapegrad.set_num_threads(1)
    >>> tapegrad.get_num_threads()
    1
    """
    if n.__class__ is bool or not hasattr(n, "__index__"):
        raise RuntimeError(f"set_num_threads expects an int, but got {type(n).__name__}")
    n = n.__index__()
    if n <= 0:
        raise RuntimeError("set_num_threads expects a positive integer")
    _num[0] = n


def get_num_threads():
    """The number of threads tapegrad runs a large array pass on (``set_num_threads``).

    Examples
    --------
    >>> import tapegrad
    >>> tapegrad.get_num_threads() >= 1
    True
    """
    return _num[0]


class _Worker:
    """A persistent thread that runs one job at a time, handed over with locks (a released
    lock wakes a thread in about 10 us on 2 cores, a ThreadPoolExecutor's future in 28). A
    job not taken yet can be withdrawn (``finish``): on a busy machine the caller runs the
    chunk itself rather than wait for a thread to be scheduled."""

    def __init__(self):
        self.go = threading.Lock()  # released: a job (or a withdrawn one) is waiting
        self.go.acquire()
        self.done = threading.Lock()  # released: the job taken has finished
        self.done.acquire()
        self.mutex = threading.Lock()
        self.job, self.pending, self.error = None, False, None
        # a hand-over cut short (an exception, KeyboardInterrupt, inside post or finish):
        # the locks may be out of step with the jobs, so the worker is never used again
        self.broken = False
        threading.Thread(target=self._loop, name="tapegrad-intraop", daemon=True).start()

    def _loop(self):
        while True:
            self.go.acquire()
            with self.mutex:
                self.pending = False
                job, self.job = self.job, None
            if job is None:  # withdrawn before this thread woke up
                continue
            try:
                job()
            except BaseException as e:  # noqa: BLE001  raised in the caller by finish
                self.error = e
            job = None  # (the pass's arrays are not kept alive until the next job)
            self.done.release()

    def post(self, job):
        self.broken = True  # (until the hand-over is complete)
        with self.mutex:
            self.job = job
            wake, self.pending = not self.pending, True
        if wake:  # else the thread has a wake-up coming and takes this job with it
            self.go.release()
        self.broken = False

    def finish(self, job):
        """True if ``job`` was withdrawn before the thread took it, else wait for it to end
        (raising what it raised) and False."""
        self.broken = True  # (until the job is withdrawn or its end is seen)
        with self.mutex:
            if self.job is job:
                self.job = None
                self.broken = False
                return True
        self.done.acquire()
        self.broken = False
        if self.error is not None:
            e, self.error = self.error, None
            raise e
        return False


class Pool:
    """Persistent workers of one kind and the lock held by the one call that uses them
    (another call meanwhile runs on its own thread): ``run_chunks``' and
    ``target="parallel"``'s (``replay_cpu``). A forked child starts with none: the parent's
    threads are not in it."""

    def __init__(self):
        self.workers, self.busy = [], threading.Lock()
        _pools.append(self)


_pools: list = []


def _reset_after_fork():
    for pool in _pools:
        pool.workers.clear()
        pool.busy = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)

_pool = Pool()


#: passes run on the calling thread alone after a worker was late (``run_chunks``): not
#: started while the caller ran its own chunk for ``LATE`` seconds or more (a shorter
#: chunk can end before an idle core has woken a thread), or ended ``STALL`` seconds or
#: more after the caller's (taken off its core midway), or the pass saved less than half
#: the time of its chunks one after the other (``PAY_SLACK`` aside); doubled after each
#: late pass that ends a back-off, up to ``BACKOFF_MAX``
BACKOFF = 16
BACKOFF_MAX = 1024
LATE = 30e-6
STALL = 200e-6
PAY_SLACK = 10e-6
_backoff = [0, BACKOFF]  # passes left on the calling thread alone, the next back-off
def chunks_for(size, min_chunk):
    """How many chunks a pass over ``size`` numbers is split into: one per thread, each of
    ``min_chunk`` numbers or more (a smaller chunk costs more to hand over than it saves)."""
    n = _num[0]
    return 1 if n == 1 else max(1, min(n, size // min_chunk))


def run_chunks(fn, m):
    """``fn(i)`` for each ``i`` in ``range(m)``: chunks 1 to m-1 handed to persistent worker
    threads while the calling thread runs chunk 0, then any chunk no worker has started
    yet is run by the caller too. Each ``fn(i)`` must write its own part of the result
    (a NumPy pass with ``out=`` or a compiled ``nogil`` kernel, which let the other threads
    run), in a copy of the caller's context (NumPy's error state). Another pass already on
    the workers (a second user thread, or a pass inside a
    chunk) runs its chunks one after the other on its own thread: the same results.

    A worker that has not started its chunk by the time the caller ends its own (``LATE``
    seconds or more), or that ends it long after (``STALL``), waits for a core other
    processes hold: the next ``BACKOFF`` passes run on the calling thread alone (waking a
    thread that then shares the caller's core costs more than it saves, and a worker taken
    off its core midway makes the caller wait a scheduler's time slice), and the one after
    tries the workers again; each late pass after a back-off doubles the next one, up to
    ``BACKOFF_MAX``, and a pass on time resets it. So does a pass that saved less than
    half the time of its chunks one after the other (the workers sharing the caller's
    core, or waits for Python's lock, held by a worker taken off its core)."""
    if m <= 1 or _backoff[0] > 0 or not _pool.busy.acquire(False):
        if _backoff[0] > 0:
            _backoff[0] -= 1
        for i in range(m):
            fn(i)
        return
    try:
        workers = _pool.workers
        while len(workers) < m - 1:
            workers.append(_Worker())
        # each chunk runs in a copy of the caller's context: NumPy's error state (quiet,
        # as tapegrad's passes are, or raising) is a context variable
        jobs = [functools.partial(contextvars.copy_context().run, fn, i) for i in range(1, m)]
        for w, job in zip(workers, jobs):
            w.post(job)
        error = None
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            fn(0)
        except BaseException as e:  # noqa: BLE001  the workers' jobs are collected first
            error = e
        own, own_cpu = time.perf_counter() - t0, time.thread_time() - c0
        late, waited = False, 0.0
        for i, (w, job) in enumerate(zip(workers, jobs), 1):
            try:
                t1 = time.perf_counter()
                if w.finish(job):  # withdrawn: no core for the worker just now
                    late = late or own > LATE
                    if error is None:
                        fn(i)
                else:
                    waited += time.perf_counter() - t1
            except BaseException as e:  # noqa: BLE001
                if error is None:
                    error = e
        # a pass that saved less than half of what the threads could (the chunks one after
        # the other: m times the caller's CPU time): the workers share the caller's core,
        # or it waited for Python's lock, held by a worker taken off its core
        if late or waited > STALL or \
                time.perf_counter() - t0 > (m + 1) / 2 * own_cpu + PAY_SLACK:
            _backoff[0] = _backoff[1]
            _backoff[1] = min(2 * _backoff[1], BACKOFF_MAX)
        else:
            _backoff[1] = BACKOFF
        if error is not None:
            raise error
    finally:
        workers = _pool.workers
        if any(w.broken for w in workers):
            workers[:] = [w for w in workers if not w.broken]
        _pool.busy.release()
