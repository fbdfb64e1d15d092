"""``tapegrad.autograd``: torch.autograd's ``grad`` and ``backward`` over the flat tape."""
from . import graph
from ._engine import backward, grad

__all__ = ["grad", "backward", "graph"]
