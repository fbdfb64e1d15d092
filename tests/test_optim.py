"""tapegrad.optim against torch.optim: trajectories, state, parameter groups and errors.

The trajectory tests run the same optimization in tapegrad and torch from the same
start, on a chained Rosenbrock function of a 0-d, a 1-d and a 2-d parameter, and compare
every step. The gradients differ from torch's in the last bit now and then, and torch
fuses multiply-adds (FMA), so agreement is to rounding, amplified along the trajectory;
L-BFGS with a line search amplifies the most (torch against itself from a start moved
by one ulp drifts as far), so its runs are kept short.
"""
import copy
import doctest
import importlib
import pickle
import warnings

import numpy as np
import pytest

import tapegrad
import tapegrad.optim as optim
from tapegrad.optim import LBFGS, SGD, Adam, Optimizer, _adam_update, _sgd_update

TOL = dict(rtol=1e-10, atol=1e-13)
START = (-1.2, [1.0, -0.5, 0.3], [[0.8, 1.1], [-0.9, 0.4]])


def _params(m, dtype="float64", start=START):
    """Leaves (0-d, 1-d, 2-d) of module ``m`` (tapegrad or torch)."""
    return [m.tensor(v, dtype=getattr(m, dtype), requires_grad=True) for v in start]


def rosenbrock(m, a, b, c):
    xs = m.cat([m.reshape(a, (1,)), b, m.reshape(c, (-1,))])
    return (100 * (xs[1:] - xs[:-1] ** 2) ** 2 + (1 - xs[:-1]) ** 2).sum()


def _values(ps):
    return np.concatenate([np.array(p.detach().numpy(), dtype=np.float64).ravel()
                           for p in ps])


def _trajectory(m, opt_ns, name, kw, steps, sign=1.0, use_closure=False, dtype="float64"):
    """Parameter values after each step, and the optimizer."""
    ps = _params(m, dtype)
    opt = getattr(opt_ns, name)(ps, **kw)

    def closure():
        opt.zero_grad()
        loss = sign * rosenbrock(m, *ps)
        loss.backward()
        return loss

    out = []
    for _ in range(steps):
        if use_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()
        out.append(_values(ps))
    return np.array(out), opt, ps


def _compare(torch, name, kw, steps, sign=1.0, use_closure=False, dtype="float64", tol=TOL):
    t, topt, tps = _trajectory(torch, torch.optim, name, kw, steps, sign, use_closure, dtype)
    g, gopt, gps = _trajectory(tapegrad, optim, name, kw, steps, sign, use_closure, dtype)
    assert np.all(np.isfinite(t))
    np.testing.assert_allclose(g, t, **tol)
    return topt, tps, gopt, gps


def _state_close(tstate, gstate, tol=TOL):
    assert set(tstate) == set(gstate)
    for key, tv in tstate.items():
        _value_close(tv, gstate[key], key, tol)


def _value_close(tv, gv, key, tol):
    if hasattr(tv, "detach"):
        assert isinstance(gv, tapegrad.Tensor), key
        assert tuple(gv.shape) == tuple(tv.shape), key
        np.testing.assert_allclose(np.array(gv.numpy(), dtype=np.float64),
                                   tv.detach().double().numpy(), err_msg=key, **tol)
    elif isinstance(tv, list):
        assert isinstance(gv, list) and len(gv) == len(tv), key
        for t, g in zip(tv, gv):
            _value_close(t, g, key, tol)
    elif isinstance(tv, float):
        assert gv == pytest.approx(tv, rel=tol["rtol"], abs=tol["atol"]), key
    else:
        assert gv == tv, key


# ---------------------------------------------------------------------------------------
# trajectories against torch

SGD_GRID = [dict(momentum=mo, dampening=da, nesterov=ne, weight_decay=wd, maximize=mx)
            for mo in (0.0, 0.9) for da in (0.0, 0.3) for ne in (False, True)
            for wd in (0.0, 0.01) for mx in (False, True)
            if not (ne and (mo == 0 or da != 0))]


@pytest.mark.parametrize("kw", SGD_GRID, ids=lambda kw: ",".join(f"{k}={v}" for k, v in
                                                               kw.items()))
