"""The registry is the one place an op is declared: its register(...) call carries its public
surface (``tapegrad.<name>``, ``Tensor.<name>``, ``__all__``, the API reference) and every
path a gradient can take; nothing fills an op in from elsewhere."""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import tapegrad as tg
from tapegrad import functions
from tapegrad.ops import ARRAY_OP, BINARY, OPS, UNARY
from tapegrad.ops._registry import register

ROOT = pathlib.Path(__file__).resolve().parent.parent

# --- the public surface before it was derived from the registry (nothing may be lost) -------
TAPEGRAD = set("""
GuardError Program Size Tensor TraceWarning abs absolute acos add amax amin arange arccos
arcsin arctan arctan2 argsort as_tensor asin atan atan2 autograd bool bool_ broadcast_to
cat cdouble cfloat clamp clamp_max clamp_min clip clone complex128 complex64 concat cos
cosh cross diag div divide dot double dtype einsum empty enable_grad equal erf exp expm1
eye flatten float float16 float32 float64 from_numpy full functions half index_add
inference_mode int int16 int32 int64 int8 interpreters is_grad_enabled
is_inference_mode_enabled linalg linspace load log log1p log_softmax logsumexp long
manual_seed matmul max maximum mean min minimum mm mul multiply neg negative nn no_grad
norm ones ones_like ops optim outer permute pow prod rand randn reciprocal relu
repeat_interleave replay reshape rsqrt scipy set_grad_enabled short sigmoid sign sin sinh
softmax softplus sort special sqrt square squeeze stack sub subtract sum t tan tanh tape
tensor trace transpose uint8 unsqueeze where zeros zeros_like
""".split())

ALL = set("""
abs acos add amax amin asin atan atan2 broadcast_to cat clamp clamp_max clamp_min clip
clone concat cos cosh diag div dot erf exp expm1 flatten log log1p log_softmax logsumexp
matmul max maximum mean min minimum mul neg norm outer permute pow prod reciprocal relu
reshape rsqrt sigmoid sign sin sinh softmax softplus sqrt square squeeze stack sub sum t
tan tanh transpose unsqueeze where
""".split())

TENSOR = set("""
T abs abs_ acos add add_ all amax amin any argmax argmin argsort asin atan atan2 backward
bool broadcast_to clamp clamp_ clamp_max clamp_min clip clone contiguous copy_ cos cosh
cpu cross data detach detach_ device diag dim div div_ dot double dtype eq equal erf exp
exp_ expand expand_as expm1 fill_ flatten float ge grad grad_fn gt index_add index_add_
int is_complex is_floating_point is_leaf isfinite isnan item le log log1p log_softmax
logical_not logsumexp long lt mT matmul max maximum mean min minimum mm mul mul_ ndim ne
neg neg_ negative nelement norm numel numpy outer permute pow pow_ prod reciprocal
register_hook register_post_accumulate_grad_hook relu repeat_interleave requires_grad
requires_grad_ reshape reshape_as retain_grad retains_grad rsqrt shape sigmoid sign sin
sinh size softmax softplus sort sqrt sqrt_ square squeeze sub sub_ sum t tan tanh to
tolist transpose type unsqueeze view view_as zero_
""".split())


def test_the_public_surface_keeps_every_name_it_had():
    assert TAPEGRAD <= {n for n in dir(tg) if not n.startswith("_")}
    assert ALL <= set(functions.__all__)
    assert TENSOR <= {n for n in dir(tg.Tensor) if not n.startswith("_")}
    for name in functions.__all__:
        assert getattr(tg, name) is getattr(functions, name), name


def test_each_op_s_public_names_come_from_its_register_call():
    torch = pytest.importorskip("torch")
    declared = set()
    for op in OPS:
        for name in op.api + op.aliases:
            declared.add(name)
            fn = getattr(tg, name)
            assert fn is getattr(functions, name), name
            assert (name in functions.__all__) == (name in op.api), name
            # torch's names: a function of torch (softplus: of torch.nn.functional)
            assert hasattr(torch, name) or hasattr(torch.nn.functional, name), name
            if op.method:
                assert getattr(tg.Tensor, name).__doc__ == fn.__doc__, name
                # (Tensor.softplus is tapegrad's own, kept: torch has F.softplus only)
                assert hasattr(torch.Tensor, name) or name == "softplus", name
    # an alias is the same function as its op's first name
    assert tg.negative is tg.neg and tg.clip is tg.clamp and tg.true_divide is tg.div
    # every name in __all__ is an op's, or one of the few composites
    composites = {n for n, in_all, _ in functions._COMPOSITES if in_all}
    assert set(functions.__all__) == {n for op in OPS for n in op.api} | composites
    assert declared.isdisjoint(composites)


def test_elementwise_methods_compute_as_their_functions():
    x = tg.tensor([0.25, 0.5, 0.75])
    for op in OPS:
        if op.method and op.kind in (UNARY, BINARY) and op.name != "clone":
            for name in op.api + op.aliases:
                args = (x,) if op.kind == UNARY else (x, 0.5)
                want = getattr(tg, name)(*args)
                got = getattr(x, name)(*args[1:])
                assert got.tolist() == want.tolist(), name


