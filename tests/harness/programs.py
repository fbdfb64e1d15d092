"""Seeded random programs over every differentiable registry op, as Python text run with
``M = tapegrad`` or ``M = torch``; a shrinker and a printer for failures.

A program is source text: ``def program(M, H, x0, x1, ...)`` returning (nodes, y), where
``nodes`` are its intermediate values and ``y`` a 0-d loss (a weighted sum of the sinks).
``H`` holds the few things spelled differently in the two libraries (``helpers(M)``:
softplus, custom Functions, ``trace``). The same text runs in both, so a difference is a
difference of the libraries, never of two hand-written versions.

Generation draws one instruction at a time and runs it at once in torch: the shape of
every node comes from torch, and a candidate that torch rejects or whose values leave the
well-defined range (non-finite, or larger than ``LIMIT``) is redrawn. Inputs reach an op's
domain through guards that are part of the program (``M.log(M.exp(M.tanh(h)))``...).

Each instruction lists the registry ops it records (``ops``), forward or in its
derivative rules under create_graph; ``tests/test_differential.py`` checks that together
they name every differentiable op of ``tapegrad.ops.OPS``.
"""
from __future__ import annotations

import dataclasses
import re
import warnings

import numpy as np

LIMIT = 1e4            # a node with a larger |value| is redrawn
SHAPES = [(), (), (3,), (2, 3), (2, 1), (1, 3), (4,), (3, 2), (2, 3, 2)]

# the helpers' source, run with M bound: printed with a failing program, so it runs alone
HELPERS_SRC = '''
class H:
    pass


def softplus(x, beta, threshold):
    if M.__name__ == "torch":
        return M.nn.functional.softplus(x, beta=beta, threshold=threshold)
    return M.softplus(x, beta, threshold)


class Fn1(M.autograd.Function):
    """x * sin(y), one output (op ``function``)."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * M.sin(y)

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * M.sin(y), g * x * M.cos(y)


class Fn2(M.autograd.Function):
    """(x * x, sin(x)), two outputs (ops ``function`` and ``function_out``)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x, M.sin(x)

    @staticmethod
    def backward(ctx, g1, g2):
        (x,) = ctx.saved_tensors
        return g1 * 2.0 * x + g2 * M.cos(x)


def trace(fn, *examples):
    """A traced Program (op ``program``) in tapegrad; the function itself in torch."""
    return fn if M.__name__ == "torch" else M.trace(fn, *examples)


H.softplus, H.Fn1, H.Fn2, H.trace = softplus, Fn1, Fn2, trace
'''


def helpers(M):
    ns = {"M": M}
    exec(compile(HELPERS_SRC, "<harness helpers>", "exec"), ns)
    return ns["H"]


# --- guards: any real value into an op's domain, as program text ----------------------------

def g_pos(a, k):
    """A positive value, bounded away from 0 and from infinity."""
    return (f"M.exp(M.tanh({a}))", f"(M.square(M.tanh({a})) + 0.25)",
            f"(M.sigmoid({a}) * 2.0 + 0.1)")[k % 3]


def g_unit(a, k):
    return f"(M.tanh({a}) * 0.9)" if k % 3 != 1 else f"(M.sin({a}) * 0.9)"


def g_b(a, r):
    return f"(M.tanh({a}) * {r})"


# --- elementwise forms: name -> (arity, template(args, params) -> expression) ---------------

def _u(name, guard=None):
    if guard is None:
        return 1, lambda a, p: f"M.{name}({a[0]})"
    return 1, lambda a, p: f"M.{name}({guard(a[0], p)})"


ELEMENTWISE = {
    "neg": (1, lambda a, p: f"-{a[0]}"),
    "exp": _u("exp", lambda a, p: g_b(a, 3.0)),
    "log": _u("log", lambda a, p: g_pos(a, p["k"])),
    "log1p": (1, lambda a, p: f"M.log1p({g_pos(a[0], p['k'])} - 0.9)"),
    "expm1": _u("expm1", lambda a, p: g_b(a, 3.0)),
    "sqrt": _u("sqrt", lambda a, p: g_pos(a, p["k"])),
    "rsqrt": _u("rsqrt", lambda a, p: g_pos(a, p["k"])),
    "sin": _u("sin"),
    "cos": _u("cos"),
    "tan": _u("tan", lambda a, p: g_b(a, 1.2)),
    "asin": _u("asin", lambda a, p: g_unit(a, p["k"])),
    "acos": _u("acos", lambda a, p: g_unit(a, p["k"])),
    "atan": _u("atan"),
    "sinh": _u("sinh", lambda a, p: g_b(a, 3.0)),
    "cosh": _u("cosh", lambda a, p: g_b(a, 3.0)),
    "tanh": _u("tanh"),
    "sigmoid": _u("sigmoid"),
    "relu": _u("relu"),
    "erf": _u("erf"),
    "abs": (1, lambda a, p: f"M.abs({a[0]})" if p["k"] else f"abs({a[0]})"),
    "sign": (1, lambda a, p: f"(M.sign({a[0]}) + {a[0]})"),
    "square": _u("square"),
    "reciprocal": _u("reciprocal", lambda a, p: g_pos(a, p["k"])),
    "clone": (1, lambda a, p: f"M.clone({a[0]})" if p["k"] else f"{a[0]}.clone()"),
    "addc": (1, lambda a, p: f"({a[0]} + {p['c']!r})" if p["k"] else f"({a[0]} - {p['c']!r})"),
    "mulc": (1, lambda a, p: f"({a[0]} * {p['c']!r})" if p["k"] else f"({p['c']!r} * {a[0]})"),
    "rsubc": (1, lambda a, p: f"({p['c']!r} - {a[0]})"),
    "divc": (1, lambda a, p: f"({a[0]} / {p['cnz']!r})"),
    "rdivc": (1, lambda a, p: f"({p['c']!r} / {g_pos(a[0], p['k'])})"),
    "powc": (1, lambda a, p: f"({g_pos(a[0], p['k'])} ** {p['e']!r})"),
    "rpowc": (1, lambda a, p: f"({p['b']!r} ** {g_b(a[0], 2.0)})"),
    "clamp": (1, lambda a, p: f"M.clamp({a[0]}, {p['lo']!r}, {p['hi']!r})"),
    "softplus": (1, lambda a, p: f"H.softplus({a[0]}, {p['beta']!r}, {p['thr']!r})"),
    "add": (2, lambda a, p: f"({a[0]} + {a[1]})"),
    "sub": (2, lambda a, p: f"({a[0]} - {a[1]})"),
    "mul": (2, lambda a, p: f"({a[0]} * {a[1]})"),
    "div": (2, lambda a, p: f"({a[0]} / {g_pos(a[1], p['k'])})"),
    "pow": (2, lambda a, p: f"({g_pos(a[0], p['k'])} ** {g_b(a[1], 2.0)})"),
    # away from the origin, where derivatives are a convention (tapegrad 0, torch's second
    # order NaN): x - x, relu and prod give exact zeros
    "atan2": (2, lambda a, p: f"M.atan2({a[0]}, {a[1]} + 0.3717)"),
    "maximum": (2, lambda a, p: f"M.maximum({a[0]}, {a[1]})"),
    "minimum": (2, lambda a, p: f"M.minimum({a[0]}, {a[1]})"),
    "clamp_min_t": (2, lambda a, p: f"M.clamp({a[0]}, min={a[1]})"),
    "clamp_max_t": (2, lambda a, p: f"M.clamp({a[0]}, max={a[1]})"),
}

