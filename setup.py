"""fusefs's compiled parts, built by `pip install`:

- fusefs.pyfuse3, its FUSE binding: pyfuse3 3.5.0's Cython sources with fusefs's changes
  (fusefs/pyfuse3: the pinned sdist with scripts/pyfuse3_patches/ applied) and the fast path's C
  (fusefs/_fastpath.h). Needs Cython (a build requirement), gcc, the Python headers and
  libfuse3's (pkg-config fuse3, or FUSE3_CFLAGS and FUSE3_LIBS where libfuse3 lies elsewhere).
- fusefs._cachecore (fusefs/_cachecore.c): the sample cache's entries, reservations and
  eviction heap; fusefs._plancore (fusefs/_plancore.c): a plan's counting of a batch of
  uses, its keys, the read-ahead's walk; fusefs._eventscore (fusefs/_eventscore.c): a batch
  of the fast path's events counted. Each needs gcc and the Python headers.
- fusefs._fetchio (fusefs/_fetchio.c): a fetch batch's reads and checksums without the GIL.
  Needs xxHash's headers. FUSEFS_NO_NATIVE=1 installs without it (fusefs then reads in
  Python, and `fusefs mount` says so on its first line).

What the build needs is checked before anything is compiled (one line naming the Debian
packages); a build that fails later stops the install and names what is missing too. The
sdist needs none of it: libfuse3 is asked for only when the extensions are built.
scripts/build_wheel.sh makes the wheel a cluster installs without any -dev package.
Everything else is in pyproject.toml."""
import os
import shlex
import subprocess
import sysconfig
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPT_OUT = "FUSEFS_NO_NATIVE"
NEEDS = {"fusefs.pyfuse3": "gcc python3-dev libfuse3-dev pkg-config",
         "fusefs._cachecore": "gcc python3-dev",
         "fusefs._plancore": "gcc python3-dev",
         "fusefs._eventscore": "gcc python3-dev",
         "fusefs._fetchio": "gcc python3-dev libxxhash-dev"}
# what each extension's sources include from outside the tree: checked before the build
HEADERS = {"fusefs.pyfuse3": ["Python.h", "fuse_lowlevel.h"],
           "fusefs._cachecore": ["Python.h"],
           "fusefs._plancore": ["Python.h"],
           "fusefs._eventscore": ["Python.h"],
           "fusefs._fetchio": ["Python.h", "xxhash.h"]}


def native_wanted() -> bool:
    return os.environ.get(OPT_OUT, "") in ("", "0")


