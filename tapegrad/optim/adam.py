"""``Adam`` (``torch.optim.Adam``), eagerly and as N compiled steps on a traced Program."""
from __future__ import annotations

import numpy as np

from .._optim_math import _adam_update
from ..tensor import Tensor, enable_grad, no_grad, tensor, zeros_like
from ._compiled import _flat_of, _program_params, _run_loop, _write_back
from ._values import _close, _open, _pyfloat, _read, _scalar
from .optimizer import Optimizer, _check_impl_flags, _check_lr

class Adam(Optimizer):
    """Adam (``torch.optim.Adam``), optionally AMSGrad.

    Parameters
    ----------
    params : iterable
        Tensors or parameter-group dicts (see ``Optimizer``).
    lr : float, default 1e-3
        Learning rate.
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the running averages of the gradient and of its square, each in
        [0, 1). Both floats (or both 1-element tensors).
    eps : float, default 1e-8
        Added to the denominator.
    weight_decay : float, default 0
        L2 penalty, added to the gradient as ``weight_decay * param``.
    amsgrad : bool, default False
        Use the running maximum of the squared-gradient average (AMSGrad).
    maximize : bool, default False
        Maximize the objective instead of minimizing it.
    foreach, fused : None or bool
        Accepted for compatibility; tapegrad has one implementation.
    capturable, differentiable, decoupled_weight_decay : bool, default False
        Only False is supported.

    Notes
    -----
    A parameter's state, made on its first step: ``"step"`` (a 0-d float64 tensor
    counting the steps), ``"exp_avg"``, ``"exp_avg_sq"`` and with ``amsgrad``
    ``"max_exp_avg_sq"``. The arithmetic is ``_adam_update``.

    Examples
    --------
    >>> import tapegrad
    >>> from tapegrad.optim import Adam
    >>> x = tapegrad.tensor([0.0, 1.0], requires_grad=True)
    >>> opt = Adam([x], lr=0.1)
    >>> for _ in range(300):
    ...     opt.zero_grad()
    ...     loss = ((x - 2) ** 2).sum()
    ...     loss.backward()
    ...     opt.step()
    >>> [round(v, 3) for v in x.tolist()]
    [2.0, 2.0]
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False):
        _check_lr(lr)
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps} (it must be >= 0)")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]} (it must be in "
                             "[0, 1))")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]} (it must be in "
                             "[0, 1))")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (it must be >= 0)")
        if not (isinstance(betas[0], float) and isinstance(betas[1], float)
                or isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor)):
            raise ValueError(f"betas must be either both floats or both Tensors (got "
                             f"{type(betas[0]).__name__} and {type(betas[1]).__name__})")
        for i, b in enumerate(betas):
            if isinstance(b, Tensor) and b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
        if decoupled_weight_decay:
            raise NotImplementedError("decoupled_weight_decay=True (AdamW) is not supported "
                                      "by tapegrad.optim")
        _check_impl_flags(foreach, fused, differentiable, capturable)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps,
                    "weight_decay": weight_decay, "amsgrad": amsgrad, "maximize": maximize,
                    "foreach": foreach, "capturable": capturable,
                    "differentiable": differentiable, "fused": fused,
                    "decoupled_weight_decay": decoupled_weight_decay}
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("decoupled_weight_decay", False)
            group.setdefault("fused", None)
            for p in group["params"]:
                p_state = self.state.get(p, [])
                if len(p_state) != 0 and not isinstance(p_state["step"], Tensor):
                    p_state["step"] = tensor(_pyfloat(p_state["step"]))

    def step(self, closure=None):
        """Perform one Adam step on every parameter that has a gradient.

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
        >>> from tapegrad.optim import Adam
        >>> w = tapegrad.tensor(1.0, requires_grad=True)
        >>> opt = Adam([w], lr=0.1)
        >>> (w * w).backward()
        >>> opt.step()
        >>> round(w.item(), 9), opt.state[w]["step"].item()
        (0.9, 1.0)
        """
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        with no_grad():
            for group in self.param_groups:
                lr = _scalar(group["lr"])
                beta1, beta2 = (_scalar(b) for b in group["betas"])
                eps = _scalar(group["eps"])
                weight_decay = _scalar(group["weight_decay"])
                amsgrad = bool(group["amsgrad"])
                maximize = bool(group["maximize"])
                if group.get("decoupled_weight_decay", False):
                    raise NotImplementedError("decoupled_weight_decay=True (AdamW) is not "
                                              "supported by tapegrad.optim")
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    state = self._init_state(p, amsgrad)
                    step_t = state["step"]
                    sflat, sshared = _open(step_t)
                    sflat += 1
                    step = _pyfloat(sflat[0])
                    _close(step_t, sflat, sshared)

                    flat, shared = _open(p)
                    grad = _read(g, flat.dtype)
                    m_t, v_t = state["exp_avg"], state["exp_avg_sq"]
                    m, m_shared = _open(m_t)
                    v, v_shared = _open(v_t)
                    if amsgrad:
                        vmax_t = state["max_exp_avg_sq"]
                        vmax, vmax_shared = _open(vmax_t)
                    else:
                        vmax = flat[:0]
                    _adam_update(flat, grad, m, v, vmax, step, lr, beta1, beta2, eps,
                                 weight_decay, amsgrad, maximize)
                    _close(p, flat, shared)
                    _close(m_t, m, m_shared)
                    _close(v_t, v, v_shared)
                    if amsgrad:
                        _close(vmax_t, vmax, vmax_shared)
        return loss

    def _init_state(self, p, amsgrad):
        """``p``'s state, made on its first step: step count and running averages."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = tensor(0.0)
            state["exp_avg"] = zeros_like(p)
            state["exp_avg_sq"] = zeros_like(p)
            if amsgrad:
                state["max_exp_avg_sq"] = zeros_like(p)
        return state

    def run(self, program, steps):
        """Run ``steps`` Adam steps on ``program``'s value entirely inside Numba.

        ``program`` is a :class:`tapegrad.Program` traced with this optimizer's parameters
        as its inputs (one parameter group, in order) and the loss as its output. The
        parameters and the state (``step``, ``exp_avg``, ...) end as ``steps`` calls of
        ``step()`` after ``backward()`` would leave them. Returns the loss before each
        step (an array).

        Examples
        --------
        >>> import numpy as np, tapegrad
        >>> from tapegrad.optim import Adam
        >>> x = tapegrad.zeros(2, requires_grad=True)
        >>> prog = tapegrad.trace(lambda x: ((x - 3.0) ** 2).sum(), x)
        >>> losses = Adam([x], lr=0.1).run(prog, 2000)
        >>> np.round(x.detach().numpy(), 4).tolist()
        [3.0, 3.0]
        """
        from ..interpreters.optim_loop import adam_loop
        params = _program_params(self, program)
        g = self.param_groups[0]
        amsgrad = bool(g["amsgrad"])
        if g.get("decoupled_weight_decay", False):
            raise NotImplementedError("decoupled_weight_decay=True (AdamW) is not supported "
                                      "by tapegrad.optim")
        for p in params:
            self._init_state(p, amsgrad)
        counts = {float(self.state[p]["step"].item()) for p in params}
        if len(counts) > 1:
            raise ValueError("run(): the parameters have taken different numbers of steps "
                             f"({sorted(counts)}); the compiled loop needs one count")
        step0 = counts.pop() if counts else 0.0
        m = _flat_of([self.state[p]["exp_avg"] for p in params])
        v = _flat_of([self.state[p]["exp_avg_sq"] for p in params])
        vmax = _flat_of([self.state[p]["max_exp_avg_sq"] for p in params]) if amsgrad else \
            np.zeros(0)
        beta1, beta2 = (_scalar(b) for b in g["betas"])

        def call(code, x, k, values, done):
            return adam_loop(code.rows, x, code.out_slots, code.in_slots, k, step0 + done,
                             _scalar(g["lr"]), beta1, beta2, _scalar(g["eps"]),
                             _scalar(g["weight_decay"]), amsgrad, bool(g["maximize"]), m, v,
                             vmax, values)
        with no_grad():
            values, x = _run_loop(program, params, steps, call)
            _write_back(params, x)
            _write_back([self.state[p]["exp_avg"] for p in params], m)
            _write_back([self.state[p]["exp_avg_sq"] for p in params], v)
            if amsgrad:
                _write_back([self.state[p]["max_exp_avg_sq"] for p in params], vmax)
            for p in params:
                _write_back([self.state[p]["step"]], np.array([step0 + steps]))
        return values

