"""Benchmark cases shared by ``python -m tapegrad.bench`` and the pytest-benchmark suite in ``bench/``.

Each case is written once against a library module (``tapegrad`` or
``torch``) using only the names the two share, so both libraries run the same
code. A case's ``make(library)`` builds the inputs and returns a zero-argument
function that runs one iteration (record the forward pass, then
``autograd.grad``) and returns the gradients; ``reference()`` gives the exact
gradient in NumPy so results can be checked without either library.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
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
# speed cases


@dataclass(frozen=True)
class SpeedCase:
    """A timed case: one iteration is forward + ``autograd.grad``.

    ``make(library)`` returns the iteration function; ``reference()`` the
    exact gradient it must return (flattened, see ``grads_to_numpy``).
    ``target_speedup`` is the least torch_time / tapegrad_time that passes.
    """

    name: str
    description: str
    make: Callable[[str], Callable[[], Any]]
    reference: Callable[[], np.ndarray]
    target_speedup: float
    ops: int | None = None
    rtol: float = 1e-9
    tags: tuple[str, ...] = field(default_factory=tuple)
    peer: str = "torch"  # the library in the "peer" column (named in the case when not torch)
    repeats: int | None = None  # timed turns in every mode (for cases whose peer takes seconds)


def _scalar_leaves(lib, values):
    return [lib.tensor(float(v), dtype=lib.float64, requires_grad=True) for v in values]


def _rosenbrock_x0(n: int) -> np.ndarray:
    return np.random.default_rng(n).uniform(-1.5, 1.5, n)


def _make_rosenbrock_scalar(n: int):
    def make(library: str):
        lib = load_library(library)
        xs = _scalar_leaves(lib, _rosenbrock_x0(n))
        grad = lib.autograd.grad

        def iteration():
            f = rosenbrock_scalar(xs)
            return grad(f, xs)

        return iteration

    return make


def _make_rosenbrock_vec(n: int):
    def make(library: str):
        lib = load_library(library)
        x = lib.tensor(_rosenbrock_x0(n), dtype=lib.float64, requires_grad=True)
        grad = lib.autograd.grad

        def iteration():
            f = rosenbrock_vec(x)
            return grad(f, (x,))

        return iteration

    return make


def _make_pendulum(steps: int):
    def make(library: str):
        lib = load_library(library)
        params = _scalar_leaves(lib, PENDULUM_PARAMS)
        grad = lib.autograd.grad

        def iteration():
            loss = pendulum_euler(lib, *params, steps=steps)
            return grad(loss, params)

        return iteration

    return make


def rosenbrock_hessian_reference(x0: np.ndarray) -> np.ndarray:
    """Exact Hessian of the Rosenbrock sum."""
    x = np.asarray(x0, dtype=np.float64)
    n = x.size
    h = np.zeros((n, n))
    for i in range(n - 1):
        h[i, i] += 1200.0 * x[i] ** 2 - 400.0 * x[i + 1] + 2.0
        h[i, i + 1] += -400.0 * x[i]
        h[i + 1, i] += -400.0 * x[i]
        h[i + 1, i + 1] += 200.0
    return h


def _hvp_v(n: int) -> np.ndarray:
    return np.random.default_rng(n + 1).standard_normal(n)


def _make_hvp_rosenbrock_scalar(n: int):
    """Hessian-vector product by double backward, recorded each iteration."""
    def make(library: str):
        lib = load_library(library)
        xs = _scalar_leaves(lib, _rosenbrock_x0(n))
        v = [float(a) for a in _hvp_v(n)]
        grad = lib.autograd.grad

        def iteration():
            gs = grad(rosenbrock_scalar(xs), xs, create_graph=True)
            gv = 0.0
            for g, vi in zip(gs, v):
                gv = gv + g * vi
            return grad(gv, xs)

        return iteration

    return make


JAC_N = 64


def _jac_data():
    rng = np.random.default_rng(64)
    return (rng.standard_normal((JAC_N, JAC_N)) / 8, rng.standard_normal((JAC_N, JAC_N)) / 8,
            rng.standard_normal(JAC_N))


def jacobian_function(lib, x, A, B):
    """R^64 -> R^64: tanh(B @ sin(tanh(A @ x)) * x)."""
    return lib.tanh((B @ lib.sin(lib.tanh(A @ x))) * x)


def jacobian_reference() -> np.ndarray:
    A, B, x = _jac_data()
    t = np.tanh(A @ x)
    s = np.sin(t)
    z = (B @ s) * x
    dz = np.diag(B @ s) + x[:, None] * (B @ (np.cos(t)[:, None] * (1 - t * t)[:, None] * A))
    return (1 - np.tanh(z) ** 2)[:, None] * dz


def _make_jacobian_batched():
    def make(library: str):
        lib = load_library(library)
        A, B, x0 = _jac_data()
        At, Bt = lib.tensor(A, dtype=lib.float64), lib.tensor(B, dtype=lib.float64)
        eye = lib.tensor(np.eye(JAC_N), dtype=lib.float64)
        grad = lib.autograd.grad

        def iteration():
            x = lib.tensor(x0, dtype=lib.float64, requires_grad=True)
            return grad(jacobian_function(lib, x, At, Bt), (x,), eye, is_grads_batched=True)

        return iteration

    return make


def _make_jacobian_loop():
    """tapegrad: the batched sweep; tapegrad-loop: one forward, then a Python loop of 64
    ``grad`` calls, one per row of the Jacobian."""
    def make(library: str):
        if library == "tapegrad":
            return _make_jacobian_batched()(library)
        lib = load_library(library)
        A, B, x0 = _jac_data()
        At, Bt = lib.tensor(A, dtype=lib.float64), lib.tensor(B, dtype=lib.float64)
        rows = [lib.tensor(e, dtype=lib.float64) for e in np.eye(JAC_N)]
        grad = lib.autograd.grad

        def iteration():
            x = lib.tensor(x0, dtype=lib.float64, requires_grad=True)
            y = jacobian_function(lib, x, At, Bt)
            return (lib.stack([grad(y, x, e, retain_graph=True)[0] for e in rows]),)

        return iteration

    return make


PENDULUM_STEPS = 10_000


# --------------------------------------------------------------------------
# compiled replay (tapegrad.trace): tapegrad replays a program traced once in ``make``;
# torch has no replay, so its side records and sweeps every call (torch eager)


def _tensor_input(lib, x0):
    return lib.tensor(np.asarray(x0, dtype=np.float64), dtype=lib.float64)


def _make_replay_rosenbrock(n: int):
    def make(library: str):
        if library != "tapegrad":
            return _make_rosenbrock_scalar(n)(library)
        tg = load_library(library)
        x = _tensor_input(tg, _rosenbrock_x0(n))
        prog = tg.trace(lambda x: rosenbrock_scalar([x[i] for i in range(n)]), x)

        def iteration():
            return (prog.value_and_grad(x)[1],)

        return iteration

    return make


def _make_replay_pendulum(steps: int):
    def make(library: str):
        if library != "tapegrad":
            return _make_pendulum(steps)(library)
        tg = load_library(library)
        p = _tensor_input(tg, PENDULUM_PARAMS)
        prog = tg.trace(lambda p: pendulum_euler(tg, p[0], p[1], p[2], p[3], steps=steps), p)

        def iteration():
            return (prog.value_and_grad(p)[1],)

        return iteration

    return make


class _Array:
    """A NumPy result that answers ``.detach().numpy()`` like a tensor (for check_result)."""

    def __init__(self, a):
        self.a = np.asarray(a, dtype=np.float64).reshape(-1)

    def detach(self):
        return self

    def numpy(self):
        return self.a


ADAM_STEPS = 1000
ADAM_LR = 1e-3


def _make_adam_rosenbrock(n: int, steps: int = ADAM_STEPS):
    """Adam on the scalar Rosenbrock from a fixed start: tapegrad runs the steps inside
    Numba on a program traced once (Optimizer.run); torch runs the same loop eagerly
    (zero_grad, forward over 0-d tensors, backward, step)."""
    x0 = _rosenbrock_x0(n)

    def make(library: str):
        lib = load_library(library)
        if library == "tapegrad":
            prog = lib.trace(lambda x: rosenbrock_scalar([x[i] for i in range(n)]),
                             _tensor_input(lib, x0))

            def iteration():
                x = lib.tensor(x0, dtype=lib.float64, requires_grad=True)
                lib.optim.Adam([x], lr=ADAM_LR).run(prog, steps)
                return (x,)

            return iteration
        xs = _scalar_leaves(lib, x0)

        def iteration():
            with lib.no_grad():
                for x, v in zip(xs, x0):
                    x.fill_(float(v))
            opt = lib.optim.Adam(xs, lr=ADAM_LR)
            for _ in range(steps):
                opt.zero_grad()
                rosenbrock_scalar(xs).backward()
                opt.step()
            return xs

        return iteration

    return make


def adam_reference(n: int, steps: int = ADAM_STEPS) -> np.ndarray:
    """The Adam trajectory's end point with exact gradients, in NumPy."""
    x = _rosenbrock_x0(n).copy()
    m, v = np.zeros(n), np.zeros(n)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for t in range(1, steps + 1):
        g = rosenbrock_grad_reference(x)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        x = x - ADAM_LR / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
    return x


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
from tapegrad.bench.cases import pendulum_euler, PENDULUM_PARAMS
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


