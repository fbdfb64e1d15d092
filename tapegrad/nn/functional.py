"""Losses and activations of ``torch.nn.functional``, built from tapegrad's recorded ops, so
``create_graph``, ``is_grads_batched`` and traced programs work through them."""
from __future__ import annotations

import warnings

import numpy as np

from .. import functions as _f
from ..tape import all_or_nothing
from ..tensor import Tensor, _hint, _plain

relu, sigmoid, tanh = _f.relu, _f.sigmoid, _f.tanh
softmax, log_softmax = _f.softmax, _f.log_softmax

_REDUCTIONS = ("none", "mean", "sum")


def _check(x, name):
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor, not {type(x).__name__}")
    return x


def _reduce(loss, reduction):
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    raise ValueError(f"{reduction} is not a valid value for reduction; use one of "
                     f"{', '.join(_REDUCTIONS)}")


def _named(t, name):
    return _hint(t, name) if t._tape is not None else t


def _same_shape(input, target, fname):
    if input.shape != target.shape:
        raise ValueError(f"{fname}: Target size ({list(target.shape)}) must be the same as "
                         f"input size ({list(input.shape)})")


def _log1p_exp(z):
    """log(1 + exp(z)) to full precision everywhere (no threshold), its derivative
    sigmoid(z) exactly (at 0 too), and no overflow: exp only ever sees -|z|."""
    pos = z > 0
    return _f.where(pos, z, 0.0) + _f.log1p(_f.exp(_f.where(pos, -z, z)))


def softplus(input, beta=1.0, threshold=20.0):
    """log(1 + exp(beta * x)) / beta, linear above ``threshold`` (torch's)."""
    return _f.softplus(_check(input, "input"), beta, threshold)


def _reduction_args(size_average, reduce, reduction=None):
    """torch's checks of the deprecated reduction arguments (and of ``reduction``, when the
    loss checks it before anything else)."""
    if size_average is not None or reduce is not None:
        raise TypeError("size_average and reduce are deprecated in torch; pass reduction= "
                        "('mean', 'sum' or 'none')")
    if reduction is not None and reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")


def logsigmoid(input):
    """log(sigmoid(x)) = -softplus(-x), without overflow."""
    return _named(-_log1p_exp(-_check(input, "input")), "LogSigmoidBackward0")


@all_or_nothing
def mse_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    """Mean (or sum, or none) of the squared differences."""
    _check(input, "input"), _check(target, "target")
    _reduction_args(size_average, reduce)
    if input.shape != target.shape:  # torch warns, then broadcasts (or raises as sub does)
        warnings.warn(f"Using a target size ({target.shape}) that is different to the input "
                      f"size ({input.shape}). This will likely lead to incorrect results due "
                      f"to broadcasting. Please ensure they have the same size.", UserWarning,
                      stacklevel=3)
    d = input - target
    return _named(_reduce(d * d, reduction), "MseLossBackward0")


@all_or_nothing
def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None,
                                     reduce=None, reduction="mean", pos_weight=None):
    """Binary cross entropy of ``sigmoid(input)`` against ``target``, computed from the
    logits as (1 - t) x + (1 + (p - 1) t) log(1 + exp(-x)), which does not overflow."""
    _check(input, "input"), _check(target, "target")
    _reduction_args(size_average, reduce)
    _same_shape(input, target, "binary_cross_entropy_with_logits")
    for arg, name in ((weight, "weight"), (pos_weight, "pos_weight")):
        if isinstance(arg, Tensor) and arg.requires_grad:
            raise RuntimeError(f"The function 'binary_cross_entropy_with_logits' is not "
                               f"differentiable with respect to argument '{name}'. This input "
                               f"cannot have requires_grad True.")
    sp = _log1p_exp(-input)
    if pos_weight is None:
        loss = (1 - target) * input + sp
    else:
        loss = (1 - target) * input + (1 + (pos_weight - 1) * target) * sp
    if weight is not None:
        loss = loss * weight
    return _named(_reduce(loss, reduction), "BinaryCrossEntropyWithLogitsBackward0")


