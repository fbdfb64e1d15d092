"""A batch with the three-row chains against the same batch with pairs only, and 256 single
calls, taking turns in one process, by CPU time (issue 17 goal 3a): run from a repo root,
``python bench/batch_chains_ab.py [n ...]`` (n=100 and 1000 by default).

Prints per input, in microseconds, the medians of 15 turns: the batch of 256 with chains
(as shipped), with pairs only (``fuse.CHAINS`` empty while its rows form), and the single
calls (fused: past their tier-up), and the ratios."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())

import tapegrad as tg  # noqa: E402
from tapegrad.interpreters import fuse, replay_cpu  # noqa: E402

B = 256
CHAINS = fuse.CHAINS


def rosen(x):
    s = 0.0
    for i in range(x.shape[0] - 1):
        s = s + 100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
    return s


def form(chains):
    """The batch's rows from the next call on: with the chains or pairs only."""
    fuse.CHAINS = CHAINS if chains else ()
    replay_cpu._last_form = (None,) * 4


def main(sizes):
    for n in sizes:
        P = tg.trace(rosen, np.linspace(-1, 1, n))
        X = np.random.default_rng(0).normal(size=(B, n))
        for x in X[:100]:  # (past the single calls' tier-up, with the chains)
            P.value_and_grad(x)
        reps = 20 if n <= 100 else 5
        t = {"chains": [], "pairs": [], "single": []}
        for turn in range(15):
            for chains in ((False, True) if turn % 2 else (True, False)):
                form(chains)
                P.value_and_grad(X)  # (the rows the form runs, once)
                t0 = time.thread_time()
                for _ in range(reps):
                    P.value_and_grad(X)
                t["chains" if chains else "pairs"].append((time.thread_time() - t0) / reps / B)
            t0 = time.thread_time()
            for x in X:
                P.value_and_grad(x)
            t["single"].append((time.thread_time() - t0) / B)
        form(True)
        m = {k: np.median(v) * 1e6 for k, v in t.items()}
        print(f"n={n}: per input (us, CPU): batch with chains {m['chains']:.3f}, pairs only "
              f"{m['pairs']:.3f}, single calls {m['single']:.3f}; pairs / chains "
              f"{m['pairs'] / m['chains']:.3f}x, single / chains {m['single'] / m['chains']:.2f}x, "
              f"single / pairs {m['single'] / m['pairs']:.2f}x; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [100, 1000])
