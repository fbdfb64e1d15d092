"""The one emitter of the code generator: ``Target`` (how an interpreter reads and writes
operands and adjoints), ``render``/``dispatch`` and ``rule_exprs`` (a rule run once on ``SymF``)."""
from __future__ import annotations

import ast
import re

from ..ops import BINARY, OPS, UNARY, UNARY_C, Sym, SymF, rule_inputs, rule_of


def _uses(expr, name):
    return re.search(rf"\b{name}\b", expr) is not None


class Target:
    """How generated code reads and writes one entry's operands, for the one emitter
    (``render``): ``cols`` maps a rule's names (a, b, c, c0, c1) to their columns in
    ``rows``; ``val`` and ``adj`` are format strings of a value's and an adjoint's source,
    given ``s``, the source of a slot (``k`` for the entry's own) and ``n``, the operand's
    name. Each is read one of three ways (``val_mode``, ``adj_mode``): ``scalar``, one
    value, read before the loop if there is one; ``row``, a row bound before the loop and
    indexed ``[j]`` in it; ``elem``, read in the loop. ``loop`` is the loop's header (a
    batch or an array's elements), None for one value per slot. ``keep_zero`` keeps rules'
    constant zero gradients (the tape sweeps add them, as torch's accumulation does);
    ``index`` False when the slots' indices are bound elsewhere (the flat sweep)."""

    def __init__(self, cols, val, adj, val_mode="scalar", adj_mode="scalar", loop=None,
                 keep_zero=False, index=True, out=None):
        self.cols, self.val, self.adj, self.loop = cols, val, adj, loop
        self.val_mode, self.adj_mode = val_mode, adj_mode
        self.keep_zero, self.index = keep_zero, index
        # a forward's result: format of the statement that stores it (``{s}``: the slot,
        # k; ``{e}``: the expression); ``cols`` None: the operands are bound already
        self.out = out


#: the tape's rows (opcode, a, b, c0, c1) and a traced program's (opcode, a, b, c, c0, c1)
TAPE_COLS = {"a": 1, "b": 2, "c0": 3, "c1": 4}
ROW_COLS = {"a": 1, "b": 2, "c": 3, "c0": 4, "c1": 5}


def _slot(n):
    return "k" if n == "out" else f"i{n}"


def _consts(op, exprs):
    return [n for n in ("c0", "c1") if any(_uses(e, n) for e in exprs)]


def _render_body(t, head, reads, inner_last):
    """``head`` (statements before any read), the reads ``reads`` (name -> slot source) as
    the target reads values, then ``inner_last`` (statements that need the values and the
    adjoint), with the target's loop when it has one."""
    pre, inner = list(head), []
    for n, s in reads.items():
        src = t.val.format(s=s, n=n)
        if t.val_mode == "scalar" or t.loop is None:
            pre.append(f"{n} = {src}")
        elif t.val_mode == "row":
            pre.append(f"v{n} = {src}")
            inner.append(f"{n} = v{n}[j]")
        else:
            inner.append(f"{n} = {src}")
    pre += inner_last[0]
    inner += inner_last[1]
    if t.loop is None:
        return pre + inner
    return pre + [t.loop] + ["    " + x for x in inner]


def render(op, t, forward=False):
    """The statements of opcode ``op``'s branch for target ``t``: its reverse rule (the
    rule run once on ``SymF``, ``rule_exprs``), or with ``forward`` its forward (``nb``
    template). None when there is nothing to do (no rule, or only zero gradients)."""
    if forward:
        e = _forward_expr(op)
        ins = [n for n in _inputs(op) if _uses(e, n)]
        bound = t.cols is None  # the operands are the function's own arguments
        head = [] if bound else [f"{n} = rows[k, {t.cols[n]}]" for n in _consts_of(op)
                                 if _uses(e, n)]
        reads = {} if bound else {n: t.val.format(s=f"int(rows[k, {t.cols[n]}])", n=n)
                                  for n in ins}
        pre = list(head)
        inner = []
        for n, src in reads.items():
            if t.val_mode == "row" and t.loop is not None:
                pre.append(f"v{n} = {src}")
                inner.append(f"{n} = v{n}[j]")
            else:
                pre.append(f"{n} = {src}")
        inner.append(t.out.format(s="k", e=e))
        return pre + ([t.loop] + ["    " + x for x in inner] if t.loop else inner)
    exprs = rule_exprs(op, t.keep_zero)
    if not exprs:
        return None
    ins = rule_inputs(op)
    reads = [n for n in ins + ("out",) if any(_uses(e, n) for e in exprs.values())]
    head = []
    if t.index:
        head += [f"i{n} = int(rows[k, {t.cols[n]}])" for n in ins if n in exprs or n in reads]
    head += [f"{n} = rows[k, {t.cols[n]}]" for n in _consts(op, exprs.values())]
    pre, inner = [], []
    if t.adj_mode == "row":
        pre += [f"a{n} = {t.adj.format(s=_slot(n), n=n)}" for n in exprs]
        pre.append(f"gk = {t.adj.format(s='k', n='out')}")
        inner.append("g = gk[j]")
        inner += [f"a{n}[j] += {e}" for n, e in exprs.items()]
    else:
        (pre if t.loop is None or t.adj_mode == "scalar" else inner).append(
            f"g = {t.adj.format(s='k', n='out')}")
        inner += [f"{t.adj.format(s=_slot(n), n=n)} += {e}" for n, e in exprs.items()]
    return _render_body(t, head, {n: _slot(n) for n in reads}, (pre, inner))


