"""``tapegrad.autograd``: torch.autograd's ``grad`` and ``backward`` over the flat tape."""
from . import functional, graph
from ._engine import backward, grad
from .anomaly import (detect_anomaly, is_anomaly_check_nan_enabled, is_anomaly_enabled,
                      set_detect_anomaly)
from .function import Function, FunctionCtx, once_differentiable
from .gradcheck import GradcheckError, gradcheck, gradgradcheck

__all__ = ["grad", "backward", "graph", "functional", "Function", "FunctionCtx",
           "once_differentiable", "detect_anomaly", "set_detect_anomaly", "is_anomaly_enabled",
           "is_anomaly_check_nan_enabled", "gradcheck", "gradgradcheck", "GradcheckError"]
