"""The cheap calls of a traced program (one sample on the CPU skips the general input and
output handling): same numbers, types and errors as the general path, no aliasing between
calls; small batches on target="parallel" run serially; issue 17's benchmark rows."""
import threading

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import replay
from tapegrad.interpreters import replay_cpu

torch = pytest.importorskip("torch")


def f3(a, b, c):
    """Three inputs of three shapes (0-d, 1-d, 2-d), a scalar output."""
    return a * (b * b).sum() + (c.sin() * b[0]).sum() - a.exp()


def torch_vg(a, b, c):
    ts = [torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True) for x in (a, b, c)]
    y = f3(*ts)
    return y.item(), [g.numpy() for g in torch.autograd.grad(y, ts)]


def inputs(seed):
    rng = np.random.default_rng(seed)
    return np.array(rng.normal()), rng.normal(size=3), rng.normal(size=(2, 3))


@pytest.fixture(scope="module")
def prog():
    return tg.trace(f3, *inputs(0))


@pytest.fixture
def no_general_path(monkeypatch):
    """Fail if a call goes through ``Program._inputs`` (the general path)."""
    def refuse(*a, **k):
        raise AssertionError("the general path ran")
    monkeypatch.setattr(replay.Program, "_inputs", refuse)


def test_one_sample_calls_take_the_fast_path_and_match_torch(prog, no_general_path):
    for seed in (1, 2):
        a, b, c = inputs(seed)
        value, (ga, gb, gc) = prog.value_and_grad(a, b, c)
        want, (wa, wb, wc) = torch_vg(a, b, c)
        assert type(value) is np.float64 and type(ga) is np.float64
        assert gb.shape == (3,) and gc.shape == (2, 3)
        np.testing.assert_allclose([value, ga], [want, wa], rtol=1e-13)
        np.testing.assert_allclose(gb, wb, rtol=1e-13)
        np.testing.assert_allclose(gc, wc, rtol=1e-13)
        assert prog(a, b, c) == value
        # a Python float for the 0-d input, tensors in: tensors out, as the general path
        v2, g2 = prog.value_and_grad(float(a), tg.tensor(b), c)
        assert isinstance(v2, tg.Tensor) and isinstance(g2[2], tg.Tensor)
        assert v2.item() == value and g2[0].item() == ga
        np.testing.assert_array_equal(g2[2].numpy(), gc)


def test_fast_results_equal_the_general_path(prog, monkeypatch):
    a, b, c = inputs(3)
    fast = prog.value_and_grad(tg.tensor(a), b, c), prog(a, b, c)
    monkeypatch.setattr(replay.Program, "_run_one", lambda *args, **kw: None)
    slow = prog.value_and_grad(tg.tensor(a), b, c), prog(a, b, c)
    assert type(fast[0][0]) is type(slow[0][0]) and fast[0][0].item() == slow[0][0].item()
    for x, y in zip(fast[0][1], slow[0][1]):
        assert type(x) is type(y) and x.shape == y.shape
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    assert type(fast[1]) is type(slow[1]) and fast[1] == slow[1]


def test_results_never_alias_a_later_call_or_the_inputs(prog):
    a, b, c = inputs(4)
    _, g = prog.value_and_grad(a, b, c)
    kept = [np.copy(x) for x in g]
    prog.value_and_grad(*inputs(5))
    for x, y in zip(g, kept):
        np.testing.assert_array_equal(x, y)
    for x in g[1:]:
        assert not any(np.shares_memory(x, i) for i in (a, b, c))
    g[1][:] = 7.0  # the gradients of two inputs are separate arrays to the user
    np.testing.assert_array_equal(g[2], kept[2])
    one = tg.trace(lambda x: (x * x).sum(), np.ones(3))
    x = np.arange(3.0)
    _, gx = one.value_and_grad(x)
    assert not np.shares_memory(gx, x)
    x[:] = 0.0
    np.testing.assert_array_equal(gx, [0.0, 2.0, 4.0])


