"""What two threads give on this machine, without tapegrad (issue 17's goal of 1.7x for
``target="parallel"``): a plain compiled loop that lets the GIL go, run on 1 thread and on 2
threads at once (each the same work), in turn, with the wall time and the CPU time (the
process's, both threads) of each round and the load average before it. From the repository
root::

    python bench/nogil_scaling.py [--rounds 40] [--mb 1.8]

Two loops: ``memory`` sweeps a private buffer of ``--mb`` megabytes (1.8: a parallel block's
values and adjoints, 892 rows x 128 samples x 2 x 8 bytes) as the batch interpreter does,
``registers`` a chain of arithmetic in registers. A ratio wall(2 threads) / wall(1 thread)
of 1.0 is perfect scaling (both threads' work in the time of one), 2.0 none; the CPU ratio
CPU(2) / (2 CPU(1)) above 1 says the threads slowed each other (shared caches, or a vCPU
that is a hyperthread of the other's core). A machine others load takes cores from the
threads: the CPU seconds a second the process got with 1 and with 2 threads say how many
cores it had (2 threads that get no more than 1 thread did cannot be faster), and the CPU
ratio what the hardware gives where the cores are there."""
import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.getcwd())

from tapegrad._jit import njit_cached  # noqa: E402


@njit_cached(nogil=True)
def _memory(buf, reps):
    for _ in range(reps):
        for i in range(buf.shape[0]):
            buf[i] = buf[i] * 0.999 + 1.0
    return buf[0]


@njit_cached(nogil=True)
def _registers(x, reps):
    a, b = x, x + 1.0
    for _ in range(reps):
        for _ in range(1000):
            a = a * 0.999 + b
            b = b * 0.999 - a * 1e-3
    return a + b


def _delay():
    """This thread's time spent runnable but waiting for a core (Linux schedstat, in
    seconds; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except OSError:
        return 0.0


def _round(fn, args, threads):
    """(wall, process CPU, the threads' time waiting for a core) of ``threads`` threads
    each calling ``fn(*args(i))``."""
    go = threading.Barrier(threads + 1)
    waits = []

    def run(i):
        go.wait()
        d = _delay()
        fn(*args(i))
        waits.append(_delay() - d)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    c0 = time.process_time()
    go.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0, time.process_time() - c0, sum(waits)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--mb", type=float, default=1.8)
    a = p.parse_args()
    n = int(a.mb * 1e6 / 8)
    bufs = [np.ones(n) for _ in range(2)]
    # each call about 20 ms on one thread: far above a thread's start
    mem_reps = max(1, int(2e7 / n))
    cases = {"memory": (_memory, lambda i: (bufs[i], mem_reps)),
             "registers": (_registers, lambda i: (1.0 + i, 2000))}
    for fn, args in cases.values():
        fn(*args(0))  # (compiled or loaded)
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at the start")
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            print(f"autogroup scheduling {'on' if f.read().strip() == '1' else 'off'} (on: "
                  f"each session's processes share one fair share of the CPUs)")
    except OSError:
        pass
    for name, (fn, args) in cases.items():
        rows = []
        for _ in range(a.rounds):
            w1, c1, d1 = _round(fn, args, 1)
            w2, c2, d2 = _round(fn, args, 2)
            rows.append((w2 / w1, c2 / (2 * c1), c1 / w1, c2 / w2))
        r = np.array(rows)
        print(f"{name}: wall(2)/wall(1) median {np.median(r[:, 0]):.2f} (speed-up "
              f"{2 / np.median(r[:, 0]):.2f}x), best {np.min(r[:, 0]):.2f}; CPU(2)/2CPU(1) "
              f"{np.median(r[:, 1]):.2f}; the cores the process got (CPU seconds a "
              f"second): 1 thread {np.median(r[:, 2]):.2f} (at most {np.max(r[:, 2]):.2f}), "
              f"2 threads {np.median(r[:, 3]):.2f} (at most {np.max(r[:, 3]):.2f})")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")

if __name__ == "__main__":
    main()
