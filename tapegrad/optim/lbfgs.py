"""``LBFGS`` (``torch.optim.LBFGS``) and its strong-Wolfe line search."""
from __future__ import annotations

import numpy as np

from ..tensor import Tensor, enable_grad, from_numpy, no_grad, tensor
from ._values import _close, _np_dtype_of, _open, _pyfloat, _read, _scalar
from .optimizer import Optimizer, _check_lr

def _cubic_interpolate(x1, f1, g1, x2, f2, g2, bounds=None):
    """Minimizer of the cubic through two points with their values and slopes, clamped
    to ``bounds`` (default: the interval between the points); the midpoint when the
    cubic has no minimizer."""
    if bounds is not None:
        xmin_bound, xmax_bound = bounds
    else:
        xmin_bound, xmax_bound = (x1, x2) if x1 <= x2 else (x2, x1)
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    d2_square = d1 ** 2 - g1 * g2
    if d2_square >= 0:
        d2 = np.sqrt(d2_square)
        if x1 <= x2:
            min_pos = x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
        else:
            min_pos = x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2))
        return min(max(min_pos, xmin_bound), xmax_bound)
    return (xmin_bound + xmax_bound) / 2.0


def _strong_wolfe(obj_func, x, t, d, f, g, gtd, c1=1e-4, c2=0.9, tolerance_change=1e-9,
                  max_ls=25):
    """Line search for a step ``t`` along ``d`` that satisfies the strong Wolfe
    conditions (bracketing, then zoom by cubic interpolation; torch's ``_strong_wolfe``).

    Returns ``(f_new, g_new, t, evaluations)``.
    """
    d_norm = np.abs(d).max()
    g = g.copy()
    f_new, g_new = obj_func(x, t, d)
    ls_func_evals = 1
    gtd_new = g_new.dot(d)

    # bracket an interval that holds a point satisfying the conditions
    t_prev, f_prev, g_prev, gtd_prev = 0, f, g, gtd
    done = False
    ls_iter = 0
    while ls_iter < max_ls:
        if f_new > (f + c1 * t * gtd) or (ls_iter > 1 and f_new >= f_prev):
            bracket, bracket_f = [t_prev, t], [f_prev, f_new]
            bracket_g, bracket_gtd = [g_prev, g_new.copy()], [gtd_prev, gtd_new]
            break
        if abs(gtd_new) <= -c2 * gtd:
            bracket, bracket_f, bracket_g = [t], [f_new], [g_new]
            done = True
            break
        if gtd_new >= 0:
            bracket, bracket_f = [t_prev, t], [f_prev, f_new]
            bracket_g, bracket_gtd = [g_prev, g_new.copy()], [gtd_prev, gtd_new]
            break
        min_step = t + 0.01 * (t - t_prev)
        max_step = t * 10
        tmp = t
        t = _cubic_interpolate(t_prev, f_prev, gtd_prev, t, f_new, gtd_new,
                               bounds=(min_step, max_step))
        t_prev, f_prev, g_prev, gtd_prev = tmp, f_new, g_new.copy(), gtd_new
        f_new, g_new = obj_func(x, t, d)
        ls_func_evals += 1
        gtd_new = g_new.dot(d)
        ls_iter += 1

    if ls_iter == max_ls:
        bracket, bracket_f, bracket_g = [0, t], [f, f_new], [g, g_new]

    # zoom: shrink the bracket until a point satisfies the conditions
    insuf_progress = False
    low_pos, high_pos = (0, 1) if bracket_f[0] <= bracket_f[-1] else (1, 0)
    while not done and ls_iter < max_ls:
        if abs(bracket[1] - bracket[0]) * d_norm < tolerance_change:
            break
        t = _cubic_interpolate(bracket[0], bracket_f[0], bracket_gtd[0],
                               bracket[1], bracket_f[1], bracket_gtd[1])
        # too close to an end of the bracket: move 10% of its length inside
        eps = 0.1 * (max(bracket) - min(bracket))
        if min(max(bracket) - t, t - min(bracket)) < eps:
            if insuf_progress or t >= max(bracket) or t <= min(bracket):
                if abs(t - max(bracket)) < abs(t - min(bracket)):
                    t = max(bracket) - eps
                else:
                    t = min(bracket) + eps
                insuf_progress = False
            else:
                insuf_progress = True
        else:
            insuf_progress = False

        f_new, g_new = obj_func(x, t, d)
        ls_func_evals += 1
        gtd_new = g_new.dot(d)
        ls_iter += 1

        if f_new > (f + c1 * t * gtd) or f_new >= bracket_f[low_pos]:
            # Armijo fails, or no lower than the low end: the new point is the high end
            bracket[high_pos] = t
            bracket_f[high_pos] = f_new
            bracket_g[high_pos] = g_new.copy()
            bracket_gtd[high_pos] = gtd_new
            low_pos, high_pos = (0, 1) if bracket_f[0] <= bracket_f[1] else (1, 0)
        else:
            if abs(gtd_new) <= -c2 * gtd:
                done = True
            elif gtd_new * (bracket[high_pos] - bracket[low_pos]) >= 0:
                bracket[high_pos] = bracket[low_pos]
                bracket_f[high_pos] = bracket_f[low_pos]
                bracket_g[high_pos] = bracket_g[low_pos]
                bracket_gtd[high_pos] = bracket_gtd[low_pos]
            bracket[low_pos] = t
            bracket_f[low_pos] = f_new
            bracket_g[low_pos] = g_new.copy()
            bracket_gtd[low_pos] = gtd_new

    return bracket_f[low_pos], bracket_g[low_pos], bracket[low_pos], ls_func_evals


