"""Intra-op threads: ``set_num_threads``/``get_num_threads`` and ``run_chunks``, which runs
the chunks of one large pass on persistent worker threads beside the calling thread."""
from __future__ import annotations

import contextvars
import os
import threading
import time

import numba
import numpy as np

# one thread unless the user asks for more: with workers that take Python's lock around
# each chunk, splitting a pass never paid on the 2-core machines measured (idle: gmm's
# gradient 1.49 ms on one thread, 1.55 on two); with workers that wait and run compiled
# chunks without it, gmm's 250,000-number pass took 49 us on one thread and 28 on two with
# a free core, but the whole evaluations were not measured on an idle machine yet (at a
# load of 4 to 5 on 2 cores no core is free and two threads lose; docs/gradbench.md)
#: the default thread count, the one place to change it (``set_num_threads`` sets it for
#: a process; ``bench/threads_eager.py`` says whether 2 pays on a machine)
DEFAULT_THREADS = 1
_num = [DEFAULT_THREADS]


def set_num_threads(n):
    """Set the number of threads tapegrad runs a large array pass on (as
    ``torch.set_num_threads``). 1 runs every pass on the calling thread.

    Large passes are split into contiguous chunks, each computed as on one thread: the
    result is the same, bit for bit, whatever the number of threads. The compiled
    broadcast passes and sums over a middle axis (gmm's ``(k, d, n)`` work) over 131,072
    numbers or more (below, kmeans' 80,000, two threads lost) are split into up to 4
    chunks a thread, which worker threads run without Python's lock; NumPy's passes
    (products, sums over the last axis, large additions) over 131,072 numbers or more
    into one chunk a thread. The calling thread takes chunks too, and takes them all when
    the workers are late (a busy machine); after a pass the workers did not speed up,
    passes run on the calling thread alone for a while.

    Parameters
    ----------
    n : int
        A positive number of threads; the default is 1 (unlike torch's, which is the
        number of cores: on the 2-core machines measured the threads have not been shown
        to pay for a whole evaluation, see docs/gradbench.md).

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
    """A persistent thread that takes chunks of the pool's jobs: in compiled code, without
    Python's lock (``_atomic.serve``: it spins ``SPIN_US`` for a chunk after its last
    one), running a compiled job's chunks there and coming back to Python only for a
    Python job's chunk (with the GIL, which the caller, inside its own chunk's compiled or
    NumPy call, does not hold) or to sleep on a lock when no job came."""

    def __init__(self, pool, index):
        self.pool, self.index = pool, index
        self.go = threading.Lock()  # released: wake up, a job was posted
        self.go.acquire()
        self.sleeping = False  # (under pool.mutex) blocked on ``go``
        # what this thread did (only it writes these: ``stats``): chunks of Python jobs it
        # ran, spins that ended with no chunk (back to Python, which needs the GIL), sleeps
        self.chunks = self.spins_ended = self.sleeps = 0
        # (reset by the caller's ``post``) chunks of the job now posted, and when this thread
        # claimed the first (``time.perf_counter_ns``): ``Pool.lag``
        self.chunks_job, self.claimed_ns = 0, 0
        self.clock = None  # (set by the thread) its CPU clock, read by ``stats``
        # its room for a parallel batch's blocks (values and adjoints), its own (a second
        # worker of the same index, in a test, cannot share it), grown as ``serve`` asks
        self.room = np.empty(0)
        threading.Thread(target=self._loop, name="tapegrad-worker", daemon=True).start()

    def _loop(self):
        if hasattr(time, "pthread_getcpuclockid"):
            self.clock = time.pthread_getcpuclockid(threading.get_ident())
        K, A = _k(), _K[1]
        pool, index = self.pool, self.index
        ctl = pool.ctl
        turns = spin_turns()
        while True:
            # roused (``ROUSE_S`` after an intra-op pass, ``rouse``): spin that long in
            # compiled code, not ``SPIN_US`` and back here for the GIL, which the caller
            # holds between its passes (a worker waiting for it came after the caller had
            # taken every chunk: on a busy machine, always)
            # (at most ROUSE_S a call: a worker a test took out of the pool's list leaves
            # its spin soon)
            r = min(pool.roused - _clock(), ROUSE_S)
            i = A.serve(ctl, index, turns if r < 1e-6 * SPIN_US else
                        int(turns * r / (1e-6 * SPIN_US)), self.room)
            if i == -2:  # a batch's block needs more room than this thread has
                self.room = np.empty(2 * int(ctl[A.PARAMS + A.B_ROOM_HALF]))
                continue
            if i >= 0:  # a Python job's chunk, in a copy of the caller's context
                if not self.chunks_job:  # (its first chunk of this job: the wake-up lag)
                    self.claimed_ns = time.perf_counter_ns()
                self.chunks += 1
                self.chunks_job += 1
                try:
                    pool.context.copy().run(pool.fn, i)
                except BaseException as e:  # noqa: BLE001  raised in the caller
                    pool.errors.append(e)
                K.chunk_done(ctl)
                continue
            self.spins_ended += 1
            with pool.mutex:  # no job within the spin: sleep until one is posted
                # (or spin again: a job whose claim word the caller stores later, from
                # inside its first block, would never wake a thread asleep by then)
                if pool.claimable(index) or pool.coming or _clock() < pool.roused:
                    continue
                self.sleeping = True
            self.sleeps += 1
            self.go.acquire()


class Pool:
    """The persistent workers, the job they share (``ctl``, laid out as ``_kernels.CLAIM``
    and the names after it say) and the lock held by the one call that posts jobs to them
    (another call meanwhile runs on its own thread): intra-op passes (``run_chunks``,
    ``run_compiled``) and ``target="parallel"``'s batches (``replay_cpu``). A forked child
    starts with none: the parent's threads are not in it."""

    def __init__(self):
        self.workers, self.busy, self.mutex = [], threading.Lock(), threading.Lock()
        self.ctl = np.zeros(64, dtype=np.int64)
        self.seq = 0
        self.fn, self.context, self.errors = None, None, []
        self.coming = False  # (under mutex) a job posted ``later``, not finished yet
        self.roused = 0.0  # (under mutex) workers spin until then (``rouse``)
        self.posted_ns = 0  # when the job now posted was (``time.perf_counter_ns``)
        _pools.append(self)

    def lag(self):
        """(After ``finish``) the workers that took a chunk of the job, and the sum of their
        lags in ns, from the job's ``post`` to the claim of their first chunk: how late a
        worker came (asleep, off its core, waiting for the GIL)."""
        ran = [w.claimed_ns - self.posted_ns for w in self.workers if w.chunks_job]
        return len(ran), sum(ran)

    def claimable(self, index):
        """(Under ``mutex``) whether worker ``index`` may take a chunk of the job now."""
        w = int(self.ctl[0])
        return (w & _IDX_MASK) < ((w >> _IDX_BITS) & _IDX_MASK) and index < self.ctl[_ALLOWED]

    def post(self, kind, chunks, threads, taken=0, later=False, always_later=False):
        """Describe a job of ``chunks`` chunks (its parameters already in ``ctl``) for
        ``threads - 1`` workers, started as needed, and wake those asleep; returns its
        claim word (the caller's ``taken`` chunks, the first ones, counted as claimed) and
        whether it is stored. With ``later`` the caller stores it (``run_block``'s signal,
        once it let the GIL go, so a spinning worker does not wait for the GIL) unless a
        worker sleeps: then now. With ``always_later`` the caller stores it in any case
        (``_atomic.run_caller``, which writes the job's parameters first, in the same
        compiled call)."""
        K = _k()
        workers = self.workers
        if len(workers) < threads - 1:
            _load()
        while len(workers) < threads - 1:
            workers.append(_Worker(self, len(workers)))
        for w in workers:
            w.chunks_job = 0
        self.posted_ns = time.perf_counter_ns()
        ctl = self.ctl
        self.seq = seq = (self.seq + 1) & K.SEQ_MASK
        word = (seq << (2 * K.IDX_BITS)) | (chunks << K.IDX_BITS) | taken
        ctl[K.DONE] = 0
        ctl[K.KIND] = kind
        ctl[K.ALLOWED] = threads - 1
        with self.mutex:
            sleepers = [w for w in workers[:threads - 1] if w.sleeping] \
                if later and not always_later else None
            if not (later or always_later) or sleepers:
                K.publish(ctl, word)
            else:  # stored by the caller soon: a worker leaving its spin now spins again
                self.coming = True
            for w in workers[:threads - 1]:
                if w.sleeping:
                    w.sleeping = False
                    counts["woken"] += 1
                    w.go.release()
        return word, not (later or always_later) or bool(sleepers)

    def next_word(self, chunks, taken):
        """The claim word of the next job of ``chunks`` chunks, the caller's ``taken`` first
        ones counted as claimed, for a caller that posts the job itself (compiled:
        ``_atomic.run_caller``, where every worker it needs is started and awake)."""
        self.seq = seq = (self.seq + 1) & _SEQ_MASK
        return (seq << (2 * _IDX_BITS)) | (chunks << _IDX_BITS) | taken

    def rouse(self, threads, seconds):
        """Wake the workers of a job about to come (``threads - 1`` of them), and keep them
        spinning for ``seconds`` even without one: a job posted to a worker asleep waits for
        its wake-up (tens of microseconds, more on a busy machine), and the first batch after
        a pause always found its worker asleep."""
        with self.mutex:
            self.roused = _clock() + seconds
            for w in self.workers[:threads - 1]:
                if w.sleeping:
                    w.sleeping = False
                    counts["roused"] += 1
                    w.go.release()

    def finish(self, chunks, own):
        """Wait for the workers' chunks of the job (all ``chunks`` but the caller's
        ``own``), without the GIL, then raise what a chunk raised. Never cut short (a
        KeyboardInterrupt meanwhile is raised after): a worker may still read the job's
        arrays."""
        K = _k()
        ctl, interrupted, turns = self.ctl, None, spin_turns()
        while True:
            try:
                while not K.wait_done(ctl, chunks - own, turns):
                    os.sched_yield()  # (a worker taken off its core gets it back)
                break
            except BaseException as e:  # noqa: BLE001  a signal handler's, raised below
                interrupted = interrupted or e
        self.fn = self.context = None
        if self.coming:
            with self.mutex:
                self.coming = False
        errors, self.errors = self.errors, []
        if interrupted is not None:
            raise interrupted
        if errors:
            raise errors[0]


