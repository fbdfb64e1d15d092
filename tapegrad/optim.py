"""Optimizers with torch.optim's API (SGD, Adam, LBFGS) for eager tapegrad tensors.

Each optimizer holds ``param_groups`` (a list of dicts: ``"params"`` and the
hyperparameters, defaults filled in) and ``state`` (a dict keyed by parameter
tensor), and updates the parameters in place, without recording, in ``step()``.
The names, defaults, state entries, ``state_dict()`` layout and errors are those of
``torch.optim``, and so is the arithmetic, operation for operation.

The per-step arithmetic of SGD and Adam lives in the functions ``_sgd_update`` and
``_adam_update`` (module ``_optim_math``, shared with the compiled loops). They work on
flat float NumPy arrays, change them in place and use only what Numba's nopython mode
compiles, so a caller can run many steps of them inside ``numba.njit``.

Examples
--------
>>> import tapegrad
>>> import tapegrad.optim
>>> w = tapegrad.tensor([1.0, -2.0], requires_grad=True)
>>> opt = tapegrad.optim.SGD([w], lr=0.1)
>>> for _ in range(3):
...     opt.zero_grad()
...     loss = (w * w).sum()
...     loss.backward()
...     opt.step()
>>> [round(v, 6) for v in w.tolist()]
[0.512, -1.024]
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable
from copy import deepcopy
from itertools import chain

import numpy as np

from ._optim_math import _adam_update, _sgd_update  # the per-step arithmetic (shared)
from .tape import bump
from .tensor import Tensor, enable_grad, from_numpy, no_grad, tensor, zeros_like

__all__ = ["Optimizer", "SGD", "Adam", "LBFGS", "required"]

_pyfloat = float


class _RequiredParameter:
    """The default of a hyperparameter that every parameter group must set itself."""

    def __repr__(self):
        return "<required parameter>"


#: marks a hyperparameter without a default (as ``torch.optim.optimizer.required``)
required = _RequiredParameter()


# ---------------------------------------------------------------------------------------
# reading and writing a tensor's value in place


def _open(t):
    """``(flat, shared)``: ``t``'s value as a 1-d contiguous array to update in place.

    ``shared`` says whether ``flat`` is ``t``'s own storage (a writable contiguous
    array of a tensor off the tape); otherwise ``flat`` is a copy that ``_close``
    writes back.
    """
    d = t._d
    if d.__class__ is _pyfloat:
        return np.array([d]), False
    if t._tape is None and d.flags.writeable and d.flags.c_contiguous:
        return d.reshape(-1), True
    return d.flatten(), False


def _close(t, flat, shared):
    """Finish an in-place update of ``t`` opened with ``_open``: write ``flat`` back when
    it is a copy, and count the change as an in-place op does (version bump, cached tape
    entry dropped, so a backward through an older use of ``t`` reports it)."""
    d = t._d
    if shared:
        box = getattr(t, "_ver", None)
        if box is None:
            t._ver = [0]
        else:
            bump(box)
    elif d.__class__ is _pyfloat:
        t._d = _pyfloat(flat[0])
        box = getattr(t, "_ver", None)
        if box is not None:
            bump(box)
        if t._tape is not None:
            t._tape.dirty[t._slot] = len(t._tape)
    elif t._tape is None and d.flags.writeable:
        np.copyto(d, flat.reshape(d.shape))
        bump(t._ver)
    else:  # a non-leaf (its tape keeps the old array) or a read-only array: a new array
        if t._tape is not None:
            t._tape.dirty[t._slot] = len(t._tape)
        t._d = flat.reshape(d.shape)
        t._ver = [0]
    t._sid = -1


def _read(t, dtype):
    """``t``'s value as a 1-d contiguous array of ``dtype`` (a view when it can be)."""
    d = t._d
    if d.__class__ is _pyfloat:
        return np.array([d], dtype=dtype)
    return np.ascontiguousarray(d, dtype=dtype).reshape(-1)


def _np_dtype_of(t):
    d = t._d
    return np.dtype(np.float64) if d.__class__ is _pyfloat else d.dtype


