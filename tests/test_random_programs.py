"""Seeded random-program differential test: random expression DAGs over the registry's
elementwise ops (unary, binary, unary with constants) and a few array ops, evaluated in
tapegrad and in torch; values and gradients must agree to rtol 1e-10.

Scalar programs run on 0-d tensors (the compiled scalar path); array programs on (2, 3)
arrays mixed with 0-d values. Inputs reach an op's domain through guards that are part of
the program (``log(exp(tanh(h)))``, ``asin(0.9 * tanh(h))``...), so every program is
well defined; a program whose values still overflow is redrawn.
"""
import sys
import warnings

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.ops import BINARY, OPS, UNARY, UNARY_C

torch = pytest.importorskip("torch")

RTOL = 1e-10
SHAPE = (2, 3)
LIMIT = 1e6          # a program with a larger |value| is redrawn


def _softplus(M, x, beta, threshold):
    if M is torch:
        return torch.nn.functional.softplus(x, beta=beta, threshold=threshold)
    return tg.softplus(x, beta, threshold)


# --- guards: map any real value into an op's domain, using ops -------------------------------

def g_pos(M, a, p):
    """A positive value, bounded away from 0 and from infinity."""
    kind = p["pos"]
    if kind == 0:
        return M.exp(M.tanh(a))
    if kind == 1:
        return M.square(M.tanh(a)) + 0.25
    return M.sigmoid(a) * 2.0 + 0.1


def g_unit(M, a, p):
    """A value in (-0.9, 0.9)."""
    return M.tanh(a) * 0.9 if p["pos"] != 1 else M.sin(a) * 0.9


def g_bounded(r):
    def g(M, a, p):
        return M.tanh(a) * r
    return g


def g_id(M, a, p):
    return a


# --- op forms: how each registry op is called in both libraries -------------------------------
# name -> (arity, fn(M, args, params)); one form per registered elementwise op (checked below)

def _unary(name, guard=g_id):
    return 1, lambda M, a, p: getattr(M, name)(guard(M, a[0], p))


FORMS = {
    # unary
    "neg": (1, lambda M, a, p: -a[0]),
    "exp": _unary("exp", g_bounded(3.0)),
    "log": _unary("log", g_pos),
    "log1p": (1, lambda M, a, p: M.log1p(g_pos(M, a[0], p) - 0.9)),
    "expm1": _unary("expm1", g_bounded(3.0)),
    "sqrt": _unary("sqrt", g_pos),
    "rsqrt": _unary("rsqrt", g_pos),
    "sin": _unary("sin"),
    "cos": _unary("cos"),
    "tan": _unary("tan", g_bounded(1.2)),
    "asin": _unary("asin", g_unit),
    "acos": _unary("acos", g_unit),
    "atan": _unary("atan"),
    "sinh": _unary("sinh", g_bounded(3.0)),
    "cosh": _unary("cosh", g_bounded(3.0)),
    "tanh": _unary("tanh"),
    "sigmoid": _unary("sigmoid"),
    "relu": _unary("relu"),
    "erf": _unary("erf"),
    "abs": (1, lambda M, a, p: M.abs(a[0]) if p["pos"] else abs(a[0])),
    "sign": (1, lambda M, a, p: M.sign(a[0]) + a[0]),
    "square": _unary("square"),
    "reciprocal": _unary("reciprocal", g_pos),
    "clone": (1, lambda M, a, p: M.clone(a[0])),
    # unary with float constants
    "addc": (1, lambda M, a, p: a[0] + p["c"] if p["pos"] else a[0] - p["c"]),
    "mulc": (1, lambda M, a, p: a[0] * p["c"] if p["pos"] else p["c"] * a[0]),
    "rsubc": (1, lambda M, a, p: p["c"] - a[0]),
    "divc": (1, lambda M, a, p: a[0] / p["cnz"]),
    "rdivc": (1, lambda M, a, p: p["c"] / g_pos(M, a[0], p)),
    "powc": (1, lambda M, a, p: g_pos(M, a[0], p) ** p["e"]),
    "rpowc": (1, lambda M, a, p: p["b"] ** g_bounded(2.0)(M, a[0], p)),
    "clamp": (1, lambda M, a, p: M.clamp(a[0], p["lo"], p["hi"])),
    "softplus": (1, lambda M, a, p: _softplus(M, a[0], p["beta"], p["thr"])),
    # binary
    "add": (2, lambda M, a, p: a[0] + a[1]),
    "sub": (2, lambda M, a, p: a[0] - a[1]),
    "mul": (2, lambda M, a, p: a[0] * a[1]),
    "div": (2, lambda M, a, p: a[0] / g_pos(M, a[1], p)),
    "pow": (2, lambda M, a, p: g_pos(M, a[0], p) ** g_bounded(2.0)(M, a[1], p)),
    "atan2": (2, lambda M, a, p: M.atan2(a[0], a[1])),
    "maximum": (2, lambda M, a, p: M.maximum(a[0], a[1])),
    "minimum": (2, lambda M, a, p: M.minimum(a[0], a[1])),
    "clamp_min_t": (2, lambda M, a, p: M.clamp(a[0], min=a[1])),
    "clamp_max_t": (2, lambda M, a, p: M.clamp(a[0], max=a[1])),
}

