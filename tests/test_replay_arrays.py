"""Array instructions in traced programs (tapegrad/interpreters/program_arrays.py): array ops
stay one instruction per op over ranges of slots, replay runs them as loops, derivative
programs of them are array instructions too, and every other target runs their expansion;
each against the same program as scalar rows, eager tapegrad and torch."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import program_arrays as PA
from tapegrad.ops import OPS

from harness import replay_forms as RF

torch = pytest.importorskip("torch")


min_run = RF.array_instructions  # (traces with runs of n or more as instructions)


SCALAR = 1 << 62  # no run is that long: scalar rows only


def instructions(code):
    """{op name: elements} of a program's array instructions, and the number of its
    instructions (an array instruction counts once)."""
    rows, ops, r, count = code.arows, {}, 0, 0
    while r < rows.shape[0]:
        n, op, _ = PA.info(rows, r)
        if rows[r, 0] == PA.ARR:
            ops[OPS[op].name] = ops.get(OPS[op].name, 0) + n
            r += PA.META
        r += 1
        count += 1
    return ops, count


def lse(M, x):
    a = M.max(x)
    return a + M.log(M.sum(M.exp(x - a)))


def mixed(M, x, W):
    """Elementwise ops, scalar broadcast, a matmul, a broadcast over an axis, reductions
    over an axis, and the max's tie-sharing gradient."""
    h = M.tanh(M.matmul(W, x) * 0.5 + 1.0)          # (6,) from (6, 40) @ (40,)
    z = x.reshape(5, 8) - M.mean(x.reshape(5, 8), 1, keepdim=True)
    return (M.sum(z * z, 0).sum() + M.logsumexp(h, 0) + M.sin(x).pow(2.0).sum()
            + M.amax(x.reshape(5, 8), 1).sum() + (h @ h))


def torch_derivs(f, x, v):
    xt = torch.tensor(x, requires_grad=True)
    y = f(xt)
    g, = torch.autograd.grad(y, xt, create_graph=True)
    hv, = torch.autograd.grad((g * torch.tensor(v)).sum(), xt)
    return y.item(), g.detach().numpy(), hv.numpy()


def results(P, x, v):
    value, g = P.value_and_grad(x)
    return [value, g, P.hvp((x,), (v,))[1], P.grad_program()(x), P.hessian(x) @ v,
            P.grad(np.stack([x, 0.5 * x]))[1], P.jacobian(x)]


