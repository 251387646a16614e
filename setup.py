"""fusefs's compiled parts, built by `pip install`:

- fusefs.pyfuse3, its FUSE binding: pyfuse3 3.5.0's Cython sources with fusefs's changes
  (fusefs/pyfuse3: the pinned sdist with scripts/pyfuse3_patches/ applied) and the fast path's C
  (fusefs/_fastpath.h). Needs Cython (a build requirement), gcc, the Python headers and
  libfuse3's (pkg-config fuse3, or FUSE3_CFLAGS and FUSE3_LIBS where libfuse3 lies elsewhere).
- fusefs._fetchio (fusefs/_fetchio.c): a fetch batch's reads and checksums without the GIL.
  Needs xxHash's headers. FUSEFS_NO_NATIVE=1 installs without it (fusefs then reads in
  Python, and `fusefs mount` says so on its first line).

A build that fails stops the install and names what is missing. Everything else is in
pyproject.toml."""
import os
import shlex
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPT_OUT = "FUSEFS_NO_NATIVE"
NEEDS = {"fusefs.pyfuse3": "gcc python3-dev libfuse3-dev pkg-config",
         "fusefs._fetchio": "gcc python3-dev libxxhash-dev"}


def fuse3_flags() -> tuple[list[str], list[str]]:
    """libfuse3's compile and link flags: $FUSE3_CFLAGS and $FUSE3_LIBS, or pkg-config's."""
    if "FUSE3_CFLAGS" in os.environ or "FUSE3_LIBS" in os.environ:
        return shlex.split(os.environ.get("FUSE3_CFLAGS", "")), shlex.split(os.environ.get("FUSE3_LIBS", ""))
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "fuse3"], capture_output=True, text=True, check=True)
        libs = subprocess.run(["pkg-config", "--libs", "fuse3"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"fusefs: libfuse3 not found by pkg-config ({e}); Debian: apt-get install "
                         f"{NEEDS['fusefs.pyfuse3']} (or set FUSE3_CFLAGS and FUSE3_LIBS)") from None
    return cflags.stdout.split(), libs.stdout.split()


class BuildNative(build_ext):
    """build_ext whose failure says what to install, or how to go on without it."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            name = ext.name.removesuffix(".__init__")
            opt_out = (f" To install without it (fetches read in Python, slower): {OPT_OUT}=1 "
                       f"pip install ...") if name == "fusefs._fetchio" else ""
            raise SystemExit(f"fusefs: {name} did not build ({e}). It needs {NEEDS[name]} "
                             f"(Debian's names).{opt_out}") from None


def extensions() -> list[Extension]:
    from Cython.Build import cythonize
    cflags, libs = fuse3_flags()
    binding = Extension("fusefs.pyfuse3.__init__", ["fusefs/pyfuse3/__init__.pyx"],
                        include_dirs=["fusefs/pyfuse3/include", "fusefs"],
                        # (optimised as Python's own build is, as pyfuse3's build does)
                        extra_compile_args=[*cflags, "-DFUSE_USE_VERSION=32",
                                            "-Wno-unused-function", "-Wno-incompatible-pointer-types"],
                        extra_link_args=[*libs, "-lpthread", "-lrt"])
    out = cythonize([binding], language_level=3, quiet=True,
                    include_path=["fusefs/pyfuse3/include"])
    if os.environ.get(OPT_OUT, "") in ("", "0"):
        out.append(Extension("fusefs._fetchio", ["fusefs/_fetchio.c"], libraries=["xxhash"],
                             extra_compile_args=["-O2"]))
    return out


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildNative},
      package_data={"fusefs.pyfuse3": ["py.typed", "*.pyi", "LICENSE"]},
      exclude_package_data={"fusefs": ["*.c", "*.h"], "fusefs.pyfuse3": ["*.c", "*.h", "*.pyx", "*.pxi", "*.pxd"]})