ELEMENTWISE = sorted(FORMS)

# array forms: (input shapes, output shape, fn); "A" is SHAPE, "S" is 0-d
ARRAY_FORMS = {
    "sum": (("A",), "S", lambda M, a, p: a[0].sum()),
    "mean": (("A",), "S", lambda M, a, p: a[0].mean()),
    "sum_dim_bcast": (("A", "A"), "A", lambda M, a, p: a[0].sum(0) * a[1]),
    "mean_keepdim_bcast": (("A", "A"), "A",
                           lambda M, a, p: a[0].mean(1, keepdim=True) + a[1]),
    "matmul": (("A", "A", "A"), "A",
               lambda M, a, p: (a[0] @ a[1].transpose(0, 1)) @ a[2] * 0.3),
    "matmul_vec": (("A", "A"), "A",
                   lambda M, a, p: a[1] * (a[0].reshape(6) @ a[1].reshape(6)) * 0.2),
    "reshape": (("A",), "A", lambda M, a, p: a[0].reshape(3, 2).transpose(0, 1)),
    "getitem_rows": (("A",), "A", lambda M, a, p: a[0][[1, 0]]),
    "getitem_repeat": (("A",), "A", lambda M, a, p: a[0][:, [2, 2, 0]]),
    "getitem_slice": (("A", "A"), "A",
                      lambda M, a, p: M.stack([a[0][1], a[1][0]])),
    "getitem_scalar": (("A",), "S", lambda M, a, p: a[0][1, 2]),
    "stack_scalars": (("S", "S", "S", "S", "S", "S"), "A",
                      lambda M, a, p: M.stack(list(a)).reshape(2, 3)),
    "scalar_bcast": (("A", "S"), "A", lambda M, a, p: a[0] * a[1] + a[1]),
}


def test_every_elementwise_registry_op_has_a_form():
    ops = {op.name for op in OPS if op.kind in (UNARY, UNARY_C, BINARY)}
    assert ops == set(FORMS), (f"ops without a random-program form: {sorted(ops - set(FORMS))}"
                               f"; forms for unknown ops: {sorted(set(FORMS) - ops)}")


# --- generation -------------------------------------------------------------------------------


def _params(rng):
    lo = float(rng.uniform(-1.0, 0.5))
    return {
        "pos": int(rng.integers(0, 3)),
        "c": float(rng.choice([rng.uniform(-2.0, 2.0), 2.0, 0.5, -1.0])),
        "cnz": float(rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 2.0)),
        "e": float(rng.choice([rng.uniform(-2.0, 2.5), 2.0, 3.0, -1.0, 0.5, 0.0])),
        "b": float(rng.uniform(0.3, 3.0)),
        "lo": lo,
        "hi": lo + float(rng.uniform(0.2, 1.5)),
        "beta": float(rng.choice([1.0, rng.uniform(0.5, 2.0)])),
        "thr": float(rng.choice([20.0, rng.uniform(0.0, 2.0)])),
    }


def make_program(seed, arrays, n_ops):
    """A program: inputs (values, requires_grad) and instructions (form, input nodes, params).

    Nodes are numbered in creation order: inputs first, then one node per instruction.
    """
    rng = np.random.default_rng(seed)
    inputs, kinds = [], []
    n_scalar = int(rng.integers(2, 5))
    for i in range(n_scalar):
        inputs.append((float(rng.uniform(-1.5, 1.5)), i != n_scalar - 1 or arrays))
        kinds.append("S")
    if arrays:
        for i in range(int(rng.integers(2, 4))):
            inputs.append((rng.uniform(-1.5, 1.5, SHAPE), i < 2))
            kinds.append("A")
    instrs, consumed = [], set()
    for _ in range(n_ops):
        p = _params(rng)
        if arrays and rng.random() < 0.3:
            name = str(rng.choice(sorted(ARRAY_FORMS)))
            in_kinds, out_kind, _ = ARRAY_FORMS[name]
            args = []
            for k in in_kinds:
                pool = [i for i, kk in enumerate(kinds) if kk == k]
                args.append(_pick(rng, pool))
        else:
            name = str(rng.choice(ELEMENTWISE))
            arity = FORMS[name][0]
            fresh = [i for i in range(len(inputs)) if i not in consumed]
            first = fresh[0] if fresh else _pick(rng, list(range(len(kinds))))
            args = [first]
            if arity == 2:
                # a partner of either kind: 0-d and (2, 3) broadcast together
                args.append(_pick(rng, list(range(len(kinds)))))
            out_kind = "A" if any(kinds[i] == "A" for i in args) else "S"
        instrs.append((name, tuple(args), p))
        consumed.update(args)
        kinds.append(out_kind)
    return inputs, instrs


