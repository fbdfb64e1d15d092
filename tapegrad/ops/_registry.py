"""The one ops registry: each op's opcode, forward kernels and derivative rule, side by side.

An op is declared once, everything about it in its one ``register(...)`` call:

* ``py``  -- forward on Python floats (the 0-d float64 fast path of eager mode),
* ``np``  -- forward on NumPy arrays (array entries, eager and sweep),
* ``nb``  -- forward as a Numba scalar expression template (the compiled interpreters),
* ``vjp`` -- the derivative rule, written once against a backend namespace ``F`` and
  Python operators, so the same rule becomes generated Numba source (``SymF``), runs on
  NumPy arrays (``NpF``) and re-records onto a tape (tensor ops, create_graph),
* ``batch`` and ``lower`` -- an array op's batch rule (is_grads_batched) and its lowering
  to program rows (``tapegrad.trace``, see ops/lowering.py),
* ``const`` -- a binary op's forms with a float constant (``x * 2.0`` records ``mulc``),
* ``torch`` -- the torch function it mirrors; ``api``, ``aliases`` and ``method`` -- its
  public surface: ``tapegrad.<name>`` for each api name (in ``__all__``) and alias
  (NumPy's spellings, outside ``__all__``), and ``Tensor.<name>`` for each when
  ``method`` (tapegrad/functions.py builds them; an elementwise op needs no code there),
* ``via`` -- for the API reference (docs/api.md), what records an op that no torch
  function of its own name does,
* ``torch_saves`` -- which of its values (a, b, out) torch saves for backward, where that
  differs from what its rule reads (per input that requires grad, as torch saves only
  what the needed formulas read): the in-place version check raises only for those,
* ``scatter`` -- for an op whose gradient is its output's adjoint added into its input
  (full sums and means, indexing), that rule written elementwise, as the sweeps that
  add in place run it (the flat sweep, a view's adjoint).

Elementwise ops have a scalar opcode swept by the compiled interpreter; when an entry
works on arrays its opcode carries the ``ARRAY`` flag and the array interpreter runs the
same rule on NumPy values.
"""
from __future__ import annotations

import enum

ARRAY = 256          # opcode flag: the entry is swept by the array interpreter
ROW = 5              # tape row: opcode, a, b, c0, c1

#: kinds of op
SPECIAL = "special"  # tape bookkeeping (leaf, constant, import)
UNARY = "unary"      # elementwise f(a)
UNARY_C = "unary_c"  # elementwise f(a; c0, c1) with float constants
BINARY = "binary"    # elementwise f(a, b), broadcasting
ARRAY_OP = "array"   # array-only op with a Python ``aux`` (shape, axis, index...)
COMPARE = "compare"  # comparison or logic on 1.0/0.0 truth values: no gradient (traced)
REPLAY = "replay"    # scalar op of traced programs only: select, pick, detach, guard

#: Every op's opcode is its index here. Opcodes are stored in tapes, saved programs and
#: compiled code, so this list only grows: a new op's name goes at the END (inserting or
#: reordering would silently give existing ops other opcodes; a test pins the order).
OPCODES = (
    "leaf", "const", "import_", "neg", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "sigmoid", "relu",
    "erf", "abs", "sign", "square", "reciprocal", "addc", "mulc", "rsubc", "divc", "rdivc",
    "powc", "rpowc", "clamp", "softplus", "add", "sub", "mul", "div", "pow", "atan2",
    "maximum", "minimum", "clamp_min_t", "clamp_max_t", "clone", "reshape", "expand",
    "sum_to", "transpose", "permute", "cast", "stack", "cat", "diag", "getitem",
    "index_scatter", "setitem", "where", "sum", "mean", "prod", "prod_others", "amax",
    "amin", "norm", "logsumexp", "softmax", "log_softmax", "matmul", "outer", "function",
    "function_out", "program", "lt", "le", "gt", "ge", "eq", "ne", "logical_and",
    "logical_or", "logical_xor", "logical_not", "detach", "select", "pick", "guard",
    "round_f32", "array_ew", "array_tail", "array_red", "eq_nan", "pick_where",
    "powc_special", "fms", "cross",
)

_VALUES, _OUT = frozenset(("a", "b", "out")), frozenset(("out",))
OPS: list[Op] = []  # by opcode (ops/__init__ sorts it once every family has registered)
BY_NAME: dict[str, Op] = {}


