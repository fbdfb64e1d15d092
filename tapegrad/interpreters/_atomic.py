"""Atomic loads and stores of int64 array items for compiled code (Numba has none on the
CPU): the replay's threads signal each other through them without the GIL."""
from __future__ import annotations

from numba.core import cgutils, types
from numba.extending import intrinsic


@intrinsic
def load_acquire(typingctx, flags, i):
    """``flags[i]`` (int64) read by an atomic load: a loop that waits for another thread's
    store reads memory each turn (a plain load may be hoisted out of the loop)."""
    if not (isinstance(flags, types.Array) and flags.dtype == types.int64
            and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]],
                                       wraparound=False)
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
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]],
                                       wraparound=False)
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, ptr, "release", 8)
        return context.get_dummy_value()

    return types.none(flags, i, value), codegen