# ops the guards themselves record (every unary guard records these)
GUARD_OPS = {"exp", "tanh", "square", "addc", "sigmoid", "mulc", "sin"}


def _params(rng):
    lo = round(float(rng.uniform(-1.0, 0.5)), 3)
    return {
        "k": int(rng.integers(0, 3)),
        "c": round(float(rng.choice([rng.uniform(-2.0, 2.0), 2.0, 0.5, -1.0])), 3),
        "cnz": round(float(rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 2.0)), 3),
        "e": round(float(rng.choice([rng.uniform(-2.0, 2.5), 2.0, 3.0, -1.0, 0.5, 0.0])), 3),
        "b": round(float(rng.uniform(0.3, 3.0)), 3),
        "lo": lo,
        "hi": round(lo + float(rng.uniform(0.2, 1.5)), 3),
        "beta": round(float(rng.choice([1.0, rng.uniform(0.5, 2.0)])), 3),
        "thr": round(float(rng.choice([20.0, rng.uniform(0.0, 2.0)])), 3),
    }


# --- array forms: name -> draw(rng, shapes) -> (args, lines, ops) or None --------------------
# ``shapes[i]`` is node i's shape. ``lines`` is code with {out} for the result's name and {0},
# {1}... for the arguments'. ``ops`` lists the registry ops it records (forward, or in the
# derivative rules that create_graph re-records).

def _pick_shape(rng, shapes, ok):
    pool = [i for i, s in enumerate(shapes) if ok(s)]
    return _pick(rng, pool) if pool else None


def _pick(rng, pool):
    """Prefer recent nodes (deep chains) but reach back to any node (DAG sharing)."""
    if rng.random() < 0.6:
        return pool[-1 - int(rng.integers(0, min(3, len(pool))))]
    return pool[int(rng.integers(0, len(pool)))]


def _dim(rng, nd):
    """A dim for a tensor of ``nd`` dims, sometimes negative."""
    d = int(rng.integers(0, nd))
    return d - nd if rng.random() < 0.3 else d


def f_reshape(rng, shapes):
    i = _pick(rng, list(range(len(shapes))))
    s = shapes[i]
    n = int(np.prod(s))
    opts = [(n,), (1, n), (n, 1), ()] if n == 1 else [(n,), (1, n), (n, 1), (-1,)]
    opts += [(a, n // a) for a in (2, 3) if n % a == 0 and n // a > 1]
    t = opts[int(rng.integers(0, len(opts)))]
    if rng.random() < 0.3:  # view: on a fresh (contiguous) clone, as torch needs
        return (i,), "{out} = M.clone({0}).view(%r)" % (t,), ("reshape", "clone")
    return (i,), "{out} = {0}.reshape(%r)" % (t,), ("reshape",)


def f_expand(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) <= 2 and (not s or 1 in s or len(s) == 1))
    if i is None:
        return None
    s = shapes[i]
    if s == ():
        t = ((3,), (2, 2))[int(rng.integers(0, 2))]
    elif len(s) == 1:
        t = (2,) + s
    else:
        t = tuple(3 if d == 1 else d for d in s)
    return (i,), "{out} = {0}.expand(%r)" % (t,), ("expand", "sum_to")


def f_transpose(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) >= 2)
    if i is None:
        return None
    nd = len(shapes[i])
    k = int(rng.integers(0, 4))
    if nd == 3:
        perm = tuple(int(x) for x in rng.permutation(3))
        return (i,), "{out} = {0}.permute%r" % (perm,), ("permute",)
    return (i,), ["{out} = {0}.T", "{out} = {0}.transpose(0, 1)", "{out} = M.transpose({0}, 1, 0)",
                  "{out} = {0}.permute(1, 0)"][k], ("transpose", "permute")


def f_cast(rng, shapes):
    i = _pick(rng, list(range(len(shapes))))
    return (i,), "{out} = {0}.to(M.float32).to(M.float64)", ("cast",)


def f_stack(rng, shapes):
    i = _pick(rng, list(range(len(shapes))))
    same = [j for j, s in enumerate(shapes) if s == shapes[i]]
    js = [i] + [_pick(rng, same) for _ in range(int(rng.integers(1, 3)))]
    nd = len(shapes[i]) + 1
    d = _dim(rng, nd)
    args = tuple(js)
    items = ", ".join("{%d}" % k for k in range(len(js)))
    return args, "{out} = M.stack([%s], dim=%d)" % (items, d), ("stack",)


def f_cat(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) >= 1)
    if i is None:
        return None
    s = shapes[i]
    d = _dim(rng, len(s))
    ok = [j for j, t in enumerate(shapes)
          if len(t) == len(s) and all(a == b for k, (a, b) in enumerate(zip(s, t))
                                      if k != d % len(s))]
    js = [i] + [_pick(rng, ok) for _ in range(int(rng.integers(1, 3)))]
    items = ", ".join("{%d}" % k for k in range(len(js)))
    return tuple(js), "{out} = M.cat([%s], dim=%d)" % (items, d), ("cat",)


def f_diag(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) in (1, 2))
    if i is None:
        return None
    k = int(rng.integers(-1, 2))
    return (i,), "{out} = M.diag({0}, %d)" % k, ("diag", "index_scatter", "getitem")


def _index(rng, s):
    """An index expression for shape ``s`` (at least 1-d) and the ops it records."""
    kind = int(rng.integers(0, 6))
    n0 = s[0]
    if 0 in s:  # an empty value: the whole of it
        return ":", ("getitem",)
    if kind == 0:
        return str(int(rng.integers(-n0, n0))), ("getitem",)
    if kind == 1:
        lo = int(rng.integers(0, n0))
        step = int(rng.integers(1, 3))
        return f"{lo}::{step}", ("getitem",)
    if kind == 2 and len(s) >= 2:
        return f"..., {int(rng.integers(0, s[-1]))}", ("getitem",)
    if kind == 3:  # integer array, repeats allowed
        idx = [int(x) for x in rng.integers(0, n0, size=int(rng.integers(1, 4)))]
        return f"{idx}", ("getitem", "index_scatter")
    if kind == 4:  # boolean mask over the first dim
        m = [bool(x) for x in rng.integers(0, 2, size=n0)]
        return f"M.tensor({m})", ("getitem", "index_scatter")
    if len(s) >= 2:
        return f":, {int(rng.integers(0, s[1]))}:", ("getitem",)
    return "1:" if n0 > 1 else ":", ("getitem",)


