"""The eager evals' per-op and per-backward costs cut in issue 18's fifth round (detach, an
index of slices and new axes, the release's kept answer, the broadcast pass's setup, the
seeds' -0.0): each keeps what it did, against torch where torch has the behaviour."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import cpu
from tapegrad.ops import _kernels as K

torch = pytest.importorskip("torch")


def _kmeans_dir(M, C0, P0):
    """kmeans' Newton direction (the eval's text): two backwards, the first create_graph."""
    C = M.tensor(C0, dtype=M.float64, requires_grad=True)
    P = M.tensor(P0, dtype=M.float64)
    d = P[None, :, :] - C[:, :, None]
    cost = M.sum(M.min(M.sum(d * d, 1), 0).values)
    (J,) = M.autograd.grad(cost, (C,), create_graph=True)
    (H,) = M.autograd.grad(J, (C,), grad_outputs=(M.ones_like(J),))
    return J.detach() / H, J


_RNG = np.random.default_rng(18)
_C0, _P0 = _RNG.normal(size=(5, 4)), _RNG.normal(size=(4, 300))


class _Forget(list):
    """A ``_LAST_DROP`` that keeps nothing: every release computes its answer afresh."""

    def __getitem__(self, i):
        return None

    def __setitem__(self, i, v):
        pass


def _released(tape):
    ph = sorted(k for k, v in tape.arrays.items()
                if cpu._PLACEHOLDERS.get((v.shape, v.dtype)) is v)
    consts = sorted(k for k, a in tape.aux.items()
                    if isinstance(a, tuple) and len(a) == 2 and a[0] is None)
    return ph, consts, list(tape.versioned)


@pytest.mark.parametrize("keep", [True, False])
def test_release_keeps_its_last_answer_for_the_same_rows_and_mask(monkeypatch, keep):
    """The second backward of kmeans' direction releases a partly freed tape: the answer
    kept for the same rows matrix and freed mask drops what a fresh one drops (the same
    arrays, constants and version checks), and is asked of ``_droppable`` once in a loop."""
    monkeypatch.setattr(cpu, "_LAST_DROP", [None] if keep else _Forget([None]))
    calls = []
    real = cpu._droppable
    monkeypatch.setattr(cpu, "_droppable", lambda *a: calls.append(1) or real(*a))
    states, dirs = [], []
    for _ in range(3):
        r, J = _kmeans_dir(tg, _C0, _P0)
        states.append(_released(J._tape))
        dirs.append(r.numpy().tobytes())
    assert states[0] == states[1] == states[2] and states[0][0]
    assert dirs[0] == dirs[1] == dirs[2]
    assert len(calls) == (1 if keep else 3)
    want, _ = _kmeans_dir(torch, _C0, _P0)
    np.testing.assert_allclose(np.frombuffer(dirs[0]), want.numpy().ravel(), rtol=1e-13)


def _tape_of_program():
    x = tg.tensor(np.linspace(0.1, 1.0, 600), requires_grad=True)
    c = tg.tensor(np.linspace(1.0, 2.0, 600))
    e = tg.exp(x) * c
    y = (e * e).sum() + (e - c).sum()
    return y._tape


@pytest.mark.parametrize("masks", [((1, 2, 3), (1, 2)), ((4, 5), (1, 2, 3, 4, 5))])
def test_release_answer_is_not_reused_for_another_mask(monkeypatch, masks):
    """Two tapes of one program (the same rows matrix) freed differently: the second
    release computes its own answer, which is what a release without a kept one gives."""
    def run(last):
        monkeypatch.setattr(cpu, "_LAST_DROP", last)
        out = []
        for m in masks:
            tape = _tape_of_program()
            freed = np.zeros(len(tape.vals), np.bool_)
            freed[list(m)] = True
            cpu._release(tape, freed, tape.rows())
            out.append(_released(tape))
        return out
    kept, fresh = run([None]), run(_Forget([None]))
    assert kept == fresh
    assert kept[0] != kept[1]


def test_detach_shares_memory_and_version_with_torch():
    """detach of a non-leaf: the same memory and version counter (a write through it is
    seen by the tensor and fails the backward that saved it), as torch's."""
    out = []
    for M in (tg, torch):
        x = M.tensor(np.linspace(0.5, 1.5, 6), dtype=M.float64, requires_grad=True)
        y = x * 2.0
        z = (y * y).sum()
        d = y.detach()
        assert not d.requires_grad and d.grad_fn is None
        d.add_(1.0)
        out.append(y.detach().numpy().copy())
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.backward()
    np.testing.assert_array_equal(out[0], out[1])


