"""Tensor, dtypes, factories, grad modes and the recorder, by name: the modules that hold them
are ``_dtypes``, ``_grad_mode``, ``_tensor_class``, ``_recorder`` and ``_factories``."""
from ._dtypes import (_DTYPES, TORCH_NAMES, _cat, _dtype_by_name, _np_dtype, _pybool, _pyfloat,
                      _pyint, bool_, complex64, complex128, dtype, float16, float32, float64,
                      int8, int16, int32, int64, promote_types, uint8)
from ._factories import (arange, as_tensor, check_device, eye, from_numpy, full, linspace,
                         manual_seed, ones, ones_like, rand, randn, tensor, zeros, zeros_like)
from ._grad_mode import (enable_grad, inference_mode, is_grad_enabled, is_inference_mode_enabled,
                         no_grad, set_grad_enabled)
from ._recorder import (_addc_name, _errstate, _plain_s, _record, _to_dtype, _to_tensor, array_op,
                        binary, binary_fallback, quiet, result_dtype, unary, unary_fallback)
from ._tensor_class import _HINTS, Size, Tensor, _dim, _GradFn, _hint, _leaf, _norm_value, _plain
