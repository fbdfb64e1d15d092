"""Drivers of traced programs on the CPU: one sample, a batch in blocks of samples (serial
or spread over cores by threads), and one sample with many seeds (Jacobians)."""
from __future__ import annotations

import contextvars
import functools
import threading
import time
import weakref

import numba
import numpy as np
from numba.np.ufunc import parallel as _nb_parallel

from .._jit import njit_cached
from .. import _threads
from . import _atomic
from . import _generated_replay as _g
from ._generated_replay import (  # noqa: F401  (the entries, named from here)
    COMMON, HEADER, forward, reverse, reverse_multi, run_bound, run_bound_fused, run_fused,
    run_fused_common, run_into, run_into_common)
from .fuse import BASE, batch_rows

BLOCK = 128  # samples per block: the block's values (rows x BLOCK) stay in cache


# the one-sample entries (``run_into``, of rows as traced; ``run_fused``, of rows with
# superinstructions, interpreters/fuse.py; ``run_bound`` and ``run_bound_fused``, a bound
# call's) and the batch's ``run_block``, each generated in two forms (``_codegen_replay.
# FORMS``): of any rows, and of rows of common ops only (``*_common``), which compiles in
# half the time; ``entry`` and ``run_block`` pick the form by the rows (``common``).
# ``work``: ``HEADER`` (_codegen_replay.py says its layout)

#: each entry's form for rows of common ops only
_COMMON_FORM = {}
for _name in ("run_into", "run_fused", "run_bound", "run_bound_fused", "run_block"):
    _COMMON_FORM[getattr(_g, _name)] = getattr(_g, _name + "_common")


def common(rows):
    """Whether ``rows`` (as traced, or with superinstructions: ``fuse.BASE`` and above) hold
    only ops that the ``*_common`` entries run (``COMMON``): never a rare op's row, which
    those would skip."""
    op = rows[:, 0].astype(np.int64)
    inside = op < COMMON.shape[0]
    return bool(COMMON[op[inside]].all()) and bool((op[~inside] >= BASE).all()) \
        and bool((op >= 0).all())


def entry(rows, work, fn=None):
    """``run_into`` (or ``fn``) for this program's arrays without Numba's dispatch: the
    compiled wrapper of their signature (compiled, or loaded from the cache, now), called
    with the arrays only, in its form of common ops (``common``) for rows that have only
    those. The dispatcher types each argument to pick it on every call (0.11 us of 0.41);
    the one-sample calls pass only arrays they made (``rows``, ``work`` and a fresh float64
    result vector), of the signature picked here, so that check has nothing to catch. The
    dispatcher itself without the JIT (``NUMBA_DISABLE_JIT=1``)."""
    fn = run_into if fn is None else fn  # (program_arrays' run_into: the same arguments)
    if fn in _COMMON_FORM and common(rows):
        fn = _COMMON_FORM[fn]
    if not hasattr(fn, "compile"):
        return fn
    return fn.compile((numba.typeof(rows), numba.typeof(work), numba.typeof(work)))


#: the most inputs ``run_args`` takes, and its stand-in for an input it is not given (it
#: always takes three arrays: one signature, one compile per form)
ARGS_MAX = 3
NO_X = np.empty(0)
#: the most input elements ``run_args`` takes: its copy (any strides) costs about 1 ns an
#: element, NumPy's of a contiguous input 0.1 to 0.2 ns after 160 ns of call; one input of
#: 100 elements ran as fast either way (n=100 Rosenbrock), so larger inputs keep NumPy's
ARGS_SIZE = 64


def takes_args(shapes):
    """Whether ``run_args`` runs the one-sample calls of a program of inputs of these
    shapes: one to ``ARGS_MAX`` 1-D inputs of ``ARGS_SIZE`` elements in all at most."""
    return 1 <= len(shapes) <= ARGS_MAX and all(len(s) == 1 for s in shapes) \
        and sum(s[0] for s in shapes) <= ARGS_SIZE


