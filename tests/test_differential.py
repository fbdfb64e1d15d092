"""The differential harness: random programs (tests/harness/programs.py) over every
differentiable op, run in tapegrad and torch, compared leg by leg: values, gradients,
create_graph gradients and a Hessian-vector product, third-order derivatives (scalar
programs), is_grads_batched, backward() accumulating twice, and every backward path
FORCED (tapegrad.autograd.paths) on the programs it accepts.

A leg is a function ``leg(M, prog, ctx, first)`` returning a list of results (arrays or
None) for library ``M``; ``ctx`` is reserved for what legs of one program share (None
today); ``first`` is a context manager for its first differentiation (a forced path
applies there). Adding a leg (replay at new inputs, batched replay...) is one
such function and one entry in ``LEGS``.

A failing program is shrunk to a smallest one that still fails and printed as runnable
code (tapegrad and torch) with its seed. Default tier: a few hundred seeded programs
(about a minute); ``-m slow``: thousands.
"""
import collections
import contextlib
import traceback
import warnings

import numpy as np
import pytest

import tapegrad as tg
import tapegrad.tape as tape_mod
from tapegrad.autograd import paths
from tapegrad.ops import ARRAY, OPS

torch = pytest.importorskip("torch")

from harness.programs import (FAMILIES, generate, helpers,  # noqa: E402
                              shrink)

RTOL = 1e-10
#: ops a program never records: bookkeeping, and the trace-only ones (the replay legs')
NOT_GENERATED = {"leaf", "const", "import_"}
TRACE_ONLY_KINDS = ("compare", "replay")


class NotApplicable(Exception):
    """The leg does not apply to this program (torch rejects it, a forced path declines, or
    tapegrad says clearly that it does not implement it)."""


# --- legs ----------------------------------------------------------------------------------

def _arr(t):
    if t is None:
        return None
    if isinstance(t, torch.Tensor) and t._is_zerotensor():
        return np.zeros(tuple(t.shape))  # torch's internal zero (API.md: we give plain zeros)
    return np.array(t.detach().numpy(), dtype=np.float64)  # a copy: .grad changes in place


def leg_values(M, prog, ctx, first):
    xs, nodes, y = prog.run(M)
    return [_arr(t) for t in nodes] + [_arr(y)]


def _used(M, prog):
    """Inputs, their used subset (torch decides), and the loss."""
    xs, nodes, y = prog.run(M)
    if not y.requires_grad:
        raise NotApplicable("the loss does not require grad")
    return xs, [xs[i] for i in ctx_used(prog)], y


_USED = {}


def ctx_used(prog):
    """Indices of the inputs the loss depends on (from torch, once per program)."""
    key = prog.source(), repr(prog.inputs)
    got = _USED.get(key)
    if got is None:
        xs, nodes, y = prog.run(torch)
        rg = [i for i, x in enumerate(xs) if x.requires_grad]
        if not y.requires_grad or not rg:
            got = ()
        else:
            gs = torch.autograd.grad(y, [xs[i] for i in rg], allow_unused=True)
            got = tuple(i for i, g in zip(rg, gs) if g is not None)
        if len(_USED) > 64:
            _USED.clear()
        _USED[key] = got
    if not got:
        raise NotApplicable("the loss depends on no input")
    return got


def leg_grad(M, prog, ctx, first):
    """First-order gradients, default options (so the fast paths may take it)."""
    xs, used, y = _used(M, prog)
    with first():
        gs = M.autograd.grad(y, used)
    return [_arr(g) for g in gs]


def leg_hvp(M, prog, ctx, first):
    """create_graph gradients, then a Hessian-vector product through them."""
    xs, used, y = _used(M, prog)
    with first():
        gs = M.autograd.grad(y, used, create_graph=True)
    rng = np.random.default_rng(prog.seed)
    s = None
    for g in gs:
        v = M.tensor(rng.uniform(-1, 1, tuple(g.shape)), dtype=M.float64)
        term = (g * v).sum()
        s = term if s is None else s + term
    out = [_arr(g) for g in gs]
    if s.requires_grad:
        hs = M.autograd.grad(s, used, allow_unused=True, materialize_grads=True)
        out += [_arr(h) for h in hs]
    else:
        out += [np.zeros(tuple(x.shape)) for x in used]
    return out


