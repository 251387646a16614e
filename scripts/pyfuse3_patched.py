"""fusefs/pyfuse3, the FUSE binding fusefs builds and ships: pyfuse3 3.5.0 (its sdist pinned
by SHA-256) with fusefs's changes, kept as a series of patches in scripts/pyfuse3_patches/
(`NNNN-name.patch`, applied in that order; each opens with what it changes and why, and
sets a mark on the module that fusefs and the tests look for). The vendored sources are
the truth that setup.py compiles; this script only writes them anew from the sdist and the
series, and records an edit made to them as the next patch:

    .venv/bin/python scripts/pyfuse3_patched.py            # rewrites fusefs/pyfuse3 (then: git diff)
    .venv/bin/python scripts/pyfuse3_patched.py --record NAME --why "..." --mark MARK
        # fusefs/pyfuse3's edits beyond the series, as scripts/pyfuse3_patches/NNNN-NAME.patch

A patch that does not apply to a new pyfuse3 stops the script, naming it: a new release
must be looked at, not patched blindly. Why a changed copy and not pyfuse3 from PyPI:
docs/ARCHITECTURE.md, "pyfuse3's request loop".
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
VENDOR_DIR = HERE.parent / "fusefs" / "pyfuse3"
PATCH_DIR = HERE / "pyfuse3_patches"
VERSION = "3.5.0"
# the sdist's SHA-256: a download that differs is refused
SDIST_SHA256 = "88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24"
# what fusefs/pyfuse3 holds of the sdist's sources (the rest is not needed to build); a
# patch changes only these
VENDORED = ("__init__.pyx", "handlers.pxi", "internal.pxi", "macros.pxd", "macros.c", "pyfuse3.h",
            "xattr.h", "gettime.h", "_pyfuse3.py", "__init__.pyi", "py.typed")
_HEADER = re.compile(r"fusefs patch (\d+), (\w+) \(mark: pyfuse3\.(\w+)\)\n")


def series() -> list[pathlib.Path]:
    """The patches, in the order they apply."""
    return sorted(PATCH_DIR.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def marks() -> dict[str, str]:
    """patch name -> the mark it sets on the module (`pyfuse3.MARK = True`), from each
    patch's first line."""
    out = {}
    for path in series():
        m = _HEADER.match(path.read_text())
        if m is None:
            raise SystemExit(f"{path}: its first line is not 'fusefs patch N, NAME (mark: pyfuse3.MARK)'")
        out[m.group(2)] = m.group(3)
    return out


# set-up's copy of the sdist (scripts/setup.sh: --fetch), which the script takes instead of
# a download, so that the tests need no package index once set-up is done
SDIST_COPY = HERE.parent / ".venv" / "sdist" / f"pyfuse3-{VERSION}.tar.gz"


def _checked(sdist: pathlib.Path) -> pathlib.Path:
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{sdist}: SHA-256 {digest}, not pyfuse3 {VERSION}'s {SDIST_SHA256}")
    return sdist


def fetch(into: pathlib.Path) -> pathlib.Path:
    """Download pyfuse3's sdist into `into`, its SHA-256 checked: its path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--no-binary", ":all:", f"pyfuse3=={VERSION}", "-d", str(into)], check=True)
    return _checked(next(into.glob("pyfuse3-*.tar.gz")))


def sdist_sources(into: pathlib.Path, offline: bool = False) -> pathlib.Path:
    """Unpack pyfuse3's sdist into `into`: set-up's copy (SDIST_COPY) if there is one, else
    a download (refused if offline), its SHA-256 checked either way; the unpacked tree
    (holding src/pyfuse3, Include and LICENSE)."""
    if SDIST_COPY.is_file():
        sdist = _checked(SDIST_COPY)
    elif offline:
        raise SystemExit(f"no copy of pyfuse3 {VERSION}'s sdist at {SDIST_COPY}: scripts/setup.sh "
                         "fetches it (pyfuse3_patched.py --fetch)")
    else:
        sdist = fetch(into)
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # (Python 3.11.4 and later)
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    return into / f"pyfuse3-{VERSION}"


def apply(patch: pathlib.Path, folder: pathlib.Path) -> None:
    """Apply one patch to the sources in folder (git apply, outside any repository), or
    SystemExit naming it."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(folder.parent))  # (no repository around it)
    r = subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)], cwd=folder, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{patch.name} does not apply to pyfuse3 {VERSION}'s sources: "
                         f"{r.stderr.strip()}")


