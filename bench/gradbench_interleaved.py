"""GradBench's eager evals, tapegrad and torch called in turn on the same prepared input.

``python -m tapegrad.bench`` runs each library for a turn of many iterations; on a machine
other processes load, torch's thread pool and the turns' timing swing the ratios. Here each
iteration of one library is followed by one of the other (the same ``prepare()`` of the
eval module, the suite's seeded input), torch and tapegrad on ``--threads`` threads (1: as
GradBench runs tools), and the medians of all iterations are compared. Run from the
repository root::

    python bench/gradbench_interleaved.py                      # gmm, lse, kmeans, lstm
    python bench/gradbench_interleaved.py kmeans --seconds 10 --threads 2
"""
import argparse
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

FUNCTIONS = {"gmm": "jacobian", "lse": "gradient", "kmeans": "dir", "lstm": "jacobian",
             "ba": "jacobian", "llsq": "gradient", "ode": "gradient", "det": "gradient"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("evals", nargs="*", default=["gmm", "lse", "kmeans", "lstm"])
    p.add_argument("--seconds", type=float, default=5.0, help="per eval (default 5)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch's and tapegrad's threads (default 1)")
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    import tapegrad
    tapegrad.set_num_threads(args.threads)
    from tapegrad.bench.cases import gradbench_input, load_library
    print(f"torch {torch.__version__} on {args.threads} thread(s); medians per iteration")
    for name in args.evals:
        mod = importlib.import_module(f"tapegrad.bench.gradbench.{name}")
        inp = gradbench_input(name)
        runs = {lib: mod.prepare(FUNCTIONS[name], inp, load_library(lib), False)[0]
                for lib in ("tapegrad", "torch")}
        for run in runs.values():  # compile, warm up
            for _ in range(3):
                run()
        times = {lib: [] for lib in runs}
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            for lib, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[lib].append(time.perf_counter() - t0)
        t, o = (statistics.median(times[lib]) for lib in ("tapegrad", "torch"))
        print(f"{name:8s} tapegrad {t * 1e6:10.1f} us  torch {o * 1e6:10.1f} us  "
              f"torch / tapegrad {o / t:.2f}x  ({len(times['torch'])} iterations each)")


if __name__ == "__main__":
    main()
