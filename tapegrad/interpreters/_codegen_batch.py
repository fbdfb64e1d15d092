"""Generates the batched replay's ``run_block`` and the shared loop of the rarer ops into
``_generated_replay.py``, with ``_codegen_emit``'s emitter."""
from __future__ import annotations

import re

from ..ops import OPS, rule_inputs
from ._codegen_emit import (ROW_COLS, _consts_of, _forward_expr, _inputs, _renamed, _uses, chain,
                             rule_exprs)

#: the ops whose batch branches are loops of their own, which LLVM vectorizes over the
#: block's samples: the common ones in traced programs. The other ops share one loop that
#: calls their one-sample code per sample: each loop of its own costs about 0.1 s of a cold
#: compile, and the 60 of them made the first batched call compile 15 s (2 cores)
BATCH_LOOPED = frozenset((
    "neg", "exp", "log", "sqrt", "sin", "cos", "tanh", "sigmoid", "square", "addc", "mulc",
    "rsubc", "divc", "powc", "add", "sub", "mul", "div"))

#: ops whose batch loops are one loop with a sign (+-1.0, so the same numbers: x * -1.0 is
#: -x exactly, and a + -b is a - b): a loop fewer is about 0.1 s less of a cold compile.
#: Their rules and forwards as the registry has them now; ``_signed`` checks that they still
#: are, so a changed rule fails the generator instead of giving other numbers in batches
SIGNED = {
    # op: (forward, gradient to a, gradient to b)
    "add": ("(a + b)", "g", "g"), "sub": ("(a - b)", "g", "(-g)"),
    "addc": ("(a + c0)", "g", None), "rsubc": ("(c0 - a)", "(-g)", None),
    "neg": ("(-a)", "(-g)", None)}

SIGNED_FORWARD = '''        if op == {add} or op == {sub}:  # add, sub: a + s * b with s = +-1.0
            s = 1.0 if op == {add} else -1.0
            oa = np.uint64(int(rows[k, 1])) * u
            ob = np.uint64(int(rows[k, 2])) * u
            for j in range(u):
                Vw[ok + j] = Vw[oa + j] + s * Vw[ob + j]
        elif op == {addc} or op == {rsubc}:  # addc, rsubc: s * a + c0 with s = +-1.0
            s = 1.0 if op == {addc} else -1.0
            c0 = rows[k, 4]
            oa = np.uint64(int(rows[k, 1])) * u
            for j in range(u):
                Vw[ok + j] = s * Vw[oa + j] + c0
'''
SIGNED_REVERSE = '''        if op == {add} or op == {sub}:  # add, sub: g to a, s * g to b
            s = 1.0 if op == {add} else -1.0
            oa = np.uint64(int(rows[k, 1])) * u
            ob = np.uint64(int(rows[k, 2])) * u
            Aok = Aw[ok:ok + u]
            Aoa = Aw[oa:oa + u]
            Aob = Aw[ob:ob + u]
            for j in range(u):
                g = Aok[j]
                Aoa[j] += g
                Aob[j] += s * g
        elif op == {neg} or op == {addc} or op == {rsubc}:  # neg, addc, rsubc: s * g to a
            s = 1.0 if op == {addc} else -1.0
            oa = np.uint64(int(rows[k, 1])) * u
            for j in range(u):
                Aw[oa + j] += s * Aw[ok + j]
'''


def _signed(ops):
    """The codes of ``SIGNED``'s ops, after checking their rules and forwards."""
    by = {op.name: op for op in ops}
    for name, (fwd, ga, gb) in SIGNED.items():
        op = by[name]
        want = {n: e for n, e in (("a", ga), ("b", gb)) if e is not None}
        if _forward_expr(op) != fwd or rule_exprs(op) != want:
            raise AssertionError(f"{name}'s forward or rule changed: update SIGNED and the "
                                 f"batch loops of _codegen_batch.SIGNED_* for it")
    return {name: by[name].code for name in SIGNED}


