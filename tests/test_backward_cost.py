"""The fixed cost of one eager backward (issue 18): the work each backward does once
(rows, marks, seeds, release) is done once and keeps every check it guards."""
import numpy as np
import pytest

import tapegrad as tg
import tapegrad.tape as tape_mod
from tapegrad.interpreters import cpu


def _big_graph():
    """A general-path graph whose saved arrays are released by a backward (above
    ``_RELEASE_BYTES``), and its leaf."""
    x = tg.tensor(np.linspace(0.1, 1.0, 600), requires_grad=True)
    y = (tg.exp(x) * x).sum()
    return x, y


def test_release_reuses_the_converted_rows_and_drops_them(monkeypatch):
    """free_entries hands the sweep's rows to the release (not converted again) and the
    tape keeps no converted rows afterwards."""
    x, y = _big_graph()
    tape = y._tape
    calls = []
    real = cpu._release
    monkeypatch.setattr(cpu, "_release",
                        lambda t, f, rows=None, fl=None: calls.append(rows) or real(t, f, rows, fl))
    (g,) = tg.autograd.grad(y, x)
    np.testing.assert_allclose(g.numpy(), np.exp(x.detach().numpy()) * (1 + x.detach().numpy()))
    assert calls and calls[0] is not None
    assert tape._cache is None and tape._vcache is None
    # the saved arrays are gone: a second backward raises torch's error
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        tg.autograd.grad(y, x)


def test_release_without_rows_converts_and_drops_them():
    x, y = _big_graph()
    tape = y._tape
    need = np.ones(len(tape.vals), dtype=np.bool_)
    tape.freed = need.copy()
    cpu._release(tape, tape.freed)
    assert tape._cache is None
    tape_mod.end_tape(tape)


def _array_graph():
    x = tg.tensor(np.linspace(0.1, 1.0, 12).reshape(3, 4), requires_grad=True)
    return x, (tg.exp(x) * x).sum()


def test_array_sweep_converts_no_scalar_values():
    """A sweep of array entries only never reads the scalar values: the graph converts
    them on first use, so such a backward does not convert them at all."""
    x, y = _array_graph()
    tape = y._tape
    with tg.autograd.paths.force("sweep"):
        (g,) = tg.autograd.grad(y, x, retain_graph=True)
    xd = x.detach().numpy()
    np.testing.assert_allclose(g.numpy(), np.exp(xd) * (1 + xd))
    assert tape._vcache is None


def test_graph_values_are_the_first_n_of_a_grown_tape():
    x, y = _array_graph()
    tape = y._tape
    z = y * 2.0 + 1.0  # scalar entries: the compiled sweep reads the values
    graph = cpu.Graph([tape])
    n = graph.n
    w = z * 3.0  # the tape grows after the graph was built (as create_graph records)
    assert len(tape.vals) > n
    assert len(graph.vals) == n
    np.testing.assert_array_equal(graph.vals, tape.values()[:n])
    with tg.autograd.paths.force("sweep"):
        (g,) = tg.autograd.grad(w, x)
    xd = x.detach().numpy()
    np.testing.assert_allclose(g.numpy(), 6.0 * np.exp(xd) * (1 + xd))


_SPECIALS = (0.0, -0.0, np.inf, -np.inf, np.nan, 1e308, -1e308, 5e-324)


def _bits(shape, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=shape) * 10
    m = rng.random(shape) < 0.05
    a[m] = rng.choice(_SPECIALS, size=int(m.sum()))
    return a


def _same_bits(r, s):
    return (r.shape == s.shape and r.dtype == s.dtype and np.array_equal(r, s, equal_nan=True)
            and np.array_equal(np.signbit(r)[~np.isnan(r)], np.signbit(s)[~np.isnan(s)]))


@pytest.mark.parametrize("have, want", [((10, 8, 16), (10, 8, 1)), ((10, 8, 1000), (10, 8, 1)),
                                        ((10, 8, 16), (8, 16)), ((10, 8, 16), (1, 8, 1)),
                                        ((30, 4), (4,)), ((30, 4), (30, 1)), ((6, 5, 7), (5, 1)),
                                        ((300, 3, 8), (300, 3, 1)), ((64, 1), (1,))])
