"""Superinstructions of the one-sample interpreters: two dependent rows run as one branch."""
from __future__ import annotations

import numpy as np

#: (head, tail, operand): row k's op ``head`` and row k + 1's op ``tail`` whose operand
#: ``operand`` (0: a, 1: b) is row k, run as one branch of ``replay_cpu.run_fused``'s forward
#: (at the head's row) and reverse (at the tail's row): one dispatch for two rows, the head's
#: value and adjoint kept in registers. Squared residuals and sums of products: the pairs of
#: the Rosenbrock function's terms (issue 17's benchmark: at n=100, 892 rows run as 596
#: branches, and value_and_grad's compiled entry takes 2.85 us instead of 3.4, CPU time with
#: a warm cache) and of dot products. Each pair costs 0.15 to 0.2 s of run_fused's first
#: compile (CPU time, 2 shared cores; 0.77 s for 5 pairs): 14 pairs that also covered the
#: pendulum's Euler steps (div+neg, sin+mul, mul+sub, ...: its entry 708 -> 519 us) made a
#: cold trace and first gradient 1.9 s slower. A tail that is ``add`` with the head as ``a``
#: swaps its operands (exactly commutative in IEEE arithmetic; the adjoints go to different
#: slots)
PAIRS = (("sub", "powc", 0), ("rsubc", "powc", 0), ("mulc", "add", 1), ("mul", "add", 1))
COMMUTATIVE = ("add", "mul")

#: the fused rows' opcodes: pair i's head ``BASE + 2 i``, its tail ``BASE + 2 i + 1`` (above
#: every registry opcode; only the one-sample ``forward`` and ``reverse`` know them)
BASE = 1000

#: the opcode of the first row of a run of leaves (``LEAF_RUN_MIN`` rows or more in a row,
#: reading consecutive input elements), its count in column 5: ``run_fused``'s forward copies
#: the run in one branch, and its reverse stops above a run that starts the program (leaves
#: have no rule: their rows only cost a dispatch each, 100 of n=100 Rosenbrock's 596
#: branches forward). The other rows of the run stay leaves. Above the pairs' opcodes
LEAF_RUN = BASE + 2 * len(PAIRS)
LEAF_RUN_MIN = 2

#: three dependent rows run as one branch of ``run_fused`` (forward at the first row, reverse
#: at the last): each ((op, fixed constants ((name, value), ...), the operand (0: a, 1: b)
#: that is the row before, None for the first row), ...); a row whose op is commutative
#: and reads the row before as its other operand has its operands swapped. No row of a
#: chain reads another row of it but the one before. A fixed constant is written into the
#: branch's code (a square's exponent: powc's other exponents' branches drop out, so each
#: chain is about the code of a pair). Squared residuals: ``(x - y ** 2) ** 2`` and
#: ``s + (c - x) ** 2`` (each term of n=100 Rosenbrock: 5 branches as pairs, 3 as chains;
#: value_and_grad's compiled entry 2.06 instead of 2.36 us, CPU time; an entry with these
#: branches ran pairs' rows as fast as one without them)
SQUARE = (("c0", 2.0),)
CHAINS = ((("powc", SQUARE, None), ("sub", (), 1), ("powc", SQUARE, 0)),
          (("rsubc", (), None), ("powc", SQUARE, 0), ("add", (), 1)))
#: the chains' opcodes: chain i's rows ``CHAIN_BASE + 3 i``, ``+ 1`` and ``+ 2`` (only the
#: one-sample ``run_fused`` knows them: ``batch_rows`` forms pairs only)
CHAIN_BASE = LEAF_RUN + 1

#: False: the one-sample entry runs the rows as traced (tests force both forms)
ENABLED = True

#: the share of rows in pairs below which a program runs its rows as traced: the entry of
#: fused rows (``run_fused``, ``while`` loops) runs rows as traced 15% slower than
#: ``replay_cpu.run_into`` (n=100 Rosenbrock, CPU time: 4.05 against 3.5 us), and its pairs
#: (66% of the rows) bring it to 2.85 us: it pays from about 30%
MIN_PAIRED = 0.3

#: one-sample calls a program runs its rows as traced (``replay_cpu.run_into``, compiled for
#: any program) before it forms its pairs and switches to ``run_fused`` (``_Code.tier_up``):
#: ``run_fused``'s first compile costs 0.5 to 2.3 s of CPU with a cold Numba cache (once per
#: machine: cached on disk afterwards) and a few ms to load from a warm one, against 0.55 us
#: a call saved at n=100 (7 us at n=1000, 0.12 ms for the pendulum). A script or a test that
#: calls a program a handful of times never pays it (a cold trace and first gradient stays at
#: ``run_into``'s cost, issue 17 goal 5); an optimization loop passes 64 calls in its first
#: milliseconds (0.3 ms at n=100) and runs fused for the rest. 0: the first call fuses
TIER = 64


