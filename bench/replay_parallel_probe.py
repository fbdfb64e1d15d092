"""Where target="parallel" spends a batch (issue 17): run from a repo root on an idle machine,
``python bench/replay_parallel_probe.py [n] [B]`` (n=100, B=256 by default).

Prints: the load, the serial and parallel batch's wall-clock medians (the serial one's CPU
time too); parallel batches back to back, the workers' blocks compiled and through Python,
with both sides' CPU time a call (compiled: the caller's blocks' CPU time, and how long it
waited at their end for the workers' blocks, ``wait_ns``: the threads' imbalance, with
the blocks each side ran and the worker's sleeps); how far behind the calling
thread a worker starts its first block, and each side's block time; and what the hardware
gives, two threads each running the whole batch's blocks at once against one (memory
bandwidth and shared caches: 1.0 is perfect scaling)."""
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.getcwd())

import tapegrad as tg  # noqa: E402
from tapegrad.interpreters import replay_cpu as R  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
B = int(sys.argv[2]) if len(sys.argv) > 2 else 256


def rosen(x):
    s = 0.0
    for i in range(n - 1):
        s = s + 100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
    return s


R.ADAPT = False  # every batch on the threads, even where they do not pay (a busy machine)
print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
prog = tg.trace(lambda x: rosen([x[i] for i in range(n)]), np.zeros(n))
par = prog.to("parallel")
X = np.random.default_rng(0).uniform(-1.5, 1.5, (B, n))


def median_us(f, k=300, clock=time.perf_counter):
    for _ in range(20):
        f()
    ts = []
    for _ in range(k):
        t0 = clock()
        f()
        ts.append(clock() - t0)
    return np.median(ts) * 1e6


def in_turn(fs, k=400):
    """Median wall time of each of ``fs``, called in turn (a load that moves moves both),
    and its 10th percentile."""
    ts = [[] for _ in fs]
    for r in range(k + 20):
        for f, t in zip(fs, ts):
            t0 = time.perf_counter()
            f()
            if r >= 20:
                t.append(time.perf_counter() - t0)
    return [(np.median(t) * 1e6, np.percentile(t, 10) * 1e6) for t in ts]


before = tg._threads.stats()
(s, s10), (p, p10) = in_turn([lambda: prog.value_and_grad(X), lambda: par.value_and_grad(X)])
after = tg._threads.stats()
print("what the threads did (counts, _threads.stats):",
      {k: after[k] - before[k] for k in tg._threads.counts if after[k] != before[k]})
c = median_us(lambda: prog.value_and_grad(X), clock=time.thread_time)
print(f"{len(prog)} rows, {B} samples, block {prog.block}: serial {s:.0f} us (CPU {c:.0f}), "
      f"parallel {p:.0f} us, {s / p:.2f}x (in turn; 10th percentiles {s10:.0f} and {p10:.0f} "
      f"us, {s10 / p10:.2f}x)")


def back_to_back(compiled, k=300):
    """Parallel batches called back to back (the workers' blocks compiled, or through
    Python): wall time a call (median), the caller's and the workers' CPU time a call
    (thread clocks: what a batch cost, whatever the load), and what the threads did."""
    R.COMPILED = compiled
    for _ in range(20):
        par.value_and_grad(X)
    s0, walls, cpu, blocks = tg._threads.stats(), [], 0.0, 0
    for _ in range(k):
        t0, c0 = time.perf_counter(), time.thread_time()
        par.value_and_grad(X)
        walls.append(time.perf_counter() - t0)
        cpu += time.thread_time() - c0
        blocks += int(R._times[2]) if compiled else 0
    s1 = tg._threads.stats()
    d = {c: s1[c] - s0[c] for c in ("batches_missed", "chunks_workers", "woken",
                                     "lag_workers", "lag_ns", "wait_ns", "chunks_caller",
                                     "worker_sleeps")}
    lag = f", lag {d['lag_ns'] / d['lag_workers'] / 1e3:.1f} us" if d["lag_workers"] else ""
    if compiled:  # (the caller's blocks and wait: _atomic.run_caller's clock reads)
        lag += (f"; caller's blocks' CPU {blocks / k / 1e3:.0f} us a call, its wait for the "
                f"workers' blocks {d['wait_ns'] / k / 1e3:.1f} us a call; blocks: caller "
                f"{d['chunks_caller']}, workers {d['chunks_workers']}; worker sleeps "
                f"{d['worker_sleeps']}")
    print(f"back to back, workers' blocks {'compiled' if compiled else 'through Python'}: "
          f"{np.median(walls) * 1e6:.0f} us ({s / (np.median(walls) * 1e6):.2f}x the serial median), "
          f"CPU a call: caller {cpu / k * 1e6:.0f} us, workers "
          f"{(s1['worker_cpu_ns'] - s0['worker_cpu_ns']) / k / 1e3:.0f} us; {k} batches, "
          f"{d['batches_missed']} with no worker block, worker blocks {d['chunks_workers']}, "
          f"woken {d['woken']}{lag}")


back_to_back(True)
back_to_back(False)
R.COMPILED = False  # (below: the spy sees the workers' blocks only through Python)

real, log = R.run_block, []


def spy(*a):
    t0 = time.perf_counter()
    real(*a)
    log.append((threading.get_ident(), t0, time.perf_counter()))


R.run_block = spy
lags, mine, other = [], [], []
for _ in range(200):
    log.clear()
    par.value_and_grad(X)
    me = threading.get_ident()
    m = [e for e in log if e[0] == me]
    o = [e for e in log if e[0] != me]
    mine.append(sum(e[2] - e[1] for e in m))
    other.append(sum(e[2] - e[1] for e in o))
    if o:
        lags.append(min(e[1] for e in o) - min(e[1] for e in m))
R.run_block = real
print(f"a worker ran blocks in {len(lags)}/200 calls, starting {np.median(lags) * 1e6:.1f} us "
      f"after the caller (median); block time a call: caller {np.median(mine) * 1e6:.0f} us, "
      f"workers {np.median(other) * 1e6:.0f} us")

code, S = prog._code, np.ones((B, 1))


def whole(out, i):
    W = (np.empty(len(prog) * prog.block), np.empty(len(prog) * prog.block))
    st, o, G = R._outputs(X, code.out_slots, code.in_slots, True)
    t0 = time.perf_counter()
    for _ in range(50):
        for b0 in range(0, B, prog.block):
            real(code.rows, X, code.out_slots, S, code.in_slots, True, st, o, G, b0,
                 min(B, b0 + prog.block), *W, R._NO_SIGNAL, 0)
    out[i] = time.perf_counter() - t0


walls = {}
for threads in (1, 2, 1, 2):
    out = {}
    ts = [threading.Thread(target=whole, args=(out, i)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    walls[threads] = min(walls.get(threads, 1e9), max(out.values()))
print(f"hardware: 2 threads each running the batch take {walls[2] / walls[1]:.2f}x the time "
      f"of one")
