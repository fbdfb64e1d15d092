"""Reverse steps that write an adjoint (``0.0 + t``) instead of adding to it, when judged the
first to reach it (``program_arrays._first_writers``, ``_first_operands``, ``_mm_first``,
``_rgrp_first``, ``_exp_shift``): a reader they missed lost its gradient. Negative and
mixed-sign strides, an instruction's own operands over the same slots, ``A @ A``. The
NumPy thresholds are forced down so that small programs take those paths; torch is the
oracle (the reviewer's reproducers, review13)."""

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.interpreters import program_arrays as PA

from harness import replay_forms as RF

torch = pytest.importorskip("torch")


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(PA, "NUMPY_RED_MIN", 16)
    monkeypatch.setattr(PA, "NUMPY_BCAST_MIN", 16)
    monkeypatch.setattr(PA, "NUMPY_MM_MIN", 16)


def check(f, x0):
    with RF.array_instructions(4):
        P = tg.trace(lambda x: f(tg, x), x0)
    v, g = P.value_and_grad(x0)
    xt = torch.tensor(x0, requires_grad=True)
    yt = f(torch, xt)
    gt, = torch.autograd.grad(yt, xt)
    assert np.isclose(v, yt.item(), rtol=1e-12)
    np.testing.assert_allclose(g, gt.numpy(), rtol=1e-10, atol=1e-12)
    return P


def test_a_sum_is_no_first_writer_of_terms_a_reversed_gather_reads(small):
    # cat([y, w]) read backwards (stride -1, one instruction: w's slots right after y's)
    # reads y's slots from above: the sum over y wrote y's adjoints over the gather's
    n = 40

    def f(M, x):
        y = M.exp(x)
        w = x * 3.0
        s = M.sum(y)
        c = M.cat([y, w])
        z = c[M.arange(2 * n - 1, -1, -1)] * 2.0
        return s + M.sum(z * z)
    check(f, np.random.default_rng(0).normal(size=n) * 0.1)


def test_a_broadcast_operand_over_the_strided_ones_slots_adds(small):
    # x[:1] - x: the broadcast operand's summed rule adds to x[0]'s adjoint before the
    # strided operand's rule, which wrote over it
    def f(M, x):
        d = x[:1] - x
        return M.sum(d * d)
    check(f, np.random.default_rng(1).normal(size=64))


@pytest.mark.parametrize("h", [lambda M, A: M.matmul(A, A), lambda M, A: M.matmul(A, A.T),
                               lambda M, A: M.matmul(A.T, A)], ids=["AA", "AAT", "ATA"])
def test_a_product_of_a_matrix_with_itself_adds_both_gradients(small, h):
    n = 6

    def f(M, x):
        return M.sum(h(M, x.reshape(n, n)) * 0.5)
    check(f, np.random.default_rng(2).normal(size=n * n))


def test_a_reduction_reading_below_its_first_term_is_a_reader(small):
    # rows of a row-reversed gather (sa > 0, ta < 0) summed: x[N - 1] is read through the
    # span's low end only; ``x - c`` (NumPy reverse) wrote x's adjoints over it
    N, C, R2 = 64, 8, 6

    def f(M, x):
        w = x * 2.0
        c = x[:1] * 1.0
        d = x - c
        Z = M.cat([x, w])
        idx = N - 1 + np.arange(R2)[:, None] * C + (C - 1 - np.arange(C))[None, :]
        G = Z[M.tensor(idx)]
        return M.sum(d * d) + M.sum(G.sum(1) * 3.0)
    check(f, np.random.default_rng(3).normal(size=N))


def test_the_first_writers_still_write_where_nothing_else_reads(small, monkeypatch):
    # lse's shapes keep their fast paths: the analysis declines only what it must
    found = []

    def spy(rows, plan, out, real=PA._first_writers):
        found.append(real(rows, plan, out))
        return found[-1]
    monkeypatch.setattr(PA, "_first_writers", spy)

    def f(M, x):
        m = M.max(x).detach()
        return M.log(M.sum(M.exp(x - m))) + m
    check(f, np.random.default_rng(4).normal(size=64))
    assert found and found[-1]
