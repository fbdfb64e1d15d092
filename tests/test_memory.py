"""Memory follows torch's rules: a recorded graph lives exactly as long as a tensor that can
reach it, loops keep memory flat, and backward releases what it saved."""
import gc
import importlib
import sys
import tracemalloc
import weakref

import numpy as np
import pytest

import tapegrad as tg
import tapegrad.tape as tape_mod

tensor_mod = importlib.import_module("tapegrad.tensor")


from conftest import set_rollover  # noqa: E402

pytestmark = pytest.mark.usefixtures("frozen_heap")  # cheap gc.collect() calls

#: allowed growth of traced memory between iteration 1,000 and iteration 10,000
FLAT_BOUND = 64 * 1024


def current_tape():
    t = tape_mod.STATE.tape
    return t() if callable(t) else t


@pytest.fixture(autouse=True)
def _fresh_tape_no_gc():
    """Each test records onto a new tape (an earlier test's leftovers cannot keep it alive),
    and reference counting alone must free a dropped graph, as in torch (no cycles)."""
    t = current_tape()
    if t is not None:
        tape_mod.end_tape(t)
    del t
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def scalar_forward(x, w):
    h = tg.sin(x) * w + x * x
    return tg.exp(-h) + tg.log1p(h * h) / (w + 2.0)


def array_forward(x, w):
    h = tg.tanh(w @ x) * x
    return (h * h).sum() + x.exp().mean()


# --- a dropped forward pass leaves nothing ------------------------------------------------


def test_dropped_scalar_forward_frees_its_tape():
    x = tg.tensor(0.3, requires_grad=True)
    w = tg.tensor(1.2, requires_grad=True)
    y = scalar_forward(x, w)
    ref = weakref.ref(y._tape)
    del y
    assert ref() is None


def test_dropped_array_forward_frees_its_tape():
    x = tg.tensor(np.linspace(0.0, 1.0, 5), requires_grad=True)
    w = tg.tensor(np.eye(5) * 0.5, requires_grad=True)
    y = array_forward(x, w)
    ref = weakref.ref(y._tape)
    del y
    assert ref() is None


def test_tape_lives_while_an_intermediate_lives():
    x = tg.tensor(0.3, requires_grad=True)
    h = tg.sin(x) * 2.0
    y = h * h
    ref = weakref.ref(y._tape)
    del y
    assert ref() is not None          # h still reaches it
    assert tg.autograd.grad(h, x)[0].item() == pytest.approx(2.0 * np.cos(0.3), rel=1e-14)
    del h
    assert ref() is None


def test_intermediate_values_die_with_the_graph():
    x = tg.tensor(np.ones(4), requires_grad=True)
    h = x.exp()
    y = (h * 2.0).sum()
    href = weakref.ref(h)
    tref = weakref.ref(y._tape)
    del h, y
    assert href() is None and tref() is None


def test_dropped_graph_after_backward_with_retain_graph_is_freed():
    x = tg.tensor([0.1, 0.2], requires_grad=True)
    y = (x.exp() * x).sum()
    y.backward(retain_graph=True)
    ref = weakref.ref(y._tape)
    del y
    assert ref() is None


def test_dropped_graph_with_retained_non_leaf_is_freed():
    x = tg.tensor([0.1, 0.2], requires_grad=True)
    h = x.sin()
    h.retain_grad()
    y = (h * h).sum()
    ref = weakref.ref(y._tape)
    y.backward()
    assert h.grad is not None
    del y, h
    assert ref() is None


def test_dropped_graph_across_tapes_is_freed(monkeypatch):
    set_rollover(monkeypatch, 8)
    x = tg.tensor(0.3, requires_grad=True)
    h = x
    first = None
    for _ in range(40):
        h = tg.sin(h) * 0.9 + x
        if first is None:
            first = weakref.ref(h._tape)
    last = weakref.ref(h._tape)
    assert first() is not last()      # the chain crossed tapes (imports keep the old alive)
    del h
    assert first() is None and last() is None


def test_leaf_is_not_kept_alive_by_a_dropped_graph():
    x = tg.tensor(np.ones(3), requires_grad=True)
    y = (x * x).sum()
    xref = weakref.ref(x)
    del x
    assert xref() is not None         # the graph holds its leaf, as torch's does
    del y
    assert xref() is None


# --- loops keep memory flat ------------------------------------------------------------------


def _traced_growth(step, n_warm=1000, n_total=10000):
    """Traced bytes after ``n_total`` calls of ``step`` minus after ``n_warm`` calls."""
    tracemalloc.start()
    try:
        for _ in range(n_warm):
            step()
        gc.collect()
        warm, _ = tracemalloc.get_traced_memory()
        for _ in range(n_total - n_warm):
            step()
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return end - warm


