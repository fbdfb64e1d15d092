"""Write docs/api.md, the API reference, from the ops registry: ``python -m tapegrad._apidoc``
(tests/test_docs.py checks that the committed page is fresh)."""
import pathlib
import sys

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"

HEAD = """\
# API reference

tapegrad mirrors `torch` and `torch.autograd`: the names, arguments and exceptions are
torch's, so torch's documentation is the reference for what a function computes. This page
lists what tapegrad has and how far each op goes. What differs from torch is in
[Home](index.md#where-it-differs).

## Modules

- `tapegrad`: tensors (`tensor`, `zeros`, `ones`, `arange`, `linspace`, `eye`, `rand`,
  `randn`, `from_numpy`, ...), the functions in the table below, dtypes (`float64` is the
  default), `no_grad`, `enable_grad`, `set_grad_enabled`, `inference_mode`,
  `trace` and `load` (traced programs, see [Fast optimization loops](fast-loops.md)),
  `GuardError`, `TraceWarning`, `set_num_threads` and `get_num_threads` (torch's: the
  threads an eager pass over 131,072 numbers or more is split over, by default the cores
  this process may use, at most 8; the result has the same bits on any number of
  threads, see [GradBench](gradbench.md)).
- `tapegrad.autograd`: `grad`, `backward`, `Function`, `once_differentiable`,
  `gradcheck`, `gradgradcheck`, `detect_anomaly`, `set_detect_anomaly`, `graph`, and
  `tapegrad.autograd.functional` (`jacobian`, `hessian`, `vjp`, `jvp`, `hvp`, `vhp`);
  see [Higher-order derivatives](higher-order.md).
- `tapegrad.optim`: `SGD`, `Adam`, `LBFGS`, and `run(program, steps)` inside Numba.
- `tapegrad.scipy`: `objective` and `minimize` for `scipy.optimize`.
- `Program` (from `tapegrad.trace`): `__call__`, `value_and_grad`, `grad`, `buffer` (a
  call bound once to arrays you own, see [Fast optimization loops](fast-loops.md)), `hvp`,
  `grad_and_hvp` (value, gradient and H v of one run),
  `hessian`, `jacobian`, `vjp`, `grad_program`, `to(target)`, `save`;
  targets `"cpu"`, `"parallel"` and `"cuda"` (see [The CUDA target](cuda.md)).
- `python -m tapegrad.bench`: the benchmarks (`--help`).

## Ops

Every entry a tape records is one of these registered ops (`tapegrad.ops.OPS`, in opcode
order). The columns:

- **torch**: the torch function the op mirrors, or what records it.
- **tapegrad**: its public functions, `tapegrad.<name>` (and `Tensor.<name>` where marked
  "method"); NumPy's spellings in parentheses (not in `__all__`).
- **create_graph**: its derivative rule is written in differentiable ops, so
  `grad(..., create_graph=True)` through it gives a gradient that can be differentiated
  again; "no gradient" for comparisons and logic, whose results are constant.
- **is_grads_batched**: `grad(..., is_grads_batched=True)` sweeps a batch of cotangents
  through it in one pass.
- **replay**: `tapegrad.trace` turns it into the scalar rows of a program ("row": one row
  per element; "lowered": into elementwise rows), so it runs in compiled replay,
  batched and on `target="parallel"`.
- **CUDA**: the program's rows run in the `target="cuda"` kernels.

"""

TAIL = """
This table is generated from the registry by `python -m tapegrad._apidoc`; a test fails when
it is stale. To add an op, see [Design](design.md).
"""


def _rows():
    from tapegrad.ops import ARRAY_OP, BINARY, COMPARE, OPS, REPLAY, SPECIAL, UNARY, UNARY_C
    from tapegrad.interpreters import _generated_cuda

    cuda_src = pathlib.Path(_generated_cuda.__file__).read_text()
    elementwise = (UNARY, UNARY_C, BINARY)
    for op in OPS:
        if op.torch is not None:
            torch_name = f"`torch.{op.torch}`"
            if op.via:
                torch_name += ", " + op.via
        else:
            torch_name = op.via  # what records it (its register(..., via=...))
        if op.kind is COMPARE or op.name in ("detach", "guard"):
            create_graph = batched = "no gradient"
        elif op.kind is SPECIAL and op.name != "import_":
            create_graph = batched = "-"
        else:
            create_graph = "yes" if op.vjp is not None else "no"
            if op.kind is REPLAY:  # in traced programs only, never on an eager tape
                batched = "-"
            else:
                batched = "yes" if op.kind in elementwise or op.kind is SPECIAL \
                    or (op.kind is ARRAY_OP and op.batch is not None) else "no"
        if op.name == "import_":  # tape bookkeeping: a traced program has one tape
            replay = cuda = "-"
        elif op.kind in elementwise or op.kind in (COMPARE, REPLAY) or op.name in ("leaf", "const"):
            replay, cuda = "row", ("yes" if _in_cuda(op, cuda_src) else "no")
        elif op.lower is not None and not op.lower.__qualname__.startswith("unsupported."):
            replay, cuda = "lowered", "yes"  # into elementwise rows, which every target runs
        else:
            replay = cuda = "no"
        yield (op.code, op.name, op.kind, torch_name, _public(op), create_graph, batched, replay,
               cuda)


def _public(op):
    """The op's public names, from its register(..., api=, aliases=, method=) call."""
    names = ", ".join(f"`{n}`" for n in op.api)
    if op.aliases:
        names += " (" + ", ".join(f"`{n}`" for n in op.aliases) + ")"
    return names + (", method" if op.method else "")


def _in_cuda(op, src):
    if op.name in ("leaf", "const", "guard"):
        return f"{op.name.upper()} = {op.code}" in src
    return f"op == {op.code}:  # {op.name}" in src


def render():
    """The page's text."""
    header = ("opcode", "op", "kind", "torch", "tapegrad", "create_graph", "is_grads_batched",
              "replay", "CUDA")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in _rows():
        # a | inside a cell would end it, code span or not
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return HEAD + "\n".join(lines) + "\n" + TAIL


def main(argv=None):
    text = render()
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
