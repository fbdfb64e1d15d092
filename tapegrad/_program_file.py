"""Reading ``Program.save`` files without trusting them: every field is checked before any
array reaches the compiled interpreters, which do no bounds checks."""
from __future__ import annotations

import io
import json
import math
import os
import zipfile

import numpy as np

from .tensor import _DTYPES

_MAX_DIM = 2 ** 31      # a dimension of an input or output shape
_MAX_NDIM = 64          # NumPy's limit
_DEFLATE_RATIO = 1100   # zlib expands at most ~1032x: more is a lie about the size
# tapegrad's dtypes by the names save writes; traced inputs are floating point, and
# programs compute real numbers
_OUTPUT_DTYPES = tuple(str(d) for d in _DTYPES if d.kind != "c")
_INPUT_DTYPES = tuple(str(d) for d in _DTYPES if d.kind == "f")
_META_KEYS = ("format", "version", "tapegrad", "ops", "variants")
_VARIANT_KEYS = ("inputs", "outputs", "kind", "sites")


def _short(x):
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


class _File:
    """One file being read: its path for messages, and the failures it can raise."""

    def __init__(self, path):
        self.path = path

    def corrupt(self, what):
        from .replay import FORMAT_VERSION
        return ValueError(f"{self.path} is corrupt: {what}. The file is damaged, or it was "
                          f"not written by Program.save of this tapegrad (program format "
                          f"version {FORMAT_VERSION})")

    def unreadable(self, why):
        return ValueError(f"{self.path} is not a readable tapegrad program file ({why}): the "
                          f"file is damaged, or it is not a program saved by Program.save")


# --- the container: an uncompressed .npz (zip of .npy members) -----------------------------


def _members(f, data):
    """{name: bytes} of the zip archive ``data``, with the sizes the archive claims checked
    against its real size before anything is read."""
    # zipfile raises many kinds of exceptions on damaged archives (BadZipFile, EOFError,
    # NotImplementedError for unknown methods, RuntimeError for encrypted members, zlib
    # errors...): all of them mean the same thing here
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = zf.infolist()
    except Exception as e:  # noqa: BLE001 (see above)
        raise f.unreadable(f"{type(e).__name__}: {e}") from None
    out = {}
    total = 0
    for info in infos:
        name = info.filename
        if info.compress_type == zipfile.ZIP_STORED:
            limit = len(data)
        elif info.compress_type == zipfile.ZIP_DEFLATED:
            limit = min(len(data), info.compress_size) * _DEFLATE_RATIO
        else:
            raise f.unreadable(f"member {_short(name)} uses compression method "
                               f"{info.compress_type}")
        total += info.file_size
        if info.file_size > limit or info.compress_size > len(data) or \
                total > len(data) * _DEFLATE_RATIO:
            raise f.unreadable(f"member {_short(name)} claims {info.file_size} bytes, more "
                               f"than the file holds")
        if not name.endswith(".npy"):
            raise ValueError(f"{f.path} is not a tapegrad program file (its member "
                             f"{_short(name)} is not a .npy array)")
        if name[:-4] in out:
            raise f.corrupt(f"the archive holds {_short(name)} twice")
        try:
            out[name[:-4]] = zf.read(info)
        except Exception as e:  # noqa: BLE001 (as above)
            raise f.unreadable(f"member {_short(name)}: {type(e).__name__}: {e}") from None
    return out


def _array(f, name, raw, kind, itemsize):
    """The ``.npy`` bytes ``raw`` as an array of dtype kind ``kind`` and ``itemsize``,
    native byte order; the header's shape is checked against the data before use."""
    fp = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except Exception as e:  # noqa: BLE001 (NumPy's header parser: ValueError, SyntaxError...)
        raise f.corrupt(f"array {name!r} has a bad .npy header ({type(e).__name__}: "
                        f"{e})") from None
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise f.corrupt(f"array {name!r} has the invalid shape {_short(shape)}")
    if dtype.kind != kind or dtype.itemsize != itemsize:
        raise f.corrupt(f"array {name!r} has dtype {dtype}, expected "
                        f"{np.dtype(kind + str(itemsize))}")
    count = math.prod(shape)
    body = memoryview(raw)[fp.tell():]
    if count * itemsize != len(body):
        raise f.corrupt(f"array {name!r} has shape {list(shape)} ({count} elements) but "
                        f"{len(body)} bytes of data")
    a = np.frombuffer(body, dtype=dtype, count=count).reshape(shape,
                                                              order="F" if fortran else "C")
    # a writable native copy: the interpreters are compiled for writable arrays
    return np.array(a, dtype=dtype.newbyteorder("="), order="C")


