"""Reduction instructions (``array_red`` in tapegrad/interpreters/program_arrays.py): sums,
matmuls' sums of products and extremes of detached values summed in order into one slot
each, whose replay keeps no product nor partial sum; inputs as one leaf instruction; large
instructions' forward in NumPy. Each forced (runs of 4) against its expansion (the same
program as scalar rows), eager tapegrad and torch: values, gradients, hvp, batched,
derivative programs and a saved-and-loaded program."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import program_arrays as PA
from tapegrad.interpreters.program import Builder
from tapegrad.ops import OPS

from harness import replay_forms as RF

torch = pytest.importorskip("torch")

SCALAR = 1 << 62  # no run is that long: scalar rows only


def reductions(code):
    """[(step name, outputs, terms)] of a program's reduction instructions."""
    rows, out = code.arows, []
    for h in np.nonzero(rows[:, 0] == PA.RED)[0].tolist():
        out.append((OPS[int(rows[h + 1, 5])].name, int(rows[h + 1, 4]), int(rows[h, 4])))
    return out


W = np.random.default_rng(7).normal(size=(3, 5, 6))


def matmuls(M, x):
    """A batched matmul (each output a row of its left operand: stride 0), a matrix times a
    vector, a dot product and x^T x (both operands strided)."""
    X = x.reshape(3, 6, 4)
    Wt = M.tensor(W, dtype=M.float64)
    P = M.matmul(Wt, X)                                    # (3, 5, 4)
    v = M.matmul(x.reshape(8, 9), x[:9])                   # (8,)
    G = M.matmul(x.reshape(8, 9).T, x.reshape(8, 9))       # (9, 9)
    return M.sum(M.tanh(P)) + M.sum(v * v) * 0.1 + (x @ x) + M.sum(G) * 0.01


def sums(M, x):
    """Sums over every axis of a matrix, a long sum (blocks of RED_BLOCK and a rest), mean,
    and extremes: max, min, logsumexp and softmax (the max of detached values)."""
    A = x.reshape(8, 9)
    return (M.sum(M.sum(A, 0) ** 2) + M.sum(M.sum(A, 1) ** 2) + M.mean(A)
            + M.sum(M.exp(M.cat([x, x * 0.5, x * x]) * 0.1)) + M.amax(A) + M.amin(A, 1).sum()
            + M.logsumexp(A, 0).sum() + M.sum(M.softmax(A, 1) * A))


def torch_derivs(f, x, v):
    xt = torch.tensor(x, requires_grad=True)
    y = f(torch, xt)
    g, = torch.autograd.grad(y, xt, create_graph=True)
    hv, = torch.autograd.grad((g * torch.tensor(v)).sum(), xt)
    return y.item(), g.detach().numpy(), hv.numpy()


def assert_as_scalar_rows_and_torch(P, f, x0):
    """``P`` (f traced with instructions) gives the scalar rows' numbers to the bit, and
    torch's gradient."""
    with RF.array_instructions(SCALAR):
        S = tg.trace(lambda x: f(tg, x), x0)
    for a, b in zip(P.value_and_grad(x0), S.value_and_grad(x0)):
        np.testing.assert_array_equal(a, b)
    y, g, _ = torch_derivs(f, x0, x0)
    np.testing.assert_allclose(P.value_and_grad(x0)[1], g, rtol=1e-12, atol=1e-15)


def results(P, x, v):
    value, g = P.value_and_grad(x)
    return [value, g, P.hvp((x,), (v,))[1], P.grad_program()(x), P.hessian(x) @ v,
            P.grad(np.stack([x, 0.5 * x]))[1], P.jacobian(x)]


