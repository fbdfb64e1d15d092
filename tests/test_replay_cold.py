"""Cold-start cuts of the replay: ``program.prune`` (NumPy and a marking sweep, was one
compiled function) and a batch's first call, which must not compile the one-sample entry."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import program as P


def _prune_reference(rows, roots):
    """The compiled ``_prune`` this replaced, line for line in Python."""
    n = rows.shape[0]
    need = np.zeros(n, dtype=np.bool_)
    for r in roots:
        need[r] = True
    for k in range(n):
        op = int(rows[k, 0])
        if op == P.GUARD or op == P.LEAF:
            need[k] = True
    for k in range(n - 1, -1, -1):
        if need[k]:
            for c in range(1, 4):
                s = int(rows[k, c])
                if s >= 0:
                    need[s] = True
    new = np.full(n, -1, dtype=np.int64)
    m = 0
    for k in range(n):
        if need[k]:
            new[k] = m
            m += 1
    out = np.empty((m, rows.shape[1]), dtype=np.float64)
    for k in range(n):
        j = new[k]
        if j >= 0:
            for c in range(rows.shape[1]):
                out[j, c] = rows[k, c]
            for c in range(1, 4):
                s = int(rows[k, c])
                if s >= 0:
                    out[j, c] = new[s]
    return out, new


def _random_rows(rng, n):
    """Rows whose operands are earlier rows or -1, with leaves, guards and other ops."""
    rows = np.full((n, 6), -1.0)
    rows[:, 0] = rng.choice([P.LEAF, P.GUARD, 24, 26, 30, 33], size=n, p=[.1, .05, .25, .2,
                                                                            .2, .2])
    rows[:, 4:] = rng.normal(size=(n, 2))
    for k in range(1, n):
        for c in range(1, 1 + rng.integers(0, 4)):
            rows[k, c] = rng.integers(0, k)
    rows[0, 1:4] = -1.0
    return rows


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_prune_matches_the_compiled_original(seed, compiled, monkeypatch):
    if compiled:  # the marking sweep of programs above MARK_IN_PYTHON rows
        monkeypatch.setattr(P, "MARK_IN_PYTHON", -1)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    rows = _random_rows(rng, n)
    roots = rng.integers(0, n, size=int(rng.integers(0, 4))).astype(np.int64)
    out, new = P.prune(rows, roots)
    want_out, want_new = _prune_reference(rows, roots)
    np.testing.assert_array_equal(new, want_new)
    np.testing.assert_array_equal(out, want_out)
    assert out.dtype == np.float64 and new.dtype == np.int64


@pytest.mark.parametrize("seed", range(6))
def test_dead_cuts_in_python_match_the_compiled_sweep(seed):
    """``_cuts_py`` (flat lists) against ``_cuts`` (compiled): the same live rows and cuts."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    rows = _random_rows(rng, n)
    rows[:, 0] = rng.choice([P.LEAF, 24, 26, 30, 33, 35, 36, 37, 38], size=n)
    codes = rows[:, 0].astype(np.int64)
    diff, safe = (x[codes] for x in P._diff_operands())
    live0 = rng.random(n) < 0.3
    got = []
    for fn in (P._cuts_py, P._cuts):
        live, cut = live0.copy(), np.zeros((n, 3), dtype=np.bool_)
        fn(rows, diff, safe, live, cut)
        got.append((live, cut))
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])


def test_prune_of_no_rows():
    out, new = P.prune(np.zeros((0, 6)), np.zeros(0, np.int64))
    assert out.shape == (0, 6) and new.shape == (0,)


def test_batch_call_does_not_compile_the_one_sample_entry():
    """``Program._one`` takes the work buffers before it sees a batch's shape: the entry is
    compiled at the first one-sample call, not then (seconds of a cold first batch)."""
    x0 = np.linspace(-1, 1, 4)
    p = tg.trace(lambda x: (x[0] * x[1] + x[2].sin() * x[3]), tg.tensor(x0))
    X = np.tile(x0, (5, 1))
    code = p._variants[0]
    assert code.run is None
    v, g = p.value_and_grad(X)
    assert code.run is None and not code._free  # no buffers, nothing compiled for them
    v, g = p.value_and_grad(tg.tensor(X))  # tensors take _run_one's check
    assert code.run is None
    v1, g1 = p.value_and_grad(x0)  # the one-sample call compiles (or loads) it now
    assert code.run is not None
    np.testing.assert_allclose(np.asarray(v[0]), v1, rtol=1e-15)
    np.testing.assert_allclose(np.asarray(g[0]), g1, rtol=1e-15)
    v3, g3 = p.value_and_grad(tg.tensor(x0))  # and a one-sample tensor call after it
    np.testing.assert_allclose(np.asarray(g3), g1, rtol=1e-15)
    v2, g2 = p.value_and_grad(x0)
    assert v2 == v1 and np.array_equal(g2, g1)
