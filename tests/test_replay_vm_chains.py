"""Three-row superinstructions of the one-sample entry (``fuse.CHAINS``): the rows' own
numbers to the bit (non-finite ones too) and torch's, formed only where their checks hold."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import fuse, replay_cpu
from tapegrad.ops import BY_NAME
from test_replay_call_vm import fusion  # (superinstructions on or off at a first call)

torch = pytest.importorskip("torch")


#: a function of x[i], x[i + 1] per chain of ``fuse.CHAINS`` (and the commutative last row
#: with the row before as its first operand, which fuse swaps), summed along a vector
CHAIN_FNS = {
    0: lambda x, y: (y - x ** 2) ** 2,
    1: lambda x, y: y * 0.5 + (1.0 - x) ** 2,
}
SWAPPED = {1: lambda x, y: (1.0 - x) ** 2 + y}
#: the same shapes the chains must not take: another exponent, a row read twice
NOT_CHAINS = {
    "cube": lambda x, y: (y - x ** 2) ** 3,
    "square of a cube": lambda x, y: (y - x ** 3) ** 2,
    "head read twice": lambda x, y: (lambda t: (t - t) ** 2)(x ** 2) + y,
    "first row read by the last": lambda x, y: (1.0 - x) ** 2 + (1.0 - x),
}


def _along(f):
    def g(x):
        s = 0.0
        for i in range(x.shape[0] - 1):
            s = s + f(x[i], x[i + 1])
        return s
    return g


def _programs(fn, x0):
    with fusion(True):
        P = tg.trace(fn, x0)
        P.value_and_grad(x0)
    with fusion(False):
        U = tg.trace(fn, x0)
        U.value_and_grad(x0)
    assert U._code.frows is U._code.arows
    return P, U


def test_every_chain_has_a_test():
    assert set(CHAIN_FNS) == set(range(len(fuse.CHAINS)))


@pytest.mark.parametrize("i, f", list(CHAIN_FNS.items()) + [(i, f) for i, f in SWAPPED.items()],
                         ids=["chain0", "chain1", "chain1-swapped"])
def test_chains_give_their_rows_numbers_to_the_bit_and_torchs(i, f):
    g = _along(f)
    rng = np.random.default_rng(11 + i)
    x0 = rng.uniform(-1.5, 1.5, 7)
    P, U = _programs(g, x0)
    ops = P._code.frows[:, 0]
    code = fuse.CHAIN_BASE + 3 * i
    assert (ops == code).sum() == 6 and (ops == code + 2).sum() == 6
    big = np.array([1e200, -1e160, 3.0, np.inf, -0.0, 1e-320, np.nan])
    for x in [rng.uniform(-1.5, 1.5, 7) for _ in range(3)] + [big, -big]:
        v, gr = P.value_and_grad(x)
        w, h = U.value_and_grad(x)
        assert np.float64(v).tobytes() == np.float64(w).tobytes(), (x, v, w)
        assert gr.tobytes() == h.tobytes(), (x, gr, h)
        if np.isfinite(x).all() and np.abs(x).max() < 10:
            xt = torch.tensor(x, requires_grad=True)
            y = g(xt)
            (gt,) = torch.autograd.grad(y, xt)
            np.testing.assert_allclose(v, y.item(), rtol=1e-13)
            np.testing.assert_allclose(gr, gt.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", list(NOT_CHAINS))
def test_rows_that_do_not_chain_stay_pairs_or_rows(name):
    g = _along(NOT_CHAINS[name])
    x0 = np.linspace(0.2, 1.3, 5)
    P, U = _programs(g, x0)
    assert (P._code.frows[:, 0] < fuse.CHAIN_BASE).all()
    v, gr = P.value_and_grad(x0 + 0.1)
    w, h = U.value_and_grad(x0 + 0.1)
    assert v == w and gr.tobytes() == h.tobytes()


def test_a_batch_runs_pairs_only():
    g = _along(CHAIN_FNS[0])
    x0 = np.linspace(-1.0, 1.0, 6)
    P, U = _programs(g, x0)
    assert (P._code.frows[:, 0] >= fuse.CHAIN_BASE).any()
    assert (fuse.batch_rows(P._code.rows)[:, 0] < fuse.LEAF_RUN).all()
    X = np.random.default_rng(2).normal(size=(4, 6))
    values, grads = P.value_and_grad(X)
    for b in range(4):
        v, gr = P.value_and_grad(X[b])
        assert v == values[b]
        np.testing.assert_allclose(gr, grads[b], rtol=1e-14, atol=0)


LEAF, SUB, POWC = (BY_NAME[n].code for n in ("leaf", "sub", "powc"))
#: x0 ** 2, x1 - that, its square; then a row after it (a Hessian-vector program's rows may
#: go on past an output)
ROWS = np.array([[LEAF, -1, -1, -1, 0, 0], [LEAF, -1, -1, -1, 1, 0], [POWC, 0, -1, -1, 2, 0],
                 [SUB, 1, 2, -1, 0, 0], [POWC, 3, -1, -1, 2, 0]], dtype=np.float64)


@pytest.mark.parametrize("out", [2, 3, 4])
def test_no_chain_starts_at_or_holds_an_output(out):
    with fusion(True):
        f = fuse.fuse(ROWS, outs=np.array([out]))
        assert ((f[:, 0] >= fuse.CHAIN_BASE).sum() == 3) == (out == 4)
        outs, ins = np.array([out]), np.array([0, 1])
        results = []
        for rows, fn in ((ROWS, replay_cpu.run_into), (f, replay_cpu.run_fused)):
            work = replay_cpu.new_work(5, outs, ins, 2)
            work[replay_cpu.HEADER + 4:replay_cpu.HEADER + 6] = [np.inf, -0.0]
            res = np.empty(3)
            assert replay_cpu.entry(rows, work, fn)(rows, work, res) == 0
            results.append(res.tobytes())
        assert results[0] == results[1]


def test_a_fixed_constant_keeps_only_its_branch():
    from tapegrad.interpreters._codegen_emit import _folded
    assert _folded("(a * a if 2.0 == 2.0 else (a * a * a if 2.0 == 3.0 else a ** 2.0))") \
        == "a * a"
    assert _folded("(0.0 if (2.0 == 0.0) else g * (2.0 * (a ** 1.0)))") == \
        "g * (2.0 * a ** 1.0)"
    assert _folded("(x if c0 == 2.0 else y)") == "x if c0 == 2.0 else y"  # not a constant
