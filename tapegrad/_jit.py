"""``njit_cached``: Numba's on-disk cache, keyed on what the compiled code really depends on.

``@njit(cache=True)`` keys a function's cache on its own source file's stamp and bytecode
only. A driver that calls into a generated module (or reads a global array made from the
ops registry) therefore keeps running a cached copy of the old callee after the registry
changes or an in-place upgrade, and a read-only install cannot even import (no cache
locator), and a damaged cache file raises from the first call. ``njit_cached`` is
``njit(cache=True)`` with three differences:

* the cache index key also holds a hash of the *contents* of the function's own file, of
  the package files it reaches through its globals (modules, other compiled functions),
  and of the registry and generated modules, so a changed callee means a recompile;
* with no writable cache location it compiles without caching, after one warning;
* a cache file that cannot be read is dropped and the function recompiled.
"""
from __future__ import annotations

import hashlib
import os
import threading
import types
import warnings

import numba
from numba.core.caching import FunctionCache

_PKG = os.path.dirname(os.path.abspath(__file__))
#: files every compiled function depends on: the registry (global arrays made from it
#: are frozen into compiled code) and the code generated from it
_ALWAYS = ("ops/_registry.py", "ops/__init__.py", "ops/elementwise.py", "ops/arrays.py",
           "ops/traced.py", "interpreters/_generated_cpu.py",
           "interpreters/_generated_replay.py", "interpreters/_generated_cuda.py",
           "interpreters/_generated_arrays.py")

_file_hashes: dict[str, bytes] = {}
_lock = threading.Lock()
_warned: set[str] = set()


class CacheWarning(RuntimeWarning):
    """Numba's on-disk cache cannot be used: code still runs, compiled in each process."""


def _warn_once(kind, message):
    with _lock:
        if kind in _warned:
            return
        _warned.add(kind)
    warnings.warn(message, CacheWarning, stacklevel=3)


def _file_hash(path):
    h = _file_hashes.get(path)
    if h is None:
        try:
            with open(path, "rb") as f:
                h = hashlib.sha256(f.read()).digest()
        except OSError:
            h = b"missing"
        _file_hashes[path] = h
    return h


def _in_package(path):
    return path is not None and os.path.abspath(path).startswith(_PKG + os.sep)


def _names(code):
    """Global names read by ``code`` and the code objects nested in it."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _deps(fn, files, seen):
    """Add to ``files`` the file of Python function ``fn`` and the package files its
    globals reach (modules, compiled and plain functions), transitively."""
    if fn in seen:
        return
    seen.add(fn)
    files.add(fn.__code__.co_filename)
    g = fn.__globals__
    for name in _names(fn.__code__):
        v = g.get(name)
        if isinstance(v, types.ModuleType):
            path = getattr(v, "__file__", None)
            if _in_package(path) and v not in seen:
                seen.add(v)
                files.add(path)
                for w in list(vars(v).values()):  # what the module's functions call
                    f = getattr(w, "py_func", None)
                    if isinstance(f, types.FunctionType) and f.__module__ == v.__name__:
                        _deps(f, files, seen)
        else:
            f = getattr(v, "py_func", v)
            if isinstance(f, types.FunctionType) and _in_package(f.__code__.co_filename):
                _deps(f, files, seen)


def fingerprint(fn):
    """Hash of the source files compiled function ``fn`` depends on (contents, not stamps)."""
    files = {os.path.join(_PKG, p) for p in _ALWAYS}
    _deps(fn, files, set())
    h = hashlib.sha256()
    for path in sorted(files):
        # paths inside the package count relative to it: a moved install keeps its cache
        name = os.path.relpath(path, _PKG) if _in_package(path) else path
        h.update(name.encode() + b"\0" + _file_hash(path))
    return h.hexdigest()


class _Keyed:
    """Mixed into a Numba cache class: the dependency fingerprint in its index key, and a
    damaged cache file treated as a miss."""

    _fp = None

    def _index_key(self, sig, codegen):
        if self._fp is None:
            self._fp = fingerprint(self._py_func)
        return super()._index_key(sig, codegen) + (("tapegrad", self._fp),)

    def _drop_index(self):
        try:
            os.unlink(self._cache_file._index_path)
        except (OSError, AttributeError):
            pass

    def load_overload(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except Exception:  # noqa: BLE001  a damaged index or data file: compile again
            self._drop_index()
            return None

    def save_overload(self, sig, data):
        try:
            super().save_overload(sig, data)
            return
        except Exception:  # noqa: BLE001  e.g. an unreadable index: start it afresh
            self._drop_index()
        try:
            super().save_overload(sig, data)
        except Exception as e:  # noqa: BLE001
            _warn_once("save", f"tapegrad: cannot write Numba's cache for "
                               f"{self._py_func.__qualname__} ({e!r}); compiled code is not "
                               "cached. Set NUMBA_CACHE_DIR to a writable directory.")


class _Cache(_Keyed, FunctionCache):
    """The CPU functions' cache: loading a function loads its callees first (``_callees``)."""

    def load_overload(self, sig, target_context):
        for callee in _callees(self._py_func):
            _load_all(callee)
        return super().load_overload(sig, target_context)