@njit_cached(error_model="numpy", nogil=True)
def _args_in(work, x0, x1, x2):
    """Copy the inputs ``x0``, ``x1``, ``x2`` (1-D, any strides, one after the other) into
    ``work``'s inputs; False, with nothing written, when their sizes do not add up to the
    inputs' count."""
    m, p, nx = int(work[0]), int(work[1]), int(work[2])
    n0, n1, n2 = x0.shape[0], x1.shape[0], x2.shape[0]
    if n0 + n1 + n2 != nx:
        return False
    o = HEADER + 2 * m + p
    for i in range(n0):
        work[o + i] = x0[i]
    o += n0
    for i in range(n1):
        work[o + i] = x1[i]
    o += n1
    for i in range(n2):
        work[o + i] = x2[i]
    return True


# ``run_into`` and ``run_fused`` (each in its two forms) with the inputs as arguments: what
# ``Program._one`` calls for a few small 1-D inputs (``takes_args``), after ``fuse.TIER`` calls
# (``_Code.tier_up``). Numba's wrapper unboxes an array argument in 25 ns, where copying it
# into the entry's buffer from Python (``view[...] = x``) took 160 ns: value_and_grad of 3
# inputs of 2 elements 0.3 us faster (2.26 to 1.95 us, CPU time). Entries of their own
# (1.1 to 1.2 s of cold compile each, at the first call after the tier-up), so that a
# program's first calls, its batches and its bound calls never compile them. Status -1: the
# sizes did not add up (nothing ran).

@njit_cached(error_model="numpy", nogil=True)
def run_args(rows, work, res, x0, x1, x2):
    """``run_into`` of inputs ``x0``, ``x1``, ``x2`` (``_args_in``)."""
    if not _args_in(work, x0, x1, x2):
        return -1
    return run_into(rows, work, res)


@njit_cached(error_model="numpy", nogil=True)
def run_args_common(rows, work, res, x0, x1, x2):
    """``run_into_common`` of inputs ``x0``, ``x1``, ``x2`` (``_args_in``)."""
    if not _args_in(work, x0, x1, x2):
        return -1
    return run_into_common(rows, work, res)


@njit_cached(error_model="numpy", nogil=True)
def run_args_fused(rows, work, res, x0, x1, x2):
    """``run_fused`` of inputs ``x0``, ``x1``, ``x2`` (``_args_in``)."""
    if not _args_in(work, x0, x1, x2):
        return -1
    return run_fused(rows, work, res)


@njit_cached(error_model="numpy", nogil=True)
def run_args_fused_common(rows, work, res, x0, x1, x2):
    """``run_fused_common`` of inputs ``x0``, ``x1``, ``x2`` (``_args_in``)."""
    if not _args_in(work, x0, x1, x2):
        return -1
    return run_fused_common(rows, work, res)


_COMMON_FORM[run_args] = run_args_common
_COMMON_FORM[run_args_fused] = run_args_fused_common


def entry_args(rows, work, fused):
    """``entry`` of ``run_args`` (``fused``: ``run_args_fused``): the compiled wrapper for
    this program's arrays and three inputs of any strides (Numba's layout "A": the wrapper
    reads an array's strides, and the one-sample call passes only 1-D float64 ndarrays of
    the traced sizes, ``NO_X`` for the inputs a program does not have)."""
    fn = run_args_fused if fused else run_args
    if fn in _COMMON_FORM and common(rows):
        fn = _COMMON_FORM[fn]
    if not hasattr(fn, "compile"):
        return fn
    x = numba.types.float64[:]
    return fn.compile((numba.typeof(rows), numba.typeof(work), numba.typeof(work), x, x, x))


def new_work(n, out_slots, in_slots, nx):
    """A ``work`` buffer of ``run_into`` for a program of ``n`` values (its rows; with array
    instructions, their slots), with inputs of size ``nx``: its
    header, seeds (ones) and slots set, the inputs and values left to fill. (``run`` lays
    out its own: a compiled caller cannot call this.)"""
    m, p = out_slots.shape[0], in_slots.shape[0]
    o = HEADER + 2 * m + p
    work = np.empty(o + nx + 2 * n)
    work[:HEADER] = m, p, nx
    work[HEADER:HEADER + m] = 1.0
    work[HEADER + m:HEADER + 2 * m] = out_slots
    work[HEADER + 2 * m:o] = in_slots
    return work


