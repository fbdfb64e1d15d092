"""``tapegrad.autograd``: torch.autograd's ``grad`` and ``backward`` over the flat tape."""
from . import functional, graph
from ._engine import backward, grad
from .function import Function, FunctionCtx, once_differentiable
from .gradcheck import GradcheckError, gradcheck, gradgradcheck

__all__ = ["grad", "backward", "graph", "functional", "Function", "FunctionCtx",
           "once_differentiable", "gradcheck", "gradgradcheck", "GradcheckError"]