def leg_third(M, prog, ctx, first):
    """A third derivative: d/dx_j of d/dx0 of d/dx0 of the loss (scalar programs)."""
    if not prog.scalar:
        raise NotApplicable("third order runs on scalar programs")
    xs, used, y = _used(M, prog)
    x0 = used[0]
    with first():
        (g,) = M.autograd.grad(y, x0, create_graph=True)
    out = [_arr(g)]
    if not g.requires_grad:
        return out + [0.0, [0.0] * len(used)]
    (g2,) = M.autograd.grad(g, x0, create_graph=True, allow_unused=True,
                            materialize_grads=True)
    out.append(_arr(g2))
    if not g2.requires_grad:
        return out + [np.zeros(len(used))]
    g3 = M.autograd.grad(g2, used, allow_unused=True, materialize_grads=True)
    return out + [np.array([float(_arr(t)) for t in g3])]


def leg_batched(M, prog, ctx, first):
    """is_grads_batched: the loss and the last non-scalar node that requires grad, seeded
    with a batch of 3."""
    xs, nodes, y = prog.run(M)
    used = [xs[i] for i in ctx_used(prog)]
    rng = np.random.default_rng(prog.seed + 1)
    outs = [y]
    for t in reversed(nodes):
        if t.requires_grad and t.ndim > 0 and t is not y:
            outs.append(t)
            break
    gos = [M.tensor(rng.uniform(-1, 1, (3,) + tuple(t.shape)), dtype=M.float64) for t in outs]
    with first():
        gs = M.autograd.grad(outs, used, gos, is_grads_batched=True, allow_unused=True,
                             materialize_grads=True)
    return [_arr(g) for g in gs]


def leg_backward(M, prog, ctx, first):
    """backward() twice on one graph: .grad accumulates."""
    xs, used, y = _used(M, prog)
    with first():
        M.autograd.backward(y, retain_graph=True)
    out = [_arr(x.grad) for x in used]
    y.backward()
    return out + [_arr(x.grad) for x in used]


LEGS = {
    "values": leg_values,
    "grad": leg_grad,
    "hvp": leg_hvp,
    "third": leg_third,
    "batched": leg_batched,
    "backward": leg_backward,
}
#: the leg each forced path runs (a path applies to the first differentiation only)
FORCED = {
    "scalar": "grad", "flat": "grad", "fused": "grad", "sweep": "grad", "checked": "grad",
    "record": "hvp", "rerecord": "hvp", "batched": "batched",
}
#: the general path each fast path is also compared with
GENERAL_FOR = {"scalar": "sweep", "flat": "sweep", "fused": "sweep", "record": "rerecord"}
#: relative tolerance per leg (higher orders compound ulps of libm)
LEG_RTOL = {"hvp": 1e-9, "third": 1e-8}


# --- running and comparing -----------------------------------------------------------------

def run_leg(M, leg, prog, first=contextlib.nullcontext, took=None):
    """(results, warnings) of a leg in library ``M``; raises NotApplicable. ``took`` gets
    the path the leg's first differentiation took."""
    @contextlib.contextmanager
    def first_noted():
        with first():
            yield
        if took is not None:
            took.append(paths.last())

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            out = LEGS[leg](M, prog, None, first_noted)
        except paths.PathDeclined as e:
            raise NotApplicable(str(e)) from None
        except NotApplicable:
            raise
        except Exception as e:
            if M is torch:  # torch cannot run it (vmap over a custom Function...)
                raise NotApplicable(f"torch: {type(e).__name__}: {e}") from None
            if isinstance(e, NotImplementedError):
                raise NotApplicable(f"tapegrad: {e}") from None
            raise
    return out, {str(w.message) for w in warned}


