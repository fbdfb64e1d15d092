"""The work a backward skips or shortens for speed (GradBench's vectorized evals): each
shortcut gives torch's numbers and is checked to be taken."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.autograd import _tensor_backend
from tapegrad.interpreters import cpu

torch = pytest.importorskip("torch")


def _count(monkeypatch, module):
    calls = []
    real = module.sum_to
    monkeypatch.setattr(module, "sum_to", lambda g, shape: calls.append(shape) or real(g, shape))
    return calls


@pytest.mark.parametrize("create_graph", [False, True])
def test_constant_input_gradient_not_summed(monkeypatch, create_graph):
    # the broadcast of a constant's gradient is never undone: nobody reads it (kmeans'
    # points, (n, k, d) -> (n, 1, d), was most of its backward)
    calls = _count(monkeypatch, _tensor_backend if create_graph else cpu)
    rng = np.random.default_rng(0)
    c0, x0 = rng.normal(size=(5, 1, 3)), rng.normal(size=(4, 3))
    out = []
    for M in (tg, torch):
        c = M.tensor(c0)
        x = M.tensor(x0, requires_grad=True)
        d = c - x
        g, = M.autograd.grad((d * d).sum(), x, create_graph=create_graph)
        if create_graph:
            h, = M.autograd.grad(g.sum(), x)
            out.append((g.detach().numpy(), h.numpy()))
        else:
            out.append((g.numpy(),))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-14)
    assert all(tuple(s) == (4, 3) for s in calls), calls  # x's only, never c's (5, 1, 3)
