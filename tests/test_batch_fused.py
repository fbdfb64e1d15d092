"""A batch's superinstructions (``fuse.batch_rows``: ``fuse.PAIRS`` run by ``run_block``'s
form of common ops, one loop over the block's samples a pair) and its reverse's sliced rows
give the numbers of the rows as traced and of single calls to the bit, at any block size,
and torch's: pairs whose head other rows read too, whose tail's other operand is the
head's operand (``x + 3 * x``, ``x * x + y``), swapped commutative tails, powc's exponents
other than 2 (and -0.0)."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import fuse, replay_cpu

torch = pytest.importorskip("torch")


def sums(M, x):
    """Every pair of ``fuse.PAIRS``, both operand orders of the commutative tails."""
    f = 0.0
    for i in range(x.shape[0] - 1):
        a, b = x[i], x[i + 1]
        f = f + 100.0 * (b - a ** 2) ** 2 + (1.0 - a) ** 2       # sub/rsubc then powc
        f = 3.0 * a + f                                           # mulc then add, swapped
        f = f + a * b + b * 0.5                                   # mul/mulc then add
    return f


def aliased(M, x):
    """Heads read by other rows too, tails whose other operand is the head's operand,
    squares as mul heads, powc exponents 3, 0.5 and -0.0, sub and add of one row twice
    (their reverse's two sliced operands are one row)."""
    f = 0.0
    for i in range(x.shape[0] - 1):
        a, b = x[i], x[i + 1]
        t = b - a
        f = f + t ** 3.0 + t * 0.25                  # sub -> powc(3), t read again
        f = f + a + a * 3.0                          # mulc -> add of the same a
        f = f + (a * a + a)                          # mul(a, a) -> add of a
        u = a * 3.0
        f = f + u                                    # mulc -> add, u read again
        w = a * b
        f = f + w + u * w                            # mul -> add, w read again
        f = f + (9.0 - a) ** 0.5                      # rsubc -> powc(0.5)
        f = f + (b - a) ** -0.0
        f = f + (a - a) ** 2 + (b + b)               # one row as both operands: same slices
    return f


def traced(f, n=7):
    return tg.trace(lambda x: f(tg, x), np.linspace(-0.8, 1.1, n))


def samples(B, n=7, seed=0):
    X = np.random.default_rng(seed).normal(size=(B, n))
    X[0] = 0.0  # t = 0: powc(0, 3), (0)^-0.0, 0 * 0.25
    X[1, 2] = -0.0
    return X


def fresh(monkeypatch, on):
    monkeypatch.setattr(fuse, "BATCH", on)
    monkeypatch.setattr(replay_cpu, "_last_form", (None, None, None, None))


@pytest.mark.parametrize("f", [sums, aliased])
def test_batch_pairs_give_the_rows_as_traced_and_single_calls_to_the_bit(f, monkeypatch):
    prog = traced(f)
    rows = prog._code.rows
    brows = fuse.batch_rows(rows)
    heads = brows[:, 0] >= fuse.BASE
    assert heads.any() and (brows[:, 0] < fuse.BASE + 2 * len(fuse.PAIRS)).all()  # pairs only
    # a powc tail pairs as a square only (the batch's pair loops): others run as traced
    powc = (rows[:, 0] == tg.ops.BY_NAME["powc"].code) & (rows[:, 4] != 2.0)
    assert (brows[powc, 0] == rows[powc, 0]).all()
    assert (brows[np.nonzero(powc)[0] - 1, 0] == rows[np.nonzero(powc)[0] - 1, 0]).all()
    # pairs outside fuse.BATCH_PAIRS (mul then add) too, their operands as traced
    i = fuse.PAIRS.index(("mul", "add", 1))
    fused = fuse.fuse(rows)
    tails = np.nonzero(fused[:, 0] == fuse.BASE + 2 * i + 1)[0]
    assert tails.size and (brows[tails] == rows[tails]).all()
    assert (brows[tails - 1, 0] == rows[tails - 1, 0]).all()
    fresh(monkeypatch, True)
    form, run = replay_cpu.batch_of(rows)
    assert form is replay_cpu._g.run_block_common
    np.testing.assert_array_equal(run, brows)
    X = samples(40)
    got = {}
    for on in (True, False):
        fresh(monkeypatch, on)
        got[on] = prog.value_and_grad(X)
        assert (replay_cpu.batch_of(rows)[1] is rows) != on
    np.testing.assert_array_equal(got[True][0], got[False][0])
    np.testing.assert_array_equal(got[True][1], got[False][1])
    for j, x in enumerate(X):
        v, g = prog.value_and_grad(x)
        np.testing.assert_array_equal(got[True][0][j], v)
        np.testing.assert_array_equal(got[True][1][j], g)
        xt = torch.tensor(x, requires_grad=True)
        y = f(torch, xt)
        (gt,) = torch.autograd.grad(y, xt)
        np.testing.assert_allclose(v, y.item(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(g, gt.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block", [1, 3, 16, 64])
def test_batch_pairs_at_any_block_size(block, monkeypatch):
    """Blocks split the samples only: every block size, pairs on, gives the rows as traced
    in one block's numbers (a block of 1 and of 3: the loops' remainders, unvectorized)."""
    prog = traced(aliased)
    code = prog._code
    X = samples(67, seed=1)
    S = np.ones((X.shape[0], len(code.out_slots)))
    fresh(monkeypatch, False)
    want = replay_cpu.run_batch(code.rows, X, code.out_slots, S, code.in_slots, True, 128)
    fresh(monkeypatch, True)
    got = replay_cpu.run_batch(code.rows, X, code.out_slots, S, code.in_slots, True, block)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


def test_forward_only_batches_with_pairs(monkeypatch):
    prog = traced(sums)
    X = samples(20, seed=2)
    fresh(monkeypatch, True)
    got = prog(X)
    fresh(monkeypatch, False)
    np.testing.assert_array_equal(got, prog(X))
    np.testing.assert_array_equal(got, [prog(x) for x in X])


def test_rows_of_rare_ops_run_as_traced():
    """The form of any rows has no pairs: its rows stay as traced."""
    prog = tg.trace(lambda x: (x[0] - x[1]).atan() ** 2 + (x[0] - x[1]) ** 2,
                    np.array([0.3, -0.4]))
    rows = prog._code.rows
    form, brows = replay_cpu.batch_of(rows)
    assert form is replay_cpu._g.run_block and brows is rows
