"""tapegrad.argmax / argmin (and the Tensor methods, the same functions) against torch:
values over all elements and along a dim, keepdim, ties, NaN, -0.0, integer inputs, 0-d and
empty tensors, and the errors' types."""
import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")

NAN, INF = float("nan"), float("inf")
DATA = [np.array([[1.0, 3.0, NAN], [4.0, 0.0, 4.0]]),
        np.array([[2.0, 2.0, -1.0], [-1.0, 5.0, 5.0], [0.0, -0.0, 0.0]]),  # ties, -0.0
        np.array([[-INF, INF, 1.0], [NAN, NAN, -INF]]),
        np.array([3.0, 1.0, 3.0, 1.0]),
        np.array(2.5),
        np.arange(24.0).reshape(2, 3, 4) % 5,
        np.array([[1, 7, 7], [0, -3, 2]])]
CALLS = [{}, {"keepdim": True}, {"dim": 0}, {"dim": -1}, {"dim": 1}, {"dim": 0, "keepdim": True},
         {"dim": -1, "keepdim": True}]


@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_values_against_torch(name):
    for a in DATA:
        for kw in CALLS:
            if "dim" in kw and not -max(a.ndim, 1) <= kw["dim"] < max(a.ndim, 1):
                continue
            want = getattr(torch, name)(torch.tensor(a), **kw)
            for got in (getattr(tg, name)(tg.tensor(a), **kw),
                        getattr(tg.tensor(a), name)(**kw)):
                assert got.dtype == tg.int64 and not got.requires_grad
                assert tuple(got.shape) == tuple(want.shape), (a, kw)
                np.testing.assert_array_equal(got.numpy(), want.numpy())
    x = tg.tensor([1.0, 4.0, 2.0], requires_grad=True)  # no gradient through indices
    assert tg.argmax(x).item() == 1 and not tg.argmax(x).requires_grad


def _error(M, f):
    try:
        f(M)
    except Exception as e:  # noqa: BLE001  (the type is what is compared)
        return type(e), str(e)
    return None, None


@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_errors_as_torch(name):
    cases = [lambda M: getattr(M, name)(M.tensor([[1.0, 2.0]]), 2),
             lambda M: getattr(M, name)(M.tensor(1.0), 1),
             lambda M: getattr(M, name)(M.zeros(0)),
             lambda M: getattr(M, name)(M.zeros((2, 0)), 1),
             lambda M: getattr(M, name)(M.tensor([1.0, 2.0]), (0,)),
             lambda M: getattr(M, name)(M.tensor([1.0, 2.0]), 0.0),
             lambda M: getattr(M, name)(M.tensor([1.0, 2.0]), True),
             lambda M: getattr(M, name)(M.tensor([1.0, 2.0]), 0, keepdim=1),
             lambda M: getattr(M, name)(M.tensor([True, False])),
             lambda M: getattr(M, name)([1.0, 2.0])]
    for f in cases:
        (te, me), (tt, mt) = _error(tg, f), _error(torch, f)
        assert tt is not None and issubclass(te, tt), (me, mt)
        assert me and name in me or "Dimension out of range" in me or "Tensor" in me, me
    # an empty dim of an empty tensor along another dim is fine, as torch
    np.testing.assert_array_equal(getattr(tg, name)(tg.zeros((2, 0)), 0).numpy(),
                                  getattr(torch, name)(torch.zeros((2, 0)), 0).numpy())
