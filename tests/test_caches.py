"""Caches and compiled code you can trust (``_jit.py``, the fused kernel cache, opcodes).

The fused kernel cache trusts only a directory of this user's alone and never runs a
damaged kernel file; Numba's caches recompile when what they depend on changes or when a
cache file is damaged; a read-only install works; opcodes never move. The scenarios that
need a cold process run in a subprocess on a copy of the package, so the worktree's own
caches are never touched."""
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tapegrad as tg
from tapegrad import _jit
from tapegrad.interpreters import cpu, fused, optim_loop, replay_cpu
from tapegrad.ops import BY_NAME, OPCODES, OPS, UNARY
from tapegrad.ops import _registry

N = cpu.FLAT_MAX + 1001  # past the flat buffers' limit: the fused path's sizes
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The opcodes as first pinned: tapes, saved programs and compiled code store them.
FROZEN = (
    "leaf", "const", "import_", "neg", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "sigmoid", "relu",
    "erf", "abs", "sign", "square", "reciprocal", "addc", "mulc", "rsubc", "divc", "rdivc",
    "powc", "rpowc", "clamp", "softplus", "add", "sub", "mul", "div", "pow", "atan2",
    "maximum", "minimum", "clamp_min_t", "clamp_max_t", "clone", "reshape", "expand",
    "sum_to", "transpose", "permute", "cast", "stack", "cat", "diag", "getitem",
    "index_scatter", "setitem", "where", "sum", "mean", "prod", "prod_others", "amax",
    "amin", "norm", "logsumexp", "softmax", "log_softmax", "matmul", "outer", "function",
    "function_out", "program", "lt", "le", "gt", "ge", "eq", "ne", "logical_and",
    "logical_or", "logical_xor", "logical_not", "detach", "select", "pick", "guard",
)


# --- opcodes ------------------------------------------------------------------------------

def test_opcodes_only_grow_at_the_end():
    assert OPCODES[:len(FROZEN)] == FROZEN, (
        "an existing opcode moved: new ops go at the END of OPCODES in ops/_registry.py")
    assert len(set(OPCODES)) == len(OPCODES)
    assert [op.code for op in OPS] == list(range(len(OPCODES)))
    assert all(OPS[BY_NAME[n].code].name == n == OPCODES[BY_NAME[n].code] for n in OPCODES)


def test_an_op_missing_from_the_opcode_table_is_refused():
    n_ops = len(OPS)
    with pytest.raises(ValueError, match="append its name at the end of OPCODES"):
        _registry.register("not_in_the_table", UNARY, vjp=lambda F, g, a, out: (g,))
    assert len(OPS) == n_ops and "not_in_the_table" not in BY_NAME


# --- what a compiled driver's cache depends on ---------------------------------------------

@pytest.mark.parametrize("fn, generated", [
    (cpu.grad_scalar, "interpreters/_generated_cpu.py"),
    (replay_cpu.run_into, "interpreters/_generated_replay.py"),
    (optim_loop.adam_loop, "interpreters/_generated_replay.py"),
])
def test_a_driver_cache_key_covers_the_generated_code_it_calls(fn, generated):
    files = set()
    _jit._deps(fn.py_func, files, set())
    pkg = os.path.dirname(os.path.abspath(tg.__file__))
    assert os.path.join(pkg, generated) in files
    assert isinstance(fn._cache, _jit._Cache)
    key = fn._cache._index_key((), type("C", (), {"magic_tuple": lambda self: ()})())
    assert key[-1] == ("tapegrad", _jit.fingerprint(fn.py_func))


# --- the fused kernel cache ---------------------------------------------------------------

def _plan_text(x, f):
    tape, rows = f._tape, f._tape.rows()
    ins = np.array([x._slot])
    need, _, lo, _ = cpu._mark_scalar(rows, ins, f._slot, cpu.FLAT, f._slot)
    return fused.plan_for(tape, rows, need, lo, f._slot + 1, ins).text


def _loss(M, x):
    return (M.sin(x) * x).sum()


def _expected(x0):
    return np.sin(x0) + x0 * np.cos(x0)


@pytest.fixture
def fresh(monkeypatch):
    """The fused path compiling on first sight, with no directory or kernel chosen yet."""
    monkeypatch.setattr(fused, "COMPILE_AFTER", 1)
    monkeypatch.setattr(fused, "_dir", None)
    monkeypatch.setattr(fused, "_kernels", {})
    monkeypatch.setattr(fused, "_seen", {})
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m.startswith(fused.MODULE_PREFIX)]:
        monkeypatch.delitem(sys.modules, name)
    return monkeypatch


