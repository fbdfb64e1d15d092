"""Issue 17's replay rows: traced programs against CasADi's SX virtual machine called through
``Function.buffer()``, batches against single calls, ``target="parallel"`` against the serial
batch, the Python cost of a call, and forward-only calls against ``value_and_grad``.

Each case is a :class:`~tapegrad.bench.cases.SpeedCase` (so ``--only``, ``--list`` and the
pytest-benchmark suite see it); :func:`finish` adds what the row format has no column for
(ns per program row forward and reverse, rows of the Hessian-vector program, times per input)
as a note, and the pass rule of the rows whose target is not a speedup.
"""
from __future__ import annotations

import time

import numpy as np

from .cases import (
    PENDULUM_PARAMS, PENDULUM_STEPS, SpeedCase, _hvp_v, _rosenbrock_x0, load_library,
    pendulum_euler, pendulum_grad_reference, rosenbrock_grad_reference,
    rosenbrock_hessian_reference, rosenbrock_scalar)

BATCH = 256
SMALL_BATCH = 8
OVERHEAD_TARGET_S = 2e-6

#: what ``make("tapegrad")`` built, for ``finish`` (case name -> dict)
_BUILT: dict[str, dict] = {}


class _Last:
    """The last result of an iteration, read like a tensor by ``check_result``: timed calls
    store one attribute instead of wrapping their result."""

    a = None

    def detach(self):
        return self

    def numpy(self):
        return np.asarray(self.a, dtype=np.float64).reshape(-1)


def _rosenbrock_fn(n):
    return lambda x: rosenbrock_scalar([x[i] for i in range(n)])


def _pendulum_fn(tg):
    return lambda p: pendulum_euler(tg, p[0], p[1], p[2], p[3], steps=PENDULUM_STEPS)


def _trace(name, fn, x):
    tg = load_library("tapegrad")
    prog = tg.trace(fn, x)
    # the rows time a loop's steady state: superinstructions now, not after fuse.TIER calls
    prog._code.tier_up()
    _BUILT[name] = {"prog": prog, "x": x}
    return prog


# --- value_and_grad against CasADi's VM -------------------------------------------------------


def _casadi_buffer(outputs_of, n, *args):
    """CasADi SX Function of one symbol of ``n`` per array of ``args`` returning
    ``outputs_of(ca, *syms)``, called through ``Function.buffer()``: the arguments (bound to
    ``args``) and results are bound once to NumPy arrays, so a call is CasADi's VM and
    nothing else."""
    ca = load_library("casadi")
    syms = [ca.SX.sym(f"a{i}", n) for i in range(len(args))]
    outs = outputs_of(ca, *syms)
    F = ca.Function("F", syms, outs)
    buf, call = F.buffer()
    keep = [np.ascontiguousarray(a, dtype=np.float64) for a in args]
    for i, a in enumerate(keep):
        buf.set_arg(i, memoryview(a))
    res = [np.zeros(o.numel()) for o in outs]
    for i, r in enumerate(res):
        buf.set_res(i, memoryview(r))
    return F, buf, call, keep, res


def _make_vs_casadi(name, n, fn_of, x0, buffer=False):
    """tapegrad: ``program.value_and_grad(x)`` on an ndarray, or with ``buffer`` the call
    ``program.buffer(x, out=f, grad=g)`` bound once, as CasADi's is; casadi: the (value,
    gradient) SX Function of the same scalar ops through its buffer."""
    def make(library):
        last = _Last()
        checked = (last,)
        if library == "tapegrad":
            x = np.array(x0, dtype=np.float64)
            prog = _trace(name, fn_of(load_library("tapegrad")), x)
            if buffer:
                f, g = np.empty(()), np.empty(x.shape)
                call = prog.buffer(x, out=f, grad=g)
                last.a = g  # the bound array is the result

                def iteration():
                    call()
                    return checked
                return iteration
            vg = prog.value_and_grad

            def iteration():
                last.a = vg(x)[1]
                return checked
            return iteration

        def outputs(ca, x):
            f = fn_of(ca)(x)
            return [f, ca.gradient(f, x)]
        F, buf, call, keep, res = _casadi_buffer(outputs, n, x0)
        _BUILT[name + ":casadi"] = {"instructions": F.n_instructions(), "buf": buf, "keep": keep,
                                    "call": call}
        last.a = res[1]  # the buffer is the result

        def iteration():
            call()
            return checked
        return iteration
    return make