def test_array_sweep_sum_to_is_sum_tos_bits(have, want):
    """The array sweep sums a broadcast gradient by np.sum's own add.reduce call: the bits
    of ``sum_to`` (fast_sum's short last axis, float32 and the rest left to it), also
    through ``neg_sum_to``."""
    from tapegrad.interpreters.cpu_arrays import neg_sum_to, sum_to_shape
    from tapegrad.ops.arrays import sum_to
    for seed in range(3):
        g = _bits(have, seed)
        with np.errstate(all="ignore"):
            assert _same_bits(sum_to_shape(g, want), sum_to(g, want))
            assert _same_bits(neg_sum_to(g, want), sum_to(-g, want))
            g32 = g.astype(np.float32)
            assert _same_bits(sum_to_shape(g32, want), sum_to(g32, want))
            gt = np.asfortranarray(g)  # another memory order: the same call, its own order
            assert _same_bits(sum_to_shape(gt, want), sum_to(gt, want))


def test_array_sweep_is_quiet_and_restores_numpys_error_state():
    """The array sweep silences NumPy's warnings through its context variable: no warning
    for an overflowing rule, and the caller's error state is back afterwards, also when a
    rule raises."""
    import warnings
    x = tg.tensor([1e200, 2.0, -1e300], requires_grad=True)
    before = np.geterr()
    with np.errstate(over="raise", invalid="raise"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = (x * x * tg.tensor([1e300, 1.0, 1e300])).sum()
            with tg.autograd.paths.force("sweep"):
                (g,) = tg.autograd.grad(y, x)
        assert np.geterr()["over"] == "raise"
        assert np.isinf(g.numpy()[0]) and g.numpy()[1] == 4.0
        x2, y2 = _array_graph()
        with tg.autograd.paths.force("sweep"):
            (g2,) = tg.autograd.grad(y2, x2, retain_graph=True)

        class Boom(Exception):
            pass

        def fail(*a, **k):
            raise Boom

        from tapegrad.interpreters import cpu_arrays
        real = cpu_arrays.array_vjp
        cpu_arrays.array_vjp = fail
        try:
            with pytest.raises(Boom):
                with tg.autograd.paths.force("sweep"):
                    tg.autograd.grad(y2, x2, retain_graph=True)
        finally:
            cpu_arrays.array_vjp = real
        assert np.geterr()["over"] == "raise" and np.geterr()["invalid"] == "raise"
    assert np.geterr() == before


@pytest.mark.parametrize("ga_shape, v_shape", [((10, 8, 1000), (10, 1, 1000)),
                                               ((10, 8, 1000), (10, 8, 1000)),
                                               ((10, 1, 1000), (10, 8, 1000)),
                                               ((300, 64), (300, 1)), ((40, 500), (500,))])
def test_array_sweep_mul_sides_by_rows_are_numpys_bits(monkeypatch, ga_shape, v_shape):
    """The array sweep's mul sides on a large gradient with a broadcast operand (kmeans'
    g * diff, g expanded) run the compiled rows pass: NumPy's bits, specials included;
    where it declines, NumPy's product."""
    from tapegrad.interpreters import cpu_arrays
    from tapegrad.ops import BY_NAME
    calls = []
    real = cpu_arrays.rows_op
    monkeypatch.setattr(cpu_arrays, "rows_op", lambda *a: calls.append(a) or real(*a))
    shape = np.broadcast_shapes(ga_shape, v_shape)
    g = np.broadcast_to(_bits(ga_shape, 1), shape)
    va = np.broadcast_to(_bits(v_shape, 2), shape)  # a constant factor, expanded
    vb = _bits(shape, 3)
    code = BY_NAME["mul"].code
    value = {0: va, 1: vb}.__getitem__
    with np.errstate(all="ignore"):
        for wanted in ([True, True], [False, True], [True, False]):
            ga, gb = cpu_arrays._one_sided(code, g, 0, 1, value, wanted)
            assert (ga is None) != wanted[0] and (gb is None) != wanted[1]
            if ga is not None:
                assert _same_bits(ga, g * vb)
            if gb is not None:
                assert _same_bits(gb, g * va)
    assert calls


def test_array_sweep_skips_runs_with_nothing_needed(monkeypatch):
    """On a short tape, a scalar run between array entries is swept only when it holds a
    needed entry: llsq's ``/ 2`` is, the constants and the leaf below are not. The
    gradients are torch's, also with needed scalar entries between array ones."""
    torch = pytest.importorskip("torch")
    from tapegrad.interpreters import cpu_arrays
    runs = []
    real = cpu_arrays._generated_cpu.sweep

    class Gen:
        def __getattr__(self, name):
            return getattr(cpu_arrays.__dict__["_real_gen"], name)

        @staticmethod
        def sweep(rows, vals, adj, need, hi, lo):
            runs.append((lo, hi))
            return real(rows, vals, adj, need, hi, lo)
    monkeypatch.setitem(cpu_arrays.__dict__, "_real_gen", cpu_arrays._generated_cpu)
    monkeypatch.setattr(cpu_arrays, "_generated_cpu", Gen())
    P0 = np.linspace(-1, 1, 40).reshape(10, 4)
    s0, x0 = np.sign(np.linspace(-1, 1, 10)), np.array([0.5, -1.0, 2.0, 0.25])
    res = []
    for M in (tg, torch):
        x = M.tensor(x0, requires_grad=True)
        r = M.tensor(s0) - M.matmul(M.tensor(P0), x)
        q = M.sum(r * r) / 2  # a scalar entry above the arrays
        w = (q * 3.0 + 1.0) * M.sum(M.exp(x * q))  # scalars between array entries
        if M is tg:
            with tg.autograd.paths.force("sweep"):
                (g,) = M.autograd.grad(w, x)
        else:
            (g,) = M.autograd.grad(w, x)
        res.append(g.numpy())
    np.testing.assert_allclose(res[0], res[1], rtol=1e-13)
    assert runs  # the scalar runs with a needed entry are swept
    assert all(lo > 0 for lo, hi in runs)  # the leaf and constants at the bottom: not swept


def _released_state(short, monkeypatch, make):
    monkeypatch.setattr(cpu, "_SHORT", short)
    monkeypatch.setattr(cpu, "_LAST_DROP", [None])  # (no answer kept from an earlier test)
    calls = []
    real = cpu._droppable
    monkeypatch.setattr(cpu, "_droppable", lambda *a: calls.append(1) or real(*a))
    tape, keep = make()
    ph = [k for k, v in tape.arrays.items() if cpu._PLACEHOLDERS.get((v.shape, v.dtype)) is v]
    consts = sorted(k for k, a in tape.aux.items() if isinstance(a, tuple) and len(a) == 2
                    and a[0] is None)
    return ph, consts, list(tape.versioned), bool(calls)


def _whole():
    x = tg.tensor(np.linspace(0.1, 1.0, 600), requires_grad=True)
    c = tg.tensor(np.linspace(1.0, 2.0, 600))
    y = (tg.exp(x) * c - c).sum() / 2
    (g,) = tg.autograd.grad(y, x)
    return y._tape, g


def _partial():
    x = tg.tensor(np.linspace(0.1, 1.0, 600), requires_grad=True)
    c = tg.tensor(np.linspace(1.0, 2.0, 600))
    e = tg.exp(x) * c
    z = (e * e).sum()  # not swept below: its entries stay live and keep what they read
    y = (e - c).sum()
    (g,) = tg.autograd.grad(y, x)
    return y._tape, (g, z)


@pytest.mark.parametrize("make", [_whole, _partial])
def test_release_of_a_wholly_freed_short_tape_is_droppables(monkeypatch, make):
    """A short tape whose entries are all freed or bookkeeping drops every saved array
    without the compiled ``_droppable`` (it would drop them all); a tape with live entries
    still asks it. The same arrays, constants and version checks go either way."""
    fast = _released_state(64, monkeypatch, make)
    slow = _released_state(0, monkeypatch, make)
    assert fast[:3] == slow[:3] and slow[3]
    assert fast[3] == (make is _partial)
    assert fast[0]


def test_expand_forward_is_broadcast_to():
    """expand's forward builds a C-contiguous array's zero-stride view directly (a sum's
    gradient broadcast back in the array sweep, half broadcast_to's cost): broadcast_to's
    shape, strides, values and read-only flag, and its error where shapes do not fit."""
    from tapegrad.ops import BY_NAME
    expand = BY_NAME["expand"].np
    rng = np.random.default_rng(0)
    for a, shape in [(rng.normal(size=(10, 1, 16)), (10, 8, 16)),
                     (rng.normal(size=(3,)), (4, 2, 3)), (rng.normal(size=(1, 1)), (5, 6)),
                     (rng.normal(size=(2, 3)), (2, 3)), (rng.normal(size=(4, 1)), (2, 4, 0)),
                     (rng.normal(size=(6, 4))[:, :2], (3, 6, 2)), (np.array(2.5), (2, 2)),
                     (2.5, (3, 2)), (-0.0, (4,)), (np.float64(1.5), (2, 1)), (1.5, ())]:
        got, want = expand(a, (shape,)), np.broadcast_to(a, shape)
        assert got.shape == want.shape and got.strides == want.strides
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))
        if np.ndim(a):
            assert not got.flags.writeable
    with pytest.raises(ValueError, match="could not be broadcast"):
        expand(np.ones((2, 3)), ((4, 3),))


