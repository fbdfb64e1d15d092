"""ba: bundle adjustment (ADBench): the reprojection error of p observations (camera i % n,
point i % m) and the weight error 1 - w^2, and their sparse Jacobian in ADBench's layout.

The Jacobian comes from two reverse sweeps over per-observation copies of the camera and
point parameters (each residual depends only on its own observation's copies), so every
one of the p blocks is computed; GradBench checks the first 30 entries and the last.
"""
import numpy as np

from ._common import check, T, host, leaf, trace as _trace

NCAM = 11


def cross(M, a, b):
    i, j = [1, 2, 0], [2, 0, 1]
    return a[:, i] * b[:, j] - a[:, j] * b[:, i]


def rotate(M, rot, pt):
    """Rodrigues rotation of each row of ``pt`` by the angle-axis rows of ``rot``."""
    sq = M.sum(rot * rot, 1)
    zero = host(sq) == 0
    if zero.all():
        return pt + cross(M, rot, pt)
    safe = M.where(T(M, zero) > 0, M.ones_like(sq), sq) if zero.any() else sq
    theta = M.sqrt(safe)
    c, s = M.cos(theta)[:, None], M.sin(theta)[:, None]
    w = rot / theta[:, None]
    tmp = M.sum(w * pt, 1)[:, None] * (1 - c)
    out = pt * c + cross(M, w, pt) * s + w * tmp
    if zero.any():
        out = M.where(T(M, zero)[:, None] > 0, pt + cross(M, rot, pt), out)
    return out


def reproj(M, cam, X, w, feat):
    """Residuals (p x 2) of observations with camera rows ``cam`` (p x 11), point rows
    ``X`` (p x 3), weights ``w`` (p) and features ``feat`` (p x 2)."""
    Xcam = rotate(M, cam[:, 0:3], X - cam[:, 3:6])
    proj = Xcam[:, 0:2] / Xcam[:, 2:3]
    rsq = M.sum(proj * proj, 1)
    L = 1 + cam[:, 9] * rsq + cam[:, 10] * rsq * rsq
    proj = proj * L[:, None] * cam[:, 6:7] + cam[:, 7:9]
    return w[:, None] * (proj - feat)


def data(input):
    n, m, p = int(input["n"]), int(input["m"]), int(input["p"])
    cams = np.tile(np.asarray(input["cam"], dtype=np.float64), (n, 1))
    X = np.tile(np.asarray(input["x"], dtype=np.float64), (m, 1))
    w = np.full(p, float(input["w"]))
    feats = np.tile(np.asarray(input["feat"], dtype=np.float64), (p, 1))
    obs = np.stack([np.arange(p) % n, np.arange(p) % m], 1)
    return n, m, p, cams, X, w, feats, obs


def objective(M, cams, X, w, feats, obs):
    return reproj(M, cams[obs[:, 0]], X[obs[:, 1]], w, feats), 1 - w * w


def post_objective(res):
    r, we = host(res[0]), host(res[1])
    return {"reproj_error": {"elements": r[0].tolist(), "repeated": len(r)},
            "w_err": {"element": float(we[0]), "repeated": len(we)}}


def sparse(n, m, p, obs, dcam, dX, dw, w):
    """ADBench's SparseMat (CSR rows, cols, vals) from the per-observation derivatives
    ``dcam`` (2, p, 11), ``dX`` (2, p, 3), ``dw`` (2, p) and the weights."""
    per = NCAM + 3 + 1
    cols = np.concatenate([
        NCAM * obs[:, 0:1] + np.arange(NCAM),
        NCAM * n + 3 * obs[:, 1:2] + np.arange(3),
        (NCAM * n + 3 * m + np.arange(p))[:, None]], 1)                      # (p, 15)
    vals = np.concatenate([dcam, dX, dw[..., None]], 2).transpose(1, 0, 2)   # (p, 2, 15)
    cols = np.concatenate([np.repeat(cols[:, None, :], 2, 1).reshape(-1),
                           NCAM * n + 3 * m + np.arange(p)])
    vals = np.concatenate([vals.reshape(-1), -2 * w])
    rows = np.concatenate([np.arange(2 * p + 1) * per,
                           2 * p * per + np.arange(1, p + 1)])
    return rows, cols, vals


def post_jacobian(mat):
    rows, cols, vals = mat

    def ends(a):
        return np.concatenate([a[:30], a[-1:]])
    return {"rows": [int(v) for v in ends(rows)], "cols": [int(v) for v in ends(cols)],
            "vals": [float(v) for v in ends(vals)]}


def prepare(function, input, M, trace):
    check('ba', function, ('objective', 'jacobian'))
    n, m, p, cams, X, w, feats, obs = data(input)
    if function == "objective":
        if trace:
            import tapegrad
            prog = _trace(lambda c, x, ww: objective(tapegrad, c, x, ww, T(tapegrad, feats),
                                                     obs), cams, X, w)
            return (lambda: prog(cams, X, w)), post_objective
        ct, xt, wt, ft = T(M, cams), T(M, X), T(M, w), T(M, feats)
        return (lambda: objective(M, ct, xt, wt, ft, obs)), post_objective
    if trace:
        import tapegrad
        ft = T(tapegrad, feats)
        prog = _trace(lambda c, x, ww: reproj(tapegrad, c, x, ww, ft), cams[obs[:, 0]],
                      X[obs[:, 1]], w)
        seeds = [np.zeros((p, 2)) for _ in range(2)]
        seeds[0][:, 0] = seeds[1][:, 1] = 1

        def jacobian_replay():
            cam_o, X_o = cams[obs[:, 0]], X[obs[:, 1]]
            gs = [prog.vjp((cam_o, X_o, w), s)[1] for s in seeds]
            return sparse(n, m, p, obs, *(np.stack([g[i] for g in gs]) for i in range(3)), w)
        return jacobian_replay, post_jacobian
    ft = T(M, feats)

    def jacobian():
        # per-observation copies: the gather is part of the timed work, as in a solver
        cam_o, X_o, wt = leaf(M, cams[obs[:, 0]]), leaf(M, X[obs[:, 1]]), leaf(M, w)
        r = reproj(M, cam_o, X_o, wt, ft)
        g0 = M.autograd.grad(r[:, 0].sum(), (cam_o, X_o, wt), retain_graph=True)
        g1 = M.autograd.grad(r[:, 1].sum(), (cam_o, X_o, wt))
        return sparse(n, m, p, obs, *(np.stack([host(a), host(b)]) for a, b in zip(g0, g1)),
                      w)
    return jacobian, post_jacobian
