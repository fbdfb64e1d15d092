"""A backward without retain_graph releases what no later backward can use, on every path
(scalar, flat, fused, general), even while the output lives on (``losses.append(loss)``):
only what a backward through an unfreed part of the tape could need stays."""
import gc
import tracemalloc
import weakref

import numpy as np
import pytest

import tapegrad as tg
import tapegrad.tape as tape_mod
from tapegrad.autograd import _fast_paths
from tapegrad.interpreters import _generated_cpu, cpu, fused

pytestmark = pytest.mark.usefixtures("frozen_heap")  # cheap gc.collect() calls

#: bytes a kept step may hold after its backward: its tape's entries, not its arrays
#: (about 2.7 KB here; the three saved 1000-element float64 arrays alone are 24 KB)
PER_STEP = 4096
N_SMALL = 1000                 # the flat path's size
N_LARGE = cpu.FLAT_MAX + 1001  # past the flat buffers' limit: the fused path's size


@pytest.fixture(autouse=True)
def _fresh_tape():
    t = tape_mod.STATE.tape()
    if t:
        tape_mod.end_tape(t)
    del t
    gc.collect()


@pytest.fixture
def paths(monkeypatch, tmp_path_factory):
    """Which backward path ran: counts of the flat sweep, the fused loops, the general
    sweep and the one-call scalar sweep (fused kernels compile on first sight here)."""
    d = str(tmp_path_factory.mktemp("fused"))
    monkeypatch.setattr(fused, "COMPILE_AFTER", 1)
    monkeypatch.setattr(fused, "_dir", d)
    monkeypatch.syspath_prepend(d)
    seen = {"flat": 0, "fused": 0, "general": 0, "scalar": 0}

    def spy(mod, name, key, ok=lambda r: True):
        real = getattr(mod, name)

        def f(*a, **k):
            r = real(*a, **k)
            if ok(r):
                seen[key] += 1
            return r
        monkeypatch.setattr(mod, name, f)
    spy(_generated_cpu, "sweep_flat", "flat", lambda r: not r)
    spy(_fast_paths.FUSED, "applies", "fused", lambda r: r is not None)
    spy(cpu, "sweep", "general")
    spy(cpu, "grad_scalar", "scalar", lambda r: r[2])
    return seen


def _program(n, dtype, dim):
    w = tg.tensor(np.linspace(0.0, 1.0, n), dtype=dtype, requires_grad=True)
    x = tg.tensor(np.linspace(1.0, 2.0, n), dtype=dtype)
    y = tg.tensor(np.linspace(2.0, 3.0, n), dtype=dtype)

    def loss():
        z = (w * x).sin() * y
        return z.sum(dim=0) if dim else z.sum()
    return w, loss


def _per_step(w, loss, call, keep, steps):
    """Traced bytes per step still held after ``steps`` steps (``keep``: the losses are
    appended to a list, as when logging)."""
    losses = []

    def step():
        out = loss()
        if call == "grad":
            tg.autograd.grad(out, w)
        else:
            w.grad = None
            out.backward()
        if keep:
            losses.append(out)
    for _ in range(3):  # warm: compiles, caches, w.grad allocated
        step()
    w.grad = None
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(steps):
            step()
        w.grad = None
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return (after - before) / steps


CASES = {  # path: (elements, dtype, reduce with dim=)
    "flat": (N_SMALL, tg.float64, False),
    "general float32": (N_SMALL, tg.float32, False),
    "general dim": (N_SMALL, tg.float64, True),
    "fused": (N_LARGE, tg.float64, False),
}


@pytest.mark.parametrize("call", ["grad", "backward"])
@pytest.mark.parametrize("case", list(CASES))
def test_kept_losses_do_not_keep_their_arrays(paths, case, call):
    n, dtype, dim = CASES[case]
    steps = 20 if n == N_LARGE else 200
    w, loss = _program(n, dtype, dim)
    kept = _per_step(w, loss, call, True, steps)
    dropped = _per_step(w, loss, call, False, steps)
    path = case.split()[0]
    if call == "backward" and path != "general":
        path = "general"  # backward() has no one-call path
    assert paths[path] > 0, f"the {path} path did not run: {paths}"
    assert kept - dropped < PER_STEP, (
        f"{case}, {call}: each kept loss holds {kept - dropped:.0f} bytes after its backward "
        f"(its saved arrays take {3 * n * np.dtype(dtype.np).itemsize} bytes); the backward "
        "did not release them")


