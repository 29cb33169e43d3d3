"""Binary matrix file sets (shmps.files): round trips, inference, validation messages."""
from __future__ import annotations

import io
import json
import re
import os
import signal
import sys

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import shmps.files
import shmps.progress
from shmps.errors import CorruptFile, InvalidArgument, NotFound
from shmps.files import (CSR, INDEX_DTYPES, VALUE_DTYPES, MatrixSet, _first_decrease,
                         _scan_columns, read_checkpoint_manifest, read_csr, read_dense,
                         read_meta, validate, write_csr, write_dense)

EXAMPLE = np.array([[1, 2, 0, 0], [0, 3, 9, 0], [0, 1, 4, 0]], dtype=np.float32)
FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@st.composite
def csr_cases(draw, max_rows: int = 12, max_row_nnz: int = 6):
    """(CSR, cols) with random dtypes, empty rows, 0 x 0, R x 0-nnz and 1e6 columns."""
    vdt = draw(st.sampled_from(VALUE_DTYPES))
    rdt = draw(st.sampled_from(INDEX_DTYPES))
    cdt = draw(st.sampled_from(INDEX_DTYPES))
    rows = draw(st.integers(0, max_rows))
    cols = draw(st.sampled_from([0, 1, 3, 7, 10**6]))
    top = max_row_nnz if cols else 0
    counts = draw(st.lists(st.integers(0, top), min_size=rows, max_size=rows))
    nnz = sum(counts)
    colidx = draw(hnp.arrays(cdt, nnz, elements=st.integers(0, max(cols - 1, 0))))
    value = draw(hnp.arrays(vdt, nnz))
    rowcnt = np.zeros(rows + 1, dtype=rdt)
    rowcnt[1:] = np.cumsum(counts)
    return CSR(rowcnt, colidx, value), cols


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, length and bytes (NaN payloads and -0.0 included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def raw_set(prefix, rowcnt, colidx, value) -> str:
    """Write three raw arrays with tofile (no .meta), as another program would."""
    for ext, arr in (("rowcnt", rowcnt), ("colidx", colidx), ("value", value)):
        np.asarray(arr).tofile(f"{prefix}.{ext}")
    return str(prefix)


@FAST
@given(case=csr_cases())
def test_round_trip_every_dtype(tmp_path, case):
    """write_csr -> read_csr returns the identical arrays, dtypes, rows and cols."""
    csr, cols = case
    prefix = tmp_path / "m"
    meta = write_csr(prefix, csr, cols=cols)
    for mmap in (True, False):
        ms = read_csr(prefix, mmap=mmap)
        assert ms.rows == csr.rows and ms.cols == cols and ms.nnz == csr.nnz
        for got, want in zip(ms.csr, csr):
            assert same_bits(got, want)
        assert ms.dtypes == meta["dtypes"]
        assert ms.inferred == {}
        assert ms.sources == {"rowcnt": "meta", "colidx": "meta", "value": "meta",
                              "cols": "meta"}


def test_example_bytes_match_the_documented_hexdump(tmp_path):
    """The docs' example matrix is written byte for byte as docs/file-format.md shows."""
    meta = write_csr(tmp_path / "x", CSR.from_dense(EXAMPLE), cols=4)
    assert (tmp_path / "x.rowcnt").read_bytes().hex() == (
        "0000000000000000" "0200000000000000" "0400000000000000" "0600000000000000")
    assert (tmp_path / "x.colidx").read_bytes().hex() == (
        "00000000" "01000000" "01000000" "02000000" "01000000" "02000000")
    assert (tmp_path / "x.value").read_bytes().hex() == (
        "0000803f" "00000040" "00004040" "00001041" "0000803f" "00008040")
    assert meta == {"version": 1, "kind": "csr", "rows": 3, "cols": 4, "nnz": 6,
                    "dtypes": {"rowcnt": "int64", "colidx": "int32", "value": "float32"}}
    assert json.loads((tmp_path / "x.meta").read_text()) == meta


def test_empty_matrices_use_zero_byte_files(tmp_path):
    """0 x 0 and 5 x 0-nnz sets are written with 0-byte colidx/value and read back."""
    for rows in (0, 5):
        csr = CSR(np.zeros(rows + 1, np.int64), np.zeros(0, np.int32),
                  np.zeros(0, np.float32))
        prefix = tmp_path / f"e{rows}"
        write_csr(prefix, csr)
        assert os.path.getsize(f"{prefix}.colidx") == 0
        assert os.path.getsize(f"{prefix}.value") == 0
        ms = read_csr(prefix)
        assert (ms.rows, ms.cols, ms.nnz) == (rows, 0, 0)
        assert ms.csr.rowcnt.tolist() == [0] * (rows + 1)


def test_million_columns_without_meta(tmp_path):
    """A set with column index 999999 and no .meta infers cols = 1e6."""
    csr = CSR(np.array([0, 1, 3], np.int64), np.array([999_999, 0, 5], np.int32),
              np.array([1.5, -2.0, 3.25], np.float32))
    write_csr(tmp_path / "w", csr, cols=10**6)
    os.unlink(tmp_path / "w.meta")
    ms = read_csr(tmp_path / "w")
    assert ms.cols == 10**6
    assert ms.inferred["cols"] == "1000000 = largest column index 999999 + 1"


@FAST
@given(rows=st.integers(1, 20), cols=st.integers(1, 50), density=st.floats(0.05, 1.0),
       data_dtype=st.sampled_from([np.float64, np.float32]),
       seed=st.integers(0, 2**31 - 1))
def test_scipy_tofile_sets_read_without_meta(tmp_path, rows, cols, density, data_dtype, seed):
    """scipy indptr/indices/data saved with ndarray.tofile read correctly, no .meta."""
    m = sp.random(rows, cols, density=density, format="csr", dtype=data_dtype,
                  random_state=seed)
    m.data[:] += 1  # no explicit zeros needed, but keep nnz > 0 entries nonzero
    if m.nnz == 0:
        m = sp.csr_matrix(([1.0], ([0], [0])), shape=(rows, cols), dtype=data_dtype)
    prefix = raw_set(tmp_path / "s", m.indptr, m.indices, m.data)
    ms = read_csr(prefix)
    assert ms.dtypes == {"rowcnt": "int32", "colidx": "int32",
                         "value": np.dtype(data_dtype).name}
    assert set(ms.inferred) == {"rowcnt", "colidx", "value", "cols"}
    assert ms.rows == rows and ms.cols == m.indices.max() + 1
    assert np.array_equal(ms.csr.to_dense(cols), m.toarray())


def test_all_zero_rowcnt_is_ambiguous_and_prefers_int64(tmp_path):
    """An all-zero rowcnt without .meta reads as int64, says so, and a flag overrides."""
    prefix = raw_set(tmp_path / "z", np.zeros(4, np.int32), np.zeros(0, np.int32),
                     np.zeros(0, np.float32))
    ms = read_csr(prefix)
    assert ms.dtypes["rowcnt"] == "int64" and ms.rows == 1
    assert "ambiguous: int32 fits too (3 rows)" in ms.inferred["rowcnt"]
    assert read_csr(prefix, rowcnt_dtype="int32").rows == 3


def test_unknown_meta_keys_are_kept(tmp_path):
    """Extra .meta keys (a checkpoint's optimizer/state) survive write and read."""
    extra = {"optimizer": {"name": "Adam", "lr": 0.001}, "state": ["m", "v"]}
    write_csr(tmp_path / "c", CSR.from_dense(EXAMPLE), meta=extra)
    ms = read_csr(tmp_path / "c")
    assert ms.meta["optimizer"] == extra["optimizer"] and ms.meta["state"] == ["m", "v"]
    with pytest.raises(InvalidArgument, match='meta key "rows" = 9 disagrees'):
        write_csr(tmp_path / "c", CSR.from_dense(EXAMPLE), meta={"rows": 9})
    write_csr(tmp_path / "c", ms.csr, meta=ms.meta)  # a read set's own meta is accepted


def test_write_rejects_bad_arrays_naming_the_position(tmp_path):
    """write_csr validates first: the message names the array and the position."""
    with pytest.raises(InvalidArgument, match=r"rowcnt: position 1: rowcnt\[2\] = 1 is less"):
        write_csr(tmp_path / "b", CSR(np.array([0, 2, 1, 3]), np.zeros(3, np.int32),
                                      np.zeros(3, np.float32)))
    with pytest.raises(InvalidArgument, match=r"colidx: position 2: column 4 is out of range"):
        write_csr(tmp_path / "b", CSR(np.array([0, 3]), np.array([0, 1, 4], np.int32),
                                      np.zeros(3, np.float32)), cols=4)
    with pytest.raises(InvalidArgument, match="cannot cast float64 to int8"):
        write_csr(tmp_path / "b", CSR.from_dense(EXAMPLE.astype(np.float64)),
                  value_dtype="int8")
    with pytest.raises(InvalidArgument, match="dtype int64 is not a file dtype"):
        write_csr(tmp_path / "b", CSR.from_dense(EXAMPLE.astype(np.int64)))
    assert os.listdir(tmp_path) == []  # nothing written, no temporaries


def test_value_dtype_casts_same_kind(tmp_path):
    """value_dtype casts float64 values to float32 and the .meta records it."""
    meta = write_csr(tmp_path / "v", CSR.from_dense(EXAMPLE.astype(np.float64)),
                     value_dtype="float32")
    assert meta["dtypes"]["value"] == "float32"
    assert read_csr(tmp_path / "v").csr.value.dtype == np.float32


def test_overwrite_is_atomic_per_file_and_leaves_no_temporaries(tmp_path):
    """Rewriting a set replaces every file and leaves only the four final names (and
    the set's lock file, empty, kept for the next writer)."""
    write_csr(tmp_path / "a", CSR.from_dense(EXAMPLE))
    write_csr(tmp_path / "a", CSR.from_dense(EXAMPLE[:1].astype(np.float64)))
    assert sorted(os.listdir(tmp_path)) == [".a.lock", "a.colidx", "a.meta", "a.rowcnt",
                                            "a.value"]
    assert os.path.getsize(tmp_path / ".a.lock") == 0
    ms = read_csr(tmp_path / "a")
    assert ms.rows == 1 and ms.dtypes["value"] == "float64"


def test_mmap_is_a_memmap_and_prefix_may_name_a_member(tmp_path):
    """read_csr maps files (np.memmap) unless mmap=False, and accepts X.rowcnt as X."""
    write_csr(tmp_path / "p", CSR.from_dense(EXAMPLE))
    assert isinstance(read_csr(tmp_path / "p").csr.value, np.memmap)
    assert not isinstance(read_csr(tmp_path / "p", mmap=False).csr.value, np.memmap)
    assert read_csr(str(tmp_path / "p.rowcnt")).prefix == str(tmp_path / "p")


@settings(max_examples=200, deadline=None)
@given(a=hnp.arrays(np.int64, st.integers(0, 60), elements=st.integers(-5, 5)),
       chunk=st.integers(1, 7))
def test_chunked_decrease_scan_matches_naive(a, chunk):
    """The chunked monotonicity scan finds the same first position as a plain loop."""
    naive = next((i for i in range(len(a) - 1) if a[i + 1] < a[i]), None)
    assert _first_decrease(a, chunk) == naive


@settings(max_examples=200, deadline=None)
@given(a=hnp.arrays(np.int32, st.integers(0, 60), elements=st.integers(-2, 9)),
       cols=st.one_of(st.none(), st.integers(0, 10)), chunk=st.integers(1, 7))
def test_chunked_column_scan_matches_naive(a, cols, chunk):
    """The chunked column scan finds the same first bad position as a plain loop."""
    bad = [i for i, v in enumerate(a) if v < 0 or (cols is not None and v >= cols)]
    top, first = _scan_columns(a, cols, chunk)
    assert first == (bad[0] if bad else None)
    if not bad:
        assert top == (int(a.max()) if len(a) else -1)


def corrupt_cases():
    """(name, mutate(prefix), expected substring); the base set is EXAMPLE with .meta."""

    def rewrite(ext, dtype, fn):
        def mutate(prefix):
            arr = np.fromfile(f"{prefix}.{ext}", dtype=dtype)
            fn(arr).tofile(f"{prefix}.{ext}")
        return mutate

    def set_at(i, v):
        def f(a):
            a[i] = v
            return a
        return f

    def meta_edit(fn):
        def mutate(prefix):
            m = json.loads(open(f"{prefix}.meta").read())
            fn(m)
            open(f"{prefix}.meta", "w").write(json.dumps(m))
        return mutate

    def remove(ext):
        return lambda prefix: os.unlink(f"{prefix}.{ext}")

    def append(ext, data):
        return lambda prefix: open(f"{prefix}.{ext}", "ab").write(data)

    return [
        ("missing colidx", remove("colidx"), "missing file {p}.colidx"),
        ("truncated value", append("value", b"\0\0"),
         "{p}.value: truncated: size 26 bytes is not a multiple of the float32 itemsize 4 "
         "(partial entry at position 6)"),
        ("rowcnt start", rewrite("rowcnt", np.int64, set_at(0, 1)),
         "{p}.rowcnt: position 0: rowcnt starts at 1, must start at 0"),
        ("rowcnt decreasing", rewrite("rowcnt", np.int64, set_at(1, 5)),
         "{p}.rowcnt: position 1: rowcnt[2] = 4 is less than rowcnt[1] = 5"),
        ("rowcnt last", rewrite("rowcnt", np.int64, set_at(3, 7)),
         "{p}.rowcnt: position 3: last rowcnt entry is 7 but {p}.value holds 6 values"),
        ("colidx short", rewrite("colidx", np.int32, lambda a: a[:5]),
         "{p}.colidx: position 5: colidx ends after 5 entries but {p}.value holds 6 values"),
        ("value short", rewrite("value", np.float32, lambda a: a[:5]),
         "{p}.value: position 5: value ends after 5 entries but {p}.colidx holds 6"),
        ("column too big", rewrite("colidx", np.int32, set_at(4, 7)),
         "{p}.colidx: position 4: column 7 is out of range [0, 4)"),
        ("column negative", rewrite("colidx", np.int32, set_at(3, -2)),
         "{p}.colidx: position 3: column -2 is out of range [0, 4)"),
        ("meta rows", meta_edit(lambda m: m.update(rows=5)),
         '{p}.meta: field "rows" = 5 disagrees with {p}.rowcnt: 4 entries = 3 rows'),
        ("meta value dtype", meta_edit(lambda m: m["dtypes"].update(value="float64")),
         '{p}.meta: field "dtypes.value" = "float64" disagrees with {p}.value'),
        ("meta rowcnt dtype", meta_edit(lambda m: m["dtypes"].update(rowcnt="int32")),
         '{p}.meta: field "dtypes.rowcnt" = "int32" disagrees with {p}.rowcnt'),
        ("meta nnz", meta_edit(lambda m: m.update(nnz=5)),
         '{p}.meta: field "nnz" = 5 disagrees with {p}.value: 6 values'),
        ("meta cols", meta_edit(lambda m: m.update(cols=2)),
         '{p}.colidx: position 3: column 2 is out of range [0, 2) (cols = 2 from field '
         '"cols" of {p}.meta)'),
        ("meta unparsable", lambda p: open(f"{p}.meta", "w").write('{"version": 1,'),
         "{p}.meta: unparsable JSON at line 1 column 15"),
        ("meta bad dtype", meta_edit(lambda m: m["dtypes"].update(value="complex64")),
         '{p}.meta: field "dtypes.value" = "complex64" is not one of'),
        ("rowcnt empty", lambda p: open(f"{p}.rowcnt", "wb").close(),
         "{p}.rowcnt: position 0: empty file"),
        # json.loads raises RecursionError and a plain ValueError (not JSONDecodeError)
        # for these: both escaped read_csr, and shmps-tool called them internal errors
        ("meta nested too deeply", lambda p: open(f"{p}.meta", "w").write(
            '{"kind": "csr", "x": ' + "[" * 100000),
         "{p}.meta: unparsable JSON: nested too deeply"),
        ("meta integer of 5000 digits", lambda p: open(f"{p}.meta", "w").write(
            '{"rows": ' + "9" * 5000 + "}"),
         "{p}.meta: unparsable JSON: a number with more digits than this reader converts"),
        ("meta a directory", lambda p: (os.unlink(f"{p}.meta"), os.mkdir(f"{p}.meta")),
         "{p}.meta: not a regular file"),
    ]


CORRUPT = corrupt_cases()


@pytest.mark.parametrize("name,mutate,expected", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_every_corruption_has_its_exact_message(tmp_path, name, mutate, expected):
    """Each defect raises CorruptFile/NotFound whose one-line message names file and spot."""
    prefix = str(tmp_path / "m")
    write_csr(prefix, CSR.from_dense(EXAMPLE), cols=4)
    mutate(prefix)
    with pytest.raises((CorruptFile, NotFound)) as info:
        validate(prefix)
    msg = str(info.value)
    assert "\n" not in msg
    assert expected.format(p=prefix) in msg


class Blocked(Exception):
    """Raised by the SIGALRM handler (not an OSError: the reader must not swallow it)."""


def _alarm(signum, frame):
    raise Blocked("the reader blocked")


@pytest.mark.parametrize("reader", [validate, read_dense, read_meta, "checkpoint.json"])
@pytest.mark.parametrize("kind", ["csr", "dense"])
def test_meta_that_is_a_fifo_is_refused_without_blocking(tmp_path, reader, kind):
    """A FIFO in place of the .meta (or a checkpoint's checkpoint.json) is CorruptFile at
    once: opening it for reading blocked until some process wrote to it (shmps-tool check
    and restore hung forever)."""
    prefix = str(tmp_path / "m")
    if kind == "csr":
        write_csr(prefix, CSR.from_dense(EXAMPLE), cols=4)
    else:
        write_dense(prefix, EXAMPLE.astype(np.float32))
    fifo = str(tmp_path / "checkpoint.json") if reader == "checkpoint.json" else f"{prefix}.meta"
    if os.path.exists(fifo):
        os.unlink(fifo)
    os.mkfifo(fifo)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, 5.0, 1.0)   # every blocking open
    try:
        with pytest.raises(CorruptFile, match=r"(m\.meta|checkpoint\.json): not a regular file"):
            if reader == "checkpoint.json":
                read_checkpoint_manifest(tmp_path)
            else:
                reader(fifo if reader is read_meta else prefix)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_inference_suggests_the_value_dtype_flag(tmp_path):
    """int8 values without .meta fail with a hint naming --value-dtype int8; the flag works."""
    prefix = raw_set(tmp_path / "i", np.array([0, 4, 8], np.int64), np.arange(8, dtype=np.int32),
                     np.arange(8, dtype=np.int8))
    with pytest.raises(CorruptFile, match="pass --value-dtype int8"):
        read_csr(prefix)
    ms = read_csr(prefix, value_dtype="int8")
    assert ms.csr.value.tolist() == list(range(8)) and ms.sources["value"] == "argument"


def test_read_meta_rejects_non_objects_and_newer_versions(tmp_path):
    """A .meta that is not an object, or from a newer format version, is refused clearly."""
    (tmp_path / "a.meta").write_text("[1, 2]")
    with pytest.raises(CorruptFile, match="expected a JSON object, found list"):
        read_meta(tmp_path / "a.meta")
    (tmp_path / "a.meta").write_text('{"version": 2}')
    with pytest.raises(CorruptFile, match='field "version" = 2 is newer than this reader'):
        read_meta(tmp_path / "a.meta")


def test_csr_helpers_agree_with_scipy():
    """from_dense/to_dense/to_scipy/from_scipy/row agree with scipy on the example."""
    c = CSR.from_dense(EXAMPLE)
    assert c.rowcnt.tolist() == [0, 2, 4, 6]
    assert c.colidx.tolist() == [0, 1, 1, 2, 1, 2]
    assert c.value.tolist() == [1, 2, 3, 9, 1, 4]
    assert np.array_equal(c.to_dense(4), EXAMPLE)
    assert np.array_equal(c.to_scipy(4).toarray(), EXAMPLE)
    back = CSR.from_scipy(sp.csr_matrix(EXAMPLE).tocoo())
    assert back.rowcnt.tolist() == [0, 2, 4, 6] and c.min_cols() == 3
    cols, vals = c.row(1)
    assert cols.tolist() == [1, 2] and vals.tolist() == [3, 9]
    full = CSR.from_dense(EXAMPLE, keep_zeros=True)
    assert full.nnz == 12 and np.array_equal(full.to_dense(4), EXAMPLE)


def test_matrix_set_from_csr_validates():
    """MatrixSet.from_csr describes in-memory arrays and rejects a broken structure."""
    ms = MatrixSet.from_csr(CSR.from_dense(EXAMPLE), cols=4)
    assert (ms.rows, ms.cols, ms.nnz) == (3, 4, 6) and ms.dtypes["value"] == "float32"
    with pytest.raises(InvalidArgument, match="rowcnt: position 0: rowcnt starts at 1"):
        MatrixSet.from_csr((np.array([1, 2]), np.zeros(2, np.int32), np.zeros(2)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [3.5, np.float64(4.0), True, "4", np.array([4]), -1],
                         ids=["float", "np.float64", "bool", "str", "1-d", "negative"])
def test_cols_and_row_arguments_are_integers(tmp_path, bad):
    """``cols=`` of CSR.to_dense, CSR.to_scipy, write_csr and read_csr, and CSR.row's
    ``i``, go through checks.check_int as every integer argument does: a float, a bool,
    a string, a 1-d array or a negative count is an InvalidArgument naming it, and a
    numpy integer or a 0-d integer array is taken.  Before, to_dense(cols=3.5) and
    to_scipy(cols=3.5) gave 3 columns, row(True) a numpy TypeError and row(1.5) a numpy
    IndexError; write_csr and read_csr refused cols=np.int64(4)."""
    csr = CSR.from_dense(EXAMPLE)
    write_csr(tmp_path / "x", csr, cols=4)
    calls = {"to_dense": lambda c: csr.to_dense(cols=c),
             "to_scipy": lambda c: csr.to_scipy(cols=c),
             "write_csr": lambda c: write_csr(tmp_path / "y", csr, cols=c),
             "read_csr": lambda c: read_csr(tmp_path / "x", cols=c)}
    for what, call in calls.items():
        with pytest.raises(InvalidArgument, match="cols=") as info:
            call(bad)
        assert info.value.hint, what
        for four in (np.int64(4), np.array(4)):
            got = call(four)
            assert (got.shape if what.startswith("to_") else
                    got["cols"] if what == "write_csr" else got.cols) in ((3, 4), 4), what
    if bad != -1:   # (a negative row is refused as before)
        with pytest.raises(InvalidArgument, match="i="):
            csr.row(bad)
    assert csr.row(np.int64(1))[1].tolist() == [3, 9]
    assert csr.row(np.array(1))[0].tolist() == [1, 2]


@pytest.mark.timeout(60)
def test_writing_an_integer_the_value_dtype_cannot_hold_is_refused(tmp_path):
    """write_dense / write_csr with value_dtype= int8 or int32 of a value outside its
    range raise InvalidArgument naming the value and its position, and write nothing;
    numpy's cast wrapped it (300 into int8 is 44, -129 is 127, 2**40 into int32 is 0)
    and the set held those numbers.  A value within the range is written."""
    for write, arg, needle in [
            (write_dense, np.array([[1, 300]]), "position 1: value 300 cannot be stored in int8"),
            (write_csr, CSR(np.array([0, 1]), np.array([0]), np.array([-129])),
             "position 0: value -129 cannot be stored in int8 (range -128 .. 127; a cast "
             "would wrap it to 127)")]:
        with pytest.raises(InvalidArgument, match=re.escape(needle)):
            write(str(tmp_path / "W"), arg, value_dtype="int8")
        assert os.listdir(tmp_path) in ([], [".W.lock"])
    with pytest.raises(InvalidArgument, match="value 1099511627776 cannot be stored in int32"):
        write_dense(str(tmp_path / "W"), np.array([7, 2 ** 40]), value_dtype="int32")
    write_dense(str(tmp_path / "W"), np.array([[127, -128]]), value_dtype="int8")
    assert read_dense(str(tmp_path / "W")).csr.value.tolist() == [127, -128]


class Terminal(io.StringIO):
    """stderr as a terminal, where the progress bars of long file operations show."""

    def isatty(self) -> bool:
        return True


def record_bars(monkeypatch):
    """sys.stderr a terminal, and the files' progress threshold 1 KiB: returns a function
    giving ``(desc, n, total)`` of each bar shown (tqdm, not the one that shows nothing)
    since its last call, and ``.terminal``, what they wrote.  Bars are recorded where
    every bar is made (shmps.progress.bar), as test_checkpoint records its own.  Called
    in the test's body: pytest's capture sets sys.stderr again after the fixtures."""
    made: list = []
    real = shmps.progress.bar

    def recorded(total: int, desc: str, *args, **kw):
        b = real(total, desc, *args, **kw)
        made.append(b)
        return b

    monkeypatch.setattr(shmps.progress, "bar", recorded)
    monkeypatch.setattr(shmps.files, "PROGRESS_MIN_BYTES", 1 << 10)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)

    def shown() -> list[tuple[str, int, int]]:
        out = [(b.desc, b.n, b.total) for b in made
               if not isinstance(b, shmps.progress._NoBar)]
        made.clear()
        return out

    shown.terminal = terminal   # type: ignore[attr-defined]
    return shown


class Counted:
    """A progress bar that only adds up what it is told."""

    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int) -> None:
        self.n += n