# the shared branch of run_block's sweeps: unused operands (-1) read row k
SHARED_FORWARD = '''        elif SHARED[op]:
            ia = int(rows[k, 1])
            ib = int(rows[k, 2])
            ic = int(rows[k, 3])
            oa = np.uint64(ia if ia >= 0 else k) * u
            ob = np.uint64(ib if ib >= 0 else k) * u
            oc = np.uint64(ic if ic >= 0 else k) * u
            c0 = rows[k, 4]
            c1 = rows[k, 5]
            for j in range(u):
                Vw[ok + j] = forward_value(op, Vw[oa + j], Vw[ob + j], Vw[oc + j], c0, c1)
'''
SHARED_REVERSE = '''        elif SHARED[op] and GRADS[op] != 0:
            m = GRADS[op]
            ia = int(rows[k, 1])
            ib = int(rows[k, 2])
            ic = int(rows[k, 3])
            oa = np.uint64(ia if ia >= 0 else k) * u
            ob = np.uint64(ib if ib >= 0 else k) * u
            oc = np.uint64(ic if ic >= 0 else k) * u
            c0 = rows[k, 4]
            c1 = rows[k, 5]
            for j in range(u):
                ga, gb, gc = reverse_value(op, Vw[oa + j], Vw[ob + j], Vw[oc + j], Vw[ok + j],
                                           Aw[ok + j], c0, c1)
                if m & 1:
                    Aw[oa + j] += ga
                if m & 2:
                    Aw[ob + j] += gb
                if m & 4:
                    Aw[oc + j] += gc
'''


# a block of samples, both sweeps in one compiled function: a compiled caller of separately
# compiled sweeps links their code into its own and optimizes it all again (3.7 s more of a
# cold compile), and Python around them cost 20 us a block (1.4 ms -> 1.6 ms for 256 inputs
# of an 892-row program in blocks of 32). Rows are read and written at flat offsets
# (row x samples) of unsigned integers: a view of a row (``V[k]``) a row cost about 20 ns a
# row (an array struct and its reference count), which made blocks of 4 samples 2.5x and
# of 64 samples 1.3 to 1.5x slower (n=100 and n=1000 Rosenbrock, CPU time), and a signed
# index adds a negative index's wraparound to every element
BLOCK_IMPORT = '''

from . import _atomic  # noqa: E402  (run_block's signal to a worker thread)
'''

BLOCK_HEADER = '''

@njit_cached(error_model="numpy", nogil=True)
def run_block{suffix}(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0, b1, Vw, Aw,
              signal, number):
    """``forward`` and, with ``grad``, ``reverse`` for samples ``b0:b1`` (rows of ``X``:
    ``X[j, i]`` input ``i`` of sample ``j``; of ``S``, the seeds at the outputs), written
    into ``status`` (1 + the row of the sample's first failed guard), ``outs`` and ``G``
    (a row a sample too). The block's values and adjoints (row ``k``, sample ``j`` at
    ``k * (b1 - b0) + j``: rows x samples) live in ``Vw`` and ``Aw``, flat buffers of at
    least rows x samples reused from block to block. A ``number`` above 0 is stored in
    ``signal[0]`` first: a parallel batch's worker thread spins on it, and sees it once this
    thread has let the GIL go (so it takes the GIL without waiting for it){which}."""
    if number > 0:
        _atomic.store_release(signal, 0, number)
    n = rows.shape[0]
    nb = b1 - b0
    u = np.uint64(nb)
    ub0 = np.uint64(b0)
    st = status[b0:b1]
    for k in range(n):
        op = int(rows[k, 0])
        ok = np.uint64(k) * u
'''

BLOCK_LEAVES = '''        elif op == LEAF:
            i = np.uint64(int(rows[k, 4]))
            for j in range(u):
                Vw[ok + j] = X[ub0 + j, i]
        elif op == CONST:
            c0 = rows[k, 4]
            for j in range(u):
                Vw[ok + j] = c0
        elif op == GUARD:
            oa = np.uint64(int(rows[k, 1])) * u
            e = rows[k, 4] != 0.0
            for j in range(u):
                t = Vw[oa + j]
                Vw[ok + j] = t
                if (t != 0.0) != e and st[j] == 0:
                    st[j] = k + 1
'''

