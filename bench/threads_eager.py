"""Whether tapegrad's intra-op threads pay on whole evaluations: gmm's gradient and kmeans'
Newton direction, eager (the benchmark suite's GradBench cases), on tapegrad with
``set_num_threads(1)``, with ``set_num_threads(2)`` and on torch with its default threads,
called in turn in one process (each round runs the three in a rotating order, each as a
burst of ``--burst`` calls back to back, the first not timed, as in a loop; between bursts
a pause lets tapegrad's workers, which spin ``ROUSE_S`` after a split pass, go to sleep
before torch or the other thread count runs), with the median wall time of each and
torch's time over tapegrad's (above 1: tapegrad faster).
For the two-thread calls it counts tapegrad's split passes (``_threads.run_compiled``),
those a worker took a chunk of, those run alone in a back-off, and the calls whose
threads both stayed on their cores throughout (the calling thread's and the workers' CPU
clocks each 90% of the call's wall time or more, as ``bench/threads_concurrent.py``), with
their median: on an idle machine nearly every call should count. Run it on an idle
machine to decide the default (``tapegrad._threads.DEFAULT_THREADS``). From the repository
root::

    python bench/threads_eager.py [--reps 200] [--burst 5] [gmm] [kmeans]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import tapegrad as tg  # noqa: E402
from tapegrad import _threads as T  # noqa: E402
from tapegrad.bench.cases import gradbench_input  # noqa: E402

CASES = {"gmm": "jacobian", "kmeans": "dir"}


def _runs(name):
    import importlib

    import torch
    mod = importlib.import_module(f"tapegrad.bench.gradbench.{name}")
    ours, _ = mod.prepare(CASES[name], gradbench_input(name), tg, False)
    theirs, _ = mod.prepare(CASES[name], gradbench_input(name), torch, False)
    return ours, theirs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=200, help="calls of each, in turn")
    p.add_argument("--burst", type=int, default=5, help="calls back to back (first untimed)")
    p.add_argument("only", nargs="*", help="gmm, kmeans (default both)")
    args = p.parse_args()
    import torch
    before = tg.get_num_threads()
    print(f"{args.reps} calls of each in turn; torch {torch.__version__} on "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} cores; load "
          f"{os.getloadavg()[0]:.1f}")
    for name in args.only or list(CASES):
        ours, theirs = _runs(name)
        for th in (1, 2):  # warm: compiled, cached, the workers started
            tg.set_num_threads(th)
            for _ in range(3):
                ours()
        for _ in range(3):
            theirs()
        walls = {"1": [], "2": [], "torch": []}
        both = []  # two-thread calls whose threads all stayed on their cores
        c0 = dict(T.counts)
        order = ["1", "2", "torch"]
        timed = 0
        for r in range(-(-args.reps // max(1, args.burst - 1))):
            for who in order[r % 3:] + order[:r % 3]:
                time.sleep(T.ROUSE_S + 0.003)  # (the workers asleep: nothing spins now)
                if who == "torch":
                    theirs()
                    for _ in range(args.burst - 1):
                        t0 = time.perf_counter_ns()
                        theirs()
                        walls[who].append(time.perf_counter_ns() - t0)
                    continue
                tg.set_num_threads(int(who))
                ours()
                for _ in range(args.burst - 1):
                    ws = list(T._pool.workers[:int(who) - 1])
                    w0 = [T._cpu_ns(w) for w in ws]
                    cpu0, t0 = time.thread_time_ns(), time.perf_counter_ns()
                    ours()
                    wall = time.perf_counter_ns() - t0
                    walls[who].append(wall)
                    cpu = time.thread_time_ns() - cpu0
                    timed += who == "2"
                    if who == "2" and cpu >= 0.9 * wall and ws and all(
                            T._cpu_ns(w) - a >= 0.9 * wall for w, a in zip(ws, w0)):
                        both.append(wall)
        tg.set_num_threads(before)
        med = {k: statistics.median(v) / 1e3 for k, v in walls.items()}
        d = {k: T.counts[k] - c0[k] for k in ("passes_split", "passes_shared", "passes_alone")}
        per = max(1, timed)  # (the counts include each burst's untimed first call)
        print(f"{name} {CASES[name]}: tapegrad 1 thread {med['1']:8.1f} us, 2 threads "
              f"{med['2']:8.1f} us, torch {med['torch']:8.1f} us; torch / tapegrad: "
              f"{med['torch'] / med['1']:.3f}x on 1 thread, {med['torch'] / med['2']:.3f}x on "
              f"2; 2 threads / 1: {med['2'] / med['1']:.3f}")
        print(f"  2 threads, per call: {d['passes_split'] / per:.1f} passes split, "
              f"{d['passes_shared'] / per:.1f} of them with a worker's chunk, "
              f"{d['passes_alone'] / per:.1f} run alone (back-off); calls with both threads "
              f"on their cores: {len(both)}/{per}" + (
                  f", median {statistics.median(both) / 1e3:.1f} us" if both else ""),
              flush=True)


if __name__ == "__main__":
    main()