def f_getitem(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) >= 1)
    if i is None:
        return None
    idx, ops = _index(rng, shapes[i])
    return (i,), "{out} = {0}[%s]" % idx, ops


def f_setitem(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) >= 1)
    if i is None:
        return None
    s = shapes[i]
    idx, ops = _index(rng, s)
    j = _pick(rng, list(range(len(shapes))))
    val = ["{1}.sum()", "0.5", "M.tanh({1}).mean()"][int(rng.integers(0, 3))]
    if "{1}" not in val:
        return (i,), "{out} = {0}.clone()\n{out}[%s] = %s" % (idx, val), ops + ("clone",
                                                                                 "setitem")
    return (i, j), "{out} = {0}.clone()\n{out}[%s] = %s" % (idx, val), (
        ops + ("clone", "setitem", "sum", "mean", "tanh", "expand"))


def f_inplace(rng, shapes):
    i = _pick(rng, list(range(len(shapes))))
    s = shapes[i]
    ok = [j for j, t in enumerate(shapes) if _bcast(s, t) == s]
    j = _pick(rng, ok)
    op = ["+=", "-=", "*=", "/="][int(rng.integers(0, 4))]
    rhs = "{1}" if op != "/=" else "M.exp(M.tanh({1}))"
    return (i, j), "{out} = {0} * 1.0\n{out} %s %s" % (op, rhs), (
        "mulc", {"+=": "add", "-=": "sub", "*=": "mul", "/=": "div"}[op], "sum_to")


def f_where(rng, shapes):
    i = _pick(rng, list(range(len(shapes))))
    j = _pick(rng, list(range(len(shapes))))
    k = _pick(rng, list(range(len(shapes))))
    if _bcast(shapes[i], shapes[j], shapes[k]) is None:
        return None
    c = "{0} > %r" % round(float(rng.uniform(-0.5, 0.5)), 2)
    return (i, j, k), "{out} = M.where(%s, {1}, {2})" % c, ("where", "sum_to")


def f_reduce(rng, shapes):
    i = _pick(rng, list(range(len(shapes))))
    s = shapes[i]
    nd = len(s)
    name = ["sum", "mean", "prod", "amax", "amin", "max", "min", "norm", "logsumexp"][
        int(rng.integers(0, 9))]
    ops = {"sum": ("sum", "expand"), "mean": ("mean", "expand"),
           "prod": ("prod", "prod_others", "where", "expand", "permute", "tanh", "mulc", "relu"),
           "amax": ("amax", "where", "expand"), "amin": ("amin", "where", "expand"),
           "max": ("amax", "where", "expand"), "min": ("amin", "where", "expand"),
           "norm": ("norm", "div", "expand", "addc"),
           "logsumexp": ("logsumexp", "exp", "expand")}[name]
    how = int(rng.integers(0, 4)) if nd else 0  # 0 full, 1 dim, 2 dim keepdim, 3 dim tuple
    keep = how == 2 or (how == 3 and rng.random() < 0.5)
    if how == 3 and nd >= 2 and name not in ("prod", "max", "min"):
        dim = tuple(sorted({int(x) for x in rng.integers(0, nd, size=2)}))
    elif how:
        dim = _dim(rng, nd)
    else:
        dim = None
    x = "{0}"
    if name == "prod":  # products of many values stay bounded; with exact zeros sometimes
        x = "(M.tanh({0}) * 1.3)" if rng.random() < 0.5 else "(M.relu(M.tanh({0})) * 1.3)"
    elif name == "norm":  # away from an exact 0 (x - x, relu...): there its second
        x = "({0} + 0.3717)"  # derivative is a matter of convention (torch: NaN)
    if dim is None:
        if name in ("amax", "amin") and rng.random() < 0.5:
            return (i,), "{out} = M.%s({0}, dim=())" % name, ops
        if name == "logsumexp":
            return (i,), "{out} = M.logsumexp({0}, dim=%r)" % ((tuple(range(nd)) or 0),), ops
        if name == "norm" and rng.random() < 0.5:
            p = (2, 1, "fro")[int(rng.integers(0, 3))]
            return (i,), "{out} = M.norm(%s, p=%r)" % (x, p), ops
        if rng.random() < 0.5:
            return (i,), "{out} = M.%s(%s)" % (name, x), ops
        return (i,), "{out} = %s.%s()" % (x, name), ops
    if name in ("max", "min"):
        sel = "[0]" if rng.random() < 0.5 else ".values"
        return (i,), "{out} = {0}.%s(dim=%r, keepdim=%r)%s" % (name, dim, keep, sel), ops
    if name == "norm":
        p = 2 if isinstance(dim, tuple) else (2, 1)[int(rng.integers(0, 2))]
        return (i,), "{out} = M.norm(%s, p=%r, dim=%r, keepdim=%r)" % (x, p, dim, keep), ops
    if rng.random() < 0.5:
        return (i,), "{out} = M.%s(%s, dim=%r, keepdim=%r)" % (name, x, dim, keep), ops
    return (i,), "{out} = %s.%s(dim=%r, keepdim=%r)" % (x, name, dim, keep), ops


def f_softmax(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) >= 1)
    if i is None:
        return None
    name = ("softmax", "log_softmax")[int(rng.integers(0, 2))]
    d = _dim(rng, len(shapes[i]))
    return (i,), "{out} = M.%s({0}, dim=%d)" % (name, d), (name, "mul", "sub", "sum", "exp",
                                                            "expand")


