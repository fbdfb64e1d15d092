"""Tensor factories: tensor, as_tensor, from_numpy, zeros, ones, full, arange and the rest."""
from __future__ import annotations

import re
import warnings

import numpy as np

from ._dtypes import _DTYPES, _F64, _np_dtype, _pybool, _pyfloat, _pyint
from ._recorder import _to_dtype
from ._tensor_class import Tensor, _leaf
from .tape import STATE


#: the device types torch knows (its error for any other names them)
_DEVICE_TYPES = ("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve",
                 "fpga", "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia",
                 "privateuseone")
_DEVICE_STRING = re.compile(r"([a-zA-Z_]+)(?::(0|[1-9][0-9]*))?")


def check_device(device, fname):
    """A factory's ``device`` argument, as torch's CPU build takes it: None, ``"cpu"``,
    ``"cpu:N"`` (or a torch.device of type cpu) pass; anything else raises what torch raises
    there, saying that tapegrad tensors live on the CPU. torch accepts ``"meta"`` (shape-only
    tensors); tapegrad has none and raises NotImplementedError rather than make a CPU one."""
    if device is None:
        return
    if isinstance(device, str):
        text = device
    elif isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise RuntimeError("Device index must not be negative")
        raise RuntimeError(f"Cannot access accelerator device when none is available: device="
                           f"{device} names an accelerator; tapegrad tensors live on the CPU "
                           "(device='cpu', or leave it out)")
    elif hasattr(device, "type") and hasattr(device, "index"):  # a torch.device
        text = str(device)
    else:
        raise TypeError(f"{fname}(): argument 'device' must be torch.device, not "
                        f"{type(device).__name__}")
    m = _DEVICE_STRING.fullmatch(text)
    if m is None:
        raise RuntimeError(f"Invalid device string: {text!r}")
    kind = m.group(1)
    if kind not in _DEVICE_TYPES:
        raise RuntimeError(f"Expected one of {', '.join(_DEVICE_TYPES)} device type at start "
                           f"of device string: {text}")
    if kind == "cpu":
        return
    where = ("tapegrad tensors live on the CPU: pass device='cpu' or leave it out (a traced "
             "program runs on an NVIDIA GPU with target='cuda', see docs/cuda.md)")
    if kind == "meta":
        raise NotImplementedError(f"{fname}(): meta tensors (device='meta') are not supported "
                                  f"by tapegrad; {where}")
    if kind in ("cuda", "xpu"):  # what torch's CPU build raises for these
        raise AssertionError(f"{fname}(): device {text!r} is not available; {where}")
    # torch raises RuntimeError (tensor, to) or NotImplementedError (the rest), its subclass
    raise NotImplementedError(f"{fname}(): device {text!r} is not supported; {where}")


def _infer_np(data, nd):
    if isinstance(data, Tensor):
        tr = STATE.trace
        if tr is not None:  # a copy of a traced value is a constant: guarded
            tr.on_escape(data, "tapegrad.tensor()")
        return np.array(data._d, dtype=nd)
    if isinstance(data, (list, tuple)):
        data = [d.tolist() if isinstance(d, Tensor) else d for d in data]
    try:
        a = np.array(data, dtype=nd)
    except ValueError as e:
        raise ValueError(f"tapegrad.tensor could not make a tensor from {type(data).__name__}: "
                         f"{e} (nested sequences must be rectangular)") from None
    except TypeError as e:
        raise TypeError(f"tapegrad.tensor could not make a tensor from {type(data).__name__}: "
                        f"{e}") from None
    if a.dtype == object:
        raise TypeError(f"tapegrad.tensor could not make a tensor from {data!r}: elements "
                        "must be numbers (nested lists must be rectangular)")
    if a.dtype.kind in "US":
        raise TypeError(f"tapegrad.tensor expects numbers, got strings: {data!r}")
    return a


def _finish(a, requires_grad, share=False):
    """ndarray -> leaf tensor (0-d float64 becomes a Python float unless ``share``)."""
    if not isinstance(requires_grad, _pybool):
        raise TypeError(f"requires_grad must be a bool, got {type(requires_grad).__name__}")
    if a.dtype.kind == "c":
        raise TypeError("complex tensors are not supported by tapegrad yet; use float64 or "
                        "float32 (complex support is planned)")
    if a.dtype not in _DTYPES:
        if a.dtype.kind == "f":
            a = a.astype(np.float64)
        elif a.dtype.kind in "iu":
            a = a.astype(np.int64)
        else:
            raise TypeError(f"tapegrad does not support dtype {a.dtype}")
    v = _pyfloat(a) if (a.ndim == 0 and a.dtype == _F64 and not share) else a
    return _leaf(v, requires_grad)


def tensor(data, dtype=None, requires_grad=False, device=None):
    """Make a leaf tensor from a number, (nested) list, NumPy array or tensor (copies).

    Examples
    --------
    >>> import tapegrad
    >>> tapegrad.tensor([1.0, 2.0], requires_grad=True).shape
    (2,)
    """
    if device is not None:
        check_device(device, "tensor")
    nd = _np_dtype(dtype)
    if isinstance(data, Tensor):
        warnings.warn("To copy construct from a tensor, it is recommended to use "
                      "sourceTensor.clone().detach() or "
                      "sourceTensor.clone().detach().requires_grad_(True), rather than "
                      "tapegrad.tensor(sourceTensor).", UserWarning, stacklevel=2)
    if data.__class__ is _pyfloat and nd is None:
        return _leaf(data, requires_grad) if isinstance(requires_grad, _pybool) \
            else _finish(np.array(data), requires_grad)
    a = _infer_np(data, nd)
    if nd is None and a.dtype.kind == "f" and a.dtype != _F64 and not isinstance(
            data, (np.ndarray, np.generic, Tensor)):
        a = a.astype(np.float64)
    return _finish(np.array(a, copy=True), requires_grad)


