"""The one-sample entry that takes a few small 1-D inputs as arguments (``replay_cpu.run_args``,
``_Code.args``, after the tier-up): the same numbers as the copy into the entry's buffer, the
same errors for every other input, fresh results, guards, threads and pickles."""
import pickle
import threading

import numpy as np
import pytest

import tapegrad as tg
from tapegrad._program_code import with_args
from tapegrad.interpreters import replay_cpu

torch = pytest.importorskip("torch")


def f3(a, b, c):
    return (a * b).sum() + (c.sin() * a[0]).sum() + (b * b).sum().exp() * 1e-3


def three(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=2), rng.normal(size=2), rng.normal(size=3)


def torch_vg(f, xs):
    ts = [torch.tensor(x, requires_grad=True) for x in xs]
    y = f(*ts)
    return y.item(), [g.numpy() for g in torch.autograd.grad(y, ts)]


@pytest.fixture(scope="module")
def prog():
    p = tg.trace(f3, *three(0))
    p._code.tier_up()  # what a loop's 65th call does
    return p


def no_args(p):
    """``p`` without its entry of arguments: the copy into the entry's buffer."""
    p._code._one_consts = with_args(p._code._one_consts, None)
    assert p._code.args is None


@pytest.fixture(scope="module")
def plain():
    """The same program on the copy into the entry's buffer (no ``args``)."""
    p = tg.trace(f3, *three(0))
    p._code.tier_up()
    no_args(p)
    return p


def test_small_1d_inputs_take_the_entry_of_arguments(prog, monkeypatch):
    code = prog._code
    assert code.args is not None
    prog.value_and_grad(*three(1))  # (the entry is compiled at its first call)
    entry, rows = code.args
    calls = []

    def counted(*a):
        calls.append(len(a))
        return entry(*a)
    monkeypatch.setattr(code, "_one_consts", with_args(code._one_consts, (counted, rows)))
    monkeypatch.setattr(code, "run", None)  # the buffer's entry is not called
    xs = three(1)
    prog.value_and_grad(*xs)
    prog(*xs)
    assert calls == [6, 6]


def test_the_numbers_are_the_copys_and_torchs(prog, plain):
    for seed in (1, 2, 3):
        xs = three(seed)
        value, grads = prog.value_and_grad(*xs)
        v0, g0 = plain.value_and_grad(*xs)
        assert type(value) is np.float64 and value == v0
        for g, h in zip(grads, g0):
            assert g.dtype == np.float64 and g.shape == h.shape
            np.testing.assert_array_equal(g, h)
        want, wgrads = torch_vg(f3, xs)
        np.testing.assert_allclose(value, want, rtol=1e-13)
        for g, w in zip(grads, wgrads):
            np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-15)
        assert prog(*xs) == v0 == plain(*xs)


def test_strided_reversed_and_read_only_inputs(prog, plain):
    a, b, c = three(4)
    want = plain.value_and_grad(a, b, c)
    A = np.zeros(6)
    A[::3] = a
    R = c[::-1].copy()[::-1]  # a negative stride
    B = b.copy()
    B.flags.writeable = False
    got = prog.value_and_grad(A[::3], B, R)
    assert got[0] == want[0]
    for g, h in zip(got[1], want[1]):
        np.testing.assert_array_equal(g, h)
    assert (A[::3] == a).all() and (B == b).all()  # the inputs are only read


def test_results_are_fresh_and_never_the_buffers_or_inputs(prog):
    xs = three(5)
    v1, g1 = prog.value_and_grad(*xs)
    kept = [g.copy() for g in g1]
    for seed in (6, 7):
        prog.value_and_grad(*three(seed))
    for g, k in zip(g1, kept):
        np.testing.assert_array_equal(g, k)
    works = [buf[0] for buf in prog._code._free]
    for g in g1:
        assert not any(np.shares_memory(g, w) for w in works)
        assert not any(np.shares_memory(g, x) for x in xs)


def test_other_inputs_get_the_same_errors_and_paths(prog, plain):
    a, b, c = three(8)
    for p in (prog, plain):
        with pytest.raises(TypeError, match="input 0 has dtype float32"):
            p.value_and_grad(a.astype(np.float32), b, c)
        # int64 has float64's itemsize: only the dtype check stops it
        with pytest.raises(TypeError, match="input 1 has dtype int64"):
            p.value_and_grad(a, np.arange(2), c)
        with pytest.raises(TypeError, match="input 2 has dtype >f8"):
            p(a, b, c.astype(">f8"))
        with pytest.raises(ValueError, match=r"input 1 has shape \[3\]"):
            p.value_and_grad(a, np.ones(3), c)
        with pytest.raises(ValueError, match=r"input 0 has shape \[\]"):
            p.value_and_grad(np.array(1.0), b, c)
        with pytest.raises(ValueError, match=r"input 2 has shape \[3, 1\]"):
            p.value_and_grad(a, b, c[:, None])
        with pytest.raises(TypeError, match="takes 3 input"):
            p.value_and_grad(a, b)
    want = plain.value_and_grad(a, b, c)
    # lists and tensors: the general path, the same numbers
    assert prog.value_and_grad(list(a), b, c)[0] == want[0]
    assert prog(tg.tensor(a), b, c).item() == want[0]
    # a batch of one is a batch
    vb, gb = prog.value_and_grad(a[None], b[None], c[None])
    assert vb.shape == (1,) and gb[2].shape == (1, 3)
    np.testing.assert_allclose(gb[2][0], want[1][2], rtol=1e-14)
    assert len(prog._code._free) == 1  # every refused call gave its buffer back