def chain(ops, body_of, indent=8, first=True):
    """An ``if``/``elif`` chain on ``op`` with ``body_of(op)``'s lines for each op (ops it
    gives None are left out); ``first`` False continues a chain (``elif`` from the start)."""
    src = []
    for op in ops:
        body = body_of(op)
        if body is None:
            continue
        src.append(" " * indent + f"{'if' if first else 'elif'} op == {op.code}:  # {op.name}\n")
        src += [" " * (indent + 4) + f"{x}\n" for x in body]
        first = False
    return src


def dispatch(ops, t, indent=8, forward=False, first=True):
    """``chain`` of each op's ``render`` for target ``t``."""
    return chain(ops, lambda op: render(op, t, forward), indent, first)



def _replay_ops():
    from ..ops import COMPARE, REPLAY
    return [op for op in OPS if op.nb is not None and op.name not in ("import_", "guard")
            and op.kind in (UNARY, UNARY_C, BINARY, COMPARE, REPLAY)]


def _inputs(op):
    from ..ops import COMPARE, REPLAY
    if op.kind in (COMPARE, REPLAY):
        return ("a", "b", "c")[:op.arity]
    return ("a", "b") if op.kind == BINARY else ("a",)


def _consts_of(op):
    return ("c0", "c1") if op.kind == UNARY_C else ()


def _forward_expr(op):
    names = {n: n for n in _inputs(op) + _consts_of(op)}
    return op.nb.format(**names)


def rule_exprs(op, keep_zero=False):
    """{input name: gradient expression} of an op's rule, in source form: the rule run once
    on ``SymF``; constant zero gradients are left out unless ``keep_zero``."""
    from ..ops import COMPARE
    if op.vjp is None or op.kind == COMPARE:
        return {}
    out = {}
    for name, gr in rule_of(op, SymF, Sym).items():
        e = gr.s if isinstance(gr, Sym) else repr(float(gr))
        if keep_zero or e != "0.0":
            out[name] = e
    return out


#: a traced program's interpreters: one sample (``v``, ``adj``), a batch in columns (``V``,
#: ``A``: rows x samples), one sample with many seeds (``A[k, j]``), a CUDA thread. One
#: sample indexes by unsigned slots: Numba adds a negative index's wraparound to every
#: signed one (slots are never negative), and without it value_and_grad ran 14 to 18%
#: faster (n=100 and n=1000 Rosenbrock, CPU time; the pendulum unchanged)
REPLAY_ONE = Target(ROW_COLS, "v[np.uint64({s})]", "adj[np.uint64({s})]", out="v[{s}] = {e}")
REPLAY_BATCH = Target(ROW_COLS, "V[{s}]", "A[{s}]", val_mode="row", adj_mode="row",
                      loop="for j in range(nb):", out="vk[j] = {e}")
REPLAY_MULTI = Target(ROW_COLS, "v[{s}]", "A[{s}]", adj_mode="row", loop="for j in range(nb):")
CUDA = Target(ROW_COLS, "V[{s}, j]", "A[{s}, t]", out="V[{s}, j] = {e}")
#: the forward at operands that are the function's arguments (``value``, the recording
#: sweep's constant folding)
VALUE = Target(None, None, None, out="return {e}")


_RULE_NAMES = re.compile(r"\b(a|b|c|c0|c1|out|g)\b")


def _renamed(expr, names):
    """``expr`` (a rule's source) with its names replaced by ``names``' (in one pass)."""
    return _RULE_NAMES.sub(lambda m: names.get(m.group(1), m.group(1)), expr)