def test_sgd_trajectory(torch, kw):
    kw = dict(kw, lr=2e-4)
    topt, tps, gopt, gps = _compare(torch, "SGD", kw, 25, sign=-1.0 if kw["maximize"]
                                    else 1.0)
    for tp, gp in zip(tps, gps):
        _state_close(topt.state[tp], gopt.state[gp])


ADAM_GRID = [dict(amsgrad=am, weight_decay=wd, maximize=mx)
             for am in (False, True) for wd in (0.0, 0.1) for mx in (False, True)]


@pytest.mark.parametrize("kw", ADAM_GRID, ids=lambda kw: ",".join(f"{k}={v}" for k, v in
                                                                kw.items()))
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.3, 0.5)], ids=["betas-default",
                                                                   "betas-small"])
def test_adam_trajectory(torch, kw, betas):
    kw = dict(kw, lr=0.01, betas=betas, eps=1e-6)
    topt, tps, gopt, gps = _compare(torch, "Adam", kw, 30, sign=-1.0 if kw["maximize"]
                                    else 1.0)
    for tp, gp in zip(tps, gps):
        _state_close(topt.state[tp], gopt.state[gp])


@pytest.mark.parametrize("line_search_fn,history_size,steps,max_iter", [
    (None, 100, 4, 5),
    (None, 2, 4, 5),
    ("strong_wolfe", 100, 2, 10),
    ("strong_wolfe", 2, 3, 4),
])
def test_lbfgs_trajectory(torch, line_search_fn, history_size, steps, max_iter):
    kw = dict(lr=1 if line_search_fn else 0.05, max_iter=max_iter,
              history_size=history_size, line_search_fn=line_search_fn)
    topt, tps, gopt, gps = _compare(torch, "LBFGS", kw, steps, use_closure=True)
    _state_close(topt.state[tps[0]], gopt.state[gps[0]], tol=dict(rtol=1e-8, atol=1e-10))
    assert len(gopt.state) == 1


@pytest.mark.parametrize("line_search_fn", [None, "strong_wolfe"])
def test_lbfgs_converges_like_torch(torch, line_search_fn):
    """A well-conditioned problem to convergence: the stopping tests fire at the same
    iteration (same evaluation counts) and the points agree."""
    def run(m, opt_ns):
        x = m.tensor([3.0, -2.0, 0.5, 1.5], dtype=m.float64, requires_grad=True)
        w = m.tensor([1.0, 2.0, 3.0, 4.0], dtype=m.float64)
        opt = opt_ns.LBFGS([x], lr=1 if line_search_fn else 0.2, max_iter=100,
                           history_size=3, line_search_fn=line_search_fn)

        def closure():
            opt.zero_grad()
            loss = (w * (x - 1) ** 2).sum() + ((x - 1) ** 4).sum()
            loss.backward()
            return loss

        opt.step(closure)
        opt.step(closure)
        st = opt.state[x]
        return _values([x]), st["func_evals"], st["n_iter"]

    t, g = run(torch, torch.optim), run(tapegrad, optim)
    np.testing.assert_allclose(g[0], t[0], rtol=1e-9)
    assert g[1:] == t[1:]
    np.testing.assert_allclose(g[0], 1.0, atol=1e-3)


def test_lbfgs_max_eval_and_tolerances(torch):
    kws = [dict(max_iter=20, max_eval=7, line_search_fn="strong_wolfe"),
           dict(max_iter=20, max_eval=3),
           dict(tolerance_grad=1e6),  # already optimal: returns at once
           dict(tolerance_change=1e-1, lr=0.01)]
    for kw in kws:
        topt, tps, gopt, gps = _compare(torch, "LBFGS", kw, 2, use_closure=True)
        for key in ("func_evals", "n_iter"):
            assert gopt.state[gps[0]][key] == topt.state[tps[0]][key], (kw, key)


@pytest.mark.parametrize("name,kw", [
    ("SGD", dict(lr=2e-4, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("Adam", dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
])
def test_float32(torch, name, kw):
    topt, tps, gopt, gps = _compare(torch, name, kw, 20, dtype="float32",
                                    tol=dict(rtol=2e-5, atol=1e-6))
    assert all(p.dtype is tapegrad.float32 for p in gps)
    for st in gopt.state.values():
        assert st.get("momentum_buffer", st.get("exp_avg")).dtype is tapegrad.float32


def test_lbfgs_float32(torch):
    kw = dict(max_iter=4, line_search_fn="strong_wolfe")
    _compare(torch, "LBFGS", kw, 1, use_closure=True, dtype="float32",
             tol=dict(rtol=1e-4, atol=1e-5))


@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.1, momentum=0.5)),
                                     ("Adam", dict(lr=0.1))])
