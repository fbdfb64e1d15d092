"""Atomic loads, stores, compare-and-swap and add on int64 array items for compiled code
(Numba has none on the CPU): the worker threads (``_threads``) take chunks and signal each
other through them without the GIL; and a parallel batch's block run by a worker there
(``block_job``), through the batch interpreter's address."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray
from numba.core import cgutils, types
from numba.core.callconv import excinfo_t
from numba.extending import intrinsic

from .._jit import njit_cached


def _item(context, builder, sig, args):
    """The pointer to ``flags[i]`` (the first two arguments) in an intrinsic's code."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]],
                                    wraparound=False)


@intrinsic
def load_acquire(typingctx, flags, i):
    """``flags[i]`` (int64) read by an atomic load: a loop that waits for another thread's
    store reads memory each turn (a plain load may be hoisted out of the loop)."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64
            and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item(context, builder, sig, args)
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(flags, i), codegen


@intrinsic
def store_release(typingctx, flags, i, value):
    """``flags[i] = value`` (int64) by an atomic store: seen by a thread spinning on it after
    what this thread wrote before (a plain store may be moved)."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64
            and isinstance(i, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item(context, builder, sig, args)
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, ptr, "release", 8)
        return context.get_dummy_value()

    return types.none(flags, i, value), codegen


@intrinsic
def compare_swap(typingctx, flags, i, old, new):
    """``flags[i] = new`` if it holds ``old``, atomically (int64); returns what it held: a
    chunk claimed by one thread of several is claimed once."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64
            and isinstance(i, types.Integer) and isinstance(old, types.Integer)
            and isinstance(new, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item(context, builder, sig, args)
        o = context.cast(builder, args[2], sig.args[2], types.int64)
        n = context.cast(builder, args[3], sig.args[3], types.int64)
        pair = builder.cmpxchg(ptr, o, n, "acq_rel", "acquire")
        return builder.extract_value(pair, 0)

    return types.int64(flags, i, old, new), codegen


@intrinsic
def fetch_add(typingctx, flags, i, value):
    """``flags[i] += value`` atomically (int64), returning what it held before."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64
            and isinstance(i, types.Integer) and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _item(context, builder, sig, args)
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, v, "acq_rel")

    return types.int64(flags, i, value), codegen


@intrinsic
def f64_pointer(typingctx, address):
    """The float64 pointer at ``address`` (an int64 from ``ndarray.ctypes.data``), for
    ``numba.carray``: a worker thread's compiled loop reads a job's arrays from their
    addresses (the job is handed over in an int64 array, never as Python objects)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr_t = context.get_value_type(types.CPointer(types.float64))
        return builder.inttoptr(args[0], ptr_t)

    return types.CPointer(types.float64)(address), codegen


@intrinsic
def i64_pointer(typingctx, address):
    """The int64 pointer at ``address`` (``f64_pointer``'s, for int64 arrays)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ptr_t = context.get_value_type(types.CPointer(types.int64))
        return builder.inttoptr(args[0], ptr_t)

    return types.CPointer(types.int64)(address), codegen


@intrinsic
def call_none(typingctx, address, args):
    """Call the compiled function at ``address`` (Numba's own calling convention, its
    result ``None``) with the tuple ``args``, which must be of the types it was compiled
    for; returns its status (0: it returned, else it raised). A worker's compiled loop runs
    the batch interpreter this way without linking it into its own code (a compiled
    caller links and optimizes its callees again: seconds a form, cold)."""
    if not (isinstance(address, types.Integer) and isinstance(args, types.BaseTuple)):
        return None
    argtys = tuple(args.types)

    def codegen(context, builder, sig, llargs):
        cc = context.call_conv
        fnty = cc.get_function_type(types.none, argtys)
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())
        retty = cc.get_return_type(types.none).pointee
        ret = cgutils.alloca_once(builder, retty)
        builder.store(cgutils.get_null_value(retty), ret)
        exc = cgutils.alloca_once(builder, ir.PointerType(excinfo_t))
        values = [builder.extract_value(llargs[1], k) for k in range(len(argtys))]
        packed = list(cc._get_arg_packer(argtys).as_arguments(builder, values))
        return builder.call(fn, [ret, exc] + packed)

    return types.int32(address, args), codegen


