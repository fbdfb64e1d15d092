"""Optimization loops over a traced program, entirely in Numba: each step replays the
program's value and gradient and applies ``tapegrad.optim``'s update arithmetic."""
from __future__ import annotations

import numpy as np

from .._jit import njit_cached
from .._optim_math import _adam_update, _sgd_update
from .replay_cpu import run

adam_update = njit_cached(error_model="numpy", nogil=True)(_adam_update)
sgd_update = njit_cached(error_model="numpy", nogil=True)(_sgd_update)


@njit_cached(error_model="numpy", nogil=True)
def adam_loop(rows, x, out_slots, in_slots, steps, step0, lr, beta1, beta2, eps,
              weight_decay, amsgrad, maximize, m, v, vmax, values):
    """``steps`` Adam steps from ``x`` (updated in place, with the state ``m``, ``v``,
    ``vmax``); ``values[i]`` is the value before step ``i``. Returns (steps done, status
    of the failed guard or 0)."""
    seeds = np.ones(out_slots.shape[0])
    for i in range(steps):
        status, outs, g = run(rows, x, out_slots, seeds, in_slots, True)
        if status != 0:
            return i, status
        values[i] = outs[0]
        adam_update(x, g, m, v, vmax, step0 + i + 1.0, lr, beta1, beta2, eps, weight_decay,
                    amsgrad, maximize)
    return steps, 0


@njit_cached(error_model="numpy", nogil=True)
def sgd_loop(rows, x, out_slots, in_slots, steps, first, lr, momentum, dampening,
             weight_decay, nesterov, maximize, buf, values):
    """``steps`` SGD steps from ``x`` (with momentum buffer ``buf``, empty on ``first``)."""
    seeds = np.ones(out_slots.shape[0])
    for i in range(steps):
        status, outs, g = run(rows, x, out_slots, seeds, in_slots, True)
        if status != 0:
            return i, status
        values[i] = outs[0]
        sgd_update(x, g, buf, lr, momentum, dampening, weight_decay, nesterov, maximize,
                   first and i == 0)
    return steps, 0