@njit_cached(error_model="numpy", nogil=True)
def run(rows, x, out_slots, seeds, in_slots, grad):
    """``run_into`` with fresh buffers, for compiled callers (``optim_loop``): (status,
    outputs, gradients at ``in_slots``; zeros without ``grad``)."""
    m, p, nx = out_slots.shape[0], in_slots.shape[0], x.shape[0]
    o = HEADER + 2 * m + p
    work = np.empty(o + nx + 2 * rows.shape[0])
    work[0], work[1], work[2] = m, p, nx
    work[HEADER:HEADER + m] = seeds
    work[HEADER + m:HEADER + 2 * m] = out_slots
    work[HEADER + 2 * m:o] = in_slots
    work[o:o + nx] = x
    res = np.zeros(m + p if grad else m)
    status = run_into(rows, work, res)
    return status, res[:m], res[m:] if grad else np.zeros(p)


#: ``run`` called from Python: the same body run as Python over the compiled ``run_into``
#: (calling ``run`` itself would compile the interpreters once more, for seconds; without
#: the JIT, NUMBA_DISABLE_JIT=1, ``run`` is that Python function already)
run_fresh = getattr(run, "py_func", run)


# run_batch and run_parallel are Python around the compiled run_block (both batch sweeps in
# one generated function): a compiled caller links the generated interpreters' code into its
# own and optimizes it all again (Numba links callees' LLVM modules), so each compiled level
# above run_block would cost as much as the interpreters themselves; the loop over blocks
# costs microseconds in Python, and run_block releases the GIL, so threads run blocks at once

def _outputs(X, out_slots, in_slots, grad):
    """(status, outs, G) for ``X``'s samples; with ``grad`` every block writes all of
    ``G``, so it is not zeroed first (a 2 MB zeroed result was 20 us of page clearing)."""
    B = X.shape[0]
    return (np.zeros(B, dtype=np.int64), np.empty((B, out_slots.shape[0])),
            (np.empty if grad else np.zeros)((B, in_slots.shape[0])))


_local = threading.local()
ROOM_KEPT = 1 << 24  # bytes of room a thread keeps between calls: replay.BLOCK_BYTES


def _room(rows, block):
    """``run_block``'s room (values, adjoints) for blocks of ``block`` samples: this thread's,
    kept between calls up to ``ROOM_KEPT`` bytes (allocated per block, a 9,000-row
    program's values and adjoints were page faults that the threads took in turn; allocated
    per call, a worker thread's arena gave its pages back after each: 0.1 ms of page faults a
    call for 892 rows)."""
    half = rows.shape[0] * block
    W = _whole_room(2 * half)
    return W[:half], W[half:2 * half]


def _whole_room(size):
    """This thread's room of ``size`` numbers at least (``_room``'s, whole)."""
    W = getattr(_local, "room", None)
    if W is None or W.shape[0] < size:
        W = np.empty(size)
        if size * 8 <= ROOM_KEPT:
            _local.room = W
    return W


def run_batch(rows, X, out_slots, S, in_slots, grad, block):
    """``run`` for samples in rows (``X[j]`` the inputs of sample ``j``, ``S[j]`` its seeds;
    so are the results ``outs`` and ``G``), a block at a time."""
    status, outs, G = _outputs(X, out_slots, in_slots, grad)
    B = X.shape[0]
    W = _room(rows, min(B, block))
    for b0 in range(0, B, block):
        run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0,
                  min(B, b0 + block), *W, _NO_SIGNAL, 0)
    return status, outs, G


_NO_SIGNAL = np.zeros(1, dtype=np.int64)  # run_block's signal where no worker waits
_F64, _I64 = np.dtype(np.float64), np.dtype(np.int64)

#: the form of ``run_block`` (``_g.run_block`` or ``_g.run_block_common``) of the rows a
#: batch ran last, by their identity (with a weak reference to check it: an id is reused
#: once its array is gone), and the rows it runs (``fuse.batch_rows``): ``common`` reads
#: every row, 10 us at 9,000 rows, and the pairs 0.1 ms. One tuple, replaced whole: a
#: thread reads them at once (a list changed in place could give it one program's id and
#: another's form)
_last_form = (None, None, None, None)  # (id, weak reference, form, rows it runs)


