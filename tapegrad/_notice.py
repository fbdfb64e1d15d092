"""One line on stderr before a compile that takes seconds: Numba has nothing cached on disk for
an interpreter that is about to run for the first time. ``TAPEGRAD_QUIET=1`` silences it."""
import importlib
import os
import sys

# what a first call compiles, the dispatchers whose cache tells whether it will, and the
# compile time on a 2-core machine with a cold cache (measured: docs/getting-started.md)
_WHAT = {
    "gradient": ("the reverse sweep for the first gradient", 5,
                 [("tapegrad.interpreters.cpu", "grad_scalar"),
                  ("tapegrad.interpreters.cpu", "_mark_into"),
                  ("tapegrad.interpreters._generated_cpu", "sweep"),
                  ("tapegrad.tape", "_decode_rows")]),
    "replay": ("the replay interpreter of traced programs", 5,
               [("tapegrad.interpreters.replay_cpu", "run_into"),
                ("tapegrad.interpreters._generated_replay", "run_into_common")]),
    # (a program's superinstructions, after fuse.TIER one-sample calls of it)
    "fused": ("the replay interpreter's superinstructions, for a program called many times",
              2, [("tapegrad.interpreters.replay_cpu", "run_fused"),
                  ("tapegrad.interpreters._generated_replay", "run_fused_common")]),
    # (small inputs passed to the compiled entry, at the first call after the tier-up)
    "args": ("the replay entry of small inputs, for a program called many times", 1,
             [("tapegrad.interpreters.replay_cpu", "run_args"),
              ("tapegrad.interpreters.replay_cpu", "run_args_common"),
              ("tapegrad.interpreters.replay_cpu", "run_args_fused"),
              ("tapegrad.interpreters.replay_cpu", "run_args_fused_common")]),
    "arrays": ("the replay interpreter of traced array programs", 5,
               [("tapegrad.interpreters._generated_arrays", "forward"),
                ("tapegrad.interpreters._generated_arrays", "reverse")]),
    "batch": ("the batched replay interpreter", 5,
              [("tapegrad.interpreters._generated_replay", "run_block"),
               ("tapegrad.interpreters._generated_replay", "run_block_common")]),
    "parallel": ("the parallel replay interpreter (target='parallel')", 5,
                 [("tapegrad.interpreters._generated_replay", "run_block"),
                  ("tapegrad.interpreters._generated_replay", "run_block_common")]),
    "jacobian": ("the Jacobian interpreter of traced programs", 10,
                 [("tapegrad.interpreters.replay_cpu", "vjp_multi")]),
    "jacobian_batch": ("the batched Jacobian interpreter", 10,
                       [("tapegrad.interpreters.replay_cpu", "jacobian_batch")]),
    "kernels": ("the passes for large broadcast arrays", 2,
                [("tapegrad.ops._kernels", "_rows_op"), ("tapegrad.ops._kernels", "_sum_middle")]),
}

#: the notices this process may still give; callers test membership before calling
#: ``announce`` (a set lookup on hot paths), which removes the key
PENDING = set(_WHAT)


def _cached(dispatcher):
    """Whether Numba will load ``dispatcher`` rather than compile it: compiled in this process,
    or a fresh index on disk (numba drops an index whose source file has changed). None when
    it cannot tell (no cache, or not a Numba dispatcher)."""
    if getattr(dispatcher, "signatures", None):
        return True
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if cache_file is None:
        return None
    try:
        return bool(cache_file._load_index())
    except Exception:  # an unreadable index: numba will recompile, and says nothing either
        return None


def will_compile(key):
    """Whether the first use of ``key`` compiles: none of its dispatchers is cached (one that
    is means this path ran before; a path that differs a little compiles less, and quietly:
    the notice must never fire on a warm cache). False when it cannot tell."""
    return all(_cached(getattr(importlib.import_module(mod), name)) is False
               for mod, name in _WHAT[key][2])


def announce(key, stream=None):
    """Say on stderr, once per process, that ``key`` compiles now, when its cache is cold."""
    if key not in PENDING:
        return
    PENDING.discard(key)
    if os.environ.get("TAPEGRAD_QUIET", "") not in ("", "0"):
        return
    what, seconds, _ = _WHAT[key]
    if will_compile(key):
        print(f"tapegrad: compiling {what}, once: about {seconds} s on 2 cores; cached on disk "
              f"afterwards (TAPEGRAD_QUIET=1 hides this line)",
              file=stream or sys.stderr, flush=True)
