"""The tape as data: entry rows, the readable dump, the generated interpreter, the marked
sweep, and rollover onto new tapes."""
import importlib
import re

import numpy as np
import pytest

import tapegrad as tg
import tapegrad.tape as tape_mod
from tapegrad.interpreters import _codegen, cpu, cpu_arrays
from tapegrad.ops import ARRAY, BY_NAME, ROW

# ``tapegrad.tensor`` is the factory function; the module is reached by name
tensor_mod = importlib.import_module("tapegrad.tensor")


from conftest import set_rollover  # noqa: E402


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def current():
    t = tape_mod.STATE.tape
    return t() if callable(t) else t


@pytest.fixture
def fresh_tape():
    """Start recording on a new tape, so slot numbers start at 0."""
    t = current()
    if t is not None:
        tape_mod.end_tape(t)
    yield
    t = current()
    if t is not None:
        tape_mod.end_tape(t)


def code(name, array=False):
    return BY_NAME[name].code | (ARRAY if array else 0)


def small_program():
    x = tg.tensor(2.0, requires_grad=True)
    y = tg.tensor(3.0, requires_grad=True)
    a = x * y
    b = a + 1.5
    c = tg.sin(b)
    d = c * 2.0
    e = 3.0 - d
    f = d / x
    g = f ** 2.0
    return dict(x=x, y=y, a=a, b=b, c=c, d=d, e=e, f=f, g=g)


# --- entries --------------------------------------------------------------------------------


def test_entries_of_a_small_scalar_program(fresh_tape):
    p = small_program()
    tape = p["g"]._tape
    assert all(p[k]._tape is tape for k in "abcdefg")
    assert p["x"]._tape is None and p["x"].is_leaf
    expected = [
        # opcode,              a,  b,  c0,  c1
        (code("leaf"),        -1, -1, 0.0, 0.0),
        (code("leaf"),        -1, -1, 0.0, 0.0),
        (code("mul"),          0,  1, 0.0, 0.0),
        (code("addc"),         2, -1, 1.5, 0.0),
        (code("sin"),          3, -1, 0.0, 0.0),
        (code("mulc"),         4, -1, 2.0, 0.0),
        (code("rsubc"),        5, -1, 3.0, 0.0),
        (code("div"),          5,  0, 0.0, 0.0),
        (code("powc"),         7, -1, 2.0, 0.0),
    ]
    assert len(tape) == len(expected)
    rows = tape.rows()
    assert rows.shape == (len(expected), ROW)
    assert rows.dtype == np.float64
    np.testing.assert_array_equal(rows, np.array(expected, dtype=np.float64))
    # the flat list behind the rows holds the same numbers, with slots relative to the entry
    np.testing.assert_array_equal(np.array([tape.entry(k) for k in range(len(tape))]), rows)
    flat = np.array(tape.code, dtype=np.float64).reshape(-1, ROW)
    for col in (1, 2):
        np.testing.assert_array_equal(
            np.where(flat[:, col] > 0, np.arange(len(tape)) - flat[:, col], -1), rows[:, col])
    # each tensor knows its entry, and the entry holds its value
    for name, slot in zip("abcdefg", range(2, 9)):
        assert p[name]._slot == slot
        assert tape.vals[slot] == p[name].item()
    assert tape.vals[0] == 2.0 and tape.vals[1] == 3.0


def test_entries_of_a_small_array_program(fresh_tape):
    v = tg.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    s = tg.tensor(0.5, requires_grad=True)
    e = v.exp()
    m = e * s
    r = m.sum(1)
    st = tg.stack([r, r * s])
    tape = st._tape
    rows = tape.rows()
    ops = [int(o) for o in rows[:, 0]]
    assert ops == [code("leaf", True), code("exp", True), code("leaf"), code("mul", True),
                   code("sum", True), code("mul", True), code("stack", True)]
    # the array entries keep their values in ``arrays``; their ``aux`` is the rest
    np.testing.assert_array_equal(tape.arrays[1], np.exp(v.detach().numpy()))
    assert tape.aux[4][0] == (1,) and tape.aux[4][1] is False
    assert list(tape.aux[6][0]) == [4, 5]        # stack lists its input slots
    assert int(rows[6, 1]) == -1 and int(rows[6, 2]) == -1
    assert (int(rows[3, 1]), int(rows[3, 2])) == (1, 2)
    assert np.isnan(tape.vals[1])                # arrays are not in ``vals``


