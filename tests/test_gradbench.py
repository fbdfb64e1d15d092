"""The GradBench tool: every eval's primal and derivative against torch running the same
objective text, and the protocol round trip through an in-process driver."""
import io
import json

import numpy as np
import pytest

import tapegrad
from tapegrad.bench.gradbench import EVALS
from tapegrad.bench.gradbench.__main__ import evaluate, main, serve

torch = pytest.importorskip("torch")


def _hand_model(rng, nb=22, nv=30):
    rel = rng.normal(size=(nb, 4, 4)) * 0.3
    rel[:, 3] = [0, 0, 0, 1]
    inv = rng.normal(size=(nb, 4, 4)) * 0.3
    inv[:, 3] = [0, 0, 0, 1]
    pos = np.concatenate([rng.normal(size=(nv, 3)), np.ones((nv, 1))], 1)
    w = rng.random((nv, nb))
    return {"bone_count": nb, "bone_names": [f"b{i}" for i in range(nb)],
            "parents": [-1] + [int(rng.integers(0, i)) for i in range(1, nb)],
            "base_relatives": rel.tolist(), "inverse_base_absolutes": inv.tolist(),
            "base_positions": pos.tolist(), "weights": (w / w.sum(1, keepdims=True)).tolist(),
            "triangles": rng.integers(0, nv, size=(12, 3)).tolist(), "is_mirrored": True}


def inputs(name, rng):
    """Small inputs of each eval, with its functions."""
    runs = {"min_runs": 1, "min_seconds": 0}
    if name == "hello":
        return ("square", "double"), 1.5
    if name == "gmm":
        d, k, n = 3, 4, 7
        return ("objective", "jacobian"), dict(
            runs, d=d, k=k, n=n, m=2, gamma=1.3, x=rng.normal(size=(n, d)).tolist(),
            alpha=rng.normal(size=k).tolist(), mu=rng.normal(size=(k, d)).tolist(),
            q=(0.3 * rng.normal(size=(k, d))).tolist(),
            l=rng.normal(size=(k, d * (d - 1) // 2)).tolist())
    if name == "lse":
        return ("primal", "gradient"), dict(runs, x=rng.normal(size=9).tolist())
    if name == "ode":
        return ("primal", "gradient"), dict(runs, x=rng.random(5).tolist(), s=6)
    if name == "llsq":
        return ("primal", "gradient"), dict(runs, x=rng.normal(size=4).tolist(), n=11)
    if name == "det":
        return ("primal", "gradient"), dict(runs, A=rng.normal(size=16).tolist(), ell=4)
    if name == "kmeans":
        P = rng.normal(size=(20, 2))
        return ("cost", "dir"), dict(runs, points=P.tolist(), centroids=P[:3].tolist())
    if name == "lstm":
        layers, b, c = 2, 3, 4
        return ("objective", "jacobian"), dict(
            runs, main_params=rng.normal(size=(2 * layers, 4 * b)).tolist(),
            extra_params=rng.normal(size=(3, b)).tolist(),
            state=rng.normal(size=(2 * layers, b)).tolist(),
            sequence=rng.normal(size=(c, b)).tolist())
    if name == "ba":
        return ("objective", "jacobian"), dict(
            runs, n=3, m=5, p=7, cam=(rng.normal(size=11) * 0.3
                                      + np.eye(11)[6]).tolist(),
            x=(rng.normal(size=3) + [0, 0, 4]).tolist(), w=0.8, feat=rng.normal(size=2).tolist())
    if name == "ht":
        model = _hand_model(rng)
        corr = rng.integers(0, 12, size=5).tolist()
        return ("objective", "jacobian"), dict(
            runs, theta=(0.3 * rng.normal(size=26)).tolist(),
            data={"model": model, "correspondences": corr,
                  "points": rng.normal(size=(5, 3)).tolist()},
            us=rng.random((5, 2)).tolist())
    if name == "particle":
        return ("rr",), dict(runs, w=0.0)
    if name == "saddle":
        return ("rr",), dict(runs, start=[1.0, 1.0])
    raise KeyError(name)


def _close(a, b, path=""):
    if isinstance(b, dict):
        assert set(a) == set(b), path
        for k in b:
            _close(a[k], b[k], f"{path}.{k}")
    else:
        np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float),
                                   rtol=1e-9, atol=1e-11, err_msg=path)


@pytest.mark.parametrize("name", [e for e in EVALS if e not in ("particle", "saddle")])
def test_eval_matches_torch(name):
    functions, inp = inputs(name, np.random.default_rng(sum(map(ord, name))))
    for function in functions:
        msg = {"id": 0, "kind": "evaluate", "module": name, "function": function,
               "input": inp}
        got = evaluate(msg, M=tapegrad)
        want = evaluate(msg, M=torch)
        assert got["success"] and [t["name"] for t in got["timings"]] == ["evaluate"]
        _close(got["output"], want["output"], f"{name}.{function}")


def test_ht_simple_matches_torch():
    _, inp = inputs("ht", np.random.default_rng(3))
    inp = dict(inp, us=[])
    inp["data"]["correspondences"] = [0, 7, 29, 3, 3]
    for function in ("objective", "jacobian"):
        msg = {"module": "ht", "function": function, "input": inp}
        _close(evaluate(msg, M=tapegrad)["output"], evaluate(msg, M=torch)["output"])


def test_ht_jacobian_against_torch_jacobian():
    """The tool's column-wise Jacobian against torch's own jacobian of the residuals."""
    from tapegrad.bench.gradbench import ht
    _, inp = inputs("ht", np.random.default_rng(4))
    theta, us, model, points, corr, tri = ht.data(torch, inp)
    J = torch.autograd.functional.jacobian(
        lambda t, u: ht.residuals(torch, t, u, model, points, corr, tri),
        (torch.tensor(theta), torch.tensor(us)))
    rows = np.arange(len(corr)).repeat(3)
    Jus = J[1].numpy()[np.arange(len(rows)), rows]
    want = np.concatenate([Jus, J[0].numpy()], 1)
    got = evaluate({"module": "ht", "function": "jacobian", "input": inp})["output"]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["gmm", "lse", "ode", "llsq", "det", "kmeans", "lstm", "ba",
                                  "ht"])
