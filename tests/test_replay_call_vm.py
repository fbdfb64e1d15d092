"""The one-sample call at virtual-machine speed (issue 17 goal 1): superinstructions
(``interpreters/fuse.py``) give the numbers of the rows they fuse, to the bit, and torch's;
the interpreters that do not know them never see them; the generated entry's own names stay
apart from its sweeps'; and the returned arrays are fresh, per call and per thread."""
import ast
import contextlib
import inspect
import threading

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import fuse, replay_cpu

torch = pytest.importorskip("torch")


@contextlib.contextmanager
def fusion(on):
    """Programs whose first call runs in here get superinstructions (every pair, however
    few; at that call: no tiering), or not."""
    saved = fuse.ENABLED, fuse.MIN_PAIRED, fuse.TIER
    fuse.ENABLED, fuse.MIN_PAIRED, fuse.TIER = on, 0.0, 0
    try:
        yield
    finally:
        fuse.ENABLED, fuse.MIN_PAIRED, fuse.TIER = saved


#: a function of two scalars per pair of ``fuse.PAIRS`` (and the commutative tails with the
#: head as their first operand, which fuse swaps), written for tapegrad or torch (``M``)
PAIR_FNS = {
    ("sub", "powc", 0): lambda M, a, b: (a - b) ** 2,
    ("rsubc", "powc", 0): lambda M, a, b: (1.0 - a) ** 4,  # (3: powc_special, no pair)
    ("mulc", "add", 1): lambda M, a, b: b + 100.0 * a,
    ("mul", "add", 1): lambda M, a, b: b + a * b,  # the tail's other operand is the head's
}
SWAPPED = {  # add tails with the head first: fuse swaps their operands
    ("mulc", "add", 1): lambda M, a, b: 3.0 * a + b,
    ("mul", "add", 1): lambda M, a, b: a * b + a,
}


def test_every_pair_has_a_test():
    assert set(PAIR_FNS) == set(fuse.PAIRS)


def _chain(f):
    """``f`` applied along a vector (a few overlapping pairs, a value read twice)."""
    def g(M, x):
        y = 0.0
        for i in range(x.shape[0] - 1):
            y = y + f(M, x[i], x[i + 1]) * x[i]
        return y
    return g


def _results(prog, xs, v):
    value, grad = prog.value_and_grad(xs)
    _, hv = prog.hvp(xs, v)
    return [np.asarray(value), grad, hv, np.asarray(prog(xs)), prog.grad_program()(xs)]


def _torch(g, x, v):
    xt = torch.tensor(x, requires_grad=True)
    y = g(torch, xt)
    (gr,) = torch.autograd.grad(y, xt, create_graph=True)
    (hv,) = torch.autograd.grad((gr * torch.tensor(v)).sum(), xt)
    return y.detach().numpy(), gr.detach().numpy(), hv.numpy()


@pytest.mark.parametrize("pair, f", list(PAIR_FNS.items()) + list(SWAPPED.items()),
                         ids=lambda p: "-".join(map(str, p)) if isinstance(p, tuple) else "")
