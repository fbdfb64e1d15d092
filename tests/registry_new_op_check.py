"""Run by tests/test_registry.py in a copy of the package with a new op, ``cube``, added by
one register(...) call: every path and the public surface against torch (x ** 3)."""
import os
import pathlib
import warnings

import numpy as np
import torch
import tapegrad as tg
from tapegrad import _generated_eager, functions
from tapegrad.autograd import grad, paths
from tapegrad.ops import BY_NAME

op = BY_NAME["cube"]
assert op.code == len(BY_NAME) - 1, op.code
# the public surface
assert "cube" in functions.__all__ and "cube" in dir(tg)
assert tg.cube is functions.cube and callable(tg.Tensor.cube)
assert tg.cube is _generated_eager.cube  # its 0-d float64 fast path, generated
page = (pathlib.Path(tg.__file__).parent.parent / "docs" / "api.md").read_text()
# its row: public names, create_graph, is_grads_batched, replay, CUDA
row = f"| {op.code} | cube | unary |  | `cube`, method | yes | yes | row | yes |"
assert row in page, page[-800:]

x0 = np.array([0.5, -1.25, 2.0])
tx = torch.tensor(x0, requires_grad=True)
ty = tx ** 3
(tg1,) = torch.autograd.grad(ty.sum(), tx, create_graph=True)
(tg2,) = torch.autograd.grad(tg1.sum(), tx)
want1, want2 = tg1.detach().numpy(), tg2.numpy()

def close(a, b, what):
    a = np.asarray(getattr(a, "_d", a), dtype=np.float64)
    assert np.allclose(a, b, rtol=1e-12, atol=0), (what, a, b)
    print("ok", what)

y = tg.cube(tg.tensor(x0))
close(y, ty.detach().numpy(), "forward")
close(tg.tensor(x0).cube(), ty.detach().numpy(), "Tensor.cube")

def g_of(path, shape_x=x0, method=False):
    x = tg.tensor(shape_x, requires_grad=True)
    with paths.force(path):
        out = (x.cube() if method else tg.cube(x)).sum()
        (g,) = grad(out, (x,))
    assert paths.last() == path, (paths.last(), path)
    return g

for path in ("sweep", "flat", "fused", "checked"):
    close(g_of(path), want1, f"grad [{path}]")
    close(g_of(path, method=True), want1, f"Tensor.cube grad [{path}]")
# large elementwise regions (the general sweep)
big = np.linspace(-2, 2, 100_000)
close(g_of("sweep", big), 3 * big ** 2, "grad [sweep, large]")
close(g_of("fused", big), 3 * big ** 2, "grad [fused, large]")  # its loop: the same rule
# scalar: a tape of 0-d values
for path in ("scalar", "sweep"):
    xs = [tg.tensor(float(v), requires_grad=True) for v in x0]
    with paths.force(path):
        out = sum(tg.cube(v) for v in xs[1:]) + tg.cube(xs[0])
        gs = grad(out, xs)
    assert paths.last() == path, paths.last()
    close(np.array([g.item() for g in gs]), want1, f"scalar grad [{path}]")
# create_graph: second derivative, recorded (rerecord) and compiled recording (record)
x = tg.tensor(x0, requires_grad=True)
with paths.force("rerecord"):
    (g1,) = grad(tg.cube(x).sum(), (x,), create_graph=True)
close(g1, want1, "create_graph first")
(g2,) = grad(g1.sum(), (x,))
close(g2, want2, "create_graph second [rerecord]")
xs = tg.tensor(0.75, requires_grad=True)
with paths.force("record"):
    (g1,) = grad(tg.cube(xs), (xs,), create_graph=True)
(g2,) = grad(g1, (xs,))
close(g2, 6 * 0.75, "create_graph second [record]")
# is_grads_batched
x = tg.tensor(x0, requires_grad=True)
V = np.eye(3)
with paths.force("batched"):
    (gb,) = grad(tg.cube(x), (x,), grad_outputs=(tg.tensor(V),), is_grads_batched=True)
close(gb, V * want1, "is_grads_batched")
# replay: tapegrad.trace, its gradient, batched replay, second order
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    prog = tg.trace(lambda t: tg.cube(t).sum(), x0)
close(prog(x0 + 1.0), ((x0 + 1.0) ** 3).sum(), "replay value")
close(prog.grad(x0), want1, "replay grad")
X = np.stack([x0, x0 * 2.0])
close(prog.grad(X), 3 * X ** 2, "batched replay grad")
close(np.diag(prog.hessian(x0)), want2, "replay hessian")
# a program called on tensors, its gradient through the eager tape
x = tg.tensor(x0, requires_grad=True)
(gp,) = grad(prog(x), (x,))
close(gp, want1, "program entry grad")
if os.environ.get("CHECK_CUDA"):
    cprog = prog.to("cuda")
    close(cprog.grad(X), 3 * X ** 2, "cuda replay grad")
print("ok", tg.__file__)