def test_params_without_grad_are_skipped(torch, name, kw):
    def run(m, opt_ns):
        used = m.tensor([1.0, 2.0], dtype=m.float64, requires_grad=True)
        unused = m.tensor(3.0, dtype=m.float64, requires_grad=True)
        opt = getattr(opt_ns, name)([used, unused], **kw)
        for _ in range(3):
            opt.zero_grad()
            (used ** 2).sum().backward()
            opt.step()
        return _values([used]), unused.item(), unused in opt.state, len(opt.state)

    t, g = run(torch, torch.optim), run(tapegrad, optim)
    np.testing.assert_allclose(g[0], t[0], **TOL)
    assert g[1:] == t[1:] == (3.0, False, 1)


def test_tensor_lr(torch):
    def run(m, opt_ns, name):
        ps = _params(m)
        opt = getattr(opt_ns, name)(ps, lr=m.tensor(0.01, dtype=m.float64))
        for _ in range(5):
            opt.zero_grad()
            rosenbrock(m, *ps).backward()
            opt.step()
        return _values(ps)

    for name in ("SGD", "Adam"):
        np.testing.assert_allclose(run(tapegrad, optim, name), run(torch, torch.optim, name),
                                   **TOL)


def test_add_param_group(torch):
    """A group added mid-run, with its own lr and the defaults for the rest."""
    def run(m, opt_ns):
        a, b, c = _params(m)
        opt = opt_ns.SGD([a, b], lr=2e-4, momentum=0.9)
        for i in range(12):
            if i == 4:
                opt.add_param_group({"params": c, "lr": 1e-4})
            opt.zero_grad()
            rosenbrock(m, a, b, c).backward()
            opt.step()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return _values([a, b, c]), groups

    (t, tgroups), (g, ggroups) = run(torch, torch.optim), run(tapegrad, optim)
    np.testing.assert_allclose(g, t, **TOL)
    assert ggroups == tgroups
    assert ggroups[1]["lr"] == 1e-4 and ggroups[1]["momentum"] == 0.9


def test_param_groups_have_torch_keys_and_repr(torch):
    cases = [("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
             ("Adam", dict(lr=0.01, betas=(0.8, 0.9), amsgrad=True)),
             ("LBFGS", dict(history_size=5, line_search_fn="strong_wolfe"))]
    for name, kw in cases:
        topt = getattr(torch.optim, name)(_params(torch), **kw)
        gopt = getattr(optim, name)(_params(tapegrad), **kw)
        assert repr(gopt) == repr(topt)
        assert gopt.defaults == topt.defaults
        assert gopt.state_dict()["param_groups"] == topt.state_dict()["param_groups"]


def test_multiple_groups_trajectory(torch):
    def run(m, opt_ns):
        a, b, c = _params(m)
        opt = opt_ns.Adam([{"params": [a]}, {"params": [b, c], "lr": 0.02, "amsgrad": True}],
                          lr=0.01)
        for _ in range(10):
            opt.zero_grad()
            rosenbrock(m, a, b, c).backward()
            opt.step()
        return _values([a, b, c])

    np.testing.assert_allclose(run(tapegrad, optim), run(torch, torch.optim), **TOL)


# ---------------------------------------------------------------------------------------
# step, closure, zero_grad


@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=1e-4)), ("Adam", dict()),
                                     ("LBFGS", dict(max_iter=3)),
                                     ("LBFGS", dict(max_iter=3,
                                                    line_search_fn="strong_wolfe"))])
def test_closure_return_value_and_grad_mode(name, kw):
    ps = _params(tapegrad)
    opt = getattr(optim, name)(ps, **kw)
    seen = []

    def closure():
        seen.append(tapegrad.is_grad_enabled())
        opt.zero_grad()
        loss = rosenbrock(tapegrad, *ps)
        loss.backward()
        return loss

    with tapegrad.no_grad():
        first = opt.step(closure)
    assert isinstance(first, tapegrad.Tensor)
    assert first.item() == pytest.approx(rosenbrock(tapegrad, *_params(tapegrad)).item(),
                                         rel=1e-15)
    assert seen and all(seen)
    if name != "LBFGS":
        assert opt.step() is None
    assert not any(p.grad is not None and p.grad.requires_grad for p in ps)


