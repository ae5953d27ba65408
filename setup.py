"""Build hook: compiles the C kernels with cffi (out-of-line API mode)."""
from setuptools import setup

setup(cffi_modules=["kernels/_build.py:ffibuilder"])
