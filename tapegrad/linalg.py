"""``tapegrad.linalg``: torch.linalg's functions that tapegrad has."""
from .functions import linalg_cross as cross
from .functions import linalg_norm as norm

__all__ = ["cross", "norm"]
