"""Drivers of traced programs on an NVIDIA GPU (numba.cuda), for ``target="cuda"``.

One thread runs the whole program for one sample: every thread follows the same opcode
stream, so a warp never diverges on the dispatch. The program's rows live in device memory
that no kernel writes; values and adjoints live in ``V[slot, sample]`` (rows of slots,
samples innermost), so neighbouring threads touch neighbouring addresses on every row.
Batches bigger than ``CHUNK_BYTES`` of values and adjoints run a chunk at a time.

The reverse kernel maps thread ``t`` to sample ``t // reps``: with ``reps == 1`` it is the
batched gradient; with ``reps == m`` each sample gets ``m`` seeds (its Jacobian's rows, or
a batch of cotangents), over one forward pass.

Imported only when a program is moved to the GPU (``replay.cuda_module`` checks first).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .._jit import cuda_jit_cached
from ._generated_cuda import forward_one, reverse_one

THREADS = 128            # threads per block
CHUNK_BYTES = 1 << 30    # values + adjoints of one chunk of samples, in bytes


@cuda_jit_cached()
def _forward(rows, X, V, out_slots, outs, status, b0):
    j = cuda.grid(1)
    if j < V.shape[1] and b0 + j < X.shape[1]:
        # V holds this chunk's samples; X, outs, status hold the whole batch
        Xc = X[:, b0:]
        status[b0 + j] = forward_one(rows, Xc, V, j)
        for i in range(out_slots.shape[0]):
            outs[i, b0 + j] = V[out_slots[i], j]


@cuda_jit_cached()
def _reverse(rows, V, A, S, out_slots, in_slots, G, reps, t0, T, status):
    t = cuda.grid(1)
    if t < A.shape[1] and t0 + t < T:
        j = t // reps
        if status[(t0 + t) // reps] != 0:
            # the forward stopped at a failed guard: the values after it were never
            # computed, so no gradient (NaN until the host runs another variant)
            for i in range(in_slots.shape[0]):
                G[i, t0 + t] = math.nan
            return
        for k in range(A.shape[0]):
            A[k, t] = 0.0
        for i in range(out_slots.shape[0]):
            A[out_slots[i], t] += S[i, t0 + t]
        reverse_one(rows, V, j, A, t)
        for i in range(in_slots.shape[0]):
            G[i, t0 + t] = A[in_slots[i], t]


@cuda_jit_cached()
def _pack(src, X, off):
    """``X[off + i, b] = src[b, i]``: one input's (batch, elements) into the program's
    (elements, batch) layout, cast to float64."""
    b = cuda.grid(1)
    if b < src.shape[0]:
        for i in range(src.shape[1]):
            X[off + i, b] = src[b, i]


@cuda_jit_cached()
def _unpack(flat, off, dst):
    """``dst[b, i] = flat[off + i, b]``, cast to ``dst``'s dtype."""
    b = cuda.grid(1)
    if b < dst.shape[0]:
        for i in range(dst.shape[1]):
            dst[b, i] = flat[off + i, b]


@cuda_jit_cached()
def _unpack_jacobian(G, m, i0, j0, dst):
    """``dst[b, r, c] = G[j0 + c, b * m + i0 + r]``: one output-input block of a batch of
    Jacobians whose rows were swept as ``m`` seeds per sample."""
    b = cuda.grid(1)
    if b < dst.shape[0]:
        for r in range(dst.shape[1]):
            for c in range(dst.shape[2]):
                dst[b, r, c] = G[j0 + c, b * m + i0 + r]


@cuda_jit_cached()
def _identity_seeds(S, m):
    t = cuda.grid(1)
    if t < S.shape[1]:
        for i in range(m):
            S[i, t] = 1.0 if t % m == i else 0.0