# A function compiled in the process calls its callees' own compiled code: each njit
# callee is compiled (and defined in the JIT) before its caller, whose module holds a copy
# of the callee (linkonce, optimized again with the caller) that the linker then leaves
# unused. Loaded from the disk cache, the caller alone is loaded and its calls bind to those
# copies, which ran slower: replay_cpu.run_into (calling the generated forward and reverse)
# took 3.83 to 3.86 us loaded against 3.58 to 3.67 us compiled (n=100 Rosenbrock, CPU time;
# reverse's copy differs in 257 of its 333 instructions). Loading the callees from the
# cache first binds the caller's calls to them, as in the process that compiled it (3.6 to
# 3.7 us). (A single function, as replay_cpu.run_fused, never differed.)


def _callees(py_func):
    """The ``njit_cached`` CPU functions ``py_func`` calls by a global name."""
    g = py_func.__globals__
    out = []
    for name in sorted(_names(py_func.__code__)):
        d = g.get(name)
        if isinstance(getattr(d, "_cache", None), _Cache) and d.py_func is not py_func:
            out.append(d)
    return out


def _load_all(disp):
    """Load every overload of dispatcher ``disp`` that its cache index holds for this
    process and source (its callees first); compiles nothing. Runs under Numba's compiler
    lock (a caller's ``Dispatcher.compile`` holds it)."""
    from numba.core import sigutils
    cache = disp._cache
    try:
        index = cache._cache_file._load_index()
    except Exception:  # noqa: BLE001  unreadable: the caller's own load decides
        return
    if not index:
        return
    codegen = disp.targetctx.codegen()
    for key in list(index):
        sig = key[0]
        try:
            args, _ = sigutils.normalize_signature(sig)
            if tuple(args) in disp.overloads or cache._index_key(sig, codegen) != key:
                continue  # loaded already, or another machine's or an old source's
            cres = cache.load_overload(sig, disp.targetctx)
        except Exception:  # noqa: BLE001  as Numba's own load: a miss
            continue
        if cres is None or cres.objectmode:
            continue
        disp._cache_hits[sig] += 1  # (as Dispatcher.compile counts a load)
        disp.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
        disp.add_overload(cres)


_NO_LOCATOR = ("tapegrad: no writable location for Numba's cache ({}); compiled code is "
               "not cached and compiles again in each process. Set NUMBA_CACHE_DIR to a "
               "writable directory.")


def enable_cache(disp, cls=_Cache):
    """Give Numba dispatcher ``disp`` the fingerprinted cache ``cls``, or none (one
    warning) when there is no writable place for it."""
    if not hasattr(disp, "_cache") or not hasattr(disp, "py_func"):
        return disp  # NUMBA_DISABLE_JIT or the CUDA simulator: nothing is compiled
    try:
        disp._cache = cls(disp.py_func)
    except RuntimeError as e:  # "cannot cache function ...: no locator available"
        _warn_once("locator", _NO_LOCATOR.format(e))
    return disp


def njit_cached(fn=None, **options):
    """``numba.njit(cache=True, **options)`` with the cache of this module's docstring;
    as ``@njit_cached``, ``@njit_cached(...)`` or ``njit_cached(...)(fn)``."""
    options.pop("cache", None)

    def wrap(f):
        return enable_cache(numba.njit(**options)(f))

    return wrap if fn is None else wrap(fn)


def vectorize_cached(signatures, fn):
    """``numba.vectorize(signatures, cache=True)(fn)``, uncached (one warning) where no
    cache location is writable."""
    try:
        return numba.vectorize(signatures, cache=True)(fn)
    except RuntimeError as e:
        _warn_once("locator", _NO_LOCATOR.format(e))
        return numba.vectorize(signatures)(fn)


def cuda_jit_cached(**options):
    """``numba.cuda.jit(cache=True, **options)`` with the fingerprinted cache (kernels
    call the device functions generated from the registry)."""
    from numba import cuda

    def wrap(f):
        disp = cuda.jit(**options)(f)
        try:
            from numba.cuda.dispatcher import CUDACache
        except ImportError:  # the simulator: nothing is compiled or cached
            return disp
        return enable_cache(disp, type("_CUDACache", (_Keyed, CUDACache), {}))

    return wrap