def f_matmul(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) in (1, 2))
    if i is None:
        return None
    s = shapes[i]
    if len(s) == 1:
        vec = [j for j, t in enumerate(shapes) if t == s]
        mat = [j for j, t in enumerate(shapes) if len(t) == 2 and t[0] == s[0]]
        if mat and rng.random() < 0.4:
            return (i, _pick(rng, mat)), "{out} = {0} @ {1}", ("matmul", "outer", "transpose")
        form = ["{out} = M.dot({0}, {1})", "{out} = {0} @ {1}", "{out} = M.outer({0}, {1})",
                "{out} = M.matmul({0}, {1})"][int(rng.integers(0, 4))]
        ops = ("outer", "mul", "matmul") if "outer" in form else ("matmul", "mul", "outer")
        return (i, _pick(rng, vec)), form, ops
    same = [j for j, t in enumerate(shapes) if t == s]
    vec = [j for j, t in enumerate(shapes) if t == (s[1],)]
    if vec and rng.random() < 0.3:
        return (i, _pick(rng, vec)), "{out} = {0} @ {1}", ("matmul", "outer")
    form = ["{out} = {0} @ {1}.T", "{out} = M.matmul({0}.T, {1})",
            "{out} = {0}.transpose(0, 1) @ {1}"][int(rng.integers(0, 3))]
    return (i, _pick(rng, same)), form, ("matmul", "transpose")


def f_function(rng, shapes):
    i = _pick(rng, list(range(len(shapes))))
    if rng.random() < 0.5:
        j = _pick(rng, [k for k, t in enumerate(shapes) if t == shapes[i]])
        return (i, j), "{out} = H.Fn1.apply({0}, {1})", ("function", "mul", "sin", "cos")
    sel = int(rng.integers(0, 3))
    tail = ["[0]", "[1]", "[0] - {out}_[1]"][sel]
    if sel == 2:
        return (i,), "{out}_ = H.Fn2.apply({0})\n{out} = {out}_%s" % tail, (
            "function", "function_out", "mul", "sin", "cos", "mulc")
    return (i,), "{out} = H.Fn2.apply({0})%s" % tail, ("function", "function_out", "mul",
                                                       "sin", "cos", "mulc")


def f_program(rng, shapes):
    i = _pick(rng, list(range(len(shapes))))
    j = _pick(rng, list(range(len(shapes))))
    if _bcast(shapes[i], shapes[j]) is None:
        return None
    body = ["M.sin(x) * y + x.sum()", "M.tanh(x * y) - y", "M.exp(M.tanh(x)) * M.cos(y)"][
        int(rng.integers(0, 3))]
    return (i, j), "{out} = H.trace(lambda x, y: %s, {0}, {1})({0}, {1})" % body, (
        "program", "sin", "mul", "add", "sum", "tanh", "sub", "exp", "cos")


def _bcast(*shapes):
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


ARRAY_FORMS = {
    "reshape": f_reshape, "expand": f_expand, "transpose": f_transpose, "cast": f_cast,
    "stack": f_stack, "cat": f_cat, "diag": f_diag, "getitem": f_getitem,
    "setitem": f_setitem, "inplace": f_inplace, "where": f_where, "reduce": f_reduce,
    "softmax": f_softmax, "matmul": f_matmul, "function": f_function, "program": f_program,
}


# --- programs ------------------------------------------------------------------------------

@dataclasses.dataclass
class Instr:
    form: str
    args: tuple
    code: str       # lines with {out} and {0}, {1}...
    ops: tuple
    shape: tuple = ()


@dataclasses.dataclass
class Program:
    seed: int
    inputs: list    # [(np.ndarray or float, requires_grad)]
    instrs: list

    @property
    def shapes(self):
        return [np.shape(v) for v, _ in self.inputs] + [ins.shape for ins in self.instrs]

    @property
    def ops(self):
        out = set()
        for ins in self.instrs:
            out.update(ins.ops)
        return out

    @property
    def scalar(self):
        """Every value 0-d: the one-call scalar paths' programs."""
        return all(s == () for s in self.shapes)

    @property
    def has_cast(self):
        return any(i.form == "cast" for i in self.instrs)

    def source(self):
        """``def program(M, H, x0, ...)``: the nodes and the loss."""
        n_in = len(self.inputs)
        names = [f"x{i}" for i in range(n_in)] + [f"v{n_in + j}" for j in range(len(self.instrs))]
        lines = [f"def program(M, H, {', '.join(names[:n_in])}):"]
        for j, ins in enumerate(self.instrs):
            code = ins.code.replace("{out}", names[n_in + j])
            code = re.sub(r"\{(\d+)\}", lambda m: names[ins.args[int(m.group(1))]], code)
            lines.extend("    " + ln for ln in code.split("\n"))
        used = {a for ins in self.instrs for a in ins.args}
        sinks = [k for k in range(n_in, len(names)) if k not in used] or list(range(n_in))
        shapes = self.shapes
        terms = [f"{names[k]}{'.sum()' if shapes[k] != () else ''} * {1.0 if k % 2 else -0.5}"
                 for k in sinks]
        lines.append(f"    y = {' + '.join(terms)}")
        lines.append(f"    return [{', '.join(names)}], y")
        return "\n".join(lines) + "\n"

    def function(self, M):
        ns = {"M": M, "abs": abs}
        exec(compile(self.source(), f"<program seed {self.seed}>", "exec"), ns)
        return ns["program"]

    def make_inputs(self, M):
        return [M.tensor(v, dtype=M.float64, requires_grad=rg) for v, rg in self.inputs]

    def run(self, M, H=None):
        """(inputs, nodes, y) in library ``M``."""
        xs = self.make_inputs(M)
        nodes, y = self.function(M)(M, H or helpers(M), *xs)
        return xs, nodes, y

    def code(self, driver=""):
        """A runnable script: the program, the helpers, and ``driver`` (lines using M, H,
        xs, program) run once with tapegrad and once with torch."""
        ins = ", ".join(f"M.tensor({np.asarray(v).tolist()!r}, dtype=M.float64, "
                        f"requires_grad={rg})" for v, rg in self.inputs)
        drv = "\n".join("    " + ln for ln in (driver or "nodes, y = program(M, H, *xs)\n"
                                                "print(M.__name__, y)").split("\n"))
        return (f"# seed {self.seed}\nimport contextlib\n\nimport numpy as np\nimport tapegrad\n"
                f"import torch\n\n"
                f"{self.source()}\n\nfor M in (tapegrad, torch):\n"
                + "\n".join(("    " + ln).rstrip() for ln in HELPERS_SRC.strip().split("\n"))
                + f"\n    xs = [{ins}]\n{drv}\n")


def _torch():
    import torch
    return torch


def well_defined(t):
    v = np.asarray(t.detach().numpy(), dtype=np.float64)
    return bool(np.all(np.isfinite(v)) and np.all(np.abs(v) <= LIMIT))