def test_register_needs_api_names_for_aliases_and_methods():
    with pytest.raises(ValueError, match=r"api=\(\.\.\.\)"):
        register("not_an_op", UNARY, vjp=lambda F, g, a, out: (g,), aliases=("nao",))
    with pytest.raises(ValueError, match="append its name at the end of OPCODES"):
        register("not_an_op", UNARY, vjp=lambda F, g, a, out: (g,), api=("nao",))
    assert not hasattr(tg, "nao")


def test_every_array_op_declares_its_batch_rule_and_lowering():
    for op in OPS:
        if op.kind == ARRAY_OP:
            # program's lowering is the program itself (traced calls inline it); a custom
            # Function's batch is its user's backward on a batch: none
            assert op.lower is not None or op.name == "program", op
            assert op.batch is not None or op.name == "function", op


# assignments that would fill an op in after its register(...) call: an op's field, or a
# rule backend's function (rules call F.<name>: a registered op or a backend primitive)
_FILLED_ELSEWHERE = re.compile(
    r"^\s*(BY_NAME\[[^\]]*\]|OPS\[[^\]]*\]|_?op)\.(py|np|nb|vjp|batch|lower|const|torch|api|"
    r"aliases|method|via)\s*=|^\s*(NpF|TensorF|SymF|NodeF)\.\w+\s*=", re.M)


def test_no_module_fills_in_an_op_after_registering_it():
    pkg = ROOT / "tapegrad"
    builders = {"ops/_backends.py", "autograd/_tensor_backend.py", "ops/_registry.py"}
    found = []
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg).as_posix()
        if rel in builders or path.name.startswith("_generated_"):
            continue
        found += [f"{rel}: {m.group(0).strip()}"
                  for m in _FILLED_ELSEWHERE.finditer(path.read_text())]
    assert not found, found


# --- a new op, end to end -----------------------------------------------------------------
# Opcodes are append-only and the interpreters are generated files, so the op is added as a
# maintainer would: one register(...) call and its name at the end of OPCODES in a copy of
# the package, then the generators. The checks run with NUMBA_DISABLE_JIT=1 (the generated
# interpreters as Python: every path, no compile); the slow variant compiles them.

CUBE = '''
register("cube", UNARY, py=lambda a: a * a * a, np=lambda a: a * a * a, nb="({a} * {a} * {a})",
         vjp=lambda F, g, a, out: (g * 3.0 * (a * a),), api=("cube",), method=True)
'''

CHECK = (ROOT / "tests" / "registry_new_op_check.py")


def _package_with_cube(tmp_path):
    dst = tmp_path / "pkg"
    shutil.copytree(ROOT / "tapegrad", dst / "tapegrad",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    (dst / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "api.md", dst / "docs" / "api.md")
    ew = dst / "tapegrad" / "ops" / "elementwise.py"
    ew.write_text(ew.read_text() + CUBE)
    reg = dst / "tapegrad" / "ops" / "_registry.py"
    text = reg.read_text()
    end = text.index("\n)", text.index("OPCODES = ("))
    reg.write_text(text[:end] + ' "cube",' + text[end:])
    env = _env(dst)
    for module in ("tapegrad.interpreters._codegen", "tapegrad._apidoc"):
        r = subprocess.run([sys.executable, "-m", module], cwd=str(dst), env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
    return dst


def _env(cwd, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH", "TAPEGRAD_CACHE_DIR")}
    env["TAPEGRAD_CACHE_DIR"] = os.path.join(str(cwd), "kcache")
    env.update(extra)
    return env


def _check(pkg, **env):
    # -c: the copy (the working directory) comes first on sys.path
    r = subprocess.run([sys.executable, "-c", CHECK.read_text()], cwd=str(pkg),
                       env=_env(pkg, **env), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok " + str(pkg / "tapegrad" / "__init__.py") in r.stdout, r.stdout
    return r.stdout


def test_a_registered_op_reaches_every_path_and_the_public_surface(tmp_path):
    pytest.importorskip("torch")
    out = _check(_package_with_cube(tmp_path), NUMBA_DISABLE_JIT="1",
                 NUMBA_ENABLE_CUDASIM="1", CHECK_CUDA="1")
    assert "ok cuda replay grad" in out


@pytest.mark.slow  # compiles the generated interpreters cold (a minute or more)
def test_a_registered_op_reaches_every_compiled_path(tmp_path):
    pytest.importorskip("torch")
    _check(_package_with_cube(tmp_path))


def test_functions_gathers_every_family_function():
    # functions.py's surface looks an op's hand-written function up in its own globals(): a
    # function written in a family module (_fn_*.py) but not imported there would lose,
    # silently, to the default one the surface builds for an elementwise op
    import importlib
    import pathlib
    pkg = pathlib.Path(functions.__file__).parent
    families = sorted(p.stem for p in pkg.glob("_fn_*.py"))
    assert families, pkg
    for name in families:
        mod = importlib.import_module(f"tapegrad.{name}")
        for k, v in vars(mod).items():
            if not k.startswith("_") and callable(v) and v.__module__ == mod.__name__:
                assert getattr(functions, k, None) is v, f"{name}.{k} is not in functions.py"