BLOCK_MIDDLE = '''    for i in range(out_slots.shape[0]):
        oo = np.uint64(out_slots[i]) * u
        for j in range(u):
            outs[ub0 + j, i] = Vw[oo + j]
    if not grad:
        return
    Aw[:n * nb] = 0.0
    for i in range(out_slots.shape[0]):
        oo = np.uint64(out_slots[i]) * u
        for j in range(u):
            Aw[oo + j] += S[ub0 + j, i]
    for k in range(n - 1, -1, -1):
        op = int(rows[k, 0])
        ok = np.uint64(k) * u
'''

BLOCK_END = '''    for i in range(in_slots.shape[0]):
        oi = np.uint64(in_slots[i]) * u
        for j in range(u):
            G[ub0 + j, i] = Aw[oi + j]
'''

#: a constant operand an op's expressions compare with nonzero literals (``c0 == 2.0``:
#: powc's square): the row's loop is emitted once for each literal, under ``if c0 ==
#: 2.0:`` with the literal for ``c0`` (so the tests fold away and the loop vectorizes), and
#: else as it is; the expression is the same, so are the numbers (powc's reverse with the
#: tests in its loop: n=100 Rosenbrock batch 1.07 ns a row and sample, 0.97 without)
_SPECIAL = re.compile(r"\b([th]?c[01]) == (-?\d+\.\d+)")  # (t, h: a pair's tail, head)


def _loops(head, inner, exprs):
    """``head``, then the loop over the block's samples of ``inner``: one more for each
    value ``exprs`` test a constant operand for (``_SPECIAL``), specialized to it."""
    # not zero: c0 == 0.0 holds at -0.0 too, whose sign the literal would lose; only
    # powc's square (the common exponent): a loop per exponent torch computes otherwise
    # (3, -2, 0.5, -0.5) cost the first batched call's compile more than it saves
    found = sorted({m.groups() for e in exprs for m in _SPECIAL.finditer(e)
                    if float(m.group(2)) == 2.0})
    loop = ["for j in range(u):"] + ["    " + x for x in inner]
    if not found:
        return head + loop
    name = found[0][0]
    out = list(head)
    for i, value in enumerate(v for n, v in found if n == name):
        fixed = [re.sub(rf"\b{name}\b", value, x) for x in loop]
        out += [f"{'if' if i == 0 else 'elif'} {name} == {value}:"] + ["    " + x for x in fixed]
    return out + ["else:"] + ["    " + x for x in loop]


def _offset(n):
    return f"o{n} = np.uint64(int(rows[k, {ROW_COLS[n]}])) * u"


def _flat_forward(op):
    """The statements of ``op``'s forward branch in ``run_block``: its expression
    (``_forward_expr``) over the block's samples, at flat offsets."""
    e = _forward_expr(op)
    ins = [n for n in _inputs(op) if _uses(e, n)]
    head = [f"{n} = rows[k, {ROW_COLS[n]}]" for n in _consts_of(op) if _uses(e, n)]
    head += [_offset(n) for n in ins]
    inner = [f"{n} = Vw[o{n} + j]" for n in ins] + [f"Vw[ok + j] = {e}"]
    return _loops(head, inner, [e])


def _flat_reverse(op):
    """The statements of ``op``'s reverse branch in ``run_block``: its rule's gradients
    (``rule_exprs``) added to its operands' adjoints, at flat offsets; None without any."""
    exprs = rule_exprs(op)
    if not exprs:
        return None
    ins = rule_inputs(op)
    reads = [n for n in ins + ("out",) if any(_uses(e, n) for e in exprs.values())]
    head = [_offset(n) for n in ins if n in exprs or n in reads]
    head += [f"{n} = rows[k, {ROW_COLS[n]}]" for n in ("c0", "c1")
             if any(_uses(e, n) for e in exprs.values())]
    inner = [f"{n} = Vw[{'ok' if n == 'out' else 'o' + n} + j]" for n in reads]
    inner.append("g = Aw[ok + j]")
    inner += [f"Aw[o{n} + j] += {e}" for n, e in exprs.items()]
    return _loops(head, inner, exprs.values())