def _chains(rows, op):
    """The chains of ``CHAINS`` in ``rows`` (opcodes ``op``): the first row of each, its
    chain's index and whether its rows swap their operands (chains x rows); of overlapping
    ones, each from the first row not in one already. Arrays, built over all rows at once
    (a chain at a time, n=1000 Rosenbrock's 1,998 chains took 17 ms)."""
    from ..ops import BY_NAME
    n = rows.shape[0]
    size = max((len(spec) for spec in CHAINS), default=0)
    starts, which, swaps = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)], \
        [np.zeros((0, size), dtype=bool)]
    for i, spec in enumerate(CHAINS):
        m = n - len(spec) + 1
        if m <= 0:
            continue
        start = np.arange(m)
        hit = np.ones(m, dtype=bool)
        swap = np.zeros((m, size), dtype=bool)
        for j, (name, fixed, link) in enumerate(spec):
            r = rows[j:j + m]
            hit &= op[j:j + m] == BY_NAME[name].code
            for c, value in fixed:
                hit &= r[:, 4 if c == "c0" else 5] == value
            a, b, c = (r[:, col].astype(np.int64) for col in (1, 2, 3))
            for earlier in range(j - 1):  # no other row of the chain
                hit &= (a != start + earlier) & (b != start + earlier) & (c != start + earlier)
            if link is None:
                continue
            before = start + j - 1
            mine, other = (b, a) if link else (a, b)
            once = (mine == before) & (other != before) & (c != before)
            if name in COMMUTATIVE:
                swap[:, j] = (other == before) & (mine != before) & (c != before)
                once |= swap[:, j]
            hit &= once
        at = np.nonzero(hit)[0]
        starts.append(at)
        which.append(np.full(at.shape[0], i, dtype=np.int64))
        swaps.append(swap[at])
    K, I, SW = np.concatenate(starts), np.concatenate(which), np.concatenate(swaps)
    order = np.argsort(K, kind="stable")  # (at one row, the first chain of CHAINS)
    K, I, SW = K[order], I[order], SW[order]
    sizes = [len(spec) for spec in CHAINS]
    chosen, free = [], 0
    for r, (k, i) in enumerate(zip(K.tolist(), I.tolist())):
        if k >= free:
            chosen.append(r)
            free = k + sizes[i]
    return K[chosen], I[chosen], SW[chosen]


def fuse(rows, chains=True, outs=None):
    """A copy of a traced program's scalar ``rows`` with the chains of ``CHAINS`` (unless
    ``chains`` is False) and the pairs of ``PAIRS`` marked as superinstructions, and the
    runs of leaves (``LEAF_RUN``) (the rows themselves when fusion is off, or too few rows
    pair up: ``MIN_PAIRED``; ``run_fused`` runs the copy, ``replay_cpu.run_into`` the
    rows). Rows stay where they are, values and adjoints too: only opcodes change (and the
    operands of a commutative tail); of overlapping pairs (a row that would be a tail and a
    head), every other one from the first, among the rows of no chain. No superinstruction
    starts at an output's row (``outs``: the output slots) or has one inside: the reverse
    sweep starts at the last output, and would have to start at a row it runs only as part
    of the superinstruction (a pruned program has no row after its last output; a
    Hessian-vector program may)."""
    from ..ops import BY_NAME
    n = rows.shape[0]
    if not ENABLED or n < 2:
        return rows
    op = rows[:, 0].astype(np.int64)
    is_out = np.zeros(n, dtype=bool)
    if outs is not None:
        is_out[np.asarray(outs, dtype=np.int64)] = True
    K, I, SW = _chains(rows if chains else rows[:0], op)
    L = np.array([len(spec) for spec in CHAINS], dtype=np.int64)[I]
    # (no output among a chain's rows but its last)
    outs_before = np.concatenate(([0], np.cumsum(is_out)))
    keep = outs_before[K + L - 1] == outs_before[K]
    K, I, L, SW = K[keep], I[keep], L[keep], SW[keep]
    in_chain = np.zeros(n, dtype=bool)
    for j in range(SW.shape[1]):
        in_chain[K[L > j] + j] = True
    ta, tb = rows[1:, 1].astype(np.int64), rows[1:, 2].astype(np.int64)
    k = np.arange(n - 1)
    on_a, on_b = (ta == k) & (tb != k), (tb == k) & (ta != k)  # the tail reads row k once
    which = np.full(n - 1, -1)
    # (no pair: rows of a chain, a head that is an output)
    which[in_chain[:-1] | in_chain[1:] | is_out[:-1]] = len(PAIRS)
    swap = np.zeros(n - 1, dtype=bool)
    for i, (head, tail, operand) in enumerate(PAIRS):
        pair = (op[:-1] == BY_NAME[head].code) & (op[1:] == BY_NAME[tail].code) & (which < 0)
        hit = pair & (on_b if operand else on_a)
        if operand and tail in COMMUTATIVE:
            swap |= pair & on_a
            hit |= pair & on_a
        which[hit] = i
    cand = (which >= 0) & (which < len(PAIRS))
    if not cand.any() and not K.shape[0]:
        return rows
    # runs of overlapping candidates: the 1st, 3rd, ... of each
    start = cand & ~np.concatenate(([False], cand[:-1]))
    first = np.maximum.accumulate(np.where(start, k, 0))
    chosen = cand & ((k - first) % 2 == 0)
    heads = k[chosen]
    if 2 * heads.shape[0] + in_chain.sum() < MIN_PAIRED * n:
        return rows
    out = rows.copy()
    for j in range(SW.shape[1]):
        at = L > j
        out[K[at] + j, 0] = CHAIN_BASE + 3 * I[at] + j
        s = K[SW[:, j]] + j
        out[s, 1], out[s, 2] = rows[s, 2], rows[s, 1]
    out[heads, 0] = BASE + 2 * which[chosen]
    out[heads + 1, 0] = BASE + 2 * which[chosen] + 1
    s = heads[swap[chosen]] + 1
    out[s, 1], out[s, 2] = rows[s, 2], rows[s, 1]
    _leaf_runs(out, op == BY_NAME["leaf"].code)
    return out