def test_forward_loop_without_backward_keeps_memory_flat():
    x = tg.tensor(0.3, requires_grad=True)
    w = tg.tensor(1.2, requires_grad=True)
    xa = tg.tensor(np.linspace(0.0, 1.0, 4), requires_grad=True)
    wa = tg.tensor(np.eye(4) * 0.5, requires_grad=True)

    def step():
        y = scalar_forward(x, w) + array_forward(xa, wa)
        return y.item()
    growth = _traced_growth(step)
    assert growth < FLAT_BOUND, f"memory grew by {growth} bytes over 9,000 forward passes"


def test_forward_loop_beside_a_long_lived_non_leaf_keeps_memory_flat():
    # torch: each iteration's graph dies with its output; the non-leaf keeps only its own
    w = tg.tensor(np.ones(100), requires_grad=True)
    w2 = w * 2.0                       # recorded once, alive for the whole loop
    x = tg.tensor(np.linspace(0.0, 1.0, 100))

    def step():
        y = (tg.tanh(w2 * x) + w).sum()
        return y.item()
    # tapegrad's graphs are flat tapes, not per-node objects: the tape w2 lives on keeps the
    # entries recorded after it until the recorder moves on (ROLLOVER entries), then every
    # later iteration's tape dies with its output. So memory is flat once the first tape
    # is full: warm up past that point, then measure 9,000 more iterations.
    n_warm = tape_mod.ROLLOVER // 4 + 1000
    growth = _traced_growth(step, n_warm=n_warm, n_total=n_warm + 9000)
    assert growth < FLAT_BOUND, (
        f"memory grew by {growth} bytes over 9,000 forward passes while a non-leaf from "
        f"before the loop was alive (its tape now has {len(w2._tape)} entries)")


def test_forward_loop_keeping_only_values_keeps_memory_flat():
    x = tg.tensor(0.3, requires_grad=True)
    w = tg.tensor(1.2, requires_grad=True)
    history = []

    def step():
        history.append(scalar_forward(x, w).detach())
    # detached values are plain floats: 9,000 of them are small, the graphs must be gone
    growth = _traced_growth(step)
    assert growth < FLAT_BOUND + 9000 * 200


def _block_growth(step, n_warm=1000, n_total=10000):
    """Like ``_traced_growth`` but counts live interpreter blocks (``sys.getallocatedblocks``):
    no tracing overhead, and any leaked tensor, tape, list or array object shows up."""
    for _ in range(n_warm):
        step()
    gc.collect()
    warm = sys.getallocatedblocks()
    for _ in range(n_total - n_warm):
        step()
    gc.collect()
    return sys.getallocatedblocks() - warm


#: allowed growth of live interpreter blocks between iteration 1,000 and 10,000
BLOCK_BOUND = 500


def test_optimization_loop_with_grad_keeps_memory_flat():
    p = tg.tensor(0.3, requires_grad=True)
    q = tg.tensor([0.5, -0.5, 0.25], requires_grad=True)
    target = tg.tensor([1.0, 2.0, 3.0])

    def step():
        loss = ((q * p - target) ** 2).sum() + (p - 1.0) ** 2
        gp, gq = tg.autograd.grad(loss, [p, q])
        with tg.no_grad():
            p.sub_(0.01 * gp)
            q.sub_(0.01 * gq)
    # 10,000 traced steps of an array program take too long; count live blocks instead
    growth = _block_growth(step)
    assert growth < BLOCK_BOUND, f"{growth} more live objects after 9,000 steps"
    # and the optimization did something sensible
    assert float(((q * p - target) ** 2).sum().item()) < 1e-2


def test_optimization_loop_with_backward_keeps_memory_flat():
    a = tg.tensor(-1.0, requires_grad=True)
    b = tg.tensor(1.5, requires_grad=True)

    def step():
        loss = (1.0 - a) ** 2 + 10.0 * (b - a * a) ** 2   # Rosenbrock, scalar ops
        a.grad = None
        b.grad = None
        loss.backward()
        with tg.no_grad():
            a.sub_(1e-3 * a.grad)
            b.sub_(1e-3 * b.grad)
    growth = _traced_growth(step)
    assert growth < FLAT_BOUND, f"memory grew by {growth} bytes over 9,000 steps"


