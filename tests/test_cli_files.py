"""shmps-tool file verbs (dump, check, convert) through real subprocesses and cli.main."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import shmps.files
from shmps import cli
from shmps.cli_files import ENTRY_CHUNK, ROW_CHUNK, value_strings
from shmps.files import CSR, read_csr, write_csr

import cli_runner
from helpers import child_env
from test_files import CORRUPT, EXAMPLE, csr_cases, raw_set, record_bars



def tool_env() -> dict[str, str]:
    """The environment that makes ``python -m shmps.cli`` run the shmps under test."""
    return child_env()


def tool(*args: str, cwd: str | os.PathLike[str] | None = None,
         fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m shmps.cli ARGS`` in a process of its own, forked with the imports
    done (cli_runner), or with ``fresh`` in a fresh interpreter; capture text output."""
    if fresh:
        return subprocess.run([sys.executable, "-m", "shmps.cli", *map(str, args)], cwd=cwd,
                              env=tool_env(), capture_output=True, text=True, timeout=120)
    return cli_runner.run("shmps.cli", args, cwd=cwd, env=tool_env(), timeout=120)


def main_out(*args: str) -> tuple[int, str, str]:
    """Run cli.main in this process; return (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main([str(a) for a in args])
    return status, out.getvalue(), err.getvalue()


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, nothing on stdout, exactly one 'shmps-tool: error:' line with the needles."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("shmps-tool: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def json_matches(doc: dict, csr: CSR, cols: int) -> None:
    """The dump JSON equals the CSR: structure exactly, values bit for bit (NaN as NaN)."""
    assert set(doc) == {"rows", "cols", "dtypes", "rowcnt", "colidx", "value"}
    assert doc["rows"] == csr.rows and doc["cols"] == cols
    assert doc["rowcnt"] == csr.rowcnt.tolist() and doc["colidx"] == csr.colidx.tolist()
    dt = csr.value.dtype
    got = np.array([float(v) if isinstance(v, str) else v for v in doc["value"]],
                   dtype=np.float64 if dt.kind == "f" else np.int64).astype(dt)
    want = np.asarray(csr.value)
    nan = np.isnan(want) if dt.kind == "f" else np.zeros(len(want), bool)
    assert np.array_equal(np.isnan(got) if dt.kind == "f" else nan, nan)
    assert got[~nan].tobytes() == want[~nan].tobytes()
    for v, w in zip(doc["value"], want):
        if isinstance(v, str):
            assert v in ("nan", "inf", "-inf") and not np.isfinite(w)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=csr_cases())
def test_dump_json_round_trip_through_subprocess(tmp_path, case):
    """write_csr, then `shmps-tool dump --format json` in a subprocess (a fresh
    interpreter: `python -m shmps.cli` imports its modules itself), gives the data back."""
    csr, cols = case
    write_csr(tmp_path / "m", csr, cols=cols)
    r = tool("dump", tmp_path / "m", "--format", "json", fresh=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    json_matches(json.loads(r.stdout), csr, cols)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=csr_cases())
def test_dump_json_round_trip_in_process(tmp_path, case):
    """The same JSON round trip over many more random sets, through cli.main."""
    csr, cols = case
    write_csr(tmp_path / "m", csr, cols=cols)
    status, out, err = main_out("dump", tmp_path / "m", "--format", "json")
    assert status == 0 and err == ""
    doc = json.loads(out)
    json_matches(doc, csr, cols)
    assert doc["dtypes"] == {"rowcnt": csr.rowcnt.dtype.name, "colidx": csr.colidx.dtype.name,
                             "value": csr.value.dtype.name}


@settings(max_examples=300, deadline=None)
@given(a=st.one_of(hnp.arrays(np.float16, st.integers(0, 40)),
                   hnp.arrays(np.float32, st.integers(0, 40)),
                   hnp.arrays(np.float64, st.integers(0, 40))))
def test_value_strings_read_back_exactly(a):
    """Every finite value string parses (float64, then cast) to the identical value."""
    s = value_strings(a)
    fin = np.isfinite(a)
    back = np.array([float(x) for x in s], dtype=np.float64).astype(a.dtype)
    assert back[fin].tobytes() == a[fin].tobytes()
    assert [x for x, f in zip(s, fin) if not f] == [str(v) for v in a[~fin].astype(np.float64)]


def test_table_csv_json_of_the_example(tmp_path):
    """The example matrix prints exactly as docs/cli.md shows, in table, csv and json."""
    write_csr(tmp_path / "x", CSR.from_dense(EXAMPLE), cols=4)
    r = tool("dump", tmp_path / "x")
    assert r.returncode == 0 and r.stdout == (
        "# 3 x 4, nnz 6 (rowcnt int64, colidx int32, value float32)\n"
        "row 0: (0, 1.0) (1, 2.0)\nrow 1: (1, 3.0) (2, 9.0)\nrow 2: (1, 1.0) (2, 4.0)\n")
    status, out, _ = main_out("dump", tmp_path / "x", "--format", "csv")
    assert status == 0 and out == ("row,col,value\n0,0,1.0\n0,1,2.0\n1,1,3.0\n1,2,9.0\n"
                                   "2,1,1.0\n2,2,4.0\n")
    status, out, _ = main_out("dump", tmp_path / "x", "--format", "json")
    assert out == ('{"rows":3,"cols":4,"dtypes":{"rowcnt":"int64","colidx":"int32",'
                   '"value":"float32"},"rowcnt":[0,2,4,6],"colidx":[0,1,1,2,1,2],'
                   '"value":[1.0,2.0,3.0,9.0,1.0,4.0]}\n')


def test_rows_and_head_limit_table_csv_json(tmp_path):
    """--rows A:B and --head N restrict table, csv and json (json rebases rowcnt)."""
    write_csr(tmp_path / "x", CSR.from_dense(EXAMPLE), cols=4)
    _, out, _ = main_out("dump", tmp_path / "x", "--rows", "1:3", "--format", "json")
    assert json.loads(out) == {"rows": 2, "cols": 4, "dtypes": {
        "rowcnt": "int64", "colidx": "int32", "value": "float32"}, "rowcnt": [0, 2, 4],
        "colidx": [1, 2, 1, 2], "value": [3.0, 9.0, 1.0, 4.0]}
    _, out, _ = main_out("dump", tmp_path / "x", "--head", "1")
    assert out.splitlines()[1:] == ["row 0: (0, 1.0) (1, 2.0)",
                                    "# 2 more rows not shown (--rows 1: shows them)"]
    _, out, _ = main_out("dump", tmp_path / "x", "--rows", "1:", "--head", "1",
                         "--format", "csv")
    assert out == "row,col,value\n1,1,3.0\n1,2,9.0\n"
    _, out, _ = main_out("dump", tmp_path / "x", "--rows", "2", "--format", "csv")
    assert out == "row,col,value\n2,1,1.0\n2,2,4.0\n"


def test_summary_reports_shape_dtypes_inference_and_stats(tmp_path):
    """summary shows shape, nnz, density, inferred dtypes with reasons, row/value stats."""
    indptr = np.array([0, 2, 2, 5], np.int32)
    prefix = raw_set(tmp_path / "s", indptr, np.array([0, 3, 1, 2, 3], np.int32),
                     np.array([1.0, np.nan, np.inf, -2.0, 4.0], np.float64))
    r = tool("dump", prefix, "--format", "summary")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "shape:     3 x 4" in lines and "nnz:       5" in lines
    assert "density:   0.416667" in lines
    assert ("  rowcnt: int32 (inferred: int32: 16 bytes = 4 entries, starting at 0 and "
            "ending at 5 = the number of values)") in lines
    assert "  value: float64 (inferred: float64: 40 bytes = 5 entries of 8 bytes = " \
           "rowcnt's last entry)" in lines
    assert "cols:      4 (inferred: 4 = largest column index 3 + 1)" in lines
    assert "row nnz:   min 0, median 2, max 3 (1 empty rows)" in lines
    assert "values:    min -2.0, max 4.0, mean 1 (over 3 finite values)" in lines
    assert "nonfinite: NaN 1, +Inf 1, -Inf 0" in lines


def test_scipy_files_dump_like_scipy(tmp_path):
    """A scipy matrix saved with tofile (no .meta) dumps as JSON equal to scipy's arrays."""
    m = sp.random(30, 1000, density=0.05, format="csr", dtype=np.float64, random_state=7)
    prefix = raw_set(tmp_path / "s", m.indptr, m.indices, m.data)
    r = tool("dump", prefix, "--format", "json")
    doc = json.loads(r.stdout)
    assert doc["dtypes"] == {"rowcnt": "int32", "colidx": "int32", "value": "float64"}
    assert doc["rowcnt"] == m.indptr.tolist() and doc["colidx"] == m.indices.tolist()
    assert doc["value"] == m.data.tolist() and doc["cols"] == m.indices.max() + 1