def batch_of(rows, out_slots=None):
    """``run_block``'s form for ``rows`` (of common ops only where ``common`` holds) and the
    rows it runs: in that form, with the superinstructions of ``fuse.batch_rows`` (none at
    or across the row of an output of ``out_slots``: a program's rows go with its outputs,
    and the rows are kept by their identity only)."""
    global _last_form
    key, ref, form, brows = _last_form
    if key == id(rows) and ref() is rows:
        return form, brows
    if common(rows):
        form, brows = _COMMON_FORM[_g.run_block], batch_rows(rows, out_slots)
    else:
        form, brows = _g.run_block, rows
    _last_form = id(rows), weakref.ref(rows), form, brows
    return form, brows


def form_of(rows):
    """``run_block``'s form for ``rows`` (``batch_of``)."""
    return batch_of(rows)[0]


def run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0, b1, Vw, Aw, signal,
              number):
    """The generated ``run_block`` in its form for ``rows`` (``batch_of``), of the rows
    that form runs: its arguments and results."""
    form, brows = batch_of(rows, out_slots)
    return form(brows, X, out_slots, S, in_slots, grad, status, outs, G, b0, b1, Vw, Aw,
                signal, number)


_compiled = set()  # the forms of run_block that have run in this process (compiled or loaded)


#: row-samples (rows x samples) a batch needs for ``target="parallel"`` to spread it over
#: threads: about 1 ns each (n=100 and n=1000 Rosenbrock, blocks of 64 to 128), so 60 us of
#: work, where handing half of it to a worker (10 to 30 us to start one on a busy 2-core
#: machine) can pay; smaller batches run serially
PARALLEL_WORK = 60_000


