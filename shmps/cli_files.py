"""File verbs of ``shmps-tool``: ``dump``, ``check`` and ``convert``.

They read and write binary matrix file sets (:mod:`shmps.files`) and need neither shared
memory nor the compiled core.  Output is streamed in chunks of :data:`ENTRY_CHUNK`
entries, so dumping a file of any size needs bounded memory.  Every error is a
:class:`shmps.Error`; :mod:`shmps.cli` prints it as one line and exits 2.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import time
import zipfile
from collections import Counter
from contextlib import contextmanager
from typing import IO, Any, Iterator

import numpy as np

from . import files as _files
from .errors import CapacityError, CorruptFile, InvalidArgument, NotFound
from .files import (ARRAYS, CHUNK, CSR, INDEX_DTYPES, PROGRESS_MIN_BYTES, VALUE_DTYPES,
                    MatrixSet, SetWriter, _check_structure, _scipy_sparse, build_meta,
                    check_held, finish_replacement, read_checkpoint_manifest, read_csr,
                    remove_dead_temporaries, temporary_path, validate_all)

#: Entries formatted per write when printing (bounded memory, bounded string size).
ENTRY_CHUNK = 1 << 16
#: Rows formatted per write in the table format.
ROW_CHUNK = 1 << 14
# Passes of at least PROGRESS_MIN_BYTES (shmps.files: validation, conversions, summary
# statistics) show a progress bar when stderr is a terminal (files.progress_bar).
#: Dense rows are converted in blocks of about this many bytes.
BLOCK_BYTES = 32 << 20

# ----------------------------------------------------------------------------- parsing


def _row_range(text: str) -> tuple[int | None, int | None]:
    """Parse ``A:B``, ``A:``, ``:B`` or ``A`` (one row) for ``--rows``."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            lo = int(a) if a.strip() else None
            hi = int(b) if b.strip() else None
        else:
            lo = int(text)
            hi = lo + 1
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected A:B (row range, A and B non-negative integers), got {text!r}") from None
    if (lo is not None and lo < 0) or (hi is not None and hi < 0):
        raise argparse.ArgumentTypeError(
            f"row bounds must be non-negative (no negative indexing), got {text!r}")
    if lo is not None and hi is not None and hi < lo:
        raise argparse.ArgumentTypeError(f"empty range {text!r}: B must be >= A")
    return lo, hi


def _nonneg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") \
            from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return v


def _add_read_flags(p: argparse.ArgumentParser, what: str = "PREFIX") -> None:
    g = p.add_argument_group(f"how to read {what} (override the .meta and the inference)")
    g.add_argument("--rowcnt-dtype", choices=INDEX_DTYPES, metavar="D",
                   help="dtype of .rowcnt: int32 or int64")
    g.add_argument("--colidx-dtype", choices=INDEX_DTYPES, metavar="D",
                   help="dtype of .colidx: int32 or int64")
    g.add_argument("--value-dtype", choices=VALUE_DTYPES, metavar="D",
                   help="dtype of .value: " + ", ".join(VALUE_DTYPES))
    g.add_argument("--cols", type=_nonneg, metavar="C",
                   help="number of columns (default: .meta, else largest column + 1)")
    g.add_argument("--array", metavar="NAME",
                   help="which array supplies the values: value (default) or an optimizer "
                        "state array state0, state1, ... that the .meta declares (same "
                        "structure)")


_FORMATS = ("table", "summary", "json", "csv")

_DUMP_EPILOG = """\
formats:
  table    '# R x C ...' header, then 'row I: (col, value) (col, value) ...' per row
  summary  shape, nnz, density, dtypes (and what was inferred, why), per-row nnz
           min/median/max, value min/max/mean over finite values, NaN/Inf counts
  json     {"rows":R,"cols":C,"dtypes":{...},"rowcnt":[...],"colidx":[...],"value":[...]}
           values are JSON numbers; NaN and infinities are the strings "nan", "inf",
           "-inf"; with --rows/--head it is the sub-matrix of those rows (rowcnt
           rebased to start at 0)
  csv      header 'row,col,value', then one line per entry

A dense set (its .meta says "kind": "dense", e.g. a checkpoint tensor ckpt/t0) has
only PREFIX.value: every row holds cols entries; the structure is implicit and
printed as if stored.  --array state0 shows an optimizer state array instead of the
values.  A checkpoint directory with --tensor NAME picks that tensor's set.

examples:
  shmps-tool dump data/X
  shmps-tool dump data/X --format summary
  shmps-tool dump ckpt/t0 --format summary
  shmps-tool dump ckpt --tensor fc.w --array state0 --head 5
  shmps-tool dump data/X --format csv --rows 100:200 > part.csv
  shmps-tool dump scipy_X --rowcnt-dtype int32 --value-dtype float64
  shmps-tool dump --store model --tensor X --format summary
"""

_CONVERT_EPILOG = """\
directions (chosen by the file extensions):
  SRC.npz -> DST   scipy.sparse.save_npz file (any format; converted to CSR, structure
                   kept as is, explicit zeros included) -> file set DST.rowcnt/...
  SRC.npy -> DST   dense 2-d array -> file set; only the nonzero entries are stored
                   (NaN counts as nonzero) unless --keep-zeros stores every entry
  SRC -> DST.npz   file set -> scipy CSR matrix (needs scipy; no float16 in scipy)
  SRC -> DST.npy   file set -> dense 2-d array (duplicate entries are summed; an
                   integer sum the dtype cannot hold is refused)
DST is replaced atomically (per file).  Conversions of more than 64 MiB (and the
check of a file-set SRC) show a progress bar on stderr when it is a terminal.

examples:
  shmps-tool convert X.npz data/X
  shmps-tool convert W.npy data/W --keep-zeros
  shmps-tool convert data/X X.npz
  shmps-tool convert data/X X.npy --dtype float64
"""