def test_detach_of_a_view_writes_through_to_the_base():
    out = []
    for M in (tg, torch):
        x = M.tensor(np.arange(12.0).reshape(3, 4), dtype=M.float64, requires_grad=True)
        y = x * 1.0
        v = y[:, None, 1:3].detach()  # a view of a view
        v.mul_(10.0)
        w = y.detach()
        w[0, 0] = -1.0
        out.append((y.detach().numpy().copy(), v.numpy().copy()))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_detach_of_a_leaf_and_of_a_number():
    for M in (tg, torch):
        x = M.tensor(np.ones(3), dtype=M.float64, requires_grad=True)
        d = x.detach()
        d[1] = 5.0
        assert x.detach().numpy()[1] == 5.0
        s = M.tensor(2.0, dtype=M.float64, requires_grad=True) * 3.0
        ds = s.detach()
        assert ds.item() == 6.0 and not ds.requires_grad


def test_none_index_higher_derivatives_are_torchs():
    """``C[:, :, None]`` (the short path of slices and new axes) through two backwards,
    create_graph, against torch: kmeans' direction and a third-order term."""
    got, _ = _kmeans_dir(tg, _C0, _P0)
    want, _ = _kmeans_dir(torch, _C0, _P0)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-13)
    res = []
    for M in (tg, torch):
        c = M.tensor(_C0, dtype=M.float64, requires_grad=True)
        y = (M.sin(c[None, :, None, 1:]) ** 3).sum()
        (g,) = M.autograd.grad(y, (c,), create_graph=True)
        (h,) = M.autograd.grad((g * g).sum(), (c,), create_graph=True)
        (t,) = M.autograd.grad(h.sum(), (c,))
        res.append([a.detach().numpy() for a in (g, h, t)])
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("idx", [(slice(None), slice(None), slice(None), None),
                                 (None, slice(None), slice(None), slice(None)),
                                 (slice(None), None, slice(None), slice(None), None)])
def test_a_bad_index_of_slices_and_new_axes_records_nothing(idx):
    """Too many slices for the tensor: torch's IndexError, and nothing on the tape."""
    c = tg.tensor(_C0, requires_grad=True)
    y = c * 1.0
    tape = y._tape
    n = len(tape.vals)
    with pytest.raises(IndexError, match="too many indices"):
        y[idx]
    with pytest.raises(IndexError, match="too many indices"):
        torch.tensor(_C0)[idx]
    assert len(tape.vals) == n


@pytest.mark.parametrize("shape_x,shape_y", [
    ((1, 8, 512), (5, 1, 1)), ((5, 1, 512), (5, 8, 512)), ((40, 512), (1, 1)),
    ((5, 8, 512), (5, 8, 1)), ((1, 512), (40, 1))])
def test_broadcast_pass_of_expanded_operands_is_numpys_bits(shape_x, shape_y):
    """``rows_op`` on operands expanded with zero strides (an expand's view, 2 and 3 dims):
    NumPy's result, bit for bit (``_compact``'s written-out 3-d case and the general one)."""
    rng = np.random.default_rng(5)
    out = np.broadcast_shapes(shape_x, shape_y)
    x = np.broadcast_to(rng.normal(size=shape_x), out)
    y = np.broadcast_to(rng.normal(size=shape_y), out)
    for op, f in ((K.ADD, np.add), (K.SUB, np.subtract), (K.MUL, np.multiply)):
        r = K.rows_op(op, x, y)
        assert r is not None
        assert r.shape == out and r.tobytes() == f(x, y).tobytes()


def test_seed_adjoints_start_at_minus_zero():
    """The adjoints start at -0.0 (IEEE addition's identity): a gradient made only of
    -0.0 contributions keeps its sign, as torch's."""
    res = []
    for M in (tg, torch):
        x = M.tensor(np.array([1.0, -2.0, 3.0]), dtype=M.float64, requires_grad=True)
        y = (x * -0.0).sum() + (x[:2] * 0.0).sum()
        (g,) = M.autograd.grad(y, (x,))
        res.append(g.numpy())
    assert res[0].tobytes() == res[1].tobytes()


def test_grad_outputs_seed_of_the_outputs_shape_and_dtype_is_torchs():
    """A float64 ``grad_outputs`` of the output's shape is the seed as it is (the short
    check); another shape is torch's error, another dtype converted as before; the
    gradients are torch's either way."""
    a0 = np.linspace(-1.0, 1.0, 12).reshape(3, 4)
    go = np.linspace(0.5, 2.0, 12).reshape(3, 4)
    res = []
    for M in (tg, torch):
        x = M.tensor(a0, dtype=M.float64, requires_grad=True)
        y = M.sin(x) * x
        (g,) = M.autograd.grad(y, (x,), grad_outputs=(M.tensor(go, dtype=M.float64),),
                               retain_graph=True)
        (g32,) = M.autograd.grad(y, (x,), grad_outputs=(M.tensor(go, dtype=M.float32),),
                                 retain_graph=True)
        with pytest.raises(RuntimeError, match="Mismatch in shape"):
            M.autograd.grad(y, (x,), grad_outputs=(M.tensor(go[:2], dtype=M.float64),),
                            retain_graph=True)
        res.append((g.numpy(), g32.numpy()))
    for a, b in zip(*res):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
