"""The CUDA target (``target="cuda"``): kernels against the CPU target, device arrays in and
out, guards, batched gradients through program entries, and the set-up errors.

In CI these run in numba's CUDA simulator (tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1),
which runs each thread as Python: batches stay small. ``NUMBA_ENABLE_CUDASIM=0 pytest
tests/test_cuda.py`` runs them on a real GPU, with the hardware-only tests as well.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("numba_cuda", reason="the CUDA target needs pip install 'tapegrad[cuda]'")

from numba import config, cuda  # noqa: E402

import tapegrad as tg  # noqa: E402

SIM = bool(config.ENABLE_CUDASIM)
if not SIM and not cuda.is_available():
    pytest.skip("no GPU here, and the CUDA simulator is off", allow_module_level=True)
hardware = pytest.mark.skipif(SIM, reason="needs a real GPU (timing, device memory)")

RTOL = 1e-12


@pytest.fixture(autouse=True, scope="module")
def small_blocks_in_the_simulator():
    # the simulator runs every thread of a block as a Python thread, idle ones included: 4
    # threads a block (not 128) keeps a batch of 9 at 12 threads, and spreads it over blocks
    if not SIM:
        yield
        return
    from tapegrad.interpreters import replay_cuda
    mp = pytest.MonkeyPatch()
    mp.setattr(replay_cuda, "THREADS", 4)
    yield
    mp.undo()


def rosen(x):
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()


def net(w, x):
    h = (w @ x).tanh()
    return tg.softmax(h, 0) @ tg.where(h > 0.0, h * h, -h) + tg.logsumexp(h, 0)


def rng_batch(seed, *shape):
    return np.random.default_rng(seed).normal(size=shape) * 0.5


def close(a, b, rtol=RTOL):
    a = a.copy_to_host() if hasattr(a, "copy_to_host") else a
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=rtol, atol=1e-13)


@pytest.fixture(scope="module")
def rosen_progs():
    cpu = tg.trace(rosen, np.zeros(6))
    return cpu, cpu.to("cuda")


@pytest.fixture(scope="module")
def net_progs():
    cpu = tg.trace(net, np.zeros((3, 4)), np.zeros(4))
    return cpu, cpu.to("cuda")


def test_value_and_grad_over_a_batch_equals_cpu(rosen_progs):
    cpu, gpu = rosen_progs
    X = rng_batch(0, 9, 6)
    v, g = gpu.value_and_grad(X)
    vc, gc = cpu.value_and_grad(X)
    assert isinstance(v, np.ndarray) and v.shape == (9,) and g.shape == (9, 6)
    close(v, vc)
    close(g, gc)
    close(gpu.grad(X), gc)
    close(gpu(X), vc)


def test_one_sample_runs_as_a_batch_of_one(rosen_progs):
    cpu, gpu = rosen_progs
    x = rng_batch(1, 6)
    v, g = gpu.value_and_grad(x)
    vc, gc = cpu.value_and_grad(x)
    assert np.ndim(v) == 0 and g.shape == (6,)
    close(v, vc)
    close(g, gc)


def test_array_ops_and_several_inputs_equal_cpu(net_progs):
    cpu, gpu = net_progs
    W, X = rng_batch(2, 5, 3, 4), rng_batch(3, 5, 4)
    (v, (gw, gx)), (vc, (gwc, gxc)) = gpu.value_and_grad(W, X), cpu.value_and_grad(W, X)
    close(v, vc)
    close(gw, gwc)
    close(gx, gxc)


def test_hvp_jacobian_and_hessian_over_a_batch(rosen_progs, net_progs):
    cpu, gpu = rosen_progs
    X, V = rng_batch(4, 5, 6), rng_batch(5, 5, 6)
    (v, hv), (vc, hvc) = gpu.hvp(X, V), cpu.hvp(X, V)
    close(v, vc)
    close(hv, hvc)
    H = gpu.hessian(X)
    assert H.shape == (5, 6, 6)
    close(H, cpu.hessian(X))
    close(H[2], cpu.hessian(X[2]))  # the batched Jacobian is each sample's
    close(gpu.hessian(X[0]), cpu.hessian(X[0]))
    # several inputs: a tuple of blocks per input, each with the batch axis
    ncpu, ngpu = net_progs
    W, Xn = rng_batch(6, 3, 3, 4), rng_batch(7, 3, 4)
    gp_cpu, gp_gpu = ncpu.grad_program(), ngpu.grad_program()
    for a, b in zip(gp_gpu.jacobian(W, Xn), gp_cpu.jacobian(W, Xn)):
        for blk, blkc in zip(a, b):
            assert blk.shape == blkc.shape and blk.shape[0] == 3
            close(blk, blkc)


def test_vjp_with_a_batch_of_cotangents():
    cpu = tg.trace(lambda x: (x.sin() * 2.0, (x * x).sum()), np.zeros(4))
    gpu = cpu.to("cuda")
    X = rng_batch(8, 6, 4)
    V = (rng_batch(9, 6, 4), rng_batch(10, 6))
    (outs, g), (outs_c, gc) = gpu.vjp(X, V), cpu.vjp(X, V)
    close(outs[0], outs_c[0])
    close(outs[1], outs_c[1])
    close(g, gc)


def test_float32_programs_match_the_cpu_within_float32():
    cpu = tg.trace(rosen, np.zeros(6, np.float32))
    gpu = cpu.to("cuda")
    X = rng_batch(11, 7, 6).astype(np.float32)
    (v, g), (vc, gc) = gpu.value_and_grad(X), cpu.value_and_grad(X)
    assert v.dtype == np.float32 and g.dtype == np.float32
    close(v, vc, rtol=1e-6)
    close(g, gc, rtol=1e-6)


def test_device_arrays_in_and_out(rosen_progs, net_progs):
    cpu, gpu = rosen_progs
    X = rng_batch(12, 8, 6)
    Xd = cuda.to_device(X)
    v, g = gpu.value_and_grad(Xd)
    assert hasattr(v, "copy_to_host") and hasattr(g, "copy_to_host")  # stayed on the GPU
    assert v.shape == (8,) and g.shape == (8, 6)
    vc, gc = cpu.value_and_grad(X)
    close(v, vc)
    close(g, gc)
    (_, hv) = gpu.hvp(Xd, cuda.to_device(np.ones_like(X)))
    close(hv, cpu.hvp(X, np.ones_like(X))[1])
    H = gpu.hessian(Xd)
    assert hasattr(H, "copy_to_host") and H.shape == (8, 6, 6)
    close(H, cpu.hessian(X))
    # one device input, one host input; float32 on the device
    ncpu, ngpu = net_progs
    W, Xn = rng_batch(13, 4, 3, 4), rng_batch(14, 4, 4)
    v, (gw, gx) = ngpu.value_and_grad(cuda.to_device(W), Xn)
    vc, (gwc, gxc) = ncpu.value_and_grad(W, Xn)
    close(v, vc)
    close(gw, gwc)
    close(gx, gxc)
    p32 = tg.trace(rosen, np.zeros(6, np.float32), target="cuda")
    v32 = p32(cuda.to_device(X.astype(np.float32)))
    assert v32.dtype == np.float32
    close(v32, cpu(X.astype(np.float32).astype(np.float64)), rtol=1e-5)


def test_device_inputs_need_the_cuda_target(rosen_progs):
    cpu, _ = rosen_progs
    with pytest.raises(TypeError, match=r"to\('cuda'\)"):
        cpu(cuda.to_device(np.zeros((2, 6))))


def test_guards_route_each_sample_and_name_the_failing_one():
    def f(x):
        return x.sum() * 2.0 if x[0] > 0 else (x * x).sum()
    x0 = np.array([1.0, 2.0, 3.0])
    X = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0], [2.0, 1.0, 0.0]])
    strict = tg.trace(f, x0, target="cuda")
    with pytest.raises(tg.GuardError, match="sample 1"):
        strict.value_and_grad(X)
    with pytest.raises(tg.GuardError):
        strict.value_and_grad(cuda.to_device(X))
    prog = tg.trace(f, x0, target="cuda", retrace=True)
    v, g = prog.value_and_grad(cuda.to_device(X))
    ve = [f(tg.tensor(x)).item() for x in X]
    close(v, ve)
    close(g, [[2.0] * 3, [-2.0, 1.0, 4.0], [2.0] * 3])
    close(prog.jacobian(X), g.copy_to_host())


def test_reverse_skips_samples_that_failed_a_guard():
    # found by the replay legs (seed 61045): the reverse sweep ran on a sample whose
    # forward stopped at a failed guard, over values never computed (the simulator raised
    # "math domain error" from asin's rule; a GPU computes garbage)
    from tapegrad.interpreters import replay_cuda

    def f(x):
        return x.asin().sum() if x[0] > 0 else (x * x).sum()
    prog = tg.trace(f, np.array([0.5, 0.2]), target="cuda", retrace=True)
    X = np.array([[0.5, 0.2], [-0.5, 0.3], [0.1, -0.4]])
    status, _, G = replay_cuda.run(prog._code, X.T.copy(), np.ones((1, 3)), True)
    assert status.tolist()[1] != 0 and status.tolist()[0] == status.tolist()[2] == 0
    G = G.copy_to_host()
    assert np.isnan(G[:, 1]).all() and np.isfinite(G[:, [0, 2]]).all()
    v, g = prog.value_and_grad(X)
    vc, gc = prog.to("cpu").value_and_grad(X)
    close(v, vc)
    close(g, gc)


def test_chunked_batches_equal_one_chunk(rosen_progs, monkeypatch):
    from tapegrad.interpreters import replay_cuda
    cpu, gpu = rosen_progs
    X = rng_batch(15, 11, 6)
    monkeypatch.setattr(replay_cuda, "CHUNK_BYTES", 8 * len(gpu._code.rows) * 2 * 3)
    v, g = gpu.value_and_grad(X)  # chunks of 3 samples
    vc, gc = cpu.value_and_grad(X)
    close(v, vc)
    close(g, gc)
    close(gpu.hessian(X), cpu.hessian(X))


def test_higher_derivatives_and_saved_programs_on_cuda(rosen_progs, tmp_path):
    cpu, gpu = rosen_progs
    X = rng_batch(16, 3, 6)
    third_cpu = cpu.grad_program().grad_program(np.ones(6))
    third_gpu = gpu.grad_program().grad_program(np.ones(6))
    assert third_gpu.target == "cuda"
    close(third_gpu.jacobian(X), third_cpu.jacobian(X))
    path = tmp_path / "rosen.npz"
    cpu.save(path)
    loaded = tg.load(path, target="cuda")
    close(loaded.grad(X), cpu.grad(X))


def test_is_grads_batched_through_a_cuda_program(torch):
    gpu = tg.trace(lambda x: x.sin() * x + x.sum(), np.zeros(5), target="cuda")
    x0 = rng_batch(17, 5)
    seeds = rng_batch(18, 4, 5)
    x = tg.tensor(x0, requires_grad=True)
    gb, = tg.autograd.grad(gpu(x), x, grad_outputs=tg.tensor(seeds), is_grads_batched=True)
    xt = torch.tensor(x0, requires_grad=True)
    gbt, = torch.autograd.grad(xt.sin() * xt + xt.sum(), xt, grad_outputs=torch.tensor(seeds),
                               is_grads_batched=True)
    close(gb.numpy(), gbt.numpy())
    # create_graph through the program entry: second derivatives, still on the GPU target
    y = gpu(x)
    g, = tg.autograd.grad((y * y).sum(), x, create_graph=True)
    h, = tg.autograd.grad(g.sum(), x)
    yt = xt.sin() * xt + xt.sum()
    gt, = torch.autograd.grad((yt * yt).sum(), xt, create_graph=True)
    ht, = torch.autograd.grad(gt.sum(), xt)
    close(g.detach().numpy(), gt.detach().numpy())
    close(h.numpy(), ht.numpy())


def test_cross_rounds_as_torchs_kernel(torch):
    # torch's fma(a_p, b_q, -(a_q * b_p)): the fms rows use cuda.fma (the simulator's is
    # a * b + c rounded twice: tapegrad's CPU fma there), on nearly parallel vectors
    rng = np.random.default_rng(19)
    a = rng.normal(size=(3, 4, 3))
    b = a * 1.3 + rng.normal(size=(3, 4, 3)) * 1e-7
    gpu = tg.trace(lambda x, y: tg.linalg.cross(x, y), a[0], b[0], target="cuda")
    v = gpu(a, b)
    v = v.copy_to_host() if hasattr(v, "copy_to_host") else v
    np.testing.assert_array_equal(
        v, torch.linalg.cross(torch.tensor(a), torch.tensor(b)).numpy())

def test_missing_package_and_missing_gpu_say_what_to_do(monkeypatch):
    import importlib.util

    from tapegrad import replay
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "numba_cuda" else real(name, *a))
    with pytest.raises(ImportError, match=r"tapegrad\[cuda\]"):
        tg.trace(rosen, np.zeros(3), target="cuda")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setattr(config, "ENABLE_CUDASIM", 0)
    monkeypatch.setattr(cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no usable NVIDIA GPU.*target='parallel'"):
        tg.trace(rosen, np.zeros(3)).to("cuda")
    with pytest.raises(RuntimeError, match="NUMBA_ENABLE_CUDASIM"):
        replay.cuda_module()


def test_kernels_compile_for_a_real_gpu():
    # the simulator runs the kernels as Python: compile them to PTX as numba-cuda would on
    # a GPU (types, every opcode's branch), which needs NVVM but no GPU
    code = textwrap.dedent("""
        import sys
        try:  # the toolkit's compilers, which the test extra leaves out
            from cuda.pathfinder import load_nvidia_dynamic_lib
            for lib in ("nvvm", "nvrtc"):
                load_nvidia_dynamic_lib(lib)
        except ImportError:
            pass
        except Exception as e:
            print(f"MISSING {lib}: {type(e).__name__}")
            sys.exit(0)
        import types as pytypes
        import numba.cuda.dispatcher as disp
        disp.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))
        from numba import types
        from numba.cuda import compile_ptx
        from tapegrad.interpreters import replay_cuda as rc
        M, V, I, i = types.float64[:, :], types.int64[:], types.int64, types.int64
        for name, sig in {
                "_forward": (M, M, M, V, M, V, I),
                "_reverse": (M, M, M, M, V, V, M, I, I, I, V),
                "_pack": (types.float32[:, :], M, I),
                "_unpack": (M, I, types.float32[:, :]),
                "_unpack_jacobian": (M, I, I, I, types.float64[:, :, :]),
                "_identity_seeds": (M, I)}.items():
            ptx, _ = compile_ptx(getattr(rc, name).py_func, sig, cc=(9, 0))
            assert ".entry" in ptx or ".visible" in ptx, name
        print("ok")
    """)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    missing = "MISSING" in r.stdout or any(
        e in r.stderr for e in ("NvvmSupportError", "DynamicLibNotFoundError", "libnvvm"))
    if missing:
        pytest.skip("the PTX compile check needs the CUDA toolkit's NVVM and NVRTC, which the "
                    "test extra leaves out: pip install -e '.[test,cuda]' to run it "
                    f"({r.stdout.strip() or r.stderr.strip().splitlines()[-1]})")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@hardware
def test_a_large_batch_on_the_gpu_equals_the_parallel_cpu(rosen_progs):
    cpu, gpu = rosen_progs
    X = rng_batch(19, 200_000, 6)
    v, g = gpu.value_and_grad(cuda.to_device(X))
    vc, gc = cpu.to("parallel").value_and_grad(X)
    close(v, vc)
    close(g, gc)