def compare(prog, leg, got, want, rtol):
    """None when ``got`` (tapegrad) matches ``want`` (torch), else what differs."""
    if prog.has_cast:
        rtol = max(rtol, 1e-5)  # float32 rounding of a value or gradient a ulp apart
    if any(i.form == "multigammaln" for i in prog.instrs):
        rtol = max(rtol, 1e-8)  # torch's trigamma is off by up to 5e-10 (tapegrad's 3e-16)
    if len(got) != len(want):
        return f"{len(got)} results, torch has {len(want)}"
    scale = max([1.0] + [float(np.max(np.abs(w))) for w in want
                         if w is not None and np.size(w)])
    for i, (a, b) in enumerate(zip(got, want)):
        if (a is None) != (b is None):
            return f"result {i}: {'None' if a is None else 'a value'}, torch has " \
                   f"{'None' if b is None else 'a value'}"
        if a is None:
            continue
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            return f"result {i}: shape {a.shape}, torch has {b.shape}"
        # libm differs by an ulp between the libraries; where a program cancels, that ulp
        # is a large relative error of a tiny value: pass within a floor of the largest
        if not np.allclose(a, b, rtol=rtol, atol=rtol * 0.1 * scale, equal_nan=True):
            return f"result {i}:\n  tapegrad {a.tolist()}\n  torch    {b.tolist()}"
    return None


class Stats:
    """Per run: how often each path ran (default or forced) and each leg did not apply."""

    def __init__(self):
        self.paths = collections.Counter()
        self.forced = collections.Counter()
        self.skipped = collections.Counter()


def _failure(prog, leg, path, why):
    """Does ``leg`` (with ``path`` forced) still fail on ``prog``? (for the shrinker)"""
    return _check(prog, leg, path, Stats()) is not None


def _check(prog, leg, path, stats):
    """None, or a string saying how ``leg`` (``path`` forced, when given) fails."""
    try:
        want, warned_p = run_leg(torch, leg, prog)
    except NotApplicable:
        stats.skipped[(leg, "torch")] += 1
        return None
    first = (lambda: paths.force(path)) if path else contextlib.nullcontext
    took = []
    try:
        got, warned_t = run_leg(tg, leg, prog, first, took)
    except NotApplicable as e:
        stats.skipped[(leg, path or "-", str(e)[:60])] += 1
        return None
    except Exception as e:
        return "tapegrad raised " + "".join(traceback.format_exception_only(e)).strip()
    if path:
        stats.forced[path] += 1
    elif took:
        stats.paths[took[0]] += 1
    extra = warned_t - warned_p
    if extra:
        return f"tapegrad warned {sorted(extra)} where torch did not"
    why = compare(prog, leg, got, want, LEG_RTOL.get(leg, RTOL))
    if why is None and path in GENERAL_FOR:  # a fast path also agrees with the general one
        general = GENERAL_FOR[path]
        ref, _ = run_leg(tg, leg, prog, lambda: paths.force(general))
        why = compare(prog, leg, got, ref, LEG_RTOL.get(leg, RTOL))
        if why is not None:
            why = f"differs from the {general!r} path: {why}"
    return why


DRIVERS = {
    "values": "nodes, y = program(M, H, *xs)\nprint(M.__name__, [n.tolist() for n in nodes])",
    "grad": ("nodes, y = program(M, H, *xs)\nwith {first}:\n"
             "    gs = M.autograd.grad(y, {used})\nprint(M.__name__, gs)"),
    "hvp": ("nodes, y = program(M, H, *xs)\nwith {first}:\n"
            "    gs = M.autograd.grad(y, {used}, create_graph=True)\nprint(M.__name__, gs)\n"
            "s = sum((g * M.ones_like(g)).sum() for g in gs)\n"
            "print(M.__name__, M.autograd.grad(s, {used}, allow_unused=True))"),
    "third": ("nodes, y = program(M, H, *xs)\nx = {used}[0]\nwith {first}:\n"
              "    (g,) = M.autograd.grad(y, x, create_graph=True)\n"
              "(g2,) = M.autograd.grad(g, x, create_graph=True)\n"
              "print(M.__name__, g, g2, M.autograd.grad(g2, {used}, allow_unused=True))"),
    "batched": ("nodes, y = program(M, H, *xs)\nwith {first}:\n"
                "    gs = M.autograd.grad(y, {used}, M.ones(3, dtype=M.float64), "
                "is_grads_batched=True)\nprint(M.__name__, gs)"),
    "backward": ("nodes, y = program(M, H, *xs)\nwith {first}:\n"
                 "    M.autograd.backward(y, retain_graph=True)\ny.backward()\n"
                 "print(M.__name__, [x.grad for x in {used}])"),
}