def test_nonfinite_values_are_json_strings(tmp_path):
    """NaN and infinities come out as the JSON strings "nan", "inf", "-inf"."""
    write_csr(tmp_path / "n", CSR(np.array([0, 3]), np.array([0, 1, 2], np.int32),
                                  np.array([np.nan, np.inf, -np.inf], np.float32)))
    _, out, _ = main_out("dump", tmp_path / "n", "--format", "json")
    assert json.loads(out)["value"] == ["nan", "inf", "-inf"]
    _, out, _ = main_out("dump", tmp_path / "n", "--format", "csv")
    assert out.splitlines()[1:] == ["0,0,nan", "0,1,inf", "0,2,-inf"]


def test_long_rows_and_many_rows_stream_in_chunks(tmp_path):
    """A row longer than ENTRY_CHUNK and more rows than ROW_CHUNK print completely."""
    long_row = ENTRY_CHUNK + 10
    rows = ROW_CHUNK + 5
    counts = np.zeros(rows, np.int64)
    counts[0], counts[-1] = long_row, 3
    rowcnt = np.concatenate([[0], np.cumsum(counts)])
    colidx = np.concatenate([np.arange(long_row), [0, 1, 2]]).astype(np.int32)
    value = np.arange(long_row + 3, dtype=np.int32)
    write_csr(tmp_path / "b", CSR(rowcnt, colidx, value))
    _, out, _ = main_out("dump", tmp_path / "b")
    lines = out.splitlines()
    assert len(lines) == rows + 1
    assert lines[1].count("(") == long_row and lines[1].endswith(f"({long_row - 1}, "
                                                                 f"{long_row - 1})")
    assert lines[-1] == f"row {rows - 1}: (0, {long_row}) (1, {long_row + 1}) " \
                        f"(2, {long_row + 2})"
    assert all(line == f"row {i}:" for i, line in enumerate(lines[2:-1], start=1))
    _, out, _ = main_out("dump", tmp_path / "b", "--format", "csv")
    assert len(out.splitlines()) == long_row + 3 + 1
    assert out.splitlines()[-1] == f"{rows - 1},2,{long_row + 2}"


