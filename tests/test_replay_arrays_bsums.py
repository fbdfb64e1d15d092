"""Derivative programs of array programs (tapegrad/interpreters/program.py ``grad_rows``):
the gradients of broadcast scalars (kmeans' ``x - c[:, :, None]``, one instruction per
centroid's coordinate, each broadcasting one slot) are summed after the run of the rules
that make them, those of one length as one reduction (``_flush_sums``), not each rule's
sum between them; neg (a sub's rule for its right operand) runs a loop of its own. The
programs agree with their scalar expansion, eager mode and torch, through NaN, inf, -0.0,
ties, non-contiguous inputs, hvp and create_graph."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import program_arrays as PA

from harness import replay_forms as RF
from test_replay_arrays_large import SCALAR

torch = pytest.importorskip("torch")

K, D, N = 3, 4, 40


def kmeans(M, x):
    """gradbench.kmeans.cost over one input: centroids (K, D) broadcast along points
    (D, N), both taking gradients."""
    C = x[:K * D].reshape(K, D)
    P = x[K * D:].reshape(D, N)
    diff = P[None, :, :] - C[:, :, None]
    return M.sum(M.min(M.sum(diff * diff, 1), 0).values)


def scaled(M, x):
    """A broadcast scalar read by two runs (its gradients summed twice, the second sum
    added to the first's) and a scalar row after the runs reading it again."""
    C = x[:K * D].reshape(K, D)
    P = x[K * D:].reshape(D, N)
    a = M.exp(P[None, :, :] * C[:, :, None] * 0.1)
    b = (P[None, :, :] - C[:, :, None]) ** 2
    return M.sum(a) + M.sum(b * 0.5) + (C * C).sum() + x[0] * x[1]


def _special(x, case):
    if case == "tie":
        x[K * D:K * D + D] = 0.0  # a point equally far from two centroids
        x[:D] = 1.0
        x[D:2 * D] = -1.0
    elif case == "nan":
        x[K * D + 5] = np.nan
    elif case == "inf":
        x[K * D + 7] = np.inf
    elif case == "zero":
        x[:K * D] = -0.0
        x[K * D:K * D + N] = 0.0
    return x


def trace(f, x, min_run):
    with RF.array_instructions(min_run):
        return tg.trace(lambda x: f(tg, x), x)


def heads(rows):
    """The names of the array instructions (RED for a reduction), in order."""
    out = []
    for h in PA.heads_of(rows).tolist():
        out.append("RED" if rows[h, 0] == PA.RED else PA.OPS[PA.info(rows, h)[1]].name)
    return out


def test_broadcast_sums_after_the_run_of_rules():
    x = np.random.default_rng(4).normal(size=K * D + D * N)
    P = trace(kmeans, x, 4)
    rows = P.grad_program()._code.arows
    names = heads(rows)
    # the K * D sub rules (their right operands' gradients ``-(sum of g)``: no negation
    # per element, ``program._array_rule``) and the adds of the points' gradients in one
    # run, no sum between them (each rule's own sum came between them before), and one
    # sum of them after, negated once per centroid's coordinate (scalar rows)
    assert "neg" not in names, names
    first = names.index("mulc")  # (``diff * diff``'s rule: ``2 t``)
    assert "RED" not in names[first:-1] and names[-1] == "RED", names
    tail = rows[PA.heads_of(rows)[-1] + PA.META + 1:, 0]
    assert (tail == PA.OPS[[o.name for o in PA.OPS].index("neg")].code).sum() == K * D


@pytest.mark.parametrize("f", [kmeans, scaled], ids=["kmeans", "scaled"])
@pytest.mark.parametrize("case", ["plain", "tie", "nan", "inf", "zero"])
def test_derivative_programs_against_expansion_eager_and_torch(f, case):
    rng = np.random.default_rng(8)
    x = _special(rng.normal(size=K * D + D * N), case)
    v = rng.normal(size=x.size)
    P = trace(f, x, 4)
    S = trace(f, x, SCALAR)
    assert P._code.arrays and not S._code.arrays
    # the array program's derivative programs: bit for bit their own expansion (the
    # interpreters of scalar rows run it: a batch of one)
    a = P.value_and_grad(x), P.hvp((x,), (v,))
    G = P.grad_program()
    np.testing.assert_array_equal(G(x), G(x[None])[0])  # (a batch: the expansion)
    gs = S.value_and_grad(x), S.hvp((x,), (v,))
    xt = torch.tensor(x, requires_grad=True)
    y = f(torch, xt)
    g, = torch.autograd.grad(y, xt, create_graph=True)
    hv, = torch.autograd.grad((g * torch.tensor(v)).sum(), xt)
    dead = case in ("nan", "inf") and f is kmeans
    for p, q in zip(a, gs):  # (NaN where the expansion has NaN)
        np.testing.assert_allclose(p[0], q[0], rtol=1e-13)
        if dead and p is a[1]:  # (the expansion's hvp is torch's since program.cut_dead;
            continue  # array programs' NaN: xfail in test_replay_dead_adjoints.py)
        np.testing.assert_allclose(p[1], q[1], rtol=1e-10, atol=1e-12)
    if dead:
        np.testing.assert_allclose(gs[1][1], hv.numpy(), rtol=1e-10, atol=1e-12)
    if case in ("nan", "inf") and f is kmeans:
        # (a point's distances all NaN or inf: a tie of every centroid, tapegrad's min
        # shares the gradient, torch's passes it to one; the same before this change)
        return
    for r in (a, gs):
        np.testing.assert_allclose(r[0][0], y.item(), rtol=1e-13)
        np.testing.assert_allclose(r[0][1], g.detach().numpy(), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(r[1][1], hv.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(G(x), g.detach().numpy(), rtol=1e-12, atol=1e-13)


def test_non_contiguous_input_and_create_graph():
    x = np.random.default_rng(9).normal(size=2 * (K * D + D * N))[::2]
    P = trace(kmeans, np.ascontiguousarray(x), 4)
    xt = tg.tensor(x, requires_grad=True)
    g, = tg.autograd.grad(P(xt), xt, create_graph=True)
    h, = tg.autograd.grad((g * g).sum(), xt)
    t = torch.tensor(x, requires_grad=True)
    gt, = torch.autograd.grad(kmeans(torch, t), t, create_graph=True)
    ht, = torch.autograd.grad((gt * gt).sum(), t)
    np.testing.assert_allclose(g.detach().numpy(), gt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(h.numpy(), ht.numpy(), rtol=1e-10, atol=1e-12)


def test_neg_runs_its_own_loop_bit_for_bit():
    from tapegrad.interpreters import _codegen_arrays
    assert "neg" in _codegen_arrays.LOOPED
    x = np.random.default_rng(10).normal(size=48)
    x[3], x[5], x[7], x[9] = -0.0, 0.0, np.inf, np.nan

    def f(M, x):
        return M.sum(-x * x[::-1]) + M.sum(M.exp(-x[::2]))
    P = trace(f, x, 4)
    assert "neg" in heads(P._code.arows)
    S = trace(f, x, SCALAR)
    a, s = P.value_and_grad(x), S.value_and_grad(x)
    np.testing.assert_array_equal(a[1], s[1])
    np.testing.assert_array_equal(np.signbit(a[1]), np.signbit(s[1]))
    np.testing.assert_array_equal(P.grad_program()(x), P.grad_program()(x[None])[0])