def report(prog, leg, path, why):
    """The assertion message: the seed, the failure, and the shrunk program as code."""
    small = shrink(prog, lambda p: _failure(p, leg, path, why), budget=150)
    why_small = _check(small, leg, path, Stats()) or why
    try:
        used = "[" + ", ".join(f"xs[{i}]" for i in ctx_used(small)) + "]"
    except NotApplicable:
        used = "xs"
    first = (f"(tapegrad.autograd.paths.force({path!r}) if M is tapegrad else "
             "contextlib.nullcontext())" if path else "contextlib.nullcontext()")
    driver = DRIVERS[leg].format(used=used, first=first)
    return (f"seed {prog.seed}: leg {leg!r}{f' with path {path!r} forced' if path else ''}: "
            f"{why}\n--- shrunk to {len(small.instrs)} instructions ({why_small}) ---\n"
            f"{small.code(driver)}")


def check_program(prog, stats, legs=None, forced=None):
    """Every leg (and every forced path) on ``prog``; asserts with a shrunk reproducer."""
    for leg in legs or LEGS:
        if leg == "third" and not prog.scalar:
            continue
        why = _check(prog, leg, None, stats)
        if why is not None:
            pytest.fail(report(prog, leg, None, why), pytrace=False)
    for path in forced or ():
        why = _check(prog, FORCED[path], path, stats)
        if why is not None:
            pytest.fail(report(prog, FORCED[path], path, why), pytrace=False)


# --- coverage ------------------------------------------------------------------------------

def _differentiable_ops():
    return {op.name for op in OPS
            if op.name not in NOT_GENERATED and op.kind not in TRACE_ONLY_KINDS}


def _recorded(ts):
    tapes = {id(t._tape): t._tape for t in ts if getattr(t, "_tape", None) is not None}
    return {OPS[c & ~ARRAY].name for tape in tapes.values()
            for c in np.unique(tape.rows()[:, 0].astype(np.int64)).tolist()}


def test_generator_covers_every_differentiable_op(monkeypatch):
    # what the programs record on tapegrad's tape (forward, and the rules create_graph
    # re-records up to second order), not what the forms claim
    seen, declared = set(), set()
    want = _differentiable_ops()
    for seed in range(300):
        if seed >= 40 and want <= seen:
            break
        for fam, kw in FAMILIES.items():
            prog = generate(seed, 14, **kw)
            declared |= prog.ops
            # each program on a tape of its own: the scans below stay short
            monkeypatch.setattr(tape_mod.STATE, "tape", tape_mod._no_tape)
            xs, nodes, y = prog.run(tg)
            seen |= _recorded(nodes)
            if not y.requires_grad or not ctx_used_or_none(prog):
                continue
            used = [xs[i] for i in ctx_used(prog)]
            with contextlib.suppress(NotImplementedError):
                gs = tg.autograd.grad(y, used, create_graph=True)
                seen |= _recorded(gs)
                s = sum((g * 1.0).sum() for g in gs)
                if s.requires_grad:
                    seen |= _recorded(tg.autograd.grad(s, used, create_graph=True,
                                                       allow_unused=True))
    missing = _differentiable_ops() - seen
    assert not missing, f"registered ops no random program records: {sorted(missing)}"
    assert not declared - seen, f"forms claim ops never recorded: {sorted(declared - seen)}"


def ctx_used_or_none(prog):
    try:
        return ctx_used(prog)
    except NotApplicable:
        return None


def test_generator_is_deterministic():
    assert generate(7, 15).source() == generate(7, 15).source()
    assert generate(7, 15).source() != generate(8, 15).source()


