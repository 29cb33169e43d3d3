"""cffi builder for the native core (out-of-line API mode).

Run by setuptools through ``cffi_modules`` in setup.py.  Declarations come from the
marked region of ``native/shmps.h`` so they are never restated here.
"""
from __future__ import annotations

import glob
import os
import platform

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE = os.path.join(os.path.dirname(HERE), "native")


def _cdef_region(header: str) -> str:
    text = open(header, encoding="utf-8").read()
    start = text.index("/* CDEF BEGIN */") + len("/* CDEF BEGIN */")
    end = text.index("/* CDEF END */")
    return text[start:end]


ffibuilder = FFI()
ffibuilder.cdef(_cdef_region(os.path.join(NATIVE, "shmps.h")))

_sources = sorted(glob.glob(os.path.join(NATIVE, "*.c")))
_args = ["-O3", "-std=gnu11", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
if platform.machine() in ("x86_64", "AMD64"):
    _args.append("-msse2")

ffibuilder.set_source(
    "shmps._shmps_native",
    '#include "shmps.h"',
    # setuptools wants paths relative to setup.py
    sources=[os.path.relpath(s, os.path.dirname(HERE)) for s in _sources],
    include_dirs=[os.path.relpath(NATIVE, os.path.dirname(HERE))],
    extra_compile_args=_args,
    libraries=["pthread", "m"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=os.path.join(os.path.dirname(HERE), "build", "cffi"), verbose=True)
