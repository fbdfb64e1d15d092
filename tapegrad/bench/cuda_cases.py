"""The CUDA target's throughput of batched value_and_grad (needs a real GPU)."""

from __future__ import annotations

import os
import time

import numpy as np

from .common import rosenbrock_scalar, rosenbrock_vec

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