def test_expand_forward_skips_broadcast_to(monkeypatch):
    """The C-contiguous case does not go through np.broadcast_to (the cost it cuts)."""
    from tapegrad.ops import BY_NAME
    a = np.arange(20.0).reshape(10, 1, 2)
    want = np.broadcast_to(a, (10, 8, 2)).copy()

    def boom(*args, **kwargs):
        raise AssertionError("np.broadcast_to called")
    monkeypatch.setattr(np, "broadcast_to", boom)
    np.testing.assert_array_equal(BY_NAME["expand"].np(a, ((10, 8, 2),)), want)


def test_create_graph_expand_is_broadcast_to():
    # the create_graph sweep's expand forward (``_tensor_backend._expand_np``) gives what
    # np.broadcast_to gives (values, shape; read-only for an array: a view of it) for
    # floats, 0-d and other arrays
    from tapegrad.autograd._tensor_backend import _expand_np
    cases = [(2.5, (3, 2)), (np.array(1.5), (4,)), (np.arange(3.0), (2, 3)),
             (np.arange(6.0).reshape(2, 3)[:, ::2], (4, 2, 2)), (np.ones((1, 3)), (5, 3))]
    for d, shape in cases:
        got, want = _expand_np(d, (shape, np.shape(d))), np.broadcast_to(d, shape)
        assert got.shape == want.shape and np.array_equal(got, want)
        assert isinstance(d, float) or not got.flags.writeable
    with pytest.raises(ValueError):
        _expand_np(np.arange(3.0), ((2, 4), (3,)))


