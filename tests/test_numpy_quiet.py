"""tapegrad raises no NumPy warning through its own code (torch gives inf and nan quietly),
and NumPy functions of a tensor give a tensor, as torch's do."""
import warnings

import numpy as np
import pytest

import tapegrad as tg

BIG = [1e200, 1e200, -1e300, 0.0]
EDGE = [np.inf, -np.inf, 0.0, 1.0]


def _cases(m):
    def t(v, **kw):
        return m.tensor(v, dtype=m.float64, **kw)
    return {
        "x * y overflow": lambda: t(BIG, requires_grad=True) * t(BIG),
        "x * y inf * 0": lambda: t(EDGE) * t([0.0, 0.0, 1.0, 1.0]),
        "x - y inf - inf": lambda: t(EDGE) - t(EDGE),
        "x + y overflow": lambda: t([1.7e308]) + t([1.7e308]),
        "prod overflow": lambda: t(BIG, requires_grad=True).prod(),
        "prod inf * 0": lambda: t(EDGE).prod(),
        "matmul overflow": lambda: t([BIG, BIG], requires_grad=True) @ t(BIG),
        "dot inf - inf": lambda: m.dot(t([np.inf, -np.inf]), t([1.0, 1.0])),
        "outer overflow": lambda: m.outer(t(BIG, requires_grad=True), t(BIG)),
        "mean of nothing": lambda: t([], requires_grad=True).mean(),
        "mean of nothing along a dim": lambda: m.zeros(2, 0, dtype=m.float64).mean(1),
        "sum overflow": lambda: t([1.7e308, 1.7e308], requires_grad=True).sum(),
    }


@pytest.mark.parametrize("name", list(_cases(tg)))
def test_overflow_and_nan_are_quiet_and_match_torch(name, torch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _cases(tg)[name]()
    want = _cases(torch)[name]()
    np.testing.assert_array_equal(got.detach().numpy(), want.detach().numpy())


def test_numpy_functions_of_a_tensor_give_a_tensor_without_a_deprecation_warning(torch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m in (tg,):
            s = np.sin(m.tensor([1.0, 2.0]))
            assert isinstance(s, tg.Tensor) and not s.requires_grad
            np.testing.assert_allclose(s.numpy(), np.sin([1.0, 2.0]))
            z = np.sin(m.tensor(1.0))
            assert isinstance(z, tg.Tensor) and z.shape == ()
            mask = np.greater(m.tensor([1.0, 2.0]), 1.5)
            assert isinstance(mask, tg.Tensor) and mask.tolist() == [False, True]
    # torch does the same (with NumPy 2's deprecated two-argument signature)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert isinstance(np.sin(torch.tensor([1.0])), torch.Tensor)


def test_numpy_functions_of_a_tensor_that_requires_grad_refuse_as_torch():
    with pytest.raises(RuntimeError, match=r"detach\(\)\.numpy\(\)"):
        np.sin(tg.tensor([1.0], requires_grad=True))
