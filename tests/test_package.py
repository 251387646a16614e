"""The install: `pip wheel` of the checkout holds every module of fusefs and trainer, the
binding fusefs.pyfuse3 (with the fast path) and the compiled fetch reads; a native build
that fails stops the build and names what is missing (for the fetch reads, unless
FUSEFS_NO_NATIVE=1 opts out); and a mount without the native parts says so first."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wheel(out, **env):
    """`pip wheel` of a copy of the checkout (the build writes into its source tree)."""
    src = out / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".device", "out", "build", "*.egg-info", "*.so", "__pycache__", ".pytest_cache",
        "__init__.c"))
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", str(src), "-w", str(out / "dist")],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=600)


def _modules(top: str) -> set[str]:
    out = set()
    for folder, dirs, files in os.walk(os.path.join(REPO, top)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out |= {os.path.relpath(os.path.join(folder, f), REPO) for f in files if f.endswith(".py")}
    return out


def test_the_wheel_holds_every_module_and_the_compiled_reads(tmp_path):
    r = _wheel(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("fusefs-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = _modules("fusefs") | _modules("trainer")
    assert "trainer/accel/hybrid.py" in modules and "trainer/accel/swap.py" in modules
    assert modules <= names, sorted(modules - names)
    # the harness the tests share stays with them (scripts/testkit)
    assert not [n for n in names if n.split("/")[-1] in ("testing.py", "synth.py", "testbed.py")]
    assert any(n.startswith("fusefs/_fetchio.") and n.endswith(".so") for n in names)
    assert any(n.startswith("fusefs/pyfuse3/__init__.") and n.endswith(".so") for n in names)
    assert "fusefs/pyfuse3/_pyfuse3.py" in names and "fusefs/pyfuse3/LICENSE" in names
    assert not [n for n in names if n.endswith((".c", ".h", ".pyx", ".pxi"))]  # (sources stay out)
    # installed into a folder of its own (found first; this venv's packages for the
    # dependencies): the binding has the fast path
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    r = subprocess.run([sys.executable, "-c", "import fusefs.fastpath as f, fusefs._fetchio; "
                        "print(f.__file__, f.pyfuse3.FAST_PATH)"], capture_output=True, text=True,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)))
    assert r.returncode == 0, r.stderr[-2000:]
    where, available = r.stdout.split()
    assert where.startswith(str(site)) and available == "True"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fusefs = fusefs.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_a_native_build_that_fails_stops_the_build_unless_opted_out(tmp_path):
    r = _wheel(tmp_path / "a", CC="/bin/false")
    assert r.returncode != 0
    said = r.stdout + r.stderr
    assert "fusefs.pyfuse3 did not build" in said and "libfuse3-dev" in said
    # a compiler that fails on the fetch reads alone
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\ncase "$*" in *_fetchio.c*) exit 1;; esac\nexec gcc "$@"\n')
    cc.chmod(0o755)
    r = _wheel(tmp_path / "b", CC=str(cc))
    assert r.returncode != 0
    said = r.stdout + r.stderr
    assert "fusefs._fetchio did not build" in said and "libxxhash-dev" in said
    assert "FUSEFS_NO_NATIVE=1" in said
    r = _wheel(tmp_path / "c", CC=str(cc), FUSEFS_NO_NATIVE="1")
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "c" / "dist").glob("fusefs-*.whl")
    so = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    assert len(so) == 1 and so[0].startswith("fusefs/pyfuse3/__init__.")


def test_a_mount_without_the_compiled_reads_says_so_on_its_first_line(tmp_path):
    """`fusefs mount` in a Python where fusefs._fetchio cannot be imported: its first line
    is the warning, before the error about the (missing) dataset."""
    code = ("import sys; sys.modules['fusefs._fetchio'] = None; from fusefs.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "mount", str(tmp_path / "none"), str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.splitlines()
    assert "fusefs._fetchio is not built" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_the_native_parts_missing_are_named(monkeypatch):
    from fusefs import mount
    monkeypatch.setattr(mount, "store_native_built", False)
    lines = mount.missing_native()
    assert len(lines) == 1 and "_fetchio is not built" in lines[0]
    monkeypatch.setattr(mount, "store_native_built", True)
    assert mount.missing_native() == []
