"""What every benchmark family shares: the libraries, the functions being differentiated
(library-agnostic), their exact gradients in NumPy, timing and child-process helpers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np

LIBRARIES = ("tapegrad", "torch", "casadi", "tapegrad-loop")

# The directory that holds the ``tapegrad`` package, so that child processes
# import the same tapegrad as this one even when it is not installed.
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


# --------------------------------------------------------------------------
# libraries


def load_library(library: str):
    """Import and return the module for ``library`` ("tapegrad" or "torch").

    Raises ImportError when it is not installed.
    """
    if library in ("tapegrad", "tapegrad-loop"):  # tapegrad-loop: tapegrad as its own peer
        import tapegrad

        return tapegrad
    if library == "torch":
        import torch

        return torch
    if library == "casadi":
        import casadi

        return casadi
    raise ValueError(f"unknown library {library!r}; expected one of {LIBRARIES}")


def library_available(library: str) -> bool:
    """True when ``library`` can be imported."""
    try:
        load_library(library)
    except ImportError:
        return False
    return True


def library_version(library: str) -> str | None:
    """The library's ``__version__``, or None when it is not importable."""
    try:
        return str(getattr(load_library(library), "__version__", "unknown"))
    except ImportError:
        return None


def grads_to_numpy(grads) -> np.ndarray:
    """Flatten a tuple of gradient tensors (tapegrad or torch) into one float64 array."""
    parts = []
    for g in grads:
        if g is None:
            raise AssertionError("a gradient is None")
        parts.append(np.asarray(g.detach().numpy(), dtype=np.float64).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0)


def _scalar_leaves(lib, values):
    return [lib.tensor(float(v), dtype=lib.float64, requires_grad=True) for v in values]


# --------------------------------------------------------------------------
# the functions being differentiated (library-agnostic)


def rosenbrock_scalar(x):
    """Rosenbrock over a list of 0-d tensors, 8 scalar ops per term."""
    f = 0.0
    for i in range(len(x) - 1):
        f = f + 100 * (x[i + 1] - x[i] ** 2) ** 2 + (1 - x[i]) ** 2
    return f


def rosenbrock_scalar_ops(n: int) -> int:
    """Number of ops ``rosenbrock_scalar`` records for ``n`` inputs."""
    return 8 * (n - 1)


def rosenbrock_vec(x):
    """Rosenbrock over a 1-d tensor."""
    return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum()


PENDULUM_DT = 0.001
PENDULUM_PARAMS = (9.81, 1.0, 0.1, 0.5)  # g, L, b (damping), theta0
PENDULUM_OPS_PER_STEP = 10
PENDULUM_LOSS_OPS = 3
PENDULUM_STEPS = 10_000  # the pendulum cases' length


def pendulum_euler(lib, g, L, b, theta0, steps: int, dt: float = PENDULUM_DT):
    """Damped pendulum integrated with explicit Euler; returns theta_T**2 + omega_T**2.

    Records exactly ``PENDULUM_OPS_PER_STEP`` ops per step plus
    ``PENDULUM_LOSS_OPS`` for the loss (omega starts as the float 0.0, and
    every op involving it still touches a tensor).
    """
    theta = theta0
    omega = 0.0
    sin = lib.sin
    for _ in range(steps):
        omega = omega + dt * (-(g / L) * sin(theta) - b * omega)
        theta = theta + dt * omega
    return theta**2 + omega**2


def pendulum_ops(steps: int) -> int:
    """Number of ops ``pendulum_euler`` records for ``steps`` steps."""
    return steps * PENDULUM_OPS_PER_STEP + PENDULUM_LOSS_OPS


# --------------------------------------------------------------------------
# exact gradients in NumPy (the correctness check for every library)


def rosenbrock_grad_reference(x0: np.ndarray) -> np.ndarray:
    x = np.asarray(x0, dtype=np.float64)
    g = np.zeros_like(x)
    a = x[1:] - x[:-1] ** 2
    g[:-1] += -400.0 * x[:-1] * a - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * a
    return g


def pendulum_grad_reference(params=PENDULUM_PARAMS, steps: int = 10_000, dt: float = PENDULUM_DT) -> np.ndarray:
    """Hand-written adjoint of ``pendulum_euler`` (same operation order), in floats."""
    g, L, b, theta0 = (float(p) for p in params)
    thetas = [theta0]
    omegas = [0.0]
    theta, omega = theta0, 0.0
    for _ in range(steps):
        omega = omega + dt * (-(g / L) * math.sin(theta) - b * omega)
        theta = theta + dt * omega
        thetas.append(theta)
        omegas.append(omega)
    l_theta, l_omega = 2.0 * theta, 2.0 * omega
    d_g = d_L = d_b = 0.0
    for k in range(steps - 1, -1, -1):
        th, om = thetas[k], omegas[k]
        # theta' = theta + dt * omega'
        l_omega_new = l_omega + dt * l_theta
        # omega' = omega + dt * a,  a = -(g/L) sin(theta) - b omega
        l_a = dt * l_omega_new
        s = math.sin(th)
        d_g += l_a * (-s / L)
        d_L += l_a * (g * s / (L * L))
        d_b += l_a * (-om)
        l_theta = l_theta + l_a * (-(g / L) * math.cos(th))
        l_omega = l_omega_new + l_a * (-b)
    return np.array([d_g, d_L, d_b, l_theta])


# --------------------------------------------------------------------------
# timing and child processes


def median(values) -> float:
    values = sorted(values)
    n = len(values)
    if n == 0:
        return math.nan
    mid = n // 2
    return values[mid] if n % 2 else 0.5 * (values[mid - 1] + values[mid])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` once; return (seconds, result)."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _PACKAGE_PARENT + (os.pathsep + old if old else "")
    if extra:
        env.update(extra)
    return env


def _run_child_json(code: str, args=(), env=None, timeout: float = 600.0) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=env if env is not None else _child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child process failed (exit {proc.returncode}):\n{proc.stderr.strip()[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"benchmark child process printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])