def test_rows_follow_a_growing_tape(fresh_tape):
    x = tg.tensor(0.5, requires_grad=True)
    y = tg.exp(x)
    tape = y._tape
    first = tape.rows().copy()
    z = y * x + 1.0
    assert z._tape is tape
    rows = tape.rows()
    assert rows.shape == (len(tape), ROW)
    np.testing.assert_array_equal(rows[:len(first)], first)
    np.testing.assert_array_equal(rows, np.array([tape.entry(k) for k in range(len(tape))]))
    assert tape.rows() is rows or np.array_equal(tape.rows(), rows)


def test_rows_are_reused_for_a_program_recorded_again(fresh_tape):
    """An optimization loop records the same program every step: the second tape's rows are
    the first's matrix, found by comparing the code lists, and still equal a fresh packing."""
    x = tg.tensor(0.5, requires_grad=True)
    ys = []
    for _ in range(2):
        ys.append((100 * tg.exp(x) * 3.0 + x) ** 2 - 1)  # int constants too
        tape_mod.end_tape(ys[-1]._tape)
    t1, t2 = ys[0]._tape, ys[1]._tape
    assert t1 is not t2 and t1.code == t2.code
    assert all(a is b for a, b in zip(t1.code, t2.code))  # compared by identity
    assert t2.rows() is t1.rows()
    np.testing.assert_array_equal(t2.rows(), tape_mod.code_rows(t2.code, 0, len(t2)))


@pytest.mark.parametrize("first, second", [(0.0, -0.0), (-0.0, 0.0)])
def test_rows_are_not_reused_across_a_zero_constant_of_the_other_sign(fresh_tape, first,
                                                                      second):
    """0.0 == -0.0, so equal code lists may still differ in the sign of a constant that a
    rule reads: x / c has gradient 1/c, +inf or -inf."""
    x = tg.tensor(0.5, requires_grad=True)
    grads = []
    for c in (first, second, second, first):
        y = x / c
        assert y._tape.code[-2] == 0.0
        (g,) = tg.autograd.grad(y, x)
        grads.append(g.item())
    assert grads == [np.copysign(np.inf, c) for c in (first, second, second, first)]


def test_leaf_entered_once_per_tape(fresh_tape):
    x = tg.tensor(1.5, requires_grad=True)
    y = x * x + x
    z = tg.sin(x) * y
    tape = z._tape
    leaf_rows = [k for k in range(len(tape)) if int(tape.code[k * ROW]) == code("leaf")]
    assert leaf_rows == [0]


def test_constants_are_entered_as_const(fresh_tape):
    x = tg.tensor([1.0, 2.0], requires_grad=True)
    w = tg.tensor([3.0, 4.0])
    y = x * w
    ops = [int(o) for o in y._tape.rows()[:, 0]]
    assert ops == [code("leaf", True), code("const", True), code("mul", True)]


def test_no_entries_under_no_grad(fresh_tape):
    x = tg.tensor(1.5, requires_grad=True)
    _keep = x * 2.0
    n = len(_keep._tape)
    with tg.no_grad():
        y = tg.sin(x) * x
    assert y._tape is None and not y.requires_grad
    assert len(_keep._tape) == n


def test_no_entries_for_values_that_do_not_require_grad(fresh_tape):
    x = tg.tensor(1.5, requires_grad=True)
    _keep = x * 2.0
    n = len(_keep._tape)
    c = tg.tensor([1.0, 2.0])
    y = (c * 2.0).exp().sum() + tg.tensor(3.0) * 4.0
    assert y._tape is None
    assert len(_keep._tape) == n


# --- dump --------------------------------------------------------------------------------

