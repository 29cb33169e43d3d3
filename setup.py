# The native core is compiled by cffi (out-of-line API mode); everything else is in
# pyproject.toml.
from setuptools import setup

setup(cffi_modules=["shmps/_build.py:ffibuilder"])