def _make_replay_hvp(n: int):
    def make(library: str):
        if library != "tapegrad":
            return _make_hvp_rosenbrock_scalar(n)(library)
        tg = load_library(library)
        x = _tensor_input(tg, _rosenbrock_x0(n))
        v = _tensor_input(tg, _hvp_v(n))
        prog = tg.trace(lambda x: rosenbrock_scalar([x[i] for i in range(n)]), x)

        def iteration():
            return (prog.hvp(x, v)[1],)

        return iteration

    return make


# --------------------------------------------------------------------------
# GradBench-shaped cases: the tool's own eval modules (tapegrad.bench.gradbench) on inputs
# the suite generates, so no GradBench checkout is needed


def gradbench_input(name: str) -> dict:
    """A seeded input of GradBench's shape for eval ``name`` (sizes from its defaults)."""
    rng = np.random.default_rng(0)
    runs = {"min_runs": 1, "min_seconds": 0}
    if name == "gmm":
        d, k, n = 10, 25, 1000
        return dict(runs, d=d, k=k, n=n, m=0, gamma=1.0, x=rng.normal(size=(n, d)).tolist(),
                    alpha=rng.normal(size=k).tolist(), mu=rng.normal(size=(k, d)).tolist(),
                    q=(0.1 * rng.normal(size=(k, d))).tolist(),
                    l=(0.1 * rng.normal(size=(k, d * (d - 1) // 2))).tolist())
    if name == "lse":
        return dict(runs, x=rng.normal(size=10_000).tolist())
    if name == "kmeans":
        P = rng.normal(size=(1000, 8))
        return dict(runs, points=P.tolist(), centroids=P[:10].tolist())
    if name == "lstm":
        layers, b, c = 2, 14, 256
        return dict(runs, main_params=rng.normal(size=(2 * layers, 4 * b)).tolist(),
                    extra_params=rng.normal(size=(3, b)).tolist(),
                    state=rng.normal(size=(2 * layers, b)).tolist(),
                    sequence=rng.normal(size=(c, b)).tolist())
    if name == "ba":
        cam = rng.normal(size=11) * 0.1
        cam[6] = 1.0
        return dict(runs, n=21, m=100, p=1000, cam=cam.tolist(),
                    x=(rng.normal(size=3) + [0, 0, 4]).tolist(), w=0.8,
                    feat=rng.normal(size=2).tolist())
    if name == "det":
        return dict(runs, A=rng.normal(size=49).tolist(), ell=7)
    if name == "ode":
        return dict(runs, x=rng.random(100).tolist(), s=100)
    if name == "llsq":
        return dict(runs, x=rng.normal(size=16).tolist(), n=1024)
    raise KeyError(name)


class _Flat:
    """A GradBench output as the suite's result type (``.detach().numpy()``): flattened
    only when checked, so the timed iteration pays no conversion."""

    def __init__(self, post, value):
        self.post, self.value = post, value

    def detach(self):
        return self

    def numpy(self):
        return np.asarray(_flatten(self.post(self.value)), dtype=np.float64)


def _flatten(v):
    if isinstance(v, dict):
        return [x for k in sorted(v) for x in _flatten(v[k])]
    if isinstance(v, (list, tuple)):
        return [x for e in v for x in _flatten(e)]
    return [float(v)]


def _make_gradbench(name: str, function: str, replay: bool = False):
    def make(library: str):
        import importlib
        mod = importlib.import_module(f"tapegrad.bench.gradbench.{name}")
        run, post = mod.prepare(function, gradbench_input(name), load_library(library),
                                replay and library == "tapegrad")

        def iteration():
            return (_Flat(post, run()),)
        return iteration
    return make


_GB_REFERENCE: dict = {}


def _gradbench_reference(name: str, function: str):
    """The derivative by tapegrad's eager tool (the tests check it against torch)."""
    def reference():
        key = (name, function)
        if key not in _GB_REFERENCE:
            _GB_REFERENCE[key] = grads_to_numpy(_make_gradbench(name, function)("tapegrad")())
        return _GB_REFERENCE[key]
    return reference


GRADBENCH_CASES = [  # (eval, function, description, replay too)
    ("gmm", "jacobian", "GMM log posterior gradient, d=10, k=25, n=1000", True),
    ("lse", "gradient", "LogSumExp gradient from primitives, n=10,000", False),
    ("kmeans", "dir", "k-means Newton direction (gradient / Hessian diagonal), n=1000, k=10, "
     "d=8", False),
    ("lstm", "jacobian", "ADBench LSTM gradient, 2 layers, b=14, 256 characters", True),
    ("ba", "jacobian", "bundle adjustment sparse Jacobian, n=21, m=100, p=1000", True),
    ("det", "gradient", "determinant by minors (scalar ops), 7 x 7", True),
    ("ode", "gradient", "Runge-Kutta ODE gradient, n=100, s=100", True),
    ("llsq", "gradient", "least-squares objective gradient, n=1024, m=16", False),
]


def _make_retained_backward(graphs: int):
    def make(library: str):
        lib = load_library(library)
        xs = [lib.tensor(i / graphs, dtype=lib.float64, requires_grad=True)
              for i in range(graphs)]
        ys = [x * x + lib.sin(x) for x in xs]

        def iteration():
            xs[-1].grad = None
            ys[-1].backward(retain_graph=True)
            return (xs[-1].grad,)
        return iteration
    return make


def _retained_reference(graphs: int):
    x = (graphs - 1) / graphs
    return np.array([2 * x + math.cos(x)])


SPEED_CASES: dict[str, SpeedCase] = {
    c.name: c
    for c in [
        SpeedCase(
            "rosenbrock_scalar_n100",
            "scalar Rosenbrock, list of 100 0-d tensors, forward + grad",
            _make_rosenbrock_scalar(100),
            lambda: rosenbrock_grad_reference(_rosenbrock_x0(100)),
            target_speedup=10.0,
            ops=rosenbrock_scalar_ops(100),
            tags=("scalar",),
        ),
        SpeedCase(
            "rosenbrock_scalar_n1000",
            "scalar Rosenbrock, list of 1000 0-d tensors, forward + grad",
            _make_rosenbrock_scalar(1000),
            lambda: rosenbrock_grad_reference(_rosenbrock_x0(1000)),
            target_speedup=10.0,
            ops=rosenbrock_scalar_ops(1000),
            tags=("scalar",),
        ),
        SpeedCase(
            "pendulum_euler_10k",
            "explicit-Euler pendulum, 10,000 steps of scalar ops, grad w.r.t. (g, L, b, theta0)",
            _make_pendulum(PENDULUM_STEPS),
            lambda: pendulum_grad_reference(PENDULUM_PARAMS, PENDULUM_STEPS),
            target_speedup=10.0,
            ops=pendulum_ops(PENDULUM_STEPS),
            rtol=1e-8,
            tags=("scalar",),
        ),
        SpeedCase(
            "hvp_rosenbrock_scalar_n100",
            "Hessian-vector product of scalar Rosenbrock (n=100) by double backward",
            _make_hvp_rosenbrock_scalar(100),
            lambda: rosenbrock_hessian_reference(_rosenbrock_x0(100)) @ _hvp_v(100),
            target_speedup=10.0,
            tags=("higher-order",),
        ),
        SpeedCase(
            "jacobian_64_batched",
            "full Jacobian of tanh(B @ sin(tanh(A @ x)) * x), R^64 -> R^64, is_grads_batched",
            _make_jacobian_batched(),
            lambda: jacobian_reference().reshape(-1),
            target_speedup=1.0,
            tags=("higher-order",),
        ),
        SpeedCase(
            "jacobian_64_batched_vs_loop",
            "the same Jacobian: is_grads_batched vs a Python loop of 64 grad calls in tapegrad",
            _make_jacobian_loop(),
            lambda: jacobian_reference().reshape(-1),
            target_speedup=10.0,
            tags=("higher-order",),
            peer="tapegrad-loop",
        ),
        SpeedCase(
            "replay_rosenbrock_scalar_n100",
            "traced scalar Rosenbrock (n=100), program.value_and_grad vs torch eager",
            _make_replay_rosenbrock(100),
            lambda: rosenbrock_grad_reference(_rosenbrock_x0(100)),
            target_speedup=300.0,
            ops=rosenbrock_scalar_ops(100),
            tags=("replay",),
        ),
        SpeedCase(
            "replay_rosenbrock_scalar_n1000",
            "traced scalar Rosenbrock (n=1000), program.value_and_grad vs torch eager",
            _make_replay_rosenbrock(1000),
            lambda: rosenbrock_grad_reference(_rosenbrock_x0(1000)),
            target_speedup=300.0,
            ops=rosenbrock_scalar_ops(1000),
            tags=("replay",),
        ),
        SpeedCase(
            "replay_pendulum_euler_10k",
            "traced 10,000-step pendulum, program.value_and_grad vs torch eager",
            _make_replay_pendulum(PENDULUM_STEPS),
            lambda: pendulum_grad_reference(PENDULUM_PARAMS, PENDULUM_STEPS),
            target_speedup=300.0,
            ops=pendulum_ops(PENDULUM_STEPS),
            rtol=1e-8,
            tags=("replay",),
        ),
        SpeedCase(
            "replay_hvp_rosenbrock_scalar_n100",
            "traced scalar Rosenbrock (n=100), program.hvp vs torch double backward",
            _make_replay_hvp(100),
            lambda: rosenbrock_hessian_reference(_rosenbrock_x0(100)) @ _hvp_v(100),
            target_speedup=300.0,
            tags=("replay",),
        ),
        SpeedCase(
            "adam_1000_steps_rosenbrock_scalar_n100",
            "1,000 Adam steps on scalar Rosenbrock (n=100): Optimizer.run on a traced "
            "program vs the torch eager loop",
            _make_adam_rosenbrock(100),
            lambda: adam_reference(100),
            target_speedup=1.0,
            rtol=1e-8,
            tags=("replay",),
            repeats=1,
        ),
        SpeedCase(
            "rosenbrock_vec_n10",
            "vectorized Rosenbrock, 1-d tensor of 10, forward + grad",
            _make_rosenbrock_vec(10),
            lambda: rosenbrock_grad_reference(_rosenbrock_x0(10)),
            target_speedup=1.0,
            tags=("vector",),
        ),
        SpeedCase(
            "rosenbrock_vec_n1000",
            "vectorized Rosenbrock, 1-d tensor of 1,000, forward + grad",
            _make_rosenbrock_vec(1000),
            lambda: rosenbrock_grad_reference(_rosenbrock_x0(1000)),
            target_speedup=1.0,
            tags=("vector",),
        ),
        SpeedCase(
            "rosenbrock_vec_n100000",
            "vectorized Rosenbrock, 1-d tensor of 100,000, forward + grad",
            _make_rosenbrock_vec(100_000),
            lambda: rosenbrock_grad_reference(_rosenbrock_x0(100_000)),
            target_speedup=1.0,
            tags=("vector",),
        ),
        SpeedCase(
            "retained_backward_3000_graphs",
            "backward(retain_graph=True) of the last of 3,000 independent tiny graphs on one "
            "tape: costs its own graph, not the tape's",
            _make_retained_backward(3000),
            lambda: _retained_reference(3000),
            target_speedup=0.25,
            tags=("eager",),
        ),
    ]
    + [SpeedCase(f"gradbench_{name}", f"GradBench {name}: {what} (eager)",
                 _make_gradbench(name, function), _gradbench_reference(name, function),
                 target_speedup=1.0, rtol=1e-8, tags=("gradbench",))
       for name, function, what, _ in GRADBENCH_CASES]
    + [SpeedCase(f"gradbench_{name}_replay", f"GradBench {name}: {what} (traced, replayed; "
                 "torch eager)", _make_gradbench(name, function, True),
                 _gradbench_reference(name, function), target_speedup=1.0, rtol=1e-8,
                 tags=("gradbench", "replay"))
       for name, function, what, replay in GRADBENCH_CASES if replay]
}


def check_result(case: SpeedCase, grads) -> float:
    """Compare an iteration's gradients with the exact ones.

    Returns the largest relative error; raises AssertionError when it is
    above ``case.rtol``.
    """
    got = grads_to_numpy(grads)
    want = case.reference()
    if got.shape != want.shape:
        raise AssertionError(f"{case.name}: gradient has shape {got.shape}, expected {want.shape}")
    scale = np.maximum(np.abs(want), 1.0)
    err = float(np.max(np.abs(got - want) / scale)) if want.size else 0.0
    if not err <= case.rtol:
        raise AssertionError(f"{case.name}: gradient differs from the exact one (max rel err {err:.3g} > {case.rtol:g})")
    return err


# --------------------------------------------------------------------------
# memory per recorded op (pendulum)

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


_RSS_CHILD = """\
import json, sys
from tapegrad.bench.cases import rss_probe
print(json.dumps(rss_probe(sys.argv[1], int(sys.argv[2]))))
"""


def rss_bytes_per_op(library: str, steps: int = 100_000) -> dict:
    """RSS growth per recorded op of a ``steps``-step pendulum, measured in a fresh process.

    This is the measure for torch, whose graph lives in C++ allocations that
    tracemalloc cannot see.
    """
    return _run_child_json(_RSS_CHILD, (library, steps))


# --------------------------------------------------------------------------
# import to first gradient, in a fresh process

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


# --------------------------------------------------------------------------
# the CUDA target: throughput of batched value_and_grad (needs a real GPU)

CUDA_N = 100
CUDA_BATCHES = (1_000, 10_000, 100_000, 1_000_000)


def cuda_status() -> str | None:
    """None when tapegrad's CUDA target can run on a real GPU here, else why not."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "NUMBA_ENABLE_CUDASIM is set: the simulator shows no speed"
    try:
        from tapegrad.replay import cuda_module
        cuda_module()
    except ImportError:
        return "numba-cuda is not installed: pip install 'tapegrad[cuda]'"
    except RuntimeError:
        return "no usable NVIDIA GPU on this machine"
    return None


def _best_of(fn, repeats: int) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cuda_throughput(batch: int, repeats: int = 3) -> dict:
    """Seconds per batched ``value_and_grad`` of the scalar Rosenbrock (n=100) over
    ``batch`` inputs: tapegrad's CUDA target (device arrays in and out), its ``parallel``
    CPU target, and ``torch.func.vmap(torch.func.grad(f))`` on the same GPU when torch has
    CUDA; each result checked against the CPU target."""
    import tapegrad as tg
    from numba import cuda
    n = CUDA_N
    prog = tg.trace(lambda x: rosenbrock_scalar([x[i] for i in range(n)]), np.zeros(n))
    gpu, par = prog.to("cuda"), prog.to("parallel")
    X = np.random.default_rng(0).uniform(-2.0, 2.0, size=(batch, n))
    Xd = cuda.to_device(X)

    def on_gpu():
        out = gpu.value_and_grad(Xd)
        cuda.synchronize()
        return out

    res = {"batch": batch, "rows": len(prog)}
    res["cuda_s"] = _best_of(on_gpu, repeats)
    res["parallel_s"] = _best_of(lambda: par.value_and_grad(X), repeats)
    _, g = on_gpu()
    _, gp = par.value_and_grad(X)
    res["max_rel_err"] = float(np.max(np.abs(g.copy_to_host() - gp) / (1.0 + np.abs(gp))))
    res["torch_s"] = None
    try:
        import torch
        if torch.cuda.is_available():
            Xt = torch.tensor(X, device="cuda")
            f = torch.func.vmap(torch.func.grad_and_value(rosenbrock_vec))

            def on_torch():
                out = f(Xt)
                torch.cuda.synchronize()
                return out

            res["torch_s"] = _best_of(on_torch, repeats)
    except ImportError:
        pass
    return res