@pytest.mark.parametrize("call", ["grad", "backward"])
def test_kept_scalar_losses_stay_small(paths, call):
    w = tg.tensor(0.5, requires_grad=True)
    x, y = tg.tensor(1.5), tg.tensor(2.5)
    kept = _per_step(w, lambda: (w * x).sin() * y, call, True, 200)
    dropped = _per_step(w, lambda: (w * x).sin() * y, call, False, 200)
    assert paths["scalar" if call == "grad" else "general"] > 0
    assert kept - dropped < PER_STEP


def test_a_released_constant_dies_with_its_last_user_reference(paths):
    w = tg.tensor(np.linspace(0.0, 1.0, N_SMALL), requires_grad=True)
    x = tg.tensor(np.linspace(1.0, 2.0, N_SMALL))
    ref = weakref.ref(x)
    loss = ((w * x).sin()).sum()
    loss.backward()
    del x
    assert ref() is None, "the freed tape still holds the constant its mul saved"
    assert loss.item() == pytest.approx(float(np.sin(np.linspace(0, 1, N_SMALL)
                                                     * np.linspace(1, 2, N_SMALL)).sum()))


@pytest.mark.parametrize("call", ["grad", "backward"])
@pytest.mark.parametrize("n", [N_SMALL, N_LARGE])
def test_second_backward_through_the_released_part_raises_like_torch(torch, paths, call, n):
    for M in (tg, torch):
        w = M.tensor(np.linspace(0.0, 1.0, n), requires_grad=True)
        x = M.tensor(np.linspace(1.0, 2.0, n))
        loss = ((w * x).sin() * x).sum()
        for i in range(2):
            ctx = pytest.raises(RuntimeError, match="backward through the graph a second time")
            if i == 0:
                ctx = _null()
            with ctx:
                if call == "grad":
                    M.autograd.grad(loss, w)
                else:
                    loss.backward()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("n", [N_SMALL, N_LARGE])
def test_an_unswept_loss_on_the_same_tape_still_works(torch, paths, n):
    """Released: only what the first loss's backward freed; the second loss's entries (and
    the values they read) stay."""
    def run(M):
        w = M.tensor(np.linspace(0.0, 1.0, n), requires_grad=True)
        x = M.tensor(np.linspace(1.0, 2.0, n))
        a = (w * x).sin()
        b = (w * x).exp()            # read by the unswept loss only
        l1 = (a * x).sum()
        l2 = (b * b + w.cos()).sum()
        (g1,) = M.autograd.grad(l1, w)
        (g2,) = M.autograd.grad(l2, w)
        return g1.detach().numpy().copy(), g2.detach().numpy().copy()
    got, want = run(tg), run(torch)
    for g, t in zip(got, want):
        np.testing.assert_allclose(g, t, rtol=1e-12, atol=1e-12)


def test_a_loss_sharing_a_released_entry_raises_like_torch(torch, paths):
    for M in (tg, torch):
        w = M.tensor(np.linspace(0.0, 1.0, N_SMALL), requires_grad=True)
        a = w.sin()
        l1 = (a * 2.0).sum()
        l2 = (a * a).sum()           # its mul's saved values stay; sin's were freed by l1
        l1.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            l2.backward()


def test_retain_graph_keeps_everything(torch, paths):
    w = tg.tensor(np.linspace(0.0, 1.0, N_SMALL), requires_grad=True)
    x = tg.tensor(np.linspace(1.0, 2.0, N_SMALL))
    loss = ((w * x).sin() * x).sum()
    (g1,) = tg.autograd.grad(loss, w, retain_graph=True)
    assert all(any(v.strides) for v in loss._tape.arrays.values())
    (g2,) = tg.autograd.grad(loss, w)
    np.testing.assert_array_equal(g1.numpy(), g2.numpy())