def register(sub: Any) -> None:
    """Add the ``dump``, ``check`` and ``convert`` parsers to ``sub`` (argparse
    subparsers); each sets ``func`` to its verb."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "dump", help="print a binary matrix file set (or a live tensor)",
        description="Print the file set PREFIX.rowcnt/.colidx/.value (+ optional "
                    "PREFIX.meta) after validating it, or a live tensor with "
                    "--store NAME --tensor T.",
        epilog=_DUMP_EPILOG, formatter_class=raw)
    p.add_argument("prefix", nargs="?", metavar="PREFIX",
                   help="file set prefix (X for X.rowcnt, X.colidx, X.value)")
    p.add_argument("--format", choices=_FORMATS, default="table",
                   help="output format (default: table)")
    p.add_argument("--rows", type=_row_range, metavar="A:B",
                   help="only rows A..B-1 (table, csv, json); A:, :B and A also work")
    p.add_argument("--head", type=_nonneg, metavar="N",
                   help="only the first N rows (of --rows if given)")
    _add_read_flags(p)
    g = p.add_argument_group("live tensor (instead of PREFIX), or a checkpoint's tensor")
    g.add_argument("--store", metavar="NAME", help="store name")
    g.add_argument("--tensor", metavar="T",
                   help="tensor name in the store, or in the checkpoint directory PREFIX")
    g.add_argument("--namespace", metavar="NS",
                   help="store namespace (default: $SHMPS_NAMESPACE or none)")
    p.set_defaults(func=dump)

    p = sub.add_parser(
        "check", help="validate a binary matrix file set",
        description="Validate PREFIX.rowcnt/.colidx/.value (+ .meta) and print "
                    "'ok: R x C, nnz N (dtypes ...)', or one error line naming the file, "
                    "the position and the defect (exit status 2).",
        epilog="Checks the values and every optimizer state array the .meta declares "
               "(--array NAME: only that one).\n\nexamples:\n  shmps-tool check data/X\n"
               "  shmps-tool check scipy_X --rowcnt-dtype int32\n"
               "  shmps-tool check ckpt/t0", formatter_class=raw)
    p.add_argument("prefix", metavar="PREFIX", help="file set prefix")
    p.add_argument("--finish", action="store_true",
                   help="first finish a replacement of the set that a writer on another "
                        "host left half done (its journal, .PREFIX.replacing): only once "
                        "no writer of PREFIX runs on any host sharing the directory")
    _add_read_flags(p)
    p.set_defaults(func=check)

    p = sub.add_parser(
        "convert", help="convert between file sets and scipy .npz / numpy .npy",
        description="Convert SRC to DST: a scipy .npz or a dense .npy into a file set, "
                    "or a file set into .npz or .npy.",
        epilog=_CONVERT_EPILOG, formatter_class=raw)
    p.add_argument("src", metavar="SRC", help="X.npz, X.npy or a file set prefix")
    p.add_argument("dst", metavar="DST", help="a file set prefix, X.npz or X.npy")
    p.add_argument("--keep-zeros", action="store_true",
                   help="(.npy SRC) store every entry of the dense array, zeros included")
    p.add_argument("--dtype", choices=VALUE_DTYPES, metavar="D",
                   help="cast the values to D (numpy same_kind rule): "
                        + ", ".join(VALUE_DTYPES))
    _add_read_flags(p, "a file-set SRC")
    p.set_defaults(func=convert)


def _read_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {"rowcnt_dtype": args.rowcnt_dtype, "colidx_dtype": args.colidx_dtype,
            "value_dtype": args.value_dtype, "cols": args.cols}


def _read_args(args: argparse.Namespace) -> dict[str, Any]:
    """read_csr's keyword arguments from the reading flags (``--array`` included)."""
    return {**_read_flags(args), "array": args.array}


# ----------------------------------------------------------------------------- formatting


def value_strings(a: np.ndarray, *, for_json: bool = False) -> list[str]:
    """Decimal strings of ``a``: integers as is; floats as the shortest decimal that
    reads back (parse as float64, cast to the dtype) to the identical value -- numpy's
    shortest repr for the dtype, or the exact float64 repr where that would not round
    trip.  NaN/Inf are ``nan``/``inf``/``-inf``, quoted with ``for_json``.

    Cost: O(len(a)) vectorised, plus a Python step per non-finite or patched element.
    """
    arr = np.asarray(a)
    if arr.dtype.kind in "iub":
        return arr.astype(np.int64).astype(str).tolist()
    s = arr.astype(str)
    finite = np.isfinite(arr)
    back = np.zeros(len(arr), dtype=np.float64)
    back[finite] = s[finite].astype(np.float64)
    with np.errstate(over="ignore"):
        bad = finite & (back.astype(arr.dtype) != arr)
    out: list[str] = s.tolist()
    for i in np.flatnonzero(bad):
        out[i] = repr(float(arr[i]))
    if for_json:
        for i in np.flatnonzero(~finite):
            out[i] = f'"{out[i]}"'
    return out


def _index_strings(a: np.ndarray) -> list[str]:
    return np.asarray(a).astype(str).tolist()


def _write_list(out: IO[str], arr: Any, start: int, stop: int, *, base: int = 0,
                values: bool = False) -> None:
    """Write ``arr[start:stop]`` (minus ``base``) as comma-separated JSON numbers, chunk
    by chunk (``arr`` is sliced per chunk: a memmap or an implicit structure is never
    read or built whole)."""
    first = True
    for s in range(start, stop, ENTRY_CHUNK):
        seg = np.asarray(arr[s:min(s + ENTRY_CHUNK, stop)])
        if values:
            items = value_strings(seg, for_json=True)
        else:
            items = _index_strings(seg.astype(np.int64) - base if base else seg)
        if not first:
            out.write(",")
        out.write(",".join(items))
        first = False


def _window(args: argparse.Namespace, rows: int) -> tuple[int, int]:
    lo, hi = 0, rows
    if args.rows is not None:
        a, b = args.rows
        lo = a if a is not None else 0
        if lo > rows:
            raise InvalidArgument(f"--rows {lo}:...: the matrix has {rows} rows",
                                  hint="rows are numbered from 0 to rows - 1")
        hi = rows if b is None else min(b, rows)
    if args.head is not None:
        hi = min(hi, lo + args.head)
    return lo, hi