@pytest.mark.parametrize("name,mutate,expected", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_every_corruption_exits_2_with_one_line(tmp_path, name, mutate, expected):
    """check and dump report each corruption as one stderr line naming file and position."""
    prefix = str(tmp_path / "m")
    write_csr(prefix, CSR.from_dense(EXAMPLE), cols=4)
    mutate(prefix)
    r = tool("check", prefix)
    assert_one_line_error(r, expected.format(p=prefix))
    if name in ("rowcnt decreasing", "column too big"):
        assert_one_line_error(tool("dump", prefix), expected.format(p=prefix))


def test_check_ok_line(tmp_path):
    """check prints 'ok: R x C, nnz N (dtypes ...)' and exits 0; flags are honoured."""
    write_csr(tmp_path / "x", CSR.from_dense(EXAMPLE), cols=4)
    r = tool("check", tmp_path / "x")
    assert (r.returncode, r.stdout, r.stderr) == (
        0, "ok: 3 x 4, nnz 6 (dtypes rowcnt=int64, colidx=int32, value=float32)\n", "")
    prefix = raw_set(tmp_path / "i", np.array([0, 2], np.int64), np.array([0, 1], np.int32),
                     np.array([1, 2], np.int8))
    status, out, _ = main_out("check", prefix, "--value-dtype", "int8", "--cols", "9")
    assert status == 0 and out == "ok: 1 x 9, nnz 2 (dtypes rowcnt=int64, colidx=int32, " \
                                  "value=int8)\n"


@pytest.mark.parametrize("argv,needle", [
    (["dump"], "dump needs PREFIX (a file set) or --store NAME --tensor T"),
    (["dump", "x", "--rows", "3:1"], "argument --rows: empty range '3:1'"),
    (["dump", "x", "--rows=-1:"], "row bounds must be non-negative"),
    # argparse (before Python 3.13) takes '-1:' for an option, not --rows's value
    (["dump", "x", "--rows", "-1:"], "no negative indexing"),
    (["dump", "x", "--rows", "-3:-1"], "no negative indexing"),
    (["dump", "x", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
    (["dump", "x", "--store", "s", "--tensor", "t"], "give either PREFIX or --store"),
    (["dump", "nothere"], "missing file nothere.rowcnt, nothere.colidx, nothere.value"),
    # a checkpoint that is not there (it was said to be "not a checkpoint directory
    # (no checkpoint.json)"), a directory that is none (it was "missing file d.rowcnt")
    (["dump", "nothere", "--tensor", "w"], "--tensor w: no checkpoint directory nothere"),
    (["dump", "d"], "d is a directory without checkpoint.json: not a checkpoint"),
    (["check", "x", "--value-dtype", "int64"], "argument --value-dtype: invalid choice"),
    (["convert", "a", "b"], "exactly one side must be a file set prefix"),
    (["convert", "a.npz", "b.npy"], "exactly one side must be a file set prefix"),
    (["convert", "x", "x.npz", "--keep-zeros"], "--keep-zeros applies to a dense .npy SRC"),
])
def test_usage_errors_are_one_line(tmp_path, argv, needle):
    """Bad invocations exit 2 with a single 'shmps-tool: error: <what> (<hint>)' line, no
    traceback; the hint is one for a CLI user (the verb's --help where nothing more
    precise is said), never the API's "check the argument against the docstring"."""
    write_csr(tmp_path / "x", CSR.from_dense(EXAMPLE))
    (tmp_path / "d").mkdir()
    r = tool(*argv, cwd=tmp_path)
    assert_one_line_error(r, needle)
    assert r.stderr.rstrip().endswith(")") and "docstring" not in r.stderr, r.stderr


def test_rows_beyond_the_matrix_is_an_error(tmp_path):
    """--rows starting past the last row is refused; an end past it is clamped."""
    write_csr(tmp_path / "x", CSR.from_dense(EXAMPLE))
    status, _, err = main_out("dump", tmp_path / "x", "--rows", "4:")
    assert status == 2 and "--rows 4:...: the matrix has 3 rows" in err
    status, out, _ = main_out("dump", tmp_path / "x", "--rows", "2:99", "--format", "csv")
    assert status == 0 and out.count("\n") == 3


def test_convert_npz_round_trip(tmp_path):
    """npz -> file set -> npz keeps shape, structure (explicit zeros too) and values."""
    m = sp.random(40, 300, density=0.1, format="csr", dtype=np.float32, random_state=3)
    m.data[0] = 0.0  # an explicit zero is structure, and must survive
    sp.save_npz(tmp_path / "a.npz", m)
    r = tool("convert", tmp_path / "a.npz", tmp_path / "set")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"converted {tmp_path / 'a.npz'} -> {tmp_path / 'set'}: 40 x 300, " \
                       f"nnz {m.nnz}, value float32\n"
    ms = read_csr(tmp_path / "set")
    assert ms.cols == 300 and ms.sources["cols"] == "meta"
    assert np.array_equal(ms.csr.rowcnt, m.indptr) and np.array_equal(ms.csr.value, m.data)
    r = tool("convert", tmp_path / "set", tmp_path / "b.npz")
    assert r.returncode == 0, r.stderr
    b = sp.load_npz(tmp_path / "b.npz")
    assert b.shape == m.shape and b.nnz == m.nnz and b.dtype == np.float32
    assert np.array_equal(b.indptr, m.indptr) and np.array_equal(b.indices, m.indices)
    assert np.array_equal(b.data, m.data)
    assert sorted(os.listdir(tmp_path)) == [".set.lock", "a.npz", "b.npz", "set.colidx",
                                            "set.meta", "set.rowcnt", "set.value"]


def test_convert_npy_round_trip_with_and_without_zeros(tmp_path):
    """npy -> file set keeps only nonzeros (or all with --keep-zeros); back to npy is equal."""
    a = np.array([[0, 1.5, 0], [0, 0, 0], [np.nan, 0, -2]], dtype=np.float64)
    np.save(tmp_path / "d.npy", a)
    assert tool("convert", tmp_path / "d.npy", tmp_path / "s").returncode == 0
    ms = read_csr(tmp_path / "s")
    assert ms.csr.rowcnt.tolist() == [0, 1, 1, 3] and ms.csr.colidx.tolist() == [1, 0, 2]
    assert (ms.rows, ms.cols) == (3, 3)
    r = tool("convert", tmp_path / "d.npy", tmp_path / "k", "--keep-zeros", "--dtype",
             "float32")
    assert r.returncode == 0, r.stderr
    ks = read_csr(tmp_path / "k")
    assert ks.nnz == 9 and ks.dtypes["value"] == "float32"
    for src in ("s", "k"):
        r = tool("convert", tmp_path / src, tmp_path / f"{src}.npy")
        assert r.returncode == 0, r.stderr
        back = np.load(tmp_path / f"{src}.npy")
        assert np.array_equal(back, a.astype(back.dtype), equal_nan=True)


def test_convert_edge_cases_in_process(tmp_path):
    """Empty matrices convert both ways; float16 to npz and int64 npy explain the fix."""
    np.save(tmp_path / "e.npy", np.zeros((0, 4), np.float32))
    assert main_out("convert", tmp_path / "e.npy", tmp_path / "e")[0] == 0
    assert (read_csr(tmp_path / "e").rows, read_csr(tmp_path / "e").cols) == (0, 4)
    assert main_out("convert", tmp_path / "e", tmp_path / "e2.npy")[0] == 0
    assert np.load(tmp_path / "e2.npy").shape == (0, 4)
    write_csr(tmp_path / "h", CSR.from_dense(EXAMPLE.astype(np.float16)))
    status, _, err = main_out("convert", tmp_path / "h", tmp_path / "h.npz")
    assert status == 2 and "scipy.sparse cannot hold float16 values (pass --dtype float32)" \
        in err
    assert main_out("convert", tmp_path / "h", tmp_path / "h.npz", "--dtype", "float32")[0] == 0
    np.save(tmp_path / "i.npy", np.ones((2, 2), np.int64))
    status, _, err = main_out("convert", tmp_path / "i.npy", tmp_path / "i")
    assert status == 2 and "value dtype int64 is not a file dtype" in err
    assert main_out("convert", tmp_path / "i.npy", tmp_path / "i", "--dtype", "int32")[0] == 0
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    status, _, err = main_out("convert", tmp_path / "bad.npz", tmp_path / "z")
    assert status == 2 and "bad.npz: not a scipy.sparse .npz file" in err
    assert hidden(tmp_path) == set()  # no temporaries left


def test_convert_of_values_that_overflow_keeps_stderr_clean(tmp_path):
    """Repeated entries whose sum overflows (inf, or NaN from inf + -inf) and values
    beyond the --dtype convert as numpy computes them (inf, NaN), exit 0, and print
    nothing on stderr (numpy's RuntimeWarning with a source line was printed)."""
    write_csr(tmp_path / "X", CSR(np.array([0, 4]), np.array([0, 0, 1, 1]),
                                  np.array([np.inf, -np.inf, 3e38, 3e38], np.float32)), cols=2)
    shmps.files.write_dense(str(tmp_path / "D"), np.array([[1e300, -1e300]]))
    write_csr(tmp_path / "Y", CSR(np.array([0, 2]), np.array([0, 1]), np.array([1e300, 2.0])),
              cols=2)
    for args, dst, want in [(("X", "X.npy"), "X.npy", [[np.nan, np.inf]]),
                            (("D", "D.npy", "--dtype", "float32"), "D.npy", [[np.inf, -np.inf]]),
                            (("Y", "Y.npy", "--dtype", "float32"), "Y.npy", [[np.inf, 2.0]]),
                            (("Y", "Y.npz", "--dtype", "float32"), "Y.npz", [[np.inf, 2.0]])]:
        r = tool("convert", *args, cwd=tmp_path)
        assert r.returncode == 0 and r.stderr == "", (args, r.stderr)
        got = (sp.load_npz(tmp_path / dst).toarray() if dst.endswith(".npz")
               else np.load(tmp_path / dst))
        assert np.array_equal(got, np.array(want, np.float32), equal_nan=True), (args, got)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def hidden(directory: Path) -> set[str]:
    """The hidden files in ``directory`` but the sets' lock files (``.X.lock``: empty,
    made by a set's first writer and kept)."""
    return {n for n in os.listdir(directory) if n.startswith(".")
            and not (n.endswith(".lock") and os.path.getsize(directory / n) == 0)}


def test_sigkilled_convert_leaves_temporaries_that_the_next_write_removes(tmp_path):
    """A convert SIGKILLed mid-write leaves .X.*.tmp-HOST-PID-HEX files; the next convert
    to X removes exactly those of this host's dead writers and this user, and keeps
    look-alikes, the earlier form without HOST, another host's whatever its pid, a live
    writer's and another user's (as does a convert to X.npy for .X.npy.tmp-*)."""
    big = tmp_path / "big.npy"  # 8 GiB of zeros, sparse on disk: seconds to scan
    del_me = np.lib.format.open_memmap(big, mode="w+", dtype=np.float32,
                                       shape=(1 << 16, 1 << 15))
    del del_me
    try:
        victim = subprocess.Popen([sys.executable, "-m", "shmps.cli", "convert", str(big),
                                   str(tmp_path / "X")], env=tool_env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while len(hidden(tmp_path)) < 3 and victim.poll() is None \
                and time.monotonic() < deadline:  # until all three are open
            time.sleep(0.002)
        assert victim.poll() is None, "convert ended before it could be killed"
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=60) == -signal.SIGKILL
    finally:
        big.unlink()
    killed = hidden(tmp_path)
    host = shmps.files.host_id()
    assert {n.split(".tmp-")[0] for n in killed} == {".X.rowcnt", ".X.colidx", ".X.value"}
    assert all(n.split(".tmp-")[1].startswith(f"{host}-{victim.pid}-") for n in killed)
    assert not any(n.startswith("X.") for n in os.listdir(tmp_path))
    dead, live = dead_pid(), os.getpid()
    other = f"{int(host, 16) ^ 0x80000001:08x}"  # another host's (or container's)
    h = f"{host}-{dead}"
    removed = {f".X.state3.tmp-{h}-fedcba98", f".X.meta.tmp-{h}-01234567"}
    kept = {f".X.value.tmp-{h}-0123456", f".X.value.tmp-{h}-0123456g",
            f".X.value.tmp-{h}-01234567.bak", f".X.values.tmp-{h}-01234567",
            f".X.state03.tmp-{h}-01234567", f".X.value.tmp-{host}-0{dead}-01234567",
            f".Y.value.tmp-{h}-01234567", f".X.npy.tmp-{h}-01234567",
            f".X.value.tmp-{host}-{live}-01234567", f".X.npy.tmp-{host}-{live}-01234567",
            f".X.value.tmp-{other}-{dead}-01234567", f".X.npy.tmp-{other}-{dead}-01234567",
            f".X.value.tmp-{host[:7]}-{dead}-01234567", f".X.value.tmp-{host}0-{dead}-01234567",
            f".X.value.tmp-{host.upper()}X-{dead}-01234567",
            f".X.value.tmp-{host}-{10**20}-01234567",  # no pid_t: left alone, no crash
            f".X.value.tmp-{dead}-01234567", f".X.npy.tmp-{dead}-01234567"}  # earlier form
    for n in removed | kept:
        (tmp_path / n).write_bytes(b"x")
    (tmp_path / f"X.value.tmp-{h}-01234567").write_bytes(b"x")  # not hidden: kept
    (tmp_path / f".X.colidx.tmp-{h}-89abcdef").mkdir()  # not a file: kept
    (tmp_path / f".X.rowcnt.tmp-{h}-89abcdef").symlink_to(big)  # not a file: kept
    kept |= {f".X.colidx.tmp-{h}-89abcdef", f".X.rowcnt.tmp-{h}-89abcdef"}
    if os.geteuid() == 0:  # another user's file with this user's name pattern: kept
        (tmp_path / f".X.value.tmp-{h}-76543210").write_bytes(b"x")
        os.chown(tmp_path / f".X.value.tmp-{h}-76543210", 65534, 65534)
        kept.add(f".X.value.tmp-{h}-76543210")
    a = np.array([[0, 1.5, 0], [2, 0, 0]], dtype=np.float32)
    np.save(tmp_path / "d.npy", a)
    r = tool("convert", tmp_path / "d.npy", tmp_path / "X")
    assert r.returncode == 0, r.stderr
    assert np.array_equal(read_csr(tmp_path / "X").to_numpy(), a)
    assert hidden(tmp_path) == kept  # .X.npy.tmp-* is not a file set's
    r = tool("convert", tmp_path / "X", tmp_path / "X.npy")
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(tmp_path / "X.npy"), a)
    assert hidden(tmp_path) == kept - {f".X.npy.tmp-{h}-01234567"}


def test_a_live_writer_of_another_pid_namespace_keeps_its_temporaries(tmp_path):
    """A writer of prefix X in another PID namespace (another host or container on a
    shared directory), alive, its pid dead here: the next writer of X here removes the
    temporaries of this host's dead writer but not the other's, whose commit then
    succeeds.  (Judged by its pid alone, the live writer's files were removed and its
    rename failed.)"""
    from helpers import start_in_other_pid_namespace

    prefix = tmp_path / "X"
    dtypes = {"rowcnt": "int64", "colidx": "int32", "value": "float32"}
    here = subprocess.run(  # this host's writer, killed before it could clean up
        [sys.executable, "-c", "import os, sys; from shmps.files import SetWriter; "
         f"SetWriter(sys.argv[1], {dtypes!r}); os._exit(0)", str(prefix)],
        env=tool_env(), timeout=60)
    assert here.returncode == 0
    dead_here = hidden(tmp_path)
    assert len(dead_here) == 3
    theirs = ("import sys\n"
              "import numpy as np\n"
              "from shmps.files import SetWriter, build_meta\n"
              f"w = SetWriter({str(prefix)!r}, {dtypes!r})\n"
              "w.append('rowcnt', np.array([0, 1], np.int64))\n"
              "w.append('colidx', np.array([2], np.int32))\n"
              "w.append('value', np.array([7], np.float32))\n"
              "print('open', flush=True)\n"
              "input()\n"
              f"w.commit(build_meta(1, 3, 1, {dtypes!r}))\n"
              "print('committed', flush=True)\n")
    other = start_in_other_pid_namespace(theirs, dead_pid(), env=tool_env())
    try:
        assert other.stdout.readline() == "open\n"
        their_tmp = hidden(tmp_path) - dead_here
        assert len(their_tmp) == 3
        write_csr(prefix, CSR(np.array([0, 1]), np.array([0]), np.array([1.0], np.float32)))
        assert hidden(tmp_path) == their_tmp
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline() == "committed\n"
        assert other.wait(timeout=60) == 0
    finally:
        if other.poll() is None:
            other.kill()
        other.wait()
    assert hidden(tmp_path) == set()
    assert np.array_equal(read_csr(prefix).to_numpy(), [[0, 0, 7]])


def huge_cols_set(prefix: Path, cols: int) -> Path:
    """A valid 1-row set with one entry whose .meta declares ``cols`` columns."""
    np.array([0, 1], np.int64).tofile(f"{prefix}.rowcnt")
    np.array([0], np.int32).tofile(f"{prefix}.colidx")
    np.array([1], np.float32).tofile(f"{prefix}.value")
    Path(f"{prefix}.meta").write_text(json.dumps(
        {"version": 1, "rows": 1, "cols": cols,
         "dtypes": {"rowcnt": "int64", "colidx": "int32", "value": "float32"}}))
    return prefix


def test_convert_to_npy_checks_the_output_size(tmp_path, monkeypatch):
    """A dense .npy too big for numpy, or for the free space of its directory, is refused
    before anything is written (one line, exit 2, saying how much it needs), not a raw
    numpy "array is too big" traceback or a file of terabytes."""
    huge_cols_set(tmp_path / "h", 2**62)
    r = tool("convert", tmp_path / "h", tmp_path / "h.npy")
    assert_one_line_error(r, "1 x 4611686018427387904 float32", "more than numpy can address",
                          "--cols")
    assert_one_line_error(tool("convert", tmp_path / "h", tmp_path / "h.npz", "--cols",
                               2**64), "larger than scipy.sparse can index")
    # an empty set is as unaddressable: numpy leaves a 0 axis out of its product (a set
    # of 0 rows and 2**62 columns, or 2 empty rows of 2**61, was a raw "array is too big")
    for rows, cols in ((0, 2**62), (2, 2**61)):
        write_csr(tmp_path / "e", CSR(np.zeros(rows + 1, np.int64), np.zeros(0, np.int32),
                                      np.zeros(0, np.float32)), cols=cols)
        assert_one_line_error(tool("convert", tmp_path / "e", tmp_path / "e.npy"),
                              f"{rows} x {cols} float32", "more than numpy can address")
    for e in ("rowcnt", "colidx", "value", "meta"):
        os.unlink(tmp_path / f"e.{e}")
    huge_cols_set(tmp_path / "g", 2**50)   # 4 PiB: more than any disk here has free
    assert_one_line_error(tool("convert", tmp_path / "g", tmp_path / "g.npy"),
                          "needs 4503599627370624 bytes", "free")
    write_csr(tmp_path / "x", CSR.from_dense(EXAMPLE))
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 0, 100))
    status, out, err = main_out("convert", tmp_path / "x", tmp_path / "x.npy")
    assert status == 2 and out == "" and err.count("\n") == 1
    assert "a dense 3 x 3 float32 array" in err   # no .meta: cols inferred
    assert "needs 164 bytes but" in err and "has 100 bytes free" in err
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".e.lock", ".x.lock"]
        + [f"{p}.{e}" for p in "hgx" for e in ("rowcnt", "colidx", "value", "meta")])


