"""``tapegrad.autograd.grad``, ``backward`` and ``Tensor.backward`` against torch.autograd.

Each test runs the same program through both libraries (``M`` is ``tapegrad`` or
``torch``: their APIs match) and compares values, dtypes, warnings and exception types.
"""
import warnings

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.tape import STATE


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def leaf(M, data, dtype=None, rg=True):
    return M.tensor(data, dtype=dtype or M.float64, requires_grad=rg)


def arr(t):
    """A tensor's value as a NumPy array (None stays None)."""
    if t is None:
        return None
    return np.asarray(t.detach().numpy())


def dtype_name(t):
    return str(t.dtype).split(".")[-1]


def assert_same(a, b, rtol=1e-12):
    """tapegrad tensor ``a`` equals torch tensor ``b``: shape, dtype, values."""
    if b is None:
        assert a is None
        return
    assert a is not None
    assert isinstance(a, tg.Tensor)
    assert tuple(a.shape) == tuple(b.shape)
    assert dtype_name(a) == dtype_name(b)
    np.testing.assert_allclose(arr(a), arr(b), rtol=rtol, atol=1e-300)


def assert_all_same(xs, ys):
    assert len(xs) == len(ys)
    for a, b in zip(xs, ys):
        assert_same(a, b)


def assert_close_list(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(arr(g), w, rtol=1e-12)


def outcome(fn, *args):
    """(result or exception type, warning categories) of ``fn(*args)``."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            r = fn(*args)
        except Exception as e:  # noqa: BLE001 - the type is what we compare
            r = type(e)
    return r, [x.category for x in w]


def both_raise(torch, fn, exc):
    """``fn(M)`` raises ``exc`` with tapegrad and with torch; returns tapegrad's error."""
    with pytest.raises(exc):
        fn(torch)
    with pytest.raises(exc) as info:
        fn(tg)
    return info.value


def current_tape():
    """This thread's current tape, or None (``STATE.tape`` may hold it weakly)."""
    t = STATE.tape
    return t() if callable(t) else t


def tape_len():
    t = current_tape()
    return (id(t), 0) if t is None else (id(t), len(t))


# --- grad_outputs ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_implicit_grad_output_for_one_element_outputs(torch, shape):
    def run(M):
        x = leaf(M, np.full(shape, 0.7) if shape else 0.7)
        y = (M.sin(x) * x).reshape(shape)
        return M.autograd.grad(y, x)
    assert_all_same(run(tg), run(torch))


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_implicit_gradient_for_one_element_backward(torch, shape):
    def run(M):
        x = leaf(M, np.full(shape, 0.7) if shape else 0.7)
        M.autograd.backward(M.exp(x) * 3.0)
        return x.grad
    assert_same(run(tg), run(torch))


@pytest.mark.parametrize("call", ["grad", "backward", "method"])
def test_implicit_grad_output_for_non_scalar_raises(torch, call):
    def run(M):
        x = leaf(M, [1.0, 2.0, 3.0])
        y = x * x
        if call == "grad":
            return M.autograd.grad(y, x)
        if call == "backward":
            return M.autograd.backward(y)
        return y.backward()
    err = both_raise(torch, run, RuntimeError)
    assert "scalar" in str(err)


def test_explicit_grad_outputs_values(torch):
    rng = np.random.default_rng(0)
    xv, gv = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))

    def run(M):
        x = leaf(M, xv)
        y = M.tanh(x) * x
        return M.autograd.grad(y, x, grad_outputs=M.tensor(gv))
    assert_all_same(run(tg), run(torch))


def test_grad_outputs_single_tensor_or_sequence(torch):
    gv = np.array([0.5, -2.0])

    def run(M, seq):
        x = leaf(M, [1.0, 2.0])
        g = M.tensor(gv)
        return M.autograd.grad(x.exp(), x, grad_outputs=[g] if seq else g)
    for seq in (False, True):
        assert_all_same(run(tg, seq), run(torch, seq))
    assert_all_same(run(tg, False), run(tg, True))


