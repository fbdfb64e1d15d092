"""kmeans' replayed ``dir`` (its gradient and Hessian-vector programs) at the speed of its
steps: the min's tie masks (``logical_not``, ``logical_or``) run loops of their own
(``_codegen_arrays.LOOPED``); a mul adds no gradients to an operand whose gradient reaches
no input (``_codegen_arrays._MULSKIP``); the adjoints of constant rows are not zeroed
(``program_arrays._live``); a mul's reverse over contiguous operands (an operand skipped,
or ``x * x``) runs a loop LLVM vectorizes. The same bits as the shared loop and the scalar
expansion, and torch's numbers, through ties, NaN, inf and -0.0."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import _codegen_arrays
from tapegrad.interpreters import replay_cpu as _cpu
from tapegrad.interpreters import program_arrays as PA
from tapegrad.ops import BY_NAME

from test_replay_arrays_bsums import K, D, N, _special, heads, kmeans, trace
from test_replay_arrays_large import SCALAR
from test_replay_hvp_arrays import kmeans_program, torch_hvp

torch = pytest.importorskip("torch")


def test_tie_masks_run_their_own_loops():
    assert {"logical_not", "logical_or"} <= _codegen_arrays.LOOPED
    src = _codegen_arrays.generate_arrays()
    fw = src[src.index("def forward("):src.index("def red_reverse(")]
    for name in ("logical_not", "logical_or"):
        assert f"op == {BY_NAME[name].code}:" in fw, name


@pytest.mark.parametrize("case", ["plain", "tie", "nan", "inf", "zero"])
def test_tie_masks_bit_for_bit(case):
    rng = np.random.default_rng(21)
    x = _special(rng.normal(size=K * D + D * N), case)
    if case == "tie":  # (every centroid twice: each point's min a tie of two)
        x[D:2 * D] = x[:D]
    v = rng.normal(size=x.size)
    P, S = trace(kmeans, x, 4), trace(kmeans, x, SCALAR)
    G = P.grad_program()
    names = heads(G._code.arows)
    assert "logical_not" in names and "logical_or" in names, names
    # the derivative program bit for bit its expansion (a batch of one runs scalar rows)
    np.testing.assert_array_equal(G(x), G(x[None])[0])
    a, s = P.value_and_grad(x), S.value_and_grad(x)
    np.testing.assert_array_equal(a[0], s[0])
    np.testing.assert_array_equal(a[1], s[1])
    ok = ~np.isnan(s[1])  # (a NaN's sign aside: the rules' ``-(sum of g)``)
    np.testing.assert_array_equal(np.signbit(a[1][ok]), np.signbit(s[1][ok]))
    H = P.hvp((x,), (v,))[1]
    if case in ("nan", "inf"):  # (all of a point's distances tie: torch picks one; the
        return  # expansion's NaN: xfail in test_replay_dead_adjoints.py)
    np.testing.assert_allclose(H, S.hvp((x,), (v,))[1], rtol=1e-12, atol=1e-13)
    xt = torch.tensor(x, requires_grad=True)
    y = kmeans(torch, xt)
    g, = torch.autograd.grad(y, xt, create_graph=True)
    hv, = torch.autograd.grad((g * torch.tensor(v)).sum(), xt)
    if case == "tie":  # (tapegrad's min shares a tie's gradient, torch's passes it to one)
        return
    np.testing.assert_allclose(a[1], g.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(H, hv.numpy(), rtol=1e-10, atol=1e-12)


def _skipping_muls(rows):
    """The heads of the mul instructions whose reverse adds one operand's gradients only
    (the other's ``sk`` bit, both strided and apart: ``_codegen_arrays._MULSKIP``)."""
    out = []
    for h in PA.heads_of(rows).tolist():
        if rows[h, 0] == PA.RED or PA.info(rows, h)[1] != PA.MUL:
            continue
        flag = rows[h + PA.META, 5]
        sk = int(-flag) if flag < 0 else 0
        n, _, st = PA.info(rows, h)
        ia, ib = int(rows[h, 1]), int(rows[h, 2])
        if sk & 3 in (1, 2) and st[:2] == (1, 1) and (ia + n <= ib or ib + n <= ia):
            out.append(h)
    return out


def _same_bits_skips_off(code):
    """The heads of ``code``'s muls that skip an operand; its value and gradient at a
    random input the same bits with their skip marks cleared (the loop then adds both
    operands' gradients, the other's to adjoints never read)."""
    work, flat, _ = code.buffers()  # (its entry built: ``frows`` set)
    rows = code.frows
    hs = _skipping_muls(rows)
    flat[...] = np.random.default_rng(6).normal(size=flat.shape)
    w2 = work.copy()
    res = np.empty(code.res_size[True])
    assert code.run(rows, work, res) == 0
    off = rows.copy()
    off[np.array(hs, dtype=np.int64) + PA.META, 5] = -0.0
    assert not _skipping_muls(off)
    res2 = np.empty_like(res)
    assert PA.entry(off, w2)(off, w2, res2) == 0
    assert res.tobytes() == res2.tobytes()
    return hs


@pytest.mark.parametrize("step", [1, 2])
def test_mul_skipping_an_operand_contiguous_only_same_bits(step):
    """``x[::step]`` times a detached value, whose gradient reaches no input: contiguous
    operands skip it (``_MULSKIP``), strided ones add both; torch's numbers."""
    x0 = np.random.default_rng(8).normal(size=400)
    x0[[2, 8]] = [-0.0, np.inf]

    def f(M, x):
        return (x[:200 * step:step] * (x[200:] * 3.0).detach()).sum() + (x * x).sum()
    P = trace(f, x0, 4)
    hs = _same_bits_skips_off(P._code)
    assert len(hs) == (1 if step == 1 else 0), hs
    xt = torch.tensor(x0, requires_grad=True)
    g, = torch.autograd.grad(f(torch, xt), xt)
    np.testing.assert_allclose(P.grad(x0), g.numpy(), rtol=1e-13)


@pytest.mark.parametrize("k,d,n", [(4, 3, 50), (10, 8, 1000)])
def test_mul_with_a_skipped_operand_same_bits(k, d, n):
    """kmeans' Hessian-vector program's ``g * diff`` (``g`` reaches no input) adds only
    ``diff``'s gradients: the same bits as the loop that adds both (its skip marks cleared:
    the other operand's adds then land in adjoints never read)."""
    from tapegrad._program_derivs import _hvp_run
    assert "lop = -4" in _codegen_arrays.generate_arrays()
    P, PT0, C0 = kmeans_program(k, d, n)
    v = np.random.default_rng(5).normal(size=C0.shape)
    val, hv = P.hvp((C0,), (v,))
    assert len(_same_bits_skips_off(_hvp_run(P._code))) >= k * d
    # and torch's numbers
    _, th = torch_hvp(PT0, C0, v)
    np.testing.assert_allclose(hv, th, rtol=1e-12, atol=1e-12)


def _run_nan_adjoints(code, x):
    """``code``'s value and gradient at flat input ``x``, its adjoints NaN before the
    sweep wherever it does not zero them (a slot it reads unzeroed turns the result NaN)."""
    work, flat, _ = code.buffers()
    m, p, nx = int(work[0]), int(work[1]), int(work[2])
    o = _cpu.HEADER + 2 * m + p
    n = (work.shape[0] - o - nx) // 2
    work[o + nx + n:] = np.nan
    flat[...] = x
    res = np.empty(code.res_size[True])
    assert code.run(code.frows, work, res) == 0
    code._free.append((work, flat, _))
    return res


def _const_slots(rows):
    """The slots of the runs of ``CONST_RUN`` or more constant rows."""
    at = PA.row_slots(rows)[0]
    d = np.diff(np.concatenate(([0], (rows[:, 0] == PA.CONST).astype(np.int8), [0])))
    return np.concatenate([at[a:b] for a, b in zip(np.nonzero(d == 1)[0], np.nonzero(d == -1)[0])
                           if b - a >= PA.CONST_RUN])


@pytest.mark.parametrize("which", ["kmeans_grad", "kmeans_hvp", "mul_const"])
def test_constants_adjoints_not_zeroed_same_bits(which, monkeypatch):
    """A run of constant rows' adjoints (kmeans' points) are not zeroed before the reverse
    sweep (``program_arrays._live``): added to, never read. The same bits as zeroing them,
    with every other adjoint NaN before the sweep."""
    from tapegrad._program_derivs import _hvp_run

    def build():
        if which == "mul_const":  # (the product's rule adds ``g * x`` to K's adjoints)
            K0 = np.linspace(-3.0, 3.0, 6000)  # (over 2,000 a slice: ``_live``)
            K0[[5, 17, 33]] = [-0.0, np.inf, 1e300]
            K = tg.tensor(K0)
            x0 = np.linspace(0.5, 1.5, 6000)
            P = tg.trace(lambda x: (x * K + x).sum(), x0)
            return P._code, x0
        P, _, C0 = kmeans_program(10, 8, 1000)
        if which == "kmeans_grad":
            return P._code, C0.ravel()
        v = np.random.default_rng(7).normal(size=C0.size)
        return _hvp_run(P._code), np.concatenate((C0.ravel(), v))

    code, x = build()
    res = _run_nan_adjoints(code, x)
    live = PA.zeroed(code.run)
    cs = _const_slots(code.frows)
    assert cs.size >= 200 and live is not None
    zeroed = np.zeros(int(cs.max()) + 1, bool)
    for sl in live:
        zeroed[sl.start:min(sl.stop, zeroed.size)] = True
    assert not zeroed[cs].any()
    with monkeypatch.context() as mp:
        mp.setattr(PA, "LIVE_CONSTS", True)
        code2, _ = build()
        res2 = _run_nan_adjoints(code2, x)
    assert not np.isnan(res).any()
    assert res.tobytes() == res2.tobytes()


@pytest.mark.parametrize("step", [1, 3])
def test_square_reverse_contiguous_and_strided_same_bits(step):
    """``x * x``'s reverse (``_codegen_arrays._SQUARE_REVERSE``: a loop for contiguous
    operands, one for any stride) adds ``g * x`` twice, as the expansion's rows: its bits,
    -0.0, inf and NaN among the inputs; torch's numbers."""
    x0 = np.random.default_rng(9).normal(size=600)
    x0[[0, 3, 9, 12]] = [-0.0, np.inf, np.nan, 1e-300]

    def f(M, x):
        y = x[::step]
        return (y * y * 0.5).sum() + (y * 3.0).sum()
    P, S = trace(f, x0, 4), trace(f, x0, SCALAR)
    a, s = P.value_and_grad(x0), S.value_and_grad(x0)
    assert a[1].tobytes() == s[1].tobytes()
    xt = torch.tensor(x0, requires_grad=True)
    g, = torch.autograd.grad(f(torch, xt), xt)
    np.testing.assert_allclose(a[1], g.numpy(), rtol=1e-15)


def _kmeans_at(case, k=10, d=8, n=1000):
    """kmeans' program at GradBench's size (its sums over the coordinates run as one
    step), its points and centroids with ``case``'s special values."""
    rng = np.random.default_rng(31)
    PT0 = rng.normal(size=(d, n))
    C0 = PT0[:, :k].T.copy() + 0.01
    if case == "tie":  # (centroids 0 and 1 the same: every point's min a tie)
        C0[1] = C0[0]
    elif case == "nan":
        PT0[2, 7] = np.nan
    elif case == "inf":
        PT0[3, 11] = np.inf
    elif case == "zero":
        C0[2] = -0.0
        PT0[:, 5] = 0.0
    Pt = tg.tensor(PT0)
    from test_replay_hvp_arrays import kmeans as cost
    return (lambda: tg.trace(lambda C: cost(tg, C, Pt), C0)), PT0, C0


@pytest.mark.parametrize("case", ["plain", "tie", "nan", "inf", "zero"])
def test_inactive_squares_summed_one_step_same_bits(case, monkeypatch):
    """The Hessian-vector program's squared distances, which only the min's tie masks read
    (flagged inactive), are one forward step reading the differences themselves
    (``program_arrays._sqs_inactive``), not ``cut_dead``'s copy of them, the squares and
    their sums: the same bits as those steps, value, gradient and H v; torch's numbers."""
    from tapegrad._program_derivs import _hvp_run
    from test_replay_hvp_value import bits
    make, PT0, C0 = _kmeans_at(case)
    v = np.random.default_rng(5).normal(size=C0.shape)
    v[0, :3] = [-0.0, 0.0, np.inf if case == "inf" else 1.0]
    P = make()
    got = P.grad_and_hvp((C0,), (v,))
    code = _hvp_run(P._code)
    plan = dict(zip(code.run.__code__.co_freevars, code.run.__closure__))["plan"]
    kinds = [s[4][0] if type(s[4]) is tuple else s[4] for s in plan.cell_contents]
    assert PA.SQS in kinds and BY_NAME["detach"] not in kinds, kinds
    with monkeypatch.context() as m:
        m.setattr(PA, "_sqs_inactive", lambda rows, plan, out: plan)
        P2 = make()
        want = P2.grad_and_hvp((C0,), (v,))
        plan2 = dict(zip(_hvp_run(P2._code).run.__code__.co_freevars,
                         _hvp_run(P2._code).run.__closure__))["plan"].cell_contents
        assert BY_NAME["detach"] in [s[4] for s in plan2]
    for a, b in zip(got, want):
        assert bits(a) == bits(b)
    if case in ("plain", "zero"):
        g, h = torch_hvp(PT0, C0, v)
        np.testing.assert_allclose(got[1], g, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[2], h, rtol=1e-12, atol=1e-12)