_pools: list = []

#: what the hand-over did, counted (a count does not move with the machine's load as a time
#: does): ``target="parallel"``'s batches on the threads, run serially in a pause, or
#: serially as another call had the workers; its chunks run by the calling thread and by the
#: workers; threaded batches no worker took a chunk of; pauses started; jobs posted to a
#: worker asleep on its lock (woken through it); intra-op passes run on the calling thread in
#: a back-off; workers woken ahead of a job (``Pool.rouse``); and over the threaded batches,
#: the workers that took a block and their summed lags in ns (``Pool.lag``: the mean
#: wake-up); and the ns the caller waited at the end of its blocks for the workers' (the
#: threads' imbalance: ``_atomic.run_caller``'s ``T_WAIT``, over its first spin). ``stats``
#: adds the workers' own counts and the pool's state. ``passes_split``: compiled intra-op
#: passes handed to the workers (``run_compiled``), ``passes_shared``: those a worker took a
#: chunk of.
counts = dict.fromkeys(("batches_threads", "batches_paused", "batches_busy", "chunks_caller",
                        "chunks_workers", "batches_missed", "pauses", "woken", "roused",
                        "passes_alone", "lag_workers", "lag_ns", "wait_ns", "passes_split",
                        "passes_shared"), 0)


def _load():
    """The hand-over's compiled functions compiled, or loaded from the cache, on the calling
    thread, before it starts a worker: loaded by the worker itself, they took it seconds
    while the caller ran (each of llvmlite's calls lets the GIL go, and the worker waited for
    it to come back), and the parallel batches of that while found no worker (the suite's
    parallel row: 15 tries, no worker chunk, then paused)."""
    K = _k()
    spin_turns()
    ctl = np.zeros(64, dtype=np.int64)  # (a job of no chunks: each call looks once)
    _K[1].serve(ctl, 0, 0, np.empty(0))
    K.claim(ctl)
    K.take_rest(ctl)
    K.publish(ctl, 0)
    ctl[K.DONE] = -1  # (chunk_done adds 1 back: 0)
    K.chunk_done(ctl)