def test_one_sample_calls_reuse_their_buffers(prog):
    """The compiled entry sweeps into buffers kept with the program (values, adjoints, the
    flat inputs): one each after many calls; only the results are new."""
    a, b, c = inputs(11)
    code = prog._code
    v, g = prog.value_and_grad(a, b, c)
    (buf,) = code._free
    for _ in range(3):
        assert prog(a, b, c) == v
        v2, g2 = prog.value_and_grad(a, b, c)
        assert v2 == v and all((x == y).all() for x, y in zip(g, g2))
        assert not any(np.shares_memory(x, y) for x, y in zip(g, g2))
    assert len(code._free) == 1 and code._free[0] is buf
    # another float64 dtype object (big-endian): the general path says what to do
    with pytest.raises(TypeError, match="input 1 has dtype >f8"):
        prog.value_and_grad(a, b.astype(">f8"), c)


def test_bad_inputs_still_raise_clear_errors(prog):
    a, b, c = inputs(6)
    with pytest.raises(TypeError, match="input 1 has dtype float32"):
        prog.value_and_grad(a, b.astype(np.float32), c)
    with pytest.raises(ValueError, match=r"input 2 has shape \[3, 2\]"):
        prog.value_and_grad(a, b, c.T)
    with pytest.raises(ValueError, match=r"input 1 has shape \[2\]"):
        prog(a, b[:2], c)
    with pytest.raises(TypeError, match="takes 3 input"):
        prog.value_and_grad(a, b)
    with pytest.raises(ValueError, match=r"v\[1\] has shape \[2\]"):
        prog.hvp((a, b, c), (a, b[:2], c))
    with pytest.raises(ValueError, match="v has 2 part"):
        prog.hvp((a, b, c), (a, b))
    # non-contiguous inputs of the right shape are fine
    value, g = prog.value_and_grad(a, b, np.asfortranarray(c))
    assert value == prog(a, b, c)


def test_guards_on_the_fast_path():
    def f(x, y):
        return (x * y).sum() if (x.sum() > 0) else (x - y).sum()
    x, y = np.ones(2), np.ones(2)
    strict = tg.trace(f, x, y)
    with pytest.raises(tg.GuardError, match="branch"):
        strict.value_and_grad(-x, y)
    with pytest.raises(tg.GuardError, match="branch"):
        strict(-x, y)
    with pytest.raises(tg.GuardError, match="branch"):
        strict.hvp((-x, y), (x, y))
    prog = tg.trace(f, x, y, retrace=True)
    assert prog.value_and_grad(-x, y)[0] == -4.0
    assert len(prog._variants) == 2
    # both variants now answer on the fast path, each with its own branch's numbers
    for s, want in ((1.0, 4.0), (-1.0, -6.0)):
        v, (gx, gy) = prog.value_and_grad(s * x, 2 * y)
        assert v == want == prog(s * x, 2 * y)
        np.testing.assert_array_equal(gx, [2.0, 2.0] if s > 0 else [1.0, 1.0])
        val, hv = prog.hvp((s * x, 2 * y), (x, y))
        assert val == v
        np.testing.assert_array_equal(hv[0], [1.0, 1.0] if s > 0 else [0.0, 0.0])


def test_hvp_matches_torch(prog, no_general_path):
    a, b, c = inputs(7)
    va, vb, vc = inputs(8)
    value, (ha, hb, hc) = prog.hvp((a, b, c), (va, vb, vc))
    ts = tuple(torch.tensor(np.asarray(x, dtype=np.float64)) for x in (a, b, c))
    vs = tuple(torch.tensor(np.asarray(x, dtype=np.float64)) for x in (va, vb, vc))
    want, (wa, wb, wc) = torch.autograd.functional.hvp(f3, ts, vs)
    np.testing.assert_allclose(value, want.item(), rtol=1e-13)
    for got, w in ((ha, wa), (hb, wb), (hc, wc)):
        np.testing.assert_allclose(got, w.numpy(), rtol=1e-12, atol=1e-13)
    # one input: the product has the input's shape (the program's gradient also holds v's)
    one = tg.trace(lambda x: (x.sin() * x).prod(), b)
    value, h = one.hvp(b, vb)
    want, w = torch.autograd.functional.hvp(lambda x: (x.sin() * x).prod(),
                                            torch.tensor(b), torch.tensor(vb))
    assert h.shape == (3,)
    np.testing.assert_allclose(value, want.item(), rtol=1e-13)
    np.testing.assert_allclose(h, w.numpy(), rtol=1e-12, atol=1e-13)


