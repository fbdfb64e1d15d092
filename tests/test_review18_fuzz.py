"""The differential harness's programs (every public function) traced at their inputs and
replayed at inputs with inf, NaN, 800 (exp overflows), -0.0 and ties on every path: one
sample (past the tier-up), hvp, the gradient program, the program's entry on the eager tape
(its VJP, and under create_graph its VJP program), a batch and the parallel target in
blocks; against torch wherever torch's result is finite (or infinite: the same infinity).
Where torch is NaN nothing is compared (replay, which never runs the rules of elements
without an adjoint, may give a number there). Default tier: a few seeds; ``-m slow``:
hundreds."""
import collections
import warnings

import numpy as np
import pytest

import tapegrad as tg

from harness import replay_forms as RF
import test_differential_replay as T

torch = pytest.importorskip("torch")

#: (1e160 and 1e200 are left out: sums of such values cancel in an order torch and replay
#: need not share, and torch's logsumexp rule, exp(x - result), gives each of three tied
#: 1e200 a weight of 1 where the lowered rows' softmax gives 1/3; test_review18_norm.py
#: has what 1e200 found)
SPECIAL = [np.nan, np.inf, -np.inf, -0.0, 0.0, 800.0, -800.0, 0.5, 1.0]


def specials(prog, rng):
    out = []
    for v, rg in prog.inputs:
        a = np.array(v, dtype=np.float64)
        if rg:
            if a.ndim == 0:
                if rng.random() < 0.5:
                    a = np.array(rng.choice(SPECIAL))
            else:
                k = rng.integers(0, a.size, size=rng.integers(1, 3))
                a.reshape(-1)[k] = rng.choice(SPECIAL, size=len(k))
        out.append(float(a) if a.ndim == 0 else a)
    return out


def torch_ref(prog, vals, dirs):
    fn = T.traced_fn(prog, torch)
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True)
          for x in T.args_of(prog, vals)]
    y = fn(*ts)
    gs = torch.autograd.grad(y, ts, create_graph=True, allow_unused=True, materialize_grads=True)
    s = sum((g * torch.tensor(d, dtype=torch.float64)).sum() for g, d in zip(gs, dirs))
    try:
        hs = [h.detach().numpy(force=True) for h in torch.autograd.grad(
            s, ts, allow_unused=True, materialize_grads=True)]
    except RuntimeError as e:  # a gradient of constants: a zero Hessian
        if "does not require grad" not in str(e):
            raise
        hs = [np.zeros(np.shape(t)) for t in ts]
    return y.detach().numpy(), [g.detach().numpy(force=True) for g in gs], hs


def differs(name, got, want, rtol, out):
    got, want = np.atleast_1d(np.asarray(got, float)), np.atleast_1d(np.asarray(want, float))
    if got.shape != want.shape:
        out.append(f"{name}: shape {got.shape}, torch {want.shape}")
        return
    fin = np.isfinite(want)
    scale = max(1.0, float(np.abs(want[fin]).max(initial=0.0)))
    bad = ~np.isclose(got, want, rtol=rtol, atol=rtol * scale) & fin
    bad |= np.isinf(want) & (got != want)
    if bad.any():
        i = np.flatnonzero(bad)[0]
        out.append(f"{name}: element {i}: {got.reshape(-1)[i]!r}, torch "
                   f"{want.reshape(-1)[i]!r}")


def check(seed, min_run, stats):
    """How replay of the program of ``seed`` differs from torch at special inputs ("" when
    it does not)."""
    prog = T.program_for(seed, 5 + seed % 10)
    if not T.rg_of(prog):
        return ""
    rng = np.random.default_rng(seed)
    with RF.array_instructions(min_run):
        try:
            P = T.do_trace(T.traced_fn(prog, tg), prog)
        except T.NotApplicable:
            return ""
    Q = P.to("parallel")
    Q.block = 1  # blocks of one sample: the batch spreads over the thread pool
    samples = [specials(prog, rng) for _ in range(3)]
    dirs = T.directions(prog, 0)
    try:
        refs = [torch_ref(prog, vals, dirs) for vals in samples]
    except Exception:  # noqa: BLE001  (torch cannot run it there: nothing to compare)
        return ""
    stats["programs"] += 1
    out, n = [], len(T.rg_of(prog))
    for i, vals in enumerate(samples):
        a = T.args_of(prog, vals)
        y, gs, hs = refs[i]
        try:
            for _ in range(70 if i == 0 else 1):  # past the tier-up (superinstructions)
                v, g = P.value_and_grad(*a)
            differs(f"[{i}] value", v, y, 1e-8, out)
            for k, gk in enumerate(T._flat(g, n)):
                differs(f"[{i}] grad {k}", gk, gs[k], 1e-8, out)
            for k, hk in enumerate(T._flat(P.hvp(a, dirs)[1], n)):
                differs(f"[{i}] hvp {k}", hk, hs[k], 1e-6, out)
            for k, gk in enumerate(T._flat(P.grad_program()(*a), n)):
                differs(f"[{i}] grad_program {k}", gk, gs[k], 1e-8, out)
            for cg in (False, True):
                ts = [tg.tensor(x, dtype=tg.float64, requires_grad=True) for x in a]
                ge = tg.autograd.grad(P(*ts), ts, create_graph=cg, allow_unused=True,
                                      materialize_grads=True)
                for k, gk in enumerate(ge):
                    differs(f"[{i}] entry create_graph={cg} {k}", gk.detach().numpy(), gs[k],
                            1e-8, out)
        except tg.GuardError:
            stats["guards"] += 1
    X = T._stack(prog, samples)
    for R, name in ((P, "batch"), (Q, "parallel")):
        try:
            vb, gb = R.value_and_grad(*X)
        except tg.GuardError:
            stats["guards"] += 1
            continue
        for i in range(3):
            differs(f"{name}[{i}] value", np.asarray(vb)[i], refs[i][0], 1e-8, out)
            for k, gk in enumerate(T._flat(gb, n)):
                differs(f"{name}[{i}] grad {k}", np.asarray(gk)[i], refs[i][1][k], 1e-8, out)
    return "; ".join(out)


def run_seeds(seeds):
    stats = collections.Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for seed in seeds:
            for min_run in (4, 1 << 62):  # array instructions, scalar rows
                why = check(seed, min_run, stats)
                assert not why, f"seed {seed}, min_run {min_run}: {why[:1500]}"
    assert stats["programs"] >= len(seeds), stats  # (most programs were compared)


def test_replay_at_special_inputs_matches_torch():
    run_seeds(range(8))


@pytest.mark.slow
@pytest.mark.parametrize("block", range(4))
def test_replay_at_special_inputs_matches_torch_slow(block):
    run_seeds(range(100 + 100 * block, 200 + 100 * block))


def test_logsumexp_with_an_inf_and_large_elements_matches_torch():
    def f(M, x):
        return M.logsumexp(x * x[3], 0)
    x = np.array([1.0, -1.0, 0.5, 1e160])  # x * x[3]: 1e160, -1e160, 5e159, inf
    xt = torch.tensor(x, requires_grad=True)
    want, = torch.autograd.grad(f(torch, xt), xt)
    P = tg.trace(lambda x: f(tg, x), np.array([0.5, -1.0, 0.25, 2.0]))
    np.testing.assert_array_equal(P.grad(x)[:3], want.numpy()[:3])  # [0, 0, 0]