@intrinsic
def call_clock(typingctx, address, clock, ts):
    """``clock_gettime(clock, ts)`` called at ``address`` (libc's, from ctypes: a compiled
    caller of the C library by address is cached on disk, where one through a ctypes object
    is not), ``ts`` an int64 array of 2 at least (a ``struct timespec`` on 64-bit Linux);
    returns its status (0: read)."""
    if not (isinstance(address, types.Integer) and isinstance(clock, types.Integer)
            and isinstance(ts, types.Array) and ts.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(i32, [i32, ir.IntType(8).as_pointer()])
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        ary = context.make_array(sig.args[2])(context, builder, args[2])
        ptr = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        return builder.call(fn, [builder.trunc(args[1], i32), ptr])

    return types.int32(address, clock, ts), codegen


# the job's layout (``_kernels``' names, the same numbers: a test checks them), and where a
# compiled intra-op job's chunk function is (``_kernels._run_chunk``'s address, which
# ``serve`` calls: linked into it, it made a worker's loop 4 s to compile cold)
CLAIM, DONE, KIND, ALLOWED, RUN_CHUNK, PARAMS = 0, 8, 16, 17, 18, 24
IDX_BITS = 20
IDX_MASK = (1 << IDX_BITS) - 1
JOB_PY, JOB_BLOCKS = 0, 3  # (_kernels' JOB_ROWS and JOB_SUM_MIDDLE are 1 and 2)

#: a parallel batch's job (``ctl`` from ``PARAMS``, written by ``describe_blocks``): the
#: interpreter's address; the arrays of ``run_block`` (address and shape each); ``grad``;
#: the samples and a block's size; the numbers of a block's values (its adjoints as many:
#: a worker's room holds both); the address of a signal word no one waits on; and the first
#: block that failed (1 + its index; 0: none)
(B_FN, B_ROWS, B_X, B_OUT_SLOTS, B_S, B_IN_SLOTS, B_GRAD, B_STATUS, B_OUTS, B_G, B_SAMPLES,
 B_SIZE, B_ROOM_HALF, B_SIGNAL, B_FAILED) = (0, 1, 4, 7, 9, 12, 14, 15, 17, 20, 23, 24, 25,
                                             26, 27)
BLOCK_PARAMS = 28


@njit_cached(nogil=True)
def block_job(ctl, p, i, room):  # pragma: no cover (compiled)
    """Block ``i`` of the parallel batch described at ``ctl[p:]`` (above), run in ``room``
    (a worker's own, grown by it: ``serve``; one too small, a new one): the batch
    interpreter called at its address, as the caller runs its blocks (the same arguments:
    the same bits). A block that raised is noted (``B_FAILED``): the caller runs it again
    to raise that error."""
    rows = carray(f64_pointer(ctl[p + B_ROWS]), (ctl[p + B_ROWS + 1], ctl[p + B_ROWS + 2]))
    X = carray(f64_pointer(ctl[p + B_X]), (ctl[p + B_X + 1], ctl[p + B_X + 2]))
    out_slots = carray(i64_pointer(ctl[p + B_OUT_SLOTS]), ctl[p + B_OUT_SLOTS + 1])
    S = carray(f64_pointer(ctl[p + B_S]), (ctl[p + B_S + 1], ctl[p + B_S + 2]))
    in_slots = carray(i64_pointer(ctl[p + B_IN_SLOTS]), ctl[p + B_IN_SLOTS + 1])
    grad = ctl[p + B_GRAD] != 0
    status = carray(i64_pointer(ctl[p + B_STATUS]), ctl[p + B_STATUS + 1])
    outs = carray(f64_pointer(ctl[p + B_OUTS]), (ctl[p + B_OUTS + 1], ctl[p + B_OUTS + 2]))
    G = carray(f64_pointer(ctl[p + B_G]), (ctl[p + B_G + 1], ctl[p + B_G + 2]))
    half = ctl[p + B_ROOM_HALF]
    if room.shape[0] < 2 * half:
        room = np.empty(2 * half)
    Vw = carray(f64_pointer(room.ctypes.data), half)
    Aw = carray(f64_pointer(room.ctypes.data + 8 * half), half)
    signal = carray(i64_pointer(ctl[p + B_SIGNAL]), 1)
    b0 = i * ctl[p + B_SIZE]
    b1 = min(ctl[p + B_SAMPLES], b0 + ctl[p + B_SIZE])
    failed = call_none(ctl[p + B_FN], (rows, X, out_slots, S, in_slots, grad, status, outs,
                                       G, b0, b1, Vw, Aw, signal, 0))
    if failed != 0:
        compare_swap(ctl, p + B_FAILED, 0, i + 1)


@njit_cached(nogil=True)
def describe_blocks(ctl, p, fn, rows, X, out_slots, S, in_slots, grad, status, outs, G, size,
                    half, signal):  # pragma: no cover (compiled)
    """A parallel batch's job written at ``ctl[p:]`` (``block_job`` reads it; ``rows`` as
    the interpreter at ``fn`` runs them, C-contiguous arrays of its compiled types), its
    failed block cleared."""
    ctl[p + B_FN] = fn
    ctl[p + B_ROWS], ctl[p + B_ROWS + 1], ctl[p + B_ROWS + 2] = rows.ctypes.data, *rows.shape
    ctl[p + B_X], ctl[p + B_X + 1], ctl[p + B_X + 2] = X.ctypes.data, *X.shape
    ctl[p + B_OUT_SLOTS], ctl[p + B_OUT_SLOTS + 1] = out_slots.ctypes.data, out_slots.shape[0]
    ctl[p + B_S], ctl[p + B_S + 1], ctl[p + B_S + 2] = S.ctypes.data, *S.shape
    ctl[p + B_IN_SLOTS], ctl[p + B_IN_SLOTS + 1] = in_slots.ctypes.data, in_slots.shape[0]
    ctl[p + B_GRAD] = 1 if grad else 0
    ctl[p + B_STATUS], ctl[p + B_STATUS + 1] = status.ctypes.data, status.shape[0]
    ctl[p + B_OUTS], ctl[p + B_OUTS + 1], ctl[p + B_OUTS + 2] = outs.ctypes.data, *outs.shape
    ctl[p + B_G], ctl[p + B_G + 1], ctl[p + B_G + 2] = G.ctypes.data, *G.shape
    ctl[p + B_SAMPLES], ctl[p + B_SIZE] = X.shape[0], size
    ctl[p + B_ROOM_HALF] = half
    ctl[p + B_SIGNAL] = signal.ctypes.data
    ctl[p + B_FAILED] = 0


@njit_cached(nogil=True)
def serve(ctl, worker, turns, room):  # pragma: no cover (compiled)
    """A worker thread's loop: the chunks of compiled jobs run here, without the GIL (a
    parallel batch's blocks, ``block_job``, in ``room``, this worker's own; an intra-op
    pass's through ``_kernels._run_chunk`` at its address, ``RUN_CHUNK``), until ``turns``
    reads in a row found no chunk to take; returns -1 then, -2 before it takes a block its
    room is too small for (its caller grows the room: ``B_ROOM_HALF``, and calls again), or
    the index of a Python job's chunk this thread took (run by the caller of ``serve``,
    which then calls ``_kernels.chunk_done``). Worker ``worker`` takes chunks while the job
    allows that many (``ALLOWED``: threads over ``set_num_threads`` stay out)."""
    idle = 0
    while idle <= turns:  # (one look at least)
        w = load_acquire(ctl, CLAIM)
        i, m = w & IDX_MASK, (w >> IDX_BITS) & IDX_MASK
        if i < m and worker < load_acquire(ctl, ALLOWED):
            # (the job of ``w`` is the one described: a chunk of it is left, so its caller
            # has not posted the next)
            kind = load_acquire(ctl, KIND)
            if kind == JOB_BLOCKS and room.shape[0] < 2 * ctl[PARAMS + B_ROOM_HALF]:
                return -2
            if compare_swap(ctl, CLAIM, w, w + 1) != w:
                continue
            if kind == JOB_PY:
                return i
            if kind == JOB_BLOCKS:
                block_job(ctl, PARAMS, i, room)
            else:
                call_none(ctl[RUN_CHUNK], (ctl, i, m))
            fetch_add(ctl, DONE, 1)
            idle = 0
        else:
            idle += 1
    return -1


#: the thread CPU clock of Linux (``time.CLOCK_THREAD_CPUTIME_ID``), which ``run_caller``
#: reads through ``clock_gettime`` at the address it is given
CLOCK_THREAD_CPUTIME_ID = 3
CLOCK_MONOTONIC = 1  # (Linux's: read in user space, tens of ns; the thread clock is a call)
#: ``run_caller``'s ``times``: the timespec it reads into, then what it measured: the CPU
#: ns of the caller's blocks, their samples, the blocks it ran (-1 until it has run: a
#: KeyboardInterrupt before it leaves the job to the caller's ``except``), the worker
#: blocks done when it stopped waiting, and the ns it waited for them (the threads'
#: imbalance at the end: a worker late to start, or slower)
T_CPU, T_SAMPLES, T_OWN, T_DONE, T_WAIT = 2, 3, 4, 5, 6
#: a program's part of a parallel batch's job, the same from batch to batch (``describe_
#: program`` writes it once, ``run_caller`` copies it into the job): the interpreter's
#: address, the rows' (address, 2 sizes), ``out_slots``' and ``in_slots``' (address, size),
#: the caller's room (address, size), the turns of its wait, and ``clock_gettime``'s address
(D_FN, D_ROWS, D_OUT_SLOTS, D_IN_SLOTS, D_ROOM, D_TURNS, D_CLOCK) = (0, 1, 4, 6, 8, 10, 11)
DESC = 12


@njit_cached(nogil=True)
def describe_program(desc, fn, rows, out_slots, in_slots, room, turns,
                     clock):  # pragma: no cover (compiled)
    """``desc`` (``D_*``) written for the interpreter at ``fn`` running ``rows`` (its
    caller keeps these arrays alive while it uses ``desc``)."""
    desc[D_FN] = fn
    desc[D_ROWS], desc[D_ROWS + 1], desc[D_ROWS + 2] = rows.ctypes.data, *rows.shape
    desc[D_OUT_SLOTS], desc[D_OUT_SLOTS + 1] = out_slots.ctypes.data, out_slots.shape[0]
    desc[D_IN_SLOTS], desc[D_IN_SLOTS + 1] = in_slots.ctypes.data, in_slots.shape[0]
    desc[D_ROOM], desc[D_ROOM + 1] = room.ctypes.data, room.shape[0]
    desc[D_TURNS], desc[D_CLOCK] = turns, clock


@njit_cached(nogil=True)
def _clock_ns(clock, which, times):  # pragma: no cover (compiled)
    """Clock ``which`` in ns, read through ``clock_gettime`` at ``clock``."""
    call_clock(clock, which, times)
    return times[0] * 1_000_000_000 + times[1]


@njit_cached(nogil=True)
def run_caller(ctl, desc, X, S, status, outs, G, grad, size, word, allowed,
               times):  # pragma: no cover (compiled)
    """The calling thread's share of a parallel batch in one compiled call, without the GIL:
    the job described (the program's part from ``desc``, ``describe_program``; this
    batch's arrays; its kind, ``allowed`` workers and no block done yet), its claim word
    ``word`` stored, then block 0 (the caller's: ``word`` counts it taken) and every block
    it claims after, each run as a worker runs one (``block_job``, the interpreter at its
    address, in the caller's room: the same code, the same bits), then up to ``D_TURNS``
    reads for the workers' blocks to end. ``times`` (``T_*``) gets the caller's blocks'
    CPU time (its thread clock, through ``clock_gettime`` at ``D_CLOCK``: two reads a
    batch, where ``time.thread_time`` around each block cost 1.1 us a block) and
    samples. Returns the blocks it ran. (One call of 12 arguments: Numba's dispatch of
    the 18 it took before ``desc`` cost 2.4 us, 0.9 for 10.)"""
    p = PARAMS
    ctl[DONE] = 0
    ctl[KIND] = JOB_BLOCKS
    ctl[ALLOWED] = allowed
    ctl[p + B_FN] = desc[D_FN]
    for k in range(3):
        ctl[p + B_ROWS + k] = desc[D_ROWS + k]
    ctl[p + B_X], ctl[p + B_X + 1], ctl[p + B_X + 2] = X.ctypes.data, *X.shape
    ctl[p + B_OUT_SLOTS], ctl[p + B_OUT_SLOTS + 1] = desc[D_OUT_SLOTS], desc[D_OUT_SLOTS + 1]
    ctl[p + B_S], ctl[p + B_S + 1], ctl[p + B_S + 2] = S.ctypes.data, *S.shape
    ctl[p + B_IN_SLOTS], ctl[p + B_IN_SLOTS + 1] = desc[D_IN_SLOTS], desc[D_IN_SLOTS + 1]
    ctl[p + B_GRAD] = 1 if grad else 0
    ctl[p + B_STATUS], ctl[p + B_STATUS + 1] = status.ctypes.data, status.shape[0]
    ctl[p + B_OUTS], ctl[p + B_OUTS + 1], ctl[p + B_OUTS + 2] = outs.ctypes.data, *outs.shape
    ctl[p + B_G], ctl[p + B_G + 1], ctl[p + B_G + 2] = G.ctypes.data, *G.shape
    ctl[p + B_SAMPLES], ctl[p + B_SIZE] = X.shape[0], size
    ctl[p + B_ROOM_HALF] = desc[D_ROWS + 1] * size
    ctl[p + B_SIGNAL] = ctl.ctypes.data + 8 * (ctl.shape[0] - 1)  # (nobody stores to it)
    ctl[p + B_FAILED] = 0
    store_release(ctl, CLAIM, word)
    room = carray(f64_pointer(desc[D_ROOM]), desc[D_ROOM + 1])
    clock = desc[D_CLOCK]
    m = (word >> IDX_BITS) & IDX_MASK
    B = X.shape[0]
    t0 = _clock_ns(clock, CLOCK_THREAD_CPUTIME_ID, times)
    own, done, i = 0, 0, 0 if m > 0 else -1  # (a job of no blocks: none run)
    while i >= 0:
        block_job(ctl, p, i, room)
        own += 1
        done += min(B, (i + 1) * size) - i * size
        i = -1
        while True:  # the next block nobody has taken (``_kernels.claim``)
            w = load_acquire(ctl, CLAIM)
            j = w & IDX_MASK
            if j >= (w >> IDX_BITS) & IDX_MASK:
                break
            if compare_swap(ctl, CLAIM, w, w + 1) == w:
                i = j
                break
    times[T_CPU] = _clock_ns(clock, CLOCK_THREAD_CPUTIME_ID, times) - t0
    times[T_SAMPLES] = done
    times[T_OWN] = own
    left = m - own
    finished = load_acquire(ctl, DONE)
    waited = 0
    if finished < left:
        w0 = _clock_ns(clock, CLOCK_MONOTONIC, times)
        for _ in range(desc[D_TURNS]):
            finished = load_acquire(ctl, DONE)
            if finished >= left:
                break
        waited = _clock_ns(clock, CLOCK_MONOTONIC, times) - w0
    times[T_DONE] = finished
    times[T_WAIT] = waited
    return own