def generate(seed, n_ops=12, arrays=True, forms=None, shapes=None):
    """A program drawn from ``seed``: inputs and ``n_ops`` instructions, each run at once in
    torch (its shape comes from there; a candidate torch rejects, or whose value is not
    well defined, is redrawn). ``arrays=False``: 0-d inputs and elementwise ops only (the
    scalar paths' programs). ``forms``: the array forms to draw from (default all)."""
    torch = _torch()
    rng = np.random.default_rng(seed)
    H = helpers(torch)
    inputs = []
    n_in = int(rng.integers(2, 5))
    pool = shapes or SHAPES
    for i in range(n_in):
        s = pool[int(rng.integers(0, len(pool)))] if arrays else ()
        v = np.round(rng.uniform(-1.5, 1.5, s), 3)
        inputs.append((float(v) if s == () else v, i < n_in - 1 or rng.random() < 0.7))
    if forms is None:  # (the surface forms: their own family, the others' programs as before)
        forms = set(ARRAY_FORMS) - {"slice1d"} - set(SURFACE_FORMS)
    forms = sorted(forms) if arrays else []
    forms = [f for f in forms for _ in range(WEIGHTS.get(f, 1))]
    prog = Program(seed, inputs, [])
    with torch.no_grad():
        vals = [torch.tensor(v, dtype=torch.float64) for v, _ in inputs]
    consumed = set()
    tries = 0
    while len(prog.instrs) < n_ops and tries < n_ops * 20:
        tries += 1
        have = [tuple(v.shape) for v in vals]
        p = _params(rng)
        if forms and rng.random() < 0.4:
            form = forms[int(rng.integers(0, len(forms)))]
            try:
                got = ARRAY_FORMS[form](rng, have)
            except ValueError:  # nothing to draw from (an empty value's range)
                got = None
            if got is None:
                continue
            args, code, ops = got
        else:
            form = sorted(ELEMENTWISE)[int(rng.integers(0, len(ELEMENTWISE)))]
            arity, tmpl = ELEMENTWISE[form]
            fresh = [i for i in range(len(vals)) if i not in consumed]
            first = fresh[0] if fresh else _pick(rng, list(range(len(vals))))
            args = (first,)
            if arity == 2:
                partner = [j for j, s in enumerate(have) if _bcast(have[first], s) is not None]
                args += (_pick(rng, partner),)
            code = "{out} = " + tmpl(["{%d}" % k for k in range(arity)], p)
            ops = (form,) + tuple(sorted({m for m in re.findall(r"M\.(\w+)\(", code)}
                                         & GUARD_OPS))
            if arity == 2 and have[args[0]] != have[args[1]]:
                ops += ("sum_to", "expand")
        ins = Instr(form, tuple(args), code, tuple(ops))
        v = _run_instr(torch, H, ins, vals)
        if v is None:
            continue
        ins.shape = tuple(v.shape)
        prog.instrs.append(ins)
        vals.append(v)
        consumed.update(args)
    return prog


def _run_instr(torch, H, ins, vals):
    """One instruction's value in torch (None when torch rejects it or it is not well
    defined)."""
    names = [f"n{i}" for i in range(len(vals))]
    code = ins.code.replace("{out}", "out")
    code = re.sub(r"\{(\d+)\}", lambda m: names[ins.args[int(m.group(1))]], code)
    ns = {"M": torch, "H": H, "abs": abs}
    ns.update(zip(names, vals))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecations, in shrink candidates
            exec(code, ns)
    except Exception:
        return None
    out = ns["out"]
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float64 or not well_defined(out):
        return None
    return out


def f_slice1d(rng, shapes):
    """What the flat and fused paths take besides elementwise ops: 1-d slices, full sums and
    means."""
    i = _pick_shape(rng, shapes, lambda s: len(s) == 1)
    if i is None:
        return None
    n = shapes[i][0]
    k = int(rng.integers(0, 4))
    if k == 0:
        return (i,), "{out} = {0}.sum()", ("sum",)
    if k == 1:
        return (i,), "{out} = {0}.mean()", ("mean",)
    lo = int(rng.integers(0, n))
    hi = int(rng.integers(lo + 1, n + 1))
    step = int(rng.integers(1, 3))
    return (i,), "{out} = {0}[%d:%d:%d]" % (lo, hi, step), ("getitem",)


ARRAY_FORMS["slice1d"] = f_slice1d


# --- the rest of torch's surface: functions built from other ops or custom Functions ---------
# (the "surface" family draws these beside a few of the forms above; the other families'
# programs stay as they were)

def _partner(rng, shapes, i, ok=None):
    """A node whose shape broadcasts with node ``i``'s (and satisfies ``ok``)."""
    pool = [j for j, t in enumerate(shapes) if _bcast(shapes[i], t) is not None
            and (ok is None or ok(t))]
    return _pick(rng, pool) if pool else None


def f_remainder(rng, shapes):
    """``%``, remainder, fmod (custom Functions: d/dy is -floor(x / y)), and ``//``
    (no derivative in torch: its value only, detached)."""
    i = _pick(rng, list(range(len(shapes))))
    j = _partner(rng, shapes, i)
    c = round(float(rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 2.0)), 3)
    d = "(%s * %r)" % (g_pos("{1}", int(rng.integers(0, 3))), float(np.sign(c)))
    # the dividend off exact zeros (x - x, relu, a x a): % jumps at 0, where an ulp of
    # torch's (its cross(a, a) is 1e-16, not 0) lands on the other side
    x = "({0} + 0.3717)"
    forms = [("{out} = %s %% %r" % (x, c), (0,)), ("{out} = M.remainder(%s, %s)" % (x, d), (0, 1)),
             ("{out} = %s %% %s" % (x, d), (0, 1)), ("{out} = M.fmod(%s, %r)" % (x, c), (0,)),
             ("{out} = M.fmod(%s, %s)" % (x, d), (0, 1)),
             ("{out} = %s.remainder(%r)" % (x, c), (0,)),
             ("{out} = %s.fmod(%s)" % (x, d), (0, 1)),
             ("{out} = (%s // %r).detach() * {0}" % (x, c), (0,)),
             ("{out} = M.floor_divide(%s, %s).detach() + {0}" % (x, d), (0, 1)),
             ("{out} = (%r %% %s).detach() * {0}" % (c, g_pos("{0}", 1)), (0,))]
    code, uses = forms[int(rng.integers(0, len(forms)))]
    args = (i, j) if 1 in uses else (i,)
    return args, code, ("function", "mul", "add", "exp", "tanh")