def as_tensor(data, dtype=None, device=None):
    """Like ``tensor`` but shares memory with a NumPy array or tensor where it can."""
    check_device(device, "as_tensor")
    nd = _np_dtype(dtype)
    if isinstance(data, Tensor):
        if nd is None or data.dtype.np == nd:
            return data
        return _to_dtype(data, nd)
    if isinstance(data, np.ndarray):
        return _finish(data if nd is None else data.astype(nd, copy=False), False, share=True)
    return tensor(data, dtype=dtype)


def from_numpy(ndarray):
    """A tensor sharing memory with ``ndarray``."""
    if not isinstance(ndarray, np.ndarray):
        raise TypeError(f"expected np.ndarray (got {type(ndarray).__name__})")
    if ndarray.dtype not in _DTYPES or ndarray.dtype.kind == "c":
        raise TypeError(f"can't convert np.ndarray of type {ndarray.dtype}. The only supported "
                        "types are: float64, float32, float16, int64, int32, int16, int8, "
                        "uint8, and bool.")
    return _finish(ndarray, False, share=True)


def _size_args(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    for s in size:
        if not isinstance(s, (_pyint, np.integer)) or isinstance(s, _pybool):
            raise TypeError(f"size must be a sequence of ints, got {size!r}")
        if s < 0:
            raise RuntimeError(f"Trying to create tensor with negative dimension {s}: {size!r}")
    return tuple(_pyint(s) for s in size)


def _factory(fill, fname):
    def make(*size, dtype=None, requires_grad=False, device=None):
        check_device(device, fname)
        shape = _size_args(size)
        nd = _np_dtype(dtype) or _F64
        return _finish(fill(shape, nd), requires_grad)
    return make


zeros = _factory(lambda shape, nd: np.zeros(shape, dtype=nd), "zeros")
ones = _factory(lambda shape, nd: np.ones(shape, dtype=nd), "ones")
zeros.__doc__ = "Tensor of zeros: ``zeros(2, 3)`` or ``zeros((2, 3))``."
ones.__doc__ = "Tensor of ones: ``ones(2, 3)`` or ``ones((2, 3))``."

_rng = np.random.default_rng()


def manual_seed(seed):
    """Seed the generator behind ``rand`` and ``randn``."""
    global _rng
    _rng = np.random.default_rng(seed)


rand = _factory(lambda shape, nd: _rng.random(shape).astype(nd), "rand")
randn = _factory(lambda shape, nd: _rng.standard_normal(shape).astype(nd), "randn")
rand.__doc__ = "Uniform samples on [0, 1)."
randn.__doc__ = "Standard normal samples."


def full(size, fill_value, dtype=None, requires_grad=False, device=None):
    check_device(device, "full")
    shape = _size_args((size,) if not isinstance(size, (tuple, list)) else (tuple(size),))
    nd = _np_dtype(dtype)
    if nd is None:
        nd = _F64 if isinstance(fill_value, _pyfloat) else (
            np.dtype(np.bool_) if isinstance(fill_value, _pybool) else np.dtype(np.int64))
    return _finish(np.full(shape, fill_value, dtype=nd), requires_grad)


def _like(fill, fname):
    def make(input, dtype=None, requires_grad=False, device=None):
        check_device(device, fname)
        if not isinstance(input, Tensor):
            raise TypeError(f"expected a Tensor, got {type(input).__name__}")
        nd = _np_dtype(dtype) or input.dtype.np
        return _finish(fill(input.shape, nd), requires_grad)
    return make


zeros_like = _like(lambda shape, nd: np.zeros(shape, dtype=nd), "zeros_like")
ones_like = _like(lambda shape, nd: np.ones(shape, dtype=nd), "ones_like")


def arange(start, end=None, step=1, dtype=None, requires_grad=False, device=None):
    check_device(device, "arange")
    if end is None:
        start, end = 0, start
    if step == 0:
        raise RuntimeError("step must be nonzero")
    nd = _np_dtype(dtype)
    if nd is None:
        nd = np.dtype(np.int64) if all(isinstance(v, (_pyint, np.integer))
                                       for v in (start, end, step)) else _F64
    return _finish(np.arange(start, end, step, dtype=nd), requires_grad)


def linspace(start, end, steps, dtype=None, requires_grad=False, device=None):
    check_device(device, "linspace")
    if not isinstance(steps, (_pyint, np.integer)) or steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    nd = _np_dtype(dtype) or _F64
    return _finish(np.linspace(start, end, steps, dtype=nd), requires_grad)


def eye(n, m=None, dtype=None, requires_grad=False, device=None):
    check_device(device, "eye")
    nd = _np_dtype(dtype) or _F64
    return _finish(np.eye(n, m, dtype=nd), requires_grad)
