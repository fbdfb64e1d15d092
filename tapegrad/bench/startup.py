"""Seconds from ``import tapegrad`` to a first gradient, each run in a fresh process (warm
or cold Numba cache)."""

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