def f_linalg_norm(rng, shapes):
    """torch.linalg.norm's orders: vector norms over one dim (0 counts: no gradient),
    matrix norms over two, the 2-norm of everything."""
    i = _pick_shape(rng, shapes, lambda s: len(s) >= 1)
    if i is None:
        return None
    nd = len(shapes[i])
    x = "({0} + 0.3717)"  # away from an exact 0, as the norm reduction's form
    keep = bool(rng.random() < 0.3)
    if nd >= 2 and rng.random() < 0.4:
        o = ["'fro'", "1", "-1", "float('inf')", "-float('inf')"][int(rng.integers(0, 5))]
        dim = tuple(int(d) for d in rng.permutation(nd)[:2])
        if rng.random() < 0.3:
            dim = tuple(d - nd for d in dim)
        return (i,), "{out} = M.linalg.norm(%s, ord=%s, dim=%r, keepdim=%r)" % (
            x, o, dim, keep), ("norm", "amax", "amin", "abs", "sum", "reshape")
    o = ["None", "1", "2", "3", "float('inf')", "-float('inf')", "0", "-1", "0.5"][
        int(rng.integers(0, 9))]
    if nd == 1 and rng.random() < 0.3:
        return (i,), "{out} = M.linalg.norm(%s, ord=%s)" % (x, o), ("norm",)
    if rng.random() < 0.2:
        return (i,), "{out} = M.linalg.norm(%s)" % x, ("norm",)
    return (i,), "{out} = M.linalg.norm(%s, ord=%s, dim=%d, keepdim=%r)" % (
        x, o, _dim(rng, nd), keep), ("norm",)


def f_einsum(rng, shapes):
    """einsum: contractions, transposes, diagonals, and ellipses that broadcast."""
    i = _pick_shape(rng, shapes, lambda s: len(s) >= 1)
    if i is None:
        return None
    s = shapes[i]
    nd = len(s)
    k = int(rng.integers(0, 5))
    ops = ("mul", "sum", "permute", "reshape", "expand", "getitem", "index_scatter",
           "matmul", "sum_to")
    if k == 0:  # two operands, ellipses broadcasting (size-1 dims and missing ones)
        j = _partner(rng, shapes, i, lambda t: len(t) >= 1 and t[-1] == s[-1])
        if j is None:
            return None
        eq = ["...i,...i->...i", "...i,...i->...", "...i,...i->i"][int(rng.integers(0, 3))]
        return (i, j), "{out} = M.einsum(%r, {0}, {1})" % eq, ops
    if k == 1 and nd == 2:  # a matrix and a vector, or two matrices
        vec = [j for j, t in enumerate(shapes) if t == (s[1],)]
        if vec and rng.random() < 0.5:
            return (i, _pick(rng, vec)), "{out} = M.einsum('ij,j->i', {0}, {1})", ops
        same = [j for j, t in enumerate(shapes) if t == s]
        eq = ["ij,kj->ik", "ij,ij->", "ij,ij->j", "ji,jk->ik"][int(rng.integers(0, 4))]
        if eq == "ji,jk->ik":
            return (i, _pick(rng, same)), "{out} = M.einsum(%r, {0}, {1})" % eq, ops
        return (i, _pick(rng, same)), "{out} = M.einsum(%r, {0}, {1})" % eq, ops
    if k == 2 and nd == 2 and s[0] == s[1]:
        return (i,), "{out} = M.einsum(%r, {0})" % ["ii->i", "ii->"][int(rng.integers(0, 2))], ops
    if nd >= 2:
        eq = ["...ij->...ji", "...ij->...", "...ij->...i"][int(rng.integers(0, 3))]
        return (i,), "{out} = M.einsum(%r, {0})" % eq, ops
    return (i,), "{out} = M.einsum(%r, {0})" % ["i->", "i->i"][int(rng.integers(0, 2))], ops


def f_multigammaln(rng, shapes):
    """special.multigammaln (custom Functions of lgamma and the polygammas), in its domain
    x > (p - 1) / 2."""
    i = _pick(rng, list(range(len(shapes))))
    p = int(rng.integers(1, 4))
    return (i,), "{out} = M.special.multigammaln(%s + %r, %d)" % (
        g_pos("{0}", int(rng.integers(0, 3))), (p - 1) / 2 + 0.05, p), ("function",)


def f_repeat_interleave(rng, shapes):
    i = _pick(rng, list(range(len(shapes))))
    s = shapes[i]
    r = int(rng.integers(1, 4))
    if not s or rng.random() < 0.3:
        return (i,), "{out} = M.repeat_interleave({0}, %d)" % r, ("getitem", "reshape")
    d = _dim(rng, len(s))
    if rng.random() < 0.5:
        counts = [int(c) for c in rng.integers(0, 3, size=s[d])]
        return (i,), "{out} = M.repeat_interleave({0}, M.tensor(%r), dim=%d)" % (counts, d), (
            "getitem", "index_scatter")
    return (i,), "{out} = {0}.repeat_interleave(%d, dim=%d)" % (r, d), ("getitem",
                                                                         "index_scatter")


def f_cross(rng, shapes):
    """cross / linalg.cross over a dim of size 3 (linalg.cross broadcasts)."""
    i = _pick_shape(rng, shapes, lambda s: 3 in s)
    if i is None:
        return None
    s = shapes[i]
    d = [k for k, n in enumerate(s) if n == 3][int(rng.integers(0, s.count(3)))]
    if rng.random() < 0.5:
        d -= len(s)
    # never parallel operands, even two nodes of one value: a x a is exactly 0 in tapegrad
    # and 1e-16 in torch (FMA), which sign() and % turn into different numbers
    b = "({1} * 1.3 + 0.2)"
    if rng.random() < 0.5:
        j = _pick(rng, [k for k, t in enumerate(shapes) if t == s])
        fn = ("M.cross", "M.linalg.cross")[int(rng.integers(0, 2))]
        return (i, j), "{out} = %s({0}, %s, dim=%d)" % (fn, b, d), ("getitem", "mul", "sub")
    back = len(s) - d % len(s)  # the dim counted from the end
    j = _partner(rng, shapes, i, lambda t: len(t) >= back and t[len(t) - back] == 3)
    if j is None:
        return None
    return (i, j), "{out} = M.linalg.cross({0}, %s, dim=%d)" % (
        b, d - len(s) if d >= 0 else d), ("getitem", "mul", "sub")


def f_sort(rng, shapes):
    """sort's values and argsort's order (stable in both libraries: ties keep their order)."""
    i = _pick_shape(rng, shapes, lambda s: len(s) >= 1)
    if i is None:
        return None
    s = shapes[i]
    d = _dim(rng, len(s))
    desc = bool(rng.random() < 0.5)
    k = int(rng.integers(0, 3))
    if k == 0:
        return (i,), "{out} = M.sort({0}, dim=%d, descending=%r, stable=True)[0]" % (d, desc), (
            "getitem", "index_scatter")
    if k == 1:
        return (i,), "{out} = {0}.sort(dim=%d, descending=%r, stable=True).values" % (d, desc), (
            "getitem",)
    if len(s) != 1:
        return None
    return (i,), "{out} = {0}[M.argsort({0}, descending=%r, stable=True)] * {0}" % desc, (
        "getitem", "mul")