def _leaf_runs(out, leaf):
    """Mark the runs of leaves in ``out`` (``leaf``: which rows are leaves) that read
    consecutive input elements: the first row of each becomes ``LEAF_RUN`` with the run's
    count in column 5."""
    n = out.shape[0]
    # a leaf continues the run of the row before when that is a leaf of the element before
    cont = np.zeros(n, dtype=bool)
    cont[1:] = leaf[1:] & leaf[:-1] & (out[1:, 4] == out[:-1, 4] + 1.0)
    starts = np.nonzero(leaf & ~cont)[0]
    if starts.shape[0] == 0:
        return
    # each run ends before the next row that does not continue it
    ends = np.nonzero(~cont)[0]
    stops = np.append(ends, n)[np.searchsorted(ends, starts, side="right")]
    counts = stops - starts
    keep = counts >= LEAF_RUN_MIN
    out[starts[keep], 0] = LEAF_RUN
    out[starts[keep], 5] = counts[keep]


#: the pairs of ``PAIRS`` a batch runs as superinstructions (the others' rows as traced):
#: each costs about 0.25 s of the first batched call's compile (2 shared cores, CPU time),
#: so the batch keeps the pairs of squared residuals and sums of scaled terms
BATCH_PAIRS = (("sub", "powc", 0), ("rsubc", "powc", 0), ("mulc", "add", 1))

#: False: batches run their rows as traced (``ENABLED`` False turns both off; tests force
#: each form)
BATCH = True


def batch_rows(rows, outs=None):
    """The rows a batch's ``run_block`` (its form of common ops) runs: ``fuse``'s pairs (none
    at or across an output's row, ``outs``: as single calls), each
    one loop over the block's samples (the head's value and adjoint in a register: n=1000
    Rosenbrock, 5,992 of its 8,992 rows in pairs, 1.29 to 1.39 ns a row and sample in
    blocks of 32 against 1.53 to 1.62 as traced; n=100 in blocks of 128 0.86 to 0.88
    against 0.95 to 0.99, CPU time taking turns in one process), and leaves as traced (a
    block's leaf is a loop over samples already)."""
    if not BATCH:
        return rows
    # (the chains too, tried: 3 to 10% faster at n=100, within the noise at n=1000, for a
    # second more of the first batch's cold compile: docs/fast-loops.md)
    out = fuse(rows, chains=False, outs=outs)
    if out is rows:
        return rows
    runs = out[:, 0] == LEAF_RUN  # (a batch's leaf rows are loops over samples already)
    out[runs] = rows[runs]
    # pairs not in BATCH_PAIRS, and a powc tail other than a square
    # (``_codegen_batch._square``): both rows as traced (a swapped tail's operands too)
    for i, pair in enumerate(PAIRS):
        t = out[:, 0] == BASE + 2 * i + 1
        if pair[1] == "powc" and pair in BATCH_PAIRS:
            t &= rows[:, 4] != 2.0
        elif pair in BATCH_PAIRS:
            continue
        t = np.nonzero(t)[0]
        out[t], out[t - 1, 0] = rows[t], rows[t - 1, 0]
    return out
