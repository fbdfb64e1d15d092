"""``tapegrad.nn``: ``Parameter`` and the loss and activation functions of
``torch.nn.functional`` that optimization loops use (functions of tensors, not modules)."""
from . import functional
from .parameter import Parameter

__all__ = ["Parameter", "functional"]
