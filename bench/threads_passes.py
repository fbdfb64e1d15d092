"""Intra-op threads, pass by pass: each threaded pass of gmm's gradient and of kmeans'
Newton direction, and the whole evaluations, on 1 and on 2 threads, called in turn
(``tapegrad.set_num_threads``), with the median and 10th percentile wall time and the CPU
time per call (the process's: a worker's spin after its chunks counts). On a machine other
processes load, a woken thread waits for a core: the low percentile says what the threads
save where the core is there, and ``--idle`` keeps only the rounds (10 calls of each)
during which the machine's cores were idle at least 35% of the time (Linux: from
/proc/stat; on 2 cores, about one core free beside this process). From the repository
root::

    python bench/threads_passes.py [--reps 400] [--idle]
"""
import argparse
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
    x2 = rng.normal(size=(k, d, n))  # (x @ x^T itself: NumPy's syrk, another cost)
    g = np.broadcast_to(rng.normal(size=(k, 1, n)), (k, d, n))
    from tapegrad.bench.cases import gradbench_input
    from tapegrad.bench.gradbench import gmm, kmeans
    run, _ = gmm.prepare("jacobian", gradbench_input("gmm"), tg, False)
    run_k, _ = kmeans.prepare("dir", gradbench_input("kmeans"), tg, False)
    Pk, C = rng.normal(size=(1, 8, 1000)), rng.normal(size=(10, 8, 1))
    xk = rng.normal(size=(10, 8, 1000))
    gk = np.broadcast_to(rng.normal(size=(10, 1, 1000)), (10, 8, 1000))
    return {
        "x - mu (rows_op, forward)": lambda: K.rows_op(K.SUB, P, mu),
        "Q @ xc (forward)": lambda: K.matmul(Q, x),
        "sum over d (sum_middle)": lambda: K.sum_middle(x, 1, False),
        "g*x + g*x (rows_op MUL2)": lambda: K.rows_op(K.MUL2, g, x),
        "g @ xc^T (backward)": lambda: K.matmul(x, x2.transpose(0, 2, 1)),
        # (declined on one thread: NumPy's one call, as the callers make it)
        "sum over n (sum_last)": lambda: _or(K.sum_last(x, True), np.sum, x, -1, None, None,
                                             True),
        "x + x (par_ufunc)": lambda: _or(K.par_ufunc(np.add, x, x), np.add, x, x),
        "gmm jacobian, whole": run,
        "km P - C (rows_op)": lambda: K.rows_op(K.SUB, Pk, C),
        "km sum over d": lambda: K.sum_middle(xk, 1, False),
        "km g*diff (rows_op MUL)": lambda: K.rows_op(K.MUL, gk, xk),
        "kmeans dir, whole": run_k,
    }


def _idle():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return v[3], sum(v)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=400, help="calls per thread count")
    p.add_argument("--idle", action="store_true", help="keep the rounds of an idle machine")
    args = p.parse_args()
    before = tg.get_num_threads()
    print(f"{args.reps} calls per thread count, in turn; wall median / 10th percentile, CPU "
          "per call" + (" (rounds on an idle machine only)" if args.idle else ""))
    for name, f in _cases().items():
        wall, cpu, n = {1: [], 2: []}, {1: [], 2: []}, 0
        for th in (1, 2):
            tg.set_num_threads(th)
            f(), f()
        tries = 0
        while n < args.reps and tries < 50 * args.reps:
            i0, a0 = _idle()
            rw, rc = {1: [], 2: []}, {1: [], 2: []}
            for _ in range(10):
                for th in (1, 2):
                    tg.set_num_threads(th)
                    c0, t0 = time.process_time(), time.perf_counter()
                    f()
                    rw[th].append(time.perf_counter() - t0)
                    rc[th].append(time.process_time() - c0)
            i1, a1 = _idle()
            tries += 10
            if args.idle and (a1 == a0 or (i1 - i0) / (a1 - a0) < 0.35):
                continue
            for th in (1, 2):
                wall[th] += rw[th]
                cpu[th] += rc[th]
            n += 10
        if not n:
            print(f"{name:28s} no idle round")
            continue
        print(f"{name:26s}" + "  ".join(
            f"{th}T {np.median(wall[th]) * 1e6:7.1f} / {np.percentile(wall[th], 10) * 1e6:7.1f}"
            f" cpu {np.mean(cpu[th]) * 1e6:7.1f} us" for th in (1, 2)) + f"  ({n} calls)")
    tg.set_num_threads(before)


if __name__ == "__main__":
    main()
