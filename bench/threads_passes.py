"""Intra-op threads, pass by pass: each threaded pass of gmm's gradient and the whole
evaluation on 1 and on 2 threads, called in turn (``tapegrad.set_num_threads``), with the
median and 10th percentile wall time and the CPU time per call. On a machine other
processes load, a woken thread waits for a core: the CPU time and the low percentile say
what the threads cost and save there. Run from the repository root::

    python bench/threads_passes.py [repetitions]
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())

import tapegrad as tg  # noqa: E402
from tapegrad.ops import _kernels as K  # noqa: E402


def _or(r, f, *args):
    return f(*args) if r is None else r


def _cases():
    rng = np.random.default_rng(0)
    k, d, n = 25, 10, 1000
    P, mu = rng.normal(size=(1, d, n)), rng.normal(size=(k, d, 1))
    x, Q = rng.normal(size=(k, d, n)), rng.normal(size=(k, d, d))
    g = np.broadcast_to(rng.normal(size=(k, 1, n)), (k, d, n))
    from tapegrad.bench.cases import gradbench_input
    from tapegrad.bench.gradbench import gmm
    run, _ = gmm.prepare("jacobian", gradbench_input("gmm"), tg, False)
    return {
        "x - mu (rows_op, forward)": lambda: K.rows_op(K.SUB, P, mu),
        "Q @ xc (forward)": lambda: K.matmul(Q, x),
        "sum over d (sum_middle)": lambda: K.sum_middle(x, 1, False),
        "g*x + g*x (rows_op MUL2)": lambda: K.rows_op(K.MUL2, g, x),
        "g @ xc^T (backward)": lambda: K.matmul(x, x.transpose(0, 2, 1)),
        # (declined on one thread: NumPy's one call, as the callers make it)
        "sum over n (sum_last)": lambda: _or(K.sum_last(x, True), np.sum, x, -1, None, None,
                                             True),
        "x + x (par_ufunc)": lambda: _or(K.par_ufunc(np.add, x, x), np.add, x, x),
        "gmm jacobian, whole": run,
    }


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    before = tg.get_num_threads()
    print(f"{reps} calls per thread count, in turn; wall median / 10th percentile, CPU per call")
    for name, f in _cases().items():
        wall, cpu = {1: [], 2: []}, {1: 0.0, 2: 0.0}
        for th in (1, 2):
            tg.set_num_threads(th)
            f(), f()
        for _ in range(reps):
            for th in (1, 2):
                tg.set_num_threads(th)
                c0, t0 = time.process_time(), time.perf_counter()
                f()
                wall[th].append(time.perf_counter() - t0)
                cpu[th] += time.process_time() - c0
        print(f"{name:28s}" + "   ".join(
            f"{th}T {np.median(wall[th]) * 1e6:7.1f} / {np.percentile(wall[th], 10) * 1e6:7.1f}"
            f" cpu {cpu[th] / reps * 1e6:7.1f} us" for th in (1, 2)))
    tg.set_num_threads(before)


if __name__ == "__main__":
    main()