def _make_hvp_vs_jtimes(name, n):
    """tapegrad: ``program.hvp(x, v)``; casadi: ``jtimes(gradient(f, x), x, v)``."""
    x0, v0 = _rosenbrock_x0(n), _hvp_v(n)

    def make(library):
        last = _Last()
        checked = (last,)
        if library == "tapegrad":
            x, v = x0.copy(), v0.copy()
            prog = _trace(name, _rosenbrock_fn(n), x)
            hvp = prog.hvp

            def iteration():
                last.a = hvp(x, v)[1]
                return checked
            return iteration

        def outputs(ca, x, v):
            f = rosenbrock_scalar([x[i] for i in range(n)])
            return [ca.jtimes(ca.gradient(f, x), x, v)]
        F, buf, call, keep, res = _casadi_buffer(outputs, n, x0, v0)
        _BUILT[name + ":casadi"] = {"instructions": F.n_instructions(), "buf": buf, "keep": keep}
        last.a = res[0]

        def iteration():
            call()
            return checked
        return iteration
    return make


# --- batches ----------------------------------------------------------------------------------


def _batch_x(n, batch):
    return np.random.default_rng(n + batch).uniform(-1.5, 1.5, (batch, n))


def _batch_reference(n, batch):
    return lambda: np.concatenate([rosenbrock_grad_reference(x) for x in _batch_x(n, batch)])


def _make_batch_vs_single(name, n, batch):
    """tapegrad: one batched ``value_and_grad`` over ``batch`` inputs; peer: ``batch``
    single calls of the same program."""
    def make(library):
        last = _Last()
        checked = (last,)
        X = _batch_x(n, batch)
        prog = _trace(name, _rosenbrock_fn(n), X[0].copy())
        vg = prog.value_and_grad
        if library == "tapegrad":
            def iteration():
                last.a = vg(X)[1]
                return checked
            return iteration
        rows = list(X)
        G = np.empty_like(X)

        def iteration():
            for i, x in enumerate(rows):
                G[i] = vg(x)[1]
            last.a = G
            return checked
        return iteration
    return make


def _make_parallel_vs_serial(name, n, batch):
    """tapegrad: the batch on ``target="parallel"``; peer: the same batch on the serial
    (``"cpu"``) target."""
    def make(library):
        last = _Last()
        checked = (last,)
        X = _batch_x(n, batch)
        prog = _trace(name, _rosenbrock_fn(n), X[0].copy())
        vg = (prog.to("parallel") if library == "tapegrad" else prog).value_and_grad
        if batch < BATCH:
            def iteration():
                last.a = vg(X)[1]
                return checked
            return iteration
        # the process's CPU time a call (both threads: a spinning worker shows here; not
        # the first 3 calls, the compiling one and the warm-ups) and what the threads did
        # (counts: ``_threads.stats``), for the note
        from tapegrad import _threads
        cpu = _BUILT.setdefault(name + ":cpu", {})
        cpu[library] = [0.0, -3]
        if library == "tapegrad":
            _BUILT[name + ":stats"] = _threads.stats()
        clock, spent = time.process_time, cpu[library]

        def iteration():
            t0 = clock()
            last.a = vg(X)[1]
            if spent[1] >= 0:
                spent[0] += clock() - t0
            spent[1] += 1
            return checked
        return iteration
    return make


