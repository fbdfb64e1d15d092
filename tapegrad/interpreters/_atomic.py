"""Atomic loads, stores, compare-and-swap and add on int64 array items for compiled code
(Numba has none on the CPU): the worker threads (``_threads``) take chunks and signal each
other through them without the GIL."""
from __future__ import annotations

from numba.core import cgutils, types
from numba.extending import intrinsic


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
