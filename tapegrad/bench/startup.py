"""Seconds from ``import tapegrad`` to a first gradient, each run in a fresh process (warm
or cold Numba cache), and, with a cold cache, from a trace to its first replayed
``value_and_grad`` (one input, a batch, ``target="parallel"``)."""

from __future__ import annotations

import shutil
import tempfile


from .common import _child_env, _run_child_json

IMPORT_WARM_TARGET_S = 1.0
IMPORT_COLD_TARGET_S = 15.0

_FIRST_GRAD_CHILD = """\
import time
t0 = time.perf_counter()
import tapegrad
t1 = time.perf_counter()
x = tapegrad.tensor(0.5, requires_grad=True)
y = x * x + tapegrad.sin(x)
(g,) = tapegrad.autograd.grad(y, (x,))
value = g.item()
t2 = time.perf_counter()
import json, math
expected = 2 * 0.5 + math.cos(0.5)
if abs(value - expected) > 1e-12 * abs(expected):
    raise SystemExit(f"wrong first gradient: {value!r}, expected {expected!r}")
print(json.dumps({"import_s": t1 - t0, "first_grad_s": t2 - t1, "total_s": t2 - t0}))
"""


def first_grad_in_fresh_process(numba_cache_dir: str | None = None) -> dict:
    """Run ``import tapegrad`` and a first gradient in a new process; its own timings.

    Returns ``{"import_s", "first_grad_s", "total_s"}``, timed inside the
    child from just before ``import tapegrad`` (interpreter start-up is not
    counted). ``numba_cache_dir`` sets ``NUMBA_CACHE_DIR`` for the child.
    """
    extra = {"NUMBA_CACHE_DIR": numba_cache_dir} if numba_cache_dir is not None else None
    return _run_child_json(_FIRST_GRAD_CHILD, env=_child_env(extra))


def import_to_first_grad(cold: bool, repeats: int = 1) -> list[dict]:
    """Seconds from ``import tapegrad`` to the first gradient of x*x + sin(x), each in a fresh process.

    ``cold=False``: the default Numba cache, warmed by one unmeasured run
    first. ``cold=True``: ``NUMBA_CACHE_DIR`` points at a new empty directory
    for every run, so everything Numba compiles is compiled again (Python's
    own bytecode cache stays warm).
    """
    if not cold:
        first_grad_in_fresh_process()
        return [first_grad_in_fresh_process() for _ in range(repeats)]
    results = []
    for _ in range(repeats):
        cache_dir = tempfile.mkdtemp(prefix="tapegrad-cold-numba-cache-")
        try:
            results.append(first_grad_in_fresh_process(cache_dir))
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return results


#: issue 17's goal 5: with empty caches, trace plus the first ``value_and_grad`` under 3 s,
#: the first batched or parallel call under 5 s: name -> (target seconds, batch, target)
REPLAY_COLD_CASES = {
    "replay_cold_trace_first_value_and_grad": (3.0, None, "cpu"),
    "replay_cold_trace_first_batch300": (5.0, 300, "cpu"),
    "replay_cold_trace_first_parallel3000": (5.0, 3000, "parallel"),
}

_REPLAY_CHILD = """\
import json, time
import numpy as np
t0 = time.perf_counter()
import tapegrad
t1, c1 = time.perf_counter(), time.process_time()
def f(x):
    return sum(100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2 for i in range(9))
P = tapegrad.trace(f, np.full(10, 0.5), target={target!r})
X = np.linspace(-1.0, 1.0, 10) if {batch!r} is None else \\
    np.random.default_rng(0).uniform(-1.0, 1.0, ({batch!r}, 10))
value, grad = P.value_and_grad(X)
t2, c2 = time.perf_counter(), time.process_time()
x = np.atleast_2d(X)
want = np.zeros_like(x)
d = x[:, 1:] - x[:, :-1] ** 2
want[:, :-1] = -400.0 * x[:, :-1] * d - 2.0 * (1.0 - x[:, :-1])
want[:, 1:] += 200.0 * d
if not np.allclose(np.atleast_2d(grad), want, rtol=1e-12, atol=1e-12):
    raise SystemExit("wrong first replayed gradient")
print(json.dumps({{"import_s": t1 - t0, "first_call_s": t2 - t1, "total_s": t2 - t0,
                  "first_call_cpu_s": c2 - c1}}))
"""


def replay_cold_first_call(name: str) -> dict:
    """Trace of a 10-term scalar Rosenbrock plus its first ``value_and_grad`` (case ``name``
    of ``REPLAY_COLD_CASES``) in a fresh process whose ``NUMBA_CACHE_DIR`` is a new empty
    directory: ``{"import_s", "first_call_s", "total_s", "first_call_cpu_s"}`` timed inside
    the child (the CPU time of all its threads: compiling is CPU-bound, so on a shared
    machine this is the load-independent measure)."""
    _, batch, target = REPLAY_COLD_CASES[name]
    cache_dir = tempfile.mkdtemp(prefix="tapegrad-cold-numba-cache-")
    try:
        return _run_child_json(_REPLAY_CHILD.format(batch=batch, target=target),
                               env=_child_env({"NUMBA_CACHE_DIR": cache_dir}))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