GOLDEN = """\
<Tape #N: 19 entries>
%0    = S leaf()  []
%1    = S leaf()  []
%2    = S mul(%0, %1)  []
%3    = S addc(%2, c0=1.5, c1=0.0)  []
%4    = S sin(%3)  []
%5    = S mulc(%4, c0=2.0, c1=0.0)  []
%6    = S rsubc(%5, c0=3.0, c1=0.0)  []
%7    = S div(%5, %0)  []
%8    = S powc(%7, c0=2.0, c1=0.0)  []
%9    = A leaf()  [2, 3]
%10   = A exp(%9)  [2, 3]
%11   = A mul(%10, %8)  [2, 3]
%12   = A sum(%11, aux=((1), False))  [2]
%13   = A mul(%12, %1)  [2]
%14   = A stack(aux=([12, 13], 0))  [2, 2]
%15   = A const(aux=(tensor([ 0.5000, -1.0000]), 0))  [2]
%16   = A matmul(%14, %15)  [2]
%17   = A getitem(%16, aux=(0, (2), True))  []
%18   = S add(%17, %6)  []"""


def golden_program():
    p = small_program()
    v = tg.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    s = (v.exp() * p["g"]).sum(1)
    st = tg.stack([s, s * p["y"]])
    m = st @ tg.tensor([0.5, -1.0])
    return m[0] + p["e"], p


def test_golden_dump(fresh_tape):
    t, _ = golden_program()
    text = t._tape.dump()
    assert re.sub(r"^<Tape #\d+:", "<Tape #N:", text) == GOLDEN


def test_dump_header_names_the_tape(fresh_tape):
    t, _ = golden_program()
    first = t._tape.dump().splitlines()[0]
    assert first == f"<Tape #{t._tape.sid}: 19 entries>" == repr(t._tape)


def test_dump_limit(fresh_tape):
    t, _ = golden_program()
    lines = t._tape.dump(limit=3).splitlines()
    assert lines == re.sub(r"^<Tape #N:", f"<Tape #{t._tape.sid}:",
                           GOLDEN).splitlines()[:4]


def test_dump_is_one_readable_line_per_entry(fresh_tape):
    t, _ = golden_program()
    tape = t._tape
    lines = tape.dump().splitlines()[1:]
    assert len(lines) == len(tape)
    for k, line in enumerate(lines):
        assert line.startswith(f"%{k} ")
        name = line.split("=", 1)[1].split()[1].split("(")[0]
        assert name in BY_NAME


def test_dump_after_rerunning_the_same_program_is_identical(fresh_tape):
    t1, _ = golden_program()
    d1 = re.sub(r"#\d+", "#N", t1._tape.dump())
    tape_mod.end_tape(t1._tape)
    t2, _ = golden_program()
    assert t2._tape is not t1._tape
    assert re.sub(r"#\d+", "#N", t2._tape.dump()) == d1


def test_grad_fn_names_the_entry(fresh_tape):
    p = small_program()
    assert "MulBackward0" in repr(p["a"].grad_fn)
    assert "SinBackward0" in repr(p["c"].grad_fn)
    assert p["x"].grad_fn is None


# --- generated interpreter ----------------------------------------------------------------


def test_generated_interpreter_is_not_stale():
    committed = _codegen.TARGET.read_text()
    assert _codegen.generate() == committed, (
        "tapegrad/interpreters/_generated_cpu.py is stale: run "
        "python -m tapegrad.interpreters._codegen")


def test_generated_interpreter_covers_every_scalar_op():
    text = _codegen.generate()
    for op in BY_NAME.values():
        if op.scalar:
            assert f"op == {op.code}:  # {op.name}" in text
        elif op.name not in ("getitem", "sum", "mean"):  # the flat sweep writes these out
            assert f"# {op.name}\n" not in text


# --- the sweep visits only the entries between outputs and inputs ---------------------------


def _spy_mark(monkeypatch):
    calls = []
    real = cpu.mark

    def spy(*args):
        need, reach, arr = real(*args)
        calls.append((need.copy(), reach.copy()))
        return need, reach, arr
    monkeypatch.setattr(cpu, "mark", spy)
    return calls


def _spy_array_vjp(monkeypatch):
    visited = []
    real = cpu.array_vjp

    def spy(graph, k, *args, **kwargs):
        visited.append(k)
        return real(graph, k, *args, **kwargs)
    # the sweep looks it up in cpu_arrays, the hooks through cpu
    monkeypatch.setattr(cpu, "array_vjp", spy)
    monkeypatch.setattr(cpu_arrays, "array_vjp", spy)
    return visited