@pytest.mark.parametrize("f", [matmuls, sums], ids=["matmuls", "sums"])
def test_reductions_against_their_expansion_eager_and_torch(f):
    rng = np.random.default_rng(11)
    x0, x1, v = rng.normal(size=72), rng.normal(size=72), rng.normal(size=72)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: f(tg, x), x0)
    with RF.array_instructions(SCALAR):
        S = tg.trace(lambda x: f(tg, x), x0)
    red = reductions(P._code)
    assert red and not reductions(S._code) and not S._code.arrays
    steps = {s for s, _, _ in red}
    assert steps == ({"mul", "add"} if f is matmuls else {"add", "maximum", "minimum"}), red
    # the same slots: the expansion is the scalar rows' program, row for row in count
    assert P._code.nslots == S._code.nslots == P._code.rows.shape[0]
    # the instructions compute exactly what their expansion does (sums in the same order)
    for a, b in zip(P.value_and_grad(x1), S.value_and_grad(x1)):
        np.testing.assert_array_equal(a, b)
    E = PA.run_fresh(PA.expand(P._code.arows), P._code.nslots, x1, P._code.out_slots,
                     np.ones(1), P._code.in_slots, True)
    np.testing.assert_array_equal(E[2], P.value_and_grad(x1)[1])
    got, scalar = results(P, x1, v), results(S, x1, v)
    for a, b in zip(got, scalar):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    y, g, hv = torch_derivs(f, x1, v)
    np.testing.assert_allclose(got[0], y, rtol=1e-12)
    np.testing.assert_allclose(got[1], g, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(got[2], hv, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got[5], torch_derivs(f, 0.5 * x1, v)[1], rtol=1e-11,
                               atol=1e-13)
    xe = tg.tensor(x1, requires_grad=True)
    ge, = tg.autograd.grad(f(tg, xe), xe)
    np.testing.assert_allclose(got[1], ge.numpy(), rtol=1e-11, atol=1e-13)


def test_matmul_keeps_no_product_slot_in_replay():
    # gmm's shape of product: (k, d, d) @ (k, d, n); one instruction per row of the output,
    # its n outputs after their chains' slots, which the array interpreter never touches
    rng = np.random.default_rng(3)
    k, d, n = 2, 5, 40
    Q = rng.normal(size=(k, d, d))

    def f(x):
        return tg.sum(tg.matmul(tg.tensor(Q), x.reshape(k, d, n)) ** 2)
    x0 = rng.normal(size=k * d * n)
    P = tg.trace(f, x0)
    assert P._code.arrays
    assert reductions(P._code).count(("mul", n, d)) == k * d
    rows = P._code.arows
    h = np.nonzero(rows[:, 0] == PA.RED)[0][0]
    assert PA.info(rows, h)[2] == (0, 1, 1, n, d)  # (sa, sb, ta, tb, L): a row of Q
    work = np.full(P._code.nslots, np.nan)  # the chains' slots stay NaN: never written
    status = PA.forward(rows, x0, work, 0, rows.shape[0], 0)
    assert status == 0 and np.isnan(work).sum() >= k * d * n * (2 * d - 2)
    xt = torch.tensor(x0, requires_grad=True)
    y = (torch.matmul(torch.tensor(Q), xt.reshape(k, d, n)) ** 2).sum()
    g, = torch.autograd.grad(y, xt)
    value, grad = P.value_and_grad(x0)
    np.testing.assert_allclose(value, y.item(), rtol=1e-13)
    np.testing.assert_allclose(grad, g.numpy(), rtol=1e-12, atol=1e-13)


def test_expand_writes_chains_with_outputs_last():
    # a reduction's expansion: each output's chain of adds (or mul, mul, add...) in order,
    # the chains' other slots first, the outputs contiguous after them
    L = Builder(min_run=4)
    x = L.inputs(0, (3, 4))
    s = L.reduce_terms(x)                 # row sums: 3 chains of 3 adds
    p = L.reduce_terms(x[:, :2], x[:, 2:])  # 3 chains: mul, mul, add
    rows = L.rows()
    assert reductions(type("C", (), {"arows": rows})) == [("add", 3, 4), ("mul", 3, 2)]
    E = PA.expand(rows)
    assert E.shape[0] == 12 + 9 + 9 and list(s) == [18, 19, 20] and list(p) == [27, 28, 29]
    add, mul = OPS.index(tg.ops.BY_NAME["add"]), OPS.index(tg.ops.BY_NAME["mul"])
    # chain 0 of the sums: (x0 + x1) at 12, (+ x2) at 13, (+ x3) the output 18
    assert E[12, :3].tolist() == [add, 0, 1] and E[13, :3].tolist() == [add, 12, 2]
    assert E[18, :3].tolist() == [add, 13, 3]
    # chain 0 of the products: x0 * x2 at 21, x1 * x3 at 22, their sum the output 27
    assert E[21, :3].tolist() == [mul, 0, 2] and E[22, :3].tolist() == [mul, 1, 3]
    assert E[27, :3].tolist() == [add, 21, 22]
    xv = np.arange(12.0) + 1
    st, vals, _ = PA.run_fresh(rows, 30, xv, np.concatenate([s, p]), np.ones(6),
                               np.arange(12), False)
    X = xv.reshape(3, 4)
    np.testing.assert_array_equal(vals, np.r_[X.sum(1), (X[:, :2] * X[:, 2:]).sum(1)])


def test_long_sum_in_blocks_is_accurate_and_exact_against_its_expansion():
    # 640 + 7 terms: blocks of RED_BLOCK summed in order, their sums summed, then the rest
    from tapegrad.interpreters import program as prog
    n = 5 * prog.RED_BLOCK + 7
    x0 = np.random.default_rng(5).normal(size=n) * 1e3
    P = tg.trace(lambda x: tg.sum(x * x), x0)
    assert ("add", 5, prog.RED_BLOCK) in reductions(P._code)
    value, grad = P.value_and_grad(x0)
    assert abs(value - np.sum(x0 * x0)) <= 1e-13 * np.sum(x0 * x0)
    np.testing.assert_array_equal(grad, 2 * x0)
    with RF.array_instructions(SCALAR):
        S = tg.trace(lambda x: tg.sum(x * x), x0)
    assert S.value_and_grad(x0)[0] == value


def test_extreme_reductions_only_of_detached_values():
    # a max of values with a gradient has no reduction instruction (it would need a rule):
    # reduce_terms declines and emits nothing, and the lowering's tree is used
    L = Builder(min_run=4)
    x = L.inputs(0, (64,))
    n = L.n
    assert L.reduce_terms(x, step="maximum") is None and L.n == n
    d = L.op("detach", x)
    m = L.reduce_terms(d, step="maximum")
    assert m is not None and L.n > n + 64
    # the rule of a hand-made extreme of values that are not detached is refused, not a
    # wrong gradient
    rows = L.rows()
    h = int(np.nonzero(rows[:, 0] == PA.RED)[0][0])
    bad = rows.copy()
    bad[h, 1] = 0  # its terms now the inputs themselves
    from tapegrad.interpreters.program import grad_rows
    with pytest.raises(AssertionError, match="not detached"):
        grad_rows(bad, [int(m)], [1.0], np.arange(64))
    with pytest.raises(ValueError, match="only of detached values"):
        PA.mark_inactive(bad.copy(), PA.row_slots(bad)[1], PA.GRAD_BITS, PA.LEAF)


def test_inputs_are_one_leaf_instruction_expanded_to_leaf_rows():
    x0 = np.random.default_rng(2).normal(size=50)
    with RF.array_instructions(16):
        P = tg.trace(lambda x: tg.sum(tg.exp(x)), x0)
    rows = P._code.arows
    assert rows[0, 0] == PA.ARR and rows[1, 5] == PA.LEAF and rows[1, 4] == 50
    E = PA.expand(rows)
    assert (E[:50, 0] == PA.LEAF).all() and E[:50, 4].tolist() == list(range(50))
    np.testing.assert_allclose(P.grad(x0), np.exp(x0), rtol=1e-15)
    np.testing.assert_allclose(P.grad(np.stack([x0, -x0]))[1], np.exp(-x0), rtol=1e-15)


def test_large_instructions_run_in_numpy_deterministically(monkeypatch, tmp_path):
    # exp and log in NumPy (SIMD, not libm: within rounding of the compiled loop's),
    # the arithmetic exactly; the same results on every call; the reverse sweep compiled
    monkeypatch.setattr(PA, "NUMPY_MIN", dict.fromkeys(("exp", "log", "sub", "mul"), 16))
    rng = np.random.default_rng(9)
    x0 = rng.normal(size=200)

    def lse(M, x):
        a = M.max(x)
        return a + M.log(M.sum(M.exp(x - a))) + M.sum(M.log(x * x + 1.0))
    P = tg.trace(lambda x: lse(tg, x), x0)
    plan = PA._plan(P._code.arows)
    assert {op.name for *_, op in plan if op not in (None, PA.RED)} >= {"exp", "log", "sub",
                                                                     "mul"}
    with RF.array_instructions(SCALAR):
        S = tg.trace(lambda x: lse(tg, x), x0)
    a, b = P.value_and_grad(x0), P.value_and_grad(x0)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    s = S.value_and_grad(x0)
    np.testing.assert_allclose(a[0], s[0], rtol=1e-15)
    np.testing.assert_allclose(a[1], s[1], rtol=1e-14, atol=1e-16)
    y, g, hv = torch_derivs(lse, x0, x0[::-1].copy())
    np.testing.assert_allclose(a[0], y, rtol=1e-13)
    np.testing.assert_allclose(a[1], g, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(P.hvp((x0,), (x0[::-1].copy(),))[1], hv, rtol=1e-10,
                               atol=1e-13)
    path = tmp_path / "lse.npz"
    P.save(path)
    Q = tg.load(path)
    np.testing.assert_array_equal(Q.value_and_grad(x0)[1], a[1])


def test_saved_reduction_program_loads_and_runs_its_expansion_elsewhere(tmp_path):
    x0 = np.random.default_rng(4).normal(size=72)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: matmuls(tg, x), x0)
    path = tmp_path / "mm.npz"
    P.save(path)
    Q = tg.load(path)
    x1 = x0[::-1].copy()
    for a, b in zip(P.value_and_grad(x1), Q.value_and_grad(x1)):
        np.testing.assert_array_equal(a, b)
    X = np.stack([x0, x1, 2 * x1])
    np.testing.assert_allclose(Q.grad(X)[2], P.grad(2 * x1), rtol=1e-13)
    np.testing.assert_allclose(P.hvp(x1, x0)[1], Q.hvp(x1, x0)[1], rtol=1e-12)


def test_exact_ops_in_numpy_give_the_compiled_loops_numbers(monkeypatch):
    # inputs, comparisons, select, pick, detach and arithmetic in NumPy round exactly as
    # the compiled loops (and the expansion): the same numbers, bit for bit
    names = ("leaf", "detach", "select", "pick", "eq", "ne", "sub", "mul", "add", "eq_nan",
             "pick_where")
    monkeypatch.setattr(PA, "NUMPY_MIN", dict.fromkeys(names, 16))
    x0 = np.random.default_rng(6).normal(size=300)
    x0[7] = x0[8] = x0.max()  # a tie: the max's gradient shared

    def f(M, x):
        a = M.max(x)
        return a + M.log(M.sum(M.exp(x - a))) + M.sum((x * x) * 0.5 - x)
    P = tg.trace(lambda x: f(tg, x), x0)
    ran = {op.name for *_, op in PA._plan(P._code.arows) if op not in (None, PA.RED)}
    assert ran >= {"leaf", "detach", "pick_where", "eq_nan", "sub", "mul"}, ran  # (max())
    assert_as_scalar_rows_and_torch(P, f, x0)


@pytest.mark.parametrize("numpy_min", [16, 1 << 40], ids=["numpy", "compiled"])
@pytest.mark.parametrize("kind", ["max", "amax"])
def test_max_ties_in_one_test_nan_as_torch(monkeypatch, numpy_min, kind):
    # a max's ties are one test: x.max()'s eq_nan (equal, or both NaN: a NaN max shares
    # its gradient among the NaNs), amax's eq (a NaN max: all-NaN gradient), as eager mode
    # and torch (amax with a NaN once gave the NaNs 1/count); in NumPy (a broadcast NaN
    # takes its own branch) and compiled, the expansion's numbers to the bit
    monkeypatch.setattr(PA, "NUMPY_MIN", dict.fromkeys(PA.NUMPY_MIN, numpy_min))
    torch = pytest.importorskip("torch")
    f = (lambda M, x: x.max()) if kind == "max" else (lambda M, x: M.amax(x))
    x0 = np.random.default_rng(9).normal(size=200)
    x0[[3, 50, 51]] = x0.max() + 1.0  # three ties
    P = tg.trace(lambda x: f(tg, x), x0)
    rows = P._code.arows
    ops = {OPS[int(rows[h + 1, 5])].name for h in PA.heads_of(rows).tolist()
           if rows[h, 0] == PA.ARR}
    test = "eq_nan" if kind == "max" else "eq"
    assert test in ops and not ops & {"select", "ne", "eq", "eq_nan"} - {test}, ops
    with RF.array_instructions(SCALAR):
        S = tg.trace(lambda x: f(tg, x), x0)
    for x in (x0, np.where(np.arange(200) % 70 == 1, np.nan, x0), np.full(200, np.nan),
              np.full(200, np.inf)):
        t = torch.tensor(x, requires_grad=True)
        f(torch, t).backward()
        e = tg.tensor(x, requires_grad=True)
        f(tg, e).backward()
        for a, b in zip(P.value_and_grad(x), S.value_and_grad(x)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(P.value_and_grad(x)[1], t.grad.numpy())
        np.testing.assert_array_equal(P.value_and_grad(x)[1], np.asarray(e.grad))


def test_sweeps_over_row_ranges_compose():
    # the driver runs the compiled forward between NumPy steps, over ranges of rows: any
    # split of either sweep gives the whole sweep's numbers (a reduction's loop once
    # overwrote the reverse's lower bound)
    x0 = np.random.default_rng(8).normal(size=200)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: lse(tg, x) + tg.sum(tg.matmul(x.reshape(10, 20), x[:20])), x0)
    rows, n = P._code.arows, P._code.nslots
    at = PA.row_slots(rows)[0]
    nr = rows.shape[0]
    heads = PA.heads_of(rows).tolist()

    def pieces(r0, r1):  # [a, b) stretches of rows: each reduction alone (its own sweeps)
        cuts = sorted({r0, r1} | {c for h in heads if rows[h, 0] == PA.RED
                                  for c in (h, h + 4) if r0 < c < r1})
        return list(zip(cuts, cuts[1:]))

    def fw(v, r0, r1):
        for a, b in pieces(r0, r1):
            f = PA.red_forward if rows[a, 0] == PA.RED else \
                lambda *s: PA.forward(s[0], x0, *s[1:])
            assert f(rows, v, a, b, int(at[a])) == 0

    def rv(adj, r0, r1):
        for a, b in reversed(pieces(r0, r1)):
            f = PA.red_reverse if rows[a, 0] == PA.RED else PA.reverse
            f(rows, v, adj, b - 1, (int(at[b]) if b < nr else n) - 1, a)
    v = np.zeros(n)
    fw(v, 0, nr)
    whole = np.zeros(n)
    whole[P._code.out_slots] = 1.0
    rv(whole, 0, nr)
    assert any(rows[h, 0] == PA.RED for h in heads)
    for cut in heads[1:]:
        w = np.zeros(n)
        fw(w, 0, cut)
        fw(w, cut, nr)
        np.testing.assert_array_equal(w[P._code.out_slots], v[P._code.out_slots])
        adj = np.zeros(n)
        adj[P._code.out_slots] = 1.0
        rv(adj, cut, nr)
        rv(adj, 0, cut)
        np.testing.assert_array_equal(adj[P._code.in_slots], whole[P._code.in_slots])
    # the driver's steps: consecutive reductions one call, an inactive one (the max's
    # shift) left out of the reverse sweep
    plan = PA._plan(rows)
    back = PA._reverse_plan(rows, plan)
    assert sum(op is PA.RED for *_, op in plan) >= 2
    assert sum(kind is PA.RED for *_, kind in back) < sum(op is PA.RED for *_, op in plan)

def lse(M, x):
    a = M.max(x)
    return a + M.log(M.sum(M.exp(x - a)))


def test_numpy_steps_are_quiet_as_the_compiled_loops(monkeypatch):
    # a log of 0 and an exp that overflows give -inf and inf without NumPy's warnings
    import warnings
    monkeypatch.setattr(PA, "NUMPY_MIN", dict.fromkeys(("exp", "log", "mul", "divc"), 16))
    x0 = np.abs(np.random.default_rng(1).normal(size=64)) + 0.5
    P = tg.trace(lambda x: tg.sum(tg.log(x * 2.0) + tg.exp(x / 3.0)), x0)
    plan = PA._plan(P._code.arows)
    assert {op.name for *_, op in plan if op not in (None, PA.RED)} >= {"exp", "log"}
    x1 = x0.copy()
    x1[3], x1[5] = 0.0, 3000.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value, grad = P.value_and_grad(x1)
    assert np.isnan(value) or np.isinf(value)
    assert np.isinf(grad[3]) and np.isinf(grad[5])


def test_a_long_sums_blocks_and_their_adds_are_one_step_of_the_driver():
    # a sum of 1,000 terms: blocks of 128 (a reduction), the last block (another) and the
    # scalar adds of the blocks' sums between them run in one ``red_forward`` call (and one
    # ``red_reverse``), with the expansion's numbers
    x0 = np.random.default_rng(11).normal(size=1000)

    def f(M, x):
        return M.sum(M.exp(x) * 0.5) + M.sum(x * x)
    P = tg.trace(lambda x: f(tg, x), x0)
    rows = P._code.arows
    plan = PA._plan(rows)
    steps = [(r0, r1) for r0, r1, _, _, op in plan if op is PA.RED]
    assert any((rows[r0:r1, 0] == PA.ADD).any() and (rows[r0:r1, 0] == PA.RED).sum() >= 2
               for r0, r1 in steps), steps
    back = PA._reverse_plan(rows, plan)
    assert sum(kind is PA.RED for *_, kind in back) == len(steps)
    assert_as_scalar_rows_and_torch(P, f, x0)


def test_marks_what_passes_no_gradient_to_an_input():
    # mark_inactive: instructions whose values reach no input through a gradient are
    # flagged 1.0 (the reverse sweep skips them), an active one's operands without a
    # gradient ``-(bits)`` (their gradients go to the instruction's own adjoints, already
    # read), with the expansion's numbers
    x0 = np.random.default_rng(3).normal(size=200)
    Wc = np.random.default_rng(4).normal(size=200)

    def f(M, x):
        return (M.max(x) + M.sum(M.exp(x - M.max(x).detach()))
                + M.sum(x * M.tensor(Wc, dtype=M.float64)))
    P = tg.trace(lambda x: f(tg, x), x0)
    rows = P._code.arows
    flags = {}
    for h in PA.heads_of(rows).tolist():
        name = OPS[int(rows[h + 1, 5])].name
        flags.setdefault(("red " if rows[h, 0] == PA.RED else "") + name, set()).add(
            float(rows[h + 3, 5]))
    assert flags["leaf"] == {1.0} and flags["detach"] == {1.0}, flags
    assert flags["eq_nan"] == {1.0} and "select" not in flags, flags  # (a max's ties)
    assert 1.0 in flags["red maximum"] and 0.0 in flags["red add"], flags
    assert flags["sub"] == {-2.0} and flags["mul"] == {-2.0}, flags  # (b: the shift, W)
    assert_as_scalar_rows_and_torch(P, f, x0)


@pytest.mark.parametrize("d", [3, 4, 5, 8, 9, 10, 17])
def test_matmul_rows_terms_summed_together_give_the_expansions_bits(d):
    # a matmul's row against contiguous columns (gmm's): its forward vectorized, its
    # reverse summing eight terms' gradients at a time, then two, then one, each in the
    # expansion's order; both operands take gradients
    rng = np.random.default_rng(d)
    k, n = 2, 24

    def f(M, x):
        A = x[:k * d * d].reshape(k, d, d)
        B = x[k * d * d:].reshape(k, d, n)
        return M.sum(M.matmul(A, B) ** 2)
    x0 = rng.normal(size=k * d * (d + n))
    with RF.array_instructions(4):
        P = tg.trace(lambda x: f(tg, x), x0)
    rows = P._code.arows
    heads = [h for h in PA.heads_of(rows).tolist() if rows[h, 0] == PA.RED
             and rows[h + 1, 5] == PA.MUL]
    assert heads and all(PA.info(rows, h)[2][:2] == (0, 1) for h in heads)
    assert_as_scalar_rows_and_torch(P, f, x0)


def test_a_constant_matrix_with_repeated_values_is_a_reduction_operand():
    """llsq's shape: ``s - P @ x`` with a constant ``P`` whose values repeat (a column of
    ones, powers of a symmetric ``t``). Its elements were rows shared by value, so ``P``'s
    slots were not evenly spaced, the matmul was scalar rows and the program (with the
    constant rows counted as uncovered slots) ran its 48,000-row expansion, twice eager's
    time; now the constant gets a row per element and the matmul is one instruction."""
    n, m = 64, 5
    t = np.linspace(-1.0, 1.0, n)
    P = np.vander(t, m, increasing=True)  # ones, t, t^2 ...: repeated values
    s = np.sign(t)

    def f(M, x):
        r = M.tensor(s, dtype=M.float64) - M.matmul(M.tensor(P, dtype=M.float64), x)
        return M.sum(r * r) / 2
    x0 = np.random.default_rng(5).normal(size=m)
    prog = tg.trace(lambda x: f(tg, x), x0)
    assert prog._code.arrays
    assert ("mul", n, m) in reductions(prog._code), reductions(prog._code)
    assert_as_scalar_rows_and_torch(prog, f, x0)
    x1 = np.random.default_rng(6).normal(size=m)
    xe = tg.tensor(x1, requires_grad=True)
    ge, = tg.autograd.grad(f(tg, xe), xe)
    np.testing.assert_allclose(prog.grad(x1), ge.numpy(), rtol=1e-13, atol=1e-14)
    y, g, hv = torch_derivs(f, x1, x0)
    np.testing.assert_allclose(prog.hvp((x1,), (x0,))[1], hv, rtol=1e-12, atol=1e-13)