def _pair_forward(head, tail, p):
    """A superinstruction's forward branch in ``run_block`` (at the head's row ``k``; the
    tail's row ``k + 1`` is ``fuse.fuse``'s pair, whose operand ``p`` is row ``k``): one
    loop over the block's samples, the head's value kept in a register for the tail and
    stored too (outputs and the reverse read it). The two rows' own expressions, in their
    order: the same numbers as the unfused rows."""
    he = head.nb.format(**{n: "h" + n for n in _inputs(head) + _consts_of(head)})
    te = tail.nb.format(**{n: "hv" if n == p else "t" + n
                           for n in _inputs(tail) + _consts_of(tail)})
    pre = ["ok1 = ok + u"]
    pre += [f"h{n} = rows[k, {ROW_COLS[n]}]" for n in _consts_of(head) if _uses(he, "h" + n)]
    pre += [f"t{n} = rows[k + 1, {ROW_COLS[n]}]" for n in _consts_of(tail)
            if _uses(te, "t" + n)]
    hins = [n for n in _inputs(head) if _uses(he, "h" + n)]
    tins = [n for n in _inputs(tail) if n != p and _uses(te, "t" + n)]
    pre += [f"oh{n} = np.uint64(int(rows[k, {ROW_COLS[n]}])) * u" for n in hins]
    pre += [f"ot{n} = np.uint64(int(rows[k + 1, {ROW_COLS[n]}])) * u" for n in tins]
    inner = [f"h{n} = Vw[oh{n} + j]" for n in hins] + [f"hv = {he}", "Vw[ok + j] = hv"]
    inner += [f"t{n} = Vw[ot{n} + j]" for n in tins] + [f"Vw[ok1 + j] = {te}"]
    return _square(tail, _loops(pre, inner, [he, te]))


def _pair_reverse(head, tail, p):
    """A superinstruction's reverse branch in ``run_block`` (at the tail's row ``k``, the
    head's ``k - 1``): the tail's rule, the head's adjoint completed in a register (every
    later row has added to it) and stored, then the head's rule: the adjoints the unfused
    rows add, in their order."""
    pre, inner = ["ok0 = ok - u"], ["g = Aw[ok + j]"]
    for rule, row, x, g in ((tail, "k", "t", "g"), (head, "k - 1", "h", "gh")):
        exprs = rule_exprs(rule)
        names = {n: x + n for n in rule_inputs(rule) + ("out", "c0", "c1")}
        names["g"] = g
        if rule is tail:
            names[p] = "hv"
        used = {n for n in rule_inputs(rule) + ("out",) if any(_uses(e, n) for e in exprs.values())}
        ins = [n for n in rule_inputs(rule) if (n != p or rule is head)
               and (n in exprs or n in used)]
        pre += [f"o{x}{n} = np.uint64(int(rows[{row}, {ROW_COLS[n]}])) * u" for n in ins]
        pre += [f"{x}{n} = rows[{row}, {ROW_COLS[n]}]" for n in ("c0", "c1")
                if any(_uses(e, n) for e in exprs.values())]
        if rule is tail and p in used:
            inner.append("hv = Vw[ok0 + j]")
        inner += [f"{x}{n} = Vw[o{x}{n} + j]" for n in ins if n in used]
        if "out" in used:
            inner.append(f"{x}out = Vw[{'ok' if rule is tail else 'ok0'} + j]")
        for n, e in exprs.items():
            if rule is tail and n == p:
                continue
            inner.append(f"Aw[o{x}{n} + j] += {_renamed(e, names)}")
        if rule is tail:
            e = exprs.get(p)
            inner += ["gh = Aw[ok0 + j]" + ("" if e is None else f" + {_renamed(e, names)}"),
                      "Aw[ok0 + j] = gh"]
    pre, inner = _sliced(pre, inner)
    return _square(tail, _loops(pre, inner, [x for x in inner if "==" in x]))