def _pick(rng, pool):
    """Prefer recent nodes (deep chains) but reach back to any node (DAG sharing)."""
    if rng.random() < 0.6:
        return pool[-1 - int(rng.integers(0, min(3, len(pool))))]
    return pool[int(rng.integers(0, len(pool)))]


def evaluate(M, program, use_backward=False):
    """Run ``program`` in ``M``; returns (node values, output value, leaf gradients)."""
    inputs, instrs = program
    nodes, leaves = [], []
    for value, rg in inputs:
        t = M.tensor(value, dtype=M.float64, requires_grad=rg)
        nodes.append(t)
        if rg:
            leaves.append(t)
    for name, args, p in instrs:
        a = [nodes[i] for i in args]
        fn = FORMS[name][1] if name in FORMS else ARRAY_FORMS[name][2]
        nodes.append(fn(M, a, p))
    # the output: a weighted sum of the sinks (computed nodes that no later node uses)
    used = {i for _, args, _ in instrs for i in args}
    y = None
    for j in range(len(inputs), len(nodes)):
        if j in used:
            continue
        term = nodes[j].sum() * (1.0 if j % 2 else -0.5)
        y = term if y is None else y + term
    if not y.requires_grad:
        return nodes, y, None
    if use_backward:
        M.autograd.backward(y)
        grads = [t.grad for t in leaves]
    else:
        grads = M.autograd.grad(y, leaves, allow_unused=True)
    return nodes, y, grads


def values(t):
    return np.asarray(t.detach().numpy(), dtype=np.float64)


def listing(program):
    inputs, instrs = program
    lines = [f"%{i} = input {np.round(v, 4).tolist()} rg={rg}"
             for i, (v, rg) in enumerate(inputs)]
    for j, (name, args, p) in enumerate(instrs):
        lines.append(f"%{len(inputs) + j} = {name}({', '.join(f'%{a}' for a in args)})  "
                     f"{ {k: round(v, 4) for k, v in p.items()} }")
    return "\n".join(lines)


def well_defined(nodes):
    for t in nodes:
        v = values(t)
        if not np.all(np.isfinite(v)) or np.any(np.abs(v) > LIMIT):
            return False
    return True


def check_program(seed, arrays, n_ops):
    """Draw a well-defined program from ``seed`` (redrawing if needed) and compare."""
    for attempt in range(20):
        program = make_program(seed * 1000 + attempt, arrays, n_ops)
        nodes_p, y_p, grads_p = evaluate(torch, program)
        if well_defined(nodes_p) and (grads_p is None or all(
                g is None or np.all(np.isfinite(values(g))) for g in grads_p)):
            break
    else:
        pytest.fail(f"seed {seed}: no well-defined program in 20 draws")
    use_backward = seed % 3 == 2
    # warnings are compared too: a well-defined program warns in neither library, whatever
    # the user's warning filters are ("always" here)
    with warnings.catch_warnings(record=True) as warned_p:
        warnings.simplefilter("always")
        nodes_p, y_p, grads_p = evaluate(torch, program, use_backward)
    with warnings.catch_warnings(record=True) as warned_t:
        warnings.simplefilter("always")
        nodes_t, y_t, grads_t = evaluate(tg, program, use_backward)
    where = f"seed {seed} (arrays={arrays}):\n{listing(program)}"
    extra = {str(w.message) for w in warned_t} - {str(w.message) for w in warned_p}
    assert not extra, f"tapegrad warned {sorted(extra)} where torch did not\n{where}"
    assert len(nodes_t) == len(nodes_p)
    # libm results differ by an ulp between the libraries; where a program cancels
    # (1 - tanh(big)) that ulp becomes a large relative error of a tiny value. So values and
    # gradients also pass within an absolute floor 1e-2 * RTOL of the program's largest one.
    vscale = max(float(np.max(np.abs(values(b)))) for b in nodes_p)
    for i, (a, b) in enumerate(zip(nodes_t, nodes_p)):
        assert tuple(a.shape) == tuple(b.shape), f"node %{i} shape\n{where}"
        assert a.requires_grad == b.requires_grad, f"node %{i} requires_grad\n{where}"
        np.testing.assert_allclose(values(a), values(b), rtol=RTOL,
                                   atol=RTOL * 1e-2 * max(1.0, vscale),
                                   err_msg=f"value of node %{i}\n{where}")
    if grads_p is None:
        assert grads_t is None
        return
    scale = max([1.0] + [float(np.max(np.abs(values(g)))) for g in grads_p if g is not None])
    for i, (a, b) in enumerate(zip(grads_t, grads_p)):
        if b is None:
            assert a is None, f"gradient {i} should be None\n{where}"
            continue
        assert a is not None, f"gradient {i} is None\n{where}"
        assert tuple(a.shape) == tuple(b.shape)
        np.testing.assert_allclose(values(a), values(b), rtol=RTOL, atol=RTOL * 1e-2 * scale,
                                   err_msg=f"gradient of leaf {i}\n{where}")


