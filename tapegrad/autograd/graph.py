"""``GradientEdge`` and ``get_gradient_edge``: a handle on the point of the graph where a
tensor's gradient arrives, usable in place of the tensor in ``grad`` and ``backward``."""
from __future__ import annotations

from typing import Any, NamedTuple

from ..tensor import Tensor, _GradFn, _pyfloat


class GradientEdge(NamedTuple):
    """The ``node`` that receives a gradient (a tensor's ``grad_fn``, or the leaf's
    ``AccumulateGrad``) and which of its outputs (always 0 in tapegrad)."""

    node: Any
    output_nr: int
    ownership_token: Any = None


class AccumulateGrad:
    """The node of a leaf: its gradient accumulates into ``variable.grad``."""

    __slots__ = ("variable",)

    def __init__(self, variable):
        self.variable = variable

    def name(self):
        return "AccumulateGrad"

    def __repr__(self):
        return "<AccumulateGrad object>"


def get_gradient_edge(tensor):
    """The gradient edge of ``tensor``, as ``torch.autograd.graph.get_gradient_edge``.

    Examples
    --------
    >>> import tapegrad
    >>> x = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    >>> y = x * 2.0
    >>> tapegrad.autograd.grad((y * y).sum(), tapegrad.autograd.graph.get_gradient_edge(y))
    (tensor([4., 8.]),)
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"get_gradient_edge expects a Tensor, got {type(tensor).__name__}")
    if not tensor.requires_grad:
        raise RuntimeError("It is not possible to get the gradient edge for a Tensor that does "
                           "not require gradients")
    node = tensor.grad_fn if tensor._tape is not None else AccumulateGrad(tensor)
    return GradientEdge(node, 0)


def edge_tensor(edge):
    """A tensor standing for ``edge`` in a backward: the leaf itself, or a tensor bound to
    the recorded entry (so it works after the user dropped the original tensor)."""
    node = edge.node
    if isinstance(node, AccumulateGrad):
        return node.variable
    if not isinstance(node, _GradFn):
        raise TypeError(f"GradientEdge.node must come from get_gradient_edge, got "
                        f"{type(node).__name__}")
    tape, k = node._tape, node._slot
    t = Tensor()
    v = tape.arrays.get(k, tape)
    t._d = tape.vals[k] if v is tape else v
    t._rg = True
    t._tape = tape
    t._sid = tape.sid
    t._slot = k
    if t._d.__class__ is not _pyfloat:
        t._ver = [0]
    return t