@all_or_nothing
def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                  reduce=None, reduction="mean", label_smoothing=0.0):
    """Cross entropy of the logits ``input`` (C,), (N, C) or (N, C, d1, ...) against class
    indices or class probabilities ``target``, with torch's weight, ignore_index,
    reduction and label_smoothing."""
    _check(input, "input"), _check(target, "target")
    _reduction_args(size_average, reduce, reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    if input.ndim == 0:
        raise RuntimeError("cross_entropy: input must have a class dimension, got a 0-d tensor")
    cdim = 0 if input.ndim == 1 else 1
    return _from_logp(input, _f.log_softmax(input, cdim), target, weight, ignore_index,
                      reduction, label_smoothing)


def _from_logp(input, logp, target, weight, ignore_index, reduction, label_smoothing):
    cdim = 0 if input.ndim == 1 else 1
    C = input.shape[cdim]
    w = None
    if weight is not None:
        _check(weight, "weight")
        if weight.requires_grad:
            raise RuntimeError("The function 'nll_loss_forward' is not differentiable with "
                               "respect to argument 'weight'. This input cannot have "
                               "requires_grad True.")
        if weight.shape != (C,):
            raise RuntimeError(f"cross_entropy: weight must have shape [{C}] (one per class), "
                               f"got {list(weight.shape)}")
        w = weight.reshape((C,) + (1,) * (input.ndim - cdim - 1))
    if target.dtype.is_floating_point:  # class probabilities
        if target.shape != input.shape:
            raise RuntimeError(f"cross_entropy: probability targets must have the input's "
                               f"shape {list(input.shape)}, got {list(target.shape)}")
        t = target if label_smoothing == 0 else target * (1 - label_smoothing) + \
            label_smoothing / C
        prod = logp * t if w is None else logp * t * w
        loss = -prod.sum(cdim)
        if reduction == "mean":
            n = loss.numel()
            return _named(loss.sum() / n, "DivBackward1")
        return _named(_reduce(loss, reduction), "NegBackward0" if reduction == "none"
                      else "SumBackward0")
    idx = np.asarray(target._d)
    want = input.shape[:cdim] + input.shape[cdim + 1:]
    if idx.shape != tuple(want):
        raise RuntimeError(f"cross_entropy: class-index targets must have shape {list(want)}, "
                           f"got {list(idx.shape)}")
    keep = idx != ignore_index
    if np.any((idx[keep] < 0) | (idx[keep] >= C)):
        bad = int(idx[keep][(idx[keep] < 0) | (idx[keep] >= C)][0])
        raise IndexError(f"cross_entropy: Target {bad}"
                         f" is out of bounds for {C} classes")
    safe = np.where(keep, idx, 0)
    grids = list(np.indices(safe.shape, sparse=True))
    pick = tuple(grids[:cdim]) + (safe,) + tuple(grids[cdim:])
    picked = logp[pick]  # log p of each target class
    wt = _plain(np.where(keep, 1.0, 0.0).astype(input.dtype.np))
    if w is not None:
        wt = wt * weight[_plain(safe)]
    nll = -(picked * wt)
    if label_smoothing > 0:
        smooth = -(logp if w is None else logp * w).sum(cdim)
        smooth = smooth * _plain(np.where(keep, 1.0, 0.0).astype(input.dtype.np))
        loss = (1 - label_smoothing) * nll + (label_smoothing / C) * smooth
    else:
        loss = nll
    nll_name = "NllLoss2DBackward0" if input.ndim > 2 else "NllLossBackward0"
    if reduction == "none":
        return _named(loss, nll_name if label_smoothing == 0 else "AddBackward0")
    if reduction == "sum":
        return _named(loss.sum(), nll_name if label_smoothing == 0 else "AddBackward0")
    total = wt.sum()
    if label_smoothing == 0:
        return _named(loss.sum() / total, nll_name)
    return _named(((1 - label_smoothing) * nll.sum() / total
                   + (label_smoothing / C) * (smooth.sum() / total)), "AddBackward0")


@all_or_nothing
def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean"):
    """Negative log likelihood of log-probabilities ``input`` at class indices ``target``."""
    _check(input, "input"), _check(target, "target")
    _reduction_args(size_average, reduce, reduction)
    if input.ndim == 0:
        raise RuntimeError("nll_loss: input must have a class dimension, got a 0-d tensor")
    if target.dtype.is_floating_point:
        raise RuntimeError("nll_loss: target must hold class indices (an integer tensor)")
    return _from_logp(input, input, target, weight, ignore_index, reduction, 0.0)


__all__ = ["relu", "sigmoid", "tanh", "softmax", "log_softmax", "softplus", "logsigmoid",
           "mse_loss", "binary_cross_entropy_with_logits", "cross_entropy", "nll_loss"]
