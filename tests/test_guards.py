"""Traced programs never replay a stale branch: tensor predicates (all, any, mask counts),
conversions (bool, int, float, item, tolist, numpy) and boolean-mask indexing are guarded,
or tracing refuses them."""
import math
import warnings

import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")
# tracing warns of values read out of the tape; the tests below check the warning once
pytestmark = [pytest.mark.filterwarnings("ignore::tapegrad.TraceWarning"),
              pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")]


def A(x):
    return (x * x).sum()


def B(x):
    return x.sin().sum()


# name, fn, traced at, same branch, other branch, whether it reads a value (not a truth
# value): then tracing warns (an error with strict=True) and the guard is on the value
CASES = [
    ("all", lambda x: A(x) if (x > 0).all() else B(x),
     [1.0, 2.0, 3.0], [0.5, 1.0, 2.0], [-1.0, 2.0, 3.0], False),
    ("any", lambda x: A(x) if (x > 0).any() else B(x),
     [1.0, -2.0, -3.0], [-1.0, 0.5, -1.0], [-1.0, -2.0, -3.0], False),
    ("all_item", lambda x: A(x) if (x > 0).all().item() else B(x),
     [1.0, 2.0, 3.0], [0.5, 1.0, 2.0], [-1.0, 2.0, 3.0], False),
    ("any_dim", lambda x: A(x) if (x.reshape(3, 1) > 0).any(1).all() else B(x),
     [1.0, 2.0, 3.0], [0.5, 1.0, 2.0], [1.0, -2.0, 3.0], False),
    ("count_compare", lambda x: A(x) if (x > 0).sum() > 1 else B(x),
     [1.0, 2.0, -3.0], [1.0, -2.0, 3.0], [1.0, -2.0, -3.0], False),
    ("count_of_both", lambda x: A(x) if ((x > 0) & (x < 2)).sum() >= 2 else B(x),
     [1.0, 1.5, 3.0], [0.5, 1.0, -2.0], [1.0, 2.5, 3.0], False),
    ("bool_0d", lambda x: A(x) if bool(x[0] * x[1] > 0) else B(x),
     [1.0, 2.0, 3.0], [-1.0, -2.0, 3.0], [-1.0, 2.0, 3.0], False),
    ("bool_0d_sum", lambda x: A(x) if bool(x.sum() > 0) else B(x),
     [1.0, 2.0, 3.0], [-1.0, 2.0, 3.0], [-1.0, -2.0, 0.5], False),
    ("isnan", lambda x: A(x) if (x.log()).isnan().any() else B(x),
     [1.0, 2.0, 3.0], [0.5, 1.0, 2.0], [-1.0, 2.0, 3.0], False),
    ("tolist", lambda x: x.sum() * sum((x > 0).tolist()),
     [1.0, 2.0, -3.0], [3.0, 1.0, -1.0], [1.0, -2.0, -3.0], False),
    ("asarray", lambda x: x.sum() * float(np.asarray(x > 0).sum()),
     [1.0, 2.0, -3.0], [3.0, 1.0, -1.0], [1.0, -2.0, -3.0], False),
    ("mask_index", lambda x: (x[x > 0] ** 2).sum(),
     [1.0, 2.0, -3.0], [3.0, 1.0, -1.0], [1.0, -2.0, -3.0], False),
    ("mask_assign", lambda x: _assign(x),
     [1.0, 2.0, -3.0], [3.0, 1.0, -1.0], [1.0, -2.0, -3.0], False),
    ("int_count", lambda x: x.sum() * int((x > 0).sum()),
     [1.0, 2.0, -3.0], [3.0, -1.0, 1.0], [1.0, -2.0, -3.0], True),
    ("float_count", lambda x: x.sum() * float((x > 0).sum()),
     [1.0, 2.0, -3.0], [3.0, -1.0, 1.0], [1.0, -2.0, -3.0], True),
    ("item_count", lambda x: A(x) if (x > 0).sum().item() > 1 else B(x),
     [1.0, 2.0, -3.0], [3.0, -1.0, 1.0], [1.0, -2.0, -3.0], True),
    ("float_value", lambda x: x.sum() * float(x[0]),
     [1.0, 2.0, 3.0], [1.0, -5.0, 7.0], [2.0, 2.0, 3.0], True),
    ("int_index", lambda x: _cat(x)[int((x > 0).sum())] * x.sum(),
     [1.0, -2.0, -3.0], [-1.0, 5.0, -3.0], [1.0, 2.0, -3.0], True),
    ("index_tensor", lambda x: _cat(x)[(x > 0).sum()] * x.sum(),
     [1.0, -2.0, -3.0], [-1.0, 5.0, -3.0], [1.0, 2.0, -3.0], True),
    ("detach_numpy", lambda x: x.sum() * float((x.detach().numpy() > 0).sum()),
     [1.0, 2.0, -3.0], [1.0, 2.0, -3.0], [1.0, -2.0, -3.0], True),
    ("tolist_values", lambda x: x.sum() * max(x.detach().tolist()),
     [1.0, 2.0, -3.0], [1.0, 2.0, -3.0], [1.0, -2.0, -3.0], True),
    ("operator_index", lambda x: x.sum() * len(range((x > 0).sum())),
     [1.0, 2.0, -3.0], [3.0, -1.0, 1.0], [1.0, -2.0, -3.0], True),
    ("tensor_copy", lambda x: (x * _copy(x[1:])).sum(),
     [1.0, 2.0, -3.0], [5.0, 2.0, -3.0], [1.0, -2.0, -3.0], True),
]
IDS = [c[0] for c in CASES]


def _copy(x):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "To copy construct")
        return (tg if isinstance(x, tg.Tensor) else torch).tensor(x)[0]