def _scalar(x):
    """A hyperparameter as a Python float (1-element tensors included)."""
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"a tensor hyperparameter must have 1 element, got shape "
                             f"{tuple(x.shape)}")
        return _pyfloat(np.asarray(x._d).reshape(-1)[0])
    return _pyfloat(x)


def _typename(obj):
    if isinstance(obj, Tensor):
        return f"tapegrad.Tensor (dtype {obj.dtype})"
    cls = type(obj)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _copy_tensor(value, nd=None):
    """A new tensor with ``value``'s data (cast to NumPy dtype ``nd`` when given)."""
    a = np.array(value._d, dtype=nd)
    return tensor(a, requires_grad=bool(value._rg and a.dtype.kind == "f"))


# ---------------------------------------------------------------------------------------
# the compiled fast path: N steps on a traced Program inside Numba


def _program_params(opt, program):
    """The one parameter group's tensors, checked against the program's inputs."""
    from .replay import Program
    if not isinstance(program, Program):
        raise TypeError(f"run() takes a tapegrad.Program (from tapegrad.trace), got "
                        f"{_typename(program)}")
    if len(opt.param_groups) != 1:
        raise ValueError("run() needs an optimizer with one parameter group (the program's "
                         f"inputs); this one has {len(opt.param_groups)}")
    params = opt.param_groups[0]["params"]
    shapes = program.input_shapes
    got = [tuple(p.shape) for p in params]
    if got != list(shapes) or any(_np_dtype_of(p) != np.float64 for p in params):
        raise ValueError(f"run(): the program was traced with inputs of shapes "
                         f"{[list(s) for s in shapes]} (float64), but the optimizer's "
                         f"parameters have shapes {[list(s) for s in got]}: trace the function "
                         f"with the parameters, in order")
    if program._code.out_slots.shape[0] != 1:
        raise ValueError("run(): the program must return a scalar (the loss)")
    return params


def _flat_of(tensors):
    return np.concatenate([_read(t, np.float64) for t in tensors]) if tensors else \
        np.zeros(0)


def _write_back(tensors, flat):
    i = 0
    for t in tensors:
        f, shared = _open(t)
        n = f.shape[0]
        f[:] = flat[i:i + n]
        _close(t, f, shared)
        i += n


def _run_loop(program, params, steps, call):
    """Run ``call(code, x, k, values_slice)`` (the Numba loop) over the program's variants
    until ``steps`` steps are done; returns (values, x)."""
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"run(): steps must be a non-negative int, got {steps!r}")
    x = _flat_of(params)
    values = np.empty(steps)
    done, vi = 0, 0
    while done < steps:
        code = program._variants[vi]
        k, status = call(code, x, steps - done, values[done:], done)
        done += k
        if status:
            for vj, c in enumerate(program._variants):  # another branch's variant
                from .interpreters.replay_cpu import run
                if run(c.rows, x, c.out_slots, np.ones(1), c.in_slots, False)[0] == 0:
                    vi = vj
                    break
            else:
                xs = []
                i = 0
                for s in program.input_shapes:
                    n = int(np.prod(s))
                    xs.append(x[i:i + n].reshape(s).copy())
                    i += n
                _write_back(params, x)
                program._no_variant(code, int(status) - 1, xs)  # raises, or re-traces
                vi = len(program._variants) - 1
    return values, x