def render_pair(head, tail, operand, t, forward=False):
    """A superinstruction's branch (``fuse.PAIRS``) for a one-sample target ``t`` (scalar
    reads, no loop; ``k`` the row as an unsigned slot, ``kk`` the loop's signed counter):
    row k's ``head`` and row k + 1's ``tail``, whose operand ``operand`` is row k. Forward
    (dispatched at the head's row): both values, the head's kept in a register for the tail,
    and ``kk`` past the tail. Reverse (at the tail's row): the tail's rule, the head's
    adjoint completed in a register (every later row has added to it already) and stored,
    then the head's rule, and ``kk`` past the head. The same expressions in the same order
    as the two rows' own branches, so the numbers are the same to the bit."""
    p = _inputs(tail)[operand]
    if forward:
        he = head.nb.format(**{n: "h" + n for n in _inputs(head) + _consts_of(head)})
        te = tail.nb.format(**{n: "hv" if n == p else "t" + n
                               for n in _inputs(tail) + _consts_of(tail)})
        src = [f"h{n} = rows[k, {t.cols[n]}]" for n in _consts_of(head) if _uses(he, "h" + n)]
        src += [f"h{n} = " + t.val.format(s=f"int(rows[k, {t.cols[n]}])", n=n)
                for n in _inputs(head) if _uses(he, "h" + n)]
        src += [f"hv = {he}", t.out.format(s="k", e="hv"), "k1 = np.uint64(kk + 1)"]
        src += [f"t{n} = rows[k1, {t.cols[n]}]" for n in _consts_of(tail)
                if _uses(te, "t" + n)]
        src += [f"t{n} = " + t.val.format(s=f"int(rows[k1, {t.cols[n]}])", n=n)
                for n in _inputs(tail) if n != p and _uses(te, "t" + n)]
        return src + [t.out.format(s="k1", e=te), "kk += 1"]
    src = ["k0 = np.uint64(kk - 1)", f"g = {t.adj.format(s='k', n='out')}"]
    for rule, row, pre, g, own in ((tail, "k", "t", "g", None), (head, "k0", "h", "gh", "k0")):
        exprs = rule_exprs(rule)
        names = {n: pre + n for n in rule_inputs(rule) + ("out", "c0", "c1")}
        names["g"] = g
        if rule is tail:
            names[p] = "hv"
        ins = [n for n in rule_inputs(rule) if n != p or rule is head]
        src += [f"i{pre}{n} = int(rows[{row}, {t.cols[n]}])" for n in ins if n in exprs
                or any(_uses(e, n) for e in exprs.values())]
        if any(_uses(e, p) for e in exprs.values()) and rule is tail:
            src.append(f"hv = {t.val.format(s='k0', n=p)}")
        src += [f"{pre}{n} = " + t.val.format(s=f"i{pre}{n}", n=n) for n in ins
                if any(_uses(e, n) for e in exprs.values())]
        if any(_uses(e, "out") for e in exprs.values()):
            src.append(f"{pre}out = {t.val.format(s=row, n='out')}")
        src += [f"{pre}{n} = rows[{row}, {t.cols[n]}]" for n in ("c0", "c1")
                if any(_uses(e, n) for e in exprs.values())]
        for n, e in exprs.items():
            if rule is tail and n == p:
                continue
            src.append(f"{t.adj.format(s=f'i{pre}{n}', n=n)} += {_renamed(e, names)}")
        if rule is tail:
            e = exprs.get(p)
            gh = t.adj.format(s="k0", n="out")
            src += [f"gh = {gh}" + ("" if e is None else f" + {_renamed(e, names)}"),
                    f"{gh} = gh"]
    return src + ["kk -= 1"]


def dispatch_pairs(pairs, t, indent=8, forward=False):
    """``elif`` branches of the superinstructions ``pairs`` ((head, tail, operand) op
    names, ``fuse.PAIRS``), pair i's head opcode ``base + 2 i`` and its tail's ``+ 1``:
    forward dispatches on the head, reverse on the tail."""
    from ..ops import BY_NAME
    from .fuse import BASE
    src = []
    for i, (h, tl, operand) in enumerate(pairs):
        head, tail = BY_NAME[h], BY_NAME[tl]
        code = BASE + 2 * i + (0 if forward else 1)
        src.append(" " * indent + f"elif op == {code}:  # {h} then {tl}\n")
        src += [" " * (indent + 4) + f"{x}\n"
                for x in render_pair(head, tail, operand, t, forward)]
    return src


class _Fold(ast.NodeTransformer):
    """Conditional expressions whose test compares two constants, replaced by the branch
    the test picks (``_folded``)."""

    def visit_IfExp(self, node):
        self.generic_visit(node)
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 \
                and isinstance(test.left, ast.Constant) \
                and isinstance(test.comparators[0], ast.Constant) \
                and isinstance(test.ops[0], (ast.Eq, ast.NotEq)):
            same = test.left.value == test.comparators[0].value
            return node.body if same == isinstance(test.ops[0], ast.Eq) else node.orelse
        return node


def _folded(expr):
    """``expr`` (an op's source with a fixed constant written in) without the branches of the
    constant's other values: the branch taken, the same operations (Numba compiles each
    branch before dropping the dead ones: a chain's compile was 0.4 s longer)."""
    return ast.unparse(_Fold().visit(ast.parse(expr, mode="eval")))