def _grad():
    x0 = np.linspace(-1.0, 1.0, N)
    x = tg.tensor(x0, dtype=tg.float64, requires_grad=True)
    (g,) = tg.autograd.grad(_loss(tg, x), (x,))
    return x0, x, np.asarray(g.detach().numpy())


def _kernel_name(tmp_text):
    return fused.MODULE_PREFIX + hashlib.sha1(tmp_text.encode()).hexdigest()[:20]


@pytest.mark.parametrize("setup", ["world-writable", "another user's", "shared parent"])
def test_a_kernel_planted_in_a_directory_others_can_write_is_never_run(fresh, tmp_path,
                                                                       setup):
    x0 = np.linspace(-1.0, 1.0, N)
    x = tg.tensor(x0, dtype=tg.float64, requires_grad=True)
    src = _plan_text(x, _loss(tg, x))
    base = tmp_path / "cache"
    d = base / "fused"
    d.mkdir(parents=True)
    marker = tmp_path / "planted-ran"
    planted = textwrap.dedent(f"""
        open({str(marker)!r}, "w").close()
        def fused(V, G, T, P, C, adj, R):
            G[0][:] = 42.0
            return 0
        """)
    (d / (_kernel_name(src) + ".py")).write_text(planted)
    tmp = tmp_path / "tmp"  # the old fallback: a fixed name in the temporary directory
    (tmp / f"tapegrad-fused-{os.getuid()}").mkdir(parents=True)
    (tmp / f"tapegrad-fused-{os.getuid()}" / (_kernel_name(src) + ".py")).write_text(planted)
    fresh.setattr("tempfile.tempdir", str(tmp))
    if setup == "world-writable":
        os.chmod(d, 0o777)
    elif setup == "another user's":
        if os.geteuid() != 0:
            pytest.skip("making a directory another user's needs root")
        os.chown(d, 12345, 12345)
    else:
        os.chmod(base, 0o777)  # not sticky: another user can swap our directory
    fresh.setenv("TAPEGRAD_CACHE_DIR", str(base))
    with pytest.warns(_jit.CacheWarning, match="writable by others"):
        _, _, g = _grad()
    assert not marker.exists()
    np.testing.assert_allclose(g, _expected(x0), rtol=1e-12, atol=1e-12)
    assert fused.cache_dir() is None and not fused._kernels


def test_a_directory_of_this_users_alone_is_used(fresh, tmp_path):
    fresh.setenv("TAPEGRAD_CACHE_DIR", str(tmp_path / "cache"))
    x0, _, g = _grad()
    np.testing.assert_allclose(g, _expected(x0), rtol=1e-12, atol=1e-12)
    d = fused.cache_dir()
    assert d == str(tmp_path / "cache" / "fused") and fused._kernels
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


@pytest.mark.parametrize("damage", ["cut at a line", "garbage"])
def test_a_damaged_kernel_file_is_written_again_and_gradients_stay_right(fresh, tmp_path,
                                                                        damage):
    x0 = np.linspace(-1.0, 1.0, N)
    x = tg.tensor(x0, dtype=tg.float64, requires_grad=True)
    src = _plan_text(x, _loss(tg, x))
    d = tmp_path / "cache" / "fused"
    d.mkdir(parents=True, mode=0o700)
    path = d / (_kernel_name(src) + ".py")
    if damage == "cut at a line":  # still valid Python: drops the loop's last statements
        bad = "".join(src.splitlines(True)[:-3])
        compile(bad, str(path), "exec")
    else:
        bad = "def fused(V, G, T, P, C, adj, R:\n    \x00garbage"
    path.write_text(bad)
    fresh.setenv("TAPEGRAD_CACHE_DIR", str(tmp_path / "cache"))
    sys.modules.pop(_kernel_name(src), None)
    _, _, g = _grad()
    np.testing.assert_allclose(g, _expected(x0), rtol=1e-12, atol=1e-12)
    assert fused._kernels, "the fused path did not run"
    assert path.read_text() == src


# --- cold processes on a copy of the package ------------------------------------------------

GRAD = textwrap.dedent("""
    import warnings
    warnings.simplefilter("default")
    import math, tapegrad as tg
    x = tg.tensor(0.7, requires_grad=True)
    y = tg.exp(x) * x + tg.sin(x * x)
    (g,) = tg.autograd.grad(y, (x,))
    want = math.exp(0.7) * 1.7 + math.cos(0.49) * 1.4
    assert abs(g.item() - want) < 1e-12, (g.item(), want)
    print("ok", tg.__file__)
    """)


