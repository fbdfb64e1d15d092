"""The cheapest one-sample call (``Program._one``: float64 ndarrays of the traced shapes, the
inputs copied into the compiled entry's buffer): results stay fresh, threads never share a
buffer, every other input takes the checked paths, and programs still pickle."""
import pickle
import threading

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import replay
from tapegrad.interpreters import fuse, replay_cpu
from tapegrad.interpreters import _generated_replay as G

torch = pytest.importorskip("torch")


def f3(a, b, c):
    return (a * b).sum() + (c.sin() * a[0]).sum() + (b * b).sum().exp() * 1e-3


def three(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=2), rng.normal(size=2), rng.normal(size=(2, 3))


def torch_vg(f, xs):
    ts = [torch.tensor(x, requires_grad=True) for x in xs]
    y = f(*ts)
    return y.item(), [g.numpy() for g in torch.autograd.grad(y, ts)]


@pytest.fixture(scope="module")
def prog():
    return tg.trace(f3, *three(0))


@pytest.fixture
def fast_only(monkeypatch):
    """Fail if a call leaves ``Program._one`` (for the checked paths)."""
    def refuse(*a, **k):
        raise AssertionError("a checked path ran")
    monkeypatch.setattr(replay.Program, "_run_one", refuse)
    monkeypatch.setattr(replay.Program, "_inputs", refuse)


def test_ndarray_calls_take_the_cheapest_path_and_match_torch(prog, fast_only):
    for seed in (1, 2, 3):
        xs = three(seed)
        value, grads = prog.value_and_grad(*xs)
        want, wgrads = torch_vg(f3, xs)
        assert type(value) is np.float64 and isinstance(grads, tuple)
        np.testing.assert_allclose(value, want, rtol=1e-13)
        for g, w in zip(grads, wgrads):
            assert g.shape == w.shape and g.dtype == np.float64
            np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-15)
        assert prog(*xs) == value
        assert prog.grad(*xs)[2].shape == (2, 3)


def test_results_are_fresh_and_never_the_buffers(prog, fast_only):
    xs = three(4)
    v1, g1 = prog.value_and_grad(*xs)
    kept = [g.copy() for g in g1]
    out1 = prog(*xs)
    for _ in range(3):  # later calls at other inputs overwrite the buffers, not the results
        prog.value_and_grad(*three(5))
        prog(*three(6))
    for g, k in zip(g1, kept):
        np.testing.assert_array_equal(g, k)
    assert v1 == out1 == prog(*xs)
    buffers = [a for buf in prog._code._free for a in (buf[0],)]
    for g in g1:
        assert not any(np.shares_memory(g, w) for w in buffers)
        assert not any(np.shares_memory(g, x) for x in xs)
    xs[0][:] = 0.0  # the inputs were copied: changing them changes nothing returned
    for g, k in zip(g1, kept):
        np.testing.assert_array_equal(g, k)


def test_one_vector_results_are_fresh_too():
    prog = tg.trace(lambda x: (x.sin() * x).sum(), np.ones(5))
    x = np.linspace(-1.0, 1.0, 5)
    v, g = prog.value_and_grad(x)
    keep = g.copy()
    prog.value_and_grad(-x)
    np.testing.assert_array_equal(g, keep)
    np.testing.assert_allclose(g, np.sin(x) + x * np.cos(x), rtol=1e-14)
    assert not np.shares_memory(g, prog._code._free[0][0]) and not np.shares_memory(g, x)