def f_mm(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) == 2)
    if i is None:
        return None
    j = _pick(rng, [k for k, t in enumerate(shapes) if t == shapes[i]])
    form = ["{out} = M.mm({0}, {1}.T)", "{out} = {0}.mm({1}.t())", "{out} = M.mm({0}.t(), {1})"][
        int(rng.integers(0, 3))]
    return (i, j), form, ("matmul", "transpose")


def f_index_add(rng, shapes):
    i = _pick_shape(rng, shapes, lambda s: len(s) >= 1)
    if i is None:
        return None
    s = shapes[i]
    last = len(s) > 1 and rng.random() < 0.4
    n = s[-1] if last else s[0]
    idx = [int(x) for x in rng.integers(0, n, size=int(rng.integers(1, 4)))]
    src = ("M.tanh({0}[..., %r])" if last else "M.tanh({0}[%r])") % (idx,)
    alpha = ["", ", alpha=0.5", ", alpha=-2.0"][int(rng.integers(0, 3))]
    d = len(s) - 1 if last else 0
    f = ("{out} = {0}.index_add(%d, M.tensor(%r), %s%s)" if rng.random() < 0.5 else
         "{out} = M.index_add({0}, %d, M.tensor(%r), %s%s)")
    return (i,), f % (d, idx, src, alpha), ("getitem", "index_scatter", "tanh", "add", "mulc")


def f_views(rng, shapes):
    """The view and shape functions torch spells many ways."""
    i = _pick(rng, list(range(len(shapes))))
    s = shapes[i]
    nd = len(s)
    forms = [("{out} = M.flatten({0})", ("reshape",)),
             ("{out} = {0}.unsqueeze(%d)" % int(rng.integers(-nd - 1, nd + 1)), ("reshape",)),
             ("{out} = M.unsqueeze({0}, 0).squeeze(0)", ("reshape",)),
             ("{out} = M.squeeze({0})", ("reshape",)),
             ("{out} = M.concat([{0}, {0} * 2.0])" if nd else "{out} = {0} * 1.0",
              ("cat", "mulc"))]
    if nd <= 2:
        forms.append(("{out} = {0}.t()" if rng.random() < 0.5 else "{out} = M.t({0})",
                      ("transpose", "reshape")))
    if 1 in s or not s:
        t = tuple(3 if d == 1 else d for d in s) or (2,)
        forms.append(("{out} = M.broadcast_to({0}, %r)" % (t,), ("expand", "sum_to")))
    j = _pick(rng, [k for k, t in enumerate(shapes) if _bcast(s, t) == t])
    if j is not None:
        forms.append(("{out} = {0}.expand_as({1}) + {1}", ("expand", "sum_to", "add")))
    same = [k for k, t in enumerate(shapes) if int(np.prod(t)) == int(np.prod(s))]
    k2 = _pick(rng, same)
    forms.append(("{out} = {0}.reshape_as({1}) * {1}", ("reshape", "mul")))
    forms.append(("{out} = M.clone({0}).view_as({1})", ("reshape", "clone")))
    code, ops = forms[int(rng.integers(0, len(forms)))]
    if "{1}" in code:
        return (i, j if "expand_as" in code else k2), code, ops
    return (i,), code, ops


def f_methods_inplace(rng, shapes):
    """In-place methods on a clone (the tensor's version, the graph rebased)."""
    i = _pick(rng, list(range(len(shapes))))
    s = shapes[i]
    ok = [j for j, t in enumerate(shapes) if _bcast(s, t) == s]
    j = _pick(rng, ok)
    c = round(float(rng.uniform(-2.0, 2.0)), 3)
    forms = [("add_({1})", ("add",)), ("add_({1}, alpha=%r)" % c, ("add", "mulc")),
             ("sub_({1})", ("sub",)), ("mul_({1})", ("mul",)), ("mul_(%r)" % c, ("mulc",)),
             ("div_(M.exp(M.tanh({1})))", ("div", "exp", "tanh")), ("neg_()", ("neg",)),
             ("abs_()", ("abs",)), ("clamp_(-0.5, 0.7)", ("clamp",)),
             ("copy_({1})", ("expand",)), ("fill_(%r)" % c, ()), ("zero_()", ())]
    pos = [("exp_()", ("exp",)), ("sqrt_()", ("sqrt",)), ("pow_(1.5)", ("powc",))]
    if rng.random() < 0.25:  # on a value in the op's domain
        m, ops = pos[int(rng.integers(0, len(pos)))]
        # (* 1.0: exp saves its output, which an in-place op on it would break, in both)
        return (i,), "{out} = M.exp(M.tanh({0})) * 1.0\n{out}.%s" % m, ops + ("exp", "tanh",
                                                                             "mulc")
    m, ops = forms[int(rng.integers(0, len(forms)))]
    args = (i, j) if "{1}" in m else (i,)
    return args, "{out} = {0}.clone()\n{out}.%s" % m, ops + ("clone",)


def f_functions(rng, shapes):
    """Function forms of ops the other forms spell as operators or methods."""
    i = _pick(rng, list(range(len(shapes))))
    j = _partner(rng, shapes, i)
    e = float(rng.choice([2.0, 3.0, 0.5, -0.5, -2.0, 1.5, 1.0]))
    forms = [("{out} = M.pow(%s, %r)" % (g_pos("{0}", 0), e), ("powc", "exp", "tanh")),
             ("{out} = {0}.pow(%r)" % (e if float(e).is_integer() and e > 0 else 2.0),
              ("powc",)),
             ("{out} = M.clamp_min({0}, {1})", ("clamp_min_t",)),
             ("{out} = {0}.clamp_max({1})", ("clamp_max_t",)),
             ("{out} = M.true_divide({0}, %s)" % g_pos("{1}", 1), ("div",)),
             ("{out} = M.multiply({0}, {1})", ("mul",)),
             ("{out} = M.subtract({0}, {1})", ("sub",)),
             ("{out} = M.negative({0})", ("neg",)),
             ("{out} = M.arctan2({0}, {1} + 0.3717)", ("atan2",)),
             ("{out} = M.absolute({0}) + {0}", ("abs", "add"))]
    code, ops = forms[int(rng.integers(0, len(forms)))]
    return ((i, j) if "{1}" in code else (i,)), code, ops