def test_unexpected_exceptions_are_one_line(tmp_path, monkeypatch):
    """An exception that is not a shmps error nor an OSError still gives one line, no
    traceback: MemoryError is an error (exit 2); anything else is an internal error,
    reported as such with exit 1 (SHMPS_TOOL_TRACEBACK=1 shows the traceback)."""
    import shmps.cli_files as cf
    write_csr(tmp_path / "x", CSR.from_dense(EXAMPLE))

    def boom(exc):
        def verb(args):
            raise exc
        return verb

    monkeypatch.setattr(cf, "check", boom(MemoryError()))
    status, out, err = main_out("check", tmp_path / "x")
    assert status == 2 and err.startswith("shmps-tool: error: out of memory") \
        and err.count("\n") == 1
    monkeypatch.setattr(cf, "check", boom(ValueError("array is too big")))
    status, out, err = main_out("check", tmp_path / "x")
    assert status == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("shmps-tool: error: internal error: ValueError: array is too big")
    assert "please report" in err
    monkeypatch.setenv("SHMPS_TOOL_TRACEBACK", "1")
    with pytest.raises(ValueError, match="array is too big"):
        main_out("check", tmp_path / "x")


def test_what_stdout_cannot_encode_is_escaped_not_an_internal_error(tmp_path):
    """A .meta key that is a lone surrogate (JSON "\\ud800") printed by dump --format
    summary, and a DST path with a byte that is not UTF-8 printed by convert under a
    strict stdout (a UTF-8 locale): each is escaped and the verb exits 0.  Before,
    UnicodeEncodeError made them an internal error (exit 1), the convert's output
    already written (fuzzing, review 24)."""
    write_csr(tmp_path / "x", CSR.from_dense(EXAMPLE))
    meta = json.loads((tmp_path / "x.meta").read_text())
    (tmp_path / "x.meta").write_text(json.dumps(meta)[:-1] + ', "\\ud800": 1}')
    env = dict(tool_env(), PYTHONIOENCODING="utf-8:strict")
    r = subprocess.run([sys.executable, "-m", "shmps.cli", "dump", str(tmp_path / "x"),
                        "--format", "summary"], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert b"other keys: \\ud800" in r.stdout
    dst = os.fsencode(tmp_path) + b"/\xff.npy"
    r = subprocess.run([sys.executable.encode(), b"-m", b"shmps.cli", b"convert",
                        os.fsencode(tmp_path / "x"), dst], env=env, capture_output=True,
                       timeout=120)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert dst in r.stdout and os.path.exists(dst)


def test_convert_refuses_a_hostile_npz_with_one_line(tmp_path):
    """An empty .npz, and one whose shape is floats or too short: one line naming the
    file (not a scipy.sparse .npz), exit 2, nothing written.  Before, they died of an
    internal EOFError / TypeError / IndexError (fuzzing, review 24)."""
    (tmp_path / "empty.npz").write_bytes(b"")
    base = dict(format=np.array(b"csr"), data=np.array([1.0, 2.0], np.float32),
                indices=np.array([0, 2], np.int32), indptr=np.array([0, 1, 2], np.int32))
    np.savez(tmp_path / "float_shape.npz", shape=np.array([2.5, 3]), **base)
    np.savez(tmp_path / "short_shape.npz", shape=np.array([2]), **base)
    for name in ("empty.npz", "float_shape.npz", "short_shape.npz"):
        r = tool("convert", tmp_path / name, tmp_path / "out")
        assert_one_line_error(r, f"{tmp_path / name}: not a scipy.sparse .npz file")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("out", ".out"))]


