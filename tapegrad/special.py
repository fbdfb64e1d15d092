"""``tapegrad.special``: torch.special's functions that tapegrad has."""
from .functions import special_multigammaln as multigammaln

__all__ = ["multigammaln"]
