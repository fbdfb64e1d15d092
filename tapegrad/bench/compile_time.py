"""Time from a function to its first gradient by replay (trace + first call), and JAX's
``jit`` compile time of the same unrolled loop."""

from __future__ import annotations

import subprocess
import time

import numpy as np

from .common import PENDULUM_PARAMS, _run_child_json, pendulum_euler

TRACE_STEPS = (1_000, 10_000)
JAX_TIMEOUT_S = 300.0
JAX_MAX_STEPS = 1_000


def trace_compile_seconds(steps: int) -> dict:
    """tapegrad's time from a function to its first gradient by replay: trace the
    ``steps``-step pendulum, lower it to a program, and make the first (compiled, from
    Numba's cache) call."""
    import tapegrad as tg
    p = tg.tensor(np.asarray(PENDULUM_PARAMS))
    t0 = time.perf_counter()
    prog = tg.trace(lambda p: pendulum_euler(tg, p[0], p[1], p[2], p[3], steps=steps), p)
    t1 = time.perf_counter()
    prog.value_and_grad(p)
    t2 = time.perf_counter()
    return {"steps": steps, "trace_s": t1 - t0, "first_call_s": t2 - t1, "total_s": t2 - t0,
            "rows": len(prog)}


_JAX_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
from tapegrad.bench.common import pendulum_euler, PENDULUM_PARAMS
steps = int(sys.argv[1])

class lib:
    sin = staticmethod(jnp.sin)

f = lambda p: pendulum_euler(lib, p[0], p[1], p[2], p[3], steps=steps)
p = jnp.array(PENDULUM_PARAMS)
t0 = time.perf_counter()
compiled = jax.jit(jax.value_and_grad(f)).lower(p).compile()
t1 = time.perf_counter()
compiled(p)[1].block_until_ready()
print(json.dumps({"steps": steps, "compile_s": t1 - t0}))
"""


def jax_compile_seconds(steps: int, timeout: float = JAX_TIMEOUT_S) -> dict | None:
    """JAX's ``jit`` compile time of the same unrolled pendulum loop (value and gradient),
    in a fresh process; None without jax, ``{"timeout": s}`` when it takes longer."""
    try:
        import jax  # noqa: F401
    except ImportError:
        return None
    if steps > JAX_MAX_STEPS:  # XLA took 18 GB and over 5 minutes for 3,000 steps here
        return {"steps": steps, "skipped": f"not attempted above {JAX_MAX_STEPS} steps "
                                           f"(XLA's memory and time grow steeply)"}
    try:
        return _run_child_json(_JAX_CHILD, [str(steps)], timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"steps": steps, "timeout": timeout}