# --- the header --------------------------------------------------------------------------------


def _header(f, members):
    from .replay import FORMAT, FORMAT_VERSION
    raw = members.get("meta")
    if raw is None:
        raise ValueError(f"{f.path} is not a tapegrad program file (no header)")
    meta = _array(f, "meta", raw, "u", 1)
    try:
        if meta.ndim != 1:
            raise ValueError("not 1-d")
        meta = json.loads(meta.tobytes().decode())
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, too deep, too long an int
        raise ValueError(f"{f.path} is not a tapegrad program file (no valid header)") \
            from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{f.path} is not a tapegrad program file")
    version = meta.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise ValueError(f"{f.path} was written in program format version {_short(version)} "
                         f"(tapegrad {_short(meta.get('tapegrad'))}); this tapegrad reads "
                         f"version {FORMAT_VERSION}: trace the function again")
    for k in _META_KEYS:
        if k not in meta:
            raise f.corrupt(f"the header has no {k!r} field")
    for k in meta:
        if k not in _META_KEYS:
            raise f.corrupt(f"the header has an unknown field {_short(k)}")
    if not isinstance(meta["tapegrad"], str):
        raise f.corrupt(f"header field 'tapegrad' is {_short(meta['tapegrad'])}, not a "
                        f"version string")
    ops = meta["ops"]
    if not isinstance(ops, list) or not ops or not all(isinstance(n, str) for n in ops):
        raise f.corrupt("header field 'ops' is not a list of op names")
    if len(set(ops)) != len(ops):
        raise f.corrupt("header field 'ops' names an op twice")
    variants = meta["variants"]
    if not isinstance(variants, list) or not variants:
        raise f.corrupt("header field 'variants' is not a non-empty list")
    for i, vm in enumerate(variants):
        _variant_header(f, i, vm)
        if i and any(vm[k] != variants[0][k] for k in ("inputs", "outputs", "kind")):
            raise f.corrupt(f"variant {i} has other inputs, outputs or kind than variant 0")
    return meta


def _specs(f, where, specs, dtypes):
    if not isinstance(specs, list):
        raise f.corrupt(f"{where} is not a list")
    for j, s in enumerate(specs):
        ok = isinstance(s, list) and len(s) == 2 and isinstance(s[0], list) and \
            len(s[0]) <= _MAX_NDIM and \
            all(type(d) is int and 0 <= d <= _MAX_DIM for d in s[0])
        if not ok:
            raise f.corrupt(f"{where}[{j}] is {_short(s)}, not [shape, dtype]")
        if s[1] not in dtypes:
            raise f.corrupt(f"{where}[{j}] has dtype {_short(s[1])}, not one of "
                            f"{', '.join(dtypes)}")


def _variant_header(f, i, vm):
    where = f"header field variants[{i}]"
    if not isinstance(vm, dict) or sorted(vm) != sorted(_VARIANT_KEYS):
        raise f.corrupt(f"{where} is not a dict with the fields {', '.join(_VARIANT_KEYS)}")
    _specs(f, f"{where}['inputs']", vm["inputs"], _INPUT_DTYPES)
    _specs(f, f"{where}['outputs']", vm["outputs"], _OUTPUT_DTYPES)
    if vm["kind"] not in ("single", "tuple"):
        raise f.corrupt(f"{where}['kind'] is {_short(vm['kind'])}, not 'single' or 'tuple'")
    if vm["kind"] == "single" and len(vm["outputs"]) != 1:
        raise f.corrupt(f"{where} has kind 'single' but {len(vm['outputs'])} outputs")
    sites = vm["sites"]
    if not isinstance(sites, list):
        raise f.corrupt(f"{where}['sites'] is not a list")
    for j, s in enumerate(sites):
        if not (isinstance(s, list) and len(s) == 4 and isinstance(s[0], str) and
                (s[1] is None or type(s[1]) is int) and isinstance(s[2], str) and
                type(s[3]) in (bool, str)):
            raise f.corrupt(f"{where}['sites'][{j}] is {_short(s)}, not [file, line, text, "
                            f"taken]")


