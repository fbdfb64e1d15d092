"""tapegrad: a JIT-compiled tape autograd on Numba with torch.autograd's API."""
import warnings as _warnings

# torch returns inf/nan silently; NumPy warns. Silence NumPy's floating-point warnings
# raised from tapegrad's own frames only (the user's NumPy code still warns).
_warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"tapegrad(\.|$)",
                         message=r"(divide by zero|invalid value|overflow|underflow) "
                                 r"encountered")
from . import autograd, nn
from . import functions as _functions
from .tensor import (Size, Tensor, arange, as_tensor, bool_, complex64, complex128, dtype,
                     enable_grad,
                     eye, float16, float32, float64, from_numpy, full, inference_mode,
                     int8, int16, int32, int64, is_grad_enabled, is_inference_mode_enabled,
                     linspace, manual_seed, no_grad, ones, ones_like, rand, randn,
                     set_grad_enabled, tensor, uint8, zeros, zeros_like)
from . import linalg, special  # noqa: E402  (torch's namespaces: linalg.cross, special.*)
from ._threads import get_num_threads, set_num_threads  # noqa: E402

# the functions: every registered op's public names (its register(..., api=, aliases=)), the
# composites and the extras, as tapegrad/functions.py derives them from the registry
globals().update(_functions.public())

bool = bool_
float = float32
double = float64
half = float16
int = int32
long = int64
short = int16
cdouble = complex128
cfloat = complex64

__version__ = "0.1.0"

# imported on first use, so that ``import tapegrad`` (and the first eager gradient) does not
# pay for the replay machinery and the optimizers
_LAZY = {"trace": "replay", "Program": "replay", "load": "replay", "GuardError": "replay",
         "TraceWarning": "replay", "optim": None, "scipy": None, "replay": None}


def __getattr__(name):
    import importlib
    if name not in _LAZY:
        raise AttributeError(f"module 'tapegrad' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    return module if _LAZY[name] is None else getattr(module, name)


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