def fuse3_flags() -> tuple[list[str], list[str]]:
    """libfuse3's compile and link flags: $FUSE3_CFLAGS and $FUSE3_LIBS, or pkg-config's."""
    if "FUSE3_CFLAGS" in os.environ or "FUSE3_LIBS" in os.environ:
        return shlex.split(os.environ.get("FUSE3_CFLAGS", "")), shlex.split(os.environ.get("FUSE3_LIBS", ""))
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "fuse3"], capture_output=True, text=True, check=True)
        libs = subprocess.run(["pkg-config", "--libs", "fuse3"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit(f"fusefs: libfuse3 not found by pkg-config; Debian: apt-get install "
                         f"{NEEDS['fusefs.pyfuse3']} (or set FUSE3_CFLAGS and FUSE3_LIBS)") from None
    return cflags.stdout.split(), libs.stdout.split()


class BuildNative(build_ext):
    """build_ext that checks what the build needs first, and whose failure says what to
    install, or how to go on without it."""

    def build_extensions(self):
        from Cython.Build import cythonize
        cflags, libs = fuse3_flags()
        for ext in self.extensions:
            if ext.name.startswith("fusefs.pyfuse3"):
                ext.extra_compile_args = [*cflags, *ext.extra_compile_args]
                ext.extra_link_args = [*libs, *ext.extra_link_args]
            self.check_headers(ext, cflags)
        # (the binding's Cython only once the checks passed: its C replaces the .pyx)
        for ext, done in zip(self.extensions, cythonize(self.extensions, language_level=3, quiet=True,
                                                        include_path=["fusefs/pyfuse3/include"])):
            ext.sources = done.sources
        super().build_extensions()

    def check_headers(self, ext, cflags: list[str]) -> None:
        """Compile a file that includes what ext's sources include from the system: a
        missing compiler or header stops the build here, in one line, before the binding's
        minute of compiling."""
        name = ext.name.removesuffix(".__init__")
        with tempfile.TemporaryDirectory() as tmp:
            probe = os.path.join(tmp, "probe.c")
            with open(probe, "w") as f:
                f.write("".join(f"#include <{h}>\n" for h in HEADERS[name]))
                f.write("int fusefs_probe(void) { return 0; }\n")
            cc = list(getattr(self.compiler, "compiler_so", None) or ["cc"])
            command = [*cc, "-c", probe, "-o", os.path.join(tmp, "probe.o"),
                       "-I" + sysconfig.get_paths()["include"], "-DFUSE_USE_VERSION=32", *cflags]
            try:  # (the compiler's own complaint is not shown: the line below says what to do)
                failed = subprocess.run(command, capture_output=True, timeout=120).returncode != 0
            except (OSError, subprocess.TimeoutExpired):
                failed = True
            if failed:
                opt_out = (f"; or {OPT_OUT}=1 to install without it (fetches read in Python)"
                           if name == "fusefs._fetchio" else "")
                raise SystemExit(f"fusefs: cannot build {name}: the C compiler or the headers "
                                 f"{', '.join(HEADERS[name])} are missing; Debian: apt-get install "
                                 f"{NEEDS[name]}{opt_out}") from None

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            name = ext.name.removesuffix(".__init__")
            opt_out = (f" To install without it (fetches read in Python, slower): {OPT_OUT}=1 "
                       f"pip install ...") if name == "fusefs._fetchio" else ""
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise SystemExit(f"fusefs: {name} did not build ({first}). It needs {NEEDS[name]} "
                             f"(Debian's names).{opt_out}") from None


def extensions() -> list[Extension]:
    binding = Extension("fusefs.pyfuse3.__init__", ["fusefs/pyfuse3/__init__.pyx"],
                        include_dirs=["fusefs/pyfuse3/include", "fusefs"],
                        # (optimised as Python's own build is, as pyfuse3's build does)
                        extra_compile_args=["-DFUSE_USE_VERSION=32",
                                            "-Wno-unused-function", "-Wno-incompatible-pointer-types"],
                        extra_link_args=["-lpthread", "-lrt"],
                        # (the C the generated source includes: a change to it rebuilds)
                        depends=["fusefs/_fastpath.h", "fusefs/_missapi.h", "fusefs/_publishapi.h"])
    out = [binding, *(Extension(f"fusefs.{name}", [f"fusefs/{name}.c"], extra_compile_args=["-O2"],
                                depends=["fusefs/_publishapi.h"] if name == "_cachecore" else [])
                      for name in ("_cachecore", "_plancore", "_eventscore"))]
    if native_wanted():
        out.append(Extension("fusefs._fetchio", ["fusefs/_fetchio.c"], libraries=["xxhash"],
                             depends=["fusefs/_missapi.h", "fusefs/_publishapi.h"],
                             extra_compile_args=["-O2"]))
    return out


# (nothing is cythonized or asked of libfuse3 before build_ext: an sdist needs neither)
setup(ext_modules=extensions(), cmdclass={"build_ext": BuildNative},
      package_data={"fusefs.pyfuse3": ["py.typed", "*.pyi", "LICENSE"],
                    "fusefs": ["boot/sitecustomize.py"]},  # (fusefs run: launch.py)
      exclude_package_data={"fusefs": ["*.c", "*.h"], "fusefs.pyfuse3": ["*.c", "*.h", "*.pyx", "*.pxi", "*.pxd"]})
