"""A batch's superinstructions (``fuse.batch_rows``: pairs, run by ``run_block``'s form of
common ops, one loop over the block's samples each) on the programs of the one-sample
chains (``test_replay_vm_chains``): the numbers of the same batch with its rows as traced
and of single calls with and without superinstructions, to the bit (zeros' signs and
infinities; NaN where they have one), and torch's; at every block size, on the parallel
target, and with no pair at or across an output's row. (The chains themselves run in
single calls only: in batches they were 3 to 10% faster at n=100, within the noise at
n=1000, for a second more of the first batch's cold compile: docs/fast-loops.md.)"""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import fuse, replay_cpu
from test_replay_call_vm import fusion  # (superinstructions on or off at a first call)
from test_replay_vm_chains import CHAIN_FNS, ROWS, SWAPPED, _along

torch = pytest.importorskip("torch")


def rosen(x):
    """Both chains' rows, and a pair (mulc then add) between them, along the vector."""
    f = 0.0
    for i in range(x.shape[0] - 1):
        f = f + 100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
    return f


FNS = {"chain0": _along(CHAIN_FNS[0]), "chain1": _along(CHAIN_FNS[1]),
       "chain1-swapped": _along(SWAPPED[1]), "rosenbrock": rosen}
N = 7


def samples(B, seed):
    """Normal samples, then rows of non-finite, huge, tiny and signed-zero inputs."""
    X = np.random.default_rng(seed).normal(size=(B, N))
    special = np.array([1e200, -1e160, 3.0, np.inf, -0.0, 1e-320, np.nan])
    X[0], X[1], X[2], X[3] = special, -special, 0.0, -0.0
    X[4, ::2] = np.inf
    return X


def same(a, b):
    """To the bit, but a NaN's sign and payload (the rows as traced in a batch add
    ``-1.0 * g``, a superinstruction ``-g``: the same numbers but the sign of a NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    nan = np.isnan(a)
    assert (nan == np.isnan(b)).all()
    assert a[~nan].tobytes() == b[~nan].tobytes()


def form(monkeypatch, name):
    """The batch's rows from the next call on: "pairs" (as shipped) or "traced" (no
    superinstructions)."""
    monkeypatch.setattr(fuse, "BATCH", name != "traced")
    monkeypatch.setattr(replay_cpu, "_last_form", (None, None, None, None))


@pytest.fixture(autouse=True)
def _fresh_form(monkeypatch):
    monkeypatch.setattr(replay_cpu, "_last_form", (None, None, None, None))


@pytest.mark.parametrize("name", list(FNS))
def test_batch_pairs_give_the_rows_numbers_and_single_calls_and_torchs(name, monkeypatch):
    f = FNS[name]
    x0 = np.linspace(-0.8, 1.1, N)
    with fusion(True):
        P = tg.trace(f, x0)
        P.value_and_grad(x0)
    with fusion(False):
        U = tg.trace(f, x0)
        U.value_and_grad(x0)
    code = P._code
    assert (fuse.batch_rows(code.rows, code.out_slots)[:, 0] >= fuse.BASE).any()
    X = samples(41, seed=len(name))
    got = {}
    for how in ("pairs", "traced"):
        form(monkeypatch, how)
        got[how] = P.value_and_grad(X)
        assert replay_cpu.form_of(code.rows) is replay_cpu._g.run_block_common
        ran = replay_cpu.batch_of(code.rows)[1]
        assert ((ran[:, 0] >= fuse.BASE).any()) == (how == "pairs")
        assert (ran[:, 0] < fuse.LEAF_RUN).all()  # no chain, no run of leaves
    same(got["pairs"][0], got["traced"][0])
    same(got["pairs"][1], got["traced"][1])
    for j, x in enumerate(X):
        for prog in (P, U):
            v, g = prog.value_and_grad(x)
            same(got["pairs"][0][j], v)
            same(got["pairs"][1][j], g)
        if np.isfinite(x).all() and np.abs(x).max() < 10:
            xt = torch.tensor(x, requires_grad=True)
            y = f(xt)
            (gt,) = torch.autograd.grad(y, xt)
            np.testing.assert_allclose(got["pairs"][0][j], y.item(), rtol=1e-13)
            np.testing.assert_allclose(got["pairs"][1][j], gt.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("block", [1, 3, 16, 64])
def test_batch_pairs_at_any_block_size(block, monkeypatch):
    """Blocks split the samples only (a block of 1 and of 3: the loops' remainders)."""
    prog = tg.trace(rosen, np.linspace(-0.8, 1.1, N))
    code = prog._code
    X = samples(67, seed=block)
    S = np.ones((X.shape[0], 1))
    form(monkeypatch, "traced")
    want = replay_cpu.run_batch(code.rows, X, code.out_slots, S, code.in_slots, True, 128)
    form(monkeypatch, "pairs")
    got = replay_cpu.run_batch(code.rows, X, code.out_slots, S, code.in_slots, True, block)
    assert (replay_cpu.batch_of(code.rows)[1][:, 0] >= fuse.BASE).any()
    for w, g in zip(want, got):
        same(g, w)
    form(monkeypatch, "pairs")  # forward only
    values = replay_cpu.run_batch(code.rows, X, code.out_slots, S, code.in_slots, False,
                                  block)[1]
    same(values, want[1])


@pytest.mark.parametrize("outs", [[2], [3], [4], [2, 4], [3, 4], [0, 4]])
def test_no_batch_pair_starts_at_or_holds_an_output(outs, monkeypatch):
    """x0 ** 2, x1 - that, its square (``test_replay_vm_chains.ROWS``): the pair of the
    last two rows only where its first is no output; the outputs' values and the gradients
    (seeds at every output) of the rows as traced either way."""
    outs = np.array(outs)
    brows = fuse.batch_rows(ROWS, outs)
    assert (brows[:, 0] >= fuse.BASE).any() == (3 not in outs.tolist())
    ins = np.array([0, 1])
    X = np.random.default_rng(3).normal(size=(9, 2))
    X[0], X[1], X[2] = [np.inf, -0.0], [np.nan, 1.0], [-0.0, 0.0]
    S = np.random.default_rng(4).normal(size=(9, outs.shape[0]))
    results = []
    for how in ("traced", "pairs"):
        form(monkeypatch, how)
        results.append(replay_cpu.run_batch(ROWS, X, outs, S, ins, True, 4))
    for w, g in zip(*results):
        same(g, w)


def test_parallel_batches_run_the_serial_batchs_rows(monkeypatch):
    """The threads run the serial batch's rows (``batch_of``): the same numbers."""
    monkeypatch.setattr(replay_cpu, "PARALLEL_WORK", 0)
    monkeypatch.setattr(replay_cpu, "ADAPT", False)
    monkeypatch.setattr(replay_cpu, "_pause", [0, 0])
    monkeypatch.setattr(replay_cpu, "_settle", [0])
    monkeypatch.setattr(replay_cpu, "_num_threads", lambda: 2)
    prog = tg.trace(rosen, np.linspace(-0.8, 1.1, N))
    par = prog.to("parallel")
    prog.block = par.block = 8
    X = samples(50, seed=9)
    form(monkeypatch, "traced")
    want = prog.value_and_grad(X)
    form(monkeypatch, "pairs")
    for _ in range(3):  # (the first parallel batch runs serially: it compiles)
        got = par.value_and_grad(X)
        same(got[0], want[0])
        same(got[1], want[1])
    assert (replay_cpu.batch_of(par._code.rows)[1][:, 0] >= fuse.BASE).any()
