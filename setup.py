"""fusefs's compiled part: fusefs._fetchio (fusefs/_fetchio.c), a fetch batch's reads and
checksums without the GIL. It needs gcc, python3-dev and libxxhash-dev (Debian's names). A
build that fails stops the install and names what is missing; FUSEFS_NO_NATIVE=1 installs
without it (fusefs then reads in Python, and `fusefs mount` says so on its first line).
Everything else is in pyproject.toml."""
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPT_OUT = "FUSEFS_NO_NATIVE"


class BuildNative(build_ext):
    """build_ext whose failure says what to install, or how to go on without it."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            raise SystemExit(
                f"fusefs: {ext.name} did not build ({e}). It needs gcc, the Python headers and "
                f"xxHash's (Debian: apt-get install gcc python3-dev libxxhash-dev). To install "
                f"without it (fetches read in Python, slower): {OPT_OUT}=1 pip install ...") from None


native = os.environ.get(OPT_OUT, "") in ("", "0")
setup(ext_modules=[Extension("fusefs._fetchio", ["fusefs/_fetchio.c"], libraries=["xxhash"],
                             extra_compile_args=["-O2"])] if native else [],
      cmdclass={"build_ext": BuildNative})
