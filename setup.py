"""Packaging: ``passes/`` and ``kernels/`` install as ``lynx_compile.passes`` / ``lynx_compile.kernels``.

The packages are listed explicitly (no ``find_packages``) so that no top-level ``passes`` or
``kernels`` import name leaks into site-packages.
"""
from setuptools import setup

setup(
    packages=[
        "lynx_compile",
        "lynx_compile._compat",
        "lynx_compile.caches",
        "lynx_compile.compiler",
        "lynx_compile.costs",
        "lynx_compile.distributed",
        "lynx_compile.memory",
        "lynx_compile.recompute",
        "lynx_compile.solver",
        "lynx_compile.models",
        "lynx_compile.pipelining",
        "lynx_compile.runtime",
        "lynx_compile.sim",
        "lynx_compile.step",
        "lynx_compile.tools",
        "lynx_compile.passes",
        "lynx_compile.kernels",
    ],
    package_dir={
        "lynx_compile": "lynx_compile",
        "lynx_compile.passes": "passes",
        "lynx_compile.kernels": "kernels",
    },
)
