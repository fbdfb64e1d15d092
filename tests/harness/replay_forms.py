"""Program forms for the replay legs (tests/test_differential_replay.py): Python branches on
traced values (guards at replay) and ties of the branch-free ops (relu, abs, max, clamp,
where), plus the inputs replay is called at (perturbed, sign-flipped, quantized to ties).

The forms follow tests/harness/programs.py's array forms: ``draw(rng, shapes)`` returns
(args, code, ops). ``forms_added()`` registers them in ``programs.ARRAY_FORMS`` only while
a program is generated, so the other legs' default programs do not change.
"""
from __future__ import annotations

import contextlib

import numpy as np

from . import programs as P


def f_branch(rng, shapes):
    """``if <scalar of a node> <cmp> c:`` with a different elementwise function per arm: a
    guard in a traced program."""
    i = P._pick(rng, list(range(len(shapes))))
    c = round(float(rng.uniform(-0.5, 0.5)), 2)
    red = ["{0}.sum()", "{0}.mean()", "M.tanh({0}).sum()", "{0}.amax()"][int(rng.integers(0, 4))]
    if shapes[i] == () and rng.random() < 0.5:
        red = "{0}"  # a 0-d node compared directly
    cmp = [">", "<", ">=", "<="][int(rng.integers(0, 4))]
    cond = f"{red} {cmp} {c!r}"
    if rng.random() < 0.25:
        cond = f"({cond}).item()"  # a truth value read with .item(): a guard too
    arms = [("M.sin({0}) * 2.0", "M.cos({0})"), ("{0} * {0}", "-{0}"),
            ("M.tanh({0})", "{0} + 1.0")][int(rng.integers(0, 3))]
    code = "if %s:\n    {out} = %s\nelse:\n    {out} = %s" % (cond, arms[0], arms[1])
    return (i,), code, ("sum", "mean", "tanh", "amax", "sin", "cos", "mulc", "mul", "neg",
                        "addc")


def f_tie(rng, shapes):
    """The branch-free ops where their two sides meet: ties of max/min, relu and abs at 0,
    clamp at its bound, where on equal operands."""
    i = P._pick(rng, list(range(len(shapes))))
    forms = [
        ("{out} = M.maximum({0}, {0} * 1.0)", ("maximum", "mulc")),
        ("{out} = M.minimum({0} + 0.0, {0})", ("minimum", "addc")),
        ("{out} = M.relu({0} - {0}) + {0}", ("relu", "sub", "add")),
        ("{out} = M.abs({0} * 0.0) * 3.0 + {0}", ("abs", "mulc", "add")),
        ("{out} = M.stack([{0}, {0} * 1.0]).amax(0)", ("stack", "amax", "mulc")),
        ("{out} = M.stack([{0}, {0} * 1.0]).amin(0)", ("stack", "amin", "mulc")),
        ("{out} = M.stack([{0}, {0} * 1.0]).max(dim=0)[0]", ("stack", "amax", "mulc")),
        ("{out} = M.clamp({0}, min={0} * 1.0)", ("clamp_min_t", "mulc")),
        ("{out} = M.clamp({0}, max={0} * 1.0)", ("clamp_max_t", "mulc")),
        ("{out} = M.where({0} > {0} * 1.0, {0}, {0} * 2.0)", ("where", "mulc")),
        ("{out} = M.clamp({0}, -0.5, 0.5)", ("clamp",)),
        ("{out} = M.clamp({0}, 0.0, 1.0)", ("clamp",)),
        ("{out} = M.relu({0})", ("relu",)),
        ("{out} = M.abs({0})", ("abs",)),
        ("{out} = M.maximum({0}, M.zeros_like({0}))", ("maximum",)),
        ("{out} = M.where({0} >= 0.5, {0}, -{0})", ("where", "neg")),
    ]
    code, ops = forms[int(rng.integers(0, len(forms)))]
    if shapes[i] != () and rng.random() < 0.3:  # a full reduction with ties among elements
        code, ops = [("{out} = {0}.amax()", ("amax",)), ("{out} = {0}.max()", ("amax",)),
                     ("{out} = {0}.amin()", ("amin",)),
                     ("{out} = M.norm({0} * 0.0 + M.relu({0}))", ("norm", "relu"))][
            int(rng.integers(0, 4))]
    return (i,), code, ops


EXTRA_FORMS = {"branch": f_branch, "tie": f_tie}
#: the forms the replay legs draw from: every traceable array form and the extra ones
#: (custom Functions and program calls cannot be traced: the program leg covers those; the
#: surface forms have a tier of their own)
REPLAY_FORMS = sorted((set(P.ARRAY_FORMS) - {"slice1d", "function", "program"}
                       - set(P.SURFACE_FORMS)) | set(EXTRA_FORMS))
#: the surface forms (test_replay_leg_surface's programs) a trace can hold
SURFACE_REPLAY_FORMS = sorted(set(P.SURFACE_FORMS) - set(P.UNTRACEABLE_SURFACE))


@contextlib.contextmanager
def forms_added():
    saved = dict(P.ARRAY_FORMS)
    P.ARRAY_FORMS.update(EXTRA_FORMS)
    try:
        yield
    finally:
        P.ARRAY_FORMS.clear()
        P.ARRAY_FORMS.update(saved)


def generate(seed, n_ops, **kw):
    """A program for the replay legs (programs.generate with the extra forms)."""
    with forms_added():
        return P.generate(seed, n_ops, forms=kw.pop("forms", REPLAY_FORMS), **kw)


MODES = ("noise", "flip", "ties", "scale")


def new_inputs(prog, mode, salt=0):
    """Inputs of the same shapes as ``prog``'s, for replay: ``noise`` (a small random
    perturbation), ``flip`` (every sign flipped: comparisons and branches go the other
    way), ``ties`` (values from {-1, -0.5, 0, 0.5, 1}: relu/abs at 0, equal elements, clamp
    at its bounds), ``scale`` (halved). Inputs that do not require grad are constants of the
    traced function and keep their values."""
    rng = np.random.default_rng([prog.seed, MODES.index(mode), salt])
    out = []
    for v, rg in prog.inputs:
        a = np.asarray(v, dtype=np.float64)
        if not rg:  # a constant of the traced function: it keeps its value
            b = a
        elif mode == "noise":
            b = np.round(a + rng.normal(0.0, 0.3, a.shape), 3)
        elif mode == "flip":
            b = -a
        elif mode == "ties":
            b = rng.choice([-1.0, -0.5, 0.0, 0.0, 0.5, 1.0], size=a.shape)
        else:
            b = a * 0.5
        out.append(float(b) if a.shape == () else b)
    return out


@contextlib.contextmanager
def array_instructions(min_run):
    """Trace with runs of ``min_run`` elements or more as array instructions (4: as many as
    the format allows; a huge number: scalar rows only), restored after."""
    from tapegrad.interpreters import program_arrays
    saved = program_arrays.MIN_RUN, program_arrays.MIN_COVER
    program_arrays.MIN_COVER = 0.0  # every instruction runs as one, however few
    program_arrays.MIN_RUN = min_run
    try:
        yield
    finally:
        program_arrays.MIN_RUN, program_arrays.MIN_COVER = saved