# --- tiers ---------------------------------------------------------------------------------

#: family -> (programs in the default tier, ops per program, paths forced, minimum runs of
#: each path (default or forced) the family must reach)
TIERS = {
    "scalar": (120, (8, 20), ("scalar", "record", "sweep", "rerecord", "checked"),
               {"scalar": 100, "record": 100, "sweep": 80, "rerecord": 80, "checked": 80}),
    "flat": (100, (6, 14), ("flat", "fused", "sweep", "checked"),
             {"flat": 60, "fused": 3, "sweep": 80, "checked": 80}),
    "array": (240, (6, 16), ("sweep", "rerecord", "checked", "batched"),
              {"sweep": 200, "rerecord": 160, "checked": 200, "batched": 120}),
    # einsum, linalg.norm's orders, %, fmod, //, multigammaln, sort, cross, in-place methods
    # (custom Functions among them: the batched path declines those, as torch's vmap)
    "surface": (100, (6, 14), ("sweep", "rerecord", "checked", "batched"),
                {"sweep": 150, "rerecord": 80, "checked": 80, "batched": 50}),
}
#: forced fused compiles one loop per structure (a second or more each): the default tier
#: forces it on this many programs
FUSED_DEFAULT = 6


def _run_family(fam, seeds, n_fused):
    n, (lo, hi), forced, minimum = TIERS[fam]
    stats = Stats()
    fused_left = n_fused
    for seed in seeds:
        prog = generate(seed, lo + seed % (hi - lo + 1), **FAMILIES[fam])
        fp = [p for p in forced if p != "fused" or fused_left > 0]
        before = stats.forced["fused"]
        check_program(prog, stats, forced=fp)
        fused_left -= stats.forced["fused"] - before
    return stats, minimum


@pytest.mark.parametrize("fam", list(TIERS))
def test_differential(fam):
    n = TIERS[fam][0]
    base = {"scalar": 0, "flat": 10_000, "array": 20_000, "surface": 30_000}[fam]
    stats, minimum = _run_family(fam, range(base, base + n), FUSED_DEFAULT)
    ran = stats.paths + stats.forced
    short = {p: (ran[p], m) for p, m in minimum.items() if ran[p] < m}
    assert not short, (f"paths exercised fewer times than required (ran, minimum): {short}; "
                       f"skipped: {dict(stats.skipped)}")


@pytest.mark.slow
@pytest.mark.parametrize("block", range(8))
@pytest.mark.parametrize("fam", list(TIERS))
def test_differential_slow(fam, block):
    base = {"scalar": 100_000, "flat": 200_000, "array": 300_000,
            "surface": 400_000}[fam] + block * 500
    _run_family(fam, range(base, base + 500), 100)  # fused: a compile per structure


from conftest import set_rollover as _set_rollover  # noqa: E402


@pytest.mark.parametrize("fam", ["scalar", "array"])
def test_differential_across_small_tapes(monkeypatch, fam):
    # every few entries the recorder starts a new tape: each backward spans many tapes and
    # values reach later tapes through import entries
    _set_rollover(monkeypatch, 7)
    stats = Stats()
    n, (lo, hi), forced, _ = TIERS[fam]
    for seed in range(50_000, 50_015):
        check_program(generate(seed, lo + seed % (hi - lo + 1), **FAMILIES[fam]), stats,
                      forced=[p for p in forced if p in paths.GENERAL])


def test_no_numpy_warnings_from_well_defined_array_ops():
    # torch computes these without a warning; so must tapegrad, whatever the user's filters
    def run(M):
        x = M.tensor([-800.0, 0.5, 800.0], dtype=M.float64, requires_grad=True)
        z = M.tensor([0.0, 1.0, 4.0], dtype=M.float64, requires_grad=True)
        e = M.tensor([[]], dtype=M.float64, requires_grad=True)
        ys = [M.sigmoid(x), M.exp(x), M.log(z), M.sqrt(z), M.rsqrt(z), 1.0 / z, M.cosh(x),
              M.softmax(x, 0), M.tanh(x), e.mean(), M.softmax(e, 1), M.log_softmax(e, 1)]
        y = (M.sigmoid(x) * z).sum() + M.norm(z * 0.0, dim=0)
        g = M.autograd.grad(y, [x, z], create_graph=True)
        M.autograd.grad(g[1].sum(), z)
        return [_arr(t) for t in ys]
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