def _unwrap(v):
    """LBFGS state entry -> NumPy: 1-d tensors to their arrays, 0-d tensors to scalars
    of their dtype, lists entry by entry."""
    if isinstance(v, Tensor):
        d = v._d
        if d.__class__ is _pyfloat:
            return np.float64(d)  # a 0-d tensor again when wrapped back
        if d.ndim == 0:
            return d[()]
        return np.ascontiguousarray(d).reshape(-1)
    if isinstance(v, list):
        return [_unwrap(e) for e in v]
    return v


def _wrap(v):
    """NumPy -> LBFGS state entry (the inverse of ``_unwrap``; arrays are shared)."""
    if isinstance(v, np.ndarray):
        return from_numpy(v)
    if isinstance(v, np.generic):
        return tensor(v)
    if isinstance(v, list):
        return [_wrap(e) for e in v]
    return v


def _two_loop(state, flat_grad, prev_flat_grad, d, t, old_dirs, old_stps, ro, H_diag,
              history_size):
    """The next descent direction: the history (``old_dirs``, ``old_stps``, ``ro``, changed in
    place) updated with the last step, then L-BFGS's two-loop recursion. Returns
    ``(d, H_diag)``."""
    y = flat_grad - prev_flat_grad
    s = d * t
    ys = y.dot(s)
    if ys > 1e-10:
        if len(old_dirs) == history_size:
            old_dirs.pop(0)
            old_stps.pop(0)
            ro.pop(0)
        old_dirs.append(y)
        old_stps.append(s)
        ro.append(1.0 / ys)
        H_diag = ys / y.dot(y)
    num_old = len(old_dirs)
    if "al" not in state:
        state["al"] = [None] * history_size
    al = state["al"] = _unwrap(state["al"])
    # two-loop recursion, one buffer
    q = -flat_grad
    for i in range(num_old - 1, -1, -1):
        al[i] = old_stps[i].dot(q) * ro[i]
        q += (-al[i]) * old_dirs[i]
    d = r = q * H_diag
    for i in range(num_old):
        be_i = old_dirs[i].dot(r) * ro[i]
        r += (al[i] - be_i) * old_stps[i]
    return d, H_diag


