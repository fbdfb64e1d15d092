"""The gradient and Hessian-vector programs of array programs record no rules for values
that depend on no input (``program._active``): kmeans' points, constants that its
``x - c`` broadcasts over the centroids, got their own gradient (adds over the centroids)
that the sums' spans kept in both programs. Results against torch and the same bits as
without the cut."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad._program_code import _grad_code, _hvp_of
from tapegrad.interpreters import program as _prog
from tapegrad.interpreters import program_arrays as A
from tapegrad.ops import OPS

torch = pytest.importorskip("torch")


def kmeans(M, C, PT):
    diff = PT[None, :, :] - C[:, :, None]
    return M.sum(M.min(M.sum(diff * diff, 1), 0).values)


def kmeans_program(k=4, d=3, n=50, seed=0):
    rng = np.random.default_rng(seed)
    PT0 = rng.normal(size=(d, n))
    C0 = PT0[:, :k].T.copy() + 0.01
    Pt = tg.tensor(PT0)
    return tg.trace(lambda C: kmeans(tg, C, Pt), C0), PT0, C0


def instructions(rows, name, n):
    """The elementwise instructions of op ``name`` and length ``n`` in ``rows``."""
    return sum(1 for h in A.heads_of(rows).tolist()
               if rows[h, 0] != A.RED and OPS[A.info(rows, h)[1]].name == name
               and A.info(rows, h)[0] == n)


def no_cut(monkeypatch):
    monkeypatch.setattr(_prog, "_active", lambda L, in_slots: None)


def torch_hvp(PT0, C0, v):
    PT = torch.tensor(PT0)
    C = torch.tensor(C0, requires_grad=True)
    g, = torch.autograd.grad(kmeans(torch, C, PT), C, create_graph=True)
    h, = torch.autograd.grad(g, C, grad_outputs=torch.tensor(v))
    return g.detach().numpy(), h.numpy()


def recorded(code):
    """The rows ``grad_rows`` records for ``code``'s gradient, before any pruning."""
    return _prog.grad_rows(code.arows, code.out_slots, [1.0], code.in_slots)[0].rows()


def test_constant_operand_gets_no_gradient_rows(monkeypatch):
    P, _, _ = kmeans_program()
    g, h = _grad_code(P._code), _hvp_of(P._code)
    # the points' gradient: adds of the centroids' terms, 50 elements each, none now
    own = instructions(P._code.arows, "add", 50)  # (the cost's own sum over points)
    assert instructions(recorded(P._code), "add", 50) == own
    assert instructions(g.arows, "add", 50) == 0
    assert instructions(h.arows, "add", 50) == 0
    with monkeypatch.context() as m:
        no_cut(m)
        P2, _, _ = kmeans_program()
        assert instructions(recorded(P2._code), "add", 50) > own