def _parallel_note(name):
    """What the threads did over a parallel row (``_threads.stats``, after minus before)
    and the CPU time a call, both sides."""
    from tapegrad import _threads
    before, now = _BUILT.get(name + ":stats"), _threads.stats()
    if before is None:
        return None
    d = {k: now[k] - before[k] for k in now if isinstance(now[k], int) and k in before}
    cpu = _BUILT.get(name + ":cpu", {})
    line = (f"threads: {d['batches_threads']} batches on the threads ({d['batches_missed']} "
            f"with no worker chunk), {d['batches_paused']} paused, {d['batches_busy']} "
            f"busy; chunks caller {d['chunks_caller']}, workers {d['chunks_workers']}; "
            f"{d['pauses']} pauses; workers woken through their lock {d['woken']}, ahead of "
            f"a batch after a pause {d['roused']}, spins "
            f"ended {d['worker_spins_ended']}, sleeps {d['worker_sleeps']}; state before "
            f"the row: {before['workers']} workers ({before['workers_asleep']} asleep), "
            f"pause {before['pause']}, back-off {before['backoff']}")
    for lib, (t, calls) in cpu.items():
        if calls > 0:
            line += f"; CPU {_us(t / calls)}/call {'parallel' if lib == 'tapegrad' else 'serial'}"
    return line


# --- the cost of a call -----------------------------------------------------------------------


def _three_inputs(a, b, c):
    return (a * b).sum() + c.sin().sum()


def _three_x():
    rng = np.random.default_rng(3)
    return [rng.uniform(-1.0, 1.0, 2) for _ in range(3)]


def _three_reference():
    a, b, c = _three_x()
    return np.concatenate([b, a, np.cos(c)])


def _make_call_overhead(name):
    """tapegrad: ``program.value_and_grad(a, b, c)`` on three small arrays (a dozen rows);
    peer: the compiled entry it calls (``replay_cpu.run_into``'s compiled wrapper for the
    program's arrays, ``code.run``, called past Numba's dispatch as the call does), on inputs
    flattened beforehand into its buffer, with the results' buffer set once."""
    def make(library):
        tg = load_library("tapegrad")
        a, b, c = _three_x()
        prog = tg.trace(_three_inputs, a, b, c)
        prog._code.tier_up()  # the entry a loop's calls reach (``code.run`` below)
        _BUILT[name] = {"prog": prog}
        last = _Last()
        checked = (last,)
        if library == "tapegrad":
            vg = prog.value_and_grad

            def iteration():
                last.a = vg(a, b, c)[1]
                return checked
            return iteration
        code = prog._code
        work, flat, _ = code.buffers()
        flat[:] = np.concatenate([a, b, c])
        res = np.empty(code.res_size[True])
        args = (code.frows, work, res)
        run = code.run

        def iteration():
            run(*args)
            last.a = res[1:]
            return checked
        return iteration
    return make


def _make_forward_only(name, n):
    """tapegrad: ``program(x)``; peer: ``program.value_and_grad(x)`` (the value checked)."""
    def make(library):
        last = _Last()
        checked = (last,)
        x = _rosenbrock_x0(n)
        prog = _trace(name, _rosenbrock_fn(n), x)
        if library == "tapegrad":
            def iteration():
                last.a = prog(x)
                return checked
            return iteration
        vg = prog.value_and_grad

        def iteration():
            last.a = vg(x)[0]
            return checked
        return iteration
    return make


def _rosenbrock_value(n):
    x = _rosenbrock_x0(n)
    return lambda: np.array([np.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)])


