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
def run(rows, x, out_slots, seeds, in_slots, grad):
    """Forward at ``x``; with ``grad``, the reverse sweep seeded with ``seeds`` at the
    outputs. Returns (status, outputs, gradients at ``in_slots``)."""
    n = rows.shape[0]
    v = np.empty(n)
    status = forward(rows, x, v)
    outs = np.empty(out_slots.shape[0])
    for i in range(out_slots.shape[0]):
        outs[i] = v[out_slots[i]]
    grads = np.zeros(in_slots.shape[0])
    if grad and status == 0:
        adj = np.zeros(n)
        for i in range(out_slots.shape[0]):
            adj[out_slots[i]] += seeds[i]
        reverse(rows, v, adj)
        for i in range(in_slots.shape[0]):
            grads[i] = adj[in_slots[i]]
    return status, outs, grads


# run_batch and run_parallel are Python around the compiled run_block (both batch sweeps in
# one generated function): a compiled caller links the generated interpreters' code into its
# own and optimizes it all again (Numba links callees' LLVM modules), so each compiled level
# above run_block would cost as much as the interpreters themselves; the loop over blocks
# costs microseconds in Python, and run_block releases the GIL, so threads run blocks at once

def _work(rows, block):
    """Buffers for the values and adjoints of blocks of up to ``block`` samples, reused from
    block to block: fresh ones cost page faults (a 9,000-row block's values are 9 MB)."""
    return np.empty(rows.shape[0] * block), np.empty(rows.shape[0] * block)


def _outputs(X, out_slots, in_slots):
    B = X.shape[1]
    return (np.zeros(B, dtype=np.int64), np.empty((out_slots.shape[0], B)),
            np.zeros((in_slots.shape[0], B)))


def run_batch(rows, X, out_slots, S, in_slots, grad, block):
    """``run`` for samples in columns, a block at a time."""
    status, outs, G = _outputs(X, out_slots, in_slots)
    B = X.shape[1]
    work = _work(rows, min(B, block))
    for b0 in range(0, B, block):
        run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0,
                  min(B, b0 + block), *work)
    return status, outs, G


_pool = None
_pool_lock = threading.Lock()


def _executor():
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS,
                                       thread_name_prefix="tapegrad-replay")
        return _pool


def run_parallel(rows, X, out_slots, S, in_slots, grad, block):
    """``run_batch`` with the blocks spread over CPU cores: ``run_block`` releases the GIL,
    so threads run blocks at once (``numba.get_num_threads()`` of them; each block writes
    its own columns)."""
    status, outs, G = _outputs(X, out_slots, in_slots)
    B = X.shape[1]
    starts = list(range(0, B, block))
    if not starts:
        return status, outs, G

    def blocks(i0, step, work=None):
        if work is None:
            work = _work(rows, block)  # a set for each thread
        for b0 in starts[i0::step]:
            run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0,
                      min(B, b0 + block), *work)

    # the first block here: it compiles run_block once, before threads call it
    work = _work(rows, min(B, block))
    run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, 0, min(B, block),
              *work)
    starts = starts[1:]
    n = min(numba.get_num_threads(), len(starts))
    if n <= 1:
        blocks(0, 1, work)
    else:
        for f in [_executor().submit(blocks, i, n) for i in range(n)]:
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