def test_dump_into_a_closed_pipe_is_quiet(tmp_path):
    """`dump | head -1` exits 0 without a BrokenPipe message on stderr."""
    n = 200_000
    write_csr(tmp_path / "p", CSR(np.array([0, n]), np.arange(n, dtype=np.int32),
                                  np.ones(n, np.float32)))
    env = child_env()
    r = subprocess.run(f'"{sys.executable}" -m shmps.cli dump "{tmp_path / "p"}" '
                       f"--format csv | head -n 1", shell=True, capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.stdout == "row,col,value\n" and r.stderr == ""


def test_dump_store_tensor_prints_a_live_dense_tensor(store, store_name):
    """`dump --store NAME --tensor T` prints a live dense tensor through the store verbs."""
    w = store.dense("w", shape=(3, 4), dtype="float32", init=0.0)
    w.push(EXAMPLE)
    r = tool("dump", "--store", store_name, "--tensor", "w", "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["rows"], doc["cols"]) == (3, 4)
    assert np.array_equal(CSR(np.array(doc["rowcnt"]), np.array(doc["colidx"]),
                              np.array(doc["value"], np.float32)).to_dense(4), EXAMPLE)
    assert_one_line_error(tool("dump", "--store", store_name, "--tensor", "nope"), "nope")
    assert_one_line_error(tool("dump", "--store", store_name), "needs --tensor T")


#: replaces a file set with os.replace counted: after the ``argv[2]``th rename of a
#: file (rowcnt, colidx, value, meta) the writer dies outright, or sleeps ``argv[3]`` s
#: before that rename when ``argv[3]`` is given
_REPLACE_THEN = r"""
import os, sys, time
import numpy as np
from shmps.files import CSR, write_csr
real, n = os.replace, [0]
def replace(a, b):
    n[0] += 1
    if len(sys.argv) > 3 and n[0] == int(sys.argv[2]):
        print("sleeping", flush=True)
        time.sleep(float(sys.argv[3]))
    real(a, b)
    if len(sys.argv) == 3 and n[0] == int(sys.argv[2]):
        os._exit(9)
os.replace = replace
write_csr(sys.argv[1], CSR(np.array([0, 2, 3, 3]), np.array([1, 3, 0], np.int32),
                           np.array([7, 8, 9], np.float32)), cols=4)
"""
OLD_SET = CSR(np.array([0, 1, 1, 3]), np.array([0, 1, 2], np.int32),
              np.array([1, 2, 3], np.float32))


def replace_then(prefix: Path, *how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _REPLACE_THEN, str(prefix), *how],
                          env=tool_env(), capture_output=True, text=True, timeout=60)


def new_set_read(prefix: Path) -> bool:
    ms = read_csr(prefix)
    return (ms.csr.rowcnt.tolist(), ms.csr.colidx.tolist(), ms.csr.value.tolist()) == \
        ([0, 2, 3, 3], [1, 3, 0], [7.0, 8.0, 9.0])


@pytest.mark.parametrize("renamed", [1, 2, 3, 4])
def test_a_set_whose_writer_died_between_two_renames_is_read_whole(tmp_path, renamed):
    """A writer killed after some of a set's renames (here: after ``renamed`` of its
    four files, the journal in place) left new files beside old ones of the same sizes, a
    mix that read as a valid set.  Its journal (.X.replacing) lists the renames; the
    next reader finishes them and reads the new set whole, leaving no hidden file; the
    next writer likewise.  Not finished, the reader got the new rowcnt/colidx with the
    old values (seen failing)."""
    prefix = tmp_path / "X"
    write_csr(prefix, OLD_SET, cols=4)
    r = replace_then(prefix, str(renamed))
    assert r.returncode == 9, r.stderr
    assert hidden(tmp_path)   # the journal and the files not renamed yet
    if renamed % 2:
        assert new_set_read(prefix)
    else:   # a writer finishes it first, then writes its own
        write_csr(prefix, OLD_SET, cols=4)
        assert read_csr(prefix).csr.value.tolist() == [1.0, 2.0, 3.0]
    assert hidden(tmp_path) == set()
    assert sorted(os.listdir(tmp_path)) == [".X.lock", "X.colidx", "X.meta", "X.rowcnt",
                                            "X.value"]


def test_a_reader_waits_for_a_live_writer_renaming_the_set(tmp_path):
    """A reader that finds a live writer of this host in the middle of its renames
    waits for it (here 0.5 s before its third rename) and reads the new set whole."""
    prefix = tmp_path / "X"
    write_csr(prefix, OLD_SET, cols=4)
    p = subprocess.Popen([sys.executable, "-c", _REPLACE_THEN, str(prefix), "3", "0.5"],
                         env=tool_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "sleeping\n"
        t0 = time.monotonic()
        assert new_set_read(prefix)
        assert time.monotonic() - t0 > 0.2   # it waited
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert hidden(tmp_path) == set()


def test_another_hosts_unfinished_replacement_is_finished_by_check_finish(tmp_path):
    """A journal written by another host's writer (a directory shared over NFS or by
    containers) where no set lock tells whether that writer still runs (no .X.lock: a
    writer of an earlier version, or locks that do not work) cannot be judged from
    here: a read refuses with one line saying how to finish it, and changes nothing;
    ``shmps-tool check --finish`` finishes it and checks the new set.  (With the lock
    file, a reader that gets its lock finishes it: tests/test_files_hosts.py.)  A
    journal that is not one is refused naming it, changing nothing."""
    prefix = tmp_path / "X"
    write_csr(prefix, OLD_SET, cols=4)
    assert replace_then(prefix, "2").returncode == 9
    journal = tmp_path / ".X.replacing"
    j = json.loads(journal.read_text())
    j["host"] = f"{int(shmps.files.host_id(), 16) ^ 1:08x}"
    journal.write_text(json.dumps(j))
    (tmp_path / ".X.lock").unlink()
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    r = tool("check", prefix)
    assert_one_line_error(r, "another host", "check --finish")
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before
    r = tool("check", "--finish", prefix)
    assert r.returncode == 0 and r.stdout.startswith("ok: 3 x 4, nnz 3"), r
    assert new_set_read(prefix) and hidden(tmp_path) == set()

    write_csr(prefix, OLD_SET, cols=4)
    journal.write_text('{"host": "x", "pid": 1, "renames": [["../../etc/passwd", "X.value"]]}')
    r = tool("dump", prefix)
    assert_one_line_error(r, ".X.replacing", "not a replacement journal")
    journal.unlink()
    os.mkfifo(journal)   # opened for reading, a FIFO would block until a writer came
    r = tool("check", prefix)
    assert_one_line_error(r, ".X.replacing", "not a regular file")
    journal.unlink()
    assert read_csr(prefix).csr.value.tolist() == [1.0, 2.0, 3.0]


def test_a_hidden_prefix_killed_mid_replacement_is_read_whole(tmp_path):
    """A set whose name starts with '.' (all its files hidden) is finished like any
    other: its journal's final names start with '.', which the journal check refused as
    forged, for good (review 21 F1)."""
    prefix = tmp_path / ".X"
    write_csr(prefix, OLD_SET, cols=4)
    assert replace_then(prefix, "3").returncode == 9
    assert new_set_read(prefix)
    assert sorted(os.listdir(tmp_path)) == ["..X.lock", ".X.colidx", ".X.meta", ".X.rowcnt",
                                            ".X.value"]


def test_a_reader_does_not_wait_for_a_dead_unreaped_writer(tmp_path):
    """A writer killed mid-replacement and not yet reaped (a zombie: kill(pid, 0) still
    answers) is dead: the next read finishes its replacement at once.  Judged by its
    pid alone, every read waited 10 s and then failed (review 21 F6)."""
    prefix = tmp_path / "X"
    write_csr(prefix, OLD_SET, cols=4)
    p = subprocess.Popen([sys.executable, "-c", _REPLACE_THEN, str(prefix), "3"],
                         env=tool_env())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # exited (os._exit), not reaped: a zombie
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        t0 = time.monotonic()
        assert new_set_read(prefix)
        assert time.monotonic() - t0 < 2.0
    finally:
        p.kill()
        p.wait()


def test_a_writer_thread_and_reader_threads_of_one_process(tmp_path):
    """Readers in the writers' own process do not finish their replacements under them
    (the journal carries the writer's token, which is this process's): they wait.
    Before, reader threads renamed the writer's files while it did, and about 40 % of
    its writes raised FileNotFoundError (review 21 F3)."""
    import threading

    prefix = tmp_path / "X"
    write_csr(prefix, OLD_SET, cols=4)
    errors: list = []
    stop = time.monotonic() + 2.0

    def write() -> None:
        n = 0
        while time.monotonic() < stop:
            try:
                write_csr(prefix, OLD_SET if n % 2 else
                          CSR(np.array([0, 2, 3, 3]), np.array([1, 3, 0], np.int32),
                              np.array([7, 8, 9], np.float32)), cols=4)
            except Exception as exc:   # noqa: BLE001 (what the test counts)
                errors.append(exc)
            n += 1

    def read() -> None:
        while time.monotonic() < stop:
            try:
                read_csr(prefix, mmap=False)
            except shmps.CorruptFile:
                pass   # a read overlapping the renames may see a mix (documented)
            except Exception as exc:   # noqa: BLE001
                errors.append(exc)

    # (two writers: the first to end its commit forgot the other's, whose renames a
    # reader then finished under it: review 22 F1)
    threads = [threading.Thread(target=write) for _ in range(2)] + [
        threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert hidden(tmp_path) == set()


def test_a_second_writer_waits_for_the_first_ones_renames(tmp_path):
    """Two writers of one set on this host, both past their start when the first one
    renames: the second's commit waits while the first's journal is there (made with a
    hard link, which fails while another is), then replaces the set whole.  Before, the
    second replaced the first one's journal and renamed its files while the first went
    on renaming its own: the set ended a mix of both (review 21 F9)."""
    from shmps.files import SetWriter, build_meta

    prefix = tmp_path / "X"
    write_csr(prefix, OLD_SET, cols=4)
    dtypes = {"rowcnt": "int64", "colidx": "int32", "value": "float32"}
    w = SetWriter(prefix, dtypes)   # started before the other writer's journal
    for k, a in zip(("rowcnt", "colidx", "value"), OLD_SET):
        w.append(k, np.asarray(a))
    p = subprocess.Popen([sys.executable, "-c", _REPLACE_THEN, str(prefix), "2", "0.5"],
                         env=tool_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "sleeping\n"   # X.rowcnt renamed, the rest not
        w.commit(build_meta(3, 4, 3, dtypes))
        assert p.wait(timeout=60) == 0
    finally:
        w.abort()
        if p.poll() is None:
            p.kill()
            p.wait()
    ms = read_csr(prefix)
    assert (ms.csr.rowcnt.tolist(), ms.csr.colidx.tolist(), ms.csr.value.tolist()) == \
        ([0, 1, 1, 3], [0, 1, 2], [1.0, 2.0, 3.0])
    assert hidden(tmp_path) == set()


def test_a_replacement_whose_new_file_was_removed_is_reported(tmp_path):
    """A journal whose listed new file is neither under its temporary name nor its final
    one (something removed it: a writer of an earlier version cleaning up) cannot be
    finished: reads refuse, naming the loss, instead of passing the mix as finished;
    writing the set again replaces the journal (review 21 F8)."""
    prefix = tmp_path / "X"
    write_csr(prefix, OLD_SET, cols=4)
    assert replace_then(prefix, "2").returncode == 9   # X.rowcnt and X.colidx renamed
    for n in hidden(tmp_path) - {".X.replacing"}:
        os.unlink(tmp_path / n)
    with pytest.raises(shmps.CorruptFile, match="one of its new files is gone"):
        read_csr(prefix)
    write_csr(prefix, OLD_SET, cols=4)
    assert read_csr(prefix).csr.value.tolist() == [1.0, 2.0, 3.0]
    assert hidden(tmp_path) == set()


_REWRITE_FOR = r"""
import sys, time
import numpy as np
from shmps.files import CSR, write_csr
sets = [CSR(np.array([0, 1, 1, 3]), np.array([0, 1, 2], np.int32),
            np.array([1, 2, 3], np.float32)),
        CSR(np.array([0, 2, 3, 3]), np.array([1, 3, 0], np.int32),
            np.array([7, 8, 9], np.float32))]
end, n = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    write_csr(sys.argv[1], sets[n % 2], cols=4)
    n += 1
print(n)
"""


def test_a_read_over_which_the_set_went_to_another_version_and_back_reads_again(tmp_path):
    """A-B-A: while a read is in its files, the set is replaced by version B (its
    colidx read then) and by version A again.  The read must be done again, not return
    A's rowcnt and values with B's colidx.  ext4 gives the last replacement's files the
    inode numbers the first one's freed (four of four, in 200 of 200 tries here), so the
    check "the same inode under each name before and after" passed the mix: it did in
    CI, 1 read in 3033 of test_a_read_while_another_process_rewrites_the_set_gets_one_
    version.  The inodes from before are now held open during the read."""
    import shmps.files as files

    prefix = tmp_path / "X"
    old = OLD_SET
    new = CSR(np.array([0, 2, 3, 3]), np.array([1, 3, 0], np.int32),
              np.array([7.0, 8.0, 9.0], np.float32))   # (as _REPLACE_THEN's)
    write_csr(prefix, old, cols=4)
    p = files.paths(prefix)
    calls = []

    def read() -> tuple:
        calls.append(1)
        rowcnt = np.fromfile(p["rowcnt"], np.int64).tolist()
        if len(calls) == 1:
            write_csr(prefix, new, cols=4)            # (B, read in part)
        colidx = np.fromfile(p["colidx"], np.int32).tolist()
        if len(calls) == 1:
            write_csr(prefix, old, cols=4)            # (A again)
        return rowcnt, colidx, np.fromfile(f"{prefix}.value", np.float32).tolist()

    got = files._consistent_read(str(prefix), "value", read)
    assert got == ([0, 1, 1, 3], [0, 1, 2], [1.0, 2.0, 3.0]) and len(calls) == 2, (got, calls)


def test_a_read_while_another_process_rewrites_the_set_gets_one_version(tmp_path):
    """A process rewrites a set again and again, alternating two versions of the same
    sizes, while this one reads it: every read returns one version whole, never the
    rowcnt of one with the values of the other.  A read checks that no journal was
    there and that every name kept its inode from before to after it, and reads again
    if not.  Before, 1 read in 80 to 340 was such a mix, which the size checks passed
    (review 21 F5)."""
    prefix = tmp_path / "X"
    write_csr(prefix, OLD_SET, cols=4)
    p = subprocess.Popen([sys.executable, "-c", _REWRITE_FOR, str(prefix), "3"],
                         env=tool_env(), stdout=subprocess.PIPE, text=True)
    versions = {((0, 1, 1, 3), (0, 1, 2), (1.0, 2.0, 3.0)),
                ((0, 2, 3, 3), (1, 3, 0), (7.0, 8.0, 9.0))}
    reads, mixes = 0, []
    try:
        while p.poll() is None:
            ms = read_csr(prefix, mmap=False)
            got = (tuple(ms.csr.rowcnt.tolist()), tuple(ms.csr.colidx.tolist()),
                   tuple(ms.csr.value.tolist()))
            reads += 1
            if got not in versions:
                mixes.append(got)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    writes = int(p.stdout.read())
    assert reads > 50 and writes > 50, (reads, writes)
    assert mixes == [], (len(mixes), reads, mixes[:3])


@pytest.mark.parametrize("name,says", [
    ("junk.npy", "junk.npy: not a numpy .npy file: it does not start with '\\x93NUMPY'"),
    ("junk.npz", "junk.npz: not a scipy.sparse .npz file: it does not start with 'PK"),
    ("text.npz", "text.npz: not a scipy.sparse .npz file: it does not start with 'PK"),
])
def test_convert_says_a_file_that_is_not_npy_or_npz_is_not_one(tmp_path, name, says):
    """A .npy or .npz SRC without its format's magic is "not a ... file: it does not
    start with ...", exit 2, nothing written.  Before, np.load took it for a pickle and
    the line said "This file contains pickled (object) data. If you trust the file you
    can load it unsafely using the `allow_pickle=` keyword argument": untrue of a text
    file, and advice to unpickle an unknown file."""
    (tmp_path / name).write_bytes(b"PK not a zip" if name == "junk.npz" else b"hello, world\n")
    r = tool("convert", tmp_path / name, tmp_path / "out")
    assert_one_line_error(r, says)
    assert "pickle" not in r.stderr
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("out", ".out"))]


def test_convert_names_a_source_it_cannot_read(tmp_path):
    """A .npy SRC whose first read fails (here a link to /proc/self/mem, which opens and
    then fails to read at offset 0 with EIO) gets one line naming the file, exit 2.
    Before, the line was "shmps-tool: error: Input/output error", with no path (the
    check of the format's magic read it outside the error handling that names it)."""
    src = tmp_path / "mem.npy"
    os.symlink("/proc/self/mem", src)
    r = tool("convert", src, tmp_path / "out")
    assert_one_line_error(r, f"{src}: Input/output error")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("out", ".out"))]


