"""``python -m tapegrad.bench``: time tapegrad against torch on the shared cases and print a table."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import gc
import json
import math
import os
import platform
import shlex
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable

import numpy as np

from tapegrad.bench import cases, vm


@dataclass(frozen=True)
class Settings:
    """How hard each mode works. quick: about 1.5 minutes on 2 cores with a warm Numba cache,
    about 3 on a fresh clone (README.md's numbers)."""

    mode: str
    budget_s: float  # timing budget per case per library, after warm-up
    min_repeats: int
    max_repeats: int
    warmups: int  # extra untimed calls after the first (compiling) one
    import_warm_repeats: int
    import_cold_repeats: int
    rss_steps: int  # pendulum steps for the RSS memory probe


MODES = {
    "quick": Settings("quick", 0.5, 3, 100_000, 1, 3, 1, 50_000),
    "full": Settings("full", 3.0, 10, 1_000_000, 2, 10, 3, 100_000),
}


@dataclass
class Row:
    case: str
    kind: str  # "speed", "memory" or "startup"
    unit: str  # "s" or "B/op"
    target: str
    tapegrad: float | None = None
    torch: float | None = None
    ratio: float | None = None  # torch / tapegrad
    passed: bool | None = None
    error: str | None = None
    tapegrad_first_call_s: float | None = None
    torch_first_call_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


MEMORY_CASE = "pendulum_euler_10k_memory"
MEMORY_RSS_CASE = "pendulum_euler_10k_memory_rss"
IMPORT_WARM_CASE = "import_to_first_grad_warm"
IMPORT_COLD_CASE = "import_to_first_grad_cold"
TRACE_CASES = [f"replay_pendulum_trace_compile_{n // 1000}k_vs_jax" for n in cases.TRACE_STEPS]
CUDA_CASES = [f"cuda_rosenbrock_scalar_n{cases.CUDA_N}_batch_{b:.0e}".replace("+0", "")
              for b in cases.CUDA_BATCHES]


def all_case_names() -> list[str]:
    names = list(cases.SPEED_CASES)
    at = names.index("pendulum_euler_10k") + 1
    names[at:at] = [MEMORY_CASE, MEMORY_RSS_CASE]
    at = names.index("replay_pendulum_euler_10k") + 1
    names[at:at] = TRACE_CASES
    return names + CUDA_CASES + [IMPORT_WARM_CASE, IMPORT_COLD_CASE] + list(
        cases.REPLAY_COLD_CASES)


GLOB_CHARS = frozenset("*?[")


def select_cases(patterns: list[str] | None) -> list[str]:
    """Case names matching any pattern, in the table's order. A pattern that is a case's
    exact name selects that case only; one with ``*``, ``?`` or ``[`` is a glob; any other
    is a name prefix (``cuda`` selects every CUDA row)."""
    names = all_case_names()
    if not patterns:
        return names
    chosen = set()
    for pattern in patterns:
        if pattern in names:
            chosen.add(pattern)
        elif GLOB_CHARS & set(pattern):
            chosen.update(n for n in names if fnmatch.fnmatchcase(n, pattern))
        else:
            chosen.update(n for n in names if n.startswith(pattern))
    return [n for n in names if n in chosen]


def unmatched_patterns(patterns: list[str] | None) -> list[str]:
    """The patterns that select no case (a typo the user should hear about)."""
    return [p for p in patterns or [] if not select_cases([p])]


def split_patterns(values: list[str] | None) -> list[str] | None:
    """``--only`` values: several after one flag, the flag repeated, or comma-separated."""
    return [p.strip() for item in values or [] for p in item.split(",") if p.strip()] or None


def summary_line(rows: list[Row], strict: bool) -> str:
    """How many rows missed their target, and whether that fails the command."""
    missed = sum(1 for r in rows if r.passed is False and r.error is None)
    errors = sum(1 for r in rows if r.error is not None)
    parts = []
    if errors:
        parts.append(f"{errors} of {len(rows)} rows raised an error (ERROR; the exit status is 1)")
    if missed:
        consequence = ("the exit status is 1 (--strict)" if strict else
                       "the exit status stays 0; pass --strict to make that a failure")
        parts.append(f"{missed} of {len(rows)} rows missed their target (FAIL; {consequence})")
    if not parts:
        checked = sum(1 for r in rows if r.passed is not None)
        parts.append(f"all {checked} rows with a target met it" if checked else
                     "no row has a pass/fail target")
    return "; ".join(parts)


#: peers that only the bench extra installs: without one, its rows are skipped (one line says
#: so), not ERROR, so a user with only torch still gets a table and exit status 0
OPTIONAL_PEERS = ("casadi",)


def missing_optional_peers(names: list[str]) -> dict[str, list[str]]:
    """``{peer: [case names]}`` for each optional peer of the selected cases that cannot be
    imported."""
    missing: dict[str, list[str]] = {}
    for name in names:
        case = cases.SPEED_CASES.get(name)
        if case is not None and case.peer in OPTIONAL_PEERS:
            missing.setdefault(case.peer, []).append(name)
    return {peer: rows for peer, rows in missing.items() if not cases.library_available(peer)}


def plot_unavailable() -> str | None:
    """Why ``--plot`` cannot work here (matplotlib missing), or None."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return ("--plot needs matplotlib, which is not installed: "
                "pip install 'tapegrad[plot]' (or pip install matplotlib)")
    return None


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# measuring


@dataclass
class Timing:
    median_s: float
    first_call_s: float
    repeats: int
    result: Any


def measure(fn: Callable[[], Any], settings: Settings) -> Timing:
    """Call once (compiles), warm up, then time calls until the budget is spent; median of the timed calls."""
    gc.collect()
    first_call_s, result = cases.timed(fn)
    for _ in range(settings.warmups):
        fn()
    times = []
    perf_counter = time.perf_counter
    start = perf_counter()
    while True:
        t0 = perf_counter()
        fn()
        times.append(perf_counter() - t0)
        if len(times) >= settings.min_repeats and (
            perf_counter() - start >= settings.budget_s or len(times) >= settings.max_repeats
        ):
            break
    return Timing(cases.median(times), first_call_s, len(times), result)


#: each library's turn in ``measure_interleaved`` lasts at least this long
TURN_S = 0.02


def measure_interleaved(fns: dict[str, Callable[[], Any]], settings: Settings) -> dict[str, Timing]:
    """Like ``measure`` for several libraries at once: after each one's compiling first call
    and warm-up, the libraries take turns, so a busy moment of a shared machine slows both
    alike and the ratio of medians stays fair. A turn repeats the call for ``TURN_S`` and
    counts the mean time per call: one library's call right after the other's pays for
    caches the other evicted (tens of microseconds here), which would swamp fast calls."""
    gc.collect()
    first, results = {}, {}
    for lib, fn in fns.items():
        first[lib], results[lib] = cases.timed(fn)
        for _ in range(settings.warmups):
            fn()
    times = {lib: [] for lib in fns}
    perf_counter = time.perf_counter
    start = perf_counter()
    while True:
        for lib, fn in fns.items():
            t0 = perf_counter()
            calls = 0
            while True:
                fn()
                calls += 1
                elapsed = perf_counter() - t0
                if elapsed >= TURN_S:
                    break
            times[lib].append(elapsed / calls)
        n = len(times[next(iter(fns))])
        if n >= settings.min_repeats and (
            perf_counter() - start >= settings.budget_s * len(fns) or n >= settings.max_repeats
        ):
            break
    return {lib: Timing(cases.median(times[lib]), first[lib], len(times[lib]), results[lib])
            for lib in fns}


def run_speed_case(name: str, settings: Settings, with_torch: bool) -> Row:
    case = cases.SPEED_CASES[name]
    row = Row(name, "speed", "s", f">= {case.target_speedup:g}x")
    if case.ops:
        row.extra["ops"] = case.ops
    errors = []
    fns = {}
    peer = case.peer
    with_peer = with_torch if peer == "torch" else cases.library_available(peer)
    if not with_peer and peer != "torch":  # main skips these rows; a direct call says why
        row.error = f"{peer} is not installed (pip install {peer}): tapegrad only"
    for library in ("tapegrad", peer) if with_peer else ("tapegrad",):
        try:
            fns[library] = case.make(library)
        except Exception as exc:  # report, keep going with the other cases
            traceback.print_exc(file=sys.stderr)
            errors.append(f"{library}: {type(exc).__name__}: {exc}")
    if case.repeats is not None:
        settings = dataclasses.replace(settings, min_repeats=case.repeats,
                                       max_repeats=case.repeats, warmups=0)
    progress(f"running {name} ({', '.join(fns)}, interleaved) ...")
    try:
        timings = measure_interleaved(fns, settings) if fns else {}
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        errors.append(f"{type(exc).__name__}: {exc}")
        timings = {}
    for library, timing in timings.items():
        col = "tapegrad" if library == "tapegrad" else "torch"  # the peer's column
        setattr(row, col, timing.median_s)
        setattr(row, f"{col}_first_call_s", timing.first_call_s)
        row.extra[f"{library}_repeats"] = timing.repeats
        try:
            row.extra[f"{library}_max_rel_err"] = cases.check_result(case, timing.result)
        except AssertionError as exc:
            errors.append(f"{library}: wrong gradient: {exc}")
        progress(f"  {library}: median {format_value(timing.median_s, 's')} over {timing.repeats} turns")
    if errors:
        row.error = "; ".join(errors)
    if row.tapegrad and row.torch:
        row.ratio = row.torch / row.tapegrad
        row.passed = row.ratio >= case.target_speedup and row.error is None
    elif row.error is not None:
        row.passed = False
    vm.finish(name, row)  # issue 17's rows: notes and targets that are not speedups
    return row


def run_memory_cases(names: list[str], settings: Settings, with_torch: bool) -> list[Row]:
    """Bytes per recorded op of the pendulum graph, for the requested memory rows.

    ``pendulum_euler_10k_memory``: tapegrad by tracemalloc (what the brief of
    the issue asks for) against torch by RSS growth. ``..._memory_rss``: both
    by RSS growth in fresh processes, the like-for-like check (tracemalloc
    cannot see memory that Numba's runtime or C code allocates).
    """
    traced_row = Row(MEMORY_CASE, "memory", "B/op", f">= {cases.MEMORY_TARGET_RATIO:g}x less")
    rss_row = Row(MEMORY_RSS_CASE, "memory", "B/op", f">= {cases.MEMORY_TARGET_RATIO:g}x less")
    errors: dict[str, list[str]] = {MEMORY_CASE: [], MEMORY_RSS_CASE: []}

    if MEMORY_CASE in names:
        progress(f"running {MEMORY_CASE} (tapegrad, tracemalloc, {cases.PENDULUM_STEPS} steps) ...")
        try:
            traced = cases.tapegrad_tracemalloc_bytes_per_op(cases.PENDULUM_STEPS)
            traced_row.tapegrad = traced["bytes_per_op"]
            traced_row.extra["tapegrad_tracemalloc"] = traced
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            errors[MEMORY_CASE].append(f"tapegrad: {type(exc).__name__}: {exc}")
    if MEMORY_RSS_CASE in names:
        progress(f"running {MEMORY_RSS_CASE} (tapegrad, RSS in a fresh process, {settings.rss_steps} steps) ...")
        try:
            rss = cases.rss_bytes_per_op("tapegrad", settings.rss_steps)
            rss_row.tapegrad = rss["bytes_per_op"]
            rss_row.extra["tapegrad_rss"] = rss
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            errors[MEMORY_RSS_CASE].append(f"tapegrad: {type(exc).__name__}: {exc}")
    if with_torch:
        progress(f"running pendulum_euler_10k memory (torch, RSS in a fresh process, {settings.rss_steps} steps) ...")
        try:
            rss = cases.rss_bytes_per_op("torch", settings.rss_steps)
            for row in (traced_row, rss_row):
                row.torch = rss["bytes_per_op"]
                row.extra["torch_rss"] = rss
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            for key in errors:
                errors[key].append(f"torch: {type(exc).__name__}: {exc}")

    rows = []
    for row in (traced_row, rss_row):
        if row.case not in names:
            continue
        if errors[row.case]:
            row.error = "; ".join(errors[row.case])
        if row.tapegrad is not None and row.torch is not None:
            row.ratio = row.torch / row.tapegrad if row.tapegrad > 0 else math.inf
            row.passed = row.ratio >= cases.MEMORY_TARGET_RATIO and row.error is None
        elif row.tapegrad is None:
            row.passed = False
        rows.append(row)
    return rows


def run_trace_cases(names: list[str], settings: Settings) -> list[Row]:
    """Trace + first-call time of the pendulum at 1k and 10k steps (the 10k row passes when
    it grows no faster than linearly, within 1.5x), next to JAX's jit compile time of the
    same unrolled loop (``--full`` only: it takes minutes)."""
    rows, first = [], None
    for steps, name in zip(cases.TRACE_STEPS, TRACE_CASES):
        row = Row(name, "compile", "s", "linear in steps")
        progress(f"running {name} (trace + first call of a {steps}-step pendulum) ...")
        try:
            cases.trace_compile_seconds(min(steps, 100))  # load the interpreters first
            r = cases.trace_compile_seconds(steps)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            row.error = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            continue
        row.tapegrad = r["total_s"]
        row.extra.update(r)
        if first is None:
            first = r
            row.passed = True
        else:
            growth = r["total_s"] / first["total_s"]
            row.extra["growth"] = growth
            row.passed = growth <= 1.5 * steps / first["steps"]
        if settings.mode == "full":
            progress(f"  jax: jit compile of the same loop (timeout {cases.JAX_TIMEOUT_S:g} s) ...")
            j = cases.jax_compile_seconds(steps)
            if j is None:
                row.extra["jax"] = "not installed"
            elif "timeout" in j:
                row.extra["jax"] = f"> {j['timeout']:g} s (timed out)"
            elif "skipped" in j:
                row.extra["jax"] = j["skipped"]
            else:
                row.torch = j["compile_s"]
                row.ratio = row.torch / row.tapegrad
        else:
            row.extra["jax"] = "measured with --full"
        if name in names:
            rows.append(row)
    return rows


def run_cuda_cases(names: list[str], settings: Settings) -> list[Row]:
    """Batched value_and_grad on the GPU (target="cuda") against torch.func.vmap(grad) on
    the same GPU (the parallel CPU target when torch has no CUDA); one row saying why when
    there is no GPU."""
    why = cases.cuda_status()
    if why is not None:
        row = Row("cuda_rosenbrock_scalar_throughput", "throughput", "s", "report")
        row.extra["skipped"] = why
        progress(f"skipping the CUDA cases: {why}")
        return [row]
    rows = []
    for batch, name in zip(cases.CUDA_BATCHES, CUDA_CASES):
        if name not in names:
            continue
        progress(f"running {name} (value_and_grad over {batch:,} inputs on the GPU) ...")
        row = Row(name, "throughput", "s", "report")
        try:
            r = cases.cuda_throughput(batch, repeats=3 if settings.mode == "quick" else 10)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            row.error = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            continue
        row.tapegrad = r["cuda_s"]
        peer = r["torch_s"] if r["torch_s"] is not None else r["parallel_s"]
        row.torch = peer
        row.ratio = peer / r["cuda_s"]
        row.extra.update(r)
        row.extra["peer"] = "torch vmap(grad) on the GPU" if r["torch_s"] is not None else \
            "tapegrad target='parallel' (torch has no CUDA here)"
        row.passed = r["max_rel_err"] < 1e-10
        rows.append(row)
    return rows


def run_import_case(cold: bool, settings: Settings) -> Row:
    name = IMPORT_COLD_CASE if cold else IMPORT_WARM_CASE
    target_s = cases.IMPORT_COLD_TARGET_S if cold else cases.IMPORT_WARM_TARGET_S
    repeats = settings.import_cold_repeats if cold else settings.import_warm_repeats
    row = Row(name, "startup", "s", f"<= {target_s:g} s")
    what = "empty NUMBA_CACHE_DIR" if cold else "warm Numba cache"
    progress(f"running {name} ({_processes(repeats)}, {what}) ...")
    try:
        runs = cases.import_to_first_grad(cold=cold, repeats=repeats)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        row.error = f"{type(exc).__name__}: {exc}"
        row.passed = False
        return row
    row.tapegrad = cases.median([r["total_s"] for r in runs])
    row.extra["import_s"] = cases.median([r["import_s"] for r in runs])
    row.extra["first_grad_s"] = cases.median([r["first_grad_s"] for r in runs])
    row.extra["runs"] = runs
    row.passed = row.tapegrad <= target_s
    progress(f"  tapegrad: median {format_value(row.tapegrad, 's')} over {_processes(len(runs))}")
    return row


def run_replay_cold_case(name: str) -> Row:
    target_s, batch, target = cases.REPLAY_COLD_CASES[name]
    row = Row(name, "startup", "s", f"<= {target_s:g} s")
    what = "one input" if batch is None else f"{batch} inputs, target={target!r}"
    progress(f"running {name} (1 fresh process, empty NUMBA_CACHE_DIR: trace + first "
             f"value_and_grad, {what}) ...")
    try:
        r = cases.replay_cold_first_call(name)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        row.error = f"{type(exc).__name__}: {exc}"
        row.passed = False
        return row
    row.tapegrad = r["first_call_cpu_s"]  # (the wall time grows with the machine's load)
    row.extra.update(r)
    row.passed = row.tapegrad <= target_s
    progress(f"  tapegrad: {format_value(row.tapegrad, 's')} of CPU, "
             f"{format_value(r['first_call_s'], 's')} of wall time (import not counted)")
    return row


# --------------------------------------------------------------------------
# reporting


def _processes(n: int) -> str:
    return f"{n} fresh process" + ("" if n == 1 else "es")


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "B/op":
        return f"{value:.0f} B/op" if abs(value) >= 10 else f"{value:.1f} B/op"
    for scale, suffix in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
        if abs(value) >= scale or scale == 1e-9:
            shown = value / scale
            return f"{shown:.3g} {suffix}" if shown < 100 else f"{shown:.0f} {suffix}"
    return f"{value:g} {unit}"


def format_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    if math.isinf(ratio):
        return "inf"
    return f"{ratio:.3g}x" if ratio < 100 else f"{ratio:.0f}x"


def format_pass(row: Row) -> str:
    if row.error is not None:
        return "ERROR"
    if row.passed is None:
        return "n/a"
    return "pass" if row.passed else "FAIL"


def render_table(rows: list[Row]) -> str:
    header = ["case", "tapegrad", "peer", "speedup (peer/tapegrad)", "target", "pass/fail", "tapegrad 1st call"]
    body = [
        [
            r.case,
            format_value(r.tapegrad, r.unit),
            format_value(r.torch, r.unit),
            format_ratio(r.ratio),
            r.target,
            format_pass(r),
            format_value(r.tapegrad_first_call_s, "s"),
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    right = {1, 2, 3, 6}

    def fmt(line):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *(fmt(line) for line in body)])


def render_notes(rows: list[Row], with_torch: bool) -> list[str]:
    notes = [
        "peer = torch, except in cases named *_vs_<peer>; speedup = peer time / tapegrad time; for memory, torch bytes per op / tapegrad bytes per op.",
        "times are medians over turns of the mean time per iteration (forward + gradient; for replay_* cases a call of the traced program), after a compiling first call and a warm-up.",
    ]
    for r in rows:
        if r.kind == "throughput":
            if "skipped" in r.extra:
                notes.append(f"{r.case}: not measured ({r.extra['skipped']})")
            elif r.tapegrad:
                e = r.extra
                line = (f"{r.case}: tapegrad cuda {e['batch'] / e['cuda_s']:.3g} gradients/s, "
                        f"parallel CPU {e['batch'] / e['parallel_s']:.3g}/s")
                if e.get("torch_s"):
                    line += f", torch vmap(grad) on the GPU {e['batch'] / e['torch_s']:.3g}/s"
                notes.append(line + f"; peer = {e['peer']}")
            continue
        ops = r.extra.get("ops")
        if r.kind == "speed" and ops and r.tapegrad:
            line = f"{r.case}: {ops} recorded ops, tapegrad {format_value(r.tapegrad / ops, 's')}/op"
            if r.torch:
                line += f", torch {format_value(r.torch / ops, 's')}/op"
            notes.append(line + " (forward + backward)")
        elif r.kind == "memory":
            traced = r.extra.get("tapegrad_tracemalloc")
            if traced:
                notes.append(
                    f"{r.case}: tapegrad = tracemalloc bytes kept alive by a {traced['steps']}-step graph "
                    f"after the forward pass / {traced['ops']} ops (peak during forward "
                    f"{traced['peak_bytes_per_op']:.0f} B/op; {traced['left_after_free_bytes']} B left after dropping the loss)"
                )
            for library in ("tapegrad", "torch"):
                rss = r.extra.get(f"{library}_rss")
                if rss and rss.get("bytes_per_op") is not None and (library == "tapegrad" or r.case == MEMORY_RSS_CASE):
                    notes.append(
                        f"{r.case}: {library} = {rss['method']} growth in a fresh process while a "
                        f"{rss['steps']}-step graph is alive / {rss['ops']} ops"
                    )
            if r.case == MEMORY_CASE and r.torch is not None:
                notes.append(f"{r.case}: torch by RSS, because tracemalloc cannot see torch's C++ allocations")
        elif r.kind == "compile" and r.tapegrad is not None:
            line = (f"{r.case}: trace {format_value(r.extra['trace_s'], 's')} + first call "
                    f"{format_value(r.extra['first_call_s'], 's')}, {r.extra['rows']} program rows")
            if "growth" in r.extra:
                line += f", {r.extra['growth']:.1f}x the 1k time for 10x the steps"
            jax = r.extra.get("jax")
            line += f"; jax jit compile: {jax}" if jax else "; peer = jax jit compile time"
            notes.append(line)
        elif r.case in cases.REPLAY_COLD_CASES and r.tapegrad is not None:
            notes.append(f"{r.case}: trace + first call {format_value(r.tapegrad, 's')} of "
                         f"CPU ({format_value(r.extra['first_call_s'], 's')} of wall time) "
                         f"with an empty Numba cache (import "
                         f"{format_value(r.extra['import_s'], 's')} before it, not counted)")
        elif r.kind == "startup" and r.tapegrad is not None:
            notes.append(
                f"{r.case}: import {format_value(r.extra['import_s'], 's')} + first grad "
                f"{format_value(r.extra['first_grad_s'], 's')} (median of {_processes(len(r.extra['runs']))})"
            )
        if r.extra.get("note"):
            notes.append(f"{r.case}: {r.extra['note']}")
        if r.error:
            notes.append(f"{r.case}: ERROR {r.error}")
    if not with_torch:
        notes.append("torch was not found: tapegrad times only (pip install torch==2.13.0 to compare).")
    return notes


def environment(settings: Settings, with_torch: bool) -> dict[str, Any]:
    import numba

    env = {
        "mode": settings.mode,
        "command": " ".join(["python -m tapegrad.bench", shlex.join(sys.argv[1:])]).strip(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "tapegrad": cases.library_version("tapegrad"),
        "torch": cases.library_version("torch") if with_torch else None,
    }
    if with_torch:
        import torch

        env["torch_threads"] = torch.get_num_threads()
    return env


def write_plot(rows: list[Row], path: str) -> bool:
    """Bar chart of the ratios against their targets (``main`` checks for matplotlib first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [r for r in rows if r.ratio is not None and math.isfinite(r.ratio) and r.ratio > 0]
    if not shown:
        return False
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(shown) + 1.5))
    labels = [r.case for r in shown]
    ratios = [r.ratio for r in shown]
    colors = ["tab:green" if r.passed else "tab:red" for r in shown]
    ax.barh(labels, ratios, color=colors)
    for i, r in enumerate(shown):
        target = cases.MEMORY_TARGET_RATIO if r.kind == "memory" else cases.SPEED_CASES[r.case].target_speedup
        ax.plot([target, target], [i - 0.4, i + 0.4], color="black", linewidth=2)
    ax.set_xscale("log")
    ax.set_xlabel("torch / tapegrad (higher is better; black bar = target)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------
# entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tapegrad.bench",
        description="Benchmark tapegrad against torch (when installed) and print a table of ratios.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", help="short run (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="longer budgets and more repeats")
    parser.set_defaults(mode="quick")
    parser.add_argument(
        "--only",
        metavar="PATTERN",
        nargs="+",
        action="extend",
        help="run only the cases matching any PATTERN: an exact case name selects that case "
        "only, a pattern with * ? [ is a glob (quote it), anything else a name prefix; "
        "several may follow one --only, or be comma-separated",
    )
    parser.add_argument("--list", action="store_true",
                        help="list the case names (those --only selects, if given) and exit")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--plot", metavar="PATH", help="also save a bar chart to PATH (needs matplotlib: pip install 'tapegrad[plot]')")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 when any row misses its target (FAIL); without "
                        "it only errors (ERROR) make the exit status 1")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    patterns = split_patterns(args.only)
    unmatched = unmatched_patterns(patterns)
    if unmatched:
        parser.error(f"--only {' '.join(unmatched)} matched no case; the cases are "
                     f"(python -m tapegrad.bench --list): {', '.join(all_case_names())}")
    names = select_cases(patterns)
    if args.list:
        print("\n".join(names))
        return 0
    if args.plot and plot_unavailable():
        parser.error(plot_unavailable())
    settings = MODES[args.mode]

    started = time.perf_counter()
    with_torch = cases.library_available("torch")
    if not with_torch:
        progress("torch was not found: measuring tapegrad only")

    skipped = missing_optional_peers(names)
    for peer, peer_rows in skipped.items():
        print(f"{peer} not installed: pip install 'tapegrad[bench]' "
              f"(skipping its {len(peer_rows)} row{'s' * (len(peer_rows) != 1)})", flush=True)
        names = [n for n in names if n not in peer_rows]

    rows: list[Row] = []
    for name in names:
        if name in cases.SPEED_CASES:
            rows.append(run_speed_case(name, settings, with_torch))
        elif name in (MEMORY_CASE, MEMORY_RSS_CASE):
            if not any(r.kind == "memory" for r in rows):
                rows.extend(run_memory_cases(names, settings, with_torch))
        elif name in TRACE_CASES:
            if not any(r.kind == "compile" for r in rows):
                rows.extend(run_trace_cases(names, settings))
        elif name in CUDA_CASES:
            if not any(r.kind == "throughput" for r in rows):
                rows.extend(run_cuda_cases(names, settings))
        elif name == IMPORT_WARM_CASE:
            rows.append(run_import_case(False, settings))
        elif name == IMPORT_COLD_CASE:
            rows.append(run_import_case(True, settings))
        elif name in cases.REPLAY_COLD_CASES:
            rows.append(run_replay_cold_case(name))
    elapsed = time.perf_counter() - started

    env = environment(settings, with_torch)
    versions = f"python {env['python']}, numpy {env['numpy']}, numba {env['numba']}, tapegrad {env['tapegrad']}"
    versions += f", torch {env['torch']} ({env['torch_threads']} threads)" if with_torch else ", torch not found"
    print(f"tapegrad benchmark ({settings.mode}): {versions}, {env['cpu_count']} CPUs")
    print()
    print(render_table(rows))
    print()
    for note in render_notes(rows, with_torch):
        print(f"  {note}")
    print(f"\n{summary_line(rows, args.strict)}")
    print(f"total {elapsed:.1f} s; reproduce with: {env['command']}")

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "elapsed_s": elapsed, "results": [asdict(r) for r in rows]}, fh, indent=2, default=str)
    if args.plot:
        if write_plot(rows, args.plot):
            print(f"plot written to {args.plot}")
        else:
            print(f"no plot written to {args.plot}: no row has a speedup to show")

    if any(r.error is not None for r in rows):
        return 1
    if args.strict and any(r.passed is False for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