class Op:
    """One registered op. Fields are documented in the module docstring."""

    __slots__ = ("name", "code", "kind", "py", "np", "nb", "vjp", "saves", "torch",
                 "nary", "doc", "uses", "batch", "arity", "lower", "const", "api", "aliases",
                 "method", "via", "torch_saves", "scatter")

    def __init__(self, name, kind, *, py=None, np=None, nb=None, vjp=None, saves=True,
                 torch=None, nary=False, doc="", batch=None, arity=None, lower=None,
                 const=None, api=(), aliases=(), method=False, via="", torch_saves=None,
                 scatter=None):
        self.name = name
        self.kind = kind
        self.py = py
        self.np = np
        self.nb = nb
        self.vjp = vjp
        # whether a backward through this entry needs values that retain_graph=False frees
        self.saves = saves
        # name of the torch function this op mirrors (for the registry-driven tests)
        self.torch = torch
        # N-ary: the entry's inputs are listed in its aux (``aux[0]`` is the slot list)
        self.nary = nary
        self.doc = doc
        # batched sweeps (is_grads_batched): batch(values, out, g, aux, B) gives the rule's
        # arguments with a leading batch axis, and a function mapping its results back
        self.batch = batch
        # scalar inputs of compare and replay ops (a, b, c), for the traced-program interpreters
        self.arity = arity
        # lower(L, inputs, aux, value): the op on arrays of program slots, emitting scalar
        # program rows through L (see ops/lowering.py); elementwise ops need none
        self.lower = lower
        # a binary op's forms with a float constant, recorded instead of it (``x * 2.0`` as
        # mulc): ((name, sign of c) for x op c, (name, sign of c) for c op x), or None
        self.const = const
        # public functions: ``tapegrad.<name>`` per api name (listed in ``__all__``) and per
        # alias (not listed); ``Tensor.<name>`` too for each when ``method``
        self.api, self.aliases, self.method = tuple(api), tuple(aliases), method
        # what records the op, for the API reference where no torch function of its name does
        self.via = via
        # which of a, b, out torch saves for backward (its version check raises after an
        # in-place change of those only; a tape entry keeps the old value, so the rest
        # computes right): None for what the rule reads (``uses``), a set, a dict {input:
        # what its gradient reads} (torch saves those of the inputs that require grad, and
        # a result whatever requires grad), or a function of the entry's aux giving a set
        # (max over a dim saves only its indices)
        self.torch_saves = torch_saves if torch_saves is None or callable(torch_saves) \
            else {n: frozenset(v) for n, v in torch_saves.items()} \
            if isinstance(torch_saves, dict) else frozenset(torch_saves)
        # (at, f): the rule as "input element += f(g, n)", g an adjoint element of the
        # output and n the input's size; ``at`` is "all" (a full reduction, aux[0] None:
        # every input element gets the output's one adjoint) or "index" (output element i
        # goes to the input at the entry's index, aux (index, input shape, basic) as
        # getitem's). ``f`` runs on NumPy values (a view's adjoint, interpreters/cpu.py)
        # and on ``Sym`` (the generated flat sweep); a test checks it against ``vjp``
        self.scatter = scatter
        self.code = OPCODES.index(name)
        # which of the entry's values (a, b, out) its rule reads, and which constants (c0, c1)
        # its rule or forward reads; filled in by ops/__init__
        self.uses = frozenset(("a", "b", "out")) if saves else frozenset()

    def saved(self, aux=None, grads=("a", "b")):
        """Which of a, b, out an entry of this op saves as torch does, when its inputs
        ``grads`` require grad (``aux``: the entry's, for an op whose answer depends on
        it)."""
        s = self.torch_saves
        if s is None:
            return self.uses & _VALUES
        if callable(s):
            return s(aux)
        if isinstance(s, dict):  # torch saves a result whatever requires grad
            out = _OUT if any("out" in v for v in s.values()) else frozenset()
            return out.union(*[s.get(n, ()) for n in grads])
        return s

    @property
    def saves_by_input(self):
        """Whether what an entry saves depends on which of its inputs require grad."""
        return isinstance(self.torch_saves, dict)

    @property
    def scalar(self):
        """Whether the compiled scalar interpreter sweeps this op."""
        return self.kind in (UNARY, UNARY_C, BINARY) or self.name == "import_"

    def __repr__(self):
        return f"<op {self.name} #{self.code}>"


class Part:
    """The gradient for output ``index`` of a multi-output entry (a custom Function): the
    sweeps gather these per entry and hand them to its rule together."""

    __slots__ = ("index", "grad")

    def __init__(self, index, grad):
        self.index, self.grad = index, grad


def register(name, kind, **kw):
    if name in BY_NAME:
        raise ValueError(f"op {name!r} registered twice")
    if kw.get("vjp") is None and kind in (UNARY, UNARY_C, BINARY, ARRAY_OP):
        # create_graph differentiates every rule again: none may be missing
        raise ValueError(f"op {name!r} needs a derivative rule (vjp=...) written in F ops")
    if (kw.get("aliases") or kw.get("method")) and not kw.get("api"):
        raise ValueError(f"op {name!r}: aliases= and method= need the public name(s) in "
                         f"api=(...) (tapegrad.<name>, listed in __all__)")
    if name not in OPCODES:
        raise ValueError(f"op {name!r} has no opcode: append its name at the end of OPCODES "
                         "in tapegrad/ops/_registry.py (never insert: existing opcodes must "
                         "not change)")
    op = Op(name, kind, **kw)
    OPS.append(op)
    BY_NAME[name] = op
    return op


def finish():
    """Order ``OPS`` by opcode once every op is registered, so ``OPS[code]`` is that op."""
    OPS.sort(key=lambda op: op.code)
    missing = [n for n in OPCODES if n not in BY_NAME]
    if missing:
        raise RuntimeError(f"opcodes without a registered op: {missing}")
    assert [op.code for op in OPS] == list(range(len(OPCODES)))
    if len(OPCODES) > ARRAY:
        raise RuntimeError(f"more than {ARRAY} opcodes: the ARRAY flag would collide")


def opcode_enum():
    """The ``Opcode`` IntEnum: UPPER_CASE member per registered op."""
    return enum.IntEnum("Opcode", {op.name.upper().rstrip("_"): op.code for op in OPS})