def _cat(x):
    return (tg if isinstance(x, tg.Tensor) else torch).cat([x, x])


def _assign(x):
    y = x * 1.0
    y[x < 0] = 0.0
    return (y * x).sum()


def trace(fn, x0, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tg.TraceWarning)
        return tg.trace(fn, np.array(x0), **kw)


def eager(fn, x):
    t = tg.tensor(np.array(x), requires_grad=True)
    y = fn(t)
    (g,) = tg.autograd.grad(y, [t], allow_unused=True, materialize_grads=True)
    return float(y), g.numpy()


def by_torch(fn, x):
    t = torch.tensor(np.array(x), requires_grad=True)
    y = fn(t)
    (g,) = torch.autograd.grad(y, [t], allow_unused=True, materialize_grads=True)
    return float(y.detach()), g.numpy()


def close(a, b):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name,fn,x0,same,other,value", CASES, ids=IDS)
def test_other_branch_raises_same_branch_replays(name, fn, x0, same, other, value):
    prog = trace(fn, x0)
    for x in (x0, same):
        v, g = prog.value_and_grad(np.array(x))
        ve, ge = eager(fn, x)
        close(v, ve)
        close(g, ge)
        close(prog(np.array(x)), ve)
    ve, _ = eager(fn, other)
    with pytest.raises(tg.GuardError, match=r"test_guards.py:\d+"):
        prog(np.array(other))
    with pytest.raises(tg.GuardError):
        prog.value_and_grad(np.array(other))
    with pytest.raises(tg.GuardError):  # a batch: the sample on the other branch
        prog(np.array([same, other]))


@pytest.mark.parametrize("name,fn,x0,same,other,value", CASES, ids=IDS)
def test_retrace_takes_the_other_branch(name, fn, x0, same, other, value):
    prog = trace(fn, x0, retrace=True)
    v, g = prog.value_and_grad(np.array(other))
    close((v, *g), (*eager(fn, other)[:1], *eager(fn, other)[1]))
    vt, gt = by_torch(fn, other)
    close(v, vt)
    close(g, gt)
    assert len(prog._variants) == 2
    V, G = prog.value_and_grad(np.array([x0, other, same]))
    for i, x in enumerate((x0, other, same)):
        ve, ge = eager(fn, x)
        close(V[i], ve)
        close(G[i], ge)


@pytest.mark.parametrize("name,fn,x0,same,other,value", CASES, ids=IDS)
def test_strict_refuses_values_and_guards_truth_values(name, fn, x0, same, other, value):
    if value:  # a value leaving the tape: strict makes it an error, as documented
        with pytest.raises(RuntimeError, match=r"strict=True"):
            tg.trace(fn, np.array(x0), strict=True)
        with pytest.warns(tg.TraceWarning, match="GuardError"):
            tg.trace(fn, np.array(x0))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a truth value is a guard: no warning
        prog = tg.trace(fn, np.array(x0), strict=True)
    close(prog(np.array(same)), eager(fn, same)[0])
    with pytest.raises(tg.GuardError):
        prog(np.array(other))


@pytest.mark.parametrize("name,fn,x0,same,other,value", CASES, ids=IDS)
def test_seeded_inputs_never_replay_a_wrong_value(name, fn, x0, same, other, value):
    """Random inputs (small integers, so counts and signs vary and float values repeat):
    the program either raises GuardError or equals eager mode; with retrace=True it always
    equals eager mode."""
    rng = np.random.default_rng(sum(map(ord, name)))
    prog = trace(fn, x0)
    again = trace(fn, x0, retrace=True)
    outcomes = set()
    xs = [np.array(x0), np.array(same), np.array(other)]
    for _ in range(16):
        x = rng.integers(-2, 3, size=3).astype(np.float64)
        x[x == 0] = 0.5
        xs.append(x)
    for x in xs:
        ve, ge = eager(fn, x)
        try:
            v, g = prog.value_and_grad(x)
        except tg.GuardError:
            outcomes.add("guard")
        else:
            outcomes.add("replay")
            close(v, ve)
            close(g, ge)
        v, g = again.value_and_grad(x)
        close(v, ve)
        close(g, ge)
    assert outcomes == {"guard", "replay"}