@pytest.mark.parametrize("case", ["lse", "mixed"])
def test_array_program_against_scalar_rows_eager_and_torch(case):
    rng = np.random.default_rng(3)
    W = rng.normal(size=(6, 40))
    f = {"lse": lambda M, x: lse(M, x), "mixed": lambda M, x: mixed(
        M, x, M.tensor(W, dtype=M.float64))}[case]
    x0, x1, v = rng.normal(size=40), rng.normal(size=40), rng.normal(size=40)
    with min_run(4):
        P = tg.trace(lambda x: f(tg, x), x0)
    with min_run(SCALAR):
        S = tg.trace(lambda x: f(tg, x), x0)
    assert P._code.arrays and not S._code.arrays
    assert len(P) == len(S) and P._code._rows is None  # counted without expanding
    assert P._code.rows.shape == S._code.rows.shape  # the same slots, expanded
    got, scalar = results(P, x1, v), results(S, x1, v)
    for a, b in zip(got, scalar):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    y, g, hv = torch_derivs(lambda t: f(torch, t), x1, v)
    np.testing.assert_allclose(got[0], y, rtol=1e-12)
    np.testing.assert_allclose(got[1], g, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(got[2], hv, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got[5], torch_derivs(lambda t: f(torch, t), 0.5 * x1, v)[1],
                               rtol=1e-10, atol=1e-14)
    xe = tg.tensor(x1, requires_grad=True)
    ge, = tg.autograd.grad(f(tg, xe), xe)
    np.testing.assert_allclose(got[1], ge.numpy(), rtol=1e-12, atol=1e-14)


def test_instructions_per_op_not_per_element():
    # the program, its gradient program and its hvp program have about as many
    # instructions at n = 4000 as at n = 1000 (the leaves' rows aside, one per input
    # element): a reduction's tree is a level more per doubling, and its short levels
    # (under MIN_RUN elements) are scalar rows
    counts = {}
    for n in (1000, 4000):
        x = np.random.default_rng(0).normal(size=n)
        P = tg.trace(lambda x: lse(tg, x), x)
        G = P.grad_program()
        from tapegrad._program_code import _hvp_of
        H = _hvp_of(P._code)
        counts[n] = [instructions(c)[1] - c.n_in for c in (P._code, G._code, H)]
        ops = instructions(P._code)[0]
        assert ops["exp"] == n and ops["sub"] == n  # one instruction each
    assert all(b - a <= 16 for a, b in zip(counts[1000], counts[4000])), counts
    assert max(counts[4000]) < 300, counts


def test_lse_program_makes_few_passes_over_the_elements():
    # a max shares its gradient among tied elements: a select of the two tie tests and a
    # division of the picks' sum (not of each element) keep it to 8 passes, 12 in all
    P = tg.trace(lambda x: lse(tg, x), np.random.default_rng(0).normal(size=1000))
    ops = instructions(P._code)[0]
    assert "div" not in ops and "logical_or" not in ops, ops
    assert P._code.nslots <= 12 * 1000 + 50, (P._code.nslots, ops)


def test_elementwise_rule_runs_over_ranges_with_strides():
    # a column of a matrix (stride 8) and a broadcast scalar (stride 0) as operands
    x0 = np.random.default_rng(1).normal(size=(8, 8))

    def f(x):
        col = x[:, 3] * x[2, 2]
        return (tg.exp(col) * x.T[5]).sum() + (x[2, 2] * x[1]).sum()
    with min_run(4):
        P = tg.trace(f, x0)
    strides = {(OPS[PA.info(P._code.arows, k)[1]].name, PA.info(P._code.arows, k)[2])
               for k in np.nonzero(P._code.arows[:, 0] == PA.ARR)[0].tolist()}
    assert ("mul", (8, 0, 0)) in strides and ("mul", (0, 1, 0)) in strides, strides
    xt = torch.tensor(x0, requires_grad=True)
    y = (torch.exp(xt[:, 3] * xt[2, 2]) * xt.T[5]).sum() + (xt[2, 2] * xt[1]).sum()
    g, = torch.autograd.grad(y, xt)
    value, grad = P.value_and_grad(x0)
    np.testing.assert_allclose(value, y.item(), rtol=1e-13)
    np.testing.assert_allclose(grad, g.numpy(), rtol=1e-12, atol=1e-15)


def test_prune_keeps_an_instruction_and_its_strided_span_whole():
    x0 = np.random.default_rng(2).normal(size=(6, 6))

    def f(x):
        y = tg.sin(x)            # one instruction of 36
        unused = tg.cos(x) * 2.0  # dropped
        del unused
        return (y[:, 1] * y[:, 4]).sum()  # strided reads (stride 6) of y
    with min_run(4):
        P = tg.trace(f, x0)
    rows = P._code.arows
    ops = instructions(P._code)[0]
    assert "cos" not in ops and ops.get("sin") == 36, ops
    assert not (PA.expand(rows)[:, 0] == PA.ARR).any()
    assert PA.expand(rows).shape[0] == P._code.nslots > rows.shape[0]
    xt = torch.tensor(x0, requires_grad=True)
    y = torch.sin(xt)
    want = (y[:, 1] * y[:, 4]).sum()
    g, = torch.autograd.grad(want, xt)
    v, gr = P.value_and_grad(x0)
    np.testing.assert_allclose(v, want.item(), rtol=1e-13)
    np.testing.assert_allclose(gr, g.numpy(), rtol=1e-12, atol=1e-15)


def test_guard_in_an_array_program_names_its_site():
    def f(x):
        y = tg.exp(x) * 2.0
        if y.sum() > 40.0:
            return (y * y).sum()
        return y.sum()
    x0 = np.zeros(32)
    with min_run(4):
        P = tg.trace(f, x0)
    assert P._code.arrays
    np.testing.assert_allclose(P.grad(np.full(32, 0.01)), 8.0 * np.exp(0.02), rtol=1e-13)
    with pytest.raises(tg.GuardError, match="y.sum"):
        P.grad(np.full(32, -2.0))
    with pytest.raises(tg.GuardError, match="sample 1"):
        P.grad(np.stack([np.zeros(32), np.full(32, -2.0)]))


def test_saved_array_program_loads_and_gives_the_same_results(tmp_path):
    x0 = np.random.default_rng(4).normal(size=64)
    P = tg.trace(lambda x: lse(tg, x), x0)
    assert P._code.arrays
    path = tmp_path / "lse.npz"
    P.save(path)
    Q = tg.load(path)
    x1 = x0[::-1].copy()
    for a, b in zip(P.value_and_grad(x1), Q.value_and_grad(x1)):
        np.testing.assert_allclose(a, b, rtol=1e-13)
    np.testing.assert_allclose(P.hvp(x1, x0)[1], Q.hvp(x1, x0)[1], rtol=1e-12)


def test_program_entry_and_create_graph_through_an_array_program():
    x0 = np.random.default_rng(5).normal(size=48)
    P = tg.trace(lambda x: lse(tg, x * 1.5), x0)
    assert P._code.arrays
    xt = tg.tensor(x0, requires_grad=True)
    g, = tg.autograd.grad(P(xt), xt, create_graph=True)
    h, = tg.autograd.grad(g.sum(), xt)
    t = torch.tensor(x0, requires_grad=True)
    gt, = torch.autograd.grad(lse(torch, t * 1.5), t, create_graph=True)
    ht, = torch.autograd.grad(gt.sum(), t)
    np.testing.assert_allclose(g.detach().numpy(), gt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(h.numpy(), ht.numpy(), rtol=1e-10, atol=1e-15)


def test_cuda_runs_the_expansion_of_an_array_program():
    pytest.importorskip("numba_cuda", reason="the CUDA target needs pip install "
                                             "'tapegrad[cuda]'")
    from numba import config
    if not config.ENABLE_CUDASIM:
        pytest.skip("runs under numba's CUDA simulator (tests/conftest.py sets it)")
    from tapegrad.interpreters import replay_cuda
    mp = pytest.MonkeyPatch()
    mp.setattr(replay_cuda, "THREADS", 4)
    try:
        x0 = np.random.default_rng(6).normal(size=(3, 20))
        with min_run(4):
            P = tg.trace(lambda x: lse(tg, x), x0[0])
        assert P._code.arrays
        v, g = P.value_and_grad(x0)
        vc, gc = P.to("cuda").value_and_grad(x0)
        np.testing.assert_allclose(vc, v, rtol=1e-12)
        np.testing.assert_allclose(gc, g, rtol=1e-12, atol=1e-15)
    finally:
        mp.undo()


def test_runs_of_affine_slots():
    flat = np.array([[0, 1, 2, 3, 10, 11, 12, 13, 13],
                     [5, 5, 5, 5, 6, 6, 6, 6, 6]])
    assert PA.runs(flat, 4) == [(0, 4, [1, 0]), (4, 8, [1, 0]), (8, 9, [0, 0])]
    assert PA.runs(np.arange(3)[None], 4) is None  # shorter than one run
    assert PA.runs(np.array([[0, 5, 1, 7, 2, 9, 3, 4]]), 4) is None  # no run: scalar rows


def test_reversed_and_stepped_slots_are_instructions_with_their_stride():
    x0 = np.random.default_rng(7).normal(size=40)
    idx = np.arange(39, -1, -1)

    def f(M, x):
        r = x[M.tensor(idx)] if M is torch else x[idx]
        return (M.sin(r) * x).sum() + (x[::2] * 2.0).sum()
    with min_run(PA.MIN_RUN):  # (and any share of the slots in instructions)
        P = tg.trace(lambda x: f(tg, x), x0)
    rows = P._code.arows
    got = {(OPS[PA.info(rows, k)[1]].name, PA.info(rows, k)[2][0])
           for k in np.nonzero(rows[:, 0] == PA.ARR)[0].tolist()}
    assert {("sin", -1), ("mulc", 2)} <= got, got
    xt = torch.tensor(x0, requires_grad=True)
    y = f(torch, xt)
    g, = torch.autograd.grad(y, xt)
    v, gr = P.value_and_grad(x0)
    np.testing.assert_allclose(v, y.item(), rtol=1e-13)
    np.testing.assert_allclose(gr, g.numpy(), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(P.grad_program()(x0), g.numpy(), rtol=1e-13, atol=1e-15)


def test_array_interpreters_loop_per_common_op_only():
    # a loop of its own for every op made the array interpreters compile for a minute on
    # 2 cores (cold cache); the rare ops share one loop over ``value``/``grads``
    import pathlib

    from tapegrad.interpreters import _codegen_arrays
    src = pathlib.Path(PA.__file__).with_name("_generated_arrays.py").read_text()
    loops = src.count("for i in range(")
    # (+ 9: the reductions' loops, forward's four, red_reverse's two and red_reverse_mm's
    # four, and add and sub's with a broadcast operand's gradients in a register, less
    # the reverse loops of the looped ops with no rule: eq, ne, detach)
    assert loops <= 2 * len(_codegen_arrays.LOOPED) + 2 + 9, loops
    assert src == _codegen_arrays.generate_arrays(), (
        "_generated_arrays.py is stale: run python -m tapegrad.interpreters._codegen")


def test_own_and_shared_loops_over_reversed_slots():
    # a stride of -1 through an op with a loop of its own (exp, mul: slots read as
    # np.uint64, which a negative stride must not wrap) and through the shared one (sin)
    from tapegrad.interpreters import _codegen_arrays
    assert {"exp", "mul"} <= _codegen_arrays.LOOPED and "sin" not in _codegen_arrays.LOOPED
    x0 = np.random.default_rng(8).normal(size=48)
    idx = np.arange(47, -1, -1)

    def f(M, x):
        r = x[M.tensor(idx)] if M is torch else x[idx]
        return (M.exp(r) * x + M.sin(r) * r).sum()
    P = tg.trace(lambda x: f(tg, x), x0)
    rows = P._code.arows
    got = {(OPS[PA.info(rows, k)[1]].name, PA.info(rows, k)[2][0])
           for k in np.nonzero(rows[:, 0] == PA.ARR)[0].tolist()}
    assert {("exp", -1), ("sin", -1)} <= got, got
    xt = torch.tensor(x0, requires_grad=True)
    y = f(torch, xt)
    g, = torch.autograd.grad(y, xt)
    v, gr = P.value_and_grad(x0)
    np.testing.assert_allclose(v, y.item(), rtol=1e-13)
    np.testing.assert_allclose(gr, g.numpy(), rtol=1e-13, atol=1e-15)


def test_an_array_program_says_its_own_interpreter_compiles(monkeypatch):
    # the first call of an array program compiles the arrays interpreter's sweeps, not the
    # scalar replay's run_into: the notice must name (and check the cache of) those
    from tapegrad import _notice
    said = []
    monkeypatch.setattr(_notice, "announce", lambda key, stream=None: said.append(key))
    x0 = np.random.default_rng(0).normal(size=64)
    for call in (lambda P: P.value_and_grad(x0), lambda P: P(x0)):
        monkeypatch.setattr(_notice, "PENDING", set(_notice._WHAT))
        P = tg.trace(lambda x: lse(tg, x), x0)
        assert P._code.arrays
        call(P)
        assert "arrays" in said and "replay" not in said, said
        said.clear()
    assert [d for _, d in _notice._WHAT["arrays"][2]] == ["forward", "reverse"]
    assert not _notice.will_compile("arrays")  # compiled now


@pytest.mark.slow
def test_a_cold_first_array_gradient_says_so_once(tmp_path):
    # in a fresh process with an empty Numba cache: the notice names the arrays interpreter,
    # once, and the gradient is right; a second process loads it silently
    import os
    import subprocess
    import sys
    code = ("import numpy as np, tapegrad as tg; x = np.linspace(-1.0, 1.0, 64); "
            "p = tg.trace(lambda x: x.max() + tg.log(tg.sum(tg.exp(x - x.max()))), x); "
            "assert p._code.arrays; v, g = p.value_and_grad(x); v2, g2 = p.value_and_grad(x); "
            "e = np.exp(x - x.max()); assert np.allclose(g, e / e.sum(), rtol=1e-13); "
            "assert np.array_equal(g, g2)")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("TAPEGRAD_QUIET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, cwd=root, timeout=600) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs
    assert runs[0].stderr.count("traced array programs") == 1, runs[0].stderr
    assert "compiling" not in runs[1].stderr, runs[1].stderr


def test_a_program_mostly_of_scalar_rows_runs_its_expansion():
    """Below ``MIN_COVER`` of the slots in instructions the program runs as scalar rows (the
    scalar interpreter is faster there), with the same numbers; at 0 the instructions run."""
    def f(x):
        big = tg.exp(x[:64] * 0.5).sum()  # one run of 64 elements
        s = big * 0.0
        for i in range(64, 400):  # 336 scalar rows and more
            s = s + tg.sin(x[i]) * x[i - 1]
        return s + big
    x = np.random.default_rng(3).normal(size=400)
    prog = tg.trace(f, tg.tensor(x))
    assert not prog._code.arrays  # few of its slots are in the instruction
    assert not PA.has_arrays(prog._code.arows)
    saved = PA.MIN_COVER
    PA.MIN_COVER = 0.0
    try:
        forced = tg.trace(f, tg.tensor(x))
    finally:
        PA.MIN_COVER = saved
    assert forced._code.arrays
    v1, g1 = prog.value_and_grad(x)
    v2, g2 = forced.value_and_grad(x)
    np.testing.assert_allclose(v1, v2, rtol=1e-14)
    np.testing.assert_allclose(g1, g2, rtol=1e-13, atol=1e-15)
    xt = torch.tensor(x, requires_grad=True)
    big = torch.exp(xt[:64] * 0.5).sum()
    s = big * 0.0
    for i in range(64, 400):
        s = s + torch.sin(xt[i]) * xt[i - 1]
    (s + big).backward()
    np.testing.assert_allclose(g1, xt.grad.numpy(), rtol=1e-12, atol=1e-14)


def bcasts(M, x):
    """add, sub and mul with a broadcast operand that takes gradients, on either side (a
    sub's or add's right one: summed in a register) and both; a broadcast slot that is one
    of the other operand's (the loop of every element's add to the slot then) and the
    same slot on both sides."""
    X = x[:40].reshape(5, 8)
    s = M.sum(x[40:])
    mu = M.mean(X, 1, keepdim=True)
    Z = (X - mu) * (s - X) + (mu + X) * X[:, :1] - X[:, 2:3] * X + (s * X)
    return M.sum(Z * Z) + M.sum(M.exp(X - X[:, :1])) + M.sum(X[:, :1] * X[:, :1] - X)


def test_broadcast_operands_gradients_summed_in_a_register_give_the_expansions_bits():
    rng = np.random.default_rng(12)
    x0 = rng.normal(size=44)
    with RF.array_instructions(4):
        P = tg.trace(lambda x: bcasts(tg, x), x0)
    rows = P._code.arows
    kinds = set()
    for h in np.nonzero(rows[:, 0] == PA.ARR)[0].tolist():
        n, code, st = PA.info(rows, h)
        if OPS[code].name in ("add", "sub", "mul") and 0 in st[:2]:
            kinds.add((OPS[code].name, st[:2]))
    assert {("sub", (1, 0)), ("sub", (0, 1)), ("add", (0, 1)), ("mul", (1, 0)),
            ("mul", (0, 1))} <= kinds, kinds
    with RF.array_instructions(SCALAR):
        S = tg.trace(lambda x: bcasts(tg, x), x0)
    for a, b in zip(P.value_and_grad(x0), S.value_and_grad(x0)):
        np.testing.assert_array_equal(a, b)
    xt = torch.tensor(x0, requires_grad=True)
    g, = torch.autograd.grad(bcasts(torch, xt), xt)
    np.testing.assert_allclose(P.grad(x0), g.numpy(), rtol=1e-12, atol=1e-14)