@pytest.mark.timeout(60)
def test_writes_and_checks_of_large_sets_show_progress_bars_ending_at_their_totals(
        tmp_path, monkeypatch):
    """On a terminal, write_csr shows a bar checking the arrays, then one writing them;
    read_csr / validate / validate_all one checking rowcnt and colidx; write_dense one
    writing; each counts exactly up to its total (the bytes it reads or writes).  No
    bar for a pass below files.PROGRESS_MIN_BYTES, nor off a terminal.  Before, none of
    them showed progress: a 1.6 GB write_csr took 13.8 s silently, a check 1.8 s."""
    rows, per = 3000, 3
    rowcnt = np.arange(0, rows * per + 1, per, dtype=np.int64)
    colidx = np.tile(np.arange(per, dtype=np.int32), rows)
    value = np.ones(rows * per, np.float32)
    nr, nc, nv = rowcnt.nbytes, colidx.nbytes, value.nbytes
    p = str(tmp_path / "P")
    progress_bars = record_bars(monkeypatch)
    write_csr(p, CSR(rowcnt, colidx, value))
    assert progress_bars() == [(f"check {p}", nr + nc, nr + nc),
                               (f"write {p}", nr + nc + nv, nr + nc + nv)]
    assert f"check {p}:" in progress_bars.terminal.getvalue()    # (tqdm drew it)
    for read in (read_csr, shmps.files.validate, shmps.files.validate_all):
        read(p)
        assert progress_bars() == [(f"check {p}", nr + nc, nr + nc)], read
    read_csr(p, check=False)             # (cols from the .meta: no pass at all)
    assert progress_bars() == []
    d = str(tmp_path / "D")
    write_dense(d, np.ones((40, 25)), states=[np.zeros((40, 25))])
    assert progress_bars() == [(f"write {d}", 16000, 16000)]
    read_dense(d)                          # (O(1): the structure is implicit)
    assert progress_bars() == []
    # off: a set below the threshold, and stderr not a terminal
    write_csr(str(tmp_path / "small"), CSR([0, 2], [0, 1], np.ones(2)))
    read_csr(str(tmp_path / "small"))
    assert progress_bars() == []
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    write_csr(p, CSR(rowcnt, colidx, value))
    read_csr(p)
    assert progress_bars() == [] and sys.stderr.getvalue() == ""
    # the chunked passes count every byte once, whatever the chunk boundaries
    for n in (1, 2, 6, 7, 8, 13, 14, 15, 50):
        a, c = Counted(), Counted()
        assert _first_decrease(np.arange(n), 7, a) is None
        assert _scan_columns(np.arange(n, dtype=np.int32), None, 7, c) == (n - 1, None)
        assert (a.n, c.n) == (8 * n, 4 * n), n
