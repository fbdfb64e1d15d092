"""kmeans' replayed ``dir`` (its gradient and Hessian-vector programs) at the speed of its
steps: the min's tie masks (``logical_not``, ``logical_or``) run loops of their own
(``_codegen_arrays.LOOPED``). The same bits as the shared loop and the scalar expansion,
and torch's numbers, through ties, NaN, inf and -0.0."""

import numpy as np
import pytest

from tapegrad.interpreters import _codegen_arrays
from tapegrad.ops import BY_NAME

from test_replay_arrays_bsums import K, D, N, _special, heads, kmeans, trace
from test_replay_arrays_large import SCALAR

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