def test_the_entry_refuses_inputs_whose_sizes_do_not_add_up(prog):
    prog.value_and_grad(*three(9))  # (the entry is compiled at its first call)
    code = prog._code
    entry, rows = code.args
    work, flat, _ = code.buffers()
    try:
        flat[:] = 7.0
        res = np.empty(code.res_size[True])
        a, b, c = three(9)
        assert entry(rows, work, res, a, b, replay_cpu.NO_X) == -1
        assert entry(rows, work, res, a, b, np.ones(4)) == -1
        assert (flat == 7.0).all()  # nothing written
        assert entry(rows, work, res, a, b, c) == 0
        np.testing.assert_array_equal(flat, np.concatenate([a, b, c]))
    finally:
        code._free.append((work, flat, _))


def squares(x, y=None):
    """A program of scalar rows (no array instructions, which keep their own entry)."""
    t = x[0] * x[0]
    for i in range(1, x.shape[0]):
        t = t + x[i] * x[i]
    return t if y is None else t * y[0]


def test_which_programs_take_arguments():
    def tier(p):
        assert not p._code.arrays
        p._code.tier_up()
        return p._code.args
    assert tier(tg.trace(squares, np.ones(64))) is not None
    assert tier(tg.trace(squares, np.ones(32), np.ones(32))) is not None
    # more elements: NumPy's copy is as fast (one input of 100: the n=100 Rosenbrock)
    assert tier(tg.trace(squares, np.ones(65))) is None
    assert tier(tg.trace(squares, np.ones(40), np.ones(30))) is None
    assert tier(tg.trace(lambda x: x[0, 0] * x[1, 1], np.ones((2, 2)))) is None  # not 1-D
    assert tier(tg.trace(lambda x: x * x, np.array(2.0))) is None  # 0-d
    four = tg.trace(lambda a, b, c, d: a[0] * b[0] * c[0] * d[1], *[np.ones(2)] * 4)
    assert tier(four) is None
    v, g = four.value_and_grad(*[np.full(2, 2.0)] * 4)
    assert v == 16.0 and [list(x) for x in g] == [[8.0, 0.0]] * 3 + [[0.0, 8.0]]


def test_the_entry_compiles_at_its_first_call_not_at_the_tier_up():
    x = np.arange(4.0)
    bound = tg.trace(squares, np.ones(4))
    g = np.empty(4)
    step = bound.buffer(x, grad=g)  # tiers up: a bound call never runs the entry
    step()
    assert bound._code.args[0] is None and list(g) == [0.0, 2.0, 4.0, 6.0]
    v, grad = bound.value_and_grad(x)  # its first call
    assert bound._code.args[0] is not None and v == 14.0 and list(grad) == list(g)


def test_one_input_and_two_inputs_match_torch():
    one = tg.trace(lambda x: (x.sin() * x).sum(), np.ones(5))
    two = tg.trace(lambda x, y: (x * y.exp()).sum(), np.ones(3), np.ones(3))
    for p in (one, two):
        p._code.tier_up()
        assert p._code.args is not None
    x, y = np.linspace(-1.0, 1.0, 5), np.linspace(0.5, 1.5, 3)
    v, g = one.value_and_grad(x)
    want, (wg,) = torch_vg(lambda t: (t.sin() * t).sum(), [x])
    np.testing.assert_allclose(v, want, rtol=1e-14)
    np.testing.assert_allclose(g, wg, rtol=1e-14)
    v, (gx, gy) = two.value_and_grad(x[:3], y)
    want, (wx, wy) = torch_vg(lambda s, t: (s * t.exp()).sum(), [x[:3], y])
    np.testing.assert_allclose(v, want, rtol=1e-14)
    np.testing.assert_allclose(gx, wx, rtol=1e-14)
    np.testing.assert_allclose(gy, wy, rtol=1e-14)
    assert two(x[:3], y) == v


