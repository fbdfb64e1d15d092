"""The compiled fast path: N optimizer steps on a traced Program inside Numba."""
from __future__ import annotations

import numpy as np

from ._values import _close, _np_dtype_of, _open, _read, _typename

def _program_params(opt, program):
    """The one parameter group's tensors, checked against the program's inputs."""
    from ..replay import Program
    if not isinstance(program, Program):
        raise TypeError(f"run() takes a tapegrad.Program (from tapegrad.trace), got "
                        f"{_typename(program)}")
    if len(opt.param_groups) != 1:
        raise ValueError("run() needs an optimizer with one parameter group (the program's "
                         f"inputs); this one has {len(opt.param_groups)}")
    params = opt.param_groups[0]["params"]
    shapes = program.input_shapes
    got = [tuple(p.shape) for p in params]
    if got != list(shapes) or any(_np_dtype_of(p) != np.float64 for p in params):
        raise ValueError(f"run(): the program was traced with inputs of shapes "
                         f"{[list(s) for s in shapes]} (float64), but the optimizer's "
                         f"parameters have shapes {[list(s) for s in got]}: trace the function "
                         f"with the parameters, in order")
    if program._code.out_slots.shape[0] != 1:
        raise ValueError("run(): the program must return a scalar (the loss)")
    return params


def _flat_of(tensors):
    return np.concatenate([_read(t, np.float64) for t in tensors]) if tensors else \
        np.zeros(0)


def _write_back(tensors, flat):
    i = 0
    for t in tensors:
        f, shared = _open(t)
        n = f.shape[0]
        f[:] = flat[i:i + n]
        _close(t, f, shared)
        i += n


def _run_loop(program, params, steps, call):
    """Run ``call(code, x, k, values_slice)`` (the Numba loop) over the program's variants
    until ``steps`` steps are done; returns (values, x)."""
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"run(): steps must be a non-negative int, got {steps!r}")
    x = _flat_of(params)
    values = np.empty(steps)
    done, vi = 0, 0
    while done < steps:
        code = program._variants[vi]
        k, status = call(code, x, steps - done, values[done:], done)
        done += k
        if status:
            for vj, c in enumerate(program._variants):  # another branch's variant
                from ..interpreters.replay_cpu import run
                if run(c.rows, x, c.out_slots, np.ones(1), c.in_slots, False)[0] == 0:
                    vi = vj
                    break
            else:
                xs = []
                i = 0
                for s in program.input_shapes:
                    n = int(np.prod(s))
                    xs.append(x[i:i + n].reshape(s).copy())
                    i += n
                _write_back(params, x)
                program._no_variant(code, int(status) - 1, xs)  # raises, or re-traces
                vi = len(program._variants) - 1
    return values, x