# --- the harness itself ---------------------------------------------------------------------

def test_shrinker_finds_a_smallest_program_and_prints_it_runnable(capsys):
    prog = next(p for p in (generate(s, 14) for s in range(100))
                if any(i.code.startswith("{out} = M.cat(") for i in p.instrs))

    def has_cat(p):
        return any(i.code.startswith("{out} = M.cat(") for i in p.instrs)
    small = shrink(prog, has_cat)
    assert has_cat(small) and len(small.instrs) == 1
    assert all(np.size(v) <= np.size(w) for (v, _), (w, _) in zip(small.inputs, prog.inputs))
    used = "[" + ", ".join(f"xs[{i}]" for i in ctx_used(small)) + "]"
    code = small.code(DRIVERS["grad"].format(used=used, first="contextlib.nullcontext()"))
    exec(compile(code, "<reproducer>", "exec"), {"__name__": "reproducer"})
    out = capsys.readouterr().out
    assert out.startswith("tapegrad (tensor(") and "\ntorch (tensor(" in out


def test_a_failure_reports_seed_and_shrunk_code(monkeypatch):
    # a deliberately wrong rule (cos's derivative negated) must be caught, shrunk and printed
    from tapegrad.ops import BY_NAME
    op = BY_NAME["cos"]
    real = op.vjp
    prog = next(p for p in (generate(s, 12, arrays=False) for s in range(200))
                if any(i.form == "cos" for i in p.instrs) and _check(p, "hvp", None, Stats())
                is None)
    monkeypatch.setattr(op, "vjp", lambda F, g, a, out: tuple(-r for r in real(F, g, a, out)))
    why = _check(prog, "hvp", "rerecord", Stats())
    assert why is not None
    msg = report(prog, "hvp", "rerecord", why)
    assert msg.startswith(f"seed {prog.seed}: leg 'hvp' with path 'rerecord' forced")
    assert "M.cos(" in msg and "def program(M, H" in msg and "for M in (tapegrad, torch)" in msg
    small = msg.split("--- shrunk to ")[1]
    assert int(small.split()[0]) <= 3


# --- paths ----------------------------------------------------------------------------------

def test_paths_force_disable_and_last():
    x = tg.tensor(1.5, requires_grad=True)
    assert tg.autograd.grad(x * x, x)[0].item() == 3.0 and paths.last() == "scalar"
    with paths.force("sweep"):
        assert tg.autograd.grad(x * x, x)[0].item() == 3.0
    assert paths.last() == "sweep"
    with paths.disable("scalar"):
        tg.autograd.grad(x * x, x)
    assert paths.last() == "sweep"
    with paths.force("checked"):  # the checked sweep, anomaly mode off
        tg.autograd.grad(x * x, x)
    assert paths.last() == "checked"
    with paths.force("record"):
        (g,) = tg.autograd.grad(x * x * x, x, create_graph=True)
    assert paths.last() == "record" and g.item() == 6.75
    a = tg.tensor(np.arange(3.0), requires_grad=True)
    for name in ("flat", "fused"):  # fused compiles at once when forced
        with paths.force(name):
            assert tg.autograd.grad((a * a).sum(), a)[0].tolist() == [0.0, 2.0, 4.0]
        assert paths.last() == name
    with pytest.raises(ValueError, match="unknown backward path"):
        with paths.force("fast"):
            pass


@pytest.mark.parametrize("name", ["flat", "fused", "record", "batched", "rerecord"])
def test_a_forced_path_that_declines_raises_and_consumes_nothing(name):
    x = tg.tensor(1.5, requires_grad=True)
    y = x * x
    with pytest.raises(paths.PathDeclined, match=f"forced backward path '{name}' declined"):
        with paths.force(name):
            tg.autograd.grad(y, x)
    # nothing ran and nothing was freed: the default path still takes the graph
    assert tg.autograd.grad(y, x)[0].item() == 3.0


