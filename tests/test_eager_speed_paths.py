"""Issue 18's eager speed paths (ba, ode, kmeans, gmm): each shortcut gives torch's numbers,
the same bits where the slow path gave them, through higher derivatives too."""
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.ops.arrays import _index_scatter

torch = pytest.importorskip("torch")


def _bits(a):
    return np.ascontiguousarray(np.asarray(a, dtype=np.float64)).view(np.int64)


@pytest.mark.parametrize("shape, index", [
    ((5, 3), (slice(None), np.array([1, 2, 0]))),     # ba's cross product columns
    ((5, 3), (slice(None), np.array([2, -1, 0]))),    # -1 is 2: repeated, accumulated
    ((5, 3), (slice(None), np.array([1, -1, 0]))),    # -1 is 2: distinct
    ((6, 4), np.array([[0, 2], [5, 1]])),
    ((6, 4), (slice(1, 4), np.array([3, 0]))),
    ((6, 4), (2, np.array([3, 0]))),
    ((6, 4), np.array([0, 0, 1])),
    ((40, 3), np.arange(39, -1, -1)),                 # many: NumPy's unique
    ((40, 3), np.r_[np.arange(20), 7]),
])
def test_index_scatter_written_when_distinct_same_bits_as_add_at(shape, index):
    rng = np.random.default_rng(3)
    g = rng.normal(size=np.zeros(shape)[index].shape)
    g.flat[0] = -0.0  # add.at's 0.0 + -0.0 is 0.0, a plain write would keep -0.0
    want = np.zeros(shape)
    np.add.at(want, index, g)
    got = _index_scatter(g, (index, shape, False))
    assert np.array_equal(_bits(got), _bits(want))


def test_column_gather_gradients_match_torch_to_the_bit():
    """``a[:, [1, 2, 0]] * b[:, [2, 0, 1]]`` (ba's cross product): first and second
    derivatives, the gathers' scatters written."""
    rng = np.random.default_rng(0)
    a0, b0 = rng.normal(size=(7, 3)), rng.normal(size=(7, 3))
    i, j = [1, 2, 0], [2, 0, 1]

    def run(M):
        a = M.tensor(a0, dtype=M.float64, requires_grad=True)
        b = M.tensor(b0, dtype=M.float64, requires_grad=True)
        c = a[:, i] * b[:, j] - a[:, j] * b[:, i]
        ga, gb = M.autograd.grad((c * c).sum(), (a, b), create_graph=True)
        (h,) = M.autograd.grad((ga * gb).sum(), (a,))
        return [x.detach().numpy() for x in (c, ga, gb, h)]

    for got, want in zip(run(tg), run(torch)):
        assert np.array_equal(_bits(got), _bits(want))
