"""``Optimizer``, the base class of the optimizers (``torch.optim.Optimizer``), and
``required``."""
from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable
from copy import deepcopy
from itertools import chain


from ..tensor import Tensor
from ._values import _close, _copy_tensor, _open, _typename

class _RequiredParameter:
    """The default of a hyperparameter that every parameter group must set itself."""

    def __repr__(self):
        return "<required parameter>"


#: marks a hyperparameter without a default (as ``torch.optim.optimizer.required``)
required = _RequiredParameter()


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