def _cpu_ns(worker):
    """The CPU time ``worker``'s thread has run, in ns (0 where it cannot be read)."""
    try:
        return time.clock_gettime_ns(worker.clock) if worker.clock is not None else 0
    except OSError:
        return 0


def stats():
    """``counts`` and the workers' counts (``worker_chunks``: Python chunks they ran,
    ``worker_spins_ended``, ``worker_sleeps``) and CPU time (``worker_cpu_ns``: their blocks
    and their spins, read from their threads' clocks), summed, with the pool's state: its number of
    workers, how many are asleep, the back-off of intra-op passes and the pause of
    ``target="parallel"`` (``replay_cpu._pause``). For the probes and the benchmark suite:
    the difference of two calls says what happened between them."""
    out = dict(counts)
    workers = list(_pool.workers)
    out["worker_chunks"] = sum(w.chunks for w in workers)
    out["worker_spins_ended"] = sum(w.spins_ended for w in workers)
    out["worker_sleeps"] = sum(w.sleeps for w in workers)
    out["workers"] = len(workers)
    out["workers_asleep"] = sum(w.sleeping for w in workers)
    out["worker_cpu_ns"] = sum(_cpu_ns(w) for w in workers)
    out["backoff"] = list(_backoff)
    from .interpreters import replay_cpu
    out["pause"] = list(replay_cpu._pause)
    return out


