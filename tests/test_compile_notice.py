"""The one-line notice before a compile that takes seconds (cold Numba cache): given when the
cache is cold, never when it is warm or the function is compiled, silenced by TAPEGRAD_QUIET."""
import importlib
import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _notice


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A module with one cached njit function, and a notice key pointing at it."""
    (tmp_path / "tiny_jit_mod.py").write_text(textwrap.dedent("""
        from numba import njit

        @njit(cache=True)
        def twice(x):
            return 2.0 * x
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TAPEGRAD_QUIET", raising=False)
    mod = importlib.import_module("tiny_jit_mod")
    monkeypatch.setitem(_notice._WHAT, "tiny", ("the tiny function", 3,
                                                 [("tiny_jit_mod", "twice")]))
    yield mod
    sys.modules.pop("tiny_jit_mod", None)
    _notice.PENDING.discard("tiny")


def said(key):
    _notice.PENDING.add(key)
    out = io.StringIO()
    _notice.announce(key, stream=out)
    return out.getvalue()


def test_a_cold_cache_gets_one_line_then_none(tiny):
    assert _notice.will_compile("tiny")
    line = said("tiny")
    assert line == ("tapegrad: compiling the tiny function, once: about 3 s on 2 cores; "
                    "cached on disk afterwards (TAPEGRAD_QUIET=1 hides this line)\n")
    assert "tiny" not in _notice.PENDING  # once per process
    out = io.StringIO()
    _notice.announce("tiny", stream=out)
    assert out.getvalue() == ""
    tiny.twice(1.0)
    assert not _notice.will_compile("tiny")  # compiled here
    assert said("tiny") == ""


def test_a_warm_cache_on_disk_gets_no_line(tiny, tmp_path):
    # another process compiles and caches; a fresh dispatcher here then loads, silently
    subprocess.run([sys.executable, "-c", "import tiny_jit_mod; tiny_jit_mod.twice(1.0)"],
                   cwd=tmp_path, check=True, timeout=120,
                   env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert not tiny.twice.signatures
    assert not _notice.will_compile("tiny")
    assert said("tiny") == ""
    # a changed source makes numba's index stale: the compile happens again, and is said
    src = tmp_path / "tiny_jit_mod.py"
    src.write_text(src.read_text() + "\n")
    os.utime(src, (1e9, 1e9))
    sys.modules.pop("tiny_jit_mod")
    importlib.import_module("tiny_jit_mod")
    assert _notice.will_compile("tiny")


def test_tapegrad_quiet_silences_it(tiny, monkeypatch):
    monkeypatch.setenv("TAPEGRAD_QUIET", "1")
    assert said("tiny") == ""


def test_the_real_entry_points_are_silent_once_compiled(capsys, monkeypatch):
    monkeypatch.delenv("TAPEGRAD_QUIET", raising=False)
    x = tg.tensor([1.0, 2.0], requires_grad=True)
    (x * x).sum().backward()
    prog = tg.trace(lambda x: (x * x).sum(), np.zeros(2))
    prog.value_and_grad(np.ones(2))
    prog.value_and_grad(np.ones((3, 2)))
    prog.jacobian(np.ones(2))
    capsys.readouterr()
    for key in ("gradient", "replay", "batch", "jacobian"):
        monkeypatch.setattr(_notice, "PENDING", set(_notice._WHAT))
        assert not _notice.will_compile(key), key
    (x * x).sum().backward()
    prog.value_and_grad(np.ones(2))
    prog.value_and_grad(np.ones((3, 2)))
    prog.jacobian(np.ones(2))
    assert capsys.readouterr().err == ""
    for mod, name in [d for _, _, ds in _notice._WHAT.values() for d in ds]:
        assert hasattr(importlib.import_module(mod), name)  # every dispatcher named exists


@pytest.mark.slow
def test_a_cold_first_gradient_says_so_in_a_fresh_process(tmp_path):
    code = ("import numpy as np, tapegrad as tg; x = tg.tensor([1.0, 2.0], requires_grad=True); "
            "(x * x).sum().backward(); print(x.grad.tolist()); "
            "p = tg.trace(lambda x: (x * x).sum(), np.zeros(2)); p.value_and_grad(np.ones(2))")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("TAPEGRAD_QUIET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cold = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=root, timeout=600)
    assert cold.stdout.strip() == "[2.0, 4.0]"
    assert cold.stderr.count("tapegrad: compiling the reverse sweep") == 1, cold.stderr
    # value_and_grad of one input takes a fast path of its own: it says so too
    assert cold.stderr.count("tapegrad: compiling the replay interpreter") == 1, cold.stderr
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=root, timeout=600)
    assert "compiling" not in warm.stderr, warm.stderr