def test_mark_through_grad_on_a_scalar_program_with_unrelated_branches(fresh_tape, monkeypatch):
    calls = _spy_mark(monkeypatch)
    x = tg.tensor(0.3, requires_grad=True)   # %0
    u = tg.tensor(0.7, requires_grad=True)
    a = tg.exp(x)                            # %1 needed
    b = tg.sin(u)                            # %2 leaf u, %3: reaches y, but not from x
    c = tg.cos(x)                            # %4 depends on x, does not reach y
    d = a * b                                # %5 needed
    y = d + 1.0                              # %6 needed
    _ = c
    assert [p._slot for p in (a, b, c, d, y)] == [1, 3, 4, 5, 6]
    # the general path (allow_unused=False takes it: the one-call path wants defaults)
    (gx,) = tg.autograd.grad(y, x, retain_graph=True, allow_unused=False)
    need, reach = calls[-1]
    assert sorted(np.nonzero(need)[0].tolist()) == [1, 5, 6]
    assert reach[0] and not reach[2] and not reach[4]
    np.testing.assert_allclose(gx.item(), np.exp(0.3) * np.sin(0.7), rtol=1e-14)
    # the one-call scalar path marks the same entries, and frees exactly those
    n_calls = len(calls)
    (gx2,) = tg.autograd.grad(y, x)
    assert len(calls) == n_calls  # it did not go through mark()
    assert gx2.item() == gx.item()
    assert sorted(np.nonzero(y._tape.freed)[0].tolist()) == [1, 5, 6]


def test_array_sweep_visits_only_needed_entries(fresh_tape, monkeypatch):
    from tapegrad.autograd import _fast_paths
    monkeypatch.setattr(_fast_paths.FLAT, "applies", lambda *a: None)  # the general array sweep
    calls = _spy_mark(monkeypatch)
    visited = _spy_array_vjp(monkeypatch)
    x = tg.tensor([0.1, 0.2, 0.3], requires_grad=True)   # %0
    u = tg.tensor([1.0, 2.0, 3.0], requires_grad=True)   # entered at %2
    a = x.exp()                                          # %1 needed
    b = u.sin()                                          # %3 not: no path from x
    c = (x * 2.0).sum()                                  # %4, %5: no path to y
    y = (a * b).sum()                                    # %6, %7 needed
    _ = c
    assert [t._slot for t in (a, b, c, y)] == [1, 3, 5, 7]
    (gx,) = tg.autograd.grad(y, x)
    need, _reach = calls[-1]
    assert sorted(np.nonzero(need)[0].tolist()) == [1, 6, 7]
    assert sorted(visited) == [1, 6, 7]
    np.testing.assert_allclose(gx.numpy(), np.exp([0.1, 0.2, 0.3]) * np.sin([1.0, 2.0, 3.0]),
                               rtol=1e-14)


def test_sweep_skips_an_unrelated_branch_with_nan_adjoints(fresh_tape):
    x = tg.tensor(0.5, requires_grad=True)
    z = tg.tensor(0.0, requires_grad=True)
    bad = tg.log(z) * tg.sqrt(z)   # inf/nan derivative rules, not between y and x
    y = tg.exp(x) + bad * 0.0
    (gx,) = tg.autograd.grad(y, x)
    assert gx.item() == pytest.approx(np.exp(0.5), rel=1e-14)


