"""The one-sample entries' bound arrays (``Program.buffer``): inputs read from, and results
written to, arrays the caller bound once, by their addresses kept at the end of ``work``."""
from __future__ import annotations

from numba import types
from numba.extending import intrinsic

from .._jit import njit_cached

#: the largest address a ``work`` buffer can hold (a float64 holds integers below 2**53
#: exactly; user-space addresses are below 2**47, or 2**56 with 5-level page tables, where
#: ``Program.buffer`` copies in Python instead)
MAX_ADDRESS = 1 << 53


@intrinsic
def _f64_at(typingctx, address):
    """A float64 pointer to ``address`` (an int64 from ``ndarray.ctypes.data``)."""
    sig = types.CPointer(types.float64)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen


# ``work[at:]`` of a bound call: the number of bound inputs, then (address, size) of each,
# in the inputs' order (their elements fill the entry's inputs in turn); the number of bound
# results, then (address, size, offset in ``res``) of each. Set by ``Program.buffer``, which
# keeps the arrays alive and checked them (float64, C-contiguous, the traced sizes).


@njit_cached(error_model="numpy", nogil=True)
def bound_in(work, at, x):
    """Copy the bound inputs into ``x`` (the entry's inputs); returns where the results'
    part of the description starts."""
    j = at + 1
    i = 0
    for _ in range(int(work[at])):
        p = _f64_at(int(work[j]))
        m = int(work[j + 1])
        for t in range(m):
            x[i + t] = p[t]
        i += m
        j += 2
    return j


@njit_cached(error_model="numpy", nogil=True)
def bound_out(work, at, res):
    """Copy the results ``res`` into the bound result arrays (``bound_in``'s layout)."""
    j = at + 1 + 2 * int(work[at])
    for _ in range(int(work[j])):
        p = _f64_at(int(work[j + 1]))
        m = int(work[j + 2])
        o = int(work[j + 3])
        for t in range(m):
            p[t] = res[o + t]
        j += 3
    return 0
