"""``tapegrad.autograd``: torch.autograd's ``grad`` and ``backward`` over the flat tape."""
from . import functional, graph
from ._engine import backward, grad
from .gradcheck import GradcheckError, gradcheck, gradgradcheck

__all__ = ["grad", "backward", "graph", "functional", "gradcheck", "gradgradcheck", "GradcheckError"]