def test_mark_directly_on_a_tape(fresh_tape):
    x = tg.tensor(0.3, requires_grad=True)   # %0
    h = x * 2.0                              # %1
    p = tg.sin(h)                            # %2
    q = tg.cos(h)                            # %3
    y = p * p                                # %4
    graph = cpu.Graph([y._tape])
    n = graph.n
    assert n == 5
    # input h, output y: only %2 and %4 lie between them
    is_input = np.zeros(n, dtype=np.bool_)
    is_output = np.zeros(n, dtype=np.bool_)
    is_input[h._slot] = True
    is_output[y._slot] = True
    need, reach, _ = cpu.mark(graph.rows, *graph.nx, is_input, is_output)
    assert np.nonzero(need)[0].tolist() == [2, 4]
    assert reach[1] and reach[2] and not reach[3] and not reach[0]
    # input x, output q: %1 and %3
    is_input[:] = False
    is_output[:] = False
    is_input[0] = True
    is_output[q._slot] = True
    need, reach, _ = cpu.mark(graph.rows, *graph.nx, is_input, is_output)
    assert np.nonzero(need)[0].tolist() == [1, 3]
    assert reach[0]
    # an input that the output does not depend on is not reached
    is_output[:] = False
    is_output[p._slot] = True
    is_input[:] = False
    is_input[q._slot] = True
    need, reach, _ = cpu.mark(graph.rows, *graph.nx, is_input, is_output)
    assert not need.any() and not reach[q._slot]


def test_mark_follows_nary_inputs(fresh_tape):
    x = tg.tensor([0.1, 0.2], requires_grad=True)   # %0
    u = tg.tensor([1.0, 2.0], requires_grad=True)   # entered at %2
    a = x * 3.0                                     # %1
    b = u * 3.0                                     # %3
    s = tg.stack([b, a])                            # %4 (n-ary)
    y = s.sum()                                     # %5
    assert [t._slot for t in (a, b, s, y)] == [1, 3, 4, 5]
    graph = cpu.Graph([y._tape])
    is_input = np.zeros(graph.n, dtype=np.bool_)
    is_output = np.zeros(graph.n, dtype=np.bool_)
    is_input[0] = True
    is_output[y._slot] = True
    need, reach, _ = cpu.mark(graph.rows, *graph.nx, is_input, is_output)
    assert np.nonzero(need)[0].tolist() == [a._slot, s._slot, y._slot]
    assert reach[0] and reach[a._slot] and not reach[2]


def test_free_after_backward_marks_only_swept_entries(fresh_tape):
    x = tg.tensor([0.1, 0.2], requires_grad=True)
    u = tg.tensor([1.0, 2.0], requires_grad=True)
    a = x.exp().sum()
    b = u.exp().sum()
    a.backward()
    b.backward()          # its entries were not freed by the first backward
    np.testing.assert_allclose(u.grad.numpy(), np.exp([1.0, 2.0]), rtol=1e-14)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        a.backward()


# --- rollover -------------------------------------------------------------------------------

SMALL = 8


@pytest.fixture
def small_tapes(monkeypatch, fresh_tape):
    set_rollover(monkeypatch, SMALL)


def _scalar_chain(M, x, w, n):
    h = x
    hist = []
    for i in range(n):
        h = M.sin(h) * w + x * 0.1
        if i % 7 == 3:
            hist.append(h)
        if i % 11 == 10:
            h = h + hist[0] * 0.01   # an import from a tape several back
    return h


def _tapes_of(t):
    return cpu.order_tapes([t._tape])


def test_rollover_scalar_chain_matches_torch(torch, small_tapes):
    def run(M):
        x = M.tensor(0.4, dtype=M.float64, requires_grad=True)
        w = M.tensor(0.9, dtype=M.float64, requires_grad=True)
        y = _scalar_chain(M, x, w, 60)
        return y, M.autograd.grad(y, [x, w])
    yt, gt = run(tg)
    yp, gp = run(torch)
    tapes = _tapes_of(yt)
    assert len(tapes) >= 10
    assert all(len(t) <= SMALL + 3 for t in tapes)
    assert any(t.imports for t in tapes)
    assert "import_" in tapes[-1].dump()
    np.testing.assert_allclose(yt.item(), yp.item(), rtol=1e-13)
    for a, b in zip(gt, gp):
        np.testing.assert_allclose(a.item(), b.item(), rtol=1e-12)


