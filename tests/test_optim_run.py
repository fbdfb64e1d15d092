"""The compiled fast path: Optimizer.run(program, steps) equals the eager loop."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.optim import SGD, Adam


def rosen(x):
    s = 0.0
    for i in range(x.shape[0] - 1):
        s = s + 100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
    return s


def two_params(w, b):
    return ((w * 2.0 - 1.0) ** 2).sum() + (b - w.sum()) ** 2 * 0.5


CASES = [
    (Adam, dict(lr=1e-2)),
    (Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1, maximize=False)),
    (Adam, dict(lr=1e-3, betas=(0.5, 0.9), eps=1e-6)),
    (SGD, dict(lr=1e-4)),
    (SGD, dict(lr=1e-4, momentum=0.9, nesterov=True)),
    (SGD, dict(lr=1e-4, momentum=0.8, dampening=0.3, weight_decay=0.01)),
]


def _eager(opt_cls, kw, params, fn, steps):
    opt = opt_cls(params, **kw)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = fn(*params)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return opt, losses


@pytest.mark.parametrize("opt_cls,kw", CASES)
def test_run_equals_the_eager_loop(opt_cls, kw):
    x0 = np.linspace(-1.0, 1.0, 8)
    a = tg.tensor(x0.copy(), requires_grad=True)
    oa, losses = _eager(opt_cls, kw, [a], rosen, 40)
    b = tg.tensor(x0.copy(), requires_grad=True)
    ob = opt_cls([b], **kw)
    prog = tg.trace(rosen, b)
    vals = np.concatenate([ob.run(prog, 15), ob.run(prog, 25)])  # resumes its state
    np.testing.assert_allclose(b.detach().numpy(), a.detach().numpy(), rtol=1e-13)
    np.testing.assert_allclose(vals, losses, rtol=1e-13)
    for k, v in oa.state[a].items():
        np.testing.assert_allclose(np.asarray(ob.state[b][k].detach().numpy()),
                                   np.asarray(v.detach().numpy()), rtol=1e-12, atol=1e-300)
    # eager steps continue from the state run() left
    for opt, p in ((oa, a), (ob, b)):
        opt.zero_grad()
        loss = rosen(p)
        loss.backward()
        opt.step()
    np.testing.assert_allclose(b.detach().numpy(), a.detach().numpy(), rtol=1e-12)


def test_run_with_several_parameters():
    w0, b0 = np.array([0.3, -0.2]), 0.7
    w, b = tg.tensor(w0, requires_grad=True), tg.tensor(b0, requires_grad=True)
    _, losses = _eager(Adam, dict(lr=0.05), [w, b], two_params, 30)
    w2, b2 = tg.tensor(w0, requires_grad=True), tg.tensor(b0, requires_grad=True)
    prog = tg.trace(two_params, w2, b2)
    vals = Adam([w2, b2], lr=0.05).run(prog, 30)
    np.testing.assert_allclose(vals, losses, rtol=1e-13)
    np.testing.assert_allclose(w2.detach().numpy(), w.detach().numpy(), rtol=1e-13)
    np.testing.assert_allclose(b2.item(), b.item(), rtol=1e-13)


def test_run_follows_branches_with_retrace_and_reports_them_without():
    def f(x):
        if x.sum() > 0:
            return (x * x).sum()
        return (x * x).sum() * 2.0
    x = tg.tensor([0.1, 0.2], requires_grad=True)
    prog = tg.trace(f, x, retrace=True)
    y = tg.tensor([0.1, 0.2], requires_grad=True)
    _, losses = _eager(SGD, dict(lr=0.6), [y], f, 6)  # overshoots across x.sum() = 0
    vals = SGD([x], lr=0.6).run(prog, 6)
    np.testing.assert_allclose(vals, losses, rtol=1e-13)
    np.testing.assert_allclose(x.detach().numpy(), y.detach().numpy(), rtol=1e-13)
    assert len(prog._variants) == 2
    z = tg.tensor([0.1, 0.2], requires_grad=True)
    with pytest.raises(tg.GuardError):
        SGD([z], lr=0.6).run(tg.trace(f, z), 6)


def test_run_errors():
    x = tg.tensor(np.zeros(3), requires_grad=True)
    prog = tg.trace(rosen, x)
    with pytest.raises(ValueError, match="shapes"):
        Adam([tg.zeros(4, requires_grad=True)]).run(prog, 3)
    with pytest.raises(TypeError, match="tapegrad.Program"):
        Adam([x]).run(rosen, 3)
    with pytest.raises(ValueError, match="steps"):
        Adam([x]).run(prog, -1)
    with pytest.raises(ValueError, match="one parameter group"):
        Adam([{"params": [x]}, {"params": [tg.zeros(1, requires_grad=True)]}]).run(prog, 1)


def test_retrace_under_no_grad_leaves_grad_mode_state_intact():
    def f(x):
        return (x * x).sum() if x.sum() > 0 else -x.sum()
    prog = tg.trace(f, np.ones(2), retrace=True)
    with tg.no_grad():
        prog(-np.ones(2))  # traces a variant while grad is disabled
    x = tg.tensor(1.0, requires_grad=True)
    assert (x * 2.0).requires_grad
    assert tg.autograd.grad(x.clamp(0.0, 2.0) * 3.0, x)[0].item() == 3.0