_FLAT = re.compile(r"\b([AV])w\[(\w+) \+ j\]")


def _sliced(pre, inner):
    """``pre`` and ``inner`` with the rows ``inner`` reads and writes at flat offsets
    (``Aw[oa + j]``) read through slices (``Aoa = Aw[oa:oa + u]``, then ``Aoa[j]``)."""
    views = []
    for x in inner:
        for m in _FLAT.finditer(x):
            if m.groups() not in views:
                views.append(m.groups())
    pre = pre + [f"{b}{o} = {b}w[{o}:{o} + u]" for b, o in views]
    return pre, [_FLAT.sub(r"\1\2[j]", x) for x in inner]


def _square(tail, lines):
    """A pair's branch whose tail is powc as its square only (``fuse.batch_rows`` pairs no
    other exponent; the others run as traced): the loop ``_loops`` specialized to
    ``tc0 == 2.0``, without the test and the general loop (each pair's loop with
    ``a ** c0`` cost about 0.25 s of the first batched call's compile)."""
    if tail.name != "powc":
        return lines
    assert lines[-1].startswith("    ") and "else:" in lines, lines
    at = next(i for i, x in enumerate(lines) if x in ("if tc0 == 2.0:", "elif tc0 == 2.0:"))
    end = next(i for i, x in enumerate(lines) if i > at and not x.startswith(" "))
    first = next(i for i, x in enumerate(lines) if x.startswith("if tc0 == "))
    return lines[:first] + [x[4:] for x in lines[at + 1:end]]


def _pairs(forward):
    """The ``elif`` branches of ``fuse.PAIRS`` in ``run_block``'s forward (at each head's
    opcode; a tail's falls through every branch) or reverse (at each tail's)."""
    from ..ops import BY_NAME
    from .fuse import BASE, BATCH_PAIRS, PAIRS
    src = []
    for i, (h, tl, p) in enumerate(PAIRS):
        if (h, tl, p) not in BATCH_PAIRS:
            continue
        head, tail = BY_NAME[h], BY_NAME[tl]
        body = (_pair_forward if forward else _pair_reverse)(head, tail, _inputs(tail)[p])
        src.append(" " * 8 + f"elif op == {BASE + 2 * i + (0 if forward else 1)}:  "
                   f"# {h} then {tl}\n")
        src += [" " * 12 + f"{x}\n" for x in body]
    return src


#: the branches of the chain in this order first (then by opcode): the common ops of traced
#: programs, so a row takes fewer tests
COMMON_FIRST = ("mul", "powc", "mulc", "square", "div", "neg", "divc")


def _common_first(op):
    return (COMMON_FIRST.index(op.name) if op.name in COMMON_FIRST else len(COMMON_FIRST),
            op.code)


def _block_source(looped, suffix, shared, which):
    codes = _signed(looped)
    fwd = [op for op in looped if op.name not in SIGNED or op.name == "neg"]
    rev = [op for op in looped if op.name not in SIGNED]
    fwd.sort(key=_common_first)
    rev.sort(key=_common_first)
    return ([BLOCK_HEADER.replace("{suffix}", suffix).replace("{which}", which),
             SIGNED_FORWARD.format(**codes)]
            + chain(fwd, _flat_forward, first=False)
            # superinstructions (``fuse.batch_rows``) in the form of common ops only: the
            # rows of a rare op run as traced, and that form compiles as before
            + ([] if shared else _pairs(True))
            + [BLOCK_LEAVES, SHARED_FORWARD if shared else "", BLOCK_MIDDLE,
               SIGNED_REVERSE.format(**codes)]
            + chain(rev, _flat_reverse, first=False)
            + ([] if shared else _pairs(False))
            + [SHARED_REVERSE if shared else "", BLOCK_END])


