"""A GradBench tool over tapegrad's public API: ``python -m tapegrad.bench.gradbench``.

GradBench (github.com/gradbench/gradbench) sends one JSON message per line on stdin
(``start``, ``define``, ``evaluate``, ``analysis``) and reads one response per line on
stdout. ``--trace`` traces each objective once while preparing an evaluation (reported as
a ``prepare`` timing, untimed as ``evaluate``) and replays it in compiled code.

Each eval lives in its own module, written from the eval's specification as a function of
a module ``M`` (``tapegrad`` or ``torch``), so the tests run the same text under torch as
the oracle. A module exposes ``prepare(function, input, M, trace)`` returning
``(run, post)``: ``run()`` is the timed work, ``post(result)`` the JSON output.
"""
EVALS = ("hello", "gmm", "lse", "ode", "llsq", "det", "kmeans", "lstm", "ba", "ht",
         "particle", "saddle")
