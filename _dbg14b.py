import sys, numpy as np, tapegrad as tg
from tapegrad.interpreters import program as _prog
from tapegrad.ops import OPS
import test_replay_arrays as T
if sys.argv[1] == "off":
    _prog.cut_dead = lambda rows, roots, upto=None: (rows, None)
rng = np.random.default_rng(3)
W = rng.normal(size=(6, 40))
x0 = rng.normal(size=40)
with T.min_run(T.SCALAR):
    S = tg.trace(lambda x: T.mixed(tg, x, tg.tensor(W, dtype=tg.float64)), x0)
with T.min_run(4):
    P = tg.trace(lambda x: T.mixed(tg, x, tg.tensor(W, dtype=tg.float64)), x0)
from collections import Counter
print(len(S), len(P), Counter(OPS[int(c)].name for c in S._code.rows[:,0]).most_common(12))
print(Counter(OPS[int(c)].name for c in P._code.rows[:,0]).most_common(12))
r = S._code.rows
d = np.nonzero(r[:, 0] == _prog.DETACH)[0]
names = lambda k: OPS[int(r[k, 0])].name
for k in d:
    rd = np.nonzero((r[:, 1:4] == k).any(1))[0]
    if names(int(r[k,1])) == "maximum":
        print("detach", k, "of", int(r[k,1]), "readers", [(int(x), names(x), r[x,1:4].tolist()) for x in rd])
        for x in rd:
            rr = np.nonzero((r[:, 1:4] == x).any(1))[0]
            print("  readers of", x, [(int(y), names(y), r[y,1:4].tolist()) for y in rr])
            for y in rr:
                print("    readers of", y, [(int(z), names(z), r[z,1:4].tolist()) for z in np.nonzero((r[:, 1:4] == y).any(1))[0]])