def test_closure_value_is_returned_as_is():
    p = tapegrad.tensor([1.0], requires_grad=True)
    sentinel = object()
    for opt in (SGD([p], lr=0.1), Adam([p])):
        assert opt.step(lambda: sentinel) is sentinel


def test_zero_grad():
    a, b, c = _params(tapegrad)
    opt = SGD([a, b, c], lr=0.1)
    rosenbrock(tapegrad, a, b, c).backward()
    gb = b.grad
    opt.zero_grad(set_to_none=False)
    assert b.grad is gb  # zeroed in place, as torch does
    for p in (a, b, c):
        assert p.grad.tolist() == np.zeros(p.shape).tolist()
        assert not p.grad.requires_grad
    b.grad = tapegrad.tensor([np.nan, np.inf, -np.inf])
    opt.zero_grad(set_to_none=False)
    assert b.grad.tolist() == [0.0, 0.0, 0.0]
    opt.zero_grad()
    assert a.grad is None and b.grad is None and c.grad is None
    opt.zero_grad()  # nothing to reset


def test_zero_grad_detaches_a_recorded_grad():
    x = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    (gx,) = tapegrad.autograd.grad((x ** 3).sum(), (x,), create_graph=True)
    x.grad = gx
    assert x.grad.requires_grad
    SGD([x]).zero_grad(set_to_none=False)
    assert x.grad.tolist() == [0.0, 0.0] and not x.grad.requires_grad and x.grad.is_leaf


def test_zero_gradient_still_steps(torch):
    """A zero gradient is not a missing one: weight decay and momentum still act."""
    def run(m, opt_ns):
        p = m.tensor([1.0, -2.0], dtype=m.float64, requires_grad=True)
        opt = opt_ns.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.5)
        (p * p).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.step()
        return _values([p])

    np.testing.assert_allclose(run(tapegrad, optim), run(torch, torch.optim), **TOL)


def test_step_is_an_inplace_change(torch):
    """A graph recorded before a step no longer matches its leaves (torch's version
    check), and a graph recorded after the step sees the new values."""
    for start in (1.5, [1.0, 2.0]):
        for m, opt_ns in ((torch, torch.optim), (tapegrad, optim)):
            p = m.tensor(start, dtype=m.float64, requires_grad=True)
            opt = opt_ns.SGD([p], lr=0.1)
            (p * p).sum().backward()
            stale = (p * p * p).sum()
            opt.step()
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                stale.backward()
            p.grad = None
            (p * p).sum().backward()
            np.testing.assert_allclose(np.array(p.grad.numpy()), 2 * np.array(
                p.detach().numpy()), rtol=1e-15)


def test_updates_write_into_the_parameters_storage():
    base = np.array([[1.0, 2.0], [3.0, 4.0]])
    for arr in (base.copy(), np.asfortranarray(base), base.copy()[:, ::-1]):
        p = tapegrad.from_numpy(arr)
        p.requires_grad_()
        p.grad = tapegrad.tensor(np.ones((2, 2)))
        SGD([p], lr=0.5).step()
        assert p.numpy(force=True) is arr  # same storage, updated in place
        np.testing.assert_array_equal(arr, (base if arr.strides[1] > 0 else base[:, ::-1])
                                      - 0.5)