class Optimizer:
    """Base class of the optimizers (``torch.optim.Optimizer``).

    Parameters
    ----------
    params : iterable
        Tensors to optimize, ``(name, tensor)`` pairs, or dicts that define parameter
        groups (each with a ``"params"`` entry and any hyperparameters to override).
    defaults : dict
        The hyperparameters' default values, used where a group does not set them.

    Attributes
    ----------
    defaults : dict
        As given.
    param_groups : list of dict
        One dict per group: ``"params"`` (a list of tensors) and every hyperparameter.
    state : collections.defaultdict
        Per-parameter state (a dict), keyed by the parameter tensor.

    Examples
    --------
    >>> import tapegrad
    >>> from tapegrad.optim import SGD
    >>> a = tapegrad.tensor(1.0, requires_grad=True)
    >>> b = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    >>> opt = SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    >>> [g["lr"] for g in opt.param_groups]
    [0.1, 0.5]
    """

    def __init__(self, params, defaults):
        self.defaults = defaults
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            "Tensors or dicts, but got " + _typename(params))
        self.state = defaultdict(dict)
        self.param_groups = []
        try:
            it = iter(params)
        except TypeError:
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            "Tensors or dicts, but got " + _typename(params)) from None
        param_groups = list(it)
        if len(param_groups) == 0:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(param_groups[0], dict):
            param_groups = [{"params": param_groups}]
        for param_group in param_groups:
            self.add_param_group(param_group)

    def __getstate__(self):
        return {"defaults": self.defaults, "state": self.state,
                "param_groups": self.param_groups}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.defaults.setdefault("differentiable", False)

    def __repr__(self):
        lines = [self.__class__.__name__ + " ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines.extend(f"    {key}: {group[key]}" for key in sorted(group) if key != "params")
        return "\n".join(lines) + "\n)"

    def add_param_group(self, param_group):
        """Add a parameter group, with its own hyperparameters, to ``param_groups``.

        Parameters
        ----------
        param_group : dict
            ``"params"`` (a tensor, or an ordered iterable of tensors or of
            ``(name, tensor)`` pairs) and the hyperparameters to override.
            Missing hyperparameters take the optimizer's defaults.

        Raises
        ------
        TypeError
            ``param_group`` is not a dict, its params are a set, or one is not a
            tensor.
        ValueError
            A parameter is a non-leaf tensor, is already in another group, or a
            required hyperparameter is missing.

        Examples
        --------
        >>> import tapegrad
        >>> from tapegrad.optim import SGD
        >>> a = tapegrad.tensor(1.0, requires_grad=True)
        >>> opt = SGD([a], lr=0.1)
        >>> opt.add_param_group({"params": tapegrad.zeros(3, requires_grad=True), "lr": 1.0})
        >>> len(opt.param_groups), opt.param_groups[1]["momentum"]
        (2, 0)
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        try:
            params = param_group["params"]
        except KeyError:
            raise KeyError("params: a parameter group needs a 'params' entry (the tensors "
                           "to optimize)") from None
        if isinstance(params, Tensor):
            param_group["params"] = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered "
                            "collections, but the ordering of tensors in sets will change "
                            "between runs. Please use a list instead.")
        else:
            param_group["params"] = list(params)

        tensors, names = [], []
        for param in param_group["params"]:
            if isinstance(param, tuple):
                names.append(param[0])
                tensors.append(param[1])
            else:
                tensors.append(param)
        param_group["params"] = tensors
        if names:
            if len(names) != len(tensors):
                raise ValueError("all optimizer params should be with/without names. Some "
                                 "param names are missing")
            param_group["param_names"] = names

        for param in tensors:
            if not isinstance(param, Tensor):
                raise TypeError("optimizer can only optimize Tensors, but one of the params "
                                "is " + _typename(param))
            if not self.defaults.get("differentiable", None) and not (
                    param.is_leaf or param.retains_grad):
                raise ValueError("can't optimize a non-leaf Tensor")

        for name, default in self.defaults.items():
            if default is required and name not in param_group:
                raise ValueError("parameter group didn't specify a value of required "
                                 f"optimization parameter {name}")
            param_group.setdefault(name, default)

        if len(tensors) != len(set(tensors)):
            warnings.warn("optimizer contains a parameter group with duplicate parameters; "
                          "in future, this will cause an error; see "
                          "github.com/pytorch/pytorch/issues/40967 for more information",
                          stacklevel=3)

        param_set = set()
        for group in self.param_groups:
            param_set.update(group["params"])
            if ("param_names" in param_group) != ("param_names" in group):
                which = "with names" if "param_names" in param_group else "without names"
                raise ValueError("all optimizer param groups should be with/without names. "
                                 f"cannot add param group {which} to the optimizer")
        if not param_set.isdisjoint(tensors):
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(param_group)

    def zero_grad(self, set_to_none=True):
        """Reset the gradients of all the parameters.

        Parameters
        ----------
        set_to_none : bool, default True
            Set each ``.grad`` to None; otherwise fill it with zeros in place (and
            detach it). A parameter whose grad is None is skipped by ``step``, one
            whose grad is zero is not (momentum and weight decay still act).

        Examples
        --------
        >>> import tapegrad
        >>> from tapegrad.optim import SGD
        >>> w = tapegrad.tensor([1.0, 2.0], requires_grad=True)
        >>> (w * w).sum().backward()
        >>> opt = SGD([w])
        >>> opt.zero_grad(set_to_none=False)
        >>> w.grad.tolist()
        [0.0, 0.0]
        >>> opt.zero_grad()
        >>> w.grad is None
        True
        """
        for group in self.param_groups:
            for p in group["params"]:
                g = getattr(p, "_grad", None)
                if g is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if g._tape is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                flat, shared = _open(g)
                flat[:] = 0
                _close(g, flat, shared)

    def step(self, closure=None):
        """Perform one optimization step (subclasses implement it).

        Parameters
        ----------
        closure : callable, optional
            Re-evaluates the model and returns the loss (run with grad enabled).

        Returns
        -------
        The closure's return value, or None without a closure.

        Examples
        --------
        A new optimizer subclasses ``Optimizer`` and updates the parameters in place
        under ``no_grad``:

        >>> import tapegrad
        >>> from tapegrad.optim import Optimizer
        >>> class SignSGD(Optimizer):
        ...     def __init__(self, params, lr=0.1):
        ...         super().__init__(params, {"lr": lr})
        ...     def step(self, closure=None):
        ...         with tapegrad.no_grad():
        ...             for group in self.param_groups:
        ...                 for p in group["params"]:
        ...                     if p.grad is not None:
        ...                         p -= group["lr"] * tapegrad.sign(p.grad)
        >>> w = tapegrad.tensor([1.0, -1.0], requires_grad=True)
        >>> (w * w).sum().backward()
        >>> SignSGD([w]).step()
        >>> w.tolist()
        [0.9, -0.9]
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement step(): "
                                  "an Optimizer subclass must define it")

    def state_dict(self):
        """The optimizer's state, with parameters replaced by integer indices.

        Returns
        -------
        dict
            ``"state"``: per-parameter state keyed by the parameter's index (counting
            through the groups in order); ``"param_groups"``: the groups, each with
            ``"params"`` a list of indices. The state's tensors are the optimizer's own
            (as in torch): copy the dict (``copy.deepcopy``) to keep a snapshot.

        Examples
        --------
        >>> import tapegrad
        >>> from tapegrad.optim import SGD
        >>> w = tapegrad.tensor([1.0, 2.0], requires_grad=True)
        >>> opt = SGD([w], lr=0.1, momentum=0.9)
        >>> (w * w).sum().backward()
        >>> opt.step()
        >>> sd = opt.state_dict()
        >>> list(sd["state"]), sd["state"][0]["momentum_buffer"].tolist()
        ([0], [2.0, 4.0])
        >>> sd["param_groups"][0]["params"]
        [0]
        """
        mapping = {}
        start = 0

        def pack_group(group):
            nonlocal start
            packed = {k: v for k, v in group.items() if k != "params"}
            mapping.update({id(p): i for i, p in enumerate(group["params"], start)
                            if id(p) not in mapping})
            packed["params"] = [mapping[id(p)] for p in group["params"]]
            start += len(packed["params"])
            return packed

        param_groups = [pack_group(g) for g in self.param_groups]
        packed_state = {(mapping[id(k)] if isinstance(k, Tensor) else k): v
                        for k, v in self.state.items()}
        return {"state": packed_state, "param_groups": param_groups}

    @staticmethod
    def _cast_state(param, value, key=None):
        """A copy of state ``value`` for ``param``: tensors get ``param``'s floating
        dtype (except ``"step"``), containers are copied entry by entry."""
        if isinstance(value, Tensor):
            if key != "step" and param.is_floating_point():
                return _copy_tensor(value, param.dtype.np)
            return _copy_tensor(value)
        if isinstance(value, dict):
            return {k: Optimizer._cast_state(param, v, key=k) for k, v in value.items()}
        if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
            return type(value)(Optimizer._cast_state(param, v) for v in value)
        return value

    def load_state_dict(self, state_dict):
        """Load a state made by ``state_dict()`` (of an optimizer over matching groups).

        Parameters
        ----------
        state_dict : dict
            As returned by ``state_dict()``. Its tensors are copied (cast to their
            parameter's dtype), so the loaded optimizer shares no state with the source.

        Raises
        ------
        ValueError
            The number of groups, or of parameters in a group, differs.

        Examples
        --------
        >>> import copy
        >>> import tapegrad
        >>> from tapegrad.optim import Adam
        >>> w = tapegrad.tensor([1.0, 2.0], requires_grad=True)
        >>> opt = Adam([w], lr=0.1)
        >>> (w * w).sum().backward()
        >>> opt.step()
        >>> opt2 = Adam([w], lr=0.5)
        >>> opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
        >>> opt2.param_groups[0]["lr"], opt2.state[w]["step"].item()
        (0.1, 1.0)
        """
        state_dict = state_dict.copy()
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups "
                             f"({len(saved_groups)}, the optimizer has {len(groups)})")
        for g, s in zip(groups, saved_groups):
            if len(g["params"]) != len(s["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 f"match the size of optimizer's group ({len(s['params'])} "
                                 f"parameters, the optimizer's group has {len(g['params'])})")
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        state = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                state[param] = self._cast_state(param, v)
            else:
                state[k] = v

        def update_group(group, new_group):
            new_group["params"] = group["params"]
            if "param_names" in group and "param_names" not in new_group:
                new_group["param_names"] = group["param_names"]
            return new_group

        param_groups = [update_group(g, ng) for g, ng in zip(groups, saved_groups)]
        self.__setstate__({"state": state, "param_groups": param_groups})


def _check_impl_flags(foreach, fused, differentiable, capturable=False):
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    if differentiable:
        raise NotImplementedError("differentiable=True (recording the update on the tape) "
                                  "is not supported by tapegrad.optim")
    if capturable:
        raise NotImplementedError("capturable=True (CUDA graph capture) is not supported by "
                                  "tapegrad.optim")


def _check_lr(lr):
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr} (it must be >= 0)")


