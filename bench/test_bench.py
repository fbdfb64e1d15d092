"""pytest-benchmark over the cases of ``tapegrad.bench.cases``, tapegrad against torch.

Not part of the test suite (pyproject's testpaths is ``tests``). Run with::

    python -m pytest bench/ --benchmark-only -n 0

Each case is grouped so that tapegrad and torch sit side by side; the first
(compiling) call runs and is checked against the exact gradient before timing.
"""

import shutil
import tempfile

import pytest

from tapegrad.bench import cases


def _require(library):
    if library != "tapegrad":
        pytest.importorskip(library)
    return library


@pytest.mark.parametrize("case_name,library", [
    (name, lib) for name, case in cases.SPEED_CASES.items() for lib in ("tapegrad", case.peer)])
def test_speed(benchmark, case_name, library):
    case = cases.SPEED_CASES[case_name]
    iteration = case.make(_require(library))
    first_call_s, grads = cases.timed(iteration)
    benchmark.extra_info["first_call_s"] = first_call_s
    benchmark.extra_info["max_rel_err"] = cases.check_result(case, grads)
    if case.ops:
        benchmark.extra_info["ops"] = case.ops
    benchmark.group = case_name
    benchmark(iteration)


def test_pendulum_memory_tracemalloc(benchmark):
    """tapegrad's bytes per recorded op by tracemalloc (see the RSS test for torch)."""
    benchmark.group = "pendulum_euler_10k_memory"
    result = benchmark.pedantic(cases.tapegrad_tracemalloc_bytes_per_op, rounds=1, iterations=1)
    benchmark.extra_info.update(result)


@pytest.mark.parametrize("library", ["tapegrad", "torch"])
def test_pendulum_memory_rss(benchmark, library):
    """Bytes per recorded op by RSS growth in a fresh process, for both libraries."""
    _require(library)
    benchmark.group = "pendulum_euler_10k_memory"
    result = benchmark.pedantic(cases.rss_bytes_per_op, args=(library, 50_000), rounds=1, iterations=1)
    benchmark.extra_info.update(result)


def test_import_to_first_grad_warm(benchmark):
    """Wall time of a fresh process; extra_info has the time from ``import tapegrad`` to the first gradient."""
    benchmark.group = "import_to_first_grad"
    cases.first_grad_in_fresh_process()  # warm the Numba cache
    runs = []

    def run():
        runs.append(cases.first_grad_in_fresh_process())

    benchmark.pedantic(run, rounds=5, iterations=1)
    benchmark.extra_info["total_s_median"] = cases.median([r["total_s"] for r in runs])
    benchmark.extra_info["target_s"] = cases.IMPORT_WARM_TARGET_S


def test_import_to_first_grad_cold(benchmark):
    """As the warm test, with NUMBA_CACHE_DIR set to a new empty directory."""
    benchmark.group = "import_to_first_grad"
    cache_dir = tempfile.mkdtemp(prefix="tapegrad-cold-numba-cache-")
    try:
        result = benchmark.pedantic(cases.first_grad_in_fresh_process, args=(cache_dir,), rounds=1, iterations=1)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    benchmark.extra_info.update(result)
    benchmark.extra_info["target_s"] = cases.IMPORT_COLD_TARGET_S