def test_trace_matches_eager(name):
    functions, inp = inputs(name, np.random.default_rng(7))
    for function in functions:
        msg = {"module": name, "function": function, "input": inp}
        got = evaluate(msg, trace=True)
        assert [t["name"] for t in got["timings"]] == ["prepare", "evaluate"]
        _close(got["output"], evaluate(msg)["output"], f"{name}.{function}")


def test_nested_parts_match_torch():
    """particle's and saddle's nested derivatives against torch (their full gradient
    descents take a minute each: see test_reference_values, marked slow)."""
    from tapegrad.bench.gradbench import particle, saddle
    for w in (0.0, 0.13):
        res = []
        for M in (tapegrad, torch):
            wt = M.tensor(w, dtype=M.float64, requires_grad=True)
            v = particle.naive_euler(M, wt)
            res.append((v.item(), M.autograd.grad(v, (wt,))[0].item()))
        np.testing.assert_allclose(res[0], res[1], rtol=1e-10)
    res = []
    for M in (tapegrad, torch):
        p = M.tensor([0.3, -0.2], dtype=M.float64, requires_grad=True)
        v = saddle.inner_max(M, p, [1.0, 1.0], True)
        res.append(np.r_[v.item(), M.autograd.grad(v, (p,))[0].numpy()])
    np.testing.assert_allclose(res[0], res[1], rtol=1e-10)
    np.testing.assert_allclose(res[0][1:], [0.6, -0.4], rtol=1e-9)  # 2 * p1


@pytest.mark.slow
def test_reference_values():
    """The values GradBench's particle and saddle evals expect."""
    _, inp = inputs("particle", None)
    out = evaluate({"module": "particle", "function": "ff", "input": inp})["output"]
    assert abs(out - 0.2071918746486116) < 1e-9
    _, inp = inputs("saddle", None)
    out = evaluate({"module": "saddle", "function": "fr", "input": inp})["output"]
    np.testing.assert_allclose(out, [8.246324826140356e-06] * 4, rtol=1e-6)
    for name in ("particle", "saddle"):  # and torch agrees
        _, inp = inputs(name, None)
        msg = {"module": name, "function": "rr", "input": inp}
        _close(evaluate(msg)["output"], evaluate(msg, M=torch)["output"])


def test_batched_matmul_of_fewer_dims():
    """is_grads_batched through matmul of a (5, 4, 4) and a (4, 3) operand (ht's skinning):
    the batch axis used to misalign the 2-d side."""
    rng = np.random.default_rng(0)
    A0, b0, V = rng.normal(size=(5, 4, 4)), rng.normal(size=(4, 3)), rng.normal(size=(2, 5, 4, 3))
    res = []
    for M in (tapegrad, torch):
        A, b = M.tensor(A0, requires_grad=True), M.tensor(b0, requires_grad=True)
        g1 = M.autograd.grad(M.matmul(A, b), (A, b), grad_outputs=(M.tensor(V),),
                             is_grads_batched=True)
        g2 = M.autograd.grad(M.matmul(b.T, A), (A, b),
                             grad_outputs=(M.tensor(V.transpose(0, 1, 3, 2).copy()),),
                             is_grads_batched=True)
        res.append([np.asarray(g.detach()) for g in g1 + g2])
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_runs_and_seconds():
    msg = {"module": "lse", "function": "primal",
           "input": {"x": [1.0, 2.0], "min_runs": 3, "min_seconds": 0}}
    assert [t["name"] for t in evaluate(msg)["timings"]] == ["evaluate"] * 3
    msg["input"] = {"x": [1.0, 2.0], "min_runs": 1, "min_seconds": 0.02}
    timings = evaluate(msg)["timings"]
    assert sum(t["nanoseconds"] for t in timings) >= 0.02e9


def _drive(messages, trace=False):
    out = io.StringIO()
    serve(io.StringIO("".join(json.dumps(m) + "\n" for m in messages)), out.write, trace)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_protocol_round_trip():
    msgs = [{"id": 0, "kind": "start", "eval": "hello"},
            {"id": 1, "kind": "define", "module": "hello"},
            {"id": 2, "kind": "evaluate", "module": "hello", "function": "square",
             "input": 3.0},
            {"id": 3, "kind": "analysis", "of": 2, "valid": True},
            {"id": 4, "kind": "evaluate", "module": "hello", "function": "double",
             "input": 3.0},
            {"id": 5, "kind": "define", "module": "nonesuch"},
            {"id": 6, "kind": "evaluate", "module": "hello", "function": "nonesuch",
             "input": 3.0}]
    for trace in (False, True):
        r = _drive(msgs, trace)
        assert [m["id"] for m in r] == list(range(7))
        assert r[0]["tool"] == ("tapegrad-trace" if trace else "tapegrad")
        assert r[1] == {"id": 1, "success": True}
        assert r[2]["output"] == 9.0 and r[4]["output"] == 6.0
        assert r[3] == {"id": 3}
        assert r[5]["success"] is False and "nonesuch" in r[5]["error"]
        assert r[6]["success"] is False and "error" in r[6]


def test_main_exits_at_end_of_input(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(
        '{"id": 0, "kind": "start", "eval": "hello"}\n'))
    main([])
    assert json.loads(capsys.readouterr().out) == {"id": 0, "tool": "tapegrad"}