# ---------------------------------------------------------------------------------------
# SGD


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
        from .interpreters.optim_loop import sgd_loop
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


# ---------------------------------------------------------------------------------------
# Adam


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
        from .interpreters.optim_loop import adam_loop
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


# ---------------------------------------------------------------------------------------
# LBFGS


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

    def _step(self, closure):
        group = self.param_groups[0]
        lr = _scalar(group["lr"])
        max_iter = group["max_iter"]
        max_eval = group["max_eval"]
        tolerance_grad = group["tolerance_grad"]
        tolerance_change = group["tolerance_change"]
        line_search_fn = group["line_search_fn"]
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

                ls_func_evals = 0
                if line_search_fn is not None:
                    if line_search_fn != "strong_wolfe":
                        raise RuntimeError("only 'strong_wolfe' is supported (got "
                                           f"line_search_fn={line_search_fn!r})")
                    x_init = self._clone_param()

                    def obj_func(x, t, d):
                        return self._directional_evaluate(closure, x, t, d)

                    loss, flat_grad, t, ls_func_evals = _strong_wolfe(
                        obj_func, x_init, t, d, loss, flat_grad, gtd,
                        max_ls=max_eval - current_evals)
                    self._add_grad(t, d)
                    opt_cond = np.abs(flat_grad).max() <= tolerance_grad
                else:
                    self._add_grad(t, d)
                    if n_iter != max_iter:
                        loss = _pyfloat(closure())
                        flat_grad = self._gather_flat_grad()
                        opt_cond = np.abs(flat_grad).max() <= tolerance_grad
                        ls_func_evals = 1

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