_IDX_BITS = 20
_IDX_MASK = (1 << _IDX_BITS) - 1
_SEQ_MASK = (1 << 22) - 1  # (_kernels.SEQ_MASK)
_ALLOWED = 17  # (_kernels.ALLOWED: this module cannot import it)
_RUN_CHUNK = 18  # (_atomic.RUN_CHUNK)


def _reset_after_fork():
    for pool in _pools:
        pool.workers.clear()
        pool.busy, pool.mutex = threading.Lock(), threading.Lock()
        pool.ctl[:] = 0
        pool.fn, pool.context, pool.errors = None, None, []
        pool.coming, pool.roused = False, 0.0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)

_pool = Pool()

#: how long a worker spins for its next chunk, and the caller for the workers' last ones,
#: before it sleeps (the worker, on a lock) or yields its core (the caller): the passes of
#: one evaluation, and an optimization loop's next batch, come within it (20 to 30 us of
#: Python between two calls), and a thread that spins longer on a busy machine takes the
#: core from the one it waits for
SPIN_US = 50
_turns = [None]  # reads of ``wait_done`` a microsecond (measured once)


def spin_turns():
    """The turns of a spin of ``SPIN_US`` (0 without the JIT: a Python spin holds the GIL)."""
    if _turns[0] is None:
        K = _k()
        if not hasattr(K.wait_done, "py_func"):
            _turns[0] = 0
        else:
            ctl, best = np.zeros(64, dtype=np.int64), 1.0
            ctl[K.DONE] = -1
            K.wait_done(ctl, 0, 1)  # (compiled here, not on a worker)
            for _ in range(5):  # the fastest of 5: a run the thread was not taken off
                t0 = time.perf_counter()
                K.wait_done(ctl, 0, 1 << 16)
                best = min(best, time.perf_counter() - t0)
            _turns[0] = max(1, int((1 << 16) / (best * 1e6 + 1e-9)))
    return _turns[0] * SPIN_US


_K = []  # the module ops._kernels, once imported (it imports this one)