def test_threads_share_no_buffers(prog):
    samples = [inputs(100 + i) for i in range(8)]
    want = [prog.value_and_grad(*s) for s in samples]
    errors = []

    def work(i):
        for _ in range(200):
            v, g = prog.value_and_grad(*samples[i])
            if v != want[i][0] or any((x != y).any() for x, y in zip(g, want[i][1])):
                errors.append(i)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_small_batches_on_the_parallel_target_run_serially(monkeypatch):
    calls = []
    serial = replay_cpu.run_batch

    def spy(*args):
        calls.append(args[1].shape[0])  # samples in rows
        return serial(*args)
    monkeypatch.setattr(replay_cpu, "run_parallel", spy)
    prog = tg.trace(lambda x: (x.sin() * x).sum(), np.zeros(3), target="parallel")
    X = np.random.default_rng(9).normal(size=(prog.block, 3))
    v, g = prog.value_and_grad(X)
    assert calls == []  # one block: nothing to spread over the cores
    np.testing.assert_array_equal(g[5], prog.value_and_grad(X[5])[1])
    prog.value_and_grad(np.concatenate([X, X]))
    assert calls == []  # two blocks, but less work than a worker's start can pay for
    monkeypatch.setattr(replay_cpu, "PARALLEL_WORK", 2 * prog.block * len(prog))
    prog.value_and_grad(np.concatenate([X, X]))
    assert calls == [2 * prog.block]


# --- issue 17's benchmark rows ----------------------------------------------------------------


def test_vm_rows_are_registered_and_their_peers_compute_the_same():
    pytest.importorskip("casadi")
    from tapegrad.bench import cases, vm
    for name in ("replay_rosenbrock_scalar_n100_vs_casadi",
                 "replay_rosenbrock_scalar_n100_buffer_vs_casadi",
                 "replay_hvp_rosenbrock_scalar_n100_vs_casadi_jtimes",
                 "replay_call_overhead_3_inputs_vs_compiled_entry"):
        case = cases.SPEED_CASES[name]
        assert case is vm.CASES[name]
        for library in ("tapegrad", case.peer):
            result = case.make(library)()
            assert cases.check_result(case, result) <= case.rtol
            result = case.make(library)()  # a second call reads fresh results
            assert cases.check_result(case, result) <= case.rtol


def test_vm_notes_and_absolute_targets():
    from tapegrad.bench import __main__ as cli, vm
    name = "replay_call_overhead_3_inputs_vs_compiled_entry"
    row = cli.Row(name, "speed", "s", ">= 0x", tapegrad=3.5e-6, torch=1.0e-6, ratio=0.29,
                  passed=True)
    vm.finish(name, row)
    assert row.passed is False and row.target.startswith("<= 2 us")
    assert "Python side 2.5 us" in row.extra["note"]
    assert any(n.startswith(f"{name}: Python side") for n in cli.render_notes([row], True))
    row = cli.Row("replay_batch256_rosenbrock_scalar_n100_vs_single_calls", "speed", "s",
                  ">= 3x", tapegrad=256e-6, torch=512e-6)
    vm.finish(row.case, row)
    assert row.extra["note"] == "per input: tapegrad 1 us, single calls 2 us"


def test_batch_blocks_fit_the_cache_and_give_the_same_numbers():
    from tapegrad.bench.cases import rosenbrock_scalar
    small = tg.trace(lambda x: (x.sin() * x).sum(), np.zeros(3))
    assert small.block == replay_cpu.BLOCK
    n = 100
    big = tg.trace(lambda x: rosenbrock_scalar([x[i] for i in range(n)]), np.zeros(n))
    assert big.block == 128 and big.to("parallel").block == 128  # 892 rows: 1.8 MB
    n = 1000  # 8,992 rows: 128 samples would be 18 MB of values and adjoints
    bigger = tg.trace(lambda x: rosenbrock_scalar([x[i] for i in range(n)]), np.zeros(n))
    assert bigger.block == 64
    n = 100
    X = np.random.default_rng(10).normal(size=(150, n))
    v, g = big.value_and_grad(X)
    v0, g0 = replay.Program(big._variants, block=16).value_and_grad(X)
    np.testing.assert_array_equal(v, v0)
    np.testing.assert_array_equal(g, g0)
    np.testing.assert_array_equal(g[77], big.value_and_grad(X[77])[1])


