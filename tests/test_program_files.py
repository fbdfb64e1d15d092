"""Program files are untrusted input: ``tapegrad.load`` checks every field, and a damaged
file (random byte flips, edited fields) gives ValueError or a program that runs safely.

The mutation loop runs in a subprocess, so a crash in compiled code fails the test
instead of killing pytest; run it alone with ``PYTHONPATH=. python
tests/test_program_files.py DIR SEED COUNT`` (DIR holds the programs ``_save_all`` writes).
"""
from __future__ import annotations

import io
import json
import math
import os
import random
import re
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import tapegrad as tg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the programs --------------------------------------------------------------------------


def _rosen(x):
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()


def _branchy(x):
    if x.sum() > 0:
        return (x * x).sum()
    return x.sin().sum()


def programs():
    """{name: (program, example inputs)}: the kinds of programs ``save`` writes."""
    x4 = np.array([0.3, -0.2, 0.5, 1.1])
    out = {}
    out["scalar"] = (tg.trace(lambda x: (x * x).sin() + x.exp() / 3.0, 0.7), (0.4,))
    out["arrays"] = (tg.trace(_rosen, x4), (x4 * 0.9,))
    p = tg.trace(_branchy, np.array([1.0, 2.0]), retrace=True)
    p(np.array([-1.0, -2.0]))  # a second variant
    out["guards"] = (p, (np.array([0.4, -0.1]),))
    out["multi"] = (tg.trace(lambda x, y: (x * y, (x + y).max(), x > y),
                             np.ones(3, np.float32), np.arange(3.0).reshape(3)),
                    (np.array([1.0, -2.0, 0.5], np.float32), np.array([0.5, 0.0, 1.0])))
    out["where"] = (tg.trace(lambda x: tg.where(x > 0, x.sqrt(), -x).clamp(0.1, 2.0).sum(),
                             np.ones((2, 2))), (np.array([[0.5, -1.0], [2.0, 0.0]]),))
    out["grad"] = (out["arrays"][0].grad_program(), (x4,))
    out["grad2"] = (out["grad"][0].grad_program(v=np.eye(4)[1]), (x4,))
    return out


def _same(a, b):
    """Equal results (nested tuples of arrays), NaN equal to NaN."""
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(_same, a, b))
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and \
        np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


# --- what the compiled interpreters read, from their generated source -------------------------


def interpreter_reads():
    """{opcode: columns (1-3) the generated interpreters read as slots}, for every opcode
    they have a branch for; independent of the checks in ``_program_file``."""
    from tapegrad.interpreters import _generated_replay as g
    from tapegrad.interpreters import fuse
    src = open(g.__file__).read()
    names = {"LEAF": g.LEAF, "CONST": g.CONST, "GUARD": g.GUARD}
    reads = {}
    for part in re.split(r"\n\s+(?:el)?if op == ", src)[1:]:
        head, _, body = part.partition(":")
        body = body.split("\n        elif", 1)[0]
        cols = {int(c) for c in re.findall(r"int\(rows\[k, ([123])\]\)", body)}
        for h in head.split(" or op == "):  # (the batch's branches shared by two or three)
            code = names[h] if h in names else int(h)
            if code >= fuse.BASE:  # superinstructions: the one-sample entry's, never in files
                continue
            reads.setdefault(code, set()).update(cols)
    return reads


def _index(x, hi):
    """Whether ``x`` (a float) is a whole number in [0, hi)."""
    return math.isfinite(x) and x == int(x) and 0 <= x < hi