@pytest.mark.parametrize("ma,mb", [((1024, 16), (16,)), ((16,), (16, 7)), ((3, 5), (5,)),
                                   ((1, 4), (4,)), ((6,), (6, 1))])
def test_matmul_matrix_vector_rule_is_the_reshaped_products_bits(ma, mb):
    """A matrix times a vector (llsq's P @ x): each gradient is the one matrix-vector
    product (no reshapes, no sum_to), with the bits of the general rule's reshaped 2-d
    products (the same gemv), on NumPy values and recorded; derivatives are torch's."""
    torch = pytest.importorskip("torch")
    from tapegrad.ops import NpF
    from tapegrad.ops.arrays import _matmul_general, _matmul_vjp
    rng = np.random.default_rng(sum(ma) + sum(mb))
    a, b = rng.normal(size=ma), rng.normal(size=mb)
    g = rng.normal(size=np.matmul(a, b).shape)
    fast = _matmul_vjp(NpF, g, [a, b], None, None)
    general = _matmul_general(NpF, g, a, b, a.ndim, b.ndim)
    vec = 1 if b.ndim == 1 else 0

    def boom(*args):
        raise AssertionError("the vector's gradient reshaped")
    for i, (f, w) in enumerate(zip(fast, general)):
        want = w()
        if i == vec:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(NpF, "reshape", boom)
                mp.setattr(NpF, "sum_to", boom)
                got = f()
        else:
            got = f()
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    res = []
    for M in (tg, torch):
        A, B = M.tensor(a, requires_grad=True), M.tensor(b, requires_grad=True)
        y = M.sin(M.matmul(A, B)).sum()
        gA, gB = M.autograd.grad(y, (A, B), create_graph=True)
        hA, hB = M.autograd.grad((gA * gA).sum() + (gB * gB).sum(), (A, B))
        res.append([t.detach().numpy() for t in (gA, gB, hA, hB)])
    for got, want in zip(*res):  # (hA sums 1024 products that cancel: 1e-11 apart)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