@pytest.mark.parametrize("k,d,n", [(4, 3, 50), (10, 8, 1000)])
def test_kmeans_grad_hvp_against_torch_and_same_bits(k, d, n, monkeypatch):
    P, PT0, C0 = kmeans_program(k, d, n)
    v = np.random.default_rng(2).normal(size=C0.shape)
    g = P.grad(C0)
    val, hv = P.hvp((C0,), (v,))
    tg_, th = torch_hvp(PT0, C0, v)
    np.testing.assert_allclose(g, tg_, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(hv, th, rtol=1e-12, atol=1e-12)
    with monkeypatch.context() as m:
        no_cut(m)
        P2, _, _ = kmeans_program(k, d, n)
        g2 = P2.grad(C0)
        val2, hv2 = P2.hvp((C0,), (v,))
    assert g.tobytes() == g2.tobytes()
    assert np.float64(val).tobytes() == np.float64(val2).tobytes()
    assert hv.tobytes() == hv2.tobytes()


def test_both_operands_active_keep_their_rules():
    """``x - c`` where both are inputs: both gradients, as torch's."""
    rng = np.random.default_rng(3)
    X0, C0 = rng.normal(size=(3, 40)), rng.normal(size=(4, 3))
    P = tg.trace(lambda C, X: kmeans(tg, C, X), C0, X0)
    gc, gx = P.grad(C0, X0)
    C, X = torch.tensor(C0, requires_grad=True), torch.tensor(X0, requires_grad=True)
    tc, tx = torch.autograd.grad(kmeans(torch, C, X), (C, X))
    np.testing.assert_allclose(gc, tc.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gx, tx.numpy(), rtol=1e-12, atol=1e-12)
    vc, vx = rng.normal(size=C0.shape), rng.normal(size=X0.shape)
    _, (hc, hx) = P.hvp((C0, X0), (vc, vx))
    tth = torch.autograd.functional.hvp(lambda C, X: kmeans(torch, C, X),
                                        (torch.tensor(C0), torch.tensor(X0)),
                                        (torch.tensor(vc), torch.tensor(vx)))[1]
    np.testing.assert_allclose(hc, tth[0].numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(hx, tth[1].numpy(), rtol=1e-10, atol=1e-10)


def test_constant_output_gradient_is_zero():
    """A program whose output depends on no input through a gradient (a detached value):
    its gradient and H v are zeros, as torch's (``allow_unused`` zeros)."""
    x0 = np.linspace(0.1, 2.0, 64)
    P = tg.trace(lambda x: (x.detach() * 2.0 + 1.0).exp().sum(), x0)
    assert P._code.arrays
    np.testing.assert_array_equal(P.grad(x0), np.zeros(64))
    np.testing.assert_array_equal(P.hvp((x0,), (np.ones(64),))[1], np.zeros(64))


def elements(rows, name):
    """The elements of op ``name`` that ``rows`` compute (instructions and scalar rows)."""
    heads = A.heads_of(rows)
    inst = np.zeros(rows.shape[0], dtype=np.bool_)
    for j in range(A.META + 1):
        inst[heads + j] = True
    code = OPS.index(next(op for op in OPS if op.name == name))
    return int((rows[~inst, 0] == OPS[code].code).sum()) + sum(
        A.info(rows, h)[0] for h in heads.tolist()
        if rows[h, 0] != A.RED and A.info(rows, h)[1] == OPS[code].code)


def muls(rows):
    return sum(1 for h in A.heads_of(rows).tolist()
               if rows[h, 0] != A.RED and OPS[A.info(rows, h)[1]].name == "mul")


def test_square_rule_recorded_once_same_bits(monkeypatch):
    """``diff * diff``'s rule: one product ``g * diff`` added to itself, where the rule's
    two products (the same numbers) were both recorded: the gradient program's results
    are the same bits, H v against torch."""
    P, PT0, C0 = kmeans_program(4, 3, 50)
    G = P.grad_program()
    with monkeypatch.context() as m:
        m.setattr(_prog, "_squared", lambda op, ins: False)
        P2, _, _ = kmeans_program(4, 3, 50)
        G2 = P2.grad_program()
        v = np.random.default_rng(4).normal(size=C0.shape)
        hv2 = P2.hvp((C0,), (v,))[1]
    # one product per centroid's coordinate less (12 of 50 elements), and their sum
    # ``t + t`` is ``2 t`` (the same bits)
    assert muls(G._code.arows) == muls(G2._code.arows) - 12
    assert instructions(G._code.arows, "mulc", 600) == 1
    assert instructions(G2._code.arows, "add", 600) == 1
    assert instructions(G._code.arows, "add", 600) == 0
    assert G(C0).tobytes() == G2(C0).tobytes()
    assert G(C0 + 0.3).tobytes() == G2(C0 + 0.3).tobytes()
    hv = P.hvp((C0,), (v,))[1]
    np.testing.assert_allclose(hv, hv2, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(hv, torch_hvp(PT0, C0, v)[1], rtol=1e-12, atol=1e-12)


def test_square_rule_broadcast_operand():
    """``c * c`` of a broadcast scalar (stride 0, one slot twice): its gradients summed
    once per rule, as torch's."""
    x0 = np.linspace(-1.0, 1.0, 40)

    def f(M, x):
        c = x[3:4].expand(40) if M is tg else x[3:4].expand(40)
        return (c * c * x).sum()

    P = tg.trace(lambda x: f(tg, x), x0)
    v = np.linspace(0.5, 1.5, 40)
    _, hv = P.hvp((x0,), (v,))
    th = torch.autograd.functional.hvp(lambda x: f(torch, x), torch.tensor(x0),
                                       torch.tensor(v))[1].numpy()
    np.testing.assert_allclose(P.grad(x0), torch.func.grad(lambda x: f(torch, x))(
        torch.tensor(x0)).numpy(), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(hv, th, rtol=1e-12, atol=1e-12)


def squares_program(k=4, d=64, n=300, seed=0):
    """Squared distances summed over 64 coordinates (sums of 64 terms, ``diff * diff``
    read again after them: the sums' reverse adds to their terms' adjoints), every value
    live: the distances' square, and the squares' own squares."""
    rng = np.random.default_rng(seed)
    PT0 = rng.normal(size=(d, n))
    C0 = PT0[:, :k].T.copy() + 0.01
    Pt = tg.tensor(PT0)

    def f(C):
        diff = Pt[None, :, :] - C[:, :, None]
        sq = diff * diff
        return tg.sum(tg.sum(sq, 1) ** 2) + tg.sum(sq * sq)

    return tg.trace(f, C0), PT0, C0


def test_long_sums_reverse_compiled_same_bits(monkeypatch):
    """A Hessian-vector program's run of 4 sums of 300 x 64 gradients (adding to their
    terms' adjoints) reverses in the compiled loop (``_rgrp_compiled``), not NumPy's
    broadcast add: the same bits. (kmeans' distance sums, which this test read before,
    are dead to its product since ``cut_dead`` cut arrays: they run no reverse at all,
    ``test_kmeans_dead_distances_run_no_reverse``.)"""
    from tapegrad._program_derivs import _hvp_run
    P, PT0, C0 = squares_program()
    v = np.random.default_rng(5).normal(size=C0.shape)
    val, hv = P.hvp((C0,), (v,))
    back = closure(_hvp_run(P._code), "back")
    firsts = closure(_hvp_run(P._code), "rg_firsts")
    assert not [b for b in back if type(b[3]) is tuple and b[3][0] is A.RGRP
                and b[0] not in firsts and b[3][2][3] >= A.RGRP_LOOP_L]
    with monkeypatch.context() as m:
        m.setattr(A, "RGRP_LOOP_L", 1 << 40)
        P2, _, _ = squares_program()
        val2, hv2 = P2.hvp((C0,), (v,))
        back2 = closure(_hvp_run(P2._code), "back")
        firsts2 = closure(_hvp_run(P2._code), "rg_firsts")
        assert [b for b in back2 if type(b[3]) is tuple and b[3][0] is A.RGRP
                and b[0] not in firsts2 and b[3][2][3] >= 64]
    assert hv.tobytes() == hv2.tobytes()
    assert np.float64(val).tobytes() == np.float64(val2).tobytes()
    C = torch.tensor(C0, requires_grad=True)
    diff = torch.tensor(PT0)[None, :, :] - C[:, :, None]
    sq = diff * diff
    g, = torch.autograd.grad((sq.sum(1) ** 2).sum() + (sq * sq).sum(), C, create_graph=True)
    h, = torch.autograd.grad(g, C, grad_outputs=torch.tensor(v))
    np.testing.assert_allclose(hv, h.numpy(), rtol=1e-9)


def test_kmeans_dead_distances_run_no_reverse():
    """kmeans' squared distances (80,000 elements) and their sums are read only by the
    min's comparisons and picks: dead to the Hessian-vector product (``cut_dead``). They
    run no reverse step (flagged, as ``mark_inactive`` flags what reaches no input): at
    an inf centroid coordinate their rules gave 0 * inf = NaN to the live differences;
    torch's numbers."""
    from tapegrad._program_derivs import _hvp_run
    P, PT0, C0 = kmeans_program(10, 8, 1000)
    v = np.random.default_rng(7).normal(size=C0.shape)
    C1 = C0.copy()
    C1[2, 3] = np.inf
    val, hv = P.hvp((C1,), (v,))
    g, h = torch_hvp(PT0, C1, v)
    assert not np.isnan(h).any()
    np.testing.assert_allclose(hv, h, rtol=1e-12)
    np.testing.assert_allclose(P.grad(C1), g, rtol=1e-12)
    code = _hvp_run(P._code)
    r = code.arows
    heads = A.heads_of(r)
    big = [h0 for h0 in heads.tolist() if r[h0, 0] != A.RED and A.info(r, h0)[0] == 80_000]
    names = sorted(OPS[A.info(r, h0)[1]].name for h0 in big)
    assert "mul" in names  # (diff * diff)
    for h0 in big:
        if OPS[A.info(r, h0)[1]].name != "mulc":  # (the live one: the Hessian's terms)
            assert r[h0 + A.META, 5] == 1.0
    sums = [h0 for h0 in heads.tolist() if r[h0, 0] == A.RED and A.info(r, h0)[2][4] == 8]
    assert len(sums) == 10 and all(r[h0 + A.META, 5] == 1.0 for h0 in sums)
    assert not [b for b in closure(code, "back") if type(b[3]) is tuple and b[3][0] is A.RGRP]


def closure(code, name):
    run = code.run
    return dict(zip(run.__code__.co_freevars, run.__closure__))[name].cell_contents


def test_no_reverse_step_over_constants(monkeypatch):
    """kmeans' points are 8,000 constant rows (and the centroids a leaf instruction): no
    reverse step runs over them (``_no_rules``); the same bits."""
    from tapegrad._program_derivs import _hvp_run
    P, PT0, C0 = kmeans_program(10, 8, 1000)
    v = np.random.default_rng(6).normal(size=C0.shape)
    g = P.grad(C0)
    hv = P.hvp((C0,), (v,))[1]
    for code in (P._code, _hvp_run(P._code)):
        back = closure(code, "back")
        assert all(b[2] > 0 for b in back)  # (nothing down to the first rows)
        assert A._no_rules(code.frows, back) == back
    with monkeypatch.context() as m:
        m.setattr(A, "_no_rules", lambda rows, back: back)
        P2, _, _ = kmeans_program(10, 8, 1000)
        assert P2.grad(C0).tobytes() == g.tobytes()
        assert P2.hvp((C0,), (v,))[1].tobytes() == hv.tobytes()
        assert any(b[2] == 0 for b in closure(P2._code, "back"))


def test_constant_rows_copied_same_bits(monkeypatch):
    """A constant traced as scalar rows (200 of them, with -0.0, inf and NaN among them)
    is written by one copy (``_const_fills``), not the compiled loop: the same bits."""
    K0 = np.linspace(-3.0, 3.0, 200)
    K0[[5, 17, 33]] = [-0.0, np.inf, np.nan]
    K = tg.tensor(K0)
    x0 = np.linspace(0.5, 1.5, 200)

    def f(x):
        return x * K + x

    P = tg.trace(f, x0)
    assert P._code.arrays and (P._code.arows[:, 0] == A.CONST).sum() >= 200
    y = P(x0 + 0.25)
    steps = closure(P._code, "plan")
    assert any(type(s[4]) is tuple and s[4][0] is A.CONSTS for s in steps)
    np.testing.assert_array_equal(y, (x0 + 0.25) * K0 + (x0 + 0.25))
    with monkeypatch.context() as m:
        m.setattr(A, "CONST_RUN", 1 << 40)
        P2 = tg.trace(f, x0)
        y2 = P2(x0 + 0.25)
        assert not any(type(s[4]) is tuple and s[4][0] is A.CONSTS
                       for s in closure(P2._code, "plan"))
    assert y.tobytes() == y2.tobytes()
    g = P.vjp((x0,), np.ones(200))[1]
    np.testing.assert_array_equal(g, K0 + 1.0)


def test_broadcast_sub_gradient_negated_sum(monkeypatch):
    """``x - c`` of a broadcast ``c``: its gradient recorded as ``-(sum of g)`` (one
    negation per ``c``, not one per element): the same bits as the sum of the ``-g``, and
    as torch's where ``c`` is a scalar of each row."""
    P, PT0, C0 = kmeans_program(4, 3, 50)
    # 12 negations (scalar rows: fewer than ``MIN_RUN``), none over the points
    assert elements(recorded(P._code), "neg") == 12
    G = P.grad_program()
    v = np.random.default_rng(7).normal(size=C0.shape)
    hv = P.hvp((C0,), (v,))[1]
    with monkeypatch.context() as m:
        m.setattr(_prog, "_accumulate_range", _negating(_prog._accumulate_range))
        P2, _, _ = kmeans_program(4, 3, 50)
        G2 = P2.grad_program()
        hv2 = P2.hvp((C0,), (v,))[1]
        assert elements(recorded(P2._code), "neg") == 12 * 50
    for x in (C0, C0 + 0.3, -C0):
        assert G(x).tobytes() == G2(x).tobytes()
    np.testing.assert_allclose(hv, hv2, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(hv, torch_hvp(PT0, C0, v)[1], rtol=1e-12, atol=1e-12)
    # no broadcast (the same shapes): the elementwise ``-g``, as before
    x0 = np.linspace(-1.0, 1.0, 40)
    Q = tg.trace(lambda x: ((x - x * 0.5) ** 2).sum() + (x[:20] - x[20:]).sum(), x0)
    x = torch.tensor(x0, requires_grad=True)
    tgr, = torch.autograd.grad(((x - x * 0.5) ** 2).sum() + (x[:20] - x[20:]).sum(), x)
    np.testing.assert_allclose(Q.grad(x0), tgr.numpy(), rtol=1e-13, atol=1e-13)


def _negating(acc):
    """``_accumulate_range`` as before the negated sums: ``-g`` recorded, then summed."""
    def f(L, adj, slots, g, negate=False):
        return acc(L, adj, slots, -g if negate else g)
    return f


def test_broadcast_sub_of_own_element_against_torch():
    """``x - x[3]``: the broadcast element is one of ``x``'s own (its adjoint takes ``g``
    as ``x``'s and ``-(sum of g)`` as the scalar's), gradient and H v as torch's."""
    x0 = np.linspace(-1.0, 1.2, 40)
    v = np.linspace(0.5, 1.5, 40)

    def f(x):
        return ((x - x[3]) ** 2 * x).sum()

    P = tg.trace(f, x0)
    assert P._code.arrays
    x = torch.tensor(x0)
    tgr = torch.func.grad(f)(x).numpy()
    th = torch.autograd.functional.hvp(f, x, torch.tensor(v))[1].numpy()
    np.testing.assert_allclose(P.grad(x0), tgr, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(P.hvp((x0,), (v,))[1], th, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(P.grad_program()(x0), tgr, rtol=1e-13, atol=1e-13)