def unsafe(prog, reads):
    """Why running ``prog`` would read memory it must not (None when it would not): a
    row-by-row check written apart from the loader's."""
    from tapegrad.ops import BY_NAME
    leaf, guard = BY_NAME["leaf"].code, BY_NAME["guard"].code
    base = prog._variants[0]
    nin = sum(math.prod(s) for s, _ in base.inputs)
    for vi, c in enumerate(prog._variants):
        if c.inputs != base.inputs or c.outputs != base.outputs:
            return f"variant {vi} has other inputs or outputs"
        rows = c.rows
        n = rows.shape[0]
        if rows.dtype != np.float64 or rows.ndim != 2 or rows.shape[1] != 6:
            return "bad rows array"
        for k in range(n):
            op = rows[k, 0]
            if not _index(op, 1 << 30) or int(op) not in reads:
                return f"row {k}: opcode {op} has no interpreter branch"
            for col in reads[int(op)]:
                if not _index(rows[k, col], k):
                    return f"row {k}: column {col} reads slot {rows[k, col]}"
            if op == leaf and not _index(rows[k, 4], nin):
                return f"row {k}: leaf reads x[{rows[k, 4]}] of {nin}"
            if op == guard and not _index(rows[k, 5], len(c.sites)):
                return f"row {k}: guard site {rows[k, 5]} of {len(c.sites)}"
        for name, a, m in (("in", c.in_slots, nin),
                           ("out", c.out_slots, sum(math.prod(s) for s, _ in c.outputs))):
            if a.shape != (m,) or ((a < 0) | (a >= n)).any():
                return f"{name} slots {a} (rows {n}, {m} elements)"
        if c.kind == "single" and len(c.outputs) != 1:
            return "single output kind with several outputs"
    return None


# --- mutations -------------------------------------------------------------------------------


def members(data):
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def npz(files):
    """A zip of the given {name: bytes} members, stored like ``np.savez`` writes them."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, raw in files.items():
            z.writestr(name, raw)
    return buf.getvalue()


def npy(a, shape=None):
    """``.npy`` bytes of ``a`` (with the header claiming ``shape`` when given)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(a), allow_pickle=False)
    raw = buf.getvalue()
    if shape is None:
        return raw
    hdr = {"descr": np.lib.format.dtype_to_descr(np.asarray(a).dtype),
           "fortran_order": False, "shape": tuple(shape)}
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, hdr)
    return out.getvalue() + np.ascontiguousarray(a).tobytes()


def arrays(data):
    return {n[:-4]: np.load(io.BytesIO(raw), allow_pickle=False)
            for n, raw in members(data).items()}


def pack(arrs):
    return npz({f"{k}.npy": v if isinstance(v, bytes) else npy(v) for k, v in arrs.items()})


def with_meta(arrs, meta):
    a = dict(arrs)
    a["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    return a


BAD = [None, True, False, -1, 0, 1, 2, 1.5, -0.5, float("nan"), float("inf"), 10 ** 12,
       10 ** 30, "", "x", "float64", "bool", "object", "single", "tuple", [], [1], [[]],
       [[], "float64"], [[3], "float64"], {}, {"a": 1}]


def _paths(x, path=()):
    yield path
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x[:6]):  # the op list is long; its head is enough
            yield from _paths(v, path + (i,))


def _edit(x, path, how, value=None):
    if not path:
        return value
    x = json.loads(json.dumps(x))
    parent = x
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if how == "set":
        parent[last] = value
    elif how == "delete":
        del parent[last]
    elif how == "extra":
        if isinstance(parent, dict):
            parent["extra"] = value
        else:
            parent.append(value)
    elif how == "dup" and isinstance(parent, list):
        parent.insert(last, parent[last])
    return x