def test_release_stand_ins_by_shape_and_dtype(monkeypatch):
    """The release finds a float64 array's stand-in by its shape alone and others' by
    shape and dtype: each released array is a read-only zero-stride array of its own shape
    and dtype, a constant's tensor goes with its array (a leaf's stays, scalar constants
    are kept), the version list keeps the rest, and a second backward through entries that
    save nothing still reads the shapes (torch's gradient); the two lookups stay in step
    when the cache is emptied."""
    monkeypatch.setattr(cpu, "_PLACEHOLDERS", {})
    monkeypatch.setattr(cpu, "_PLACEHOLDERS_F64", {})
    for rounds in range(2):
        x = tg.tensor(np.linspace(0.1, 1.0, 600), requires_grad=True)
        c64 = tg.tensor(np.linspace(1.0, 2.0, 600))
        c32 = tg.tensor(np.linspace(1.0, 2.0, 600), dtype=tg.float32)
        s = tg.tensor(3.0)
        e = tg.exp(x) * c64 + c32 * s
        y = (e.reshape(20, 30).sum(0) + x.reshape(20, 30).sum(0)).sum()
        tape = y._tape
        (g,) = tg.autograd.grad(y, x)
        for k, v in tape.arrays.items():
            if k == x._slot:
                continue
            assert not v.flags.writeable and 0 in v.strides or v.size <= 1
            assert v is cpu._PLACEHOLDERS[(v.shape, v.dtype)]
            if v.dtype == np.float64:
                assert v is cpu._PLACEHOLDERS_F64[v.shape]
        consts = [k for k in tape.aux if tape.code[k * 5] & ~tg.ops.ARRAY == cpu.CONST_CODE]
        dropped = [k for k in consts if tape.aux[k][0] is None]
        assert sorted(dropped) == sorted(k for k in consts if k in tape.arrays)
        assert set(tape.versioned) == {k for k in consts if k not in dropped} | {x._slot}
        want = np.exp(np.linspace(0.1, 1.0, 600)) * np.linspace(1.0, 2.0, 600) + 1.0
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-15)
        cpu._PLACEHOLDERS.clear()  # (as _placeholder does past 256 entries)
        cpu._PLACEHOLDERS_F64.clear()
    x = tg.tensor(np.ones(6), requires_grad=True)
    y = x.reshape(2, 3).sum(0).sum()
    tg.autograd.grad(y, x)
    (g,) = tg.autograd.grad(y, x)  # nothing saved: a second backward reads shapes only
    np.testing.assert_array_equal(g.numpy(), np.ones(6))


def test_flat_path_declines_a_marking_it_declined_before(monkeypatch):
    """A call the flat path declined after marking (a matmul on the path: llsq's) is
    declined again without marking when its program, inputs and output are the same (the
    tape's rows are the same matrix); a program with the same input and output slots that
    the flat path takes is still taken, and every gradient is the direct one."""
    from tapegrad.autograd import paths
    calls = []
    real = cpu._mark_scalar
    monkeypatch.setattr(cpu, "_mark_scalar", lambda *a: calls.append(1) or real(*a))
    P = tg.tensor(np.linspace(-1.0, 1.0, 12).reshape(4, 3))
    c = tg.tensor(np.array([2.0, -0.5, 1.5]))

    def llsq(x):  # P (0), x (1), matmul, rsubc, mul, sum, divc (6)
        r = 1.0 - tg.matmul(P, x)
        return (r * r).sum() / 2

    def flat(x):  # c (0), x (1), mul, rsubc, mul, sum, divc (6): all the flat path's
        r = 1.0 - c * x
        return (r * r).sum() / 2
    x0 = np.array([0.5, -1.0, 2.0])
    Pn, cn = P.numpy(), c.numpy()
    for i in range(2):  # (the flat program then takes seen_rows' place for 7 entries)
        calls.clear()
        for j in range(3):
            x = tg.tensor(x0, requires_grad=True)
            y = llsq(x)
            assert (x._slot, y._slot) == (1, 6)
            (g,) = tg.autograd.grad(y, x)
            assert paths.last() == "sweep" and len(calls) == 1  # marked the first time
            np.testing.assert_allclose(g.numpy(), Pn.T @ (Pn @ x0 - 1.0), rtol=1e-15)
        x = tg.tensor(x0, requires_grad=True)
        y = flat(x)
        assert (x._slot, y._slot) == (1, 6)
        (g,) = tg.autograd.grad(y, x)
        assert paths.last() == "flat"
        np.testing.assert_allclose(g.numpy(), -(1.0 - cn * x0) * cn, rtol=1e-15)


