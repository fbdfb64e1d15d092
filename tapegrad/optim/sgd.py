"""``SGD`` (``torch.optim.SGD``), eagerly and as N compiled steps on a traced Program."""
from __future__ import annotations

import numpy as np

from .._optim_math import _sgd_update
from ..tensor import enable_grad, no_grad, zeros_like
from ._compiled import _flat_of, _program_params, _run_loop, _write_back
from ._values import _close, _open, _read, _scalar
from .optimizer import Optimizer, _check_impl_flags, _check_lr

class SGD(Optimizer):
    """Stochastic gradient descent, optionally with momentum (``torch.optim.SGD``).

    Parameters
    ----------
    params : iterable
        Tensors or parameter-group dicts (see ``Optimizer``).
    lr : float, default 1e-3
        Learning rate.
    momentum : float, default 0
        Momentum factor.
    dampening : float, default 0
        Dampening of the momentum.
    weight_decay : float, default 0
        L2 penalty, added to the gradient as ``weight_decay * param``.
    nesterov : bool, default False
        Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
    maximize : bool, default False
        Maximize the objective instead of minimizing it.
    foreach, fused : None or bool
        Accepted for compatibility; tapegrad has one implementation.
    differentiable : bool, default False
        Only False is supported.

    Notes
    -----
    The state of each parameter with momentum is ``{"momentum_buffer": tensor}``.
    The arithmetic is ``_sgd_update``.

    Examples
    --------
    >>> import tapegrad
    >>> from tapegrad.optim import SGD
    >>> x = tapegrad.tensor(0.0, requires_grad=True)
    >>> opt = SGD([x], lr=0.1, momentum=0.5)
    >>> for _ in range(50):
    ...     opt.zero_grad()
    ...     loss = (x - 3) ** 2
    ...     loss.backward()
    ...     opt.step()
    >>> round(x.item(), 6)
    3.0
    """

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None):
        _check_lr(lr)
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum} (it must be >= 0)")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (it must be >= 0)")
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                    "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize,
                    "foreach": foreach, "differentiable": differentiable, "fused": fused}
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening "
                             f"(got momentum={momentum}, dampening={dampening})")
        _check_impl_flags(foreach, fused, differentiable)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("differentiable", False)
            group.setdefault("fused", False)

    def step(self, closure=None):
        """Perform one SGD step on every parameter that has a gradient.

        Parameters
        ----------
        closure : callable, optional
            Re-evaluates the model and returns the loss; it runs first, with grad
            enabled.

        Returns
        -------
        The closure's return value, or None.

        Examples
        --------
        >>> import tapegrad
        >>> from tapegrad.optim import SGD
        >>> w = tapegrad.tensor([1.0], requires_grad=True)
        >>> opt = SGD([w], lr=0.25)
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = (w * w).sum()
        ...     loss.backward()
        ...     return loss
        >>> opt.step(closure).item(), w.tolist()
        (1.0, [0.5])
        """
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        with no_grad():
            for group in self.param_groups:
                lr = _scalar(group["lr"])
                momentum = _scalar(group["momentum"])
                dampening = _scalar(group["dampening"])
                weight_decay = _scalar(group["weight_decay"])
                nesterov = bool(group["nesterov"])
                maximize = bool(group["maximize"])
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    flat, shared = _open(p)
                    grad = _read(g, flat.dtype)
                    if momentum != 0.0:
                        state = self.state[p]
                        buf_t = state.get("momentum_buffer")
                        first = buf_t is None
                        if first:
                            buf_t = zeros_like(g)
                        bflat, bshared = _open(buf_t)
                    else:
                        bflat, first = flat[:0], False
                    _sgd_update(flat, grad, bflat, lr, momentum, dampening, weight_decay,
                                nesterov, maximize, first)
                    _close(p, flat, shared)
                    if momentum != 0.0:
                        _close(buf_t, bflat, bshared)
                        state["momentum_buffer"] = buf_t
        return loss

    def run(self, program, steps):
        """Run ``steps`` SGD steps on ``program``'s value entirely inside Numba.

        ``program`` is a :class:`tapegrad.Program` traced with this optimizer's parameters
        as its inputs (one parameter group, in order) and the loss as its output. The
        parameters and the momentum buffers end as ``steps`` calls of ``step()`` after
        ``backward()`` would leave them. Returns the loss before each step (an array).

        Examples
        --------
        >>> import numpy as np, tapegrad
        >>> from tapegrad.optim import SGD
        >>> x = tapegrad.zeros(2, requires_grad=True)
        >>> prog = tapegrad.trace(lambda x: ((x - 3.0) ** 2).sum(), x)
        >>> losses = SGD([x], lr=0.1, momentum=0.5).run(prog, 100)
        >>> np.round(x.detach().numpy(), 6).tolist()
        [3.0, 3.0]
        """
        from ..interpreters.optim_loop import sgd_loop
        params = _program_params(self, program)
        g = self.param_groups[0]
        momentum = _scalar(g["momentum"])
        bufs = [self.state[p].get("momentum_buffer") for p in params]
        first = momentum != 0.0 and any(b is None for b in bufs)
        if first and any(b is not None for b in bufs):
            raise ValueError("run(): some parameters have momentum buffers and some do not")
        buf = np.zeros(sum(p.numel() for p in params)) if first or momentum == 0.0 else \
            _flat_of(bufs)

        def call(code, x, k, values, done):
            return sgd_loop(code.rows, x, code.out_slots, code.in_slots, k,
                            first and done == 0, _scalar(g["lr"]), momentum,
                            _scalar(g["dampening"]), _scalar(g["weight_decay"]),
                            bool(g["nesterov"]), bool(g["maximize"]), buf, values)
        with no_grad():
            values, x = _run_loop(program, params, steps, call)
            _write_back(params, x)
            if momentum != 0.0 and steps:
                if first:
                    for p in params:
                        self.state[p]["momentum_buffer"] = zeros_like(p)
                _write_back([self.state[p]["momentum_buffer"] for p in params], buf)
        return values

