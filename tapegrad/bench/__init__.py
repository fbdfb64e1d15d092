"""Benchmark suite: the shared cases (``cases``) and the ``python -m tapegrad.bench`` runner.

Run ``python -m tapegrad.bench`` (quick, under 2 minutes) or
``python -m tapegrad.bench --full``; ``--only NAME``, ``--json PATH`` and
``--plot PATH`` narrow and save the run, ``--list`` names the cases. The same
cases run under pytest-benchmark with ``python -m pytest bench/ --benchmark-only``.
"""

from . import cases, vm

# issue 17's replay VM rows (bench/vm.py builds on cases' helpers, so it registers here)
cases.SPEED_CASES.update(vm.CASES)
