"""The per-step arithmetic of SGD and Adam: pure functions over flat float arrays, in place
(Numba nopython-safe), shared by ``optim`` (eager steps) and ``interpreters.optim_loop``
(compiled loops) without either importing the other."""
from __future__ import annotations

import numpy as np


def _sgd_update(param, grad, buf, lr, momentum, dampening, weight_decay, nesterov, maximize,
                first):
    """One SGD step on flat arrays, in place (torch's single-tensor ``sgd``).

    Parameters
    ----------
    param : ndarray
        The parameter's values, 1-d and contiguous; updated in place.
    grad : ndarray
        Its gradient (same shape and dtype); not modified.
    buf : ndarray
        The momentum buffer (same shape and dtype); updated in place when
        ``momentum != 0`` (set to the effective gradient when ``first``), else unused
        and may be empty.
    lr, momentum, dampening, weight_decay : float
        Hyperparameters, as in ``SGD``.
    nesterov, maximize : bool
        As in ``SGD``.
    first : bool
        Whether ``buf`` holds no momentum yet (the parameter's first step).

    Notes
    -----
    In order, elementwise: ``g = -grad if maximize else grad``;
    ``g = g + weight_decay * param`` (when ``weight_decay != 0``); with momentum,
    ``buf = g`` on the first step, else ``buf = buf * momentum + (1 - dampening) * g``,
    then ``g = g + momentum * buf`` (nesterov) or ``g = buf``; finally
    ``param = param + (-lr) * g``. torch's CPU kernels fuse each multiply-add into one
    rounding (FMA); plain NumPy rounds twice, so single steps can differ from torch in
    the last bit.

    Examples
    --------
    >>> import numpy as np
    >>> p, g, buf = np.array([1.0, 2.0]), np.array([0.5, -1.0]), np.empty(2)
    >>> _sgd_update(p, g, buf, 0.1, 0.9, 0.0, 0.0, False, False, True)
    >>> p.tolist(), buf.tolist()
    ([0.95, 2.1], [0.5, -1.0])
    """
    g = np.empty_like(param)
    if maximize:
        g[:] = -grad
    else:
        g[:] = grad
    if weight_decay != 0.0:
        g[:] = g + weight_decay * param
    if momentum != 0.0:
        if first:
            buf[:] = g
        else:
            buf *= momentum
            buf += (1.0 - dampening) * g
        if nesterov:
            g[:] = g + momentum * buf
        else:
            g = buf
    param += (-lr) * g


def _adam_update(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2,
                 eps, weight_decay, amsgrad, maximize):
    """One Adam step on flat arrays, in place (torch's single-tensor ``adam``).

    Parameters
    ----------
    param : ndarray
        The parameter's values, 1-d and contiguous; updated in place.
    grad : ndarray
        Its gradient (same shape and dtype); not modified.
    exp_avg, exp_avg_sq : ndarray
        The running averages of the gradient and of its square; updated in place.
    max_exp_avg_sq : ndarray
        The running maximum of ``exp_avg_sq``, updated in place when ``amsgrad``; else
        unused and may be empty.
    step : float
        The step count including this step (1 on the first step).
    lr, beta1, beta2, eps, weight_decay : float
        Hyperparameters, as in ``Adam``.
    amsgrad, maximize : bool
        As in ``Adam``.

    Notes
    -----
    In order: ``g = -grad if maximize else grad``; ``g = g + weight_decay * param``
    (when ``weight_decay != 0``); ``exp_avg = lerp(exp_avg, g, 1 - beta1)`` with
    torch's two-sided lerp; ``exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g``;
    ``step_size = lr / (1 - beta1 ** step)``; ``denom = sqrt(v) / (1 - beta2 ** step)
    ** 0.5 + eps`` with ``v`` the (running maximum of) ``exp_avg_sq``; finally
    ``param = param + (-step_size) * exp_avg / denom``.

    Examples
    --------
    >>> import numpy as np
    >>> p, g = np.array([1.0]), np.array([2.0])
    >>> m, v, vmax = np.zeros(1), np.zeros(1), np.empty(0)
    >>> _adam_update(p, g, m, v, vmax, 1.0, 0.1, 0.9, 0.999, 1e-8, 0.0, False, False)
    >>> round(float(p[0]), 6)  # the first step moves each entry by about lr
    0.9
    """
    g = np.empty_like(param)
    if maximize:
        g[:] = -grad
    else:
        g[:] = grad
    if weight_decay != 0.0:
        g[:] = g + weight_decay * param
    weight = 1.0 - beta1
    if abs(weight) < 0.5:  # torch's lerp: from the nearer end
        exp_avg += weight * (g - exp_avg)
    else:
        exp_avg[:] = g - (g - exp_avg) * (1.0 - weight)
    exp_avg_sq *= beta2
    exp_avg_sq += (1.0 - beta2) * g * g
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    if amsgrad:
        max_exp_avg_sq[:] = np.maximum(max_exp_avg_sq, exp_avg_sq)
        denom = np.sqrt(max_exp_avg_sq) / bias_correction2_sqrt + eps
    else:
        denom = np.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    param += (-step_size) * exp_avg / denom
