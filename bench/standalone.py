"""The vectorized Rosenbrock step, each library alone in a fresh process.

``python -m tapegrad.bench`` runs tapegrad and torch in one process, where importing
torch changes how glibc hands out memory (see the README's "Memory allocator"). This
script measures each library without the other: median time per step (forward and
gradient) and minor page faults per step, for tapegrad with and without its allocator
tuning, and for torch. Run from the repository root::

    python bench/standalone.py            # n = 100000
    python bench/standalone.py 1000 100000
"""
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import numpy as np
lib, n = sys.argv[1], int(sys.argv[2])
if lib == "torch":
    import torch as M
else:
    import tapegrad as M
from tapegrad.bench.cases import rosenbrock_vec
x = M.tensor(np.linspace(-1, 1, n), dtype=M.float64, requires_grad=True)
def step():
    return M.autograd.grad(rosenbrock_vec(x), (x,))
for _ in range(50):
    step()
reps = max(20, int(2e7 // n))
times = []
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(15):
    t0 = time.perf_counter()
    for _ in range(reps // 15 + 1):
        step()
    times.append((time.perf_counter() - t0) / (reps // 15 + 1))
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / (15 * (reps // 15 + 1))
print(json.dumps({"s": sorted(times)[len(times) // 2], "faults": faults}))
"""

RUNS = [("tapegrad", {}), ("tapegrad", {"TAPEGRAD_MALLOC_TUNING": "0"}), ("torch", {})]


def measure(lib, n, env):
    out = subprocess.run([sys.executable, "-c", CHILD, lib, str(n)], capture_output=True,
                         text=True, env={**os.environ, **env}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
    sizes = [int(a) for a in argv] or [100000]
    print(f"{'n':>8}  {'library':<34} {'time/step':>10}  {'faults/step':>11}")
    for n in sizes:
        for lib, env in RUNS:
            if lib == "torch":
                try:
                    import torch  # noqa: F401
                except ImportError:
                    continue
            r = measure(lib, n, env)
            name = lib + (" (TAPEGRAD_MALLOC_TUNING=0)" if env else "")
            print(f"{n:>8}  {name:<34} {r['s'] * 1e6:>8.0f}us  {r['faults']:>11.0f}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
