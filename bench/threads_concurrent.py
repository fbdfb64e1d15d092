"""Intra-op threads, pass by pass, measured where both threads ran at once: each threaded
pass of gmm's gradient and of kmeans' Newton direction (``bench/threads_passes.py``'s
cases) on 1 and on 2 threads, called in turn, keeping only the calls whose threads were on
their cores throughout, read from counters rather than from the machine's load: a
one-thread call counts where the calling thread's CPU time is 90% of its wall time or
more, a two-thread call where the caller's and the worker's CPU times both are (the
worker spins between chunks, so it counts CPU time whenever it is on its core; a worker
taken off its core, or a caller that was, is left out, and so is a two-thread call where
the worker ran no chunk). The ratio of the medians says what
the split saves where the cores are there; the share of the calls kept says how often
they were. ``--sizes`` measures instead the compiled passes of kmeans' shape (10, 8, n)
over a range of sizes, the split threshold (``_kernels.JOB_SPLIT_MIN``) lifted: where two
threads start to pay, the crossover the threshold is set from. From the repository root::

    python bench/threads_concurrent.py [--reps 300] [--sizes] [case substrings ...]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))

import tapegrad as tg  # noqa: E402
from tapegrad import _threads as T  # noqa: E402
from tapegrad.ops import _kernels as K  # noqa: E402

import numpy as np  # noqa: E402
import threads_passes  # noqa: E402


def _size_cases():
    """rows_op and sum_middle on kmeans' layout (10, 8, n), 40,000 to 320,000 numbers."""
    rng = np.random.default_rng(0)
    out = {}
    for n in (500, 1000, 1300, 1700, 2000, 3000, 4000):
        P, C = rng.normal(size=(1, 8, n)), rng.normal(size=(10, 8, 1))
        x = rng.normal(size=(10, 8, n))
        out[f"P - C {80 * n:7d}"] = lambda P=P, C=C: K.rows_op(K.SUB, P, C)
        out[f"sum d {80 * n:7d}"] = lambda x=x: K.sum_middle(x, 1, False)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=300, help="calls per thread count")
    p.add_argument("--sizes", action="store_true", help="the crossover: passes by size")
    p.add_argument("only", nargs="*", help="cases whose name holds one of these")
    args = p.parse_args()
    pool, before, split_min = T._pool, tg.get_num_threads(), K.JOB_SPLIT_MIN
    if args.sizes:
        K.JOB_SPLIT_MIN = 0
    print(f"{args.reps} calls per thread count, in turn; medians of the calls whose threads "
          "stayed on their cores (kept/all)")
    cases = _size_cases() if args.sizes else threads_passes._cases()
    for name, f in cases.items():
        if args.only and not any(o in name for o in args.only):
            continue
        for th in (1, 2):
            tg.set_num_threads(th)
            f(), f()
        kept = {1: [], 2: []}
        for _ in range(args.reps):
            for th in (1, 2):
                tg.set_num_threads(th)
                ws = list(pool.workers) if th > 1 else []
                w0, ch0 = sum(T._cpu_ns(w) for w in ws), sum(w.chunks for w in ws)
                T.last_pass[:] = [0, -1]  # (a compiled pass split: its chunks, the caller's)
                T._backoff[:] = [0, 0]  # (each pass tried on the threads: what a split costs)
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                f()
                wall, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
                wcpu = sum(T._cpu_ns(w) for w in ws) - w0
                if cpu < 0.9 * wall or th > 1 and wcpu < 0.9 * wall:
                    continue
                # and, on two threads, the worker ran a chunk (a compiled pass: the caller
                # ran fewer than all; a NumPy pass: the worker's count of Python chunks moved)
                m, own = T.last_pass
                if th > 1 and not (0 <= own < m or sum(w.chunks for w in ws) > ch0):
                    continue
                kept[th].append((wall, cpu, wcpu))
        m = {th: statistics.median([k[0] for k in kept[th]]) if kept[th] else float("nan")
             for th in (1, 2)}
        c2 = statistics.median([k[1] for k in kept[2]]) if kept[2] else float("nan")
        w2 = statistics.median([k[2] for k in kept[2]]) if kept[2] else float("nan")
        print(f"{name:28s} 1T {m[1] / 1e3:8.1f} us ({len(kept[1])}/{args.reps})  2T "
              f"{m[2] / 1e3:8.1f} us ({len(kept[2])}/{args.reps}; CPU caller {c2 / 1e3:.1f}, "
              f"worker {w2 / 1e3:.1f})  2T / 1T {m[2] / m[1]:.2f}", flush=True)
    K.JOB_SPLIT_MIN = split_min
    tg.set_num_threads(before)


if __name__ == "__main__":
    main()