@functools.lru_cache(maxsize=256)
def _spans(B, threads, block):
    """The blocks of a parallel batch: as many as ``threads`` (or a multiple, to stay within
    ``block`` samples), all the same size but the last: 300 samples on 2 threads in blocks of
    at most 128 are 4 of 75, not 128 + 128 + 44, so the threads finish together."""
    count = max(threads, -(-B // block))
    count = -(-count // threads) * threads
    size = -(-B // count)
    return [(b0, min(B, b0 + size)) for b0 in range(0, B, size)]


#: the threads must make a batch at least this much faster than the caller's own pace would
#: (its blocks' CPU time a sample, times the samples); a batch that missed it, on a
#: machine whose other cores are busy, makes the next 1, 2, 4 ... up to ``PAUSE_MAX``
#: batches run serially (a worker taken off its core mid-block keeps the caller waiting
#: for that block), and one that met it ends the pause. A batch that cost more than the
#: serial one would have pauses the threads long enough that its loss is at most ``LOSS`` of
#: the time run (up to ``LOSS_MAX`` batches): at a load of 4.6 on 2 cores, a worker taken
#: off its core mid-block cost about 0.6 ms on batches of 0.2 to 0.5 ms, and the pauses of at
#: most 16 batches (61 threaded batches of 972, each one judged a miss) left the suite's
#: parallel row 0.93x the serial batch (``_threads.stats``). The loss counts from the second
#: miss in a row: on the idle machine, one stall of 3 ms among threaded batches of 105 us
#: (the serial one 182 us) paused the threads for 570 batches, and the row ran 1.0x
PAYOFF = 0.95
PAUSE_MAX = 16
#: the tries before the loss counts: a process's first threaded batches miss (a worker's
#: first block, caches: 1.2 to 17x the serial time on the idle machine), and pauses by their
#: loss kept the threads off for a thousand batches after them
WARM_TRIES = 8
LOSS = 0.03
LOSS_MAX = 1024
ADAPT = True  # False: every batch above the cut runs on the threads (the tests)
_cpu_time = time.thread_time
_counts = _threads.counts  # (what the batches did: ``_threads.stats``)
_pause = [0, 0]  # [batches still to run serially, the length of the next pause]
_tries = [0]  # threaded batches judged in this process
#: threaded batches after a pause that are not judged: the first batch of a try finds the
#: worker's caches cold (its core ran other jobs through the pause) or the worker just woken,
#: and on a machine loaded by others (a load of 13 to 15 on 2 cores, this process at nice
#: -15) its wait for the worker's block was 50 to 100 us more than the next batches' (209 us
#: against 87 to 92: the worker's block came late); judged on it, every try missed and the
#: threads stayed paused for good (a try every 17 batches, each one a miss)
SETTLE = 1
_settle = [0]  # threaded batches still to run before the next is judged
_wall = [0.0]  # the last batch's time (paused, or on the threads): how long a rouse lasts


def _judge(wall, serial):
    """The pause after a batch that took ``wall`` seconds on the threads, where the serial
    batch would have taken ``serial``. A try whose worker had to be woken through its lock
    counts its loss too: with the worker woken ahead of a try (``Pool.rouse``), those are
    the tries of a busy machine, where the wake-up comes late (the suite's row at a load of
    8.5 to 9 on 2 cores: 40 and 51 tries among 615 and 786 batches, 0.83 and 0.81x the
    serial batch; counting their loss, 12 and 16 tries, 0.92 and 0.80x)."""
    _tries[0] += 1
    if wall > PAYOFF * serial:
        # the batch before missed too (no lone stall), past the first tries
        again = _pause[1] > 0 and _tries[0] > WARM_TRIES
        _pause[1] = min(PAUSE_MAX, max(1, 2 * _pause[1]))
        loss = int((wall - serial) / (LOSS * serial)) if again and wall > serial > 0.0 else 0
        _pause[0] = max(_pause[1], min(LOSS_MAX, loss))
        _counts["pauses"] += 1
    else:
        _pause[1] = 0


#: the workers run their blocks in compiled code, without the GIL (``_atomic.block_job``,
#: the interpreter called at its address), where the batch's arrays are of the types the
#: interpreter is compiled for (``_BLOCK_SIG``); False, or other arrays: each block through
#: Python on the worker (``JOB_PY``), which takes the GIL around it
COMPILED = True
_F1, _F2 = numba.float64[::1], numba.float64[:, ::1]
_I1 = numba.int64[::1]
_BLOCK_SIG = (_F2, _F2, _I1, _F2, _I1, numba.boolean, _I1, _F2, _F2, numba.int64,
              numba.int64, _F1, _F1, _I1, numba.int64)
_addresses = {}  # run_block's form -> the address of its code for ``_BLOCK_SIG``


def _plain(a, dtype, ndim):
    """Whether ``a`` is an array ``_BLOCK_SIG`` types as such: C-contiguous, writeable,
    aligned, of ``dtype`` and ``ndim`` dimensions."""
    f = a.flags
    return a.dtype == dtype and a.ndim == ndim and f.c_contiguous and f.writeable \
        and f.aligned


def _address(form):
    """The address of ``form``'s compiled code for ``_BLOCK_SIG`` (the signature the
    serial batch compiled: found, not compiled again)."""
    a = _addresses.get(form)
    if a is None:
        form.compile(_BLOCK_SIG)
        cres = form.overloads[_BLOCK_SIG]
        a = _addresses[form] = cres.library.get_pointer_to_function(
            cres.fndesc.llvm_func_name)
    return a


def _clock_address():
    """The address of libc's ``clock_gettime``, through which ``_atomic.run_caller`` reads
    the caller's CPU clock (0 where that is not Linux's 64-bit ``timespec``: the caller's
    blocks then run through Python, timed by ``time.thread_time``)."""
    import ctypes
    import sys
    try:
        if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_long) != 8 \
                or getattr(time, "CLOCK_THREAD_CPUTIME_ID", None) \
                != _atomic.CLOCK_THREAD_CPUTIME_ID:
            return 0
        return ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


#: libc's ``clock_gettime`` (``_clock_address``): 0, the caller's blocks through Python
CLOCK = _clock_address()
#: ``_atomic.run_caller``'s measurements (``_atomic.T_*``): one array, used under the
#: pool's ``busy`` lock only
_times = np.zeros(8, dtype=np.int64)
_run_caller = _atomic.run_caller  # (a name here: the tests wrap it)
_ran_caller = [False]  # (True once _run_caller has run in this process: it is compiled)


def _num_threads():
    """``numba.get_num_threads()``, read through Numba's C function once its threads are
    set up (the public function checks that each call: 0.65 us, 0.09 this way)."""
    f = getattr(_nb_parallel, "_get_num_threads", None)
    n = f() if f is not None else 0
    return n if n > 0 else numba.get_num_threads()


_last_desc = (None,) * 6  # (rows, out_slots, in_slots, room, address, desc): ``_desc``'s


def _desc(form, brows, out_slots, in_slots, size):
    """The program's part of a parallel batch's job (``_atomic.describe_program``), written
    once for the rows ``brows`` that ``form`` runs and this thread's room for blocks of
    ``size`` samples, and kept while the next batch is of the same (one entry, replaced
    whole; it keeps those arrays alive, so their addresses stay valid); None where those
    arrays are not of the interpreter's compiled types (``_plain``)."""
    global _last_desc
    room = _whole_room(2 * brows.shape[0] * size)
    fn = _address(form)
    last = _last_desc
    if last[0] is brows and last[1] is out_slots and last[2] is in_slots \
            and last[3] is room and last[4] == fn:
        return last[5]
    desc = None
    if _plain(brows, _F64, 2) and _plain(out_slots, _I64, 1) and _plain(in_slots, _I64, 1):
        desc = np.zeros(_atomic.DESC, dtype=np.int64)
        _atomic.describe_program(desc, fn, brows, out_slots, in_slots, room,
                                 _threads.spin_turns(), CLOCK)
    if room is getattr(_local, "room", None):  # (a room not kept is not kept alive here)
        _last_desc = (brows, out_slots, in_slots, room, fn, desc)
    return desc


def run_parallel(rows, X, out_slots, S, in_slots, grad, block):
    """``run_batch`` with the blocks spread over CPU cores: ``run_block`` releases the GIL,
    so threads run blocks at once (``numba.get_num_threads()`` of them, this one among
    them, the pool of ``_threads``; they take blocks in turn, each block writes its own
    rows of the results). While the threads do not pay (``PAYOFF``), batches run serially
    for a while."""
    if ADAPT and _pause[0] > 0:  # a pause (first: numba.get_num_threads() costs 2 us)
        _pause[0] -= 1
        _counts["batches_paused"] += 1
        if _pause[0] == 0:
            _settle[0] = SETTLE
        if _pause[0] == 0 and _threads._pool.workers:
            # the next batch tries the threads: its worker wakes now and spins through this
            # batch and the next one's start, or a millisecond more (a busy machine starts
            # it late): asleep, it would start late, and the try be judged by its wake-up
            # (47 of 56 tries after a pause found it asleep, and paused again)
            _threads._pool.rouse(_num_threads(), 2 * _wall[0] + 1e-3)
        t0 = time.perf_counter()
        res = run_batch(rows, X, out_slots, S, in_slots, grad, block)
        _wall[0] = time.perf_counter() - t0
        return res
    B = X.shape[0]
    n = min(_num_threads(), B)
    pool = _threads._pool
    form, brows = batch_of(rows, out_slots)
    if n < 2 or form not in _compiled or not _threads.jit_on() \
            or not pool.busy.acquire(blocking=False):
        # one thread, the first batch (run_block compiles once, before threads call it),
        # no JIT (the hand-over would spin holding the GIL), or another thread's batch has
        # the workers (and the cores)
        if n >= 2 and form in _compiled and _threads.jit_on():
            _counts["batches_busy"] += 1
        _compiled.add(form)
        return run_batch(rows, X, out_slots, S, in_slots, grad, block)
    K = _threads._k()
    try:
        t_start = time.perf_counter()
        status, outs, G = _outputs(X, out_slots, in_slots, grad)
        spans = _spans(B, n, block)
        size = spans[0][1] - spans[0][0]

        ctl = pool.ctl
        compiled = COMPILED and _plain(X, _F64, 2) and _plain(S, _F64, 2) \
            and grad.__class__ is bool  # (the program's arrays: ``_desc``, or below)
        desc = _desc(form, brows, out_slots, in_slots, size) if compiled and CLOCK else None
        if desc is not None:
            # the whole hand-over in one compiled call (the caller's blocks too, as the
            # workers run theirs): 7 to 10 us of Python a batch less
            workers = pool.workers
            started = len(workers) < n - 1  # (a thread started now: not judged, below)
            # (nor the first run_caller of a process, which compiles it or loads it)
            fresh = started or not _ran_caller[0]
            if started or True in [w.sleeping for w in workers[:n - 1]]:
                word, _ = pool.post(_atomic.JOB_BLOCKS, len(spans), n, taken=1,
                                    always_later=True)
                posted = True
            else:  # (the workers spin: nothing to start or wake, run_caller posts the job)
                word, posted = pool.next_word(len(spans), 1), False
            times = _times
            times[_atomic.T_OWN] = -1
            try:
                own = _run_caller(ctl, desc, X, S, status, outs, G, grad, size, word, n - 1,
                                  times)
            except BaseException:  # (a KeyboardInterrupt: before or after the call)
                own = int(times[_atomic.T_OWN])
                if own < 0:  # never ran: the job is not described, so none may take it
                    K.publish(ctl, word >> K.IDX_BITS << K.IDX_BITS | len(spans))
                    own = len(spans)
                pool.finish(len(spans), own + K.take_rest(ctl))
                raise
            _ran_caller[0] = True
            # (as Python numbers: NumPy's int64 scalars took 2.7 us for the judge's
            # arithmetic, and made _judge 2.5 us slower)
            measured = times.tolist()
            if posted or measured[_atomic.T_DONE] < len(spans) - own:
                pool.finish(len(spans), own)
            _counts["wait_ns"] += measured[_atomic.T_WAIT]
            _ended(ctl, (rows, X, out_slots, S, in_slots, grad, status, outs, G), spans, own,
                   t_start, fresh, measured[_atomic.T_CPU] * 1e-9, measured[_atomic.T_SAMPLES], B)
            return status, outs, G
        compiled = compiled and _plain(brows, _F64, 2) and _plain(out_slots, _I64, 1) \
            and _plain(in_slots, _I64, 1)
        if compiled:  # the workers' blocks without the GIL, each in its own room
            _atomic.describe_blocks(ctl, K.PARAMS, _address(form), brows, X, out_slots, S,
                                    in_slots, grad, status, outs, G, size,
                                    brows.shape[0] * size, _NO_SIGNAL)
        else:
            def chunk(i):  # (a worker's, with the GIL: its room is its own)
                b0, b1 = spans[i]
                run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0, b1,
                          *_room(rows, size), _NO_SIGNAL, 0)
            pool.fn, pool.context = chunk, contextvars.copy_context()
        # the caller takes the first block; the workers see the job from inside it, once
        # the caller has let the GIL go (compiled: run_block stores the claim word)
        fresh = len(pool.workers) < n - 1  # (a thread started now: not judged, below)
        word, published = pool.post(_atomic.JOB_BLOCKS if compiled else K.JOB_PY, len(spans), n,
                                    taken=1, later=True)
        W = _room(rows, size)
        # the caller's samples and their CPU time (its wall time counts the time it was off
        # its core, which a worker sharing that core took: a busy machine looked fast)
        done, cpu, own = 0, 0.0, 1
        try:
            i, signal = 0, (_NO_SIGNAL, 0) if published else (ctl, word)
            while i >= 0:
                b0, b1 = spans[i]
                t0 = _cpu_time()
                run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0, b1,
                          *W, *signal)
                cpu += _cpu_time() - t0
                done += b1 - b0
                signal = (_NO_SIGNAL, 0)
                i, _ = K.claim(ctl)
                own += i >= 0
        except BaseException:
            pool.finish(len(spans), own + K.take_rest(ctl))
            raise
        pool.finish(len(spans), own)
        ran, lag = pool.lag()
        _counts["lag_workers"] += ran
        _counts["lag_ns"] += lag
        _ended(ctl if compiled else None, (rows, X, out_slots, S, in_slots, grad, status, outs,
                                           G), spans, own, t_start, fresh, cpu, done, B)
        return status, outs, G
    finally:
        pool.busy.release()


def _ended(ctl, batch, spans, own, t_start, fresh, cpu, done, B):
    """A threaded batch's end, either way it ran: a block that raised in compiled code
    (``ctl``'s failed block; None: blocks through Python raised themselves) raised again,
    the counts, and the judge of its wall time against the serial batch's (the caller's
    CPU time ``cpu`` over its ``done`` samples, times the batch's ``B``)."""
    failed = 0 if ctl is None else ctl[_threads._k().PARAMS + _atomic.B_FAILED]
    if failed:
        _failed(*batch, spans[failed - 1])
    _counts["batches_threads"] += 1
    _counts["chunks_caller"] += own
    _counts["chunks_workers"] += len(spans) - own
    _counts["batches_missed"] += own == len(spans)
    _wall[0] = time.perf_counter() - t_start
    if _settle[0] > 0:  # (the first batch of a try: SETTLE)
        _settle[0] -= 1
    elif not fresh:  # (a thread's start, once, says nothing of the batches to come)
        _judge(_wall[0], cpu / done * B)


def _failed(rows, X, out_slots, S, in_slots, grad, status, outs, G, span):
    """A block that raised in the threads' compiled loop (a worker's or the caller's:
    ``_atomic.block_job``, the error itself stays in compiled code) run again here,
    through Python, to raise its error; one that does not raise again raises a
    RuntimeError."""
    b0, b1 = span
    run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0, b1,
              *_room(rows, b1 - b0), _NO_SIGNAL, 0)
    raise RuntimeError(f"the block of samples {b0} to {b1 - 1} of a parallel batch raised on "
                       f"a worker thread (or in the caller's compiled loop) but not when run "
                       f"again through Python on the calling thread; run the batch on the "
                       f"'cpu' target to find out why")