def _grid(n):
    return max(1, (n + THREADS - 1) // THREADS)


def is_device(x):
    """Whether ``x`` lives on the GPU: a numba device array (also the simulator's) or any
    object with ``__cuda_array_interface__`` (CuPy, torch CUDA tensors)."""
    return cuda.is_cuda_array(x) if hasattr(cuda, "is_cuda_array") else \
        hasattr(x, "copy_to_host")


def as_device(x):
    """A numba device array viewing ``x`` (no copy)."""
    if hasattr(x, "copy_to_host"):
        return x
    return cuda.as_cuda_array(x)


def device_code(code):
    """The program's rows and slot lists in device memory, copied once per program."""
    def build():
        return (cuda.to_device(code.rows), cuda.to_device(code.out_slots),
                cuda.to_device(code.in_slots))
    return code.derived("cuda", build)


def pack(arrs, batch):
    """The flat (inputs, batch) float64 device matrix of ``arrs``, each of shape
    (batch, ...) (or the traced shape when ``batch`` is None: a batch of one); host arrays
    are copied to the device once."""
    B = 1 if batch is None else batch
    sizes = [int(np.prod(a.shape[0 if batch is None else 1:])) for a in arrs]
    X = cuda.device_array((sum(sizes), B), dtype=np.float64)
    off = 0
    for a, m in zip(arrs, sizes):
        d = as_device(a) if is_device(a) else cuda.to_device(np.ascontiguousarray(a))
        if m and B:
            _pack[_grid(B), THREADS](_reshape(d, (B, m)), X, off)
        off += m
    return X


def _reshape(d, shape):
    if d.shape == shape:
        return d
    if not d.is_c_contiguous():
        raise ValueError("a CUDA input must be C-contiguous; make a contiguous copy first")
    return d.reshape(shape)


def unpack(flat, off, m, batch, shape, dtype):
    """The device array of shape ``(batch,) + shape`` (``shape`` when ``batch`` is None) of
    rows ``off:off + m`` of the flat (rows, batch) results."""
    B = 1 if batch is None else batch
    dst = cuda.device_array((B, m), dtype=dtype)
    if m and B:
        _unpack[_grid(B), THREADS](flat, off, dst)
    return dst.reshape(shape if batch is None else (batch,) + tuple(shape))


def _to_device(a):
    return a if is_device(a) else cuda.to_device(np.ascontiguousarray(a, dtype=np.float64))


def run(code, X, S, grad, reps=1):
    """Forward (and with ``grad`` the reverse sweep, ``reps`` seeds per sample, seeds in
    the columns of ``S``) of a batch whose inputs are the columns of ``X``.

    Returns (status on the host, outputs (nout, B), gradients (nin, B * reps) or None) with
    the results on the device."""
    rows, out_slots, in_slots = device_code(code)
    X = _to_device(X)
    n = code.rows.shape[0]
    nout, nin = len(code.out_slots), len(code.in_slots)
    B = X.shape[1]
    status = cuda.device_array(B, dtype=np.int64)
    outs = cuda.device_array((nout, B), dtype=np.float64)
    G = cuda.device_array((nin, B * reps), dtype=np.float64) if grad else None
    if B == 0:
        return np.zeros(0, dtype=np.int64), outs, G
    per_sample = 8 * max(n, 1) * (1 + (reps if grad else 0))
    chunk = max(1, min(B, CHUNK_BYTES // per_sample))
    V = cuda.device_array((n, chunk), dtype=np.float64)
    if grad:
        S = _to_device(S)
        A = cuda.device_array((n, chunk * reps), dtype=np.float64)
    for b0 in range(0, B, chunk):
        _forward[_grid(chunk), THREADS](rows, X, V, out_slots, outs, status, b0)
        if grad:
            _reverse[_grid(chunk * reps), THREADS](rows, V, A, S, out_slots, in_slots, G,
                                                   reps, b0 * reps, B * reps, status)
    return status.copy_to_host(), outs, G


def jacobian(code, X):
    """(status, outputs (nout, B), G (nin, B * nout)) with ``G[j, b * nout + i]`` the
    derivative of output ``i`` in input ``j`` at sample ``b``."""
    m = len(code.out_slots)
    B = X.shape[1]
    S = cuda.device_array((m, B * m), dtype=np.float64)
    if B * m:
        _identity_seeds[_grid(B * m), THREADS](S, m)
    return run(code, X, S, True, reps=max(m, 1))


def jacobian_block(G, m, i0, j0, rows, cols, batch, dtype=np.float64):
    """Block (outputs ``i0:i0+rows``, inputs ``j0:j0+cols``) of ``jacobian``'s ``G`` as a
    device array of shape (batch, rows, cols)."""
    dst = cuda.device_array((batch, rows, cols), dtype=dtype)
    if batch and rows and cols:
        _unpack_jacobian[_grid(batch), THREADS](G, m, i0, j0, dst)
    return dst


def to_device(a):
    return cuda.to_device(np.ascontiguousarray(a))
