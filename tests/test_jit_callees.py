"""Numba's disk cache loads a cached function's cached callees first (``_jit._Cache``), so
that its calls bind to the callees' own compiled code, as in the process that compiled it
(its own copies of them ran slower: replay_cpu.run_into 3.85 against 3.55 us)."""
import importlib.util
import textwrap

import numba
import numpy as np

SOURCE = textwrap.dedent('''
    from tapegrad._jit import njit_cached

    @njit_cached
    def leaf(x):
        return x * 2.0

    @njit_cached
    def callee(x):
        return leaf(x) + 1.0

    @njit_cached
    def caller(x):
        s = 0.0
        for v in x:
            s += callee(v)
        return s
''')


def _fresh(path):
    """The module at ``path`` imported anew (new dispatchers, the same cache files)."""
    spec = importlib.util.spec_from_file_location("tapegrad_cache_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_cached_function_loads_its_cached_callees_first(tmp_path, monkeypatch):
    monkeypatch.setattr(numba.core.config, "CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "probe.py"
    path.write_text(SOURCE)
    x = np.arange(4.0)
    first = _fresh(path)
    assert first.caller(x) == 16.0  # compiles leaf, callee and caller, and caches them
    assert first.callee.signatures and first.leaf.signatures
    again = _fresh(path)
    assert again.caller(x) == 16.0  # loaded from the cache
    assert again.caller.stats.cache_hits and not again.caller.stats.cache_misses
    # its callees were loaded from the cache too, theirs first: nothing compiled
    for d in (again.callee, again.leaf):
        assert d.signatures and d.stats.cache_hits and not d.stats.cache_misses, d
    assert again.callee(1.5) == 4.0
