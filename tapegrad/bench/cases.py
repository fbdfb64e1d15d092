"""Benchmark cases shared by ``python -m tapegrad.bench`` and the pytest-benchmark suite in ``bench/``.

Each case is written once against a library module (``tapegrad`` or
``torch``) using only the names the two share, so both libraries run the same
code. A case's ``make(library)`` builds the inputs and returns a zero-argument
function that runs one iteration (record the forward pass, then
``autograd.grad``) and returns the gradients; ``reference()`` gives the exact
gradient in NumPy so results can be checked without either library.

The families that are not timed iterations live in their own modules (``memory``,
``compile_time``, ``startup``, ``cuda_cases``) and what all share in ``common``; this module
re-exports their names, so ``tapegrad.bench.cases.<name>`` keeps working.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import numpy as np

from .common import (LIBRARIES, PENDULUM_DT, PENDULUM_LOSS_OPS, PENDULUM_OPS_PER_STEP,  # noqa: F401
                     PENDULUM_PARAMS, PENDULUM_STEPS, _PACKAGE_PARENT, _child_env, _run_child_json,
                     _scalar_leaves, grads_to_numpy, library_available, library_version,
                     load_library, median, pendulum_euler, pendulum_grad_reference,
                     pendulum_ops, rosenbrock_grad_reference, rosenbrock_scalar,
                     rosenbrock_scalar_ops, rosenbrock_vec, timed)
from .compile_time import (JAX_MAX_STEPS, JAX_TIMEOUT_S, TRACE_STEPS,  # noqa: F401
                           jax_compile_seconds, trace_compile_seconds)
from .cuda_cases import CUDA_BATCHES, CUDA_N, cuda_status, cuda_throughput  # noqa: F401
from .memory import (MEMORY_TARGET_RATIO, rss_bytes_per_op, rss_probe,  # noqa: F401
                     tapegrad_tracemalloc_bytes_per_op)
from .startup import (IMPORT_COLD_TARGET_S, IMPORT_WARM_TARGET_S,  # noqa: F401
                      REPLAY_COLD_CASES, first_grad_in_fresh_process, import_to_first_grad,
                      replay_cold_first_call)


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
    ("lse", "gradient", "LogSumExp gradient from primitives, n=10,000", True),
    ("kmeans", "dir", "k-means Newton direction (gradient / Hessian diagonal), n=1000, k=10, "
     "d=8", True),
    ("lstm", "jacobian", "ADBench LSTM gradient, 2 layers, b=14, 256 characters", True),
    ("ba", "jacobian", "bundle adjustment sparse Jacobian, n=21, m=100, p=1000", True),
    ("det", "gradient", "determinant by minors (scalar ops), 7 x 7", True),
    ("ode", "gradient", "Runge-Kutta ODE gradient, n=100, s=100", True),
    ("llsq", "gradient", "least-squares objective gradient, n=1024, m=16", True),
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