def test_backward_through_released_shape_only_entries_works_like_torch(torch, paths):
    """cat and sum save no values (shapes only), so torch runs them again after a free;
    the released constant's stand-in keeps its shape, also under create_graph."""
    def run(M):
        w = M.tensor(np.linspace(0.0, 1.0, N_SMALL), requires_grad=True)
        x = M.tensor(np.linspace(1.0, 2.0, N_SMALL))
        loss = (M.cat([w, x]) + 3.0).sum()
        (g1,) = M.autograd.grad(loss, w)
        (g2,) = M.autograd.grad(loss, w, create_graph=True)
        return g1.detach().numpy().copy(), g2.detach().numpy().copy()
    got, want = run(tg), run(torch)
    for g, t in zip(got, want):
        np.testing.assert_array_equal(g, t)


def test_the_output_keeps_its_own_value(paths):
    w = tg.tensor(np.linspace(0.0, 1.0, N_SMALL), requires_grad=True)
    h = (w * 2.0).sin()
    loss = (h * h).sum()
    loss.backward()
    np.testing.assert_array_equal(h.detach().numpy(), np.sin(np.linspace(0.0, 1.0, N_SMALL) * 2.0))
    assert (h * 1.0).sum().item() == pytest.approx(float(h.detach().numpy().sum()))


@pytest.mark.parametrize("n", [N_SMALL, N_LARGE])
def test_create_graph_without_retain_graph_keeps_what_the_recorded_gradient_reads(torch, n):
    """The gradient's entries are recorded onto the same tape, after the swept ones: the
    release must see them as live (they read sin's input), not read past the freed mask."""
    def run(M):
        x = M.tensor(np.linspace(0.1, 1.0, n), requires_grad=True)
        y = (x.sin() * 2.0).sum()
        (g,) = M.autograd.grad(y, x, create_graph=True, retain_graph=False)
        (h,) = M.autograd.grad((g * g).sum(), x)
        return h.detach().numpy().copy()
    np.testing.assert_allclose(run(tg), run(torch), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [N_SMALL, 20_000])
def test_a_backward_inside_a_trace_releases_nothing_the_program_needs(n):
    """A traced program re-runs every recorded entry, swept or not: releasing the constant
    a swept entry read would bake zeros into the program."""
    c = tg.tensor(np.linspace(1.0, 2.0, n))

    def f(x):
        y = (x * c).sin().sum()
        tg.autograd.grad(y, x)
        return y
    p = tg.trace(f, tg.tensor(np.linspace(0.0, 1.0, n)))
    x2 = np.linspace(0.0, 2.0, n)
    assert p(tg.tensor(x2)).item() == pytest.approx(
        float(np.sin(x2 * np.linspace(1.0, 2.0, n)).sum()), rel=1e-12)


def test_a_custom_functions_saved_tensors_are_released_like_torchs(torch):
    def make(M):
        class Twice(M.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                big = x * 3.0          # made here: only ctx keeps it
                ctx.save_for_backward(big)
                return x * 2.0

            @staticmethod
            def backward(ctx, g):
                (big,) = ctx.saved_tensors
                return g * 2.0
        return Twice
    for M in (tg, torch):
        x = M.tensor(np.linspace(0.0, 1.0, 10), requires_grad=True)
        Twice = make(M)
        y = Twice.apply(x)
        ctx = y.grad_fn if M is torch else y._tape.aux[y._tape.nary[0]][2]
        ref = weakref.ref(ctx.saved_tensors[0])
        y.sum().backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            ctx.saved_tensors
        if M is tg:
            gc.collect()
            assert ref() is None, "the freed tape still holds what the Function saved"
        np.testing.assert_array_equal(x.grad.numpy(), np.full(10, 2.0))


def test_a_traced_program_calls_input_copy_is_released():
    prog = tg.trace(lambda x: (x.sin() * x).sum(), tg.tensor(np.linspace(0.0, 1.0, N_SMALL)))
    x = tg.tensor(np.linspace(0.0, 1.0, N_SMALL), requires_grad=True)
    y = prog(x)
    node = y._tape.nary[0]
    assert y._tape.aux[node][3] is not None
    (g,) = tg.autograd.grad(y, x)
    assert y._tape.aux[node][3] is None, "the freed tape still holds the call's inputs"
    xv = np.linspace(0.0, 1.0, N_SMALL)
    np.testing.assert_allclose(g.numpy(), np.cos(xv) * xv + np.sin(xv), rtol=1e-12)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        tg.autograd.grad(y, x)
