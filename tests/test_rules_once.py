"""Each derivative stated once, in the registry: the one sum-to-broadcast axis rule, what
torch saves (each op's ``torch_saves``), and the elementwise forms of scatter rules
(``scatter``) that the flat sweep and the array sweep's views run; each checked against
torch, the op's own rule, or the general sweep."""
import itertools

import numpy as np
import pytest

import tapegrad

from tapegrad.ops import BY_NAME, OPS
from tapegrad.ops.arrays import sum_axes, sum_to

torch = pytest.importorskip("torch")

_SHAPES = [(), (1,), (3,), (1, 3), (2, 1), (2, 3), (4, 2, 3), (4, 1, 3), (1, 1, 1)]


@pytest.mark.parametrize("want,have", [(w, h) for w, h in itertools.product(_SHAPES, _SHAPES)
                                       if np.broadcast_shapes(w, h) == h])
def test_sum_to_is_broadcasting_in_reverse(want, have):
    """sum_to(g, want) is the adjoint of broadcasting ``want`` to ``have``, as torch's
    sum_to_size; with a leading batch axis kept (``keep=1``) the same axes shifted by one."""
    g = np.arange(1.0, 1.0 + np.prod(have)).reshape(have)
    ref = torch.tensor(g).sum_to_size(want).numpy() if want else g.sum()
    np.testing.assert_array_equal(sum_to(g, want), ref)
    axes = sum_axes((5,) + have, (5,) + want, 1)
    assert axes == tuple(a + 1 for a in sum_axes(have, want))


# --- what torch saves: an in-place change after recording raises exactly where torch's does


def _saved_case(M, name, which):
    x = M.tensor(np.array([[0.3, -0.7, 1.2], [0.5, 0.1, -0.4]]), requires_grad=True)
    h = x * 1.0
    if name == "relu":
        r = M.relu(h)
    elif name == "rdivc":
        r = 2.0 / h
    elif name == "softmax":
        r = M.softmax(h, 1)
    elif name == "log_softmax":
        r = M.log_softmax(h, 1)
    elif name == "matmul":
        # (w requires grad: torch saves h only for w's gradient; tapegrad saves both
        # inputs of a matmul whether or not the other needs a gradient)
        r = M.matmul(h, M.tensor(np.ones((3, 2)), requires_grad=True))
    elif name == "amax_dim":
        r = M.amax(h, 1)
    elif name == "max_dim":
        r = M.max(h, 1)[0]
    elif name == "amax":
        r = M.max(h)
    elif name == "prod":
        r = M.prod(h)
    elif name == "logsumexp":
        r = M.logsumexp(h, 1)
    y = r.sum()
    with M.no_grad():
        (h if which == "in" else r).mul_(2.0)
    try:
        y.backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        return "raised"
    return x.grad.numpy()


@pytest.mark.parametrize("name", ["relu", "rdivc", "softmax", "log_softmax", "matmul",
                                  "amax_dim", "max_dim", "amax", "prod", "logsumexp"])
@pytest.mark.parametrize("which", ["in", "out"])
def test_inplace_change_raises_where_torch_saved_it(name, which):
    ref = _saved_case(torch, name, which)
    got = _saved_case(tapegrad, name, which)
    if isinstance(ref, str):
        assert got == ref
    else:
        assert not isinstance(got, str), f"raised where torch ({name}, {which}) did not"
        np.testing.assert_allclose(got, ref, rtol=1e-13, atol=1e-15)


def test_torch_saves_is_declared_per_op():
    """The engine's table is the ops' fields: an op without one saves what its rule reads."""
    assert BY_NAME["relu"].saved() == {"out"}
    assert BY_NAME["exp"].saved() == {"out"}
    assert BY_NAME["mul"].saved() == {"a", "b"}
    assert BY_NAME["amax"].saved((None, False, np.array([0]))) == frozenset()
    assert BY_NAME["amax"].saved((None, False, None)) == {"a", "out"}
    for op in OPS:
        if op.torch_saves is not None and not callable(op.torch_saves):
            assert op.torch_saves <= {"a", "b", "out"}, op
