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