def test_backward_reports_its_path_and_declines_fast_paths():
    x = tg.tensor([1.0, 2.0], requires_grad=True)
    (x * x).sum().backward()
    assert paths.last() == "sweep"
    with pytest.raises(paths.PathDeclined):
        with paths.force("scalar"):
            (x * x).sum().backward()
    with paths.disable("sweep"), pytest.raises(paths.PathDeclined):
        (x * x).sum().backward()


def test_paths_are_per_thread():
    import threading
    seen = []

    def other():
        x = tg.tensor(2.0, requires_grad=True)
        tg.autograd.grad(x * x, x)
        seen.append(paths.last())
    with paths.force("sweep"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == ["scalar"]


# --- regressions the harness found (each compared to torch) ---------------------------------

def _both(fn):
    return [fn(tg), fn(torch)]


def _close(pair, rtol=1e-12):
    a, b = pair
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=1e-14)


def test_mean_over_a_dim_second_order():
    # create_graph counted 1/numel instead of 1/(slice size): wrong, silently
    a = np.arange(6.).reshape(2, 3) / 7 + 0.3
    w = np.linspace(-1, 1, 2).reshape(2, 1)

    def run(M):
        x = M.tensor(a, dtype=M.float64, requires_grad=True)
        (g,) = M.autograd.grad((x.mean(dim=1, keepdim=True) * M.tensor(w)).sum(), x,
                               create_graph=True)
        (h,) = M.autograd.grad((g * x.mean(dim=0)).sum(), x)
        return [_arr(g), _arr(h)]
    _close(_both(run))


@pytest.mark.parametrize("f", ["max", "min", "amax", "amin"])
def test_reduction_of_a_0d_tensor_under_create_graph(f):
    # the rule multiplied a NumPy bool scalar by a tensor: TypeError
    def run(M):
        x = M.tensor(0.7, dtype=M.float64, requires_grad=True)
        y = getattr(x, f)() if f in ("max", "min") else getattr(M, f)(x)
        (g,) = M.autograd.grad(y * x, x, create_graph=True)
        return [_arr(g), _arr(M.autograd.grad(g, x)[0])]
    _close(_both(run))


def test_batched_grad_through_setitem_on_a_clone():
    # setitem's batch rule summed the written value's gradient across the batch axis
    def run(M):
        a = M.tensor([1.0, 2.0, 3.0], dtype=M.float64, requires_grad=True)
        b = M.tensor([0.5, -1.0], dtype=M.float64, requires_grad=True)
        c = a.clone()
        c[0] = b.sum()
        c[1:] = a[1:] * b
        go = M.tensor(np.arange(6.0).reshape(2, 3), dtype=M.float64)
        return [_arr(g) for g in M.autograd.grad(c, [a, b], go, is_grads_batched=True)]
    _close(_both(run))


@pytest.mark.parametrize("create_graph", [False, True])
def test_batched_grad_through_expand_and_broadcasting(create_graph):
    # expand / sum_to aligned the batch axis with a data axis
    def run(M):
        s = M.tensor(0.5, dtype=M.float64, requires_grad=True)
        v = M.tensor([1.0, -2.0, 3.0], dtype=M.float64, requires_grad=True)
        y = s.expand((2, 2)).sum() + (v.expand((2, 3)) * M.tensor([[1.0], [2.0]])).sum()
        gs = M.autograd.grad(y, [s, v], M.tensor([1.0, 2.0, -1.0], dtype=M.float64),
                             is_grads_batched=True, create_graph=create_graph)
        return [_arr(g) for g in gs]
    _close(_both(run))


def test_batched_grad_through_max_over_the_only_dim():
    def run(M):
        x = M.tensor([0.3, -1.0, 2.0], dtype=M.float64, requires_grad=True)
        y = x.min(dim=0)[0] + x.max(dim=0, keepdim=True)[0].sum()
        return [_arr(M.autograd.grad(y, x, M.tensor([1.0, 2.0], dtype=M.float64),
                                     is_grads_batched=True)[0])]
    _close(_both(run))


