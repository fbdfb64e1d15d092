"""ht: ADBench's hand tracking: skin a hand model posed by theta (26 parameters) and
return the residuals to the observed points (``us`` non-empty: to points interpolated on
the model's triangles), and the Jacobian (with us: two columns for each residual's own u,
then theta's 26).

The Jacobian is computed column-wise as Jacobian-vector products, by differentiating a
vector-Jacobian product again (one batched sweep for all columns): each residual row
depends only on its own u, so one tangent per u component gives its two columns.
"""
import numpy as np

from ._common import check, T, as_list, host, leaf, trace as _trace


def pose_index(n_bones):
    """Where each entry of the 3 x (n_bones + 3) pose matrix (column-major: column i is
    pose parameter i) comes from in [theta (26), 0, 1]."""
    zero, one = 26, 27
    cols = [[0, 1, 2], [one] * 3, [3, 4, 5]] + [[zero] * 3 for _ in range(n_bones)]
    it, ip = 6, 5
    for _ in range(5):
        for i in range(2, 5):
            cols[ip][0] = it
            it += 1
            if i == 2:
                cols[ip][1] = it
                it += 1
            ip += 1
        ip += 1
    return np.asarray(cols, dtype=np.int64)


def stack_mat(M, entries):
    """A (n, 3, 3) tensor from nine (n,) tensors, row-major."""
    return M.stack(entries, 1).reshape(-1, 3, 3)


def euler_rotations(M, xzy):
    """Rz @ Ry @ Rx for each row (tx, tz, ty) of ``xzy`` (n, 3)."""
    tx, ty, tz = xzy[:, 0], xzy[:, 2], xzy[:, 1]
    o, z = M.ones_like(tx), M.zeros_like(tx)
    cx, sx, cy, sy, cz, sz = M.cos(tx), M.sin(tx), M.cos(ty), M.sin(ty), M.cos(tz), M.sin(tz)
    Rx = stack_mat(M, [o, z, z, z, cx, -sx, z, sx, cx])
    Ry = stack_mat(M, [cy, z, sy, z, o, z, -sy, z, cy])
    Rz = stack_mat(M, [cz, -sz, z, sz, cz, z, z, z, o])
    return M.matmul(M.matmul(Rz, Ry), Rx)


def angle_axis(M, r):
    n = M.sqrt(M.sum(r * r))
    if float(host(n)) < 1e-4:
        return M.eye(3, dtype=M.float64)
    x, y, z = r[0] / n, r[1] / n, r[2] / n
    s, c = M.sin(n), M.cos(n)
    return M.stack([x * x + (1 - x * x) * c, x * y * (1 - c) - z * s, x * z * (1 - c) + y * s,
                    x * y * (1 - c) + z * s, y * y + (1 - y * y) * c, y * z * (1 - c) - x * s,
                    x * z * (1 - c) - y * s, z * y * (1 - c) + x * s,
                    z * z + (1 - z * z) * c]).reshape(3, 3)


def vertices(M, theta, model):
    """Skinned, mirrored and globally transformed vertex positions (3, n_vertices)."""
    nb = len(model["parents"])
    src = M.cat([theta, T(M, [0.0, 1.0])])
    pose = src[pose_index(nb)]                               # (nb + 3, 3)
    R = euler_rotations(M, pose[3:])                          # (nb, 3, 3)
    tr = M.cat([M.cat([R, T(M, np.zeros((nb, 3, 1)))], 2),
                T(M, np.tile([0.0, 0.0, 0.0, 1.0], (nb, 1, 1)))], 1)
    rel = M.matmul(model["base_relatives"], tr)               # (nb, 4, 4)
    absolutes = []
    for i, parent in enumerate(model["parents"]):
        absolutes.append(rel[i] if parent == -1 else M.matmul(absolutes[parent], rel[i]))
    transforms = M.matmul(M.stack(absolutes), model["inverse_base_absolutes"])
    posed = M.matmul(transforms, model["base_positions"])     # (nb, 4, nv)
    pos = M.sum(posed[:, :3, :] * model["weights"][:, None, :], 0)
    if model["is_mirrored"]:
        pos = pos * T(M, [[-1.0], [1.0], [1.0]])
    Rg = angle_axis(M, pose[0]) * pose[1][None, :]
    return M.matmul(Rg, pos) + pose[2][:, None]