def test_grad_outputs_none_entries_mean_implicit_ones(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        y1 = (x * x).sum()
        y2 = x * 3.0
        return M.autograd.grad([y1, y2], x, grad_outputs=[None, M.tensor([1.0, -1.0])])
    assert_all_same(run(tg), run(torch))


@pytest.mark.parametrize("out_shape,go_shape", [((2,), (3,)), ((2,), (1,)), ((), (1,)),
                                                ((2,), ()), ((2, 1), (2,)), ((2,), (2, 1))])
def test_grad_outputs_shape_mismatch_raises(torch, out_shape, go_shape):
    def run(M):
        x = leaf(M, np.ones(out_shape) if out_shape else 1.0)
        y = x * x
        go = M.ones(go_shape, dtype=M.float64)
        return M.autograd.grad(y, x, grad_outputs=go)
    err = both_raise(torch, run, RuntimeError)
    assert "shape" in str(err).lower()


def test_grad_tensors_shape_mismatch_raises_in_backward(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        (x * x).backward(M.ones(3, dtype=M.float64))
    both_raise(torch, run, RuntimeError)


@pytest.mark.parametrize("x_dtype,go_dtype", [("float64", "float32"), ("float32", "float64"),
                                              ("float64", "int64"), ("float32", "float32")])
def test_grad_outputs_dtype_is_cast_like_torch(torch, x_dtype, go_dtype):
    def run(M):
        x = leaf(M, [1.5, -2.0], dtype=getattr(M, x_dtype))
        y = x * x
        go = M.tensor([1, 3], dtype=getattr(M, go_dtype))
        return M.autograd.grad(y, x, grad_outputs=go)
    assert_all_same(run(tg), run(torch))


def test_grad_outputs_dtype_cast_through_a_cast(torch):
    def run(M):
        x = leaf(M, [1.5, -2.0])
        y = x.float() * 2.0
        return M.autograd.grad(y, x, grad_outputs=M.ones(2, dtype=M.float64))
    assert_all_same(run(tg), run(torch))


def test_fewer_grad_outputs_than_outputs_raises(torch):
    def run(M):
        x = leaf(M, 2.0)
        return M.autograd.grad([x * x, x * 3.0], x, grad_outputs=[M.tensor(1.0)])
    both_raise(torch, run, RuntimeError)


def test_more_grad_outputs_than_outputs_is_an_error():
    # API.md: tapegrad deliberately differs from torch (which ignores the extra ones)
    x = leaf(tg, 2.0)
    y = x * x
    with pytest.raises(RuntimeError):
        tg.autograd.grad(y, x, grad_outputs=[tg.tensor(1.0), tg.tensor(1.0)])
    # and the graph is still usable after the rejected call
    assert tg.autograd.grad(y, x)[0].item() == 4.0


def test_grad_outputs_are_not_aliased_into_grad(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        g = M.ones(2, dtype=M.float64)
        x.backward(g)
        with M.no_grad():
            g.mul_(5.0)
        return x.grad
    assert_same(run(tg), run(torch))


# --- retain_graph ---------------------------------------------------------------------------

SAVING_PROGRAMS = {
    # name: (program on a leaf, op name tapegrad's message must mention)
    "mul": (lambda M, x: (x * x).sum(), "mul"),
    "exp": (lambda M, x: M.exp(x).sum(), "exp"),
    "divc": (lambda M, x: (x / 2.0).sum(), "divc"),
    "mulc": (lambda M, x: (x * 2.0).sum(), "mulc"),
    "matmul": (lambda M, x: (x @ x), "matmul"),
    "scalar_sin": (lambda M, x: M.sin(x.sum()), "sin"),
    "prod": (lambda M, x: x.prod(), "prod"),
}


@pytest.mark.parametrize("name", sorted(SAVING_PROGRAMS))
@pytest.mark.parametrize("call", ["backward", "grad"])
def test_second_backward_through_freed_graph_raises(torch, name, call):
    prog, opname = SAVING_PROGRAMS[name]

    def run(M):
        x = leaf(M, [0.5, 1.5])
        y = prog(M, x)
        if call == "backward":
            M.autograd.backward(y)
            M.autograd.backward(y)
        else:
            M.autograd.grad(y, x)
            M.autograd.grad(y, x)
    err = both_raise(torch, run, RuntimeError)
    msg = str(err)
    assert "retain_graph=True" in msg
    assert f"'{opname}'" in msg or opname in msg


def test_second_backward_on_scalar_graph_raises(torch):
    def run(M):
        x = leaf(M, 0.5)
        y = M.sin(x) * 3.0
        y.backward()
        y.backward()
    err = both_raise(torch, run, RuntimeError)
    assert "retain_graph=True" in str(err)


NOTHING_SAVED = {
    "add_sum": lambda M, x: (x + x).sum(),
    "addc": lambda M, x: (x + 3.0).sum(),
    "subc": lambda M, x: (x - 3.0).sum(),
    "sub": lambda M, x: (x - x.detach()).sum(),
    "rsubc": lambda M, x: (3.0 - x).sum(),
    "neg": lambda M, x: (-x).sum(),
    "reshape_mean": lambda M, x: x.reshape(2, 1).mean(),
    "scalar_add": lambda M, x: x.sum() + x.sum(),
}


@pytest.mark.parametrize("name", sorted(NOTHING_SAVED))
def test_ops_with_nothing_saved_can_be_backpropagated_twice(torch, name):
    prog = NOTHING_SAVED[name]

    def run(M):
        x = leaf(M, [0.5, 1.5])
        y = prog(M, x)
        M.autograd.backward(y)
        M.autograd.backward(y)
        return x.grad
    assert_same(run(tg), run(torch))


def test_retain_graph_true_allows_repeats_and_accumulates(torch):
    def run(M):
        x = leaf(M, [0.5, 1.5, -0.25])
        y = (M.exp(x) * M.sin(x)).sum()
        grads = []
        for _ in range(3):
            M.autograd.backward(y, retain_graph=True)
            grads.append(x.grad.clone())
        g2 = M.autograd.grad(y, x, retain_graph=True)[0]
        M.autograd.backward(y)  # the last one frees
        grads.append(x.grad.clone())
        grads.append(g2)
        return grads
    assert_all_same(run(tg), run(torch))


def test_retain_graph_then_free_then_raise(torch):
    def run(M):
        x = leaf(M, [0.5, 1.5])
        y = (x * x).sum()
        M.autograd.grad(y, x, retain_graph=True)
        M.autograd.grad(y, x)
        M.autograd.grad(y, x)
    both_raise(torch, run, RuntimeError)


def test_new_ops_on_a_freed_graph_raise_when_backpropagated(torch):
    def run(M):
        x = leaf(M, [0.5, 1.5])
        z = M.exp(x)
        M.autograd.backward((z * 2.0).sum())
        y2 = (z * 3.0).sum()
        M.autograd.backward(y2)
    err = both_raise(torch, run, RuntimeError)
    assert "retain_graph=True" in str(err)


def test_unfreed_branch_of_a_freed_graph_still_works(torch):
    def run(M):
        x = leaf(M, [0.5, 1.5])
        z1 = M.exp(x)
        z2 = M.sin(x)
        M.autograd.backward(z1.sum())
        M.autograd.backward(z2.sum())
        return x.grad
    assert_same(run(tg), run(torch))


# --- allow_unused and materialize_grads -------------------------------------------------------


def _unused_program(M, shape):
    x = leaf(M, np.full(shape, 0.3) if shape else 0.3)
    u = leaf(M, np.full(shape, 2.0) if shape else 2.0)
    other = u * u  # u feeds another output, but not y
    y = (M.exp(x) * 2.0).sum()
    return x, u, y, other


@pytest.mark.parametrize("shape", [(), (2, 3)])
def test_unused_input_raises_by_default(torch, shape):
    def run(M):
        x, u, y, _ = _unused_program(M, shape)
        M.autograd.grad(y, [x, u])
    err = both_raise(torch, run, RuntimeError)
    assert "allow_unused=True" in str(err)


@pytest.mark.parametrize("shape", [(), (2, 3)])
def test_allow_unused_gives_none(torch, shape):
    def run(M):
        x, u, y, _ = _unused_program(M, shape)
        return M.autograd.grad(y, [x, u], allow_unused=True)
    rt, rp = run(tg), run(torch)
    assert rt[1] is None and rp[1] is None
    assert_all_same(rt, rp)


@pytest.mark.parametrize("shape", [(), (2, 3)])
@pytest.mark.parametrize("allow_unused", [None, True])
def test_materialize_grads_gives_zeros(torch, shape, allow_unused):
    def run(M):
        x, u, y, _ = _unused_program(M, shape)
        kw = {} if allow_unused is None else {"allow_unused": allow_unused}
        return M.autograd.grad(y, [x, u], materialize_grads=True, **kw)
    rt, rp = run(tg), run(torch)
    assert_all_same(rt, rp)
    assert np.all(arr(rt[1]) == 0.0)
    assert not rt[1].requires_grad


def test_materialize_grads_with_allow_unused_false_raises_value_error(torch):
    def run(M):
        x, u, y, _ = _unused_program(M, (2,))
        M.autograd.grad(y, [x, u], materialize_grads=True, allow_unused=False)
    both_raise(torch, run, ValueError)


def test_allow_unused_false_explicit_raises(torch):
    def run(M):
        x, u, y, _ = _unused_program(M, (2,))
        M.autograd.grad(y, [x, u], allow_unused=False)
    both_raise(torch, run, RuntimeError)


def test_unused_input_on_an_unrelated_graph(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        w = leaf(M, [3.0, 4.0])
        _ = (w * w).sum()
        y = (x * x).sum()
        return M.autograd.grad(y, [w, x], allow_unused=True)
    assert_all_same(run(tg), run(torch))


def test_materialized_zeros_keep_float32(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0], dtype=M.float32)
        u = leaf(M, [1.0], dtype=M.float32)
        return M.autograd.grad((x * x).sum(), [x, u], materialize_grads=True)
    assert_all_same(run(tg), run(torch))


# --- deprecated arguments -------------------------------------------------------------------


def test_only_inputs_false_warns_future_warning(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        return M.autograd.grad((x * x).sum(), x, only_inputs=False)
    rt, wt = outcome(run, tg)
    rp, wp = outcome(run, torch)
    assert FutureWarning in wt and FutureWarning in wp
    assert_all_same(rt, rp)


def test_only_inputs_true_does_not_warn():
    x = leaf(tg, [1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tg.autograd.grad((x * x).sum(), x, only_inputs=True)


def test_grad_variables_warns_future_warning(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        M.autograd.backward(x * x, grad_variables=M.tensor([1.0, 0.5]))
        return x.grad
    rt, wt = outcome(run, tg)
    rp, wp = outcome(run, torch)
    assert FutureWarning in wt and FutureWarning in wp
    assert_same(rt, rp)


def test_grad_variables_and_grad_tensors_together_raise(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        g = M.tensor([1.0, 0.5])
        M.autograd.backward(x * x, grad_tensors=g, grad_variables=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        both_raise(torch, run, RuntimeError)


# --- backward(inputs=...) ------------------------------------------------------------------


def test_backward_inputs_leaf_subset(torch):
    def run(M):
        a = leaf(M, [1.0, 2.0])
        b = leaf(M, [3.0, -1.0])
        y = (a * b + M.sin(a)).sum()
        M.autograd.backward(y, inputs=[b])
        return a.grad, b.grad
    rt, rp = run(tg), run(torch)
    assert rt[0] is None
    assert_all_same(rt, rp)


def test_backward_inputs_single_tensor(torch):
    def run(M):
        a = leaf(M, [1.0, 2.0])
        b = leaf(M, [3.0, -1.0])
        M.autograd.backward((a * b).sum(), inputs=a)
        return a.grad, b.grad
    assert_all_same(run(tg), run(torch))


def test_tensor_backward_inputs(torch):
    def run(M):
        a = leaf(M, [1.0, 2.0])
        b = leaf(M, [3.0, -1.0])
        (a * b).sum().backward(inputs=[a])
        return a.grad, b.grad
    assert_all_same(run(tg), run(torch))


def test_backward_inputs_non_leaf_fills_its_grad(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        h = M.exp(x)
        y = (h * h).sum()
        M.autograd.backward(y, inputs=[h])
        with warnings.catch_warnings():
            # torch: a populated non-leaf .grad is read without a warning
            warnings.simplefilter("error")
            hg = h.grad
        return hg, x.grad
    rt, rp = run(tg), run(torch)
    assert rp[0] is not None and rp[1] is None
    assert_all_same(rt, rp)


def test_backward_inputs_non_leaf_value(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        h = M.exp(x)
        y = (h * h).sum()
        M.autograd.backward(y, inputs=[h, x])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return h.grad, x.grad
    assert_all_same(run(tg), run(torch))


def test_backward_inputs_scalar_non_leaf(torch):
    def run(M):
        x = leaf(M, 0.5)
        h = M.sin(x)
        y = h * h * 3.0
        y.backward(inputs=[h, x])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return h.grad, x.grad
    assert_all_same(run(tg), run(torch))


@pytest.mark.parametrize("call", ["function", "method"])
def test_backward_empty_inputs_raises(torch, call):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        y = (x * x).sum()
        if call == "function":
            M.autograd.backward(y, inputs=[])
        else:
            y.backward(inputs=[])
    both_raise(torch, run, RuntimeError)


def test_backward_unused_inputs_leave_grad_none(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        u = leaf(M, [1.0, 2.0])
        M.autograd.backward((x * 2.0).sum(), inputs=[x, u])
        return x.grad, u.grad
    assert_all_same(run(tg), run(torch))


def test_backward_inputs_not_requiring_grad_raise(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        c = M.ones(2, dtype=M.float64)
        M.autograd.backward((x * c).sum(), inputs=[c])
    both_raise(torch, run, RuntimeError)


# --- accumulation into .grad ----------------------------------------------------------------


def test_grad_accumulates_across_backward_calls(torch):
    def run(M):
        x = leaf(M, [0.5, -1.0])
        s = leaf(M, 0.25)
        out = []
        for k in range(3):
            y = (M.sin(x) * s * float(k + 1)).sum()
            M.autograd.backward(y)
            out += [x.grad.clone(), s.grad.clone()]
        return out
    assert_all_same(run(tg), run(torch))


def test_grad_accumulation_in_place_keeps_the_grad_object(torch):
    def run(M):
        x = leaf(M, [0.5, -1.0])
        (x * x).sum().backward()
        g = x.grad
        (x * x).sum().backward()
        return x.grad is g, g
    (st, gt), (sp, gp) = run(tg), run(torch)
    assert st == sp
    assert_same(gt, gp)


def test_grad_set_to_none_restarts_accumulation(torch):
    def run(M):
        x = leaf(M, [0.5, -1.0])
        (x * x).sum().backward()
        x.grad = None
        (x * 3.0).sum().backward()
        return x.grad
    assert_same(run(tg), run(torch))


def test_grad_assigned_by_user_is_accumulated_into(torch):
    def run(M):
        x = leaf(M, [0.5, -1.0])
        x.grad = M.tensor([10.0, 20.0], dtype=M.float64)
        (x * x).sum().backward()
        return x.grad
    assert_same(run(tg), run(torch))


def test_zeroing_grad_in_place_between_steps(torch):
    def run(M):
        x = leaf(M, [0.5, -1.0])
        s = leaf(M, 2.0)
        out = []
        for k in range(3):
            (M.sin(x) * s * float(k + 1)).sum().backward()
            out += [x.grad.clone(), s.grad.clone()]
            x.grad.zero_()
            s.grad.zero_()
        out += [x.grad, s.grad]
        return out
    assert_all_same(run(tg), run(torch))


def test_grad_does_not_accumulate_with_autograd_grad(torch):
    def run(M):
        x = leaf(M, [0.5, -1.0])
        M.autograd.grad((x * x).sum(), x)
        return x.grad
    assert run(tg) is None and run(torch) is None


def test_grad_dtype_matches_leaf_float32(torch):
    def run(M):
        x = leaf(M, [0.5, -1.0], dtype=M.float32)
        (x * x + M.exp(x)).sum().backward()
        return x.grad
    rt, rp = run(tg), run(torch)
    assert dtype_name(rt) == "float32"
    np.testing.assert_allclose(arr(rt), arr(rp), rtol=1e-6)


# --- retain_grad and .grad of non-leaves ---------------------------------------------------


def test_retain_grad_on_non_leaf(torch):
    def run(M):
        x = leaf(M, [0.5, -1.0, 2.0])
        h = M.exp(x) * x
        h.retain_grad()
        y = (h * h).sum()
        y.backward()
        return h.retains_grad, h.grad, x.grad
    rt, rp = run(tg), run(torch)
    assert rt[0] is True and rp[0] is True
    assert_all_same(rt[1:], rp[1:])


def test_retain_grad_on_scalar_non_leaf_accumulates(torch):
    def run(M):
        x = leaf(M, 0.5)
        h = M.sin(x)
        h.retain_grad()
        y = h * h
        y.backward(retain_graph=True)
        first = h.grad.clone()
        y.backward()
        return first, h.grad, x.grad
    assert_all_same(run(tg), run(torch))


def test_retain_grad_is_filled_by_backward_with_other_inputs(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        h = M.exp(x)
        h.retain_grad()
        M.autograd.backward((h * h).sum(), inputs=[x])
        return h.grad, x.grad
    rt, rp = run(tg), run(torch)
    assert rp[0] is not None
    assert_all_same(rt, rp)


def test_retain_grad_is_filled_by_autograd_grad(torch):
    # torch's retain_grad is a hook on the tensor: it fires whenever a backward pass
    # computes that tensor's gradient, autograd.grad included
    def run(M):
        x = leaf(M, [1.0, 2.0])
        h = M.exp(x)
        h.retain_grad()
        (g,) = M.autograd.grad((h * h).sum(), x)
        return h.grad, g, x.grad
    rt, rp = run(tg), run(torch)
    assert rp[0] is not None and rp[2] is None
    assert_all_same(rt, rp)


def test_retain_grad_on_leaf_is_a_no_op(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        x.retain_grad()
        (x * x).sum().backward()
        return x.retains_grad, x.grad
    (rt, gt), (rp, gp) = run(tg), run(torch)
    assert rt == rp
    assert_same(gt, gp)


def test_retain_grad_without_requires_grad_raises(torch):
    def run(M):
        M.ones(2).retain_grad()
    both_raise(torch, run, RuntimeError)


def test_non_leaf_grad_warns_and_is_none(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        h = x * 2.0
        (h * h).sum().backward()
        return h.grad
    rt, wt = outcome(run, tg)
    rp, wp = outcome(run, torch)
    assert rt is None and rp is None
    assert UserWarning in wt and UserWarning in wp


def test_leaf_grad_read_does_not_warn():
    x = leaf(tg, [1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert x.grad is None
        (x * x).sum().backward()
        assert x.grad is not None


# --- shapes of calls: self, multiple, repeated, non-leaf inputs -----------------------------


@pytest.mark.parametrize("data", [2.0, [1.0, 2.0]])
def test_grad_of_a_leaf_with_respect_to_itself(torch, data):
    def run(M):
        x = leaf(M, data)
        go = None if isinstance(data, float) else M.tensor([3.0, 4.0])
        return M.autograd.grad(x, x, grad_outputs=go)
    assert_all_same(run(tg), run(torch))


def test_backward_on_a_leaf(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        x.backward(M.tensor([3.0, 4.0]))
        s = leaf(M, 5.0)
        s.backward()
        return x.grad, s.grad
    assert_all_same(run(tg), run(torch))


def test_backward_on_a_leaf_not_requiring_grad_raises(torch):
    def run(M):
        M.ones(2, dtype=M.float64).backward(M.ones(2, dtype=M.float64))
    both_raise(torch, run, RuntimeError)


def test_multiple_outputs_and_inputs(torch):
    rng = np.random.default_rng(1)
    av, bv = rng.standard_normal(3), rng.standard_normal((3, 2))

    def run(M):
        a = leaf(M, av)
        b = leaf(M, bv)
        s = leaf(M, 0.3)
        y1 = (a @ b).sum() * s
        y2 = M.tanh(b).sum(0) + a[:2] * s
        y3 = s * s
        return M.autograd.grad([y1, y2, y3], [a, b, s],
                               grad_outputs=[None, M.tensor([1.0, -2.0]), None])
    assert_all_same(run(tg), run(torch))


def test_multiple_outputs_backward(torch):
    def run(M):
        a = leaf(M, [0.2, 0.4])
        M.autograd.backward([M.exp(a).sum(), a * 3.0], [None, M.tensor([1.0, 2.0])])
        return a.grad
    assert_same(run(tg), run(torch))


def test_same_input_twice(torch):
    def run(M):
        x = leaf(M, [0.2, 0.4])
        s = leaf(M, 0.7)
        y = (M.sin(x) * s).sum() * s
        return M.autograd.grad(y, [x, s, x, s])
    assert_all_same(run(tg), run(torch))


def test_same_output_twice(torch):
    def run(M):
        x = leaf(M, [0.2, 0.4])
        y = (M.sin(x) * x).sum()
        return M.autograd.grad([y, y], x)
    assert_all_same(run(tg), run(torch))


def test_same_output_twice_backward(torch):
    def run(M):
        x = leaf(M, 0.3)
        y = M.exp(x) * x
        M.autograd.backward([y, y])
        return x.grad
    assert_same(run(tg), run(torch))


@pytest.mark.parametrize("scalar", [True, False])
def test_non_leaf_input_stops_the_gradient(torch, scalar):
    def run(M):
        x = leaf(M, 0.4 if scalar else [0.4, 0.9])
        h = M.exp(x) * 2.0
        y = (M.sin(h) * h).sum()
        return M.autograd.grad(y, h)
    assert_all_same(run(tg), run(torch))


@pytest.mark.parametrize("scalar", [True, False])
def test_inputs_where_one_is_upstream_of_the_other(torch, scalar):
    def run(M):
        x = leaf(M, 0.4 if scalar else [0.4, 0.9])
        h = M.exp(x) * x
        z = (M.sin(h) * x + h * h).sum()
        return (M.autograd.grad(z, [x, h], retain_graph=True),
                M.autograd.grad(z, [h, x]))
    (a1, a2), (b1, b2) = run(tg), run(torch)
    assert_all_same(a1, b1)
    assert_all_same(a2, b2)


def test_grad_of_non_leaf_with_respect_to_itself(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        h = x * 3.0
        return M.autograd.grad(h, h, grad_outputs=M.tensor([1.0, 2.0]))
    assert_all_same(run(tg), run(torch))


def test_grad_results_are_plain_tensors():
    x = leaf(tg, [0.4, 0.9])
    (g,) = tg.autograd.grad((x * x).sum(), x)
    assert isinstance(g, tg.Tensor)
    assert not g.requires_grad and g.is_leaf and g.grad_fn is None
    s = leaf(tg, 0.5)
    res = tg.autograd.grad(s * s, [s])
    assert isinstance(res, tuple) and len(res) == 1


def test_outputs_recorded_after_a_retained_backward(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        h = M.exp(x)
        M.autograd.backward(h.sum(), retain_graph=True)
        y = (h * x).sum()                                 # recorded after a backward
        return M.autograd.grad([y, h.sum()], x), x.grad
    (gt, xt), (gp, xp) = run(tg), run(torch)
    assert_all_same(gt, gp)
    assert_same(xt, xp)


def test_backward_inputs_listed_twice_accumulate_once(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        h = M.exp(x)
        y = (h * x).sum()
        M.autograd.backward(y, inputs=[x, x, h, h])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return x.grad, h.grad
    assert_all_same(run(tg), run(torch))


def test_leaf_output_among_graph_outputs(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        y = (x * x).sum()
        r1 = M.autograd.grad([x, y], x, grad_outputs=[M.ones(2, dtype=M.float64), None],
                             retain_graph=True)
        M.autograd.backward([y, x], [None, M.tensor([0.5, 0.25], dtype=M.float64)])
        return r1 + (x.grad,)
    assert_all_same(run(tg), run(torch))


def test_input_downstream_of_the_output_is_unused(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        y = (x * x).sum()
        h = y * 2.0
        return M.autograd.grad(y, [x, h], allow_unused=True)
    assert_all_same(run(tg), run(torch))


def test_graph_is_freed_when_the_unused_input_error_is_raised(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        u = leaf(M, [1.0])
        y = (x * x).sum()
        with pytest.raises(RuntimeError):
            M.autograd.grad(y, [x, u])
        M.autograd.grad(y, x)
    both_raise(torch, run, RuntimeError)


def test_detach_stops_the_gradient(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        h = M.exp(x)
        d = h.detach()
        k = M.sin(x)
        k.detach_()
        y = (h * d + x * k + x * x.detach()).sum()
        return M.autograd.grad(y, x) + (d.requires_grad, k.requires_grad, k.is_leaf)
    rt, rp = run(tg), run(torch)
    assert_same(rt[0], rp[0])
    assert rt[1:] == rp[1:] == (False, False, True)


@pytest.mark.parametrize("scalar", [True, False])
def test_mixed_float32_and_float64_leaves(torch, scalar):
    def run(M):
        a = M.tensor(2.0 if scalar else [2.0, 3.0], dtype=M.float32, requires_grad=True)
        b = leaf(M, [1.0, -2.0] if scalar else 0.5)
        y = (M.exp(a * b) * b).sum()
        return M.autograd.grad(y, [a, b])
    rt, rp = run(tg), run(torch)
    for a, b in zip(rt, rp):
        assert dtype_name(a) == dtype_name(b)
        assert tuple(a.shape) == tuple(b.shape)
        np.testing.assert_allclose(arr(a), arr(b), rtol=1e-6)


def test_graph_spanning_two_tapes_with_a_scalar_operand(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        s = leaf(M, 3.0)
        h = x + 2.0                   # add saves nothing: still usable after backward
        M.autograd.backward(h.sum())  # frees and ends the current tape
        y = (h * s).sum()             # array op with a 0-d operand, on a new tape
        return M.autograd.grad(y, [x, s])
    assert_all_same(run(tg), run(torch))


# --- bad calls ------------------------------------------------------------------------------


def test_output_not_requiring_grad_raises(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        M.autograd.grad(M.ones(2, dtype=M.float64).sum(), x)
    err = both_raise(torch, run, RuntimeError)
    assert "does not require grad" in str(err)


def test_output_not_requiring_grad_raises_even_with_none_grad_output(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        M.autograd.grad([(x * x).sum(), M.tensor(1.0)], x, grad_outputs=[None, None])
    both_raise(torch, run, RuntimeError)


def test_output_made_under_no_grad_raises(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        with M.no_grad():
            y = (x * x).sum()
        y.backward()
    both_raise(torch, run, RuntimeError)


def test_input_not_requiring_grad_raises(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        c = M.tensor([1.0, 2.0])
        M.autograd.grad((x * c).sum(), [x, c])
    err = both_raise(torch, run, RuntimeError)
    assert "does not require grad" in str(err)


def test_empty_inputs_to_grad_raise(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        M.autograd.grad((x * x).sum(), [])
    both_raise(torch, run, RuntimeError)


NON_TENSOR_CALLS = {
    "grad_outputs_arg": lambda x, y: tg.autograd.grad(1.0, x),
    "grad_inputs_arg": lambda x, y: tg.autograd.grad(y, 1.0),
    "grad_inputs_list": lambda x, y: tg.autograd.grad(y, [x, 1.0]),
    "grad_outputs_list": lambda x, y: tg.autograd.grad([y, 1.0], x),
    "grad_grad_outputs": lambda x, y: tg.autograd.grad(y, x, grad_outputs=1.0),
    "grad_grad_outputs_list": lambda x, y: tg.autograd.grad(y, x, grad_outputs=[1.0]),
    "grad_numpy_input": lambda x, y: tg.autograd.grad(y, np.ones(2)),
    "backward_tensors": lambda x, y: tg.autograd.backward(1.0),
    "backward_tensors_list": lambda x, y: tg.autograd.backward([y, 2.0]),
    "backward_grad_tensors": lambda x, y: tg.autograd.backward(y, grad_tensors=[1.0]),
    "backward_inputs": lambda x, y: tg.autograd.backward(y, inputs=1.0),
    "backward_inputs_list": lambda x, y: tg.autograd.backward(y, inputs=[x, "x"]),
    "method_gradient": lambda x, y: y.backward(gradient=[1.0]),
}


@pytest.mark.parametrize("name", sorted(NON_TENSOR_CALLS))
def test_non_tensor_arguments_raise_type_error(name):
    x = leaf(tg, [0.4, 0.9])
    y = (x * x).sum()
    with pytest.raises(TypeError):
        NON_TENSOR_CALLS[name](x, y)
    # the rejected call left the graph intact
    assert_close_list(tg.autograd.grad(y, x), [np.array([0.8, 1.8])])


@pytest.mark.parametrize("call", ["grad", "backward", "method"])
def test_create_graph_records_a_differentiable_gradient(call, torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        y = (x * x * x).sum()
        if call == "grad":
            (g,) = M.autograd.grad(y, x, create_graph=True)
        elif call == "backward":
            M.autograd.backward(y, create_graph=True)
            g = x.grad
        else:
            y.backward(create_graph=True)
            g = x.grad
        assert g.requires_grad and g.grad_fn is not None
        return M.autograd.grad(g.sum(), x)
    assert_all_same(run(tg), run(torch))


def test_is_grads_batched_with_create_graph_is_recorded():
    x = leaf(tg, [0.4, 0.9])
    y = x * x
    J, = tg.autograd.grad(y, x, tg.eye(2), is_grads_batched=True, create_graph=True)
    assert J.requires_grad
    assert_close_list([J], [np.diag([0.8, 1.8])])
    assert_close_list(tg.autograd.grad(J.sum(), x), [np.array([2.0, 2.0])])


def test_is_grads_batched_gives_one_row_per_grad_output(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        return M.autograd.grad(x * x, x, grad_outputs=M.eye(2, dtype=M.float64),
                               is_grads_batched=True)
    assert_all_same(run(tg), run(torch))


# --- in-place modification of saved values ---------------------------------------------------


def test_inplace_change_of_a_saved_constant_raises(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        w = M.tensor([1.0, 2.0])
        y = (x * w).sum()
        w += 1.0
        y.backward()
    err = both_raise(torch, run, RuntimeError)
    assert "inplace" in str(err).replace("in-place", "inplace")


def test_inplace_change_through_a_view_raises(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        w = M.tensor([1.0, 2.0, 3.0])
        v = w[:2]
        y = (x * v).sum()
        w[0] = 10.0
        y.backward()
    both_raise(torch, run, RuntimeError)


def test_inplace_change_of_a_saved_output_raises(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        h = M.exp(x)           # exp saves its output
        y = (h * 2.0).sum()
        h.mul_(2.0)
        y.backward()
    both_raise(torch, run, RuntimeError)


def test_inplace_change_of_a_saved_scalar_raises(torch):
    def run(M):
        x = leaf(M, 0.4)
        w = M.tensor(3.0, dtype=M.float64)
        y = x * w
        w += 1.0
        y.backward()
    both_raise(torch, run, RuntimeError)


def test_inplace_change_of_a_saved_leaf_under_no_grad_raises(torch):
    def run(M):
        x = leaf(M, [1.0, 2.0])
        y = (x * x).sum()
        with M.no_grad():
            x += 1.0
        y.backward()
    both_raise(torch, run, RuntimeError)


def test_inplace_change_of_a_saved_scalar_leaf_under_no_grad_raises(torch):
    def run(M):
        x = leaf(M, 1.5)
        y = x * x
        with M.no_grad():
            x += 1.0
        y.backward()
    both_raise(torch, run, RuntimeError)


def test_inplace_change_of_an_unsaved_value_is_fine(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        w = M.tensor([1.0, 2.0])
        y = (x + w).sum()     # add saves nothing
        w += 1.0
        y.backward()
        return x.grad
    assert_same(run(tg), run(torch))


def test_inplace_change_after_backward_is_fine(torch):
    def run(M):
        x = leaf(M, [0.4, 0.9])
        w = M.tensor([1.0, 2.0])
        (x * w).sum().backward()
        w += 1.0
        with M.no_grad():
            x -= 0.1 * x.grad
        (x * w).sum().backward()
        return x.grad, x
    assert_all_same(run(tg), run(torch))


# --- failed calls leave the tape as it was ---------------------------------------------------


def _bad_calls():
    x = leaf(tg, np.ones((2, 3)))
    s = leaf(tg, 1.5)
    h = x * 2.0  # a non-leaf
    h0 = h[:1]
    x0 = x[0]
    return {
        "broadcast": lambda: x + leaf(tg, np.ones(4)),
        "broadcast_scalar_lhs": lambda: s + leaf(tg, np.ones(4)) @ x,
        "matmul_shapes": lambda: x @ leaf(tg, np.ones((2, 3))),
        "matmul_0d": lambda: tg.matmul(s, x),
        "reshape": lambda: x.reshape(4, 2),
        "stack_shapes": lambda: tg.stack([x, leaf(tg, np.ones(3))]),
        "cat_shapes": lambda: tg.cat([x, leaf(tg, np.ones((2, 2)))], 0),
        "getitem_range": lambda: x[5],
        "getitem_float": lambda: x[1.0],
        "getitem_0d": lambda: s[0],
        "sum_dim": lambda: x.sum(3),
        "softmax_dim": lambda: tg.softmax(x, 2),
        "where_cond": lambda: tg.where(tg.ones(2, 3), x, h),
        "setitem_shape": lambda: h.__setitem__(0, leaf(tg, np.ones(2))),
        "iadd_broadcast_nonleaf": lambda: h0.__iadd__(leaf(tg, np.ones((2, 3)))),
        "iadd_leaf": lambda: x.__iadd__(1.0),
        "imul_leaf_scalar": lambda: s.__imul__(2.0),
        "setitem_leaf": lambda: x.__setitem__(0, 1.0),
        "unary_type": lambda: tg.exp([1.0]),
        "binary_type": lambda: x + "a",
        "requires_grad_int": lambda: tg.tensor([1, 2]).requires_grad_(),
        "clamp_none": lambda: tg.clamp(x),
        "dot_shapes": lambda: tg.dot(x0, leaf(tg, np.ones(2))),
        "transpose_dim": lambda: x.transpose(0, 2),
        "clamp_tensor_min_bad_max": lambda: tg.clamp(x, min=tg.tensor(0.5), max="a"),
        "sum_dtype_bad_dim": lambda: x.sum(dim=5, dtype=tg.float32),
        "mean_dtype_bad_dim": lambda: x.mean(dim=7, dtype=tg.float32),
        "prod_dtype_tuple_dim": lambda: x.prod(dim=(0, 1), dtype=tg.float32),
        "softmax_dtype_no_dim": lambda: tg.softmax(x, dtype=tg.float32),
        "log_softmax_dtype_bad_dim": lambda: tg.log_softmax(x, 4, dtype=tg.float32),
        "stack_non_tensor": lambda: tg.stack([x, 1.0]),
        "where_bad_other": lambda: tg.where(x > 0, x, "a"),
        "sum_repeated_dims": lambda: x.sum(dim=(0, 0)),
        "expand_bad": lambda: x.expand(3, 3),
        "matmul_dtypes": lambda: x @ tg.tensor(np.ones((3, 2)), dtype=tg.float32),
        "setitem_cast_bad_index": lambda: h.__setitem__(
            5, tg.tensor(1.0, dtype=tg.float32, requires_grad=True)),
    }


@pytest.mark.parametrize("name", sorted(_bad_calls()))
def test_failed_op_leaves_the_tape_unchanged(name):
    call = _bad_calls()[name]
    # make sure the tape exists and holds something before the call
    warm = leaf(tg, 1.0) * 2.0
    before = tape_len()
    with pytest.raises((RuntimeError, TypeError, IndexError, ValueError)):
        call()
    assert tape_len() == before, f"{name} left entries on the tape"
    del warm


def test_inplace_change_of_the_base_of_a_saved_view_raises(torch):
    # x[1:] is a view; mul saves it for w's gradient; changing x in place changes the view
    def run(M):
        x = M.tensor([0.0, 1.0, 2.0, 3.0], dtype=M.float64, requires_grad=True)
        w = M.ones(3, dtype=M.float64, requires_grad=True)
        y = (x[1:] * w).sum()
        with M.no_grad():
            x -= 1.0
        y.backward()
    both_raise(torch, run, RuntimeError)


def test_view_of_an_unchanged_base_gives_torch_gradients(torch):
    def run(M):
        x = M.tensor([0.0, 1.0, 2.0, 3.0], dtype=M.float64, requires_grad=True)
        w = M.tensor([1.0, -2.0, 0.5], dtype=M.float64, requires_grad=True)
        y = (x[1:] * w * x[:-1]).sum()
        return M.autograd.grad(y, [x, w])
    assert_all_same(run(tg), run(torch))


def test_gradient_edges_stand_for_tensors_in_grad(torch):
    def run(M):
        x = leaf(M, [1.0, -2.0])
        y = x * 2.0
        z = (y * y * x).sum()
        ey = M.autograd.graph.get_gradient_edge(y)
        ex = M.autograd.graph.get_gradient_edge(x)
        assert ey.output_nr == 0 and ex.output_nr == 0
        return M.autograd.grad(z, [ex, ey])
    assert_all_same(run(tg), run(torch))


def test_gradient_edge_outlives_its_tensor_and_rejects_constants(torch):
    x = leaf(tg, [1.0, -2.0])
    y = x * 3.0
    z = (y * y).sum()
    edge = tg.autograd.graph.get_gradient_edge(y)
    del y
    assert_close_list(tg.autograd.grad(z, edge), [np.array([6.0, -12.0])])
    for M in (tg, torch):
        with pytest.raises(RuntimeError):
            M.autograd.graph.get_gradient_edge(M.ones(2))


# --- the one-call scalar path -------------------------------------------------------------
# grad(loss, leaves) with default options on a tape of scalar entries runs mark and sweep in
# one compiled call (_fast_paths.SCALAR.applies). Everything it does not cover falls back to the
# general path; these tests pin both sides of each condition against torch.


def _scalar_program(M, xs):
    a = M.sin(xs[0]) * xs[1] + xs[2] ** 2
    b = M.exp(-a) / (1.0 + xs[1] * xs[1])
    return (a * b - M.tanh(xs[0] - xs[2])).clamp(-1.0, 1.0) + 3.0 * xs[1]


def test_one_call_path_equals_the_general_path_and_torch(torch, monkeypatch):
    from tapegrad.autograd import _fast_paths

    def run(M):
        xs = [leaf(M, v) for v in (0.3, -0.8, 1.1)]
        return M.autograd.grad(_scalar_program(M, xs), xs)
    fast = run(tg)
    calls = []
    real = _fast_paths.SCALAR.applies
    monkeypatch.setattr(_fast_paths.SCALAR, "applies", lambda *a: calls.append(a) or None)
    general = run(tg)
    assert calls  # the spy replaced the one-call path, so `general` came from the other one
    monkeypatch.setattr(_fast_paths.SCALAR, "applies", real)
    want = run(torch)
    assert_all_same(fast, want)
    assert_all_same(general, want)


def test_one_call_path_frees_the_graph_and_retain_graph_keeps_it(torch):
    for M in (tg, torch):
        x = leaf(M, 0.4)
        y = M.sin(x) * x
        (g1,) = M.autograd.grad(y, x, retain_graph=True)
        (g2,) = M.autograd.grad(y, x)
        assert g1.item() == g2.item()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            M.autograd.grad(y, x)


def test_one_call_path_leaves_unused_inputs_to_the_general_path(torch):
    for M in (tg, torch):
        x, u = leaf(M, 0.4), leaf(M, 0.9)
        y = M.cos(x) * 2.0
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            M.autograd.grad(y, [x, u])
        y = M.cos(x) * 2.0
        gx, gu = M.autograd.grad(y, [x, u], allow_unused=True)
        assert gu is None and abs(gx.item() + 2.0 * np.sin(0.4)) < 1e-15


def test_one_call_path_sums_a_leaf_entered_twice(torch):
    # a leaf changed in place under no_grad is entered again: both slots hold its gradient
    def run(M):
        x = leaf(M, 0.5)
        y = x * 3.0
        with M.no_grad():
            x.mul_(2.0)
        z = y + x * x  # torch: y's graph used the old x, x * x the new one
        if M is tg:
            tape = z._tape
            assert tape.reentered and len(tape.leaf_slots(x)) == 2
            assert [ks for _, ks in tape.leaf_items()] == [tape.leaf_slots(x)]
        return M.autograd.grad(z, x)
    assert_all_same(run(tg), run(torch))


def test_one_call_path_through_an_array_entry_with_a_scalar_value(torch):
    def run(M):
        x = leaf(M, 0.5)
        return M.autograd.grad((x * x).reshape(()).reshape(()) * 2.0, x)
    assert_all_same(run(tg), run(torch))


def test_one_call_path_checks_versions_like_torch(torch):
    for M in (tg, torch):
        x = leaf(M, 0.5)
        c = M.tensor(2.0, dtype=M.float64)
        y = M.exp(x) * c
        c.add_(1.0)  # c was saved by mul: torch raises at backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            M.autograd.grad(y, x)


def test_one_call_path_with_a_non_leaf_input_and_a_leaf_output(torch):
    def run(M):
        x = leaf(M, 0.5)
        h = M.sin(x)
        y = h * h + x
        return M.autograd.grad(y, [h, x]) + M.autograd.grad(x, x)
    assert_all_same(run(tg), run(torch))


def test_in_place_adjoint_accumulation_never_writes_a_shared_gradient(torch):
    # add hands the same gradient array to both inputs; slices of one base accumulate into
    # its adjoint in place; a rule's gradient seen by two entries must stay unchanged
    def run(M):
        x = leaf(M, np.linspace(-1.0, 1.0, 7))
        w = leaf(M, np.linspace(0.5, 2.0, 6))
        a = x[1:] + w            # add: g flows to x[1:] and to w unchanged
        b = a + a                # the same tensor twice: its adjoint is summed
        c = b * x[:-1] + w * w   # w gets add's gradient, then mul's on top
        y = (c ** 2).sum() + x[2:5].sum() + x[::2].sum()
        return M.autograd.grad(y, [x, w])
    assert_all_same(run(tg), run(torch))


def test_one_call_path_across_a_tape_rollover(torch, monkeypatch):
    # tapes roll over every 128 entries: the loss imports partial sums from earlier tapes,
    # and a later iteration on a tape with an import entry off its path runs in one call
    from conftest import set_rollover
    from tapegrad.autograd import _fast_paths
    set_rollover(monkeypatch, 128)
    taken = []
    real = _fast_paths.SCALAR.applies
    monkeypatch.setattr(_fast_paths.SCALAR, "applies",
                        lambda *a: taken.append(real(*a)) or taken[-1])

    def run(M, steps):
        xs = [leaf(M, v) for v in np.linspace(-0.9, 0.8, 6)]
        out, losses = [], []  # the kept losses keep recording on one tape until it is full
        for _ in range(steps):
            f = 0.0
            for i in range(5):
                f = f + 100 * (xs[i + 1] - xs[i] ** 2) ** 2 + (1 - xs[i]) ** 2
            losses.append(f)
            out.append(M.autograd.grad(f, xs, retain_graph=True))
        return [g for gs in out for g in gs]
    assert_all_same(run(tg, 8), run(torch, 8))
    assert any(r is None for r in taken)      # a path through an import: the general path
    assert any(r is not None for r in taken)  # imports off the path: one call


# --- the flat sweep: scalar and small-array entries in one compiled call -------------------

def _flat_spy(monkeypatch):
    from tapegrad.autograd import _fast_paths
    real, done = _fast_paths.FLAT.applies, []
    monkeypatch.setattr(_fast_paths.FLAT, "applies", lambda *a: done.append(real(*a)) or done[-1])
    return done


FLAT_PROGRAMS = {
    # elementwise unary and binary ops, constants, 1-d slices, full sum
    "rosenbrock": lambda M, x, s: (100 * (x[1:] - x[:-1] ** 2) ** 2 + (s - x[:-1]) ** 2).sum(),
    # a 0-d leaf and a one-element array broadcast: their gradients are sums
    "broadcast": lambda M, x, s: (M.sin(x) * s + x[:1] * M.exp(x)).mean() + s * s,
    # steps, negative starts, integer indices, views of views
    "slices": lambda M, x, s: ((x[1::2] * x[-3::1][:3].cos()).sum() + x[3] * x[-1] * s
                               + x[2:][1::3].sum()),
    # every kind of rule: where-style (relu, clamp, maximum), division, pow, atan2
    "rules": lambda M, x, s: (M.relu(x) + M.clamp(x, -0.5, 0.5) * M.maximum(x, s)
                              + x / (2.0 + x * x) + M.atan2(x, s + 2.0)
                              + M.pow(M.abs(x) + 1.0, s)).sum(),
    # the same leaf as both inputs, scalars mixed in
    "aliasing": lambda M, x, s: (x * x).sum() * s + (x - x * s).mean(),
}


@pytest.mark.parametrize("name", sorted(FLAT_PROGRAMS))
def test_flat_path_equals_the_general_path_and_torch(name, torch, monkeypatch):
    from tapegrad.autograd import _fast_paths
    x0 = np.random.default_rng(len(name)).uniform(-1.2, 1.2, 7)

    def run(M):
        x, s = leaf(M, x0), leaf(M, 0.7)
        return M.autograd.grad(FLAT_PROGRAMS[name](M, x, s), [x, s])
    done = _flat_spy(monkeypatch)
    fast = run(tg)
    assert done and done[-1] is not None  # the flat sweep computed these
    monkeypatch.setattr(_fast_paths.FLAT, "applies", lambda *a: None)
    general = run(tg)
    want = run(torch)
    for got in (fast, general):
        for g, w in zip(got, want):
            np.testing.assert_allclose(arr(g), arr(w), rtol=1e-13, atol=1e-15)
            assert dtype_name(g) == dtype_name(w) and tuple(g.shape) == tuple(w.shape)


FLAT_DECLINED = {
    "outer broadcast": lambda M, x: (x.reshape(7, 1) * x.reshape(1, 7)).sum(),
    "sum over a dim": lambda M, x: x.reshape(7, 1).sum(0).sum(),
    "2-d index": lambda M, x: x.reshape(7, 1)[2:, 0].sum(),
    "fancy index": lambda M, x: x[[0, 2, 2]].sum(),
    "matmul": lambda M, x: x @ x,
    "float32": lambda M, x: (x.to(M.float32) ** 2).sum().to(M.float64),
}


@pytest.mark.parametrize("name", sorted(FLAT_DECLINED))
def test_flat_path_leaves_other_array_ops_to_the_general_path(name, torch, monkeypatch):
    x0 = np.linspace(-1.0, 1.3, 7)

    def run(M):
        x = leaf(M, x0)
        return M.autograd.grad(FLAT_DECLINED[name](M, x), x)
    done = _flat_spy(monkeypatch)
    got = run(tg)
    assert done == [None]  # declined before computing anything: the general path ran
    np.testing.assert_allclose(arr(got[0]), arr(run(torch)[0]), rtol=1e-6)


def test_flat_path_declines_large_arrays_and_frees_like_torch(torch, monkeypatch):
    from tapegrad.autograd import _fast_paths as _engine
    from tapegrad.interpreters import cpu
    monkeypatch.setattr(_engine.FUSED, "applies", lambda *a: None)  # tests/test_fused.py
    done = _flat_spy(monkeypatch)
    x = leaf(tg, np.linspace(-1.0, 1.0, cpu.FLAT_MAX // 2 + 1))
    (g,) = tg.autograd.grad((x * x).sum() + x.sum(), x)  # two arrays: past FLAT_MAX
    assert done == [None]
    np.testing.assert_allclose(arr(g), 2 * arr(x) + 1.0)
    for M in (tg, torch):
        x = leaf(M, [0.5, -1.0, 2.0])
        y = (M.sin(x) * x).sum()
        (g1,) = M.autograd.grad(y, x, retain_graph=True)
        (g2,) = M.autograd.grad(y, x)
        np.testing.assert_array_equal(arr(g1), arr(g2))
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            M.autograd.grad(y, x)
    assert done[1:3] != [None, None] and done[1] is not None