def size():
    """The opcode tables' size: every registry opcode indexes them."""
    return max(op.code for op in OPS) + 1


def _by_code(size):
    by = {op.code: op for op in OPS}
    return [by.get(i) for i in range(size)]


def _grad_bits(shared, size):
    bits = [0] * size
    for op in shared:
        exprs = rule_exprs(op)
        bits[op.code] = sum(1 << i for i, n in enumerate(("a", "b", "c")) if n in exprs)
    return bits


def switch_source(ops, value, grads):
    """Two compiled functions over opcode ``op``, one branch per op of ``ops``: ``value``
    (name, docstring) of ``(op, a, b, c, c0, c1)``, the op's forward expression, and
    ``grads`` (name, docstring) of ``(op, a, b, c, out, g, c0, c1)``, its rule's gradients
    to ``a, b, c`` (0.0 for an input the rule gives none). The batch's shared loop and the
    array interpreter's shared loop call them, so both give the one-sample code's numbers."""
    src = [f'''

@njit_cached(error_model="numpy", nogil=True)
def {value[0]}(op, a, b, c, c0, c1):
    """{value[1]}"""
''']
    first = True
    for op in ops:
        src.append(f"    {'if' if first else 'elif'} op == {op.code}:  # {op.name}\n")
        src.append(f"        return float({_forward_expr(op)})\n")
        first = False
    src.append("    return 0.0\n")
    src.append(f'''

@njit_cached(error_model="numpy", nogil=True)
def {grads[0]}(op, a, b, c, out, g, c0, c1):
    """{grads[1]}"""
''')
    first = True
    for op in ops:
        exprs = rule_exprs(op)
        if not exprs:
            continue
        gr = ", ".join(f"float({exprs[n]})" if n in exprs else "0.0" for n in ("a", "b", "c"))
        src.append(f"    {'if' if first else 'elif'} op == {op.code}:  # {op.name}\n")
        src.append(f"        return {gr}\n")
        first = False
    src.append("    return 0.0, 0.0, 0.0\n")
    return src


def _shared_source(shared):
    """``forward_value`` and ``reverse_value``: one sample's value and gradients of an op
    whose batch branch is the shared loop, the one-sample code (``forward``,
    ``reverse``) as expressions, so batches give the same numbers as single calls."""
    return switch_source(
        shared,
        ("forward_value", "The value of a row of opcode ``op`` (one of ``SHARED``) with "
                          "operands ``a, b, c``."),
        ("reverse_value", "The gradients to ``a, b, c`` of a row of opcode ``op`` (one of "
                          "``SHARED``) given its\n    adjoint ``g``; those not in "
                          "``GRADS[op]`` are 0.0 and unused."))


def _split(ops):
    return ([op for op in ops if op.name in BATCH_LOOPED],
            [op for op in ops if op.name not in BATCH_LOOPED])


def tables(ops):
    """The generated module's ``SHARED`` and ``GRADS``, indexed by opcode."""
    shared = _split(ops)[1]
    n = size()
    return ("\n#: by opcode: whether its batch branch is the shared loop (``forward_value``,\n"
            "#: ``reverse_value``), and the inputs its rule gives gradients to (bits a, b, c)\n"
            f"SHARED = np.array({[int(op in shared) for op in _by_code(n)]}, "
            "dtype=np.bool_)\n"
            f"GRADS = np.array({_grad_bits(shared, n)}, dtype=np.int64)\n")


def block_source(ops, forms):
    """``run_block`` in each of ``forms`` ((suffix, with the shared loop, docstring
    addition): ``_codegen_replay.FORMS``), ``forward_value`` and ``reverse_value`` of the
    replay ops ``ops``."""
    looped, shared = _split(ops)
    src = [BLOCK_IMPORT]
    for suffix, with_shared, which in forms:
        src += _block_source(looped, suffix, with_shared, which)
    return src + _shared_source(shared)