class LBFGS(Optimizer):
    """L-BFGS (``torch.optim.LBFGS``), optionally with a strong-Wolfe line search.

    Parameters
    ----------
    params : iterable
        Tensors to optimize (one group only).
    lr : float, default 1
        Learning rate (the initial step length).
    max_iter : int, default 20
        Most iterations per ``step``.
    max_eval : int, optional
        Most function evaluations per ``step`` (default ``max_iter * 5 // 4``).
    tolerance_grad : float, default 1e-7
        Stop when the largest absolute gradient entry is at most this.
    tolerance_change : float, default 1e-9
        Stop when the function value or the step changes less than this.
    history_size : int, default 100
        Number of updates kept for the inverse-Hessian approximation.
    line_search_fn : None or "strong_wolfe"
        The line search; None takes fixed steps of length ``lr``.

    Notes
    -----
    ``step`` needs a closure that clears the gradients, computes the loss, calls
    ``backward`` and returns the loss. The state (the history and the last direction)
    is stored under the first parameter, as in torch.

    Examples
    --------
    >>> import tapegrad
    >>> from tapegrad.optim import LBFGS
    >>> x = tapegrad.tensor([-1.2, 1.0], requires_grad=True)
    >>> opt = LBFGS([x], lr=1, max_iter=100, line_search_fn="strong_wolfe")
    >>> def closure():
    ...     opt.zero_grad()
    ...     loss = 100 * (x[1] - x[0] ** 2) ** 2 + (1 - x[0]) ** 2
    ...     loss.backward()
    ...     return loss
    >>> _ = opt.step(closure)
    >>> [round(v, 3) for v in x.tolist()]
    [1.0, 1.0]
    """

    def __init__(self, params, lr=1, max_iter=20, max_eval=None, tolerance_grad=1e-7,
                 tolerance_change=1e-9, history_size=100, line_search_fn=None):
        _check_lr(lr)
        if max_eval is None:
            max_eval = max_iter * 5 // 4
        defaults = {"lr": lr, "max_iter": max_iter, "max_eval": max_eval,
                    "tolerance_grad": tolerance_grad, "tolerance_change": tolerance_change,
                    "history_size": history_size, "line_search_fn": line_search_fn}
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError("LBFGS doesn't support per-parameter options (parameter groups)")

    @property
    def _params(self):
        return self.param_groups[0]["params"]

    def _dtype(self):
        return np.result_type(*(_np_dtype_of(p) for p in self._params))

    def _gather_flat_grad(self):
        dt = self._dtype()
        parts = []
        for p in self._params:
            g = getattr(p, "_grad", None)
            parts.append(np.zeros(p.numel(), dtype=dt) if g is None else _read(g, dt))
        return np.concatenate(parts)

    def _add_grad(self, step_size, update):
        offset = 0
        for p in self._params:
            flat, shared = _open(p)
            n = flat.size
            flat += flat.dtype.type(step_size) * update[offset:offset + n]
            _close(p, flat, shared)
            offset += n

    def _clone_param(self):
        return [_read(p, _np_dtype_of(p)).copy() for p in self._params]

    def _set_param(self, params_data):
        for p, data in zip(self._params, params_data):
            flat, shared = _open(p)
            flat[:] = data
            _close(p, flat, shared)

    def _directional_evaluate(self, closure, x, t, d):
        self._add_grad(t, d)
        loss = _pyfloat(closure())
        flat_grad = self._gather_flat_grad()
        self._set_param(x)
        return loss, flat_grad

    def step(self, closure):
        """Run up to ``max_iter`` L-BFGS iterations.

        Parameters
        ----------
        closure : callable
            Clears the gradients, evaluates the loss, calls ``backward`` and returns
            the loss; it runs with grad enabled, possibly several times.

        Returns
        -------
        The closure's return value at the starting point.

        Raises
        ------
        TypeError
            No closure (or one that is not callable).
        RuntimeError
            ``line_search_fn`` is neither None nor ``"strong_wolfe"``.

        Examples
        --------
        >>> import tapegrad
        >>> from tapegrad.optim import LBFGS
        >>> x = tapegrad.tensor(3.0, requires_grad=True)
        >>> opt = LBFGS([x])
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = (x - 1) ** 2
        ...     loss.backward()
        ...     return loss
        >>> opt.step(closure).item()  # the loss at the start
        4.0
        >>> round(x.item(), 9)
        1.0
        """
        if not callable(closure):
            raise TypeError(f"LBFGS.step() needs a closure that re-evaluates the loss, "
                            f"got {type(closure).__name__} ('{type(closure).__name__}' "
                            "object is not callable)")
        if len(self.param_groups) != 1:
            raise AssertionError("Expected exactly one param_group, but got "
                                 f"{len(self.param_groups)}")
        user_closure = closure

        def closure():
            with enable_grad():
                return user_closure()

        with no_grad():
            return self._step(closure)

    def _move(self, closure, group, loss, flat_grad, t, d, gtd, opt_cond, last, max_ls):
        """One step along ``d``: with the line search, or of length ``t`` (then the loss and
        gradient there are evaluated unless this is the ``last`` iteration). Returns
        ``(loss, flat_grad, t, opt_cond, function evaluations)``."""
        line_search_fn = group["line_search_fn"]
        tolerance_grad = group["tolerance_grad"]
        if line_search_fn is not None:
            if line_search_fn != "strong_wolfe":
                raise RuntimeError("only 'strong_wolfe' is supported (got "
                                   f"line_search_fn={line_search_fn!r})")
            x_init = self._clone_param()

            def obj_func(x, t, d):
                return self._directional_evaluate(closure, x, t, d)

            loss, flat_grad, t, ls_func_evals = _strong_wolfe(
                obj_func, x_init, t, d, loss, flat_grad, gtd, max_ls=max_ls)
            self._add_grad(t, d)
            return loss, flat_grad, t, np.abs(flat_grad).max() <= tolerance_grad, ls_func_evals
        self._add_grad(t, d)
        if last:
            return loss, flat_grad, t, opt_cond, 0
        loss = _pyfloat(closure())
        flat_grad = self._gather_flat_grad()
        return loss, flat_grad, t, np.abs(flat_grad).max() <= tolerance_grad, 1

    def _step(self, closure):
        group = self.param_groups[0]
        lr = _scalar(group["lr"])
        max_iter = group["max_iter"]
        max_eval = group["max_eval"]
        tolerance_grad = group["tolerance_grad"]
        tolerance_change = group["tolerance_change"]
        history_size = group["history_size"]

        state = self.state[self._params[0]]
        state.setdefault("func_evals", 0)
        state.setdefault("n_iter", 0)

        orig_loss = closure()
        loss = _pyfloat(orig_loss)
        current_evals = 1
        state["func_evals"] += 1

        flat_grad = self._gather_flat_grad()
        opt_cond = np.abs(flat_grad).max() <= tolerance_grad
        if opt_cond:
            return orig_loss

        d = _unwrap(state.get("d"))
        t = _unwrap(state.get("t"))
        old_dirs = _unwrap(state.get("old_dirs"))
        old_stps = _unwrap(state.get("old_stps"))
        ro = _unwrap(state.get("ro"))
        H_diag = _unwrap(state.get("H_diag"))
        prev_flat_grad = _unwrap(state.get("prev_flat_grad"))
        prev_loss = state.get("prev_loss")

        n_iter = 0
        try:
            while n_iter < max_iter:
                n_iter += 1
                state["n_iter"] += 1

                # the descent direction
                if state["n_iter"] == 1:
                    d = -flat_grad
                    old_dirs, old_stps, ro = [], [], []
                    H_diag = 1
                else:
                    d, H_diag = _two_loop(state, flat_grad, prev_flat_grad, d, t, old_dirs,
                                          old_stps, ro, H_diag, history_size)

                if prev_flat_grad is None:
                    prev_flat_grad = flat_grad.copy()
                else:
                    prev_flat_grad[:] = flat_grad
                prev_loss = loss

                # the step length
                if state["n_iter"] == 1:
                    t = min(1.0, 1.0 / np.abs(flat_grad).sum()) * lr
                else:
                    t = lr
                gtd = flat_grad.dot(d)
                if gtd > -tolerance_change:
                    break

                loss, flat_grad, t, opt_cond, ls_func_evals = self._move(
                    closure, group, loss, flat_grad, t, d, gtd, opt_cond,
                    last=n_iter == max_iter, max_ls=max_eval - current_evals)

                current_evals += ls_func_evals
                state["func_evals"] += ls_func_evals

                if n_iter == max_iter:
                    break
                if current_evals >= max_eval:
                    break
                if opt_cond:
                    break
                if np.abs(d * t).max() <= tolerance_change:
                    break
                if abs(loss - prev_loss) < tolerance_change:
                    break
        finally:
            if "al" in state:
                state["al"] = _wrap(state["al"])

        state["d"] = _wrap(d)
        state["t"] = _wrap(t)
        state["old_dirs"] = _wrap(old_dirs)
        state["old_stps"] = _wrap(old_stps)
        state["ro"] = _wrap(ro)
        state["H_diag"] = _wrap(H_diag)
        state["prev_flat_grad"] = _wrap(prev_flat_grad)
        state["prev_loss"] = prev_loss
        return orig_loss