def f_nn_functional(rng, shapes):
    """tapegrad.nn.functional (torch.nn.functional): losses and activations."""
    i = _pick(rng, list(range(len(shapes))))
    s = shapes[i]
    same = [j for j, t in enumerate(shapes) if t == s]
    j = _pick(rng, same)
    red = ["'mean'", "'sum'", "'none'"][int(rng.integers(0, 3))]
    forms = [("{out} = M.nn.functional.mse_loss({0}, {1}, reduction=%s)" % red, (0, 1)),
             ("{out} = M.nn.functional.logsigmoid({0})", (0,)),
             ("{out} = M.nn.functional.binary_cross_entropy_with_logits({0}, M.sigmoid({1}), "
              "reduction=%s)" % red, (0, 1)),
             ("{out} = M.nn.functional.%s({0})" % ["relu", "sigmoid", "tanh"][
                 int(rng.integers(0, 3))], (0,))]
    if s:
        d = _dim(rng, len(s))
        forms.append(("{out} = M.nn.functional.%s({0}, dim=%d)" % (
            ["softmax", "log_softmax"][int(rng.integers(0, 2))], d), (0,)))
    if len(s) == 2:
        t = [int(x) for x in rng.integers(0, s[1], size=s[0])]
        forms.append(("{out} = M.nn.functional.cross_entropy({0}, M.tensor(%r), reduction=%s)"
                      % (t, red), (0,)))
        forms.append(("{out} = M.nn.functional.nll_loss(M.log_softmax({0}, dim=1), "
                      "M.tensor(%r), reduction=%s)" % (t, red), (0,)))
    if s and rng.random() < 0.3:  # argmax / argmin as an index (their values: no gradient)
        fn = ["argmax", "argmin"][int(rng.integers(0, 2))]
        forms = [("{out} = {0}.reshape(-1)[{0}.%s()] * {0}" % fn, (0,))]
    code, uses = forms[int(rng.integers(0, len(forms)))]
    return ((i, j) if 1 in uses else (i,)), code, ("mul", "sub", "sum", "mean")


#: the forms of torch's wider surface (custom Functions among them: not traceable)
SURFACE_FORMS = {
    "remainder": f_remainder, "linalg_norm": f_linalg_norm, "einsum": f_einsum,
    "multigammaln": f_multigammaln, "repeat_interleave": f_repeat_interleave,
    "cross": f_cross, "sort": f_sort, "mm": f_mm, "index_add": f_index_add,
    "views": f_views, "methods_inplace": f_methods_inplace, "functions": f_functions,
    "nn_functional": f_nn_functional,
}
#: those a traced program cannot hold (custom Functions; trace raises a clear error)
UNTRACEABLE_SURFACE = ("remainder", "multigammaln")
ARRAY_FORMS.update(SURFACE_FORMS)
#: how often a form is drawn relative to the others: reductions (dims, keepdim, nine ops)
#: and indexing have the most variants
WEIGHTS = {"reduce": 3, "getitem": 2}
#: program families: generate() keywords, one per kind of path they reach
FAMILIES = {
    "scalar": dict(arrays=False),                       # scalar, record
    "flat": dict(shapes=[(), (5,), (5,)], forms=("slice1d",)),  # flat, fused
    "array": dict(),                                    # sweep, rerecord, batched, checked
    # torch's wider surface (einsum, linalg.norm, %, sort...) beside a few common forms
    "surface": dict(shapes=[(), (3,), (2, 3), (3, 3), (2, 1), (1, 3), (4,), (3, 2)],
                    forms=tuple(SURFACE_FORMS) + ("reduce", "getitem", "matmul", "expand")),
}


# --- shrinking -----------------------------------------------------------------------------

def revalidate(prog):
    """``prog`` with every node's shape recomputed in torch, or None when torch rejects it or
    a value is not well defined (a shrink candidate that is no longer a valid program)."""
    torch = _torch()
    H = helpers(torch)
    vals = [torch.tensor(v, dtype=torch.float64) for v, _ in prog.inputs]
    instrs = []
    for ins in prog.instrs:
        if any(a >= len(vals) for a in ins.args):
            return None
        v = _run_instr(torch, H, ins, vals)
        if v is None:
            return None
        instrs.append(dataclasses.replace(ins, shape=tuple(v.shape)))
        vals.append(v)
    return Program(prog.seed, list(prog.inputs), instrs)


def _without(prog, j):
    """Candidates without instruction ``j``: its uses replaced by one of its arguments."""
    n_in = len(prog.inputs)
    node = n_in + j
    for sub in dict.fromkeys(prog.instrs[j].args):
        instrs = []
        for ins in prog.instrs[:j] + prog.instrs[j + 1:]:
            args = tuple(sub if a == node else (a - 1 if a > node else a) for a in ins.args)
            instrs.append(dataclasses.replace(ins, args=args))
        yield Program(prog.seed, list(prog.inputs), instrs)
    # or without it and everything that depends on it
    dead = {node}
    keep = []
    for k, ins in enumerate(prog.instrs):
        if n_in + k in dead or any(a in dead for a in ins.args):
            dead.add(n_in + k)
        else:
            keep.append(k)
    remap = {i: i for i in range(n_in)}
    instrs = []
    for k in keep:
        ins = prog.instrs[k]
        remap[n_in + k] = n_in + len(instrs)
        instrs.append(dataclasses.replace(ins, args=tuple(remap[a] for a in ins.args)))
    yield Program(prog.seed, list(prog.inputs), instrs)


def _smaller_inputs(prog):
    """Candidates with one input smaller (fewer elements) or with rounder values."""
    for i, (v, rg) in enumerate(prog.inputs):
        s = np.shape(v)
        cands = []
        for d, n in enumerate(s):
            if n > 1:
                cands.append(np.take(v, range(n - 1), axis=d))
                cands.append(np.take(v, [0], axis=d))
        if s:
            cands.append(float(np.asarray(v).reshape(-1)[0]))
        r = np.round(np.asarray(v, dtype=np.float64), 1)
        if not np.array_equal(r, v):
            cands.append(float(r) if s == () else r)
        if not rg:
            cands.append(v)  # the same value, requiring grad
        for c in cands:
            inputs = list(prog.inputs)
            inputs[i] = (c, rg or c is v)
            yield Program(prog.seed, inputs, list(prog.instrs))


def shrink(prog, fails, budget=300):
    """A smallest program (fewest instructions, then smallest inputs) for which ``fails``
    still holds, trying at most ``budget`` candidates."""
    tried = 0
    progress = True
    while progress and tried < budget:
        progress = False
        for j in reversed(range(len(prog.instrs))):
            if j >= len(prog.instrs):
                continue
            for cand in _without(prog, j):
                cand = revalidate(cand)
                tried += 1
                if cand is not None and _holds(fails, cand):
                    prog, progress = cand, True
                    break
        for cand in _smaller_inputs(prog):
            if tried >= budget:
                break
            cand = revalidate(cand)
            tried += 1
            if cand is not None and _holds(fails, cand):
                prog, progress = cand, True
                break
    return prog


def _holds(fails, prog):
    try:
        return bool(fails(prog))
    except Exception:
        return False