def test_result_copy_is_the_general_conversions():
    """grad()'s copy of an adjoint the sweep does not own: for an array of the input's
    dtype and shape a plain copy (no dtype or Size object built), the general conversion's
    values, dtype, layout and writability; other cases converted as before."""
    from tapegrad.autograd._leaves import _as_tensor
    x64 = tg.tensor(np.ones((3, 4)), requires_grad=True)
    x32 = tg.tensor(np.ones((3, 4)), dtype=tg.float32, requires_grad=True)
    for x in (x64, x32):
        for r in (np.arange(12.0).reshape(3, 4), np.asfortranarray(np.arange(12.0).reshape(3, 4)),
                  np.broadcast_to(np.arange(4.0), (3, 4)), np.arange(12.0),
                  np.arange(12.0, dtype=np.float32).reshape(3, 4)):
            got = _as_tensor(r, x)._d
            want = np.array(r, dtype=x.dtype.np, copy=True).reshape(x.shape)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.strides == want.strides and got.flags.writeable
            np.testing.assert_array_equal(got, want)
            assert not np.shares_memory(got, r)
    rng = np.random.default_rng(0)
    P = tg.tensor(rng.normal(size=(5, 3)))
    x = tg.tensor(rng.normal(size=3), requires_grad=True)
    (g,) = tg.autograd.grad(tg.matmul(P, x).sum(), x)  # (gemv's fresh array, copied)
    np.testing.assert_array_equal(g.numpy(), P.numpy().T @ np.ones(5))


def test_general_path_shortcut_is_the_loops_choice():
    """The common call's general path (no create_graph, batch, hooks, anomaly mode or
    forced path) is found without the loop over the strategies: the loop's own answer, and
    each other case still takes its own strategy."""
    from tapegrad.autograd import _sweep
    for call in [(False, None), (True, None), (False, 3), (True, 3)]:
        for hooked in (False, True):
            got = _sweep._general_path(*call, hooked=hooked)
            want = next(p for p in _sweep._GENERAL if p.applies(call + (hooked,)))
            assert got is want
    assert _sweep._general_path(False, None) is _sweep.SWEEP
    x = tg.tensor(np.array([1.0, 0.0]), requires_grad=True)
    with pytest.warns(UserWarning, match="Anomaly Detection"), tg.autograd.detect_anomaly():
        assert _sweep._general_path(False, None) is _sweep.CHECKED
        with pytest.raises(RuntimeError, match="nan|NaN"):
            tg.autograd.grad(tg.sqrt(x * 0.0 - x).sum(), x)


def test_sweep_rows_from_the_code_list_are_the_matrix_rows():
    """A short one-tape sweep reads its array entries' rows from the code list
    (``_entry_row``): the opcode and slots as the matrix's, the constants the same floats
    (a -0.0's sign too), and the gradient is torch's."""
    torch = pytest.importorskip("torch")
    from tapegrad.interpreters.cpu_arrays import _entry_row
    x0 = np.linspace(-1.0, 2.0, 7)
    x = tg.tensor(x0, requires_grad=True)
    y = (((x ** 3) * -0.0 + x * 2.5) / 3 - 1.5).sum() / 2 + x.sum()
    tape = y._tape
    rows = tape.rows()
    for k in range(len(tape.vals)):
        got, want = _entry_row(tape.entry(k)), rows[k].tolist()
        assert [int(v) for v in got[:3]] == [int(v) for v in want[:3]]
        assert all(g.__class__ is float and np.copysign(1, g) == np.copysign(1, w) and g == w
                   for g, w in zip(got[3:], want[3:]))
    (g,) = tg.autograd.grad(y, x)
    xt = torch.tensor(x0, requires_grad=True)
    yt = (((xt ** 3) * -0.0 + xt * 2.5) / 3 - 1.5).sum() / 2 + xt.sum()
    (gt,) = torch.autograd.grad(yt, xt)
    assert g.numpy().tobytes() == gt.numpy().tobytes()