def mutate(rng, data):
    """(description, bytes) of one random mutation of the program file ``data``."""
    kind = rng.choice(["flip", "flip", "member", "header", "header", "row", "row", "row",
                       "slots", "arrays"])
    if kind == "flip":
        b = bytearray(data)
        what = []
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            x = rng.randint(1, 255)
            b[i] ^= x
            what.append(f"{i}^{x}")
        if rng.random() < 0.2:
            cut = rng.randrange(len(b))
            del b[cut:]
            what.append(f"cut at {cut}")
        return "flip " + " ".join(what), bytes(b)
    files = members(data)
    if kind == "member":  # damaged member, intact zip (a valid CRC)
        name = rng.choice(sorted(files))
        b = bytearray(files[name])
        i = rng.randrange(len(b)) if rng.random() < 0.5 else rng.randrange(min(len(b), 128))
        x = rng.randint(1, 255)
        b[i] ^= x
        files[name] = bytes(b)
        return f"member {name} byte {i}^{x}", npz(files)
    arrs = arrays(data)
    meta = json.loads(arrs["meta"].tobytes())
    if kind == "header":
        paths = list(_paths(meta))[1:]
        path = rng.choice(paths)
        how = rng.choice(["set", "set", "set", "delete", "extra", "dup"])
        value = rng.choice(BAD)
        return f"header {list(path)} {how} {value!r}", pack(with_meta(arrs, _edit(meta, path,
                                                                                  how, value)))
    nv = len(meta["variants"])
    i = rng.randrange(nv)
    rows = arrs[f"rows{i}"].copy()
    n = rows.shape[0]
    if kind == "row":
        k = rng.randrange(n)
        leafs = np.nonzero(rows[:, 0] == meta["ops"].index("leaf"))[0]
        guards = np.nonzero(rows[:, 0] == meta["ops"].index("guard"))[0]
        if len(leafs) and rng.random() < 0.25:
            k = int(rng.choice(leafs))
        elif len(guards) and rng.random() < 0.25:
            k = int(rng.choice(guards))
        j = rng.randrange(6)
        old = float(rows[k, j])
        value = rng.choice([-1, -2, 0, 1, k, k - 1, k + 1, n, n + 5, 1e300, -1e300,
                            float("nan"), float("inf"), -float("inf"), 0.5, k - 0.5,
                            2.0 ** 53, 2.0 ** 63, 1e19, 1e12, old + 1, old - 1, -old,
                            rng.randrange(len(meta["ops"])), len(meta["ops"])])
        rows[k, j] = value
        arrs[f"rows{i}"] = rows
        return f"rows{i}[{k}, {j}] {old!r} -> {value!r}", pack(arrs)
    if kind == "slots":
        name = f"{rng.choice(['in', 'out'])}{i}"
        a = arrs[name].copy()
        how = rng.choice(["set", "set", "truncate", "extend", "float", "int32", "2d"])
        if how == "set" and len(a):
            j = rng.randrange(len(a))
            a[j] = rng.choice([-1, n, n + 1, 10 ** 12, -(2 ** 62), rng.randrange(n)])
        elif how == "truncate":
            a = a[:-1]
        elif how == "extend":
            a = np.concatenate([a, a[:1] if len(a) else [0]])
        elif how == "float":
            a = a.astype(np.float64) + 0.5
        elif how == "int32":
            a = a.astype(np.int32)
        elif how == "2d":
            a = a.reshape(1, -1)
        arrs[name] = a
        return f"{name} {how}", pack(arrs)
    how = rng.choice(["drop row", "drop col", "transpose", "float32", "int64", "extra",
                      "missing", "meta junk", "meta utf8", "meta list", "huge claim",
                      "fortran", "big endian", "zero rows", "meta 2d"])
    if how == "drop row":
        arrs[f"rows{i}"] = rows[:-1]
    elif how == "drop col":
        arrs[f"rows{i}"] = rows[:, :5]
    elif how == "transpose":
        arrs[f"rows{i}"] = rows.T.copy()
    elif how == "float32":
        arrs[f"rows{i}"] = rows.astype(np.float32)
    elif how == "int64":
        arrs[f"rows{i}"] = rows.astype(np.int64)
    elif how == "extra":
        arrs[f"rows{nv}"] = rows
    elif how == "missing":
        del arrs[rng.choice(sorted(arrs))]
    elif how == "meta junk":
        arrs["meta"] = arrs["meta"][: rng.randrange(len(arrs["meta"]))]
    elif how == "meta utf8":
        arrs["meta"] = np.concatenate([arrs["meta"], np.array([0xff], np.uint8)])
    elif how == "meta list":
        arrs["meta"] = np.frombuffer(json.dumps([meta]).encode(), np.uint8)
    elif how == "huge claim":
        arrs[f"rows{i}"] = npy(rows, (rng.choice([n + 1, 10 ** 6, 10 ** 12, 2 ** 60]), 6))
    elif how == "fortran":
        arrs[f"rows{i}"] = np.asfortranarray(rows)
    elif how == "big endian":
        arrs[f"rows{i}"] = rows.astype(">f8")
    elif how == "zero rows":
        arrs[f"rows{i}"] = rows[:0]
    elif how == "meta 2d":
        arrs["meta"] = arrs["meta"].reshape(1, -1)
    return f"arrays {how} (variant {i})", pack(arrs)


