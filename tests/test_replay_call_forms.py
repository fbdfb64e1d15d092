"""The generated entries' two forms (``_codegen_replay.FORMS``; issue 17 goal 5): rows of
common ops only run in the ``*_common`` entries, which have no shared switch of the rare
ops (half of a cold first call's compile); rows with any other op run in the entries of any
rows, one-sample, bound, fused and batched. The two forms give the same numbers to the bit,
and torch's."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import _generated_replay as G
from tapegrad.interpreters import fuse, replay_cpu

torch = pytest.importorskip("torch")


def rosen(M, x):
    """Common ops only (sub, powc, mulc, add, rsubc)."""
    f = 0.0
    for i in range(x.shape[0] - 1):
        f = f + 100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
    return f


def rare(M, x):
    """Common ops and two rare ones (abs, atan: ``SHARED``), which the common form lacks."""
    f = 0.0
    for i in range(x.shape[0] - 1):
        f = f + (x[i] * x[i + 1]).abs() * 0.5 + (x[i + 1] - x[i]).atan() ** 2
    return f


def torch_vg(f, x):
    xt = torch.tensor(x, requires_grad=True)
    y = f(torch, xt)
    (g,) = torch.autograd.grad(y, xt)
    return y.item(), g.numpy()


def traced(f, n=6):
    x0 = np.linspace(-0.8, 1.1, n)
    return tg.trace(lambda x: f(tg, x), x0)


def samples(seed, B=5, n=6):
    return np.random.default_rng(seed).normal(size=(B, n))


def entry_point(disp, rows, work):
    """``disp``'s compiled wrapper for these arrays (None without the JIT)."""
    numba = pytest.importorskip("numba")
    if not hasattr(disp, "overloads"):
        return None
    sig = tuple(numba.typeof(a) for a in (rows, work, work))
    return disp.overloads[sig].entry_point if sig in disp.overloads else None


def test_common_tells_rows_of_common_ops_from_any_others():
    code = traced(rosen)._code
    assert replay_cpu.common(code.rows)
    assert replay_cpu.common(fuse.fuse(code.rows))  # superinstructions pair common ops
    assert not replay_cpu.common(traced(rare)._code.rows)
    rows = code.rows.copy()
    rows[3, 0] = 2  # an opcode that no interpreter of scalar rows runs: not common
    assert not replay_cpu.common(rows)
    rows[3, 0] = fuse.BASE - 1  # above the tables, below the superinstructions
    assert not replay_cpu.common(rows)
    # a guard reads a comparison row, a rare op: a program with a branch runs the full form
    branch = tg.trace(lambda x: (x * x).sum() if x.sum() > 0 else x.sum(), np.ones(3))
    assert not replay_cpu.common(branch._code.rows)


@pytest.mark.parametrize("tier", [64, 0], ids=["as-traced", "fused"])
def test_each_program_runs_its_form_and_gets_torchs_numbers(tier, monkeypatch):
    monkeypatch.setattr(fuse, "TIER", tier)
    monkeypatch.setattr(fuse, "MIN_PAIRED", 0.0)
    for f, form in ((rosen, "_common"), (rare, "")):
        prog = traced(f)
        X = samples(1)
        for x in X:
            value, grad = prog.value_and_grad(x)
            want_v, want_g = torch_vg(f, x)
            np.testing.assert_allclose(value, want_v, rtol=1e-13)
            np.testing.assert_allclose(grad, want_g, rtol=1e-12, atol=1e-14)
            assert prog(x) == value
        code = prog._code
        work = code._free[0][0]
        name = "run_into" if code.frows is code.arows else "run_fused"
        if tier == 0:
            assert name == "run_fused"
        ep = entry_point(getattr(G, name + form), code.frows, work)
        if ep is not None:  # (as traced, ``run`` is a tier's wrapper around ``entry``'s)
            assert replay_cpu.entry(code.frows, work, getattr(G, name)) is ep
            assert tier or code.run is ep
        # a batch (its form: form_of), and a bound call, give the single calls' numbers
        assert replay_cpu.form_of(code.rows) is getattr(G, "run_block" + form)
        values, grads = prog.value_and_grad(X)
        for j, x in enumerate(X):
            v, g = prog.value_and_grad(x)
            assert values[j] == v
            np.testing.assert_array_equal(grads[j], g)
        x, out, g = X[0].copy(), np.empty(()), np.empty(6)
        prog.buffer(x, out=out, grad=g)()
        v, want = prog.value_and_grad(X[0])
        assert out == v
        np.testing.assert_array_equal(g, want)