def _dtype_line(ms: MatrixSet) -> str:
    if ms.kind == "dense":
        return f"dense, structure implicit; {ms.array} {ms.dtypes['value']}"
    if ms.array != "value":
        return (f"rowcnt {ms.dtypes['rowcnt']}, colidx {ms.dtypes['colidx']}, "
                f"{ms.array} {ms.dtypes['value']}")
    return ", ".join(f"{k} {ms.dtypes[k]}" for k in ARRAYS)


def _row_blocks(rowcnt: np.ndarray, lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """Consecutive row ranges ``[ra, rb)`` of at most ROW_CHUNK rows and ENTRY_CHUNK
    entries (a single longer row is its own range).  Needs rowcnt validated."""
    ra = lo
    while ra < hi:
        end = min(hi, ra + ROW_CHUNK)
        limit = int(rowcnt[ra]) + ENTRY_CHUNK
        k = int(np.searchsorted(np.asarray(rowcnt[ra:end + 1]), limit, side="right"))
        rb = max(ra + k - 1, ra + 1)
        yield ra, min(rb, end)
        ra = min(rb, end)


def _write_table(out: IO[str], ms: MatrixSet, lo: int, hi: int) -> None:
    rowcnt, colidx, value = ms.csr
    window = f", rows {lo}:{hi}" if (lo, hi) != (0, ms.rows) else ""
    out.write(f"# {ms.rows} x {ms.cols}, nnz {ms.nnz} ({_dtype_line(ms)}){window}\n")
    for ra, rb in _row_blocks(rowcnt, lo, hi):
        e0, e1 = int(rowcnt[ra]), int(rowcnt[rb])
        if e1 - e0 > ENTRY_CHUNK:  # one long row: stream its entries
            out.write(f"row {ra}:")
            for s in range(e0, e1, ENTRY_CHUNK):
                e = min(s + ENTRY_CHUNK, e1)
                cs, vs = _index_strings(colidx[s:e]), value_strings(value[s:e])
                out.write(" " + " ".join(f"({c}, {v})" for c, v in zip(cs, vs)))
            out.write("\n")
            continue
        cs, vs = _index_strings(colidx[e0:e1]), value_strings(value[e0:e1])
        pairs = [f"({c}, {v})" for c, v in zip(cs, vs)]
        offs = (np.asarray(rowcnt[ra:rb + 1], dtype=np.int64) - e0).tolist()
        lines = []
        for i in range(rb - ra):
            a, b = offs[i], offs[i + 1]
            lines.append(f"row {ra + i}:" + (" " + " ".join(pairs[a:b]) if b > a else ""))
        out.write("\n".join(lines) + "\n")
    if hi < ms.rows:
        more = ms.rows - hi
        out.write(f"# {more} more row{'s' if more != 1 else ''} not shown "
                  f"(--rows {hi}: shows {'them' if more != 1 else 'it'})\n")


def _write_csv(out: IO[str], ms: MatrixSet, lo: int, hi: int) -> None:
    rowcnt, colidx, value = ms.csr
    out.write("row,col,value\n")
    for ra, rb in _row_blocks(rowcnt, lo, hi):
        offsets = np.asarray(rowcnt[ra:rb + 1], dtype=np.int64)
        e0, e1 = int(offsets[0]), int(offsets[-1])
        for s in range(e0, e1, ENTRY_CHUNK):
            e = min(s + ENTRY_CHUNK, e1)
            rows = np.searchsorted(offsets, np.arange(s, e), side="right") - 1 + ra
            lines = [f"{r},{c},{v}" for r, c, v in zip(_index_strings(rows),
                                                        _index_strings(colidx[s:e]),
                                                        value_strings(value[s:e]))]
            out.write("\n".join(lines) + "\n")


def _write_json(out: IO[str], ms: MatrixSet, lo: int, hi: int) -> None:
    rowcnt, colidx, value = ms.csr
    e0, e1 = int(rowcnt[lo]), int(rowcnt[hi])
    out.write(f'{{"rows":{hi - lo},"cols":{ms.cols},'
              f'"dtypes":{json.dumps(ms.dtypes, separators=(",", ":"))},"rowcnt":[')
    _write_list(out, rowcnt, lo, hi + 1, base=e0)
    out.write('],"colidx":[')
    _write_list(out, colidx, e0, e1)
    out.write('],"value":[')
    _write_list(out, value, e0, e1, values=True)
    out.write("]}\n")


def _source_note(ms: MatrixSet, key: str) -> str:
    src = ms.sources.get(key, "")
    if src == "inferred":
        return f"inferred: {ms.inferred.get(key, '')}"
    if src == "argument":
        return f"from --{key}-dtype" if key != "cols" else "from --cols"
    if src == "meta":
        return "from .meta"
    if src == "array":
        return "from the tensor"
    if src == "implicit":
        return ("implicit: row i starts at i * cols" if key == "rowcnt"
                else "implicit: every row holds columns 0 .. cols - 1")
    return src


def row_nnz_stats(rowcnt: np.ndarray, bar: Any = None) -> tuple[int, float, int, int]:
    """``(min, median, max, empty rows)`` of the entries per row, exact.

    One chunked pass; memory O(distinct row lengths) (at most ~sqrt(2 * nnz)).  A
    ``bar`` (progress) is advanced by the bytes of ``rowcnt`` read, all of them.
    """
    rows = len(rowcnt) - 1
    size = np.asarray(rowcnt[:0]).dtype.itemsize
    if rows <= 0:
        if bar is not None:
            bar.update(len(rowcnt) * size)
        return 0, 0.0, 0, 0
    hist: Counter[int] = Counter()
    for s in range(0, rows, CHUNK):
        seg = np.diff(np.asarray(rowcnt[s:min(s + CHUNK, rows) + 1], dtype=np.int64))
        u, k = np.unique(seg, return_counts=True)
        hist.update(dict(zip(u.tolist(), k.tolist())))
        if bar is not None:   # (chunks overlap by one entry: the first counts it)
            bar.update((len(seg) + (s == 0)) * size)
    keys = sorted(hist)

    def nth(n: int) -> int:
        acc = 0
        for key in keys:
            acc += hist[key]
            if acc > n:
                return key
        return keys[-1]

    median = (nth((rows - 1) // 2) + nth(rows // 2)) / 2
    return keys[0], median, keys[-1], hist.get(0, 0)


def value_stats(value: np.ndarray, bar: Any = None) -> dict[str, Any]:
    """min/max/mean over the finite values, and NaN/+Inf/-Inf counts.

    One chunked pass, O(CHUNK) memory; sums in float64 (integers: exact int64).  A
    ``bar`` (progress) is advanced by the bytes of ``value`` read.
    """
    n = len(value)
    isfloat = np.asarray(value[:0]).dtype.kind == "f"
    lo: Any = None
    hi: Any = None
    total: float | int = 0
    finite_n = nan = pinf = ninf = 0
    for s in range(0, n, CHUNK):
        seg = np.asarray(value[s:s + CHUNK])
        if bar is not None:
            bar.update(seg.nbytes)
        if isfloat:
            fin = np.isfinite(seg)
            nan += int(np.isnan(seg).sum())
            pinf += int(np.isposinf(seg).sum())
            ninf += int(np.isneginf(seg).sum())
            seg = seg[fin]
            total += float(np.sum(seg, dtype=np.float64))
        else:
            total += int(np.sum(seg, dtype=np.int64))
        if seg.size:
            a, b = seg.min(), seg.max()
            lo = a if lo is None or a < lo else lo
            hi = b if hi is None or b > hi else hi
            finite_n += seg.size
    return {"min": lo, "max": hi, "mean": (total / finite_n) if finite_n else None,
            "finite": finite_n, "nan": nan, "posinf": pinf, "neginf": ninf}


def _write_summary(out: IO[str], ms: MatrixSet, label: str) -> None:
    rowcnt, colidx, value = ms.csr
    # the statistics read rowcnt (not a dense set's: implicit) and the values once, after
    # the validation's own bar (read_csr): a 1.6 GB set took 4 s here, silently before
    name = ms.prefix if ms.prefix is not None else label.split(":", 1)[1].strip()
    total = (0 if ms.kind == "dense" else _files._nbytes(rowcnt)) + _files._nbytes(value)
    with _progress(total, f"summary {name}") as bar:
        lines = _summary_lines(ms, label, bar)
    # (printed once the bar is gone: on a terminal it would share the line)
    out.write("\n".join(lines) + "\n")


def _summary_lines(ms: MatrixSet, label: str, bar: Any) -> list[str]:
    rowcnt, colidx, value = ms.csr
    cells = ms.rows * ms.cols
    density = f"{ms.nnz / cells:.6g}" if cells else "n/a (no cells)"
    lines = [f"{label}",
             f"shape:     {ms.rows} x {ms.cols}",
             f"nnz:       {ms.nnz}",
             f"density:   {density}",
             "dtypes:"]
    for k in ARRAYS:
        name = ms.array if k == "value" else k
        lines.append(f"  {name}: {ms.dtypes[k]} ({_source_note(ms, k)})")
    lines.append(f"cols:      {ms.cols} ({_source_note(ms, 'cols')})")
    if ms.kind == "dense":
        shape = " x ".join(map(str, ms.shape)) if ms.shape else "scalar"
        lines.insert(1, f"kind:      dense (tensor shape {shape}; rows = first axis, "
                        "cols = the others; structure implicit)")
        mn, med, mx, empty = ms.cols, float(ms.cols), ms.cols, ms.rows if ms.cols == 0 else 0
        if ms.rows == 0:
            mn, med, mx = 0, 0.0, 0
    else:
        mn, med, mx, empty = row_nnz_stats(rowcnt, bar)
    lines.append(f"row nnz:   min {mn}, median {med:g}, max {mx} ({empty} empty rows)")
    st = value_stats(value, bar)
    if st["finite"]:
        fmt = value_strings(np.array([st["min"], st["max"]], dtype=np.asarray(value[:0]).dtype))
        lines.append(f"values:    min {fmt[0]}, max {fmt[1]}, mean {st['mean']:.6g} "
                     f"(over {st['finite']} finite values)")
    else:
        lines.append("values:    no finite values")
    lines.append(f"nonfinite: NaN {st['nan']}, +Inf {st['posinf']}, -Inf {st['neginf']}")
    extra = [k for k in ms.meta if k not in ("version", "kind", "rows", "cols", "nnz",
                                               "dtypes", "shape")]
    if len(ms.arrays) > 1:
        others = [a for a in ms.arrays if a != ms.array]
        lines.append(f"arrays:    {ms.array} shown; also {', '.join(others)} (--array NAME)")
    if ms.prefix is not None and isinstance(ms.meta.get("name"), str):
        lines.append(f"tensor:    {ms.meta['name']!r} (checkpointed)")
    opt = ms.meta.get("optimizer")
    if isinstance(opt, dict):
        params = ", ".join(f"{k}={v}" for k, v in opt.items() if k != "type")
        step = f"; step {ms.meta['step']}" if "step" in ms.meta else ""
        lines.append(f"optimizer: {opt.get('type')}{f'({params})' if params else ''}{step}")
    if ms.prefix is None:
        pass
    elif ms.meta:
        lines.append(f"meta:      version {ms.meta.get('version', 1)}"
                     + (f"; other keys: {', '.join(extra)}" if extra else ""))
    else:
        lines.append("meta:      none (dtypes and cols inferred unless given by flags)")
    return lines


# ----------------------------------------------------------------------------- verbs


def _load_store_tensor(args: argparse.Namespace) -> MatrixSet:
    """The live tensor as a MatrixSet, through ``shmps.cli_store.tensor_as_matrix(store,
    tensor, namespace)`` (imported at call time, owned by the store verbs)."""
    if not args.tensor:
        raise InvalidArgument("dump --store NAME needs --tensor T")
    if any(v is not None for v in _read_flags(args).values()):
        raise InvalidArgument("--rowcnt-dtype/--colidx-dtype/--value-dtype/--cols apply to "
                              "file sets, not to --store")

    from . import cli_store

    fn = getattr(cli_store, "tensor_as_matrix", None)
    if fn is None:
        raise InvalidArgument("dump --store is not available in this build "
                              "(shmps.cli_store.tensor_as_matrix is missing)",
                              hint="dump a file set instead: shmps-tool dump PREFIX")
    if args.array not in (None, "value"):
        ms = fn(args.store, args.tensor, args.namespace, array=args.array)
    else:
        ms = fn(args.store, args.tensor, args.namespace)
    if not isinstance(ms, MatrixSet):
        ms = MatrixSet.from_csr(ms)
    return ms


@contextmanager
def _quiet_broken_pipe() -> Iterator[None]:
    """On EPIPE (``dump ... | head``) point stdout at /dev/null so the interpreter's
    final flush stays silent, then let cli.main turn it into exit 0."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise


def dump(args: argparse.Namespace) -> int:
    """``shmps-tool dump``: validate, then print in the chosen format.

    Cost: one validation pass, then one streaming pass over the printed rows; memory
    O(ENTRY_CHUNK + ROW_CHUNK) plus O(distinct row lengths) for the summary.
    """
    if args.store is not None and args.prefix is not None:
        raise InvalidArgument("give either PREFIX or --store NAME --tensor T, not both")
    if args.store is None:
        if args.prefix is None:
            raise InvalidArgument("dump needs PREFIX (a file set) or --store NAME --tensor T")
        prefix = _checkpoint_prefix(args.prefix, args.tensor)
        ms = read_csr(prefix, **_read_args(args), check=True)
        if ms.kind == "dense":
            members = " ".join(f".{a}" for a in ms.arrays)
            label = f"file set:  {ms.prefix} ({members} .meta; dense: no .rowcnt/.colidx)"
        else:
            label = (f"file set:  {ms.prefix} (.rowcnt .colidx .value"
                     + "".join(f" .{a}" for a in ms.arrays[1:])
                     + f"{' .meta' if ms.meta else ''})")
    else:
        ms = _load_store_tensor(args)
        label = f"tensor:    {args.tensor} of store {args.store}"
    if args.format == "summary" and (args.rows is not None or args.head is not None):
        raise InvalidArgument("--rows/--head apply to the table, csv and json formats; "
                              "summary always covers the whole matrix")
    lo, hi = _window(args, ms.rows)
    out = sys.stdout
    with _quiet_broken_pipe():
        if args.format == "table":
            _write_table(out, ms, lo, hi)
        elif args.format == "csv":
            _write_csv(out, ms, lo, hi)
        elif args.format == "json":
            _write_json(out, ms, lo, hi)
        else:
            _write_summary(out, ms, label)
    return 0


def check(args: argparse.Namespace) -> int:
    """``shmps-tool check``: full validation; one ``ok:`` line.  Cost: one chunked pass
    over rowcnt and colidx, O(CHUNK) memory."""
    prefix = _checkpoint_prefix(args.prefix, None)
    if args.finish:
        # under a read lock of the set: a writer renaming (on any host, where locks
        # work) holds its write lock, and is waited for (bounded), not finished under
        with _files._set_lock(prefix, exclusive=False,
                              deadline=time.monotonic() + _files.REPLACE_WAIT_S):
            how = finish_replacement(prefix, any_host=True)
        if how == "finished":
            print(f"finished the replacement of {prefix} that a writer left half done",
                  file=sys.stderr)
    if args.array is not None:
        sets = [read_csr(prefix, **_read_args(args), check=True)]
    else:
        sets = validate_all(prefix, **_read_flags(args))
    ms = sets[0]
    if ms.kind == "dense":
        dt = f"{ms.array}={ms.dtypes['value']}"
        kind = "dense (structure implicit), "
    else:
        dt = ", ".join(f"{ms.array if k == 'value' else k}={ms.dtypes[k]}" for k in ARRAYS)
        kind = ""
    more = "".join(f"; {x.array} {x.dtypes['value']} ok" for x in sets[1:])
    print(f"ok: {ms.rows} x {ms.cols}, {kind}nnz {ms.nnz} (dtypes {dt}){more}")
    return 0


def _checkpoint_prefix(prefix: str, tensor: str | None) -> str:
    """``prefix``, or with ``tensor`` (or for a checkpoint directory) the file-set prefix
    of that tensor in the checkpoint directory ``prefix`` (from its checkpoint.json)."""
    is_ckpt = os.path.isdir(prefix) and os.path.isfile(os.path.join(prefix, "checkpoint.json"))
    if tensor is not None and not os.path.exists(prefix):
        raise NotFound(f"--tensor {tensor}: no checkpoint directory {prefix}",
                       hint="pass the PATH given to shmps-tool checkpoint / store.checkpoint")
    if (tensor is None and not is_ckpt and os.path.isdir(prefix)
            and not any(os.path.exists(f"{prefix}.{k}") for k in (*ARRAYS, "meta"))):
        # (a directory named as a prefix: "missing file d.rowcnt, ..." said nothing of it)
        raise InvalidArgument(f"{prefix} is a directory without checkpoint.json: not a "
                              "checkpoint, and no file set PREFIX.rowcnt/.colidx/.value "
                              "is beside it",
                              hint="pass a checkpoint directory (with --tensor NAME), or "
                                   "the prefix of a file set, e.g. DIR/t0 for DIR/t0.value")
    if tensor is None and not is_ckpt:
        return prefix
    if not is_ckpt:
        raise InvalidArgument(f"--tensor {tensor}: {prefix} is not a checkpoint directory "
                              "(no checkpoint.json)",
                              hint="--tensor picks a tensor of --store NAME or of a "
                                   "checkpoint directory")
    entries = read_checkpoint_manifest(prefix)["tensors"]
    names = ", ".join(repr(e["record"]["name"]) for e in entries) or "none"
    if tensor is None:
        raise InvalidArgument(f"{prefix} is a checkpoint directory; its tensors are {names}",
                              hint=f"pass --tensor NAME, or a set prefix such as "
                                   f"{os.path.join(prefix, entries[0]['prefix']) if entries else prefix + '/t0'}")
    for e in entries:
        if e["record"]["name"] == tensor:
            return os.path.join(prefix, e["prefix"])
    raise NotFound(f"no tensor {tensor!r} in checkpoint {prefix}; its tensors are {names}",
                   hint="list them with shmps-tool dump CKPT (or read checkpoint.json)")


def _kind(path: str) -> str:
    low = path.lower()
    if low.endswith(".npz"):
        return "npz"
    if low.endswith(".npy"):
        return "npy"
    return "set"


def _out_value_dtype(src: np.dtype, requested: str | None, what: str) -> str:
    src = np.dtype(src)
    if requested is not None:
        if not np.can_cast(src, requested, casting="same_kind"):
            raise InvalidArgument(f"{what}: cannot cast {src} values to {requested} "
                                  "(numpy same_kind rule)")
        return requested
    if src.name in VALUE_DTYPES:
        return src.name
    raise InvalidArgument(f"{what}: value dtype {src} is not a file dtype "
                          f"({', '.join(VALUE_DTYPES)})", hint="pass --dtype D to cast")


def _progress(total: int, desc: str) -> Any:
    # (through the module: the threshold is files.PROGRESS_MIN_BYTES at each call)
    return _files.progress_bar(total, desc)


@contextmanager
def _atomic_output(dst: str) -> Iterator[str]:
    """A temporary path beside ``dst`` (:func:`temporary_path`); on success fsync
    it and rename it to ``dst``, on any exception (Ctrl-C included) delete it.  First
    removes the temporaries of ``dst`` that killed writers left
    (:func:`remove_dead_temporaries`)."""
    directory = os.path.dirname(dst) or "."
    if not os.path.isdir(directory):
        raise NotFound(f"{directory}: no such directory", hint="create the directory first")
    remove_dead_temporaries(directory, os.path.basename(dst).__eq__)
    tmp = temporary_path(dst)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _copy_set(dst: str, c: CSR, rows: int, cols: int, dtypes: dict[str, str],
              desc: str, names: dict[str, str]) -> None:
    """Write ``c`` as the set ``dst``; ``names`` names each array's source (messages)."""
    nbytes = sum(len(a) * np.dtype(dtypes[k]).itemsize for k, a in zip(ARRAYS, c))
    with _progress(nbytes, desc) as bar, SetWriter(dst, dtypes) as w:
        for k, a in zip(ARRAYS, c):
            for s in range(0, len(a), CHUNK):
                bar.update(w.append(k, a[s:s + CHUNK], names[k]))
        w.commit(build_meta(rows, cols, c.nnz, dtypes))


#: what a .npy file starts with (numpy's format: magic string, then the version)
NPY_MAGIC = b"\x93NUMPY"
#: what a .npz (a zip file: its first local file header) starts with
ZIP_MAGIC = b"PK\x03\x04"


def _starts_with(path: str, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError as exc:
        if exc.filename is None:
            exc.filename = path   # (a read's error names no file: the line would not)
        raise


def _not_a(path: str, kind: str, magic: bytes, hint: str) -> CorruptFile:
    """The error for a file that lacks its format's magic.  np.load takes any such file
    for a pickle and, with allow_pickle=False, says "This file contains pickled (object)
    data. If you trust the file you can load it unsafely": wrong about the file, and a
    hint to unpickle what may be anything."""
    return CorruptFile(f"{path}: not a {kind} file: it does not start with "
                       f"{magic.decode('latin-1')!r}", hint=hint)


def _npz_to_set(args: argparse.Namespace) -> tuple[int, int, int, str]:
    sparse = _scipy_sparse()
    if not os.path.isfile(args.src):
        raise NotFound(f"missing file {args.src}", hint="check the path")
    if not _starts_with(args.src, ZIP_MAGIC):
        raise _not_a(args.src, "scipy.sparse .npz", ZIP_MAGIC,
                     "write it with scipy.sparse.save_npz")
    try:
        m = sparse.load_npz(args.src)
    # (an empty file is EOFError; a shape of floats, TypeError; a short one, IndexError)
    except (ValueError, OSError, KeyError, EOFError, TypeError, IndexError,
            zipfile.BadZipFile) as exc:
        raise CorruptFile(f"{args.src}: not a scipy.sparse .npz file: {exc}",
                          hint="write it with scipy.sparse.save_npz") from None
    c = CSR.from_scipy(m)
    rows, cols = (int(x) for x in m.shape)
    names = {"rowcnt": f"{args.src} (indptr)", "colidx": f"{args.src} (indices)",
             "value": f"{args.src} (data)"}
    _check_structure(c, cols=cols, names=names, exc=CorruptFile,
                     cols_note="from the .npz shape", full=True, desc=f"check {args.src}")
    vdt = _out_value_dtype(c.value.dtype, args.dtype, args.src)
    dtypes = {"rowcnt": _index_dtype(c.rowcnt), "colidx": _index_dtype(c.colidx),
              "value": vdt}
    _copy_set(args.dst, c, rows, cols, dtypes, "convert", names)
    return rows, cols, c.nnz, vdt


def _index_dtype(a: np.ndarray) -> str:
    name = np.dtype(a.dtype).name
    return name if name in INDEX_DTYPES else "int64"


def _npy_to_set(args: argparse.Namespace) -> tuple[int, int, int, str]:
    if not os.path.isfile(args.src):
        raise NotFound(f"missing file {args.src}", hint="check the path")
    if not _starts_with(args.src, NPY_MAGIC):
        raise _not_a(args.src, "numpy .npy", NPY_MAGIC, "write it with numpy.save")
    try:
        a = np.load(args.src, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise CorruptFile(f"{args.src}: not a numpy .npy file: {exc}",
                          hint="write it with numpy.save") from None
    if a.ndim != 2:
        raise InvalidArgument(f"{args.src}: a dense matrix must be 2-d, this array has "
                              f"shape {a.shape}")
    rows, cols = (int(x) for x in a.shape)
    vdt = _out_value_dtype(a.dtype, args.dtype, args.src)
    cdt = "int32" if cols <= np.iinfo(np.int32).max else "int64"
    dtypes = {"rowcnt": "int64", "colidx": cdt, "value": vdt}
    step = max(1, BLOCK_BYTES // max(1, cols * a.dtype.itemsize))
    nnz = 0
    with _progress(int(a.nbytes), "convert") as bar, SetWriter(args.dst, dtypes) as w:
        w.append("rowcnt", np.zeros(1, dtype=np.int64))
        for r0 in range(0, rows, step):
            block = np.asarray(a[r0:r0 + step])
            # (before from_dense: the message gives the value's row and column)
            check_held(block, vdt, args.src,
                       where=lambda i, r0=r0: f"row {r0 + i // cols}, col {i % cols}")
            part = CSR.from_dense(block, keep_zeros=args.keep_zeros, colidx_dtype=cdt)
            w.append("rowcnt", part.rowcnt[1:] + nnz)
            w.append("colidx", part.colidx)
            w.append("value", part.value)
            nnz += part.nnz
            bar.update(block.nbytes)
        w.commit(build_meta(rows, cols, nnz, dtypes))
    return rows, cols, nnz, vdt


def _set_to_npz(args: argparse.Namespace) -> tuple[int, int, int, str]:
    sparse = _scipy_sparse()
    ms = read_csr(args.src, **_read_args(args), check=True)
    vdt = _out_value_dtype(np.dtype(ms.dtypes["value"]), args.dtype, ms.prefix or args.src)
    if vdt == "float16":
        raise InvalidArgument(f"{args.src}: scipy.sparse cannot hold float16 values",
                              hint="pass --dtype float32")
    if max(ms.rows, ms.cols) > np.iinfo(np.int64).max:
        raise CapacityError(f"convert {args.src} -> {args.dst}: a {ms.rows} x {ms.cols} "
                            "matrix is larger than scipy.sparse can index (2**63 - 1 rows "
                            "and columns)",
                            hint='if the column count is wrong, fix "cols" in the .meta or '
                                 "pass --cols")
    c = ms.csr
    dtypes = {"rowcnt": ms.dtypes["rowcnt"], "colidx": ms.dtypes["colidx"], "value": vdt}
    nbytes = sum(len(x) * np.dtype(dtypes[k]).itemsize for k, x in zip(ARRAYS, c))
    loaded = []
    source = f"{ms.prefix or args.src}.{ms.array}"
    with _progress(nbytes, "read") as bar:
        for k, x in zip(ARRAYS, c):
            arr = np.empty(len(x), dtype=dtypes[k])
            for s in range(0, len(x), CHUNK):
                if k == "value":   # (an integer --dtype cannot hold: no wrapping)
                    check_held(x[s:s + CHUNK], vdt, source, s)
                arr[s:s + CHUNK] = x[s:s + CHUNK]
                bar.update(min(CHUNK, len(x) - s) * arr.itemsize)
            loaded.append(arr)
    m = sparse.csr_matrix((loaded[2], loaded[1], loaded[0]), shape=(ms.rows, ms.cols))
    with _atomic_output(args.dst) as tmp:
        with open(tmp, "wb") as f:
            sparse.save_npz(f, m)
    return ms.rows, ms.cols, ms.nnz, vdt


def _npy_bytes(shape: tuple[int, int], dtype: str) -> int:
    """The size of the ``.npy`` file ``numpy.save`` writes for that shape (header too)."""
    head = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
            "shape": shape}
    buf = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buf, head)
    except ValueError:  # a header beyond 64 KiB needs format 2.0
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, head)
    return buf.tell() + shape[0] * shape[1] * np.dtype(dtype).itemsize


def _fmt_bytes(n: int) -> str:
    """``n bytes``, with the size in KiB ... PiB beside it from 1 KiB on."""
    x, unit = float(n), ""
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        x /= 1024
        if x < 1024:
            break
    return f"{n} bytes" + (f" ({x:.1f} {unit})" if n >= 1024 else "")


def _check_npy_size(src: str, dst: str, rows: int, cols: int, nnz: int, vdt: str) -> None:
    """Refuse a dense ``.npy`` numpy cannot address, or larger than the free space of
    DST's directory, before anything is written (the ``.meta`` may declare any cols)."""
    need = _npy_bytes((rows, cols), vdt)
    what = (f"convert {src} -> {dst}: a dense {rows} x {cols} {vdt} array (the set holds "
            f"{nnz} entries)")
    hint = ("convert to a .npz instead, which keeps the matrix sparse; or, if the column "
            'count is wrong, fix "cols" in the .meta or pass --cols')
    # numpy refuses an array whose axes' product times the itemsize overflows, a 0 axis
    # left out of the product (np.zeros((0, 2**63 - 1)) is "array is too big"), so an
    # empty array can be as unaddressable as a full one
    addressed = max(rows, 1) * max(cols, 1) * np.dtype(vdt).itemsize
    if max(need - 4096, addressed) > np.iinfo(np.intp).max:
        raise CapacityError(f"{what} is {max(need - 4096, addressed)} bytes, more than numpy "
                            "can address", hint=hint)
    directory = os.path.dirname(dst) or "."
    free = shutil.disk_usage(directory).free if os.path.isdir(directory) else need
    if need > free:
        raise CapacityError(f"{what} needs {_fmt_bytes(need)} but {directory} has "
                            f"{_fmt_bytes(free)} free",
                            hint="free space there, or write DST to a disk with room; or "
                                 + hint)


#: the hint of repeated integer entries whose sum the written dtype cannot hold
SUM_HINT = ("convert with --dtype to a wider dtype (int32 for int8 values, float64), or to "
            "a .npz, which keeps repeated entries apart")


def _put_integer_sums(out: np.ndarray, ri: np.ndarray, ci: np.ndarray, v: np.ndarray,
                      source: str, r0: int) -> None:
    """Write into ``out`` (a zeroed block of rows ``r0 ...``, an integer dtype) the sum of
    the entries at each (``ri``, ``ci``): a cell a set holds several times is their sum.
    A sum ``out`` cannot hold raises InvalidArgument naming the cell, how many entries
    it sums and the sum (:func:`check_held`): np.add.at in ``out``'s dtype wrapped it
    (int8 100 + 100 wrote -56).  The sums are exact in int64: the values are int8 or
    int32 (each already checked to fit ``out``), so a cell would need 2**32 entries
    (32 GiB of its colidx and values) to overflow it.  Cost: a sort of the block's
    entries, O(entries) memory."""
    cols = out.shape[1]
    cells = ri.astype(np.int64) * cols + ci.astype(np.int64)
    cell, inverse, count = np.unique(cells, return_inverse=True, return_counts=True)
    sums = np.zeros(len(cell), dtype=np.int64)
    np.add.at(sums, inverse.reshape(-1), v.astype(np.int64))
    check_held(sums, out.dtype, source, hint=SUM_HINT,
               where=lambda i: (f"row {r0 + int(cell[i]) // cols}, col {int(cell[i]) % cols}"
                                + (f" (the sum of its {int(count[i])} entries)"
                                   if count[i] > 1 else "")))
    out.reshape(-1)[cell] = sums   # (fits: checked; out is C-contiguous rows, a view)


def _set_to_npy(args: argparse.Namespace) -> tuple[int, int, int, str]:
    ms = read_csr(args.src, **_read_args(args), check=True)
    vdt = _out_value_dtype(np.dtype(ms.dtypes["value"]), args.dtype, ms.prefix or args.src)
    rowcnt, colidx, value = ms.csr
    rows, cols = ms.rows, ms.cols
    source = f"{ms.prefix or args.src}.{ms.array}"
    _check_npy_size(args.src, args.dst, rows, cols, ms.nnz, vdt)
    itemsize = np.dtype(vdt).itemsize
    step = max(1, BLOCK_BYTES // max(1, cols * itemsize))
    with _atomic_output(args.dst) as tmp:
        if rows * cols == 0:
            with open(tmp, "wb") as f:
                np.save(f, np.zeros((rows, cols), dtype=vdt))
        else:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=vdt, shape=(rows, cols))
            with _progress(rows * cols * itemsize, "convert") as bar:
                for r0 in range(0, rows, step):
                    r1 = min(r0 + step, rows)
                    e0, e1 = int(rowcnt[r0]), int(rowcnt[r1])
                    # an integer --dtype cannot hold: refused, not wrapped (the
                    # temporary .npy goes with the error)
                    check_held(value[e0:e1], vdt, source, e0)
                    if ms.kind == "dense":  # row-major values: a plain copy
                        out[r0:r1] = np.asarray(value[e0:e1]).reshape(r1 - r0, cols) \
                            .astype(vdt, casting="same_kind")
                        bar.update((r1 - r0) * cols * itemsize)
                        continue
                    counts = np.diff(np.asarray(rowcnt[r0:r1 + 1], dtype=np.int64))
                    ri = np.repeat(np.arange(r1 - r0), counts.astype(np.int64))
                    if np.dtype(vdt).kind in "iu":
                        _put_integer_sums(out[r0:r1], ri, np.asarray(colidx[e0:e1]),
                                          np.asarray(value[e0:e1]), source, r0)
                    else:
                        np.add.at(out[r0:r1], (ri, np.asarray(colidx[e0:e1])),
                                  np.asarray(value[e0:e1]).astype(vdt, casting="same_kind"))
                    bar.update((r1 - r0) * cols * itemsize)
            out.flush()
            del out
    return rows, cols, ms.nnz, vdt


def convert(args: argparse.Namespace) -> int:
    """``shmps-tool convert SRC DST``.  Cost: one streaming pass over SRC (a .npz is
    loaded whole by scipy; a file set written to .npz is loaded whole for scipy);
    memory O(BLOCK_BYTES + CHUNK) otherwise.  DST is replaced atomically per file."""
    sk, dk = _kind(args.src), _kind(args.dst)
    if (sk == "set") == (dk == "set"):
        raise InvalidArgument(f"convert {args.src} {args.dst}: exactly one side must be a "
                              "file set prefix and the other a .npz or .npy file")
    if args.keep_zeros and sk != "npy":
        raise InvalidArgument("--keep-zeros applies to a dense .npy SRC only")
    if sk != "set" and any(v is not None for v in _read_args(args).values()):
        raise InvalidArgument("--rowcnt-dtype/--colidx-dtype/--value-dtype/--cols/--array "
                              "describe a file-set SRC; use --dtype to cast the values")
    if dk != "set" and os.path.isdir(args.dst):
        # (found before converting: the rename of the finished temporary over it failed,
        # naming the temporary: ".X.npy.tmp-HOST-PID-HEX: Is a directory")
        raise InvalidArgument(f"convert {args.src} -> {args.dst}: {args.dst} is a directory; "
                              f"the .{dk} is written as a file of that name",
                              hint="choose another DST, e.g. a file in that directory")
    conv = {"npz": _npz_to_set, "npy": _npy_to_set}.get(sk) or \
        (_set_to_npz if dk == "npz" else _set_to_npy)
    # a value beyond --dtype, or repeated entries whose sum overflows, become inf (NaN
    # for inf + -inf) as numpy computes them, without numpy's RuntimeWarning on stderr
    with np.errstate(over="ignore", invalid="ignore"):
        rows, cols, nnz, vdt = conv(args)
    print(f"converted {args.src} -> {args.dst}: {rows} x {cols}, nnz {nnz}, value {vdt}")
    return 0


__all__ = ["register", "dump", "check", "convert", "value_strings", "row_nnz_stats",
           "value_stats", "ENTRY_CHUNK", "ROW_CHUNK", "PROGRESS_MIN_BYTES"]


if __name__ == "__main__":  # pragma: no cover (run in a subprocess by the tests)
    # `python -m shmps.<this module> --help` printed nothing and exited 0: the module
    # only defines verbs of shmps-tool, so it runs shmps-tool
    from .cli import main
    raise SystemExit(main())
