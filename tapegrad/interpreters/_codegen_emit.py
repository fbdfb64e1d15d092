"""The one emitter of the code generator: ``Target`` (how an interpreter reads and writes
operands and adjoints), ``render``/``dispatch`` and ``rule_exprs`` (a rule run once on ``SymF``)."""
from __future__ import annotations

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
