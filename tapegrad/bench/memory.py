"""Memory per recorded op of the pendulum: tracemalloc in this process, RSS in a fresh one."""

from __future__ import annotations

import gc
import os
import tracemalloc


from .common import PENDULUM_PARAMS, PENDULUM_STEPS, _run_child_json, _scalar_leaves, load_library, pendulum_euler, pendulum_ops

MEMORY_TARGET_RATIO = 10.0  # torch bytes/op divided by tapegrad bytes/op must reach this


def tapegrad_tracemalloc_bytes_per_op(steps: int = PENDULUM_STEPS) -> dict:
    """Bytes that the recorded pendulum graph keeps alive, per op, by tracemalloc.

    Measures what is retained after the forward pass (the loss still alive,
    before backward). NumPy buffers are traced too. Run a forward + grad
    first so that one-time allocations (compiled kernels, caches) are not
    counted.
    """
    tg = load_library("tapegrad")
    params = _scalar_leaves(tg, PENDULUM_PARAMS)
    tg.autograd.grad(pendulum_euler(tg, *params, steps=10), params)
    gc.collect()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        gc.collect()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        loss = pendulum_euler(tg, *params, steps=steps)
        gc.collect()
        current, peak = tracemalloc.get_traced_memory()
        del loss
        gc.collect()
        after_free = tracemalloc.get_traced_memory()[0]
    finally:
        if not was_tracing:
            tracemalloc.stop()
    ops = pendulum_ops(steps)
    return {
        "method": "tracemalloc",
        "steps": steps,
        "ops": ops,
        "retained_bytes": current - base,
        "bytes_per_op": (current - base) / ops,
        "peak_bytes_per_op": (peak - base) / ops,
        "left_after_free_bytes": after_free - base,
    }


def _rss_bytes() -> int | None:
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as fh:
            resident_pages = int(fh.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def rss_probe(library: str, steps: int) -> dict:
    """In this process: RSS growth while a ``steps``-step pendulum graph is alive, per op.

    Meant to run in a fresh child process (see ``rss_bytes_per_op``), where
    freed memory of earlier work cannot hide the growth.
    """
    lib = load_library(library)
    params = _scalar_leaves(lib, PENDULUM_PARAMS)
    # one-time costs (lazy init, compiled kernels, allocator pools) first
    lib.autograd.grad(pendulum_euler(lib, *params, steps=1000), params)
    gc.collect()
    before = _rss_bytes()
    if before is None:
        return {"method": "rss", "library": library, "steps": steps, "bytes_per_op": None}
    loss = pendulum_euler(lib, *params, steps=steps)
    gc.collect()
    after = _rss_bytes()
    del loss
    ops = pendulum_ops(steps)
    return {
        "method": "psutil rss" if _has_psutil() else "/proc/self/statm rss",
        "library": library,
        "steps": steps,
        "ops": ops,
        "retained_bytes": after - before,
        "bytes_per_op": (after - before) / ops,
    }


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401  # type: ignore[import-not-found]
    except ImportError:
        return False
    return True


_RSS_CHILD = """\
import json, sys
from tapegrad.bench.memory import rss_probe
print(json.dumps(rss_probe(sys.argv[1], int(sys.argv[2]))))
"""


def rss_bytes_per_op(library: str, steps: int = 100_000) -> dict:
    """RSS growth per recorded op of a ``steps``-step pendulum, measured in a fresh process.

    This is the measure for torch, whose graph lives in C++ allocations that
    tracemalloc cannot see.
    """
    return _run_child_json(_RSS_CHILD, (library, steps))