def test_create_graph_through_an_inplace_op_on_a_constant():
    # the recorded sweep read the constant's tensor, which the in-place op had rebound to
    # its result: d(c * x)/dx came out as c * x
    def run(M):
        x = M.tensor(-1.3, dtype=M.float64, requires_grad=True)
        c = M.tensor([[-1.1, 0.4]], dtype=M.float64) * 1.0
        c *= x
        (g,) = M.autograd.grad(c.sum(), x, create_graph=True)
        return [_arr(g)]
    _close(_both(run))


def test_batched_grad_of_an_input_entered_on_several_tapes(monkeypatch):
    # each tape's row of the batched adjoints was a list: an input on two tapes got the
    # two lists concatenated (a (2B,) gradient, then a broadcast error)
    _set_rollover(monkeypatch, 4)

    def run(M):
        x1 = M.tensor(-1.2, dtype=M.float64, requires_grad=True)
        x2 = M.tensor(-1.0, dtype=M.float64, requires_grad=True)
        v3 = (M.sigmoid(x2) * 2.0 + 0.1) ** 2.0
        v4 = (M.sigmoid(x1) * 2.0 + 0.1) ** (M.tanh(x2) * 2.0)
        y = v3 * 1.0 + v4 * -0.5
        gs = M.autograd.grad(y, [x1, x2], M.tensor([1.0, 2.0, 3.0], dtype=M.float64),
                             is_grads_batched=True)
        return [_arr(g) for g in gs]
    _close(_both(run))


def test_batched_grad_through_a_traced_program_with_an_empty_output():
    def run(M):
        x = M.tensor([[0.3, 0.5]], dtype=M.float64, requires_grad=True)
        e = M.diag(x, -1)  # empty
        H = helpers(M)
        y = H.trace(lambda u, w: M.exp(M.tanh(u)) * M.cos(w), e, e)(e, e).sum() + x.sum()
        return [_arr(M.autograd.grad(y, x, M.tensor([1.0, 2.0, 3.0], dtype=M.float64),
                                     is_grads_batched=True)[0])]
    _close(_both(run))


@pytest.mark.parametrize("which", ["program", "function", "two outputs"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_a_multi_output_entry_and_its_outputs_on_different_tapes(monkeypatch, which,
                                                                 create_graph):
    # a tape rollover between a custom Function / traced Program entry and its outputs put
    # an import between them, which dropped the gathered output gradients: zero, silently
    _set_rollover(monkeypatch, 4)

    def run(M):
        H = helpers(M)
        x = M.tensor(0.7, dtype=M.float64, requires_grad=True)
        z = M.tensor(0.6, dtype=M.float64, requires_grad=True)
        pad = (z * 2.0) * 3.0
        if which == "program":
            v = H.trace(lambda u, w: M.sin(u) * w, x, z)(x, z)
        elif which == "function":
            v = H.Fn1.apply(x, z)
        else:
            a, b = H.Fn2.apply(x)
            v = a + b * z
        return [_arr(g) for g in M.autograd.grad(v + pad, [x, z], create_graph=create_graph)]
    _close(_both(run))


def test_paths_are_one_ordered_list_of_strategies():
    from tapegrad.autograd import _engine  # noqa: F401 (fills the list)
    assert [p.name for p in paths.STRATEGIES] == list(paths.PATHS)
    assert paths.by_name("fused").graph is False and paths.by_name("sweep").graph is None


def test_a_hooked_graph_takes_the_hooks_path_and_only_it():
    x = tg.tensor([1.0, 2.0], requires_grad=True)
    y = x * x
    h = y.register_hook(lambda g: g * 2.0)
    try:
        with paths.force("sweep"), pytest.raises(paths.PathDeclined, match="'hooks' path"):
            y.sum().backward(retain_graph=True)
        assert x.grad is None  # declined before anything was accumulated
        y.sum().backward()
        assert paths.last() == "hooks" and x.grad.tolist() == [4.0, 8.0]
    finally:
        h.remove()
