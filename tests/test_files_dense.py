"""Dense file sets (a checkpoint tensor's format): implicit structure, state arrays,
validation messages, and the dump/check/convert verbs on them."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import shmps.files
from shmps import cli
from shmps.errors import CorruptFile, InvalidArgument, NotFound
from shmps.files import (CSR, VALUE_DTYPES, ImplicitIndex, MatrixSet, implicit_structure,
                         read_csr, read_dense, validate_all, write_csr, write_dense)

from helpers import child_env

FAST = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def main_out(*args: object) -> tuple[int, str, str]:
    """Run cli.main in this process; return (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main([str(a) for a in args])
    return status, out.getvalue(), err.getvalue()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@st.composite
def dense_cases(draw):
    """(values of any file dtype and 0-3 dims, optimizer states or none)."""
    dt = draw(st.sampled_from(VALUE_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    values = draw(hnp.arrays(dt, shape))
    nstate = draw(st.integers(0, 3))
    sdt = draw(st.sampled_from(["float32", "float64"]))
    states = [draw(hnp.arrays(sdt, shape)) for _ in range(nstate)]
    return values, states


@FAST
@given(case=dense_cases())
def test_dense_round_trip_with_implicit_structure(tmp_path, case):
    """write_dense -> read_csr: same values and states; implicit structure = explicit one."""
    values, states = case
    here = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example (hypothesis)
    prefix = here / "d"
    meta = write_dense(prefix, values, states=states, meta={"name": "w"})
    assert sorted(os.listdir(here)) == sorted(
        [".d.lock", "d.value", "d.meta"] + [f"d.state{k}" for k in range(len(states))])
    ms = read_csr(prefix)
    rows, cols = shmps.files.dense_dims(values.shape)
    assert (ms.kind, ms.rows, ms.cols, ms.shape) == ("dense", rows, cols, values.shape)
    assert ms.arrays == ("value",) + tuple(f"state{k}" for k in range(len(states)))
    assert ms.meta == meta and ms.meta["name"] == "w"
    assert same_bits(ms.to_numpy(), values)
    assert isinstance(ms.csr.rowcnt, ImplicitIndex) and isinstance(ms.csr.colidx, ImplicitIndex)
    explicit = CSR.from_dense(values.reshape(rows, cols), keep_zeros=True)
    assert same_bits(np.asarray(ms.csr.rowcnt), explicit.rowcnt)
    assert same_bits(np.asarray(ms.csr.colidx), explicit.colidx)
    assert ms.sources == {"rowcnt": "implicit", "colidx": "implicit", "value": "meta",
                          "cols": "meta"}
    for k, s in enumerate(states):
        st_set = read_csr(prefix, array=f"state{k}")
        assert st_set.array == f"state{k}" and same_bits(st_set.to_numpy(), s)
        assert same_bits(read_csr(f"{prefix}.state{k}").to_numpy(), s)  # member path
    assert [x.array for x in validate_all(prefix)] == list(ms.arrays)
    assert same_bits(read_dense(prefix, mmap=False).to_numpy(), values)


@FAST
@given(rows=st.integers(0, 9), cols=st.integers(0, 6), data=st.data())
def test_implicit_index_reads_like_the_array(rows, cols, data):
    """ImplicitIndex indexing (int, negative, slice, array) matches the numpy array."""
    for arr, want in zip(implicit_structure(rows, cols),
                         CSR.from_dense(np.zeros((rows, cols)), keep_zeros=True)[:2]):
        n = len(want)
        assert len(arr) == n and arr.shape == (n,) and arr.dtype == want.dtype
        assert same_bits(np.asarray(arr), want)
        a = data.draw(st.integers(-n - 2, n + 2))
        b = data.draw(st.integers(-n - 2, n + 2))
        step = data.draw(st.sampled_from([None, 1, 2, -1, 3]))
        assert same_bits(arr[a:b:step], want[a:b:step])
        if -n <= a < n:
            assert arr[a] == want[a] and type(arr[a]) is type(want[a])
        else:
            with pytest.raises(IndexError):
                arr[a]
        if n:
            idx = np.array(data.draw(st.lists(st.integers(-n, n - 1), max_size=5)),
                           dtype=np.int64)
            assert same_bits(arr[idx], want[idx])


@FAST
@given(a=hnp.arrays(st.sampled_from(["int8", "float16", "float32", "float64"]),
                    hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=6)),
       window=st.sampled_from([[], ["--rows", "1:3"], ["--head", "2"], ["--rows", "2"]]))
def test_dense_dump_prints_like_the_explicit_set(tmp_path, a, window):
    """A dense set dumps exactly like the csr set storing every entry of its matrix."""
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example (hypothesis)
    write_dense(tmp_path / "d", a)
    write_csr(tmp_path / "c", CSR.from_dense(a, keep_zeros=True), cols=a.shape[1])
    for fmt in ("json", "csv", "table"):
        sd, od, ed = main_out("dump", tmp_path / "d", "--format", fmt, *window)
        sc, oc, ec = main_out("dump", tmp_path / "c", "--format", fmt, *window)
        assert (sd, ed) == (sc, ec)
        if fmt == "table" and sd == 0:
            assert od.splitlines()[0].replace("dense, structure implicit; ", "") == \
                oc.splitlines()[0].replace("rowcnt int64, colidx int32, ", "")
            od, oc = od.split("\n", 1)[1], oc.split("\n", 1)[1]
        assert od == oc


def test_dump_and_check_of_a_dense_set(tmp_path):
    """The summary shows kind, shape, arrays, checkpoint fields; check covers state arrays."""
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    write_dense(tmp_path / "t0", a, states=[a * 0.5], meta={
        "name": "fc.w", "optimizer": {"type": "SGD", "lr": 0.1}, "step": 9})
    status, out, err = main_out("dump", tmp_path / "t0", "--format", "summary")
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0] == f"file set:  {tmp_path / 't0'} (.value .state0 .meta; dense: no " \
                       ".rowcnt/.colidx)"
    assert lines[1].startswith("kind:      dense (tensor shape 2 x 3 x 4;")
    assert "shape:     2 x 12" in lines and "density:   1" in lines
    assert "  rowcnt: int64 (implicit: row i starts at i * cols)" in lines
    assert "row nnz:   min 12, median 12, max 12 (0 empty rows)" in lines
    assert "arrays:    value shown; also state0 (--array NAME)" in lines
    assert "tensor:    'fc.w' (checkpointed)" in lines
    assert "optimizer: SGD(lr=0.1); step 9" in lines
    status, out, _ = main_out("dump", tmp_path / "t0", "--array", "state0", "--head", "1")
    assert out.splitlines()[0] == \
        "# 2 x 12, nnz 24 (dense, structure implicit; state0 float32), rows 0:1"
    assert out.splitlines()[1].startswith("row 0: (0, 0.0) (1, 0.5) (2, 1.0)")
    status, out, _ = main_out("check", tmp_path / "t0")
    assert out == "ok: 2 x 12, dense (structure implicit), nnz 24 (dtypes value=float32); " \
                  "state0 float32 ok\n"
    (tmp_path / "t0.state0").write_bytes(b"\0" * 10)
    status, out, err = main_out("check", tmp_path / "t0")
    assert status == 2 and "t0.state0: truncated: size 10 bytes" in err
    status, out, err = main_out("check", tmp_path / "t0", "--array", "value")
    assert status == 0, err


def test_convert_dense_set(tmp_path):
    """A dense set converts to .npy (rows x cols) and .npz (every entry stored)."""
    import scipy.sparse as sp

    a = np.arange(12, dtype=np.float64).reshape(3, 2, 2)
    write_dense(tmp_path / "d", a)
    assert main_out("convert", tmp_path / "d", tmp_path / "d.npy")[0] == 0
    assert same_bits(np.load(tmp_path / "d.npy"), a.reshape(3, 4))
    assert main_out("convert", tmp_path / "d", tmp_path / "d.npz")[0] == 0
    m = sp.load_npz(tmp_path / "d.npz")
    assert m.nnz == 12 and np.array_equal(m.toarray(), a.reshape(3, 4))


def test_csr_set_with_state_arrays(tmp_path):
    """A csr set's declared state arrays read with --array; bad ones are clear errors."""
    c = CSR.from_dense(np.array([[1, 0, 2], [0, 0, 3]], dtype=np.float32))
    write_csr(tmp_path / "c", c, cols=3, meta={"state": {"count": 1, "dtype": "float64"}})
    np.array([0.5, 1.5, 2.5]).tofile(tmp_path / "c.state0")
    ms = read_csr(tmp_path / "c", array="state0")
    assert ms.kind == "csr" and ms.arrays == ("value", "state0")
    assert same_bits(ms.csr.value, np.array([0.5, 1.5, 2.5]))
    assert same_bits(ms.csr.colidx, c.colidx) and ms.dtypes["value"] == "float64"
    status, out, _ = main_out("dump", tmp_path / "c", "--array", "state0", "--format", "csv")
    assert out == "row,col,value\n0,0,0.5\n0,2,1.5\n1,2,2.5\n"
    assert main_out("check", tmp_path / "c")[1].endswith("; state0 float64 ok\n")
    with pytest.raises(InvalidArgument, match="has no array 'state1': its arrays are value, "
                                              "state0"):
        read_csr(tmp_path / "c", array="state1")
    with pytest.raises(InvalidArgument, match="is not value or stateN"):
        read_csr(tmp_path / "c", array="../x")
    (tmp_path / "c.state0").write_bytes(b"\0" * 16)
    with pytest.raises(CorruptFile, match=r"c.state0: position 2: state0 ends after 2 entries "
                                          r"but .*c.colidx holds 3 column indices \(colidx and "
                                          r"state0 must have equal length\)"):
        read_csr(tmp_path / "c", array="state0")
    os.unlink(tmp_path / "c.state0")
    with pytest.raises(NotFound, match="missing file .*c.state0"):
        read_csr(tmp_path / "c", array="state0")


def _damage_cases():
    """(what, how to damage the set X = 3 x 4 float32 with one state, exact message)."""
    def meta_edit(**kw):
        def f(p):
            m = json.loads(open(f"{p}.meta").read())
            for k, v in kw.items():
                if v is None:
                    m.pop(k, None)
                else:
                    m[k] = v
            open(f"{p}.meta", "w").write(json.dumps(m))
        return f

    def cut(ext, n):
        def f(p):
            os.truncate(f"{p}.{ext}", n)
        return f

    def rm(ext):
        return lambda p: os.unlink(f"{p}.{ext}")

    return [
        ("missing value", rm("value"), NotFound, "missing file X.value"),
        ("missing state", rm("state0"), NotFound, "missing file X.state0"),
        ("partial entry", cut("value", 46), CorruptFile,
         "X.value: truncated: size 46 bytes is not a multiple of the float32 itemsize 4 "
         "(partial entry at position 11) (value dtype float32 from X.meta)"),
        ("too few values", cut("value", 40), CorruptFile,
         'X.value: position 10: 10 float32 values, but a dense 3 x 4 set has rows * cols = '
         '12 (rows and cols from field "shape" of X.meta)'),
        ("state too short", cut("state0", 8), CorruptFile,
         'X.state0: position 2: 2 float32 values, but a dense 3 x 4 set has rows * cols = '
         '12 (rows and cols from field "shape" of X.meta)'),
        ("meta dtype too narrow", meta_edit(dtypes={"value": "float16"}), CorruptFile,
         'X.meta: field "dtypes.value" = "float16" disagrees with X.value: 48 bytes = 24 '
         'float16 entries, but 12 are expected (int32 or float32 would fit)'),
        ("meta dtype too wide", meta_edit(dtypes={"value": "float64"}), CorruptFile,
         'X.value: position 6: 6 float64 values, but a dense 3 x 4 set has rows * cols = 12 '
         '(rows and cols from field "shape" of X.meta); or, if X.value is whole, its values '
         'are int32 or float32 and field "dtypes.value" of X.meta is wrong'),
        ("half truncated", cut("value", 24), CorruptFile,
         'X.value: position 6: 6 float32 values, but a dense 3 x 4 set has rows * cols = 12 '
         '(rows and cols from field "shape" of X.meta); or, if X.value is whole, its values '
         'are float16 and field "dtypes.value" of X.meta is wrong'),
        ("no cols", meta_edit(shape=None, cols=None), CorruptFile,
         'X.meta: field "cols" is missing: a dense set needs "rows" and "cols" (or "shape")'),
        ("rows vs shape", meta_edit(rows=4), CorruptFile,
         'X.meta: field "rows" = 4 disagrees with field "shape" = [3, 4] (rows = shape[0], '
         'cols = the product of shape[1:]: 3 x 4)'),
        ("rows without shape", meta_edit(shape=None, rows=4), CorruptFile,
         'X.value: position 12: 12 float32 values, but a dense 4 x 4 set has rows * cols = '
         '16 (rows and cols from X.meta)'),
        ("nnz", meta_edit(nnz=11), CorruptFile,
         'X.meta: field "nnz" = 11 disagrees with rows * cols = 3 x 4 = 12'),
        ("bad kind", meta_edit(kind="table"), CorruptFile,
         'X.meta: field "kind" = "table" is not "csr" or "dense": the file set kinds this '
         'reader knows'),
        ("meta state dtype", meta_edit(state={"count": 1, "dtype": "float16"}), CorruptFile,
         'X.meta: field "state.dtype" = "float16" disagrees with X.state0: 48 bytes = 24 '
         'float16 entries, but 12 are expected (int32 or float32 would fit)'),
        ("bad shape", meta_edit(shape=[3, -4]), CorruptFile,
         'X.meta: field "shape" = [3, -4] is not a list of non-negative integers'),
        ("state count too large", meta_edit(state={"count": 5, "dtype": "float32"}),
         CorruptFile, 'X.meta: field "state.count" = 5 is more than 4, the most optimizer '
         'state arrays a set has'),
        ("bad state dtype", meta_edit(state={"count": 1, "dtype": "complex64"}), CorruptFile,
         'X.meta: field "state.dtype" = "complex64" is not one of int8, int32, float16, '
         'float32, float64'),
    ]


@pytest.mark.parametrize("what,damage,exc,message", _damage_cases(),
                         ids=[c[0] for c in _damage_cases()])
def test_dense_validation_messages(tmp_path, monkeypatch, what, damage, exc, message):
    """Each defect of a dense set raises its documented one-line message (CLI: exit 2)."""
    monkeypatch.chdir(tmp_path)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_dense("X", a, states=[a])
    damage("X")
    with pytest.raises(exc) as info:
        validate_all("X")
    assert info.value.message == message
    status, out, err = main_out("check", "X")
    assert status == 2 and out == ""
    assert err.startswith(f"shmps-tool: error: {message}") and err.count("\n") == 1


def test_dense_dtype_inference_and_flags(tmp_path, monkeypatch):
    """Dense dtypes are inferred or need --value-dtype; structure flags are refused."""
    monkeypatch.chdir(tmp_path)
    np.arange(6, dtype=np.float64).tofile("F.value")
    Path("F.meta").write_text('{"kind": "dense", "rows": 2, "cols": 3}')
    ms = read_csr("F")
    assert ms.dtypes["value"] == "float64" and ms.sources["value"] == "inferred"
    assert ms.inferred["value"] == "float64: 48 bytes = 6 entries of 8 bytes = rows * cols"
    np.arange(6, dtype=np.int8).tofile("I.value")
    Path("I.meta").write_text('{"kind": "dense", "rows": 2, "cols": 3}')
    with pytest.raises(CorruptFile, match="truncated: .*pass --value-dtype"):
        read_csr("I")
    np.arange(8, dtype=np.int8).tofile("J.value")
    Path("J.meta").write_text('{"kind": "dense", "rows": 2, "cols": 4}')
    with pytest.raises(CorruptFile, match="8 bytes = 8 values of 1 byte: pass --value-dtype "
                                          "int8"):
        read_csr("J")
    assert same_bits(read_csr("J", value_dtype="int8").to_numpy(),
                     np.arange(8, dtype=np.int8).reshape(2, 4))
    with pytest.raises(InvalidArgument, match="--rowcnt-dtype: .* dense set"):
        read_csr("F", rowcnt_dtype="int32")
    with pytest.raises(InvalidArgument, match="--cols 4: .* has 3 columns"):
        read_csr("F", cols=4)
    assert read_csr("F", cols=3).cols == 3
    status, _, err = main_out("dump", "F", "--colidx-dtype", "int64")
    assert status == 2 and "dense set" in err


@pytest.mark.parametrize("meta,field", [
    ({"rows": 2**70, "cols": 0}, "a dense 1180591620717411303424 x 0 set"),
    ({"rows": 2**63 - 1, "cols": 0}, "a dense 9223372036854775807 x 0 set"),  # rows + 1
    ({"rows": 2**62, "cols": 0}, "a dense 4611686018427387904 x 0 set"),      # x 4 bytes
    ({"rows": 0, "cols": 10**400}, "a dense 0 x 1000000"),
    ({"shape": [2**64, 0]}, "a dense 18446744073709551616 x 0 set"),
    ({"shape": [0, 2**40, 2**40]}, "a dense 0 x 1208925819614629174706176 set"),
    ({"shape": [0, 2**61, 0]}, "a dense 0 x 0 set (shape [0, 2305843009213693952, 0])"),
])
def test_dense_dims_beyond_an_array_are_refused(tmp_path, meta, field):
    """A dense float32 set numpy cannot make an array of (its non-zero axes times 4 bytes,
    or rows + 1, past 2**63 - 1) is a CorruptFile, everywhere it is read; with a 0 axis
    its empty .value fitted, so it read "ok", then to_numpy() (ValueError), dump --format
    summary (OverflowError) and convert to .npy (ValueError) failed as internal errors."""
    prefix = tmp_path / "d"
    (tmp_path / "d.meta").write_text(json.dumps(
        {"version": 1, "kind": "dense", "dtypes": {"value": "float32"}, **meta}))
    (tmp_path / "d.value").write_bytes(b"")
    for read in (shmps.files.read_csr, shmps.files.read_dense, shmps.files.validate_all):
        with pytest.raises(CorruptFile, match="is larger than an array can be") as info:
            read(prefix)
        assert field in str(info.value)
    for argv in (("check", prefix), ("dump", prefix, "--format", "summary"),
                 ("convert", prefix, tmp_path / "o.npy")):
        status, out, err = main_out(*argv)
        assert status == 2 and err.count("\n") == 1 and "larger than an array can be" in err
    assert not (tmp_path / "o.npy").exists()


def test_largest_dense_dims_still_read(tmp_path):
    """The largest empty dense float32 sets numpy can make read, check and convert."""
    for rows, cols in (((2**63 - 1) // 4, 0), (0, (2**63 - 1) // 4)):
        prefix = tmp_path / f"d{rows}"
        Path(f"{prefix}.meta").write_text(json.dumps(
            {"version": 1, "kind": "dense", "rows": rows, "cols": cols,
             "dtypes": {"value": "float32"}}))
        Path(f"{prefix}.value").write_bytes(b"")
        ms = shmps.files.read_csr(prefix)
        assert (ms.rows, ms.cols, ms.nnz, len(ms.csr.rowcnt)) == (rows, cols, 0, rows + 1)
        assert ms.to_numpy().shape == (rows, cols)
        status, out, err = main_out("check", prefix)
        assert status == 0, err


def test_from_dense_matrix_set():
    """MatrixSet.from_dense describes an in-memory array without copying it."""
    a = np.arange(6, dtype=np.int32).reshape(3, 2)
    ms = MatrixSet.from_dense(a)
    assert (ms.kind, ms.rows, ms.cols, ms.shape, ms.nnz) == ("dense", 3, 2, (3, 2), 6)
    assert np.shares_memory(ms.csr.value, a)
    assert MatrixSet.from_dense(np.float32(7)).shape == ()
    with pytest.raises(InvalidArgument):
        MatrixSet.from_dense(a, shape=(4, 2))


HUGE = """
import sys
from shmps import cli
for args in (["check", sys.argv[1]],
             ["dump", sys.argv[1], "--head", "2"],
             ["dump", sys.argv[1], "--format", "csv", "--rows", sys.argv[2]],
             ["dump", sys.argv[1], "--format", "json", "--rows", sys.argv[2]]):
    assert cli.main(args) == 0
    print("---", flush=True)
# peak RSS of this process image (ru_maxrss would include the parent's at fork)
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
print(int(hwm.split()[1]) // 1024)
"""


def test_huge_dense_set_is_never_materialised(tmp_path):
    """check and windowed dumps of a 2 GiB dense set run in bounded memory."""
    rows = 1 << 29
    with open(tmp_path / "H.value", "wb") as f:
        f.truncate(rows * 4)
        f.seek((rows - 2) * 4)
        f.write(np.array([1.5, -2.0], dtype=np.float32).tobytes())
    (tmp_path / "H.meta").write_text(json.dumps({"version": 1, "kind": "dense", "rows": rows,
                                                 "cols": 1, "dtypes": {"value": "float32"}}))
    env = child_env()
    r = subprocess.run([sys.executable, "-c", HUGE, str(tmp_path / "H"), f"{rows - 3}:"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    check, head, csv, js, rss = r.stdout.split("---\n")
    assert check == f"ok: {rows} x 1, dense (structure implicit), nnz {rows} " \
                    "(dtypes value=float32)\n"
    assert head.splitlines()[1:3] == ["row 0: (0, 0.0)", "row 1: (0, 0.0)"]
    assert csv.splitlines() == ["row,col,value", f"{rows - 3},0,0.0", f"{rows - 2},0,1.5",
                                f"{rows - 1},0,-2.0"]
    assert json.loads(js) == {"rows": 3, "cols": 1, "dtypes": {
        "rowcnt": "int64", "colidx": "int32", "value": "float32"}, "rowcnt": [0, 1, 2, 3],
        "colidx": [0, 0, 0], "value": [0.0, 1.5, -2.0]}
    assert int(rss) < 400, f"peak RSS {rss} MiB: something was materialised"


LIMITED_CHECK = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from shmps import cli
sys.exit(cli.main(["check", sys.argv[1]]))
"""


def test_huge_state_count_is_refused_at_once(tmp_path):
    """A .meta declaring 2**40 state arrays (one flipped bit) is refused naming
    "state.count", at once and in 1 GiB of address space (it made 2**40 array names)."""
    p = tmp_path / "D"
    write_dense(str(p), np.zeros((4, 6), np.float32), states=[np.zeros((4, 6), np.float32)])
    m = json.loads((tmp_path / "D.meta").read_text())
    m["state"]["count"] = 2**40
    (tmp_path / "D.meta").write_text(json.dumps(m))
    env = child_env()
    r = subprocess.run(["timeout", "60", sys.executable, "-c", LIMITED_CHECK, str(p)],
                       capture_output=True, text=True, env=env, timeout=90)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert 'field "state.count" = 1099511627776 is more than 4' in r.stderr, r.stderr


def test_a_dense_set_whose_meta_cannot_be_read_names_the_meta(tmp_path):
    """A dense set (X.value + X.meta) whose .meta is damaged is reported by that .meta's
    defect, not as a csr set missing X.rowcnt and X.colidx (the kind the .meta would
    have given was unknown, so the set was read as csr; review of the fuzzing pass)."""
    write_dense(tmp_path / "X", np.arange(6, dtype=np.float32).reshape(2, 3))
    meta = tmp_path / "X.meta"
    meta.write_text(meta.read_text()[:-5])   # cut short: unparsable
    for read in (read_csr, validate_all):
        with pytest.raises(CorruptFile, match=r"X\.meta: unparsable JSON"):
            read(tmp_path / "X")
    # a csr set missing a file is still NotFound, .meta or not
    write_csr(tmp_path / "S", CSR.from_dense(np.eye(2, dtype=np.float32)))
    os.unlink(tmp_path / "S.colidx")
    with pytest.raises(NotFound, match=r"missing file .*S\.colidx"):
        read_csr(tmp_path / "S")


@pytest.mark.timeout(60)
def test_a_member_path_of_an_array_the_set_does_not_have_says_which_it_has(tmp_path):
    """X.state9 (a member path, as X.state0 is, of an array the .meta does not declare)
    is refused naming the arrays X has, as --array state9 is; and X.state0 of a
    declared array whose file is gone is a missing file.  It was taken for the prefix
    of another set: "missing file X.state9.rowcnt, X.state9.colidx, X.state9.value"."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    write_dense(tmp_path / "t0", a, states=[a * 2])
    with pytest.raises(InvalidArgument, match="has no array 'state9': its arrays are "
                                              "value, state0"):
        shmps.files.read_csr(tmp_path / "t0.state9")
    status, _, err = main_out("dump", tmp_path / "t0.state9")
    assert status == 2 and "has no array 'state9'" in err, err
    assert shmps.files.read_csr(tmp_path / "t0.state0").csr.value.tolist() == \
        (a * 2).reshape(-1).tolist()
    os.unlink(tmp_path / "t0.state0")
    with pytest.raises(NotFound, match="t0.state0"):
        shmps.files.read_csr(tmp_path / "t0.state0")
