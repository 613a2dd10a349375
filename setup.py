"""Builds the compiled pieces of samebits: the CPU digest library (see docs/digest.md), which
also encodes a Recorder's step frames (csrc/step_frame.c, docs/stream.md), and the block fixed
point of the invariant gradient reduction (csrc/fixed.c, docs/invariance.md), a library of its
own so that neither changes the other's interface.

All package metadata lives in pyproject.toml; this file only adds the C extension.  It is a
plain shared library loaded with ctypes (no Python API), built through setuptools so that
`pip install .` and `pip install -e .` produce it next to samebits/fingerprint/__init__.py.

OpenMP is used when the compiler accepts it; without it the library is single-threaded (still
correct).  If the build fails altogether, samebits falls back to the torch reference
implementation (the digest warns at first use; the reduction gives the same bits, slower).
"""

from __future__ import annotations

import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = ["src/samebits/fingerprint/csrc/digest.c", "src/samebits/fingerprint/csrc/step_frame.c"]
FIXED_SOURCES = ["src/samebits/fingerprint/csrc/fixed.c"]


def _compiler_accepts(compiler, flags: list[str]) -> bool:
    """Whether `compiler` can compile and link a small OpenMP program with `flags`."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w") as f:
            f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
        try:
            objects = compiler.compile([source], output_dir=tmp, extra_postargs=flags)
            compiler.link_executable(objects, "probe", output_dir=tmp, extra_postargs=flags)
        except Exception:
            return False
    return True


class BuildDigest(build_ext):
    """Adds optimisation and OpenMP flags that fit the compiler in use."""

    def build_extensions(self):
        msvc = self.compiler.compiler_type == "msvc"
        # No -march=native: the library must run on any x86-64; digest.c uses target_clones.
        compile_flags = ["/O2"] if msvc else ["-O3", "-std=c11", "-fvisibility=hidden"]
        link_flags: list[str] = []
        openmp = ["/openmp"] if msvc else ["-fopenmp"]
        if os.environ.get("SAMEBITS_NO_OPENMP") != "1" and _compiler_accepts(self.compiler, openmp):
            compile_flags += openmp
            link_flags += openmp
        else:
            print("samebits: building the digest library without OpenMP (single-threaded)",
                  file=sys.stderr)
        for ext in self.extensions:
            ext.extra_compile_args = compile_flags + list(ext.extra_compile_args or [])
            ext.extra_link_args = link_flags + list(ext.extra_link_args or [])
        super().build_extensions()

    def get_export_symbols(self, ext):
        # A ctypes library has no PyInit_ function; don't ask the linker to export one.
        return ext.export_symbols


setup(
    ext_modules=[
        Extension(
            "samebits.fingerprint._libdigest",
            sources=SOURCES,
            depends=["src/samebits/fingerprint/csrc/native.h"],  # shipped in the sdist, rebuilds on change
            # A missing compiler must not block installation: the torch fallback still works.
            optional=True,
        ),
        Extension(
            "samebits.invariant._libfixed",
            sources=FIXED_SOURCES,
            depends=["src/samebits/fingerprint/csrc/native.h"],
            libraries=[] if sys.platform == "win32" else ["m"],  # nearbyint
            optional=True,  # without it the invariant reduction runs its torch path (same bits)
        ),
    ],
    cmdclass={"build_ext": BuildDigest},
)
