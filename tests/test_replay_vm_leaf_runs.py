"""Runs of leaves in the one-sample entry of superinstructions (``fuse.LEAF_RUN``): one
branch copies the run, the reverse sweep stops above the run that starts the program, and
the numbers are the rows' own to the bit."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import fuse, replay_cpu
from tapegrad.ops import BY_NAME

LEAF, ADD, SUB, MUL, MULC, POWC = (BY_NAME[n].code for n in
                                    ("leaf", "add", "sub", "mul", "mulc", "powc"))


def _row(op, a=-1, b=-1, c0=0.0):
    return [op, a, b, -1, c0, 0.0]


#: leaves of x0, x1 (a run that starts the program), a product, leaves of x2..x4 (a run in
#: the middle), then a pair (sub, powc), a pair (mulc, add) and the sum
ROWS = np.array([
    _row(LEAF, c0=0), _row(LEAF, c0=1), _row(MUL, 0, 1), _row(LEAF, c0=2), _row(LEAF, c0=3),
    _row(LEAF, c0=4), _row(SUB, 5, 3), _row(POWC, 6, c0=2.0), _row(MULC, 4, c0=3.0),
    _row(ADD, 7, 8), _row(ADD, 9, 2)], dtype=np.float64)
IN_SLOTS = np.array([0, 1, 3, 4, 5])


def _run(rows, out_slots, x, fn):
    work = replay_cpu.new_work(rows.shape[0], out_slots, IN_SLOTS, x.shape[0])
    o = replay_cpu.HEADER + 2 * out_slots.shape[0] + IN_SLOTS.shape[0]
    work[o:o + x.shape[0]] = x
    res = np.full(out_slots.shape[0] + IN_SLOTS.shape[0], np.nan)
    status = replay_cpu.entry(rows, work, fn)(rows, work, res)
    return status, res


@pytest.fixture
def all_pairs(monkeypatch):
    monkeypatch.setattr(fuse, "MIN_PAIRED", 0.0)


def test_fuse_marks_runs_of_consecutive_elements_only(all_pairs):
    rows = ROWS.copy()
    rows[4, 4] = 7.0  # x2, x7, x4: no run in the middle
    f = fuse.fuse(rows)
    assert np.nonzero(f[:, 0] == fuse.LEAF_RUN)[0].tolist() == [0] and f[0, 5] == 2
    assert (f[1:6, 0] == [LEAF, MUL, LEAF, LEAF, LEAF]).all()
    f = fuse.fuse(ROWS)
    assert np.nonzero(f[:, 0] == fuse.LEAF_RUN)[0].tolist() == [0, 3]
    assert f[0, 5] == 2 and f[3, 5] == 3 and (f[[1, 4, 5], 0] == LEAF).all()
    # nothing else changes: the leaves' element, the other rows' columns
    assert np.array_equal(f[:, 1:5], ROWS[:, 1:5])
    # a batch runs its leaves as traced (its leaf rows loop over samples already)
    b = fuse.batch_rows(ROWS)
    assert (b[:, 0] < fuse.LEAF_RUN).all() and np.array_equal(b[[0, 3]], ROWS[[0, 3]])


@pytest.mark.parametrize("out", [10, 1, 0, 4])  # the sum; leaves in a run (its head too)
def test_runs_give_the_rows_numbers_to_the_bit(all_pairs, monkeypatch, out):
    x = np.array([0.3, -1.7, 2.5, 1e-3, -4.25])
    outs = np.array([out])
    fused = fuse.fuse(ROWS)
    assert (fused[:, 0] == fuse.LEAF_RUN).sum() == 2
    monkeypatch.setattr(fuse, "LEAF_RUN_MIN", 10 ** 9)
    pairs_only = fuse.fuse(ROWS)
    assert (pairs_only[:, 0] >= fuse.BASE).sum() == 4 and \
        (pairs_only[:, 0] == fuse.LEAF_RUN).sum() == 0
    s0, plain = _run(ROWS, outs, x, replay_cpu.run_into)
    s1, runs = _run(fused, outs, x, replay_cpu.run_fused)
    s2, pairs = _run(pairs_only, outs, x, replay_cpu.run_fused)
    assert s0 == s1 == s2 == 0
    assert plain.tobytes() == runs.tobytes() == pairs.tobytes()
    x0, x1, x2, x3, x4 = x
    if out == 10:
        want = [(x4 - x2) ** 2 + x3 * 3.0 + x0 * x1, x1, x0, -2 * (x4 - x2), 3.0,
                2 * (x4 - x2)]
    else:
        i = {0: 0, 1: 1, 4: 3}[out]
        want = [x[i]] + [float(j == i) for j in range(5)]
    np.testing.assert_allclose(runs, want, rtol=1e-15)


def test_a_traced_programs_leaves_run_as_one(monkeypatch):
    """n=100 Rosenbrock traced from ``x[i]``: its 100 leaves are one run (100 of its 596
    forward branches before), and value_and_grad is the rows' own, to the bit."""
    monkeypatch.setattr(fuse, "TIER", 0)
    n = 100
    fn = lambda x: sum(100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2  # noqa: E731
                       for i in range(n - 1))
    x = np.random.default_rng(3).uniform(-1.5, 1.5, n)
    P = tg.trace(fn, x)
    v, g = P.value_and_grad(x)
    f = P._code.frows
    assert np.nonzero(f[:, 0] == fuse.LEAF_RUN)[0].tolist() == [0] and f[0, 5] == n
    monkeypatch.setattr(fuse, "ENABLED", False)
    Q = tg.trace(fn, x)
    w, h = Q.value_and_grad(x)
    assert Q._code.frows is Q._code.arows
    assert np.float64(v).tobytes() == np.float64(w).tobytes() and g.tobytes() == h.tobytes()