def test_threads_calling_one_program_get_their_own_results(prog):
    """The compiled entry releases the GIL: two threads in it at once must each sweep their
    own buffer (a shared one would mix their inputs, values and adjoints)."""
    inputs = [three(100 + i) for i in range(8)]
    want = [prog.value_and_grad(*xs) for xs in inputs]
    errors = []

    def worker(k):
        try:
            for r in range(300):
                i = (k + r) % len(inputs)
                v, g = prog.value_and_grad(*inputs[i])
                if v != want[i][0] or any((a != b).any() for a, b in zip(g, want[i][1])):
                    errors.append((k, r, i))
                if prog(*inputs[i]) != want[i][0]:
                    errors.append((k, r, i, "forward"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert 1 <= len(prog._code._free) <= 4  # a buffer per thread at most, all given back


def test_other_inputs_take_the_checked_paths(prog):
    a, b, c = three(7)
    v, g = prog.value_and_grad(a, b, c)
    signatures = len(replay_cpu.run_into.signatures)
    # strided and Fortran-ordered inputs: copied into the buffer, no compile for their layout
    A = np.empty(4)
    A[::2] = a
    v2, g2 = prog.value_and_grad(A[::2], b, np.asfortranarray(c))
    assert v2 == v and all((x == y).all() for x, y in zip(g, g2))
    assert len(replay_cpu.run_into.signatures) == signatures
    # a batch of one is a batch, not one sample
    vb, gb = prog.value_and_grad(a[None], b[None], c[None])
    assert vb.shape == (1,) and gb[2].shape == (1, 2, 3)
    np.testing.assert_allclose(gb[2][0], g[2], rtol=1e-14)
    with pytest.raises(TypeError, match="input 0 has dtype float32"):
        prog.value_and_grad(a.astype(np.float32), b, c)
    with pytest.raises(TypeError, match="input 2 has dtype >f8"):
        prog(a, b, c.astype(">f8"))
    with pytest.raises(ValueError, match=r"input 1 has shape \[3\]"):
        prog.value_and_grad(a, np.ones(3), c)
    with pytest.raises(TypeError, match="takes 3 input"):
        prog.value_and_grad(a, b)
    # lists are arrays to the general path
    v3, _ = prog.value_and_grad(list(a), b, c)
    assert v3 == v


def test_a_0d_input_and_a_numpy_scalar():
    prog = tg.trace(lambda s, x: (s * x).sum() + s * s, np.array(2.0), np.ones(3))
    x = np.array([1.0, 2.0, 3.0])
    for s in (np.array(1.5), np.float64(1.5), 1.5):
        v, (gs, gx) = prog.value_and_grad(s, x)
        assert v == 1.5 * 6.0 + 2.25 and gs == 6.0 + 3.0
        np.testing.assert_array_equal(gx, [1.5, 1.5, 1.5])


def test_guards_and_variants_on_the_cheapest_path():
    def f(x, y):
        return (x * y).sum() if x[0] > 0 else (x - y).sum()
    prog = tg.trace(f, np.ones(2), np.ones(2), retrace=True)
    x, y = np.array([-1.0, 2.0]), np.array([3.0, 4.0])
    v, (gx, gy) = prog.value_and_grad(x, y)
    assert len(prog._variants) == 2 and v == -1.0 - 3.0 + 2.0 - 4.0
    np.testing.assert_array_equal(gx, [1.0, 1.0])
    np.testing.assert_array_equal(gy, [-1.0, -1.0])
    assert prog(-x, y) == 1.0 * 3.0 - 2.0 * 4.0  # x[0] > 0: the first variant
    np.testing.assert_array_equal(prog.value_and_grad(-x, y)[1][0], y)
    strict = tg.trace(f, np.ones(2), np.ones(2))
    with pytest.raises(tg.GuardError, match="retrace=True"):
        strict.value_and_grad(x, y)
    assert len(strict._code._free) == 1  # the buffer came back after the failed guard


def square_and_sum(x, y):
    return (x * y).reshape(2, 2), x.sum()


def sum_of_squares(x):
    return (x * x).sum()


def test_programs_with_any_result_shape_pickle_and_replay():
    prog = tg.trace(square_and_sum, np.ones(4), np.ones(4))
    x, y = np.arange(4.0), np.arange(4.0) + 1.0
    first = prog(x, y)
    again = pickle.loads(pickle.dumps(prog))
    assert again._code._free == []
    for a, b in zip(first, again(x, y)):
        np.testing.assert_array_equal(a, b)
    assert first[0].shape == (2, 2)
    one = tg.trace(sum_of_squares, np.ones(3))
    one.value_and_grad(np.ones(3))
    g = pickle.loads(pickle.dumps(one)).grad(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(g, [2.0, 4.0, 6.0])


def test_the_entry_called_past_numbas_dispatch_is_run_into_for_the_programs_arrays(prog):
    numba = pytest.importorskip("numba")
    xs = three(8)
    for _ in range(fuse.TIER + 2):  # past the tier-up, whichever tests ran on the module's
        value, grads = prog.value_and_grad(*xs)  # program before (xdist splits modules)
    code = prog._code
    work, flat, _ = code._free[0]
    res = np.empty(code.res_size[True])
    # (its form of common ops: the program has no other, ``replay_cpu.common``)
    assert replay_cpu.common(code.rows)
    if hasattr(replay_cpu.run_into, "overloads"):  # compiled (not NUMBA_DISABLE_JIT)
        sig = tuple(numba.typeof(a) for a in (code.rows, work, res))
        assert code.run is G.run_into_common.overloads[sig].entry_point
    flat[:] = np.concatenate([x.reshape(-1) for x in xs])
    assert replay_cpu.run_into(code.rows, work, res) == 0  # the form of any rows: the same
    np.testing.assert_array_equal(res, np.concatenate(
        [[value]] + [g.reshape(-1) for g in grads]))
    # the compiled callers' entry (optim_loop) lays out its own buffer the same way
    st, outs, g = replay_cpu.run_fresh(code.rows, flat.copy(), code.out_slots, np.ones(1),
                                       code.in_slots, True)
    assert st == 0 and outs[0] == value
    np.testing.assert_array_equal(g, res[1:])
