"""What the replay interpreters compile (issue 17, cold start): the one-sample sweeps have
branches of their own only for the batch's looped ops and call the batch's scalar
``forward_value``/``reverse_value`` for the rest, with the same numbers as torch."""
import inspect

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import _codegen, _codegen_batch, _generated_replay as G

torch = pytest.importorskip("torch")


def _source(fn):
    return inspect.getsource(fn.py_func)


def test_one_sample_sweeps_branch_only_on_the_looped_ops():
    """A branch per op made the one-sample sweeps 3.3 s of a 4.7 s cold first gradient;
    the rare ops share the batch's compiled switch."""
    for fn in (G.forward, G.reverse):
        src = _source(fn)
        assert ("forward_value(" if fn is G.forward else "reverse_value(") in src
        for op in _codegen._replay_ops():
            branch = f"op == {op.code}:  # {op.name}"
            looped = op.name in _codegen_batch.BATCH_LOOPED
            has_rule = fn is G.forward or _codegen.rule_exprs(op)
            assert (branch in src) == (looped and bool(has_rule)), (fn, op.name)


def _rare(x, lib=tg):
    """Ops of the shared switch: pow, abs, clamp, atan2, maximum, log1p, relu."""
    s = 0.0
    for i in range(x.shape[0] - 1):
        a, b = x[i], x[i + 1]
        s = s + (a ** b.abs()).clamp(-3.0, 3.0) + lib.atan2(a, b) + lib.maximum(a, b)
        s = s + a.log1p() + (a - 0.5).relu() * b
    return s


def test_rare_ops_through_the_shared_switch_match_torch():
    x0 = np.linspace(0.2, 0.9, 6)
    prog = tg.trace(_rare, x0)
    for seed in range(3):
        x = np.random.default_rng(seed).uniform(0.05, 1.0, 6)
        v, g = prog.value_and_grad(x)
        xt = torch.tensor(x, requires_grad=True)
        y = _rare(xt, torch)
        (gt,) = torch.autograd.grad(y, (xt,))
        np.testing.assert_allclose(v, y.item(), rtol=1e-14)
        np.testing.assert_allclose(g, gt.numpy(), rtol=1e-13)
        vb, gb = prog.value_and_grad(np.stack([x, x]))
        assert vb[1] == v and (gb[1] == g).all()


def test_signed_loops_check_the_rules_they_stand_for(monkeypatch):
    """add/sub, addc/rsubc and neg share batch loops with a sign (5 loops fewer, 0.5 s of a
    cold batch compile); the generator refuses to write them if a rule or forward is no
    longer the one the shared loop computes, instead of batches giving other numbers."""
    ops = _codegen._replay_ops()
    assert set(_codegen_batch._signed(ops)) == set(_codegen_batch.SIGNED)
    monkeypatch.setitem(_codegen_batch.SIGNED, "sub", ("(a - b)", "g", "g"))
    with pytest.raises(AssertionError, match="sub's forward or rule changed"):
        _codegen_batch._signed(ops)
    src = _source(G.run_block)
    assert src.count("for j in range(nb):") <= 2 * len(_codegen_batch.BATCH_LOOPED) + 5