def _results(prog, xs):
    """The program's outputs, gradient (vjp with ones), Jacobian, a batch of two and its
    gradient program's value (the reverse sweep re-recorded as rows), or the name of the
    clean error it raised."""
    try:
        out = prog(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        v = tuple(np.ones(np.shape(o)) for o in outs)
        v = v if len(v) > 1 else v[0]
        _, g = prog.vjp(xs, v)
        jac = prog.jacobian(*xs)
        batch = prog(*[np.stack([np.asarray(x), np.asarray(x) * 0.5]) for x in xs])
        return out, g, jac, batch, prog.grad_program(v=v)(*xs)
    except tg.GuardError:
        return "GuardError"


def _inputs_for(prog, xs):
    """``xs`` where they fit the (mutated) program's inputs, other values where not."""
    out = []
    for i, (shape, dtype) in enumerate(prog._code.inputs):
        x = np.asarray(xs[i]) if i < len(xs) else None
        if x is None or x.shape != shape or x.dtype != dtype:
            x = np.linspace(-0.7, 0.9, math.prod(shape)).reshape(shape).astype(dtype)
        out.append(x)
    return tuple(out)


def run_mutations(folder, seed, count):
    """Mutate each saved program in ``folder``; returns (counts, failures)."""
    import warnings
    warnings.simplefilter("ignore")  # overflow in a mutated program is not the point
    reads = interpreter_reads()
    spec = json.load(open(os.path.join(folder, "inputs.json")))
    originals = {}
    for name, xs in spec.items():
        path = os.path.join(folder, name + ".npz")
        prog = tg.load(path)
        xs = tuple(np.asarray(x, dtype=d) for x, d in xs)
        originals[name] = (open(path, "rb").read(), prog, xs, _results(prog, xs))
    rng = random.Random(seed)
    counts, failures = {"rejected": 0, "loaded": 0}, []
    current = os.path.join(folder, "current.txt")
    target = os.path.join(folder, "mutated.npz")
    names = sorted(originals)
    for t in range(count):
        name = names[t % len(names)]
        data, orig, xs, expect = originals[name]
        desc, mutated = mutate(rng, data)
        desc = f"{name} #{t} (seed {seed}): {desc}"
        with open(current, "w") as fh:
            fh.write(desc)
        with open(target, "wb") as fh:
            fh.write(mutated)
        try:
            prog = tg.load(target)
        except ValueError as e:
            counts["rejected"] += 1
            if target not in str(e):
                failures.append(f"{desc}: the message does not name the file: {e}")
            continue
        except Exception as e:  # noqa: BLE001 (any other exception is the failure)
            failures.append(f"{desc}: load raised {type(e).__name__}: {e}")
            continue
        counts["loaded"] += 1
        try:
            why = unsafe(prog, reads)
        except Exception as e:  # noqa: BLE001 (fields of types the checker does not expect)
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            failures.append(f"{desc}: load accepted an unsafe program: {why}")
            continue
        try:
            got = _results(prog, _inputs_for(prog, xs))
        except Exception as e:  # noqa: BLE001
            failures.append(f"{desc}: the loaded program raised {type(e).__name__}: {e}")
            continue
        same = all(np.array_equal(a.rows, b.rows, equal_nan=True) and
                   np.array_equal(a.in_slots, b.in_slots) and
                   np.array_equal(a.out_slots, b.out_slots) and a.inputs == b.inputs and
                   a.outputs == b.outputs and a.kind == b.kind and a.sites == b.sites
                   for a, b in zip(prog._variants, orig._variants)) and \
            len(prog._variants) == len(orig._variants)
        if same and not (got == expect if isinstance(got, str) or isinstance(expect, str)
                         else _same(got, expect)):
            failures.append(f"{desc}: an unchanged program computes other values")
    return counts, failures


def _save_all(folder):
    spec = {}
    for name, (prog, xs) in programs().items():
        prog.save(os.path.join(folder, name + ".npz"))
        spec[name] = [[np.asarray(x).tolist(), str(np.asarray(x).dtype)] for x in xs]
    with open(os.path.join(folder, "inputs.json"), "w") as fh:
        json.dump(spec, fh)


def _mutations(tmp_path, seed, count):
    _save_all(str(tmp_path))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path), str(seed),
                        str(count)], capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "PYTHONPATH": ROOT})
    if r.returncode != 0:
        current = tmp_path / "current.txt"
        last = current.read_text() if current.exists() else "(before the first mutation)"
        pytest.fail(f"the mutation run died (exit {r.returncode}) at {last}\n"
                    f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["failures"] == [], "\n".join(report["failures"][:20])
    assert report["counts"]["rejected"] > count // 3 and report["counts"]["loaded"] > 0, report
    return report


def test_mutated_files_give_value_error_or_a_safe_program(tmp_path):
    _mutations(tmp_path, seed=1, count=500)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_mutated_files_many(tmp_path, seed):
    _mutations(tmp_path, seed=seed, count=3000)


# --- targeted cases ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("programs")
    progs = programs()
    out = {}
    for name, (prog, xs) in progs.items():
        path = folder / (name + ".npz")
        prog.save(path)
        out[name] = (path.read_bytes(), prog, xs)
    return out


def _load_bytes(tmp_path, data, name="m.npz"):
    p = tmp_path / name
    p.write_bytes(data)
    return tg.load(p)


def _rejects(tmp_path, data, match):
    with pytest.raises(ValueError, match=match) as e:
        _load_bytes(tmp_path, data)
    assert "m.npz" in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("name", ["scalar", "arrays", "guards", "multi", "where", "grad",
                                  "grad2"])
def test_round_trip_computes_the_same(tmp_path, saved, name):
    data, prog, xs = saved[name]
    again = _load_bytes(tmp_path, data)
    assert len(again._variants) == len(prog._variants)
    for c in again._variants:  # read-only arrays would compile the interpreters again
        assert all(a.flags.writeable and a.flags.c_contiguous
                   for a in (c.rows, c.in_slots, c.out_slots))
    assert _same(_results(again, xs), _results(prog, xs))
    with open(tmp_path / "m.npz", "rb") as fh:  # a binary file works as well as a path
        assert _same(_results(tg.load(fh), xs), _results(prog, xs))


def test_leaf_input_index_out_of_range_is_rejected(tmp_path, saved):
    """The reported bug: a leaf row's input index (column 4) was never checked; small
    overruns returned heap contents, large ones crashed."""
    data, _, _ = saved["arrays"]
    arrs = arrays(data)
    ops = json.loads(arrs["meta"].tobytes())["ops"]
    leaf = int(np.nonzero(arrs["rows0"][:, 0] == ops.index("leaf"))[0][0])
    for value in (4.0, 7.0, 1e12, -1.0, 0.5, float("nan")):
        rows = arrs["rows0"].copy()
        rows[leaf, 4] = value
        msg = _rejects(tmp_path, pack(dict(arrs, rows0=rows)), "leaf")
        assert f"row {leaf}" in msg and "input element" in msg and "4 elements" in msg


def test_slot_columns_are_checked_for_what_each_op_reads(tmp_path, saved):
    data, prog, _ = saved["arrays"]
    arrs = arrays(data)
    rows = arrs["rows0"]
    ops = json.loads(arrs["meta"].tobytes())["ops"]
    k = int(np.nonzero(rows[:, 0] == ops.index("sub"))[0][0])
    for j, value, match in ((2, -1.0, "column 'b' reads slot -1.0"),  # a missing operand
                            (1, float(k), "reads slot"), (1, 2.5, "reads slot 2.5"),
                            (1, 1e300, "reads slot"), (3, 0.0, "column 'c' is 0.0"),
                            (3, float("nan"), "column 'c' is nan")):
        bad = rows.copy()
        bad[k, j] = value
        msg = _rejects(tmp_path, pack(dict(arrs, rows0=bad)), match)
        assert f"rows0 row {k} (sub)" in msg and "damaged" in msg


def test_opcodes_must_have_an_interpreter_branch(tmp_path, saved):
    data, _, _ = saved["arrays"]
    arrs = arrays(data)
    ops = json.loads(arrs["meta"].tobytes())["ops"]
    for op, match in ((ops.index("matmul"), "'matmul' does not occur in traced programs"),
                      (len(ops), "not an index"), (-1, "not an index"),
                      (1.5, "not an index"), (float("inf"), "not an index")):
        rows = arrs["rows0"].copy()
        rows[-1, 0] = op
        _rejects(tmp_path, pack(dict(arrs, rows0=rows)), match)


def test_input_and_output_slots(tmp_path, saved):
    data, _, _ = saved["multi"]
    arrs = arrays(data)
    n = arrs["rows0"].shape[0]
    for name, value, match in (("in0", n, "but the program has"), ("out0", -1, "slot -1"),
                               ("out0", 10 ** 12, "slot 1000000000000"),
                               ("in0", int(arrs["in0"][1]), r"not the leaf row of input "
                                                            r"element 0")):
        a = arrs[name].copy()
        a[0] = value
        _rejects(tmp_path, pack(dict(arrs, **{name: a})), match)
    _rejects(tmp_path, pack(dict(arrs, out0=arrs["out0"][:-1])), "output elements number 7")
    _rejects(tmp_path, pack(dict(arrs, in0=arrs["in0"].astype(np.float64))),
             "dtype float64, expected int64")


def test_header_fields(tmp_path, saved):
    data, _, _ = saved["guards"]
    arrs = arrays(data)
    meta = json.loads(arrs["meta"].tobytes())
    v = meta["variants"][0]
    cases = [
        ({**meta, "variants": None}, "'variants' is not a non-empty list"),
        ({**meta, "variants": []}, "'variants' is not a non-empty list"),
        ({k: x for k, x in meta.items() if k != "ops"}, "no 'ops' field"),
        ({**meta, "extra": 1}, "unknown field 'extra'"),
        ({**meta, "ops": 3}, "'ops' is not a list"),
        ({**meta, "tapegrad": 1}, "'tapegrad' is 1"),
        ({**meta, "variants": [dict(v, inputs=[[[2], "object"]])] + meta["variants"][1:]},
         r"inputs'\]\[0\] has dtype 'object'"),
        ({**meta, "variants": [dict(x, inputs=[[[3], "float64"]]) for x in meta["variants"]]},
         "input elements number 3"),
        ({**meta, "variants": [dict(v, inputs=[[[-2], "float64"]])] + meta["variants"][1:]},
         r"not \[shape, dtype\]"),
        ({**meta, "variants": [dict(v, inputs=[[[10 ** 12, 10 ** 12], "float64"]])]},
         r"not \[shape, dtype\]"),
        ({**meta, "variants": [dict(v, kind="many")] + meta["variants"][1:]},
         r"\['kind'\] is 'many'"),
        ({**meta, "variants": [dict(v, kind="single", outputs=[])] + meta["variants"][1:]},
         "kind 'single' but 0 outputs"),
        ({**meta, "variants": [dict(v, sites=[])] + meta["variants"][1:]},
         r"guard\): names site 0.0, but variant 0 has 0 guard sites"),
        ({**meta, "variants": [dict(v, sites=[[1, 2, 3, 4]])] + meta["variants"][1:]},
         r"\['sites'\]\[0\] is"),
        ({**meta, "variants": [dict(v, sites=[s[:3] + [not s[3]] for s in v["sites"]])] +
          meta["variants"][1:]}, "its site says the branch was"),
        ({**meta, "variants": [v, dict(meta["variants"][1], inputs=[[[3], "float64"]])]},
         "variant 1 has other inputs"),
        ({**meta, "variants": [v]}, "unexpected array 'in1'"),
        ({**meta, "variants": meta["variants"] + [v]}, "array 'in2' is missing"),
        ({**meta, "ops": meta["ops"] + ["leaf"]}, "names an op twice"),
    ]
    for m, match in cases:
        _rejects(tmp_path, pack(with_meta(arrs, m)), match)


def test_sizes_are_checked_before_anything_is_allocated(tmp_path, saved):
    """A header claiming 10^12 rows gives ValueError, not MemoryError (or a 48 TB array)."""
    data, _, _ = saved["arrays"]
    arrs = arrays(data)
    for shape in ((10 ** 12, 6), (2 ** 62, 2 ** 62), (-1, 6), (-6, -1)):
        _rejects(tmp_path, pack(dict(arrs, rows0=npy(arrs["rows0"], shape))),
                 "shape|bad .npy header")
    files = members(data)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, raw in files.items():
            z.writestr(name, raw)
    raw = bytearray(buf.getvalue())
    # the central directory's uncompressed size of the first member: 2^32 - 1 bytes
    cd = raw.find(b"PK\x01\x02")
    raw[cd + 24:cd + 28] = (2 ** 32 - 1).to_bytes(4, "little")
    _rejects(tmp_path, bytes(raw), "not a readable tapegrad program file")


def test_not_a_program_file(tmp_path, saved):
    data, _, _ = saved["scalar"]
    _rejects(tmp_path, b"", "not a readable tapegrad program file")
    _rejects(tmp_path, data[:100], "not a readable tapegrad program file")
    _rejects(tmp_path, pack({"a": np.ones(3)}), "not a tapegrad program file")
    _rejects(tmp_path, npz({"a.txt": b"hello"}), "not a tapegrad program file")
    _rejects(tmp_path, npz({"meta.npy": npy(np.zeros(2, np.uint8)), "meta": b""}),
             "not a tapegrad program file")
    files = members(data)
    dup = io.BytesIO()
    with zipfile.ZipFile(dup, "w") as z, pytest.warns(UserWarning, match="Duplicate"):
        for name, raw in list(files.items()) + [("rows0.npy", files["rows0.npy"])]:
            z.writestr(name, raw)
    _rejects(tmp_path, dup.getvalue(), "holds 'rows0.npy' twice")
    arrs = arrays(data)
    _rejects(tmp_path, pack(dict(arrs, meta=np.frombuffer(b"\xff\xfe", np.uint8))),
             "no valid header")
    _rejects(tmp_path, pack(dict(arrs, meta=np.frombuffer(b"[" * 100000, np.uint8))),
             "no valid header")
    _rejects(tmp_path, pack(dict(arrs, meta=np.frombuffer(b"9" * 5000, np.uint8))),
             "no valid header")
    _rejects(tmp_path, pack(dict(arrs, meta=np.frombuffer(b"[]", np.uint8))),
             "not a tapegrad program file")
    _rejects(tmp_path, pack(dict(arrs, meta=np.zeros(3, np.float64))),
             "dtype float64, expected uint8")
    _rejects(tmp_path, pack(dict(arrs, extra=np.zeros(3))), "unexpected array 'extra'")
    with pytest.raises(FileNotFoundError):
        tg.load(tmp_path / "nothing.npz")
    with pytest.raises(TypeError):  # not a path (open(3) would read file descriptor 3)
        tg.load(3)
    (tmp_path / "t.npz").write_bytes(data)
    with open(tmp_path / "t.npz") as fh, pytest.raises(TypeError, match="mode 'rb'"):
        tg.load(fh)


def test_load_target_is_checked_first(tmp_path, saved):
    with pytest.raises(ValueError, match="target must be one of"):
        tg.load(tmp_path / "nothing.npz", target="tpu")


def test_loader_op_table_matches_the_generated_interpreters():
    """The loader's table of which slots each op reads (from the registry, as _codegen
    generates the interpreters) covers what the generated source actually reads."""
    from tapegrad._program_file import _op_tables
    nargs = _op_tables()
    reads = interpreter_reads()
    assert {c for c in range(len(nargs)) if nargs[c] >= 0} == set(reads)
    for code, cols in reads.items():
        assert cols <= set(range(1, 1 + int(nargs[code]))), code


if __name__ == "__main__":
    counts, failures = run_mutations(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps({"counts": counts, "failures": failures}))