# --- the rows ------------------------------------------------------------------------------


_NARGS = []


def _op_tables():
    """How many slots (a, b, c) each opcode reads, -1 for ops the interpreters have no
    branch for: the selection ``_codegen`` generates the interpreters' branches from."""
    if _NARGS:
        return _NARGS[0]
    from .interpreters._codegen import _inputs, _replay_ops
    from .ops import BY_NAME, OPS
    nargs = np.full(len(OPS), -1, dtype=np.int64)  # -1: the interpreters have no branch
    nargs[BY_NAME["leaf"].code] = nargs[BY_NAME["const"].code] = 0
    nargs[BY_NAME["guard"].code] = 1
    for op in _replay_ops():
        nargs[op.code] = len(_inputs(op))
    _NARGS.append(nargs)
    return nargs


def _first(bad):
    return int(np.argmax(bad))


def _integral(x):
    return np.isfinite(x) & (x == np.floor(x))


def _rows(f, i, rows, ins, outs, vm, names):
    """Check variant ``i``'s arrays; returns ``rows`` (changed in place) with this
    tapegrad's opcodes."""
    from .ops import BY_NAME, OPS
    from .interpreters.program import NCOL
    tag = f"rows{i}"
    if rows.ndim != 2 or rows.shape[1] != NCOL:
        raise f.corrupt(f"array {tag!r} has shape {list(rows.shape)}, expected [rows, {NCOL}]")
    n = rows.shape[0]
    op = rows[:, 0]
    bad = ~(_integral(op) & (op >= 0) & (op < len(names)))
    if bad.any():
        k = _first(bad)
        raise f.corrupt(f"{tag} row {k}: opcode {float(op[k])!r} is not an index into the "
                        f"header's {len(names)} op names")
    remap = np.array([BY_NAME[m].code if m in BY_NAME else -1 for m in names], np.int64)
    codes = remap[op.astype(np.int64)]
    if (codes < 0).any():
        missing = sorted({names[int(c)] for c in op[codes < 0]})
        raise ValueError(f"{f.path} uses ops this tapegrad does not have "
                         f"({', '.join(map(_short, missing))}): it comes from an incompatible "
                         f"version (tapegrad {_short(f.version)})")
    # x ** c of powc_special's exponents, written as powc by a tapegrad before that op: its
    # rows now (powc's compiled branches would run pow, not torch's arms)
    from .ops.elementwise import POWC_SPECIAL
    codes[(codes == BY_NAME["powc"].code) & np.isin(rows[:, 4], sorted(POWC_SPECIAL))] = \
        BY_NAME["powc_special"].code
    nargs = _op_tables()[codes]
    if (nargs < 0).any():
        k = _first(nargs < 0)
        raise f.corrupt(f"{tag} row {k}: op {OPS[codes[k]].name!r} does not occur in traced "
                        f"programs")
    # operand slots: each input the op reads is an earlier row, the columns it does not
    # read are -1 (the interpreters read nothing else, so nothing else needs a bound)
    ks = np.arange(n)
    for j, col in enumerate("abc"):
        s = rows[:, 1 + j]
        used = nargs > j
        bad = np.where(used, ~(_integral(s) & (s >= 0) & (s < ks)), s != -1)
        if bad.any():
            k = _first(bad)
            what = (f"reads slot {float(s[k])!r}; a row reads earlier rows only" if used[k]
                    else f"is {float(s[k])!r}, but the op reads no slot there (-1)")
            raise f.corrupt(f"{tag} row {k} ({OPS[codes[k]].name}): column {col!r} {what}")
    nin = sum(math.prod(s) for s, _ in vm["inputs"])
    nout = sum(math.prod(s) for s, _ in vm["outputs"])
    for name, a, count, what in ((f"in{i}", ins, nin, "input elements"),
                                 (f"out{i}", outs, nout, "output elements")):
        if a.shape != (count,):
            raise f.corrupt(f"array {name!r} has shape {list(a.shape)}, but the header's "
                            f"{what} number {count}")
        bad = (a < 0) | (a >= n)
        if bad.any():
            j = _first(bad)
            raise f.corrupt(f"{name}[{j}] is slot {int(a[j])}, but the program has {n} rows")
    leaf = codes == BY_NAME["leaf"].code
    c0 = rows[:, 4]
    bad = leaf & ~(_integral(c0) & (c0 >= 0) & (c0 < nin))
    if bad.any():
        k = _first(bad)
        raise f.corrupt(f"{tag} row {k} (leaf): reads input element {float(c0[k])!r}, but "
                        f"the inputs have {nin} elements")
    guard = codes == BY_NAME["guard"].code
    sites = vm["sites"]
    c1 = rows[:, 5]
    bad = guard & ~(_integral(c1) & (c1 >= 0) & (c1 < len(sites)))
    if bad.any():
        k = _first(bad)
        raise f.corrupt(f"{tag} row {k} (guard): names site {float(c1[k])!r}, but variant "
                        f"{i} has {len(sites)} guard sites")
    for k in np.nonzero(guard)[0].tolist():
        # a branch site (taken: bool) has one guard row expecting it; a mask or value site
        # (taken: what was read) has a row per element, each expecting 1.0 or 0.0
        taken = sites[int(c1[k])][3]
        if (c0[k] != float(taken) if type(taken) is bool else c0[k] not in (0.0, 1.0)):
            raise f.corrupt(f"{tag} row {k} (guard): expects {float(c0[k])!r}, but its site "
                            f"says the branch was {taken}")
    # input element j's gradient is read at the leaf row that reads element j
    bad = ~leaf[ins] | (c0[ins] != np.arange(nin))
    if bad.any():
        j = _first(bad)
        raise f.corrupt(f"in{i}[{j}] is slot {int(ins[j])}, which is not the leaf row of "
                        f"input element {j}")
    rows[:, 0] = codes
    return rows


