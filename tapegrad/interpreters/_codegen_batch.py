"""Generates the batched replay's ``run_block`` and the shared loop of the rarer ops into
``_generated_replay.py``, with ``_codegen_emit``'s emitter."""
from __future__ import annotations

from ..ops import OPS
from ._codegen_emit import REPLAY_BATCH, _forward_expr, dispatch, rule_exprs

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

SIGNED_FORWARD = '''        elif op in ({add}, {sub}):  # add, sub: a + s * b with s = +-1.0
            s = 1.0 if op == {add} else -1.0
            va = V[int(rows[k, 1])]
            vb = V[int(rows[k, 2])]
            for j in range(nb):
                vk[j] = va[j] + s * vb[j]
        elif op in ({addc}, {rsubc}):  # addc, rsubc: s * a + c0 with s = +-1.0
            s = 1.0 if op == {addc} else -1.0
            c0 = rows[k, 4]
            va = V[int(rows[k, 1])]
            for j in range(nb):
                vk[j] = s * va[j] + c0
'''
SIGNED_REVERSE = '''        elif op in ({add}, {sub}):  # add, sub: g to a, s * g to b
            s = 1.0 if op == {add} else -1.0
            aa = A[int(rows[k, 1])]
            ab = A[int(rows[k, 2])]
            gk = A[k]
            for j in range(nb):
                g = gk[j]
                aa[j] += g
                ab[j] += s * g
        elif op in ({neg}, {addc}, {rsubc}):  # neg, addc, rsubc: s * g to a
            s = 1.0 if op == {addc} else -1.0
            aa = A[int(rows[k, 1])]
            gk = A[k]
            for j in range(nb):
                aa[j] += s * gk[j]
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
            va = V[ia if ia >= 0 else k]
            vb = V[ib if ib >= 0 else k]
            vc = V[ic if ic >= 0 else k]
            c0 = rows[k, 4]
            c1 = rows[k, 5]
            for j in range(nb):
                vk[j] = forward_value(op, va[j], vb[j], vc[j], c0, c1)
'''
SHARED_REVERSE = '''        elif SHARED[op] and GRADS[op] != 0:
            m = GRADS[op]
            ia = int(rows[k, 1])
            ib = int(rows[k, 2])
            ic = int(rows[k, 3])
            ia = ia if ia >= 0 else k
            ib = ib if ib >= 0 else k
            ic = ic if ic >= 0 else k
            va = V[ia]
            vb = V[ib]
            vc = V[ic]
            vout = V[k]
            aa = A[ia]
            ab = A[ib]
            ac = A[ic]
            gk = A[k]
            c0 = rows[k, 4]
            c1 = rows[k, 5]
            for j in range(nb):
                ga, gb, gc = reverse_value(op, va[j], vb[j], vc[j], vout[j], gk[j], c0, c1)
                if m & 1:
                    aa[j] += ga
                if m & 2:
                    ab[j] += gb
                if m & 4:
                    ac[j] += gc
'''


# a block of samples, both sweeps in one compiled function: a compiled caller of separately
# compiled sweeps links their code into its own and optimizes it all again (3.7 s more of a
# cold compile), and Python around them cost 20 us a block (1.4 ms -> 1.6 ms for 256 inputs
# of an 892-row program in blocks of 32)
BLOCK_HEADER = '''

@njit_cached(error_model="numpy", nogil=True)
def run_block(rows, X, out_slots, S, in_slots, grad, status, outs, G, b0, b1, Vw, Aw):
    """``forward`` and, with ``grad``, ``reverse`` for samples ``b0:b1`` (rows of ``X``:
    ``X[j, i]`` input ``i`` of sample ``j``; of ``S``, the seeds at the outputs), written
    into ``status`` (1 + the row of the sample's first failed guard), ``outs`` and ``G``
    (a row a sample too). The block's values and adjoints (``V[k, j]``, ``A[k, j]``: rows x
    samples) live in ``Vw`` and ``Aw``, flat buffers of at least rows x samples reused from
    block to block."""
    n = rows.shape[0]
    nb = b1 - b0
    V = Vw[:n * nb].reshape((n, nb))
    st = status[b0:b1]
    for k in range(n):
        op = int(rows[k, 0])
        vk = V[k]
        if op == LEAF:
            i = int(rows[k, 4])
            for j in range(nb):
                vk[j] = X[b0 + j, i]
        elif op == CONST:
            c0 = rows[k, 4]
            for j in range(nb):
                vk[j] = c0
        elif op == GUARD:
            va = V[int(rows[k, 1])]
            e = rows[k, 4] != 0.0
            for j in range(nb):
                t = va[j]
                vk[j] = t
                if (t != 0.0) != e and st[j] == 0:
                    st[j] = k + 1
'''

BLOCK_MIDDLE = '''    for i in range(out_slots.shape[0]):
        vo = V[out_slots[i]]
        for j in range(nb):
            outs[b0 + j, i] = vo[j]
    if not grad:
        return
    A = Aw[:n * nb].reshape((n, nb))
    A[:] = 0.0
    for i in range(out_slots.shape[0]):
        ao = A[out_slots[i]]
        for j in range(nb):
            ao[j] += S[b0 + j, i]
    for k in range(n - 1, -1, -1):
        op = int(rows[k, 0])
'''

BLOCK_END = '''    for i in range(in_slots.shape[0]):
        ai = A[in_slots[i]]
        for j in range(nb):
            G[b0 + j, i] = ai[j]
'''


def _block_source(looped):
    codes = _signed(looped)
    fwd = [op for op in looped if op.name not in SIGNED or op.name == "neg"]
    rev = [op for op in looped if op.name not in SIGNED]
    return ([BLOCK_HEADER] + dispatch(fwd, REPLAY_BATCH, forward=True, first=False)
            + [SIGNED_FORWARD.format(**codes), SHARED_FORWARD, BLOCK_MIDDLE]
            + dispatch(rev, REPLAY_BATCH) + [SIGNED_REVERSE.format(**codes), SHARED_REVERSE,
                                             BLOCK_END])


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
    size = max(op.code for op in OPS) + 1
    return ("\n#: by opcode: whether its batch branch is the shared loop (``forward_value``,\n"
            "#: ``reverse_value``), and the inputs its rule gives gradients to (bits a, b, c)\n"
            f"SHARED = np.array({[int(op in shared) for op in _by_code(size)]}, "
            "dtype=np.bool_)\n"
            f"GRADS = np.array({_grad_bits(shared, size)}, dtype=np.int64)\n")


def block_source(ops):
    """``run_block``, ``forward_value`` and ``reverse_value`` of the replay ops ``ops``."""
    looped, shared = _split(ops)
    return _block_source(looped) + _shared_source(shared)