def write(dest: pathlib.Path, patches=None, offline: bool = False) -> None:
    """Write the sdist's sources with the patches applied (default: the whole series) into
    dest, with pyfuse3's Cython declarations of libfuse (include/) and its licence; what was
    there goes."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = sdist_sources(pathlib.Path(tmp), offline)
        work = pathlib.Path(tmp) / "work"
        work.mkdir()
        for name in VENDORED:
            shutil.copy(tree / "src" / "pyfuse3" / name, work / name)
        for patch in series() if patches is None else patches:
            apply(patch, work)
        if dest.exists():
            shutil.rmtree(dest)
        (dest / "include").mkdir(parents=True)
        for name in VENDORED:
            shutil.copy(work / name, dest / name)
        for pxd in (tree / "Include").glob("*.pxd"):
            shutil.copy(pxd, dest / "include" / pxd.name)
        shutil.copy(tree / "LICENSE", dest / "LICENSE")


def record(name: str, why: str, mark: str) -> pathlib.Path:
    """fusefs/pyfuse3's differences from the sdist with the series applied, as the next
    patch (the mark's line is added to __init__.pyx by it); its path."""
    if not re.fullmatch(r"\w+", name) or not re.fullmatch(r"[A-Z][A-Z0-9_]*", mark):
        raise SystemExit("--record NAME: a word; --mark MARK: an upper-case name")
    if name in marks():
        raise SystemExit(f"a patch called {name} is in the series already")
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp) / "pyfuse3"
        write(base)

        def diff() -> list[str]:
            out = []
            for f in VENDORED:
                old, new = (base / f).read_text(), (VENDOR_DIR / f).read_text()
                out += difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{f}", f"b/{f}")
            return out

        if not diff():
            raise SystemExit("fusefs/pyfuse3 is the series applied: nothing to record")
        init = (VENDOR_DIR / "__init__.pyx").read_text()
        if f"\n{mark} = True\n" not in init:
            first = why.strip().splitlines()[0] if why.strip() else name
            (VENDOR_DIR / "__init__.pyx").write_text(f"{init}\n# fusefs: {first}\n{mark} = True\n")
        lines = diff()
    number = len(series()) + 1
    path = PATCH_DIR / f"{number:04d}-{name}.patch"
    path.write_text(f"fusefs patch {number}, {name} (mark: pyfuse3.{mark})\n\n{why.strip()}\n\n"
                    + "".join(lines))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--into", default=str(VENDOR_DIR),
                   help=f"where to write the patched sources (default {VENDOR_DIR})")
    p.add_argument("--record", metavar="NAME", help="record fusefs/pyfuse3's edits as the next patch")
    p.add_argument("--why", default="", help="with --record: what the patch changes and why")
    p.add_argument("--mark", help="with --record: the mark it sets on the module (pyfuse3.MARK)")
    p.add_argument("--fetch", action="store_true",
                   help=f"only keep a copy of the sdist at {SDIST_COPY} (set-up does), for the runs after")
    p.add_argument("--offline", action="store_true",
                   help="take set-up's copy of the sdist, never the package index")
    a = p.parse_args()
    if a.fetch:
        if not SDIST_COPY.is_file():
            SDIST_COPY.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=SDIST_COPY.parent) as tmp:
                os.replace(fetch(pathlib.Path(tmp)), SDIST_COPY)
        print(f"pyfuse3 {VERSION}'s sdist: {_checked(SDIST_COPY)}")
        return
    if a.record:
        if not a.mark:
            raise SystemExit("--record needs --mark")
        print(f"recorded {record(a.record, a.why, a.mark)}")
        return
    write(pathlib.Path(a.into), offline=a.offline)
    print(f"pyfuse3 {VERSION} with the patches {', '.join(marks())}: {a.into}")


if __name__ == "__main__":
    main()