def test_optimization_loop_matches_torch(monkeypatch):
    torch = pytest.importorskip("torch")

    def run(M):
        a = M.tensor(-1.0, dtype=M.float64, requires_grad=True)
        b = M.tensor(1.5, dtype=M.float64, requires_grad=True)
        w = M.tensor([0.5, -0.5], dtype=M.float64, requires_grad=True)
        for _ in range(200):
            loss = (1.0 - a) ** 2 + 10.0 * (b - a * a) ** 2 + (w * w * a).sum()
            a.grad = b.grad = w.grad = None
            loss.backward()
            with M.no_grad():
                a -= 1e-3 * a.grad
                b -= 1e-3 * b.grad
                w -= 1e-3 * w.grad
        return a.item(), b.item(), w.detach().numpy().copy()
    rt, rp = run(tg), run(torch)
    np.testing.assert_allclose(rt[:2], rp[:2], rtol=1e-10)
    np.testing.assert_allclose(rt[2], rp[2], rtol=1e-10)


# --- backward releases what it saved -------------------------------------------------------

BIG = 250_000   # 2 MB per float64 array


def test_backward_releases_saved_arrays_while_the_output_lives():
    warm = tg.tensor(np.linspace(0.0, 1.0, BIG), requires_grad=True)
    (warm.exp() * warm).sin().sum().backward()  # the first backward's imports are not held memory
    del warm
    x = tg.tensor(np.linspace(0.0, 1.0, BIG), requires_grad=True)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        y = (x.exp() * x).sin().sum()      # three 2 MB intermediates saved on the tape
        recorded, _ = tracemalloc.get_traced_memory()
        y.backward()                        # adds x.grad (2 MB), frees the saved ones
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert recorded - base > 3 * 8 * BIG * 0.9
    assert after - base < 1.5 * 8 * BIG, (
        f"{(after - base) / 1e6:.1f} MB still held after backward; expected about x.grad "
        f"({8 * BIG / 1e6:.1f} MB): the tape's saved arrays were not released")
    assert y.item() == y.item()


def test_backward_releases_the_tape_when_the_output_is_dropped():
    x = tg.tensor(np.linspace(0.0, 1.0, BIG), requires_grad=True)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        y = (x.exp() * x).sin().sum()
        ref = weakref.ref(y._tape)
        y.backward()
        del y
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ref() is None
    assert after - base < 1.5 * 8 * BIG


def test_grad_releases_saved_arrays_while_the_output_lives():
    x = tg.tensor(np.linspace(0.0, 1.0, BIG), requires_grad=True)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        y = (x.exp() * x).sin().sum()
        (g,) = tg.autograd.grad(y, x)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - base < 1.5 * 8 * BIG
    assert g.shape == (BIG,)


def test_retain_graph_keeps_saved_arrays():
    x = tg.tensor(np.linspace(0.0, 1.0, 10), requires_grad=True)
    y = (x.exp() * x).sin().sum()
    (g1,) = tg.autograd.grad(y, x, retain_graph=True)
    (g2,) = tg.autograd.grad(y, x)
    np.testing.assert_array_equal(g1.numpy(), g2.numpy())


class _FakeLibc:
    def __init__(self, calls):
        self.calls = calls

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


def _fake_allocator(monkeypatch):
    import tapegrad.tape as tape_mod
    calls = []
    monkeypatch.setattr(tape_mod, "ALLOCATOR", [False])
    monkeypatch.setattr(tape_mod.ctypes, "CDLL", lambda name: _FakeLibc(calls))
    return tape_mod, calls


def test_allocator_is_tuned_once_at_the_first_large_array(monkeypatch):
    """glibc would map each large array afresh and give the freed heap back after every
    step (a page fault per 4 KiB touched): the first large array a tape records sets the
    thresholds glibc itself reaches once a large block is freed."""
    tape_mod, calls = _fake_allocator(monkeypatch)
    monkeypatch.delenv("TAPEGRAD_MALLOC_TUNING", raising=False)
    x = tg.tensor(np.ones(100), requires_grad=True)
    (x * 2.0).sum()
    assert calls == [] and not tape_mod.ALLOCATOR[0]  # small arrays leave it alone
    x = tg.tensor(np.ones(1 << 15), requires_grad=True)
    y = (x * 2.0) * 3.0
    linux = sys.platform.startswith("linux")
    assert tape_mod.ALLOCATOR[0]
    assert calls == ([(-3, 32 << 20), (-1, 64 << 20)] if linux else [])
    tg.autograd.grad(y.sum(), x)
    assert len(calls) == (2 if linux else 0)  # once per process


def test_allocator_tuning_can_be_turned_off(monkeypatch):
    tape_mod, calls = _fake_allocator(monkeypatch)
    monkeypatch.setenv("TAPEGRAD_MALLOC_TUNING", "0")
    x = tg.tensor(np.ones(1 << 15), requires_grad=True)
    (x * 2.0).sum()
    assert tape_mod.ALLOCATOR[0] and calls == []
