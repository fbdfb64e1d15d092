"""A batch's three-row superinstructions (``fuse.CHAINS`` in ``fuse.batch_rows``, one loop
over the block's samples each in ``run_block``'s form of common ops): the numbers of the
same batch with pairs only and with its rows as traced, and of single calls with and
without superinstructions, to the bit (zeros' signs and infinities; NaN where they have
one), and torch's; at every block size, on the parallel target, and with no chain at or
across an output's row."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import fuse, replay_cpu
from test_replay_call_vm import fusion  # (superinstructions on or off at a first call)
from test_replay_vm_chains import CHAIN_FNS, ROWS, SWAPPED, _along

torch = pytest.importorskip("torch")


def rosen(x):
    """Both chains, and a pair (mulc then add) between them, along the vector."""
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
    ``-1.0 * g``, a chain ``-g``: the same numbers but the sign of a NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    nan = np.isnan(a)
    assert (nan == np.isnan(b)).all()
    assert a[~nan].tobytes() == b[~nan].tobytes()


def form(monkeypatch, name):
    """The batch's rows from the next call on: "chains" (as shipped), "pairs" (no chains)
    or "traced" (no superinstructions)."""
    monkeypatch.setattr(fuse, "BATCH", name != "traced")
    monkeypatch.setattr(fuse, "CHAINS", fuse.CHAINS if name != "pairs" else ())
    monkeypatch.setattr(replay_cpu, "_last_form", (None, None, None, None))


@pytest.fixture(autouse=True)
def _shipped_chains(monkeypatch):
    monkeypatch.setattr(fuse, "CHAINS", fuse.CHAINS)
    monkeypatch.setattr(replay_cpu, "_last_form", (None, None, None, None))


@pytest.mark.parametrize("name", list(FNS))
def test_batch_chains_give_the_rows_numbers_and_single_calls_and_torchs(name, monkeypatch):
    f = FNS[name]
    x0 = np.linspace(-0.8, 1.1, N)
    with fusion(True):
        P = tg.trace(f, x0)
        P.value_and_grad(x0)
    with fusion(False):
        U = tg.trace(f, x0)
        U.value_and_grad(x0)
    code = P._code
    brows = fuse.batch_rows(code.rows, code.out_slots)
    chains = (brows[:, 0] >= fuse.CHAIN_BASE) & (brows[:, 0] % 3 == fuse.CHAIN_BASE % 3)
    assert chains.sum() >= N - 2 if name != "rosenbrock" else chains.sum() == 2 * (N - 1)
    X = samples(41, seed=len(name))
    got = {}
    for how in ("chains", "pairs", "traced"):
        form(monkeypatch, how)
        got[how] = P.value_and_grad(X)
        assert replay_cpu.form_of(code.rows) is replay_cpu._g.run_block_common
        ran = replay_cpu.batch_of(code.rows)[1]
        assert ((ran[:, 0] >= fuse.CHAIN_BASE).any()) == (how == "chains")
    for how in ("pairs", "traced"):
        same(got["chains"][0], got[how][0])
        same(got["chains"][1], got[how][1])
    for j, x in enumerate(X):
        for prog in (P, U):
            v, g = prog.value_and_grad(x)
            same(got["chains"][0][j], v)
            same(got["chains"][1][j], g)
        if np.isfinite(x).all() and np.abs(x).max() < 10:
            xt = torch.tensor(x, requires_grad=True)
            y = f(xt)
            (gt,) = torch.autograd.grad(y, xt)
            np.testing.assert_allclose(got["chains"][0][j], y.item(), rtol=1e-13)
            np.testing.assert_allclose(got["chains"][1][j], gt.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("block", [1, 3, 16, 64])
def test_batch_chains_at_any_block_size(block, monkeypatch):
    """Blocks split the samples only (a block of 1 and of 3: the loops' remainders)."""
    prog = tg.trace(rosen, np.linspace(-0.8, 1.1, N))
    code = prog._code
    X = samples(67, seed=block)
    S = np.ones((X.shape[0], 1))
    form(monkeypatch, "traced")
    want = replay_cpu.run_batch(code.rows, X, code.out_slots, S, code.in_slots, True, 128)
    form(monkeypatch, "chains")
    got = replay_cpu.run_batch(code.rows, X, code.out_slots, S, code.in_slots, True, block)
    assert (replay_cpu.batch_of(code.rows)[1][:, 0] >= fuse.CHAIN_BASE).any()
    for w, g in zip(want, got):
        same(g, w)
    form(monkeypatch, "chains")  # forward only
    values = replay_cpu.run_batch(code.rows, X, code.out_slots, S, code.in_slots, False,
                                  block)[1]
    same(values, want[1])


@pytest.mark.parametrize("outs", [[2], [3], [4], [2, 4], [3, 4], [0, 4]])
def test_no_batch_chain_starts_at_or_holds_an_output(outs, monkeypatch):
    """x0 ** 2, x1 - that, its square (``test_replay_vm_chains.ROWS``): a chain only where
    its last row is the only output among its rows; the outputs' values and the gradients
    (seeds at every output) of the rows as traced either way."""
    outs = np.array(outs)
    brows = fuse.batch_rows(ROWS, outs)
    assert ((brows[:, 0] >= fuse.CHAIN_BASE).sum() == 3) == (outs.tolist() in ([4], [0, 4]))
    ins = np.array([0, 1])
    X = np.random.default_rng(3).normal(size=(9, 2))
    X[0], X[1], X[2] = [np.inf, -0.0], [np.nan, 1.0], [-0.0, 0.0]
    S = np.random.default_rng(4).normal(size=(9, outs.shape[0]))
    results = []
    for how in ("traced", "chains"):
        form(monkeypatch, how)
        results.append(replay_cpu.run_batch(ROWS, X, outs, S, ins, True, 4))
    for w, g in zip(*results):
        same(g, w)


def test_parallel_batches_run_the_chains(monkeypatch):
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
    form(monkeypatch, "chains")
    for _ in range(3):  # (the first parallel batch runs serially: it compiles)
        got = par.value_and_grad(X)
        same(got[0], want[0])
        same(got[1], want[1])
    assert (replay_cpu.batch_of(par._code.rows)[1][:, 0] >= fuse.CHAIN_BASE).any()