# --- tiers ------------------------------------------------------------------------------------

N_DEFAULT = 100     # programs per kind in the default tier (200 in all)
N_SLOW = 2000


@pytest.mark.parametrize("block", range(4))
def test_random_scalar_programs(block):
    per = N_DEFAULT // 4
    for seed in range(block * per, (block + 1) * per):
        check_program(seed, arrays=False, n_ops=12 + seed % 13)


@pytest.mark.parametrize("block", range(4))
def test_random_array_programs(block):
    per = N_DEFAULT // 4
    for seed in range(block * per, (block + 1) * per):
        check_program(10_000 + seed, arrays=True, n_ops=10 + seed % 11)


@pytest.mark.slow
@pytest.mark.parametrize("block", range(10))
def test_random_scalar_programs_slow(block):
    per = N_SLOW // 10
    for seed in range(100_000 + block * per, 100_000 + (block + 1) * per):
        check_program(seed, arrays=False, n_ops=10 + seed % 40)


@pytest.mark.slow
@pytest.mark.parametrize("block", range(10))
def test_random_array_programs_slow(block):
    per = N_SLOW // 10
    for seed in range(200_000 + block * per, 200_000 + (block + 1) * per):
        check_program(seed, arrays=True, n_ops=10 + seed % 30)


from conftest import set_rollover as _set_rollover  # noqa: E402


@pytest.mark.parametrize("arrays", [False, True])
def test_random_programs_across_small_tapes(monkeypatch, arrays):
    # every few entries the recorder starts a new tape: each backward spans many tapes and
    # values reach later tapes through import entries
    _set_rollover(monkeypatch, 7)
    for seed in range(25):
        check_program(50_000 + seed + (1000 if arrays else 0), arrays=arrays,
                      n_ops=10 + seed % 11)


def test_no_numpy_warnings_from_well_defined_array_ops():
    # torch computes these without a warning; so must tapegrad, whatever the user's filters
    def run(M):
        x = M.tensor([-800.0, 0.5, 800.0], dtype=M.float64, requires_grad=True)
        z = M.tensor([0.0, 1.0, 4.0], dtype=M.float64, requires_grad=True)
        ys = [M.sigmoid(x), M.exp(x), M.log(z), M.sqrt(z), M.rsqrt(z), 1.0 / z, M.cosh(x),
              M.softmax(x, 0), M.tanh(x)]
        y = sum(t.sum() for t in ys[:1]) + (M.sigmoid(x) * z).sum()
        M.autograd.grad(y, [x, z])
        return [values(t) for t in ys]
    with warnings.catch_warnings(record=True) as warned_p:
        warnings.simplefilter("always")
        vp = run(torch)
    with warnings.catch_warnings(record=True) as warned_t:
        warnings.simplefilter("always")
        vt = run(tg)
    assert not warned_p
    for a, b in zip(vt, vp):
        np.testing.assert_allclose(a, b, rtol=RTOL)
    assert [str(w.message) for w in warned_t] == []


def test_generator_is_deterministic():
    assert listing(make_program(7, True, 15)) == listing(make_program(7, True, 15))
    assert listing(make_program(7, True, 15)) != listing(make_program(8, True, 15))


def test_generator_covers_every_form():
    seen = set()
    for seed in range(N_DEFAULT):
        for arrays, base in ((False, 0), (True, 10_000)):
            seen.update(name for name, _, _ in
                        make_program((base + seed) * 1000, arrays, 10 + seed % 11)[1])
    assert set(FORMS) | set(ARRAY_FORMS) <= seen, sorted(set(FORMS) | set(ARRAY_FORMS) - seen)
