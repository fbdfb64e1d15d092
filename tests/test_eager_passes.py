"""Issue 18's compiled passes over (k, d, n) arrays (kmeans', gmm's): their Python setup cut
without changing a bit of what they return."""
import itertools

import numpy as np
import pytest

from tapegrad.ops._kernels import ADD, MUL, MUL2, SUB, broadcast_pair, rows_op


def _bits(a):
    return np.ascontiguousarray(np.asarray(a, dtype=np.float64)).view(np.int64)


def test_broadcast_pair_is_numpys_broadcast_shapes():
    dims = (0, 1, 2, 3)
    shapes = [s for k in range(4) for s in itertools.product(dims, repeat=k)]
    for xs, ys in itertools.product(shapes, repeat=2):
        try:
            want = np.broadcast_shapes(xs, ys)
        except ValueError:
            want = None
        got = broadcast_pair(xs, ys)
        assert got == want, (xs, ys)
        assert got is None or got.__class__ is tuple


@pytest.mark.parametrize("xs, ys", [
    ((1, 8, 1000), (10, 8, 1)),     # kmeans' P[None] - C[:, :, None], 3-d as they are
    ((10, 8, 1), (1, 8, 1000)),
    ((8, 1000), (10, 8, 1)),        # a 2-d operand, viewed as 3-d
    ((10, 1, 1000), (10, 8, 1000)),
    ((1000,), (20, 8, 1)),
])
@pytest.mark.parametrize("op, f", [(ADD, np.add), (SUB, np.subtract), (MUL, np.multiply),
                                   (MUL2, lambda x, y: np.multiply(x, y) * 2.0)])
def test_rows_op_same_bits_as_numpy_and_leaves_its_operands_alone(xs, ys, op, f):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=xs), rng.normal(size=ys)
    x.flat[0], y.flat[1] = -0.0, np.inf
    got = rows_op(op, x, y)
    with np.errstate(all="ignore"):
        want = f(x, y)
    assert got.shape == want.shape
    assert np.array_equal(_bits(got), _bits(want))
    # the operands (passed to the compiled pass as they are where they are 3-d) keep
    # their flags, and the result is a new writable array
    assert x.flags.writeable and y.flags.writeable
    assert got.flags.writeable and not np.shares_memory(got, x) \
        and not np.shares_memory(got, y)


def test_rows_op_declines_what_numpy_rejects():
    x, y = np.ones((2, 8, 1000)), np.ones((3, 8, 1))
    assert rows_op(SUB, x, y) is None  # (2 against 3: NumPy's error from the caller's path)
    with pytest.raises(ValueError):
        np.subtract(x, y)


def test_scatter_add_same_bits_as_add_at():
    """The compiled scatter of a gather's gradient (gmm's ``lpad[:, idx]``, idx repeating):
    np.add.at's numbers, each element summed in the index's order from 0.0."""
    from tapegrad.ops._kernels import scatter_add
    rng = np.random.default_rng(5)
    used = 0
    for _ in range(600):
        shape = tuple(int(v) for v in rng.integers(1, 6, size=rng.integers(1, 4)))
        ax = int(rng.integers(0, len(shape)))
        idx = rng.integers(-shape[ax], shape[ax], size=int(rng.integers(1, 12)))
        index = tuple([slice(None)] * ax + [idx]) if ax or rng.random() < 0.5 else idx
        gs = np.zeros(shape)[index].shape
        g = rng.normal(size=gs) * 10.0 ** rng.integers(-10, 10, size=gs)
        g.flat[0] = -0.0  # (0.0 + -0.0 is 0.0 in both)
        want = np.zeros(shape)
        np.add.at(want, index, g)
        got = np.zeros(shape)
        if scatter_add(got, index, g):
            used += 1
        else:
            np.add.at(got, index, g)
        assert np.array_equal(_bits(got), _bits(want)), (shape, index)
    assert used == 600


@pytest.mark.parametrize("index", [
    (slice(None), np.array([5, 0, 0, 5, 1])),    # repeated, leading slice
    (np.array([2, 0, -1, 0]),),                  # on the first axis, a negative index
    (slice(None), np.array([3, 1, 2])),          # distinct
])
def test_scatter_add_declines_what_it_does_not_cover(index):
    from tapegrad.ops._kernels import scatter_add
    z = np.zeros((4, 6))
    g = np.arange(float(z[index].size)).reshape(z[index].shape)
    ro = g.copy()
    ro.flags.writeable = False
    want = np.zeros((4, 6))
    np.add.at(want, index, g)
    for gi in (g, ro, np.asfortranarray(g)):  # any flags and layout: add.at's numbers
        z = np.zeros((4, 6))
        assert scatter_add(z, index, gi)
        assert np.array_equal(z, want)
    assert not scatter_add(np.zeros((4, 6), dtype=np.float32), index,
                           g.astype(np.float32))  # (other dtypes: add.at)
    assert not scatter_add(np.zeros((4, 6)), index, np.ones(1))  # a broadcast g: add.at
    assert not scatter_add(np.zeros((4, 6)), (slice(None), np.array([0, 6])),
                           np.ones((4, 2)))  # out of range: nothing written, add.at raises
    assert not scatter_add(np.zeros((4, 6)), (np.array([0]), np.array([1])), np.ones(1))


def test_gather_with_repeats_gradients_match_torch():
    """gmm's ``cat([zeros, l], 1)[:, idx]`` with idx repeating 0 (the scatter of its
    gradient compiled): first and second derivatives against torch."""
    torch = pytest.importorskip("torch")
    import tapegrad as tg
    rng = np.random.default_rng(2)
    l0 = rng.normal(size=(5, 6))
    idx = np.array([0, 3, 0, 1, 6, 0, 2, 2, 4, 5, 0])
    w = rng.normal(size=(5, len(idx)))

    def f(M, l):
        lpad = M.cat([M.zeros((5, 1), dtype=M.float64), l], 1)
        q = lpad[:, idx] * M.tensor(w, dtype=M.float64)
        return M.sum(q * q * q)

    res = []
    for M in (tg, torch):
        l = M.tensor(l0, dtype=M.float64, requires_grad=True)
        (g,) = M.autograd.grad(f(M, l), (l,), create_graph=True)
        (h,) = M.autograd.grad(M.sum(g * g), (l,))
        res.append((g.detach().numpy(), h.numpy()))
    np.testing.assert_allclose(res[0][0], res[1][0], rtol=1e-13, atol=0)
    np.testing.assert_allclose(res[0][1], res[1][1], rtol=1e-12, atol=0)
