import sys, numpy as np, tapegrad as tg
from tapegrad.interpreters import program as _prog
from tapegrad import _program_code as PC
from tapegrad.bench.common import rosenbrock_scalar, rosenbrock_vec, pendulum_euler
from tapegrad.bench.gradbench import gmm, lse
if sys.argv[1] == "off":
    _prog.cut_dead = lambda rows, roots, upto=None: (rows, np.arange(
        _prog._arr.row_slots(rows)[1] if _prog._arr.has_arrays(rows) else rows.shape[0]))
rng = np.random.default_rng(0)
progs = {}
x = rng.normal(size=100)
progs["rosen100"] = (tg.trace(lambda x: rosenbrock_scalar([x[i] for i in range(100)]), x), (x,))
progs["rosenvec"] = (tg.trace(lambda x: rosenbrock_vec(x), x), (x,))
p = np.array([9.81, 1.0, 0.1, 0.5])
progs["pend"] = (tg.trace(lambda p: pendulum_euler(tg, p[0], p[1], p[2], p[3], steps=300), p), (p,))
for n in (50, 20000):
    x = rng.normal(size=n)
    progs[f"lse{n}"] = (tg.trace(lambda x: lse.lse(tg, x), x), (x,))
k, d, n = 3, 4, 50
arrays = [rng.normal(size=k), rng.normal(size=(k, d)), rng.normal(size=(k, d)), rng.normal(size=(k, d*(d-1)//2))]
xt = tg.tensor(rng.normal(size=(d, n)))
progs["gmm"] = (tg.trace(lambda *a: gmm.objective(tg, *a, xt, 10, 1.0), *arrays), tuple(arrays))
for name, (P, xs) in progs.items():
    c = P._code
    h = PC._hvp_of(c)
    g = PC._grad_code(c)
    v = PC._vjp_code(c)
    wv = h.with_value
    print(name, c.arows.shape[0], h.arows.shape[0], None if wv is None else wv.arows.shape[0], g.arows.shape[0], v.arows.shape[0])