def test_superinstructions_give_their_rows_numbers_to_the_bit_and_torchs(pair, f):
    g = _chain(f)
    rng = np.random.default_rng(len(pair[0]) * 7 + pair[2])
    x0 = rng.uniform(0.5, 1.5, 6)
    fn = lambda x: g(tg, x)  # noqa: E731
    with fusion(True):
        P = tg.trace(fn, x0)
        P.value_and_grad(x0)
    with fusion(False):
        U = tg.trace(fn, x0)
        U.value_and_grad(x0)
    code = fuse.BASE + 2 * fuse.PAIRS.index(pair)
    assert (P._code.frows[:, 0] == code).any() and (P._code.frows[:, 0] == code + 1).any()
    assert (U._code.frows[:, 0] < fuse.BASE).all()
    for _ in range(3):
        x, v = rng.uniform(0.5, 1.5, 6), rng.normal(size=6)
        with fusion(True):
            got = _results(P, x, v)
        with fusion(False):
            want = _results(U, x, v)
        for a, b in zip(got, want):
            assert np.array_equal(a, b), (pair, a, b)  # the same operations in the same order
        y, gr, hv = _torch(g, x, v)
        np.testing.assert_allclose(got[0], y, rtol=1e-13)
        np.testing.assert_allclose(got[1], gr, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(got[2], hv, rtol=1e-10, atol=1e-12)


def _rosenbrock(M, x):
    f = 0.0
    for i in range(x.shape[0] - 1):
        f = f + 100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
    return f


@pytest.fixture(scope="module")
def rosen():
    with fusion(True):
        P = tg.trace(lambda x: _rosenbrock(tg, x), np.zeros(12))
        P.value_and_grad(np.zeros(12))
    return P


def test_overlapping_pairs_fuse_every_other_one(rosen):
    # (the pairs alone: ``fuse.CHAINS`` take rows of theirs first, tests/test_replay_vm_*)
    rows, fused = rosen._code.rows, fuse.fuse(rosen._code.rows, chains=False)
    ops = fused[:, 0].astype(int)
    pairs = (ops >= fuse.BASE) & (ops < fuse.LEAF_RUN)
    heads = np.nonzero(pairs & (ops % 2 == 0))[0]
    # (sub, powc), (mulc, add), (rsubc, powc) of each term; the first adds to 0.0 (addc)
    assert len(heads) == 3 * 11 - 1
    assert (ops[heads + 1] == ops[heads] + 1).all()  # each head, then its own tail
    assert (pairs & (ops % 2 == 1)).sum() == len(heads)
    # the 12 leaves are one run (its count in column 5)
    assert np.array_equal(np.nonzero(ops == fuse.LEAF_RUN)[0], [0]) and fused[0, 5] == 12
    assert np.array_equal(fused[:, 1:5], rows[:, 1:5])  # no operand moved (no add swapped)
    assert np.array_equal(fused[1:, 5], rows[1:, 5])
    assert (rows[:, 0] < fuse.BASE).all()


def test_few_pairs_run_the_rows_as_traced():
    """Below ``MIN_PAIRED`` of the rows in pairs, the entry of the rows as traced runs
    them (faster there than the entry of fused rows)."""
    fn = lambda x: (x[0] - x[1]) ** 2 + (x[2:] * x[1:-1]).exp().sum()  # noqa: E731
    x = np.linspace(0.1, 0.9, 9)
    P = tg.trace(fn, x)
    v, g = P.value_and_grad(x)
    assert P._code.frows is P._code.arows
    with fusion(True):
        Q = tg.trace(fn, x)
        assert Q.value_and_grad(x)[0] == v and np.array_equal(Q.grad(x), g)
    op = Q._code.frows[:, 0]
    assert ((op >= fuse.BASE) & (op < fuse.LEAF_RUN)).sum() == 2  # one pair (sub, powc)


def test_other_interpreters_and_files_get_the_rows_as_traced(rosen, tmp_path):
    """Batches, Jacobians and saved programs run ``rows``: the superinstructions are only
    in the one-sample entry's ``frows``."""
    rng = np.random.default_rng(5)
    X = rng.normal(size=(5, 12))
    values, grads = rosen.value_and_grad(X)
    for b in range(5):
        v, g = rosen.value_and_grad(X[b])
        assert v == values[b] and np.allclose(g, grads[b], rtol=1e-14, atol=0)
    np.testing.assert_allclose(rosen.jacobian(X[0]), rosen.grad(X[0]), rtol=1e-14)
    path = tmp_path / "rosen.npz"
    rosen.save(path)
    with np.load(path) as f:
        assert (f["rows0"][:, 0] < fuse.BASE).all()
    Q = tg.load(path)
    for _ in range(fuse.TIER + 1):  # the call after TIER of them switches
        v, g = Q.value_and_grad(X[1])
    assert (Q._code.frows[:, 0] >= fuse.BASE).any()  # fused again for its own entry
    assert v == rosen.value_and_grad(X[1])[0] and np.array_equal(g, rosen.grad(X[1]))


def test_a_rare_ops_gradient_with_one_output():
    """The rare ops' reverse branch (the shared switch) in the entry's own body: ``pow``
    adds to two adjoints (its bits were once read into the entry's count of outputs)."""
    fn = lambda M, x: (x[0] ** x[1]) * M.atan2(x[2], x[1]) + x[2]  # noqa: E731
    x = np.array([1.3, 0.7, 0.4])
    P = tg.trace(lambda x: fn(tg, x), x)
    xt = torch.tensor(x, requires_grad=True)
    fn(torch, xt).backward()
    for _ in range(2):
        v, g = P.value_and_grad(x)
        np.testing.assert_allclose(g, xt.grad.numpy(), rtol=1e-13)
        assert g.shape == (3,)


def _assigned(nodes):
    names = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
    return names


def test_the_entrys_own_names_are_not_its_sweeps():
    """``run_fused`` holds both sweeps in its body: a name a branch assigns must not be one
    of the entry's own (counts, offsets), or the results go to the wrong place."""
    fn = ast.parse(inspect.getsource(replay_cpu.run_fused.py_func)).body[0]
    loops = [s for s in fn.body if isinstance(s, ast.While)]
    assert len(loops) == 2
    own = _assigned([s for s in fn.body if not isinstance(s, ast.While)])
    sweeps = _assigned(loops)
    assert own & sweeps <= {"kk", "status"}, own & sweeps


def test_results_are_fresh_per_call_and_per_thread(rosen):
    rng = np.random.default_rng(2)
    xs = [rng.normal(size=12) for _ in range(4)]
    want = [(_rosenbrock(np, x), rosen.grad(x).copy()) for x in xs]
    v0, g0 = rosen.value_and_grad(xs[0])
    g0_copy = g0.copy()
    rosen.value_and_grad(xs[1])
    assert np.array_equal(g0, g0_copy)  # a later call wrote elsewhere
    for buf in rosen._code._free:
        assert not any(np.shares_memory(g0, b) for b in buf[:2])
    errors = []

    def work(i):
        try:
            for _ in range(300):
                j = (i + _) % 4
                v, g = rosen.value_and_grad(xs[j])
                if not (np.isclose(v, want[j][0], rtol=1e-13) and np.array_equal(g, want[j][1])):
                    errors.append((i, j))
                    return
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_input_errors_are_unchanged(rosen):
    with pytest.raises(TypeError, match="dtype int64.*astype"):
        rosen.value_and_grad(np.zeros(12, dtype=np.int64))
    with pytest.raises(ValueError, match=r"shape \[11\]"):
        rosen.value_and_grad(np.zeros(11))
    with pytest.raises(TypeError, match="takes 1 input"):
        rosen.value_and_grad(np.zeros(12), np.zeros(12))
    # strided and list inputs take the checked paths and give the same numbers
    x = np.linspace(-1, 1, 24)
    v, g = rosen.value_and_grad(x[::2].copy())
    for other in (x[::2], list(x[::2])):
        v2, g2 = rosen.value_and_grad(other)
        assert v2 == v and np.array_equal(g2, g)


def test_a_pickle_without_the_new_attributes_still_runs(rosen):
    """A program pickled before ``frows`` and ``get_vg`` existed (its state lacks them)."""
    import pickle

    from tapegrad.replay import Program, _Code
    state = rosen._code.__getstate__()
    for name in ("frows", "get_vg"):
        del state[name]
    old = _Code.__new__(_Code)
    old.__dict__.update(state)
    P = pickle.loads(pickle.dumps(Program([old])))
    x = np.linspace(-1.0, 1.0, 12)
    v, g = P.value_and_grad(x)
    assert v == rosen.value_and_grad(x)[0] and np.array_equal(g, rosen.grad(x))


# --- tiering: the rows as traced for fuse.TIER calls, then the superinstructions ----------


@pytest.fixture
def tier(monkeypatch):
    """Every pair fuses (however few), after ``fuse.TIER`` = 5 one-sample calls."""
    monkeypatch.setattr(fuse, "ENABLED", True)
    monkeypatch.setattr(fuse, "MIN_PAIRED", 0.0)
    monkeypatch.setattr(fuse, "TIER", 5)
    return 5


def _fused(P):
    return P._code.frows is not None and (P._code.frows[:, 0] >= fuse.BASE).any()


def test_the_switch_comes_exactly_after_tier_calls_with_the_same_numbers(tier, monkeypatch):
    from tapegrad import _notice
    said = []
    monkeypatch.setattr(_notice, "announce", lambda key, stream=None: said.append(key))
    monkeypatch.setattr(_notice, "PENDING", {"fused"})
    P = tg.trace(lambda x: _rosenbrock(tg, x), np.zeros(12))
    x = np.linspace(-1.2, 0.9, 12)
    first = P.value_and_grad(x)
    for i in range(2, tier + 1):  # calls 2 .. TIER: the rows as traced, forward-only ones too
        got = P(x) if i % 2 else P.value_and_grad(x)
        assert not _fused(P) and P._code.frows is P._code.arows, i
    assert said == []
    v, g = P.value_and_grad(x)  # the call after TIER switches, and runs fused
    assert _fused(P) and said == ["fused"]
    assert v == first[0] and np.array_equal(g, first[1])  # to the bit
    assert P(x) == first[0] and got is not None
    entry = P._code.run
    P.value_and_grad(x)
    assert P._code.run is entry  # switched once


def test_few_pairs_switch_to_the_rows_as_traced(tier, monkeypatch):
    monkeypatch.setattr(fuse, "MIN_PAIRED", 0.99)
    P = tg.trace(lambda x: _rosenbrock(tg, x), np.zeros(12))
    x = np.linspace(-1.2, 0.9, 12)
    want = P.value_and_grad(x)
    for _ in range(tier + 2):
        v, g = P.value_and_grad(x)
        assert v == want[0] and np.array_equal(g, want[1])
    assert P._code.frows is P._code.arows
    assert P._code.run is replay_cpu.entry(P._code.arows, P._code._free[0][0])


def test_threads_calling_a_program_while_it_switches(tier, monkeypatch):
    """Two and four threads call the same program across its switch: every result is the
    rows' own (to the bit), whichever entry ran it."""
    monkeypatch.setattr(fuse, "TIER", 40)
    rng = np.random.default_rng(11)
    xs = [rng.normal(size=12) for _ in range(6)]
    with fusion(False):
        U = tg.trace(lambda x: _rosenbrock(tg, x), np.zeros(12))
        want = [U.value_and_grad(x) for x in xs]
    for nthreads in (2, 4):
        P = tg.trace(lambda x: _rosenbrock(tg, x), np.zeros(12))
        errors, start = [], threading.Barrier(nthreads)

        def work(i, P=P, errors=errors, start=start):
            try:
                start.wait()
                for k in range(60):
                    j = (i + k) % len(xs)
                    v, g = P.value_and_grad(xs[j])
                    if not (v == want[j][0] and np.array_equal(g, want[j][1])):
                        errors.append((i, k, j))
                        return
            except Exception as e:  # noqa: BLE001  reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert _fused(P)


def test_a_caller_that_read_the_entry_before_the_switch(tier):
    """A thread may read ``code.run`` before the switch and ``code.frows`` after it (or the
    new entry with the old rows): every such pair gives the rows' numbers."""
    P = tg.trace(lambda x: _rosenbrock(tg, x), np.zeros(12))
    x = np.linspace(-1.2, 0.9, 12)
    want = P.value_and_grad(x)
    code = P._code
    stale, rows = code.run, code.frows
    code.tier_up()
    assert _fused(P) and code.run is not stale
    work, flat, _ = code.buffers()
    flat[...] = x
    for run, r in ((stale, code.frows), (stale, rows), (code.run, rows),
                   (code.run, code.frows)):
        res = np.empty(code.res_size[True])
        assert run(r, work, res) == 0
        assert res[0] == want[0] and np.array_equal(res[1:], want[1])