def test_guards_and_variants_on_the_entry_of_arguments():
    def f(x, y):
        return (x * y).sum() if x[0] > 0 else (x - y).sum()
    prog = tg.trace(f, np.ones(2), np.ones(2), retrace=True)
    prog._code.tier_up()
    assert prog._code.args is not None
    x, y = np.array([-1.0, 2.0]), np.array([3.0, 4.0])
    v, (gx, gy) = prog.value_and_grad(x, y)  # a new variant: the inputs were in the buffer
    assert len(prog._variants) == 2 and v == -1.0 - 3.0 + 2.0 - 4.0
    np.testing.assert_array_equal(gx, [1.0, 1.0])
    np.testing.assert_array_equal(gy, [-1.0, -1.0])
    v, (gx, gy) = prog.value_and_grad(x, y)  # now through the variants of the fast path
    assert v == -1.0 - 3.0 + 2.0 - 4.0
    np.testing.assert_array_equal(gx, [1.0, 1.0])
    assert prog(-x, y) == 1.0 * 3.0 - 2.0 * 4.0  # the first variant again
    strict = tg.trace(f, np.ones(2), np.ones(2))
    strict._code.tier_up()
    with pytest.raises(tg.GuardError, match="retrace=True"):
        strict.value_and_grad(x, y)
    assert len(strict._code._free) == 1  # the buffer came back after the failed guard


def test_threads_get_their_own_results(prog, plain):
    inputs = [three(20 + i) for i in range(4)]
    want = [plain.value_and_grad(*xs) for xs in inputs]
    errors = []

    def loop(i):
        try:
            for _ in range(300):
                v, g = prog.value_and_grad(*inputs[i])
                assert v == want[i][0]
                for a, b in zip(g, want[i][1]):
                    assert (a == b).all()
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_pickles_without_the_entry(prog, plain):
    again = pickle.loads(pickle.dumps(prog))
    assert again._code.args is None and again._code._free == []
    xs = three(30)
    assert again.value_and_grad(*xs)[0] == plain.value_and_grad(*xs)[0]
    again._code.tier_up()
    assert again._code.args is not None
    assert again(*xs) == plain(*xs)


@pytest.mark.parametrize("n", [1, 2])
def test_one_or_two_inputs_refuse_what_the_copy_refuses(n):
    progs = []
    for args in (True, False):
        p = tg.trace(squares, *[np.ones(3)] * n)
        p._code.tier_up()
        assert p._code.args is not None
        if not args:
            no_args(p)
        progs.append(p)
    x = np.array([1.0, 2.0, 3.0])
    wrong = [(x.astype(np.float32), TypeError, "input 0 has dtype float32"),
             (np.arange(3), TypeError, "input 0 has dtype int64"),
             (np.ones(4), ValueError, r"input 0 has shape \[4\]"),
             (np.array(1.0), ValueError, r"input 0 has shape \[\]"),
             (x[:, None], ValueError, r"input 0 has shape \[3, 1\]")]
    for p in progs:
        for bad, err, msg in wrong:
            with pytest.raises(err, match=msg):
                p.value_and_grad(bad, *[x] * (n - 1))
            with pytest.raises(err, match=msg):
                p(bad, *[x] * (n - 1))
        if n == 2:
            with pytest.raises(TypeError, match="input 1 has dtype int64"):
                p.value_and_grad(x, np.arange(3))
        assert len(p._code._free) == 1
    want = 14.0  # (y[0] = 1)
    for p in progs:
        v, g = p.value_and_grad(*[x] * n)
        assert v == want
        assert p(list(x), *[x] * (n - 1)) == want  # a list: the general path
        v, g = p.value_and_grad(x[::-1].copy()[::-1], *[x] * (n - 1))  # a negative stride
        assert v == want
    assert progs[0].value_and_grad(*[x] * n)[0] == progs[1].value_and_grad(*[x] * n)[0]


def test_a_code_keeps_its_attributes_in_the_instance():
    """Python 3.11 keeps up to 29 attributes in an instance's own values; a 30th makes every
    attribute read of the code, 10 to 15 of them a call, slower (10 reads: 95 ns, 109 with
    30): the one-sample call's constants and entry of arguments share one (``_one_consts``)."""
    p = tg.trace(squares, np.ones(3))
    p.value_and_grad(np.ones(3))
    p._code.tier_up()
    p.value_and_grad(np.ones(3))
    assert len(p._code.__dict__) <= 29, sorted(p._code.__dict__)


def test_a_code_pickled_before_its_constants_works_them_out():
    p = tg.trace(squares, np.ones(3), np.ones(3))
    del p._code.__dict__["_one_consts"]  # (as a program pickled before them)
    x = np.array([1.0, 2.0, 3.0])
    assert p.value_and_grad(x, x)[0] == 14.0 and p._code._one_consts is not None
    del p._code.__dict__["_one_consts"]
    p._code.tier_up()
    assert p._code.args is not None
    v, (gx, gy) = p.value_and_grad(x, x)
    assert v == 14.0 and list(gx) == [2.0, 4.0, 6.0] and list(gy) == [14.0, 0.0, 0.0]
    del p._code.__dict__["_one_consts"]
    h = p.hvp((x, x), (x, x))  # (hvp's one-sample call reads them too)
    assert np.isfinite(h[1][0]).all()