def _k():
    """``ops._kernels``, where the hand-over's compiled side lives (imported on first use:
    it imports this module; an import statement in each call cost 0.5 us)."""
    if not _K:
        from .interpreters import _atomic
        from .ops import _kernels
        _K.extend((_kernels, _atomic))
        _JIT.append(hasattr(_atomic.serve, "py_func"))
    return _K[0]


_chunk_at = []  # the address of ``_kernels._run_chunk``, once compiled (``_run_chunk_at``)


def _run_chunk_at():
    """The address of ``_kernels._run_chunk``'s compiled code, which a worker's ``serve``
    calls for a compiled intra-op job's chunk (``_atomic.RUN_CHUNK``)."""
    if not _chunk_at:
        K = _k()
        sig = (numba.int64[::1], numba.int64, numba.int64)
        K._run_chunk.compile(sig)
        cres = K._run_chunk.overloads[sig]
        _chunk_at.append(cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name))
    return _chunk_at[0]


_JIT = []  # whether the hand-over is compiled (``NUMBA_DISABLE_JIT=1``: jobs run serially)


def jit_on():
    """Whether the hand-over is compiled (``NUMBA_DISABLE_JIT=1``: jobs run on the caller,
    as a Python spin would hold the GIL the worker needs)."""
    if not _JIT:
        _k()
    return _JIT[0]


#: a pass on the workers must take less than ``PAYOFF`` times the caller's own pace (its
#: chunks' CPU time a chunk, times the chunks); one that did not (on a machine whose other
#: core is busy, a worker taken off its core mid-chunk kept the caller waiting: gmm's
#: 250,000-number passes 2.4x slower at a load of 5 on 2 cores) makes the next 1, 2, 4 ...
#: up to ``BACKOFF_MAX`` passes run on the calling thread alone, and one that met it ends
#: the back-off
PAYOFF = 0.95
BACKOFF_MAX = 64
_backoff = [0, 0]  # [passes still to run on the calling thread alone, the next back-off]
_clock, _cpu_time = time.perf_counter, time.thread_time


def _judge(t0, cpu, own, m):
    """The back-off after a pass that took ``_clock() - t0`` where the caller ran ``own`` of
    its ``m`` chunks in ``cpu`` seconds of CPU time."""
    if own and _clock() - t0 > PAYOFF * cpu / own * m:
        _backoff[1] = min(BACKOFF_MAX, max(1, 2 * _backoff[1]))
        _backoff[0] = _backoff[1]
    else:
        _backoff[1] = 0


def _alone():
    """Whether this pass runs on the calling thread alone (a back-off)."""
    if _backoff[0] > 0:
        _backoff[0] -= 1
        counts["passes_alone"] += 1
        return True
    return False


