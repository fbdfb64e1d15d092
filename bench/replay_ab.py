"""The generated replay interpreters of a git revision (default HEAD) against the work
tree's, compiled in one process and timed in turn on n=100 Rosenbrock's Hessian-vector
program (and its gradient program), after checking that both give the same bits.

    PYTHONPATH=$PWD python bench/replay_ab.py [REV [ROUNDS]]

Absolute times on a shared machine are noise: compare the two columns (min and median of
ROUNDS rounds of 200 calls each, wall time).
"""
import subprocess
import sys
import time
import types

import numba
import numpy as np

import tapegrad as tg
from tapegrad._program_derivs import _hvp_run
from tapegrad.bench.cases import _hvp_v, _rosenbrock_x0, rosenbrock_scalar
from tapegrad.interpreters import fuse, replay_cpu

GEN = "tapegrad/interpreters/_generated_replay.py"


def _njit(fn=None, **options):
    wrap = lambda f: numba.njit(**options)(f)  # noqa: E731 (uncached: a module of its own)
    return wrap if fn is None else wrap(fn)


def load(src, name):
    """The generated module's source as a module of its own, compiled without the cache."""
    src = src.replace("from .._jit import njit_cached", "")
    src = src.replace("from ._bound import", "from tapegrad.interpreters._bound import")
    src = src.replace("from . import _atomic", "from tapegrad.interpreters import _atomic")
    m = types.ModuleType(name)
    m.njit_cached = _njit
    exec(compile(src, name, "exec"), m.__dict__)
    return m


def main(rev="HEAD", rounds=40):
    old = load(subprocess.check_output(["git", "show", f"{rev}:{GEN}"], text=True), "old")
    new = load(open(GEN).read(), "new")
    n = 100
    x0 = _rosenbrock_x0(n)
    P = tg.trace(lambda x: rosenbrock_scalar([x[i] for i in range(n)]), x0)
    P.hvp((x0,), (_hvp_v(n),))
    h = _hvp_run(P._code)
    rows = h.rows
    X = np.concatenate([x0, _hvp_v(n)])
    work = replay_cpu.new_work(rows.shape[0], h.out_slots, h.in_slots, X.shape[0])
    o = replay_cpu.HEADER + 2 * len(h.out_slots) + len(h.in_slots)
    work[o:o + X.shape[0]] = X
    res = np.zeros(len(h.out_slots) + len(h.in_slots))
    vv, adj = np.zeros(rows.shape[0]), np.zeros(rows.shape[0])
    pc = P._code
    prows = pc.arows
    pfrows = fuse.fuse(prows, outs=pc.out_slots)
    pwork = replay_cpu.new_work(prows.shape[0], pc.out_slots, pc.in_slots, n)
    po = replay_cpu.HEADER + 2 * len(pc.out_slots) + len(pc.in_slots)
    pwork[po:po + n] = x0
    pres = np.zeros(1 + n)

    def cases(m):
        def rev():
            adj[:] = 0.0
            adj[-1] = 1.0
            m.reverse_common(rows, vv, adj)
        return {"forward_common": lambda: m.forward_common(rows, X, vv),
                "reverse_common": rev,
                "run_into_common": lambda: m.run_into_common(rows, work, res),
                "grad fused": lambda: m.run_fused_common(pfrows, pwork, pres),
                "grad as traced": lambda: m.run_into_common(prows, pwork, pres)}

    C = {"old": cases(old), "new": cases(new)}
    got = {}
    for tag, c in C.items():
        c["forward_common"]()
        c["reverse_common"]()
        r = [vv.copy(), adj.copy()]
        for k in ("run_into_common", "grad fused", "grad as traced"):
            c[k]()
            r.append((res if k == "run_into_common" else pres).copy())
        got[tag] = r
    for a, b in zip(got["old"], got["new"]):
        assert a.tobytes() == b.tobytes(), "the two revisions give other numbers"

    def one(f, reps=200):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - t) / reps * 1e6

    T = {(t, k): [] for t in C for k in C[t]}
    for _ in range(rounds):
        for k in C["old"]:
            for t in C:
                T[t, k].append(one(C[t][k]))
    print(f"Hessian-vector program {rows.shape[0]} rows, the program {prows.shape[0]} rows "
          f"(grad: its value_and_grad); the same bits ({rev} and the work tree)")
    for k in C["old"]:
        a, b = np.array(T["old", k]), np.array(T["new", k])
        print(f"{k:16s} {rev}: min {a.min():6.2f} med {np.median(a):6.2f} us | work tree: "
              f"min {b.min():6.2f} med {np.median(b):6.2f} us | ratio {b.min() / a.min():.2f}")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["HEAD"]), *(int(a) for a in sys.argv[2:3]))
