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
they were. From the repository root::

    python bench/threads_concurrent.py [--reps 300] [case substrings ...]
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

import threads_passes  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=300, help="calls per thread count")
    p.add_argument("only", nargs="*", help="cases whose name holds one of these")
    args = p.parse_args()
    own = [0]
    real = K.help_out

    def help_out(ctl):  # the caller's chunks of a compiled pass (the workers ran the rest)
        own[0] = real(ctl)
        return own[0]
    K.help_out = help_out
    pool, before = T._pool, tg.get_num_threads()
    print(f"{args.reps} calls per thread count, in turn; medians of the calls whose threads "
          "stayed on their cores (kept/all)")
    for name, f in threads_passes._cases().items():
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
                own[0] = -1
                c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                f()
                wall, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
                wcpu = sum(T._cpu_ns(w) for w in ws) - w0
                if cpu < 0.9 * wall or th > 1 and wcpu < 0.9 * wall:
                    continue
                # and, on two threads, the worker ran a chunk (a compiled pass: the caller
                # ran fewer than all; a NumPy pass: the worker's count of Python chunks moved)
                m = int(pool.ctl[K.CLAIM] >> K.IDX_BITS & K.IDX_MASK)
                if th > 1 and not (0 <= own[0] < m or sum(w.chunks for w in ws) > ch0):
                    continue
                kept[th].append((wall, cpu, wcpu))
        m = {th: statistics.median([k[0] for k in kept[th]]) if kept[th] else float("nan")
             for th in (1, 2)}
        c2 = statistics.median([k[1] for k in kept[2]]) if kept[2] else float("nan")
        w2 = statistics.median([k[2] for k in kept[2]]) if kept[2] else float("nan")
        print(f"{name:28s} 1T {m[1] / 1e3:8.1f} us ({len(kept[1])}/{args.reps})  2T "
              f"{m[2] / 1e3:8.1f} us ({len(kept[2])}/{args.reps}; CPU caller {c2 / 1e3:.1f}, "
              f"worker {w2 / 1e3:.1f})  2T / 1T {m[2] / m[1]:.2f}", flush=True)
    K.help_out = real
    tg.set_num_threads(before)


if __name__ == "__main__":
    main()
