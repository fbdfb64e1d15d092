"""tapegrad.scipy: a traced program drives scipy.optimize.minimize."""
import numpy as np
import pytest

import tapegrad as tg
import tapegrad.scipy as tgs

scipy_optimize = pytest.importorskip("scipy.optimize")


def rosen(x):
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()


@pytest.mark.parametrize("method", ["L-BFGS-B", "BFGS", "Newton-CG", "trust-ncg",
                                    "trust-exact"])
def test_minimize_rosenbrock(method):
    prog = tg.trace(rosen, np.zeros(5))
    res = tgs.minimize(prog, np.full(5, -1.0), method=method, options={"maxiter": 2000})
    assert res.success, res.message
    np.testing.assert_allclose(res.x, np.ones(5), atol=1e-4)


def test_objective_matches_scipy_reference_functions():
    prog = tg.trace(rosen, np.zeros(6))
    obj = tgs.objective(prog)
    x = np.random.default_rng(0).normal(size=6)
    p = np.random.default_rng(1).normal(size=6)
    v, g = obj.fun(x)
    np.testing.assert_allclose(v, scipy_optimize.rosen(x), rtol=1e-13)
    np.testing.assert_allclose(g, scipy_optimize.rosen_der(x), rtol=1e-12)
    np.testing.assert_allclose(obj.hessp(x, p), scipy_optimize.rosen_hess_prod(x, p),
                               rtol=1e-12)
    np.testing.assert_allclose(obj.hess(x), scipy_optimize.rosen_hess(x), rtol=1e-12)
    res = scipy_optimize.minimize(obj.fun, np.zeros(6), jac=True, hessp=obj.hessp,
                                  method="trust-krylov")
    np.testing.assert_allclose(res.x, np.ones(6), atol=1e-4)


def test_several_inputs_are_one_flat_vector():
    prog = tg.trace(lambda a, B: ((a - 1.0) ** 2).sum() + ((B - 2.0) ** 2).sum(),
                    np.zeros(2), np.zeros((2, 2)))
    res = tgs.minimize(prog, np.zeros(6), method="BFGS")
    np.testing.assert_allclose(res.x, [1, 1, 2, 2, 2, 2], atol=1e-6)
    assert tgs.objective(prog).hess(np.zeros(6)).shape == (6, 6)


def test_errors():
    with pytest.raises(TypeError, match="tapegrad.Program"):
        tgs.objective(rosen)
    with pytest.raises(ValueError, match="scalar"):
        tgs.objective(tg.trace(lambda x: x * 2.0, np.zeros(3)))
    obj = tgs.objective(tg.trace(rosen, np.zeros(3)))
    with pytest.raises(ValueError, match="flat vector of 3"):
        obj.fun(np.zeros(4))