def read(path):
    """The variants of the program file at ``path`` (a path or a binary file), checked:
    [(rows, input slots, output slots, inputs, outputs, kind, sites)]."""
    if hasattr(path, "read"):
        data = path.read() if not isinstance(path, io.TextIOBase) else ""
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"load: {path!r} is open in text mode; open it with mode 'rb'")
        data = bytes(data)
    else:
        with open(os.fspath(path), "rb") as fh:  # OSError (no such file...) is not ours
            data = fh.read()
    f = _File(path)
    members = _members(f, data)
    meta = _header(f, members)
    f.version = meta["tapegrad"]
    variants = meta["variants"]
    want = {"meta"} | {f"{p}{i}" for i in range(len(variants)) for p in ("rows", "in", "out")}
    missing, extra = sorted(want - set(members)), sorted(set(members) - want)
    if missing:
        raise f.corrupt(f"array {missing[0]!r} is missing")
    if extra:
        name = extra[0]
        raise f.corrupt(f"unexpected array {_short(name)} (the header lists "
                        f"{len(variants)} variant(s))")
    out = []
    for i, vm in enumerate(variants):
        rows = _array(f, f"rows{i}", members[f"rows{i}"], "f", 8)
        ins = _array(f, f"in{i}", members[f"in{i}"], "i", 8)
        outs = _array(f, f"out{i}", members[f"out{i}"], "i", 8)
        rows = _rows(f, i, rows, ins, outs, vm, meta["ops"])
        out.append((rows, ins, outs,
                    [(tuple(s), np.dtype(d)) for s, d in vm["inputs"]],
                    [(tuple(s), np.dtype(d)) for s, d in vm["outputs"]],
                    vm["kind"], [tuple(s) for s in vm["sites"]]))
    return out