def _cases():
    p = np.array(PENDULUM_PARAMS)
    return [
        SpeedCase(
            "replay_rosenbrock_scalar_n100_vs_casadi",
            "traced scalar Rosenbrock (n=100), value_and_grad vs CasADi's SX Function through "
            "Function.buffer() (buffers set once)",
            _make_vs_casadi("replay_rosenbrock_scalar_n100_vs_casadi", 100, _rosenbrock_fn_of(100),
                            _rosenbrock_x0(100)),
            lambda: rosenbrock_grad_reference(_rosenbrock_x0(100)),
            target_speedup=1.0, tags=("replay", "vm"), peer="casadi"),
        SpeedCase(
            "replay_rosenbrock_scalar_n1000_vs_casadi",
            "traced scalar Rosenbrock (n=1000), value_and_grad vs CasADi's SX Function through "
            "Function.buffer() (buffers set once)",
            _make_vs_casadi("replay_rosenbrock_scalar_n1000_vs_casadi", 1000,
                            _rosenbrock_fn_of(1000), _rosenbrock_x0(1000)),
            lambda: rosenbrock_grad_reference(_rosenbrock_x0(1000)),
            target_speedup=1.0, tags=("replay", "vm"), peer="casadi"),
        SpeedCase(
            "replay_pendulum_euler_10k_vs_casadi",
            "traced 10,000-step pendulum, value_and_grad vs CasADi's SX Function through "
            "Function.buffer() (buffers set once)",
            _make_vs_casadi("replay_pendulum_euler_10k_vs_casadi", 4, _pendulum_fn, p),
            lambda: pendulum_grad_reference(PENDULUM_PARAMS, PENDULUM_STEPS),
            target_speedup=1.0, rtol=1e-8, tags=("replay", "vm"), peer="casadi"),
        *[SpeedCase(
            f"replay_rosenbrock_scalar_n{n}_buffer_vs_casadi",
            f"traced scalar Rosenbrock (n={n}), program.buffer(x, out=f, grad=g) called with "
            f"no arguments vs CasADi's SX Function through Function.buffer() (both bound "
            f"once to arrays)",
            _make_vs_casadi(f"replay_rosenbrock_scalar_n{n}_buffer_vs_casadi", n,
                            _rosenbrock_fn_of(n), _rosenbrock_x0(n), buffer=True),
            lambda n=n: rosenbrock_grad_reference(_rosenbrock_x0(n)),
            target_speedup=1.0, tags=("replay", "vm"), peer="casadi") for n in (100, 1000)],
        SpeedCase(
            "replay_hvp_rosenbrock_scalar_n100_vs_casadi_jtimes",
            "traced scalar Rosenbrock (n=100), program.hvp vs CasADi jtimes through "
            "Function.buffer(); target: within 3x, and the Hessian-vector program at most 4x "
            "the gradient program's rows",
            _make_hvp_vs_jtimes("replay_hvp_rosenbrock_scalar_n100_vs_casadi_jtimes", 100),
            lambda: rosenbrock_hessian_reference(_rosenbrock_x0(100)) @ _hvp_v(100),
            target_speedup=1 / 3, tags=("replay", "vm"), peer="casadi"),
        *[SpeedCase(
            f"replay_batch{BATCH}_rosenbrock_scalar_n{n}_vs_single_calls",
            f"traced scalar Rosenbrock (n={n}), value_and_grad over a batch of {BATCH} inputs "
            f"vs {BATCH} single calls",
            _make_batch_vs_single(f"replay_batch{BATCH}_rosenbrock_scalar_n{n}_vs_single_calls",
                                  n, BATCH),
            _batch_reference(n, BATCH), target_speedup=3.0, tags=("replay", "vm"),
            peer="tapegrad-loop") for n in (100, 1000)],
        *[SpeedCase(
            f"replay_parallel_batch{b}_rosenbrock_scalar_n100_vs_serial",
            f"traced scalar Rosenbrock (n=100), value_and_grad over {b} inputs, "
            f"target='parallel' vs the serial batch"
            + ("" if b == BATCH else " (target: not slower, within 10% timing noise)"),
            _make_parallel_vs_serial(f"replay_parallel_batch{b}_rosenbrock_scalar_n100_vs_serial",
                                     100, b),
            _batch_reference(100, b), target_speedup=target, tags=("replay", "vm"),
            peer="tapegrad-loop") for b, target in ((BATCH, 1.7), (SMALL_BATCH, 0.9))],
        SpeedCase(
            "replay_call_overhead_3_inputs_vs_compiled_entry",
            "value_and_grad(a, b, c) of a 3-input program of a dozen rows vs the compiled "
            "entry it calls; target: the Python side costs at most 2 us",
            _make_call_overhead("replay_call_overhead_3_inputs_vs_compiled_entry"),
            _three_reference, target_speedup=0.0, tags=("replay", "vm"), peer="tapegrad-loop"),
        SpeedCase(
            "replay_forward_only_rosenbrock_scalar_n1000_vs_value_and_grad",
            "traced scalar Rosenbrock (n=1000), forward-only program(x) vs value_and_grad(x); "
            "target: at most half",
            _make_forward_only("replay_forward_only_rosenbrock_scalar_n1000_vs_value_and_grad",
                               1000),
            _rosenbrock_value(1000), target_speedup=2.0, tags=("replay", "vm"),
            peer="tapegrad-loop"),
    ]


