"""The code generator and the CPU sweep split into modules: sizes, and the names kept."""
import ast
import pathlib

import pytest

from tapegrad.interpreters import (
    _codegen, _codegen_cpu, _codegen_eager, _codegen_emit, _codegen_replay, cpu, cpu_arrays,
    cpu_fast)

HERE = pathlib.Path(_codegen.__file__).parent
SPLIT = ("_codegen.py", "_codegen_emit.py", "_codegen_cpu.py", "_codegen_eager.py",
         "_codegen_replay.py", "cpu.py", "cpu_arrays.py", "cpu_fast.py", "fused.py")


@pytest.mark.parametrize("name", SPLIT)
def test_module_and_function_sizes(name):
    # issue 16: no hand-written module over about 800 lines, no function over about 100
    text = (HERE / name).read_text()
    assert len(text.splitlines()) < 800, name
    long = [f"{n.name}: {n.end_lineno - n.lineno + 1}" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 100]
    assert not long, (name, long)


def test_cpu_names_are_the_moved_objects():
    # callers reach cpu.sweep, cpu.grad_scalar, ...: the very functions, no wrapper between
    for module in (cpu_arrays, cpu_fast):
        for n in ("sweep", "sweep_batched", "sweep_checked", "array_vjp", "elementwise_rule",
                  "neg_sum_to", "negated_sum_applies", "_SIDES", "MULTI_OUTPUT", "_THUNK",
                  "_gather", "_compact", "sum_to_batched", "grad_scalar", "grad_record",
                  "_mark_scalar", "flat_layout", "SWEEPABLE", "RECORDABLE", "FLAT",
                  "FLAT_MAX", "IMPORT_CODE"):
            if hasattr(module, n):
                assert getattr(cpu, n) is getattr(module, n), n
    assert cpu.sweep is cpu_arrays.sweep and cpu.grad_scalar is cpu_fast.grad_scalar


def test_codegen_names_are_the_moved_objects():
    # _codegen stays the generator's command and the place tests and _program_file import from
    for module, names in ((_codegen_emit, ("rule_exprs", "render", "dispatch", "Target",
                                          "_inputs", "_replay_ops", "REPLAY_BATCH")),
                          (_codegen_cpu, ("generate", "TARGET", "_flat_source",
                                          "render_scatter")),
                          (_codegen_eager, ("generate_eager", "EAGER_TARGET")),
                          (_codegen_replay, ("generate_replay", "generate_cuda",
                                             "REPLAY_TARGET", "CUDA_TARGET"))):
        for n in names:
            assert getattr(_codegen, n) is getattr(module, n), n
    assert {p.parent for p in (_codegen.TARGET, _codegen.REPLAY_TARGET,
                               _codegen.CUDA_TARGET)} == {HERE}
    assert _codegen.EAGER_TARGET == HERE.parent / "_generated_eager.py"
