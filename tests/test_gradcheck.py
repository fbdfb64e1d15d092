"""gradcheck / gradgradcheck: torch's signatures, results and failure reports."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.autograd import GradcheckError, gradcheck, gradgradcheck

torch = pytest.importorskip("torch")

PROGRAMS = {
    "elementwise": lambda m, x, w: (m.sin(x) * m.exp(x * 0.3) + x ** 3).sum(),
    "matmul_tanh": lambda m, x, w: m.tanh(w @ x) * x,
    "two_outputs": lambda m, x, w: ((w * w).sum(0), m.logsumexp(w, 1)),
    "reductions": lambda m, x, w: m.norm(w, dim=0) + m.softmax(w, 1).max(1).values,
}


def _inputs(m):
    rng = np.random.default_rng(5)
    mk = (lambda a: tg.tensor(a, requires_grad=True)) if m is tg else \
        (lambda a: torch.tensor(a, requires_grad=True))
    return mk(rng.uniform(-1, 1, 3)), mk(rng.uniform(-1, 1, (3, 3)))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_gradcheck_and_gradgradcheck_pass_like_torch(name):
    fn = PROGRAMS[name]
    for m, gc, ggc in ((tg, gradcheck, gradgradcheck),
                       (torch, torch.autograd.gradcheck, torch.autograd.gradgradcheck)):
        xs = _inputs(m)
        assert gc(lambda x, w: fn(m, x, w), xs) is True
        assert ggc(lambda x, w: fn(m, x, w), xs) is True


def test_gradcheck_reports_a_mismatch():
    x = tg.tensor([0.3, 1.2], requires_grad=True)
    # a coarse step makes the finite differences of x**3 visibly wrong
    with pytest.raises(GradcheckError, match="Jacobian mismatch for output 0 with respect to "
                                             "input 0") as info:
        gradcheck(lambda t: (t ** 3).sum(), (x,), eps=1e-1, atol=1e-6, rtol=1e-9)
    assert isinstance(info.value, RuntimeError)
    assert "first disagreement" in str(info.value)
    assert gradcheck(lambda t: (t ** 3).sum(), (x,), eps=1e-1, atol=1e-6, rtol=1e-9,
                     raise_exception=False) is False


def test_gradcheck_argument_errors_and_warnings():
    with pytest.raises(ValueError):
        gradcheck(lambda t: t * 2.0, (tg.tensor([1.0]),))
    with pytest.raises(ValueError):
        torch.autograd.gradcheck(lambda t: t * 2.0, (torch.tensor([1.0]),))
    x32 = tg.tensor([0.5], dtype=tg.float32, requires_grad=True)
    with pytest.warns(UserWarning, match="double precision"):
        gradcheck(lambda t: t * 2.0, (x32,), atol=1e-2, rtol=1e-2)