def test_convert_refuses_integers_that_the_dtype_cannot_hold(tmp_path):
    """convert --dtype int8/int32 of integer values outside that dtype's range is one
    error line naming the value and where it is, and writes nothing (DST as it was);
    values within the range convert.  numpy's cast wraps them (300 into int8 is 44,
    2**40 into int32 is 0), and convert wrote those silently, in every direction: .npy
    and .npz into a set, a set into .npy and .npz."""
    np.save(tmp_path / "i.npy", np.array([[300, 0, -200]]))
    sp.save_npz(tmp_path / "i.npz", sp.csr_matrix(np.array([[5, 0, 2 ** 40]])))
    shmps.files.write_dense(str(tmp_path / "S"), np.array([[7, 300]], np.int32))
    write_csr(tmp_path / "old", CSR.from_dense(np.array([[1.0, 2.0]])))   # a DST to keep
    np.save(tmp_path / "old.npy", np.array([[9]]))
    for args, needle in [
            (("i.npy", "old", "--dtype", "int8"), "i.npy: row 0, col 0: value 300"),
            (("i.npz", "old", "--dtype", "int32"), "i.npz (data): position 1: value 1099511627776"),
            (("S", "old.npy", "--dtype", "int8"), "S.value: position 1: value 300"),
            (("S", "old.npz", "--dtype", "int8"), "S.value: position 1: value 300")]:
        r = tool("convert", *args, cwd=tmp_path)
        assert_one_line_error(r, needle, "cannot be stored in", "-128 .. 127"
                              if "int8" in args else "-2147483648 .. 2147483647")
        assert hidden(tmp_path) == set()
    assert read_csr(tmp_path / "old").csr.value.tolist() == [1.0, 2.0]
    assert np.load(tmp_path / "old.npy").tolist() == [[9]]
    assert not (tmp_path / "old.npz").exists()
    np.save(tmp_path / "ok.npy", np.array([[127, 0, -128]]))
    assert tool("convert", "ok.npy", "ok", "--dtype", "int8", cwd=tmp_path).returncode == 0
    assert read_csr(tmp_path / "ok").csr.value.tolist() == [127, -128]