@pytest.mark.parametrize("n", [3, 48, 49, 200])
def test_short_values_conversion_is_f64s(n):
    """``Tape.values`` converts a short list by NumPy, a long one by ``f64``: the same
    float64 bits (NaN, -0.0, inf, subnormals), also when the tape grew since."""
    specials = [float("nan"), -0.0, float("inf"), 5e-324, -1.5, 1e308]
    t = tape_mod.Tape()
    t.vals.extend((specials * (n // len(specials) + 1))[:n])
    got = t.values()
    assert got.tobytes() == tape_mod.f64(t.vals).tobytes()
    t.vals.extend(specials)  # grown: the new part converted and appended
    assert t.values().tobytes() == tape_mod.f64(t.vals).tobytes()


def _fresh_mark(rows, nx, is_input, is_output):
    """The marking found again (nothing kept)."""
    n = rows.shape[0]
    need, reach = np.zeros(n, np.bool_), is_output.copy()
    arr = np.empty(n, np.int64)
    k = cpu._mark_into(rows, *nx, is_input, need, reach, arr)
    return need, reach, arr[:k]


def test_kept_markings_are_the_marking_and_not_shared(monkeypatch):
    """``mark`` keeps what it found per (rows, inputs, outputs): the same program's
    backward again marks without the compiled pass, a different input or output set is
    marked anew, and what a call gets is its own (writing to it changes no later call's)."""
    monkeypatch.setattr(cpu._MARKS, "d", {})
    calls = []
    real = cpu._mark_into
    monkeypatch.setattr(cpu, "_mark_into", lambda *a: calls.append(1) or real(*a))

    def program():
        x = tg.tensor(np.linspace(0.5, 1.5, 6), requires_grad=True)
        w = tg.tensor(np.linspace(-1.0, 1.0, 6), requires_grad=True)
        u = (x * 2.0).sum()
        return x, w, u * (x * w).sum() + tg.exp(w).sum()

    marked = []
    for _ in range(3):
        for which in ("x", "w", "xw"):
            x, w, y = program()
            graph = cpu.Graph([y._tape])
            is_input = np.zeros(graph.n, np.bool_)
            for t in {"x": (x,), "w": (w,), "xw": (x, w)}[which]:
                is_input[t._slot] = True
            is_output = np.zeros(graph.n, np.bool_)
            is_output[y._slot] = True
            before = len(calls)
            got = cpu.mark(graph.rows, *graph.nx, is_input, is_output)
            marked.append(len(calls) - before)
            want = _fresh_mark(graph.rows, graph.nx, is_input, is_output)
            for g, w_ in zip(got, want):
                assert g.dtype == w_.dtype and np.array_equal(g, w_)
            got[0][:] = True  # a caller's own arrays: no later call sees this
            got[1][:] = False
            ins = tuple(t for t in (x, w) if t._slot in np.flatnonzero(is_input))
            grads = tg.autograd.grad(y, ins)
            assert len(grads) == len(ins)
    # the rows are the same matrix every round (seen_rows): each input set marked once
    assert marked[3:] == [0] * 6


def test_a_kept_marking_gives_torchs_gradients_again():
    """The same program's gradient, call after call with kept markings, is torch's."""
    torch = pytest.importorskip("torch")
    x0 = np.linspace(-1.0, 1.0, 9)
    want = None
    for _ in range(4):
        x = tg.tensor(x0, requires_grad=True)
        y = ((x * x).sum() - tg.sin(x).sum()) / 2
        (g,) = tg.autograd.grad(y, x)
        if want is None:
            xt = torch.tensor(x0, requires_grad=True)
            (want,) = torch.autograd.grad(((xt * xt).sum() - torch.sin(xt).sum()) / 2, xt)
        assert g.numpy().tobytes() == want.numpy().tobytes()