def _one(entry, rows, code, x):
    work = replay_cpu.new_work(code.nslots, code.out_slots, code.in_slots, code.n_in)
    start = replay_cpu.HEADER + 2 * len(code.out_slots) + len(code.in_slots)
    work[start:start + code.n_in] = x
    res = np.empty(code.res_size[True])
    assert entry(rows, work, res) == 0
    return res


def _block(entry, code, X):
    status, outs, Gr = replay_cpu._outputs(X, code.out_slots, code.in_slots, True)
    n, B = code.rows.shape[0], X.shape[0]
    entry(code.rows, X, code.out_slots, np.ones((B, 1)), code.in_slots, True, status, outs,
          Gr, 0, B, np.empty(n * B), np.empty(n * B), replay_cpu._NO_SIGNAL, 0)
    assert (status == 0).all()
    return outs, Gr


def test_the_form_of_any_rows_gives_the_common_forms_numbers_to_the_bit():
    """The entries of any rows, forced on rows of common ops, against their common forms
    (which the calls pick): the same branches, the same numbers."""
    code = traced(rosen, 9)._code
    fused = fuse.fuse(code.rows)
    assert fused is not code.rows
    X = samples(2, 7, 9)
    for x in X:
        want = _one(G.run_into_common, code.rows, code, x)
        np.testing.assert_array_equal(_one(G.run_into, code.rows, code, x), want)
        np.testing.assert_array_equal(_one(G.run_fused, fused, code, x), want)
        np.testing.assert_array_equal(_one(G.run_fused_common, fused, code, x), want)
        v, g = torch_vg(rosen, x)
        np.testing.assert_allclose(want, np.concatenate([[v], g]), rtol=1e-12, atol=1e-14)
    outs, Gr = _block(G.run_block_common, code, X)
    outs2, Gr2 = _block(G.run_block, code, X)
    np.testing.assert_array_equal(outs, outs2)
    np.testing.assert_array_equal(Gr, Gr2)
    for j, x in enumerate(X):
        np.testing.assert_array_equal(np.concatenate([outs[j], Gr[j]]),
                                      _one(G.run_into_common, code.rows, code, x))


def test_the_batch_form_is_found_again_for_other_rows(monkeypatch):
    """``form_of`` keeps the last rows' form by identity, checked by a weak reference: an id
    whose array is gone (another array may have it now) is worked out again."""
    common_rows, rare_rows = traced(rosen)._code.rows, traced(rare)._code.rows
    assert replay_cpu.form_of(common_rows) is G.run_block_common
    assert replay_cpu.form_of(rare_rows) is G.run_block
    assert replay_cpu.form_of(common_rows) is G.run_block_common
    monkeypatch.setattr(replay_cpu, "_last_form",
                        (id(rare_rows), lambda: None, G.run_block_common, rare_rows))
    assert replay_cpu.form_of(rare_rows) is G.run_block


def test_batches_of_two_programs_in_threads_at_once_keep_their_forms():
    """Threads batching a program of common ops and one with rare ops at once: each batch
    runs its own form (``form_of`` reads its one tuple whole), with single calls' numbers."""
    import threading
    progs = [traced(rosen), traced(rare)]
    X = samples(3, 16)
    want = [[p.value_and_grad(x) for x in X] for p in progs]
    errors = []

    def work(i):
        try:
            for _ in range(40):
                values, grads = progs[i].value_and_grad(X)
                for j, (v, g) in enumerate(want[i]):
                    assert values[j] == v
                    np.testing.assert_array_equal(grads[j], g)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