def test_convert_to_a_dst_that_is_a_directory_names_it(tmp_path):
    """convert to X.npy or X.npz where a directory of that name exists is one error line
    naming DST, before anything is converted, and leaves no temporary; it named the
    hidden temporary the result was written to, after the whole conversion
    (".d.npy.tmp-HOST-PID-HEX: Is a directory")."""
    write_csr(tmp_path / "S", CSR.from_dense(EXAMPLE))
    for dst in ("d.npy", "d.npz"):
        (tmp_path / dst).mkdir()
        r = tool("convert", "S", dst, cwd=tmp_path)
        assert_one_line_error(r, f"{dst} is a directory")
        assert ".tmp-" not in r.stderr
        assert os.listdir(tmp_path / dst) == []
    assert hidden(tmp_path) == set()


def test_convert_refuses_repeated_integer_entries_whose_sum_the_dtype_cannot_hold(tmp_path):
    """A set holding one (row, col) several times converts to .npy as their sum; an
    integer sum the written dtype cannot hold is one error line naming the cell, how
    many entries it sums and the sum, and nothing is written (DST as it was), as for a
    single value (test_convert_refuses_integers_that_the_dtype_cannot_hold).  Sums in
    range convert, whatever their partial sums (100 + 100 - 120 = 80 in int8).  Before,
    np.add.at summed in the dtype and wrapped: int8 entries 100 + 100 at (1, 2) wrote
    -56, and two int32 2**30 + 2**30 wrote -2147483648, exit 0."""
    write_csr(tmp_path / "S", CSR(np.array([0, 1, 4]), np.array([0, 2, 0, 2]),
                                  np.array([7, 100, -3, 100], np.int8)), cols=3)
    write_csr(tmp_path / "W", CSR(np.array([0, 2]), np.array([1, 1]),
                                  np.array([2 ** 30, 2 ** 30], np.int32)), cols=2)
    np.save(tmp_path / "old.npy", np.array([[9]]))
    for args, needle, rng in [
            (("S", "old.npy"), "S.value: row 1, col 2 (the sum of its 2 entries): value 200 "
             "cannot be stored in int8", "-128 .. 127; a cast would wrap it to -56"),
            (("W", "old.npy"), "W.value: row 0, col 1 (the sum of its 2 entries): value "
             "2147483648 cannot be stored in int32", "a cast would wrap it to -2147483648"),
            (("S", "old.npy", "--dtype", "int8"), "value 200 cannot be stored in int8", "")]:
        r = tool("convert", *args, cwd=tmp_path)
        assert_one_line_error(r, needle, rng)
        assert hidden(tmp_path) == set()
        assert np.load(tmp_path / "old.npy").tolist() == [[9]]
    assert tool("convert", "S", "s32.npy", "--dtype", "int32", cwd=tmp_path).returncode == 0
    assert np.load(tmp_path / "s32.npy").tolist() == [[7, 0, 0], [-3, 0, 200]]
    write_csr(tmp_path / "ok", CSR(np.array([0, 3]), np.array([1, 1, 1]),
                                   np.array([100, 100, -120], np.int8)), cols=2)
    assert tool("convert", "ok", "ok.npy", cwd=tmp_path).returncode == 0
    assert np.load(tmp_path / "ok.npy").tolist() == [[0, 80]]


