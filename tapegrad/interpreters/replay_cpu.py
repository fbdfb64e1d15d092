"""Drivers of traced programs on the CPU: one sample, a batch in blocks of samples (serial
or spread over cores by threads), and one sample with many seeds (Jacobians)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from .._jit import njit_cached
from ._generated_replay import forward, reverse, reverse_multi, run_block

BLOCK = 128  # samples per block: the block's values (rows x BLOCK) stay in cache


@njit_cached(error_model="numpy", nogil=True)
def run_into(rows, slots, x, work, res, grad):
    """Forward at ``x``; with ``grad``, the reverse sweep seeded at the outputs. ``slots``:
    the m output slots, then the input slots; ``work`` (m + 2 x rows): the seeds, then room
    for the rows' values and adjoints; ``res``: the outputs, then (with ``grad``) the
    gradient. Returns the status (0, or 1 + the row of a failed guard).

    The caller owns the buffers (the one-sample calls reuse ``work``): nothing is allocated
    or boxed here but the status, which took a third of a small program's call (the entry
    returning three fresh arrays cost 1.4 us on a 12-row program, this one 0.55 us)."""
    n = rows.shape[0]
    m = work.shape[0] - 2 * n
    v = work[m:m + n]
    status = forward(rows, x, v)
    for i in range(m):
        res[i] = v[slots[i]]
    if grad and status == 0:
        adj = work[m + n:]
        adj[:] = 0.0
        for i in range(m):
            adj[slots[i]] += work[i]
        reverse(rows, v, adj)
        for i in range(m, slots.shape[0]):
            res[i] = adj[slots[i]]
    return status


@njit_cached(error_model="numpy", nogil=True)
def run(rows, x, out_slots, seeds, in_slots, grad):
    """``run_into`` with fresh buffers, for compiled callers (``optim_loop``): (status,
    outputs, gradients at ``in_slots``; zeros without ``grad``)."""
    m = out_slots.shape[0]
    work = np.empty(m + 2 * rows.shape[0])
    work[:m] = seeds
    res = np.zeros(m + in_slots.shape[0])
    status = run_into(rows, np.concatenate((out_slots, in_slots)), x, work, res, grad)
    return status, res[:m], res[m:]


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
    W = getattr(_local, "room", None)
    if W is None or W.shape[0] < 2 * half:
        W = np.empty(2 * half)
        if 2 * half * 8 <= ROOM_KEPT:
            _local.room = W
    return W[:half], W[half:2 * half]


def run_batch(rows, X, out_slots, S, in_slots, grad, block):
    """``run`` for samples in rows (``X[j]`` the inputs of sample ``j``, ``S[j]`` its seeds;
    so are the results ``outs`` and ``G``), a block at a time."""
    status, outs, G = _outputs(X, out_slots, in_slots, grad)
    B = X.shape[0]
    W = _room(rows, min(B, block))
    for b0 in range(0, B, block):
        run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0,
                  min(B, b0 + block), *W)
    return status, outs, G


_pool = None
_pool_lock = threading.Lock()
_compiled = False  # run_block has run once in this process (compiled or loaded)


def _executor():
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS,
                                       thread_name_prefix="tapegrad-replay")
        return _pool


def run_parallel(rows, X, out_slots, S, in_slots, grad, block):
    """``run_batch`` with the blocks spread over CPU cores: ``run_block`` releases the GIL,
    so threads run blocks at once (``numba.get_num_threads()`` of them, this one among them;
    each block writes its own columns)."""
    global _compiled
    status, outs, G = _outputs(X, out_slots, in_slots, grad)
    B = X.shape[0]
    if B == 0:
        return status, outs, G
    n = numba.get_num_threads()
    # a block a thread at least (not below 16 samples a block); not smaller: blocks half
    # as big cost 12% more per sample (n=100 Rosenbrock, 64 vs 128 samples)
    while block > 16 and B < n * block:
        block //= 2
    starts = iter(range(0, B, block))

    def blocks():
        W = _room(rows, min(B, block))
        for b0 in starts:  # the threads take the next block in turn (under the GIL)
            run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0,
                      min(B, b0 + block), *W)

    if not _compiled:  # one block here first: run_block compiles once, before threads call it
        b0 = next(starts)
        run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0,
                  min(B, b0 + block), *_room(rows, block))
        _compiled = True
    n = min(n, -(-B // block))
    futures = [_executor().submit(blocks) for _ in range(n - 1)]
    try:
        blocks()
    finally:
        # a thread that has not started by now would find no block left: it is not waited
        # for (on a busy machine its start can take longer than the whole batch)
        for f in futures:
            if not f.cancel():
                f.result()
    return status, outs, G


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