def test_rollover_a_full_tape_takes_no_input_entries(torch, small_tapes):
    """An op whose new inputs would be entered onto a full tape enters them on the next one:
    with new leaves at every op, no tape grows past its limit, and the gradients hold."""
    def run(M):
        xs = [M.tensor(0.1 * i + 0.3, dtype=M.float64, requires_grad=True) for i in range(41)]
        y = xs[0] * 1.0
        for i in range(1, 41, 2):
            y = y + xs[i] * xs[i + 1]
        return y, xs, M.autograd.grad(y, xs)
    yt, xt, gt = run(tg)
    yp, _, gp = run(torch)
    tapes = _tapes_of(yt)
    assert len(tapes) >= 5
    assert all(len(t) <= SMALL for t in tapes)
    np.testing.assert_allclose(yt.item(), yp.item(), rtol=1e-13)
    np.testing.assert_allclose([g.item() for g in gt], [g.item() for g in gp], rtol=1e-13)


def test_rollover_array_chain_matches_torch(torch, small_tapes):
    rng = np.random.default_rng(3)
    xv, wv = rng.standard_normal(4), rng.standard_normal((4, 4)) * 0.5

    def run(M):
        x = M.tensor(xv, dtype=M.float64, requires_grad=True)
        w = M.tensor(wv, dtype=M.float64, requires_grad=True)
        s = M.tensor(0.3, dtype=M.float64, requires_grad=True)
        h = x
        first = None
        for i in range(25):
            h = M.tanh(w @ h) * s + x
            if i == 2:
                first = h
            if i % 6 == 5:
                h = M.stack([h, first * s]).sum(0) * 0.5
        y = (h * h).sum() + h[1] * s
        return y, M.autograd.grad(y, [x, w, s])
    yt, gt = run(tg)
    yp, gp = run(torch)
    assert len(_tapes_of(yt)) >= 10
    np.testing.assert_allclose(yt.item(), yp.item(), rtol=1e-13)
    for a, b in zip(gt, gp):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-11)


def test_rollover_backward_fills_grad_across_tapes(torch, small_tapes):
    def run(M):
        x = M.tensor([0.4, -0.2], dtype=M.float64, requires_grad=True)
        s = M.tensor(0.7, dtype=M.float64, requires_grad=True)
        h = x
        mid = None
        for i in range(20):
            h = M.sin(h) * s + 0.1
            if i == 5:
                mid = h
                mid.retain_grad()
        y = h.sum()
        y.backward(retain_graph=True)
        y.backward()
        return x.grad, s.grad, mid.grad
    for a, b in zip(run(tg), run(torch)):
        np.testing.assert_allclose(np.asarray(a.numpy()), b.numpy(), rtol=1e-12)


def test_rollover_second_backward_raises(small_tapes):
    x = tg.tensor(0.4, requires_grad=True)
    y = _scalar_chain(tg, x, tg.tensor(0.9), 30)
    y.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.backward()


def test_rollover_non_leaf_input_on_an_earlier_tape(torch, small_tapes):
    def run(M):
        x = M.tensor(0.4, dtype=M.float64, requires_grad=True)
        h = M.exp(x) * 1.0
        y = _scalar_chain(M, h, M.tensor(0.8, dtype=M.float64), 40)
        return M.autograd.grad(y, [h, x])
    for a, b in zip(run(tg), run(torch)):
        np.testing.assert_allclose(a.item(), b.item(), rtol=1e-12)


def test_rollover_array_only_chain_matches_torch(torch, small_tapes):
    rng = np.random.default_rng(4)
    xv, wv = rng.standard_normal(3), rng.standard_normal((3, 3)) * 0.5

    def run(M):
        x = M.tensor(xv, dtype=M.float64, requires_grad=True)
        w = M.tensor(wv, dtype=M.float64, requires_grad=True)
        h = x
        first = None
        for i in range(25):
            h = M.tanh(w @ h) + x
            if i == 2:
                first = h
            if i % 6 == 5:
                h = M.stack([h, first]).mean(0)
        y = (h * h).sum()
        return y, M.autograd.grad(y, [x, w])
    yt, gt = run(tg)
    yp, gp = run(torch)
    assert len(_tapes_of(yt)) >= 10
    np.testing.assert_allclose(yt.item(), yp.item(), rtol=1e-13)
    for a, b in zip(gt, gp):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-11)


def test_generated_eager_fast_paths_are_not_stale():
    # run `python -m tapegrad.interpreters._codegen` after changing an op
    committed = _codegen.EAGER_TARGET.read_text()
    assert _codegen.generate_eager() == committed, "tapegrad/_generated_eager.py is stale"