@pytest.mark.timeout(60)
def test_check_dump_and_convert_show_progress_bars_ending_at_their_totals(tmp_path,
                                                                         monkeypatch):
    """On a terminal (threshold lowered), check shows a bar over rowcnt and colidx;
    dump --format summary that one, then one over rowcnt and the values (its
    statistics); convert of a set that check's, then its own; each ends at its total.
    A dense set's check is O(1): no bar; its summary reads the values.  Before, check
    and summary showed nothing (1.8 s and 4 s for a 1.6 GB set, cached)."""
    rows, per = 2000, 4
    rowcnt = np.arange(0, rows * per + 1, per, dtype=np.int64)
    colidx = np.tile(np.arange(per, dtype=np.int32), rows)
    value = np.arange(rows * per, dtype=np.float32)
    p, d = str(tmp_path / "P"), str(tmp_path / "D")
    write_csr(p, CSR(rowcnt, colidx, value))
    shmps.files.write_dense(d, np.ones((100, 30), np.float32))
    nr, nc, nv = rowcnt.nbytes, colidx.nbytes, value.nbytes
    check = (f"check {p}", nr + nc, nr + nc)
    shown = record_bars(monkeypatch)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["check", p]) == 0
        assert shown() == [check]
        assert cli.main(["dump", p, "--format", "summary"]) == 0
        assert shown() == [check, (f"summary {p}", nr + nv, nr + nv)]
        assert cli.main(["dump", d, "--format", "summary"]) == 0
        assert shown() == [(f"summary {d}", 12000, 12000)]
        assert cli.main(["check", d]) == 0
        assert shown() == []
        assert cli.main(["convert", p, str(tmp_path / "p.npy")]) == 0
        assert shown() == [check, ("convert", rows * per * 4, rows * per * 4)]
        m = sp.csr_matrix((value, colidx, rowcnt), shape=(rows, per))
        sp.save_npz(tmp_path / "m.npz", m)
        both = m.indptr.nbytes + m.indices.nbytes
        assert cli.main(["convert", str(tmp_path / "m.npz"), str(tmp_path / "M")]) == 0
        assert shown() == [(f"check {tmp_path / 'm.npz'}", both, both),
                           ("convert", both + nv, both + nv)]
    assert f"ok: {rows} x {per}, nnz {rows * per}" in out.getvalue()
    assert "nnz:       8000" in out.getvalue()
    assert f"summary {p}:" in shown.terminal.getvalue()


def _run_on_terminal(args: list[str], cwd: Path) -> tuple[int, str, bytes]:
    """Run ``python -m shmps.cli ARGS`` with stderr a pseudo-terminal (stdout a pipe):
    (exit status, stdout, what reached the terminal)."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    master, slave = pty.openpty()
    # a terminal's size, 24 x 80 (a new pty's is 0 x 0, where tqdm draws nothing)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        p = subprocess.Popen([sys.executable, "-m", "shmps.cli", *args], cwd=cwd,
                             env=tool_env(), stdout=subprocess.PIPE, stderr=slave,
                             stdin=subprocess.DEVNULL)
    finally:
        os.close(slave)
    seen = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:   # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            elif p.poll() is not None:
                break
        out = p.communicate(timeout=30)[0].decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        os.close(master)
    return p.returncode, out, seen


@pytest.mark.timeout(120)
def test_check_of_a_large_set_shows_a_progress_bar_on_a_real_terminal(tmp_path):
    """shmps-tool check of a set above PROGRESS_MIN_BYTES (64 MiB of rowcnt and colidx)
    draws a tqdm bar on a real terminal (a pty) and prints its ok line; with stderr
    not a terminal it writes nothing there.  Before, nothing showed on the terminal."""
    nnz = (shmps.files.PROGRESS_MIN_BYTES // 4) + 1024
    np.array([0, nnz], np.int64).tofile(tmp_path / "L.rowcnt")
    np.zeros(nnz, np.int32).tofile(tmp_path / "L.colidx")
    np.zeros(nnz, np.int8).tofile(tmp_path / "L.value")
    (tmp_path / "L.meta").write_text(json.dumps({
        "version": 1, "kind": "csr", "rows": 1, "cols": 1, "nnz": nnz,
        "dtypes": {"rowcnt": "int64", "colidx": "int32", "value": "int8"}}))
    status, out, seen = _run_on_terminal(["check", "L"], tmp_path)
    assert status == 0 and out.startswith(f"ok: 1 x 1, nnz {nnz}"), (status, out, seen)
    assert b"check L:" in seen and b"%|" in seen, seen
    r = tool("check", "L", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (0, ""), r