def residuals(M, theta, us, model, points, corr, triangles):
    pos = vertices(M, theta, model)
    if us is None:
        return (points - pos[:, corr].T).reshape(-1)
    v = triangles[corr]                                         # (ncorr, 3)
    u0, u1 = us[:, 0:1], us[:, 1:2]
    hand = (u0 * pos[:, v[:, 0]].T + u1 * pos[:, v[:, 1]].T
            + (1 - u0 - u1) * pos[:, v[:, 2]].T)
    return (points - hand).reshape(-1)


def data(M, input):
    d, m = input["data"], input["data"]["model"]
    model = {"parents": [int(p) for p in m["parents"]],
             "base_relatives": T(M, m["base_relatives"]),
             "inverse_base_absolutes": T(M, m["inverse_base_absolutes"]),
             "base_positions": T(M, np.asarray(m["base_positions"], dtype=np.float64).T),
             "weights": T(M, np.asarray(m["weights"], dtype=np.float64).T),
             "is_mirrored": bool(m["is_mirrored"])}
    us = np.asarray(input.get("us") or [], dtype=np.float64).reshape(-1, 2)
    return (np.asarray(input["theta"], dtype=np.float64), us if len(us) else None, model,
            T(M, d["points"]), np.asarray(d["correspondences"], dtype=np.int64),
            np.asarray(m["triangles"], dtype=np.int64).reshape(-1, 3))


def tangents(ntheta, us):
    """Tangent columns of the reported Jacobian: (u0 of every row, u1 of every row) when
    there are us, then theta's unit vectors."""
    k = 0 if us is None else 2
    Vth = np.zeros((k + ntheta, ntheta))
    Vth[k:] = np.eye(ntheta)
    if us is None:
        return Vth, None
    Vus = np.zeros((k + ntheta,) + us.shape)
    Vus[0, :, 0] = Vus[1, :, 1] = 1
    return Vth, Vus


def jacobian_columns(M, f, inputs, tangent_sets):
    """Jacobian-vector products of ``f`` at ``inputs``, one per row of the tangents, as
    columns (outputs x tangents): J v is the derivative in u of v . (J^T u), so one sweep
    with create_graph gives J^T u and one batched sweep over it gives every J v."""
    out = f(*inputs)
    u = M.zeros(out.shape, dtype=M.float64, requires_grad=True)
    vjps = M.autograd.grad(out, inputs, grad_outputs=(u,), create_graph=True)
    jv = M.autograd.grad(vjps, (u,), grad_outputs=tuple(T(M, V) for V in tangent_sets),
                         is_grads_batched=True)[0]
    return out, jv.T


def prepare(function, input, M, trace):
    check('ht', function, ('objective', 'jacobian'))
    theta0, us0, model, points, corr, tri = data(M, input)
    if trace:
        import tapegrad
        model, points = data(tapegrad, input)[2:4]
        if us0 is None:
            prog = _trace(lambda th: residuals(tapegrad, th, None, model, points, corr, tri),
                          theta0)
            if function == "objective":
                return (lambda: prog(theta0)), as_list
            return (lambda: prog.jacobian(theta0)), as_list
        prog = _trace(lambda th, us: residuals(tapegrad, th, us, model, points, corr, tri),
                      theta0, us0)
        if function == "objective":
            return (lambda: prog(theta0, us0)), as_list

        def jacobian_replay():
            Jth, Jus = prog.jacobian(theta0, us0)
            rows = np.arange(len(corr)).repeat(3)
            Jus = Jus.reshape(len(rows), -1, 2)[np.arange(len(rows)), rows]
            return np.concatenate([Jus, Jth], 1)
        return jacobian_replay, as_list
    if function == "objective":
        th = T(M, theta0)
        us = None if us0 is None else T(M, us0)
        return (lambda: residuals(M, th, us, model, points, corr, tri)), as_list
    Vth, Vus = tangents(len(theta0), us0)

    def jacobian():
        th = leaf(M, theta0)
        if us0 is None:
            return jacobian_columns(M, lambda t: residuals(M, t, None, model, points, corr,
                                                           tri), (th,), (Vth,))[1]
        us = leaf(M, us0)
        return jacobian_columns(M, lambda t, u: residuals(M, t, u, model, points, corr, tri),
                                (th, us), (Vth, Vus))[1]
    return jacobian, as_list
