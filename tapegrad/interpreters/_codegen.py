"""Generates the compiled interpreters (``_generated_cpu.py``, ``_generated_replay.py``,
``_generated_cuda.py``) and the eager fast paths (``_generated_eager.py``) from the ops
registry. Each rule is run once on ``SymF`` (``rule_exprs``, through ``ops.call_rule``);
one emitter, ``render``, writes every interpreter's branch of an op from it, told by a
``Target`` how that interpreter reads and writes values and adjoints. The emitter lives in
``_codegen_emit``, each generated file's generator in ``_codegen_cpu``, ``_codegen_eager``,
``_codegen_replay`` (and ``_codegen_batch``); this module writes them all.

Run ``python -m tapegrad.interpreters._codegen`` after changing an op; a test fails when
the committed file is stale. Numba caches the generated module's functions because they
live in a file (``njit_cached`` also keys every driver's cache on this file's content).
"""
from __future__ import annotations

import pathlib

from ._codegen_arrays import ARRAYS_TARGET, generate_arrays
from ._codegen_cpu import (  # noqa: F401 (re-exported: the generator's one entry point)
    FLAT, SCALAR, TARGET, _flat_source, _sides_source, generate, recordable_ops, render_scatter)
from ._codegen_eager import EAGER_TARGET, generate_eager  # noqa: F401
from ._codegen_emit import (  # noqa: F401
    CUDA, REPLAY_BATCH, REPLAY_MULTI, REPLAY_ONE, ROW_COLS, TAPE_COLS, VALUE,
    Target, _consts_of, _forward_expr, _inputs, _replay_ops, dispatch, render, rule_exprs)
from ._codegen_replay import (  # noqa: F401
    CUDA_TARGET, REPLAY_TARGET, generate_cuda, generate_replay)


def write_all():
    TARGET.write_text(generate())
    EAGER_TARGET.write_text(generate_eager())
    REPLAY_TARGET.write_text(generate_replay())
    CUDA_TARGET.write_text(generate_cuda())
    ARRAYS_TARGET.write_text(generate_arrays())
    _drop_numba_caches()


def _drop_numba_caches():
    """Delete the package's Numba caches: a cached caller of the generated functions
    (replay_cpu.run...) is keyed on its own file only, so it would keep the old code."""
    pkg = pathlib.Path(__file__).resolve().parents[1]
    for f in list(pkg.rglob("__pycache__/*.nbi")) + list(pkg.rglob("__pycache__/*.nbc")):
        f.unlink(missing_ok=True)


if __name__ == "__main__":
    write_all()
    print(f"wrote {TARGET}, {EAGER_TARGET}, {REPLAY_TARGET}, {CUDA_TARGET} and "
          f"{ARRAYS_TARGET}")