def test_float32_zero_dim_parameter(torch):
    def run(m, opt_ns):
        p = m.tensor(2.0, dtype=m.float32, requires_grad=True)
        opt = opt_ns.Adam([p], lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            (p * p).backward()
            opt.step()
        return p.item()

    assert run(tapegrad, optim) == pytest.approx(run(torch, torch.optim), rel=1e-6)


# ---------------------------------------------------------------------------------------
# state_dict


def test_state_dict_layout_matches_torch(torch):
    for name, kw in [("SGD", dict(lr=1e-4, momentum=0.9)),
                     ("Adam", dict(amsgrad=True)),
                     ("LBFGS", dict(max_iter=3))]:
        topt, tps, gopt, gps = _compare(torch, name, kw, 2, use_closure=True)
        tsd, gsd = topt.state_dict(), gopt.state_dict()
        assert gsd["param_groups"] == tsd["param_groups"]
        assert list(gsd["state"]) == list(tsd["state"])
        for k in tsd["state"]:
            assert list(gsd["state"][k]) == list(tsd["state"][k])


@pytest.mark.parametrize("name,kw", [
    ("SGD", dict(lr=2e-4, momentum=0.9, nesterov=True)),
    ("Adam", dict(lr=0.01, amsgrad=True)),
    ("LBFGS", dict(max_iter=3, history_size=4, line_search_fn="strong_wolfe")),
    ("LBFGS", dict(lr=0.05, max_iter=3)),
])
def test_state_dict_round_trip(name, kw):
    """Continuing after load_state_dict gives exactly what continuing would have."""
    cls = getattr(optim, name)

    def steps(opt, ps, n):
        def closure():
            opt.zero_grad()
            loss = rosenbrock(tapegrad, *ps)
            loss.backward()
            return loss
        for _ in range(n):
            opt.step(closure)
        return _values(ps)

    ps = _params(tapegrad)
    opt = cls(ps, **kw)
    steps(opt, ps, 3)
    saved = copy.deepcopy(opt.state_dict())
    snapshot = [p.detach().clone() for p in ps]
    expected = steps(opt, ps, 3)

    ps2 = [s.clone().requires_grad_() for s in snapshot]
    opt2 = cls(ps2, **dict(kw, lr=123.0))
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == kw.get("lr", opt.defaults["lr"])
    assert all(a is b for a, b in zip(opt2.param_groups[0]["params"], ps2))
    np.testing.assert_array_equal(steps(opt2, ps2, 3), expected)
    # the loaded state is a copy: stepping opt2 left the saved dict alone
    again = cls([s.clone().requires_grad_() for s in snapshot], **kw)
    again.load_state_dict(saved)
    np.testing.assert_array_equal(steps(again, again.param_groups[0]["params"], 3), expected)


def test_load_state_dict_casts_to_the_parameters_dtype():
    p = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    opt = Adam([p])
    (p * p).sum().backward()
    opt.step()
    q = tapegrad.tensor([1.0, 2.0], dtype=tapegrad.float32, requires_grad=True)
    opt32 = Adam([q])
    opt32.load_state_dict(opt.state_dict())
    st = opt32.state[q]
    assert st["exp_avg"].dtype is tapegrad.float32
    assert st["step"].dtype is tapegrad.float64  # "step" keeps its dtype
    assert st["exp_avg"] is not opt.state[p]["exp_avg"]


def test_adam_accepts_a_numeric_step_on_load():
    p = tapegrad.tensor([1.0, 2.0], requires_grad=True)
    opt = Adam([p], lr=0.1)
    (p * p).sum().backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = 1  # old checkpoints saved a number
    opt2 = Adam([tapegrad.tensor([1.0, 2.0], requires_grad=True)])
    opt2.load_state_dict(sd)
    (step,) = [s["step"] for s in opt2.state.values()]
    assert isinstance(step, tapegrad.Tensor) and step.item() == 1.0


def test_pickle_round_trip():
    ps = _params(tapegrad)
    opt = SGD(ps, lr=1e-4, momentum=0.9)
    rosenbrock(tapegrad, *ps).backward()
    opt.step()
    opt2 = pickle.loads(pickle.dumps(opt))
    (a, b, c) = opt2.param_groups[0]["params"]
    assert set(opt2.state) == {a, b, c}
    assert opt2.state[b]["momentum_buffer"].tolist() == opt.state[ps[1]][
        "momentum_buffer"].tolist()


# ---------------------------------------------------------------------------------------
# errors: the same exception types as torch


def _p(m):
    return m.tensor([1.0, 2.0], requires_grad=True)


ERRORS = {
    "single tensor": lambda m, o: o.SGD(_p(m), lr=0.1),
    "not iterable": lambda m, o: o.SGD(5, lr=0.1),
    "not tensors": lambda m, o: o.SGD([1.0, 2.0], lr=0.1),
    "empty": lambda m, o: o.SGD([], lr=0.1),
    "empty adam": lambda m, o: o.Adam(iter([])),
    "non-leaf": lambda m, o: o.SGD([_p(m) * 2], lr=0.1),
    "param in two groups": lambda m, o: (lambda p: o.SGD(
        [{"params": [p]}, {"params": [p], "lr": 1.0}], lr=0.1))(_p(m)),
    "group without params": lambda m, o: o.SGD([{"lr": 0.1}], lr=0.1),
    "set of params in a group": lambda m, o: o.SGD([{"params": {_p(m)}}], lr=0.1),
    "group not a dict": lambda m, o: o.SGD([_p(m)], lr=0.1).add_param_group([_p(m)]),
    "mixed names": lambda m, o: o.SGD([("w", _p(m)), _p(m)], lr=0.1),
    "sgd negative lr": lambda m, o: o.SGD([_p(m)], lr=-0.1),
    "sgd negative momentum": lambda m, o: o.SGD([_p(m)], lr=0.1, momentum=-0.5),
    "sgd negative weight_decay": lambda m, o: o.SGD([_p(m)], lr=0.1, weight_decay=-1.0),
    "nesterov without momentum": lambda m, o: o.SGD([_p(m)], lr=0.1, nesterov=True),
    "nesterov with dampening": lambda m, o: o.SGD([_p(m)], lr=0.1, momentum=0.9,
                                                  dampening=0.1, nesterov=True),
    "tensor lr of 2 elements": lambda m, o: o.SGD([_p(m)], lr=m.tensor([0.1, 0.2])),
    "adam negative lr": lambda m, o: o.Adam([_p(m)], lr=-1e-3),
    "adam negative eps": lambda m, o: o.Adam([_p(m)], eps=-1e-8),
    "adam beta1 = 1": lambda m, o: o.Adam([_p(m)], betas=(1.0, 0.999)),
    "adam beta2 < 0": lambda m, o: o.Adam([_p(m)], betas=(0.9, -0.1)),
    "adam beta2 > 1": lambda m, o: o.Adam([_p(m)], betas=(0.9, 1.5)),
    "adam integer betas": lambda m, o: o.Adam([_p(m)], betas=(0, 0)),
    "adam negative weight_decay": lambda m, o: o.Adam([_p(m)], weight_decay=-0.1),
    "lbfgs negative lr": lambda m, o: o.LBFGS([_p(m)], lr=-1),
    "lbfgs two groups": lambda m, o: o.LBFGS([{"params": [_p(m)]}, {"params": [_p(m)]}]),
    "lbfgs without closure": lambda m, o: o.LBFGS([_p(m)]).step(),
    "lbfgs closure None": lambda m, o: o.LBFGS([_p(m)]).step(None),
    "lbfgs unknown line search": lambda m, o: (lambda p: (lambda opt: opt.step(
        lambda: _loss_backward(p)))(o.LBFGS([p], line_search_fn="armijo")))(_p(m)),
    "base step": lambda m, o: o.Optimizer([_p(m)], {}).step(),
    "required hyperparameter": lambda m, o: o.Optimizer([_p(m)], {"lr": _required(o)}),
    "load: other number of groups": lambda m, o: o.SGD([_p(m)], lr=0.1).load_state_dict(
        o.SGD([{"params": [_p(m)]}, {"params": [_p(m)]}], lr=0.1).state_dict()),
    "load: other group size": lambda m, o: o.SGD([_p(m)], lr=0.1).load_state_dict(
        o.SGD([_p(m), _p(m)], lr=0.1).state_dict()),
}


def _required(o):
    return o.required if o is optim else importlib.import_module(
        "torch.optim.optimizer").required


def _loss_backward(p):
    loss = (p * p).sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_match_torch(torch, case):
    fn = ERRORS[case]
    with pytest.raises(Exception) as t_err:
        fn(torch, torch.optim)
    with pytest.raises(Exception) as g_err:
        fn(tapegrad, optim)
    assert type(g_err.value) is type(t_err.value), (g_err.value, t_err.value)
    assert str(g_err.value)


def test_error_messages_say_what_was_wrong():
    p = tapegrad.tensor([1.0], requires_grad=True)
    with pytest.raises(ValueError, match="empty parameter list"):
        SGD([])
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        Adam([p], lr=-1)
    with pytest.raises(ValueError, match="beta parameter at index 1: 1.0"):
        Adam([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid epsilon value"):
        Adam([p], eps=-1.0)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero "
                                         "dampening"):
        SGD([p], nesterov=True)
    with pytest.raises(ValueError, match="more than one parameter group"):
        SGD([{"params": [p]}, {"params": [p]}])
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        SGD(p)
    with pytest.raises(TypeError, match="only optimize Tensors.*float"):
        SGD([1.0])
    with pytest.raises(ValueError, match="non-leaf"):
        SGD([p * 2])
    with pytest.raises(TypeError, match="closure"):
        LBFGS([p]).step(None)


def test_duplicate_parameter_warns_like_torch(torch):
    for m, o in ((torch, torch.optim), (tapegrad, optim)):
        p = _p(m)
        with pytest.warns(UserWarning, match="duplicate parameters"):
            o.SGD([p, p], lr=0.1)


def test_unsupported_options_raise():
    p = tapegrad.tensor([1.0], requires_grad=True)
    with pytest.raises(NotImplementedError, match="differentiable"):
        SGD([p], differentiable=True)
    with pytest.raises(NotImplementedError, match="decoupled_weight_decay"):
        Adam([p], decoupled_weight_decay=True)
    with pytest.raises(NotImplementedError, match="capturable"):
        Adam([p], capturable=True)
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        SGD([p], foreach=True, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SGD([p], foreach=True)  # accepted: one implementation either way
        Adam([p], fused=True)


def test_named_parameters_and_generators():
    a, b = tapegrad.tensor(1.0, requires_grad=True), tapegrad.tensor([2.0], requires_grad=True)
    opt = SGD([("a", a), ("b", b)], lr=0.1)
    assert opt.param_groups[0]["param_names"] == ["a", "b"]
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["a", "b"]
    opt = Adam(p for p in (a, b))
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(a), id(b)]


def test_required_hyperparameter():
    class Plain(Optimizer):
        def __init__(self, params, lr=optim.required):
            super().__init__(params, {"lr": lr})

    p = tapegrad.tensor([1.0], requires_grad=True)
    assert Plain([{"params": [p], "lr": 0.5}]).param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        Plain([p])


# ---------------------------------------------------------------------------------------
# the pure update functions


def test_update_functions_mutate_only_their_outputs():
    rng = np.random.default_rng(0)
    p, g, buf = rng.standard_normal(5), rng.standard_normal(5), rng.standard_normal(5)
    g0 = g.copy()
    _sgd_update(p, g, buf, 0.1, 0.9, 0.1, 0.01, False, True, False)
    np.testing.assert_array_equal(g, g0)
    m, v, vmax = rng.standard_normal(5), rng.random(5), rng.random(5)
    _adam_update(p, g, m, v, vmax, 2.0, 0.1, 0.9, 0.999, 1e-8, 0.1, True, True)
    np.testing.assert_array_equal(g, g0)
    assert np.all(vmax >= v)


def test_update_functions_compile_with_numba():
    """The pure functions run in nopython mode, with the same results (float64)."""
    numba = pytest.importorskip("numba")
    sgd, adam = (numba.njit(cache=True)(f) for f in (_sgd_update, _adam_update))
    rng = np.random.default_rng(1)
    for args in [(0.1, 0.9, 0.0, 0.01, True, False, False), (0.1, 0.9, 0.3, 0.0, False, True,
                                                              True),
                 (0.1, 0.0, 0.0, 0.0, False, False, False)]:
        p, g, buf = rng.standard_normal(6), rng.standard_normal(6), rng.standard_normal(6)
        p2, buf2 = p.copy(), buf.copy()
        _sgd_update(p, g, buf, *args)
        sgd(p2, g, buf2, *args)
        np.testing.assert_array_equal(p2, p)
        np.testing.assert_array_equal(buf2, buf)
    for amsgrad in (False, True):
        arrs = [rng.standard_normal(6), rng.standard_normal(6), rng.standard_normal(6),
                rng.random(6), rng.random(6) if amsgrad else np.empty(0)]
        copies = [a.copy() for a in arrs]
        scalars = (3.0, 0.01, 0.9, 0.999, 1e-8, 0.1, amsgrad, True)
        _adam_update(*arrs, *scalars)
        adam(*copies, *scalars)
        for a, b in zip(arrs, copies):
            np.testing.assert_array_equal(b, a)


def test_docstring_examples():
    # the package's and each module's (doctest finds only what a module defines itself)
    import pkgutil
    attempted = 0
    for mod in [optim] + [importlib.import_module(f"tapegrad.optim.{m.name}")
                          for m in pkgutil.iter_modules(optim.__path__)]:
        result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, mod.__name__
        attempted += result.attempted
    assert attempted > 10