def _rosenbrock_fn_of(n):
    return lambda lib: _rosenbrock_fn(n)


CASES: dict[str, SpeedCase] = {c.name: c for c in _cases()}


# --- what the row format has no column for ----------------------------------------------------


def _interleaved_s(fns, turns=5, turn_s=0.02, clock=time.perf_counter):
    """Median over ``turns`` of each function's mean call time, the functions taking turns
    (so that a busy moment of a shared machine slows them alike); ``clock=time.thread_time``
    counts this thread's CPU time only (time other jobs hold the core is left out)."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(turns):
        for i, fn in enumerate(fns):
            # the clock read between batches of calls that double: ``time.thread_time`` is
            # a system call (0.8 us here), which read after every call doubled a small one
            calls, batch, t0 = 0, 1, clock()
            while True:
                for _ in range(batch):
                    fn()
                calls += batch
                elapsed = clock() - t0
                if elapsed >= turn_s:
                    break
                batch *= 2
            times[i].append(elapsed / calls)
    return [float(np.median(t)) for t in times]


def _cpu_rows(prog, x, ca):
    """ns per row of the compiled entry alone, forward and reverse, and of CasADi's VM per
    instruction, by CPU time in turns (what docs/fast-loops.md's table reports)."""
    code = prog._code
    prog.value_and_grad(x)  # the entry compiled for the program's arrays
    buf = code.buffers()
    buf[1][:] = x
    fwd, both = np.empty(code.res_size[False]), np.empty(code.res_size[True])
    fns = [lambda: code.run(code.frows, buf[0], fwd), lambda: code.run(code.frows, buf[0], both)]
    if ca:
        fns.append(ca["call"])
    t = _interleaved_s(fns, turns=9, clock=time.thread_time)
    code._free.append(buf)
    rows = len(prog)
    line = (f"by CPU time, the compiled entry alone: forward {_ns(t[0] / rows)}/row, reverse "
            f"{_ns(max(t[1] - t[0], 0.0) / rows)}/row ({_us(t[1])} a value_and_grad)")
    if ca:
        line += (f", CasADi {_ns(t[2] / ca['instructions'])}/instruction ({_us(t[2])} a "
                 f"call)")
    return line


def _cpu_buffer(prog, x, ca):
    """The bound call (``program.buffer``), its compiled entry alone and CasADi's buffer
    call, by CPU time in turns: the bound call's Python side."""
    code = prog._code
    f, g = np.empty(()), np.empty(x.shape)
    call = prog.buffer(x.copy(), out=f, grad=g)
    buf = code.buffers()
    buf[1][:] = x
    both = np.empty(code.res_size[True])
    fns = [call, lambda: code.run(code.frows, buf[0], both)]
    if ca:
        fns.append(ca["call"])
    t = _interleaved_s(fns, turns=9, clock=time.thread_time)
    code._free.append(buf)
    line = (f"by CPU time: the bound call {_us(t[0])}, its compiled entry {_us(t[1])} (Python "
            f"side {_us(max(t[0] - t[1], 0.0))})")
    if ca:
        line += f", CasADi {_us(t[2])} ({t[2] / t[0]:.2f}x)"
    return line


def _cpu_overhead(prog):
    """The call-overhead row's Python side again by CPU time, the call and its compiled entry
    in turns (on a shared machine the wall-clock difference grows with the load)."""
    a, b, c = _three_x()
    code = prog._code
    buf = code.buffers()
    buf[1][:] = np.concatenate([a, b, c])
    res = np.empty(code.res_size[True])
    call, entry = _interleaved_s([lambda: prog.value_and_grad(a, b, c),
                                  lambda: code.run(code.frows, buf[0], res)],
                                 turns=9, clock=time.thread_time)
    code._free.append(buf)
    return (f"by CPU time: Python side {_us(call - entry)} (value_and_grad {_us(call)}, entry "
            f"{_us(entry)})")


def _ns(seconds):
    return f"{seconds * 1e9:.1f} ns"


def _us(seconds):
    return f"{seconds * 1e6:.3g} us"


def finish(name: str, row) -> None:
    """Add the note of an issue-17 row (``row.extra["note"]``) and the pass rule of the rows
    whose target is not a speedup; other rows are left alone."""
    if name not in CASES or row.tapegrad is None:
        return
    built = _BUILT.get(name, {})
    prog = built.get("prog")
    parts = []
    if name.endswith("_buffer_vs_casadi"):
        ca = _BUILT.get(name + ":casadi")
        if ca and row.torch:
            parts.append(f"CasADi {ca['instructions']} instructions, "
                         f"{_ns(row.torch / ca['instructions'])}/instruction; both bound once "
                         f"to arrays (program.buffer, CasADi Function.buffer())")
        parts.append(_cpu_buffer(prog, built["x"], ca))
    elif name.endswith("_vs_casadi"):
        x = built["x"]
        rows = len(prog)
        fwd, both = _interleaved_s([lambda: prog(x), lambda: prog.value_and_grad(x)])
        parts.append(f"{rows} program rows: forward {_ns(fwd / rows)}/row, reverse "
                     f"{_ns(max(both - fwd, 0.0) / rows)}/row (whole calls, Python included: "
                     f"program(x), and value_and_grad minus it, timed in turns after the row)")
        ca = _BUILT.get(name + ":casadi")
        if ca and row.torch:
            parts.append(f"CasADi {ca['instructions']} instructions, "
                         f"{_ns(row.torch / ca['instructions'])}/instruction (forward and "
                         f"reverse together); peer = CasADi Function.buffer(), buffers set once")
        parts.append(_cpu_rows(prog, x, ca))
    elif name.endswith("_jtimes"):
        grad_rows = len(prog.grad_program())
        from tapegrad.replay import _hvp_code
        code = prog._code
        h = code.derived("hvp", lambda: _hvp_code(code))
        hvp_rows = h.rows.shape[0]
        # one-sample calls run the program that keeps the value too (its rows after the
        # product: the reverse sweep skips them)
        one = "" if h.with_value is None else \
            f" ({h.with_value.rows.shape[0]} with the value, for one-sample calls)"
        ratio = max(hvp_rows, 0 if h.with_value is None else h.with_value.rows.shape[0]) \
            / grad_rows
        parts.append(f"Hessian-vector program {hvp_rows} rows{one}, gradient program "
                     f"{grad_rows} rows ({ratio:.2f}x; target <= 4x)")
        if ratio > 4:
            row.passed = False
        parts.append("peer = CasADi jtimes through Function.buffer(), buffers set once")
    elif "_batch" in name:
        batch = BATCH if f"batch{BATCH}_" in name else SMALL_BATCH
        peer = "single calls" if name.endswith("single_calls") else "serial batch"
        line = f"per input: tapegrad {_us(row.tapegrad / batch)}"
        if row.torch:
            line += f", {peer} {_us(row.torch / batch)}"
        parts.append(line)
        note = _parallel_note(name) if "_parallel_" in name else None
        if note:
            parts.append(note)
    elif "call_overhead" in name:
        row.target = f"<= {_us(OVERHEAD_TARGET_S)} over entry"
        if row.torch:
            over = row.tapegrad - row.torch
            parts.append(f"Python side {_us(over)} per call (value_and_grad {_us(row.tapegrad)}"
                         f" minus the compiled entry {_us(row.torch)}: the sweeps into "
                         f"buffers set once)")
            row.passed = over <= OVERHEAD_TARGET_S and row.error is None
        if prog is not None:  # (a row finished without its case run here has no program)
            parts.append(_cpu_overhead(prog))
    if parts:
        row.extra["note"] = "; ".join(parts)
