"""The one compiled part of fusefs: fusefs._fetchio (fusefs/_fetchio.c), a fetch batch's reads
and checksums without the GIL. It needs Debian's libxxhash-dev (scripts/setup.sh installs it);
where it cannot be built, fusefs installs without it and reads in Python (store.ChunkStore).
Everything else is in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("fusefs._fetchio", ["fusefs/_fetchio.c"], libraries=["xxhash"],
                             extra_compile_args=["-O2"], optional=True)])
