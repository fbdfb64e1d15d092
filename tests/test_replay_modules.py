"""replay.py's split (issue 16 item 4): the import paths and class identities others rely on."""
import ast
import pathlib
import pickle

import numpy as np

import tapegrad
from tapegrad import replay

PKG = pathlib.Path(tapegrad.__file__).parent
MODULES = ("replay.py", "_trace.py", "_program_code.py", "_program_run.py",
           "_program_derivs.py")


def test_names_others_import_from_replay_are_there():
    # ops/arrays.py, bench/, _program_file.py, tests and users import these from replay
    for name in ("Program", "GuardError", "TraceWarning", "trace", "load", "program_vjp",
                 "_hvp_code", "cuda_module", "FORMAT", "FORMAT_VERSION", "BLOCK_BYTES",
                 "_Code", "_trace_code", "_Trace", "_host", "_is_device"):
        assert hasattr(replay, name), name
    for cls in (replay.Program, replay.GuardError, replay.TraceWarning):
        assert cls.__module__ == "tapegrad.replay"
        assert getattr(tapegrad, cls.__name__) is cls


def test_a_program_pickles_as_replay_program():
    prog = tapegrad.trace(tapegrad.sin, np.ones(2))
    again = pickle.loads(pickle.dumps(prog))
    assert type(again) is replay.Program
    np.testing.assert_array_equal(again(np.arange(2.0)), np.sin(np.arange(2.0)))


def test_modules_and_functions_stay_small():
    for name in MODULES:
        src = (PKG / name).read_text()
        assert src.count("\n") < 800, name
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno < 100, (name, node.name)