def _copy_package(tmp_path):
    dst = tmp_path / "pkg"
    shutil.copytree(os.path.join(ROOT, "tapegrad"), dst / "tapegrad",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    return dst


def _run(code, cwd, env_extra=None, prefix=()):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH")}
    env.update(env_extra or {})
    r = subprocess.run([*prefix, sys.executable, "-c", code], cwd=str(cwd), env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok " + os.path.join(str(cwd), "tapegrad", "__init__.py") in r.stdout
    return r


def _numba_cache_files(pkg):
    return [os.path.join(dp, f) for dp, _, fs in os.walk(pkg) for f in fs
            if f.endswith((".nbi", ".nbc"))]


def test_a_damaged_numba_cache_is_compiled_again(tmp_path):
    pkg = _copy_package(tmp_path)
    _run(GRAD, pkg)
    files = _numba_cache_files(pkg / "tapegrad")
    # index and data files of the first compiled functions, each way (damaging them all
    # would only make the test slower: every function recompiles alike)
    hit = [f for f in sorted(files) if os.path.basename(f).startswith(
        ("tape._decode_rows-", "cpu.grad_scalar-"))]
    assert {f[-3:] for f in hit} == {"nbi", "nbc"}
    for i, f in enumerate(hit):
        with open(f, "r+b") as fh:
            if i % 2:  # cut short
                fh.truncate(max(os.path.getsize(f) // 2, 1))
            else:  # garbage (not even valid UTF-8 for pickle's strings)
                fh.write(b"\x80\x04\x95garbage\xff\xfe" * 8)
    r = _run(GRAD, pkg)
    assert "Error" not in r.stderr


@pytest.mark.slow  # three cold processes, 10-25 s (test_a_driver_cache_key_... runs by default)
def test_drivers_compile_again_when_the_generated_code_changes(tmp_path):
    """An op inserted in the middle of its family (as a user's in-place upgrade might
    bring): the cached drivers must not keep the old generated sweep."""
    pkg = _copy_package(tmp_path)
    _run(GRAD, pkg)
    ew = pkg / "tapegrad" / "ops" / "elementwise.py"
    text = ew.read_text()
    anchor = 'register("log", U,'
    assert anchor in text
    ew.write_text(text.replace(anchor, textwrap.dedent('''\
        register("exp2", U, py=lambda a: 2.0 ** a, np=np.exp2, nb="(2.0 ** {a})",
                 torch="exp2", vjp=lambda F, g, a, out: (g * out * 0.6931471805599453,))
        ''') + anchor, 1))
    reg = pkg / "tapegrad" / "ops" / "_registry.py"
    rtext = reg.read_text()
    if "OPCODES" in rtext:  # its opcode goes at the end of the table
        start = rtext.index("OPCODES = (")
        end = rtext.index("\n)", start)
        reg.write_text(rtext[:end] + ' "exp2",' + rtext[end:])
    r = subprocess.run([sys.executable, "-m", "tapegrad.interpreters._codegen"], cwd=str(pkg),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    _run(GRAD + textwrap.dedent("""
        from tapegrad import _generated_eager as E
        from tapegrad.ops import BY_NAME
        x = tg.tensor(1.5, requires_grad=True)
        y = E.exp2(x) * x
        (g,) = tg.autograd.grad(y, (x,))
        want = 2.0 ** 1.5 * (1.0 + 1.5 * math.log(2.0))
        assert abs(g.item() - want) < 1e-12, (g.item(), want)
        assert BY_NAME["exp2"].code == len(BY_NAME) - 1 and BY_NAME["log"].code == 5
        print("ok", tg.__file__)
        """), pkg)


def _unprivileged():
    """A command prefix running as ``nobody`` that may read everything and write nothing it
    does not own (root ignores permissions), or None."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return None
    prefix = (setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups",
              "--inh-caps", "+dac_read_search", "--ambient-caps", "+dac_read_search")
    try:
        r = subprocess.run([*prefix, sys.executable, "-c", "import numba, os; print(os.getuid())"],
                           capture_output=True, text=True, timeout=120)
    except OSError:
        return None
    return prefix if r.returncode == 0 and r.stdout.strip() == "65534" else None


def test_a_read_only_install_imports_and_computes_with_one_warning(tmp_path):
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    pkg = _copy_package(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    for dp, dns, fs in os.walk(tmp_path):
        for n in dns + fs:
            p = os.path.join(dp, n)
            os.chmod(p, os.stat(p).st_mode & ~0o222)
    os.chmod(tmp_path, 0o555)
    try:
        r = _run(GRAD + "print(tg.erf(tg.tensor([0.0, 1.0])).sum().item())\n", pkg,
                 {"HOME": str(home), "XDG_CACHE_HOME": ""}, prefix)
    finally:
        os.chmod(tmp_path, 0o755)
    assert r.stderr.count("CacheWarning") == 1, r.stderr
    assert "no writable location for Numba's cache" in r.stderr