def render_chain(chain, t, forward=False):
    """A three-row superinstruction's branch (``fuse.CHAINS``) for a one-sample target ``t``
    (as ``render_pair``): ``chain`` is ((op, fixed constants {name: source}, the input that
    is the row before, or None for the first row), ...), rows k, k + 1, ... Forward
    (dispatched at the first row): each value from the one before kept in a register, every
    value stored, ``kk`` past the last row. Reverse (at the last row): each row's rule from
    the last, the adjoint of the row before completed in a register (every later row has
    added to it already, ``fuse`` checks that no row of the chain reads another but the
    one before it) and stored, ``kk`` past the first row. A fixed constant (a square's
    exponent, which ``fuse`` checks) is written into the expressions, where Numba's
    optimizer drops the branches of the op's other constants. The same expressions in the
    same order as the rows' own branches: the same numbers, to the bit."""
    last = len(chain) - 1

    def row(i):
        return "k" if i == (0 if forward else last) else f"k{i}"

    if forward:
        src = []
        for i, (op, fixed, link) in enumerate(chain):
            if i > 0:
                src.append(f"{row(i)} = np.uint64(kk + {i})")
            names = {n: fixed.get(n, f"r{i}{n}") for n in _consts_of(op)}
            names.update({n: f"r{i - 1}" if n == link else f"r{i}{n}" for n in _inputs(op)})
            e = _folded(op.nb.format(**names))
            src += [f"r{i}{n} = rows[{row(i)}, {t.cols[n]}]" for n in _consts_of(op)
                    if n not in fixed and _uses(e, f"r{i}{n}")]
            src += [f"r{i}{n} = " + t.val.format(s=f"int(rows[{row(i)}, {t.cols[n]}])", n=n)
                    for n in _inputs(op) if n != link and _uses(e, f"r{i}{n}")]
            src += [f"r{i} = {e}", t.out.format(s=row(i), e=f"r{i}")]
        return src + [f"kk += {last}"]
    src = [f"k{i} = np.uint64(kk - {last - i})" for i in range(last)]
    src.append(f"g{last} = {t.adj.format(s='k', n='out')}")
    for i in range(last, -1, -1):
        op, fixed, link = chain[i]
        exprs = rule_exprs(op)

        def used(n, exprs=exprs):
            return any(_uses(e, n) for e in exprs.values())
        names = {n: f"r{i}{n}" for n in rule_inputs(op) + ("out", "c0", "c1")}
        names.update(fixed)
        names["g"] = f"g{i}"
        ins = [n for n in rule_inputs(op) if n != link]
        src += [f"ir{i}{n} = int(rows[{row(i)}, {t.cols[n]}])" for n in ins
                if n in exprs or used(n)]
        if link is not None and used(link):
            src.append(f"r{i}{link} = " + t.val.format(s=f"k{i - 1}", n=link))
        src += [f"r{i}{n} = " + t.val.format(s=f"ir{i}{n}", n=n) for n in ins if used(n)]
        if used("out"):
            src.append(f"r{i}out = " + t.val.format(s=row(i), n="out"))
        src += [f"r{i}{n} = rows[{row(i)}, {t.cols[n]}]" for n in ("c0", "c1")
                if n not in fixed and used(n)]
        src += [f"{t.adj.format(s=f'ir{i}{n}', n=n)} += {_folded(_renamed(e, names))}"
                for n, e in exprs.items() if n != link]
        if link is not None:
            e = exprs.get(link)
            before = t.adj.format(s=f"k{i - 1}", n="out")
            src += [f"g{i - 1} = {before}"
                    + ("" if e is None else f" + {_folded(_renamed(e, names))}"),
                    f"{before} = g{i - 1}"]
    return src + [f"kk -= {last}"]


def dispatch_chains(chains, t, indent=8, forward=False):
    """``elif`` branches of the three-row superinstructions ``chains`` (``fuse.CHAINS``),
    chain i's first row's opcode ``fuse.CHAIN_BASE + 3 i``, its last row's ``+ 2``: forward
    dispatches on the first, reverse on the last."""
    from ..ops import BY_NAME
    from .fuse import CHAIN_BASE
    src = []
    for i, spec in enumerate(chains):
        chain = [(BY_NAME[name], {c: repr(float(x)) for c, x in fixed},
                  None if link is None else _inputs(BY_NAME[name])[link])
                 for name, fixed, link in spec]
        code = CHAIN_BASE + 3 * i + (0 if forward else 2)
        src.append(" " * indent + f"elif op == {code}:  # "
                   + " then ".join(name for name, _, _ in spec) + "\n")
        src += [" " * (indent + 4) + f"{x}\n" for x in render_chain(chain, t, forward)]
    return src
