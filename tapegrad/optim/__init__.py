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

The package's modules: ``optimizer`` (the base class, ``required``), ``sgd``, ``adam``,
``lbfgs`` (with its strong-Wolfe line search), ``_values`` (reading and writing a
parameter's value in place) and ``_compiled`` (N steps of a traced Program inside Numba).

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
from .._optim_math import _adam_update, _sgd_update  # the per-step arithmetic (shared)
from .adam import Adam
from .lbfgs import LBFGS
from .optimizer import Optimizer, required
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "LBFGS", "required"]