def test_guards_survive_derivative_programs_and_files(tmp_path):
    fn = CASES[0][1]
    prog = trace(fn, [1.0, 2.0, 3.0])
    H = prog.hessian(np.array([0.5, 1.0, 2.0]))
    close(H, 2 * np.eye(3))
    with pytest.raises(tg.GuardError):
        prog.hessian(np.array([-1.0, 1.0, 2.0]))
    prog = trace(CASES[IDS.index("int_count")][1], [1.0, 2.0, -3.0])
    prog.save(tmp_path / "p.npz")
    loaded = tg.load(tmp_path / "p.npz")
    close(loaded(np.array([3.0, -1.0, 1.0])), 6.0)
    with pytest.raises(tg.GuardError, match=r"int\(\) == 2"):
        loaded(np.array([1.0, -2.0, -3.0]))


def test_counts_and_casts_of_masks_replay_branch_free():
    """A mask used as numbers (cast, counted, combined, choosing between constants) stays
    recomputed: no guard."""
    def fn(x):
        m = (x > 0).double()
        n = (x > 0).sum() + (x < -1).long().sum() * 2
        where = tg.where if isinstance(x, tg.Tensor) else torch.where
        s = where(x > 0, 1.0, -1.0).sum() + where((x > 0).logical_not(), 3.0, x).sum()
        return (m * x).sum() + n * x.sum() + where(x.isfinite(), x, 0.0).sum() + s * x[0]
    prog = tg.trace(fn, np.array([1.0, -2.0, 3.0]), strict=True)
    for x in ([1.0, 2.0, 3.0], [-3.0, -0.5, 2.0], [-1.0, -2.0, -3.0]):
        v, g = prog.value_and_grad(np.array(x))
        vt, gt = by_torch(fn, x)
        close(v, vt)
        close(g, gt)


def test_in_place_updates_of_counts_are_followed():
    def fn(x):
        c = (x > 0).sum()
        c += (x > 1).sum()
        return A(x) if c > 2 else B(x)
    prog = trace(fn, [1.0, 2.0, -3.0])
    close(prog(np.array([0.5, 3.0, 3.0])), eager(fn, [0.5, 3.0, 3.0])[0])
    with pytest.raises(tg.GuardError):
        prog(np.array([0.5, 0.5, -1.0]))


@pytest.mark.parametrize("fn,what", [
    (lambda x: x.sum() * int(x.argmax()), "argmax"),
    (lambda x: x[x.argmin()] * 2.0, "argmin"),
    (lambda x: A(x) if x.argmax() == 0 else B(x), "argmax"),
    (lambda x: x.sum() * float(x.max(0).indices), "indices of max"),
    (lambda x: A(x) if (x * 10.0).long().sum() > 3 else B(x), "cast of a traced value"),
    (lambda x: x.sum() * int((x > 0).long().clamp(0, 1).sum()), "clamp"),
    (lambda x: x.sum() * int(~(x > 0).sum()), "bitwise not"),
])
def test_values_that_cannot_be_recomputed_are_refused(fn, what):
    with pytest.raises(RuntimeError, match=f"{what}.*cannot recompute.*tapegrad.where"):
        tg.trace(fn, np.array([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("fn,what", [
    (lambda x: x * x.argmax(), "argmax"),
    (lambda x: tg.where(x.argmax() == x, x, 0.0).sum(), "argmax"),
    (lambda x: _assign_plain(x), "index assignment"),
])
def test_untraceable_values_in_the_program_are_refused(fn, what):
    with pytest.raises(NotImplementedError, match=f"{what}.*cannot be recorded"):
        tg.trace(fn, np.array([1.0, 2.0, 3.0]))


def _assign_plain(x):
    b = tg.zeros(3)
    b[0] = (x > 0).sum()
    return (b * x).sum()


def test_a_value_guard_tells_zero_from_minus_zero():
    def fn(x):
        return x.sum() + math.copysign(1.0, float(x[0]))
    prog = trace(fn, [0.0, 1.0])
    close(prog(np.array([0.0, 2.0])), 3.0)
    with pytest.raises(tg.GuardError):
        prog(np.array([-0.0, 2.0]))
    assert trace(fn, [0.0, 1.0], retrace=True)(np.array([-0.0, 2.0])) == 1.0


def test_a_bool_cast_of_a_traced_value_is_recomputed():
    prog = tg.trace(lambda x: A(x) if x.bool().all() else B(x), np.array([1.0, 2.0]))
    close(prog(np.array([3.0, -1.0])), 10.0)
    with pytest.raises(tg.GuardError):
        prog(np.array([0.0, 1.0]))
