"""The fast array paths, the one rule-calling convention and the generated sweeps: each
checked against torch or against the general sweep."""
import numpy as np
import pytest

import tapegrad
import tapegrad.tape
from tapegrad.autograd import paths

torch = pytest.importorskip("torch")


def _two(x):
    return ((x * 2.0).tanh() * x.cos() + x.sqrt()).sum() * 0.5


def test_array_import_is_swept(monkeypatch):
    """A tape that rolled over imports an array from the tape before it (opcode with the
    ARRAY bit): the flat path counted only scalar imports, so it swept past the import and
    gave the gradient of ``sqrt`` alone (and so did a 1e6-element loss by default)."""
    monkeypatch.setattr(tapegrad.tape, "MAX_BYTES", 3200)  # rolls over after x * 2.0 ... mul
    x0 = np.linspace(0.1, 0.9, 100)
    xt = torch.tensor(x0, requires_grad=True)
    (ref,) = torch.autograd.grad(_two(xt), (xt,))
    x = tapegrad.tensor(x0, requires_grad=True)
    y = _two(x)
    assert y._tape.imports, "the loss's tape should import an array"
    (g,) = tapegrad.autograd.grad(y, (x,))
    np.testing.assert_allclose(g.numpy(), ref.numpy(), rtol=1e-13, atol=1e-15)
    with paths.force("flat"), pytest.raises(paths.PathDeclined):
        tapegrad.autograd.grad(_two(x), (x,))


def _rosen(x):
    f = 0.0
    for i in range(x.shape[0] - 1):
        f = f + 100.0 * (x[i + 1] - x[i] ** 2) ** 2 + (1.0 - x[i]) ** 2
    return f


def test_parallel_target_runs_every_block_on_threads_as_the_serial_batch():
    """``run_parallel`` hands blocks to threads (Python over the compiled ``run_block``):
    every block's columns are written, in any order, the same as the serial batch."""
    prog = tapegrad.trace(_rosen, np.zeros(6))
    par = prog.to("parallel")
    par.block = prog.block = 16  # many blocks: 1000 samples in 63 blocks, the last short
    X = np.random.default_rng(3).normal(size=(1000, 6))
    v, g = prog.value_and_grad(X)
    vp, gp = par.value_and_grad(X)
    np.testing.assert_array_equal(vp, v)
    np.testing.assert_array_equal(gp, g)
    np.testing.assert_allclose(g[417], prog.grad(X[417]), rtol=1e-14)
    xt = torch.tensor(X[999], requires_grad=True)
    (ref,) = torch.autograd.grad(_rosen(xt), (xt,))
    np.testing.assert_allclose(gp[999], ref.numpy(), rtol=1e-13)