def chunks_for(size, min_chunk, per_thread=1):
    """How many chunks a pass over ``size`` numbers is split into: ``per_thread`` per thread
    (the threads take them in turn: one late to start leaves its share to the others), each
    of ``min_chunk`` numbers or more (a smaller chunk costs more to hand over than it
    saves)."""
    n = _num[0]
    return 1 if n == 1 else max(1, min(n * per_thread, size // min_chunk))


def run_chunks(fn, m):
    """``fn(i)`` for each ``i`` in ``range(m)``: the calling thread and the workers take
    chunks in turn until none is left (the caller runs them all where no worker comes in
    time), then the caller waits for the workers' chunks in progress. Each ``fn(i)`` must
    write its own part of the result (a NumPy pass with ``out=`` or a compiled ``nogil``
    kernel, which let the other threads run); a worker runs it in a copy of the caller's
    context (NumPy's error state). Another pass already on the workers (a second user
    thread, or a pass inside a chunk) runs its chunks one after the other on its own
    thread: the same results. What a chunk raised is raised here once every chunk taken
    has ended (the chunks not taken yet are not run). A pass the workers did not speed up
    (``PAYOFF``) makes the next ones run on the calling thread alone for a while."""
    if m <= 1 or not jit_on() or _alone() or not _pool.busy.acquire(False):
        for i in range(m):
            fn(i)
        return
    K = _k()
    pool = _pool
    try:
        t0, cpu = _clock(), _cpu_time()
        pool.fn, pool.context, pool.errors = fn, contextvars.copy_context(), []
        pool.post(K.JOB_PY, m, min(_num[0], m))
        own, error = 0, None
        while True:
            i, _ = K.claim(pool.ctl)
            if i < 0:
                break
            own += 1
            try:
                fn(i)
            except BaseException as e:  # noqa: BLE001  raised once the workers' chunks end
                error = e
                own += K.take_rest(pool.ctl)
                break
        cpu = _cpu_time() - cpu
        try:
            pool.finish(m, own)
        except BaseException as e:  # noqa: BLE001
            error = error or e
        if error is not None:
            raise error
        _judge(t0, cpu, own, m)
    finally:
        pool.busy.release()


#: how long the workers keep spinning after a pass split over them (``Pool.rouse``'s
#: ``roused``): the next passes of an evaluation come after 20 to 200 us of Python, the next
#: evaluation of a loop after a millisecond or two; a worker asleep by then starts a pass
#: tens of us late (its wake-up), after the caller took its chunks
ROUSE_S = 0.002
#: ``_kernels.share``'s measurements (``_kernels.T_*``): one array, under the pool's ``busy``
#: lock only (its turns and clock set on first use)
_times = np.zeros(8, dtype=np.int64)
#: the last pass split over the workers: its chunks and the caller's share of them (for the
#: probes: ``bench/threads_concurrent.py``)
last_pass = [0, 0]


def run_compiled(m, caller, *args):
    """A compiled job (``_kernels.rows_caller``, ``sum_caller``) of ``m`` chunks:
    ``caller(ctl, *args, word, allowed, times)`` describes it (the addresses and shapes of
    ``args``, C-contiguous arrays this call keeps alive), stores its claim word and runs
    the calling thread's chunks, all in one compiled call, while the workers take the
    others without Python's lock; after it, the workers spin ``ROUSE_S`` for the next
    pass. Returns False (nothing run) where the pass runs on the calling thread in one
    piece: without the JIT (``NUMBA_DISABLE_JIT``), in a back-off (``run_chunks``), or
    with another call already on the workers."""
    if not jit_on() or _alone():
        return False
    pool = _pool
    if not pool.busy.acquire(False):
        return False
    K = _k()
    try:
        t0 = _clock()
        times = _times
        if not times[K.T_TURNS]:
            from .interpreters import replay_cpu
            times[K.T_CLOCK], times[K.T_RUN] = replay_cpu.CLOCK, _run_chunk_at()
            times[K.T_TURNS] = spin_turns()
        n = min(_num[0], m)
        workers = pool.workers
        ctl = pool.ctl
        if len(workers) < n - 1 or True in [w.sleeping for w in workers[:n - 1]]:
            # (a worker to start or wake: the job's word is stored by ``caller``)
            word, _ = pool.post(K.JOB_ROWS, m, n, always_later=True)
            posted = True
        else:  # (the workers spin: nothing to start or wake, ``caller`` posts the job)
            word, posted = pool.next_word(m, 0), False
        cpu = -1 if times[K.T_CLOCK] else _cpu_time()
        times[K.T_OWN] = -1
        try:
            own = caller(ctl, *args, word, n - 1, times)
        except BaseException:  # (a KeyboardInterrupt: before or after the call)
            own = int(times[K.T_OWN])
            if own < 0:  # never ran: the job is not described, so none may take it
                K.publish(ctl, word | m)
                own = m
            pool.finish(m, own + K.take_rest(ctl))
            raise
        if posted or times[K.T_DONE] < m - own:
            pool.finish(m, own)
        cpu = times[K.T_CPU] * 1e-9 if cpu == -1 else _cpu_time() - cpu
        last_pass[0], last_pass[1] = m, own
        counts["passes_split"] += 1
        if own < m:
            counts["passes_shared"] += 1
        _judge(t0, cpu, own, m)
        pool.roused = _clock() + ROUSE_S  # (the workers spin for the next pass)
    finally:
        pool.busy.release()
    return True