def test_run_block_room_reused_or_too_small_gives_the_same_numbers():
    """``run_block`` sweeps into the caller's room (values, adjoints), reused from block to
    block, so the adjoints are zeroed each time: stale NaNs in it change nothing."""
    prog = tg.trace(lambda x: (x.sin() * x).sum() * x[0], np.zeros(3))
    code = prog._code
    X = np.ascontiguousarray(np.random.default_rng(12).normal(size=(5, 3)))  # samples x inputs
    S = np.ones((5, 1))
    want = [prog.value_and_grad(X[j].copy()) for j in range(5)]
    n = code.rows.shape[0]
    for W in (np.full(2 * n * 2, np.nan), np.full(2 * n * 3, np.nan)):
        status, outs, G = replay_cpu._outputs(X, code.out_slots, code.in_slots, True)
        for b0 in (0, 2, 4):  # blocks of 2, the last of 1
            replay_cpu.run_block(code.rows, X, code.out_slots, S, code.in_slots, True,
                                 status, outs, G, b0, min(5, b0 + 2), W[:2 * n], W[2 * n:],
                                 replay_cpu._NO_SIGNAL, 0)
        assert (status == 0).all()
        for j, (v, g) in enumerate(want):
            assert outs[j, 0] == v
            np.testing.assert_array_equal(G[j], g)


def test_block_room_is_kept_per_thread(monkeypatch):
    """Each thread keeps its largest block room between calls (up to ROOM_KEPT bytes)."""
    rows = np.zeros((10, 6))
    monkeypatch.setattr(replay_cpu, "_local", threading.local())
    V, A = replay_cpu._room(rows, 16)
    W = V.base
    assert V.shape == A.shape == (160,) and A.base is W
    assert replay_cpu._room(rows, 8)[0].base is W
    other = []
    t = threading.Thread(target=lambda: other.append(replay_cpu._room(rows, 16)))
    t.start()
    t.join()
    assert other[0][0].base is not W
    monkeypatch.setattr(replay_cpu, "ROOM_KEPT", 8 * 320)
    big = replay_cpu._room(rows, 32)
    assert big[0].shape == (320,) and replay_cpu._room(rows, 16)[0].base is W  # too big to keep


def test_one_vector_calls_match_the_general_path(monkeypatch):
    """One float64 vector in (``Program._one``): the same numbers and types as the
    other paths, a strided vector without a compile for its layout, guards and variants."""
    def f(x):
        return (x.sin() * x).sum() if x[0] > 0 else (x * x).sum()
    prog = tg.trace(f, np.ones(4), retrace=True)
    X = np.random.default_rng(13).normal(size=8)
    X[0] = 0.5
    x = X[::2]  # strided
    prog.value_and_grad(np.ascontiguousarray(x))
    signatures = len(replay_cpu.run_into.signatures)
    got = prog.value_and_grad(x), prog(x), prog.value_and_grad(-x), prog(-x)
    assert len(prog._variants) == 2
    assert len(replay_cpu.run_into.signatures) == signatures
    monkeypatch.setattr(replay.Program, "_one", lambda *args, **kw: None)
    ref = prog.value_and_grad(x), prog(x), prog.value_and_grad(-x), prog(-x)
    monkeypatch.setattr(replay.Program, "_run_one", lambda *args, **kw: None)
    slow = prog.value_and_grad(x), prog(x), prog.value_and_grad(-x), prog(-x)
    for a, b, c in zip(got, ref, slow):
        a, b, c = (r if isinstance(r, tuple) else (r,) for r in (a, b, c))
        for u, v, w in zip(a, b, c):
            assert type(u) is type(v) is type(w)
            np.testing.assert_array_equal(u, v)
            np.testing.assert_array_equal(u, w)
    xt = torch.tensor(-x, requires_grad=True)
    (want,) = torch.autograd.grad((xt * xt).sum(), (xt,))
    np.testing.assert_array_equal(got[2][1], want.numpy())
    # a (1, 1) output is not a vector result: it is reshaped
    sq = tg.trace(lambda x: (x * x).sum().reshape(1, 1), np.ones(3))
    assert sq(np.ones(3)).shape == (1, 1) and sq.value_and_grad(np.ones(3))[0].shape == (1, 1)