@njit_cached(error_model="numpy", nogil=True)
def vjp_multi(rows, x, out_slots, S, in_slots):
    """(status, outputs, G) with ``G[:, j]`` the gradient seeded with ``S[:, j]`` at the
    outputs: one forward, one reverse sweep for all the seeds at once."""
    n = rows.shape[0]
    m = out_slots.shape[0]
    ns = S.shape[1]
    v = np.empty(n)
    status = forward(rows, x, v)
    outs = np.empty(m)
    for i in range(m):
        outs[i] = v[out_slots[i]]
    G = np.zeros((in_slots.shape[0], ns))
    if status == 0:
        A = np.zeros((n, ns))
        for i in range(m):
            ai = A[out_slots[i]]
            for j in range(ns):
                ai[j] += S[i, j]
        reverse_multi(rows, v, A)
        for i in range(in_slots.shape[0]):
            for j in range(ns):
                G[i, j] = A[in_slots[i], j]
    return status, outs, G


def jacobian(rows, x, out_slots, in_slots):
    """(status, outputs, J) with ``J[i, j]`` = d output i / d input j: one forward, one
    reverse sweep seeded with every output at once (Python over ``vjp_multi``: a compiled
    level more would optimize the interpreters again)."""
    status, outs, G = vjp_multi(rows, x, out_slots, np.eye(out_slots.shape[0]), in_slots)
    return status, outs, G.T.copy()


@njit_cached(error_model="numpy", nogil=True)
def jacobian_batch(rows, X, out_slots, in_slots):
    """``jacobian`` of every sample (column of ``X``): (status (B,), J (B, outputs,
    inputs))."""
    B = X.shape[1]
    status = np.zeros(B, dtype=np.int64)
    J = np.zeros((B, out_slots.shape[0], in_slots.shape[0]))
    eye = np.eye(out_slots.shape[0])
    for b in range(B):
        st, _, G = vjp_multi(rows, np.ascontiguousarray(X[:, b]), out_slots, eye, in_slots)
        status[b] = st
        J[b] = G.T
    return status, J
