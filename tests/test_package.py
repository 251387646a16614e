"""The install: `pip wheel` of the checkout holds every module of fusefs and trainer, the
binding fusefs.pyfuse3 (with the fast path) and the compiled fetch reads; a native build
that fails stops the build and names what is missing (for the fetch reads, unless
FUSEFS_NO_NATIVE=1 opts out); and a mount without the native parts says so first."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from conftest import as_root

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _copy(out):
    src = out / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".device", "out", "build", "dist", "*.egg-info", "*.so", "__pycache__",
        ".pytest_cache", "__init__.c"))
    return src


def _wheel(out, **env):
    """`pip wheel` of a copy of the checkout (the build writes into its source tree)."""
    src = _copy(out)
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", str(src), "-w", str(out / "dist")],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=600)


def _modules(top: str) -> set[str]:
    out = set()
    for folder, dirs, files in os.walk(os.path.join(REPO, top)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out |= {os.path.relpath(os.path.join(folder, f), REPO) for f in files if f.endswith(".py")}
    return out


# the sources the binding's and the fetch reads' builds need (MANIFEST.in puts them in the sdist)
SOURCES = ("fusefs/_fastpath.h", "fusefs/_fetchio.c", "fusefs/pyfuse3/*.pyx", "fusefs/pyfuse3/*.pxi",
           "fusefs/pyfuse3/*.pxd", "fusefs/pyfuse3/*.h", "fusefs/pyfuse3/macros.c",
           "fusefs/pyfuse3/include/*.pxd", "fusefs/pyfuse3/LICENSE", "LICENSE")


@as_root
def test_the_sdist_needs_no_libfuse_and_its_wheel_installs_without_any_dev_package(tmp_path, attacker):
    """The sdist builds with no libfuse3 and no compiler, and holds every source; the wheel
    scripts/build_wheel.sh makes from it holds every module, the compiled parts and the
    libraries they link (libfuse3, libxxhash, grafted by auditwheel), and a user who is not
    root installs it into a venv of their own with no compiler (CC=false) and loads it: the
    binding finds libfuse3 in the wheel, not on the system."""
    import glob
    import tarfile
    src = _copy(tmp_path)
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "pkg-config").write_text("#!/bin/sh\nexit 1\n")
    (fake / "pkg-config").chmod(0o755)
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
                        str(tmp_path / "sdist"), str(src)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", CC="false"))
    assert r.returncode == 0, r.stderr[-3000:]
    (sdist,) = (tmp_path / "sdist").glob("fusefs-*.tar.gz")
    held = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    needed = {os.path.relpath(f, REPO) for pattern in SOURCES for f in glob.glob(os.path.join(REPO, pattern))}
    assert "fusefs/pyfuse3/__init__.pyx" in needed and needed <= held, sorted(needed - held)

    r = subprocess.run(["bash", str(src / "scripts" / "build_wheel.sh"), str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("fusefs-*manylinux*.whl")
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
    grafted = [n for n in names if n.startswith("fusefs.libs/")]
    assert any("libfuse3" in n for n in grafted) and any("libxxhash" in n for n in grafted), grafted
    assert any(n.endswith("licenses/LICENSE") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    entries = zipfile.ZipFile(wheel).read(entry).decode()
    assert "fusefs = fusefs.cli:main" in entries and "mount.fuse.fusefs = fusefs.cli:mount_helper" in entries

    # a user who is not root: a venv of their own (Debian's Python, the wheel's version),
    # no compiler, no index
    uid, gid, _ = attacker
    home = tempfile.mkdtemp(prefix="fusefs-user-")
    try:
        os.chown(home, uid, gid)
        shutil.copy(wheel, home)
        os.chmod(os.path.join(home, wheel.name), 0o644)
        script = (f"set -e; cd {home}; /usr/bin/python3 -m venv venv; "
                  f"CC=false venv/bin/python -m pip install -q --no-deps --no-index {wheel.name}; "
                  "so=$(venv/bin/python -c 'import importlib.util as u; "
                  "print(u.find_spec(\"fusefs.pyfuse3\").origin)' 2>/dev/null || "
                  "ls venv/lib/python3*/site-packages/fusefs/pyfuse3/__init__*.so); "
                  "ldd $so | grep libfuse3; venv/bin/python -c 'import fusefs._fetchio; print(\"fetchio ok\")'")
        r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "bash", "-c", script],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, HOME=home))
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        fuse_line = next(line for line in r.stdout.splitlines() if "libfuse3" in line)
        assert f"{home}/venv/" in fuse_line and "fusefs.libs/libfuse3-" in fuse_line, r.stdout
        assert "fetchio ok" in r.stdout
    finally:
        shutil.rmtree(home, ignore_errors=True)

    # installed into a folder of its own (found first; this venv's packages for the
    # dependencies): the binding has the fast path and `fusefs --version` says so
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    r = subprocess.run([sys.executable, "-c", "import fusefs.fastpath as f, fusefs._fetchio; "
                        "print(f.__file__, f.pyfuse3.FAST_PATH)"], capture_output=True, text=True,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    where, available = r.stdout.split()
    assert where.startswith(str(site)) and available == "True"
    r = subprocess.run([sys.executable, "-m", "fusefs", "--version"], capture_output=True, text=True,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pyfuse3 3.5.0" in r.stdout and "fast path: built in" in r.stdout
    assert "native fetch (fusefs._fetchio): built in" in r.stdout and "libfuse: 3." in r.stdout


def _glibc_needed(so: str) -> tuple:
    """The newest GLIBC_x.y symbol version the shared object so needs (objdump -T)."""
    out = subprocess.run(["objdump", "-T", so], capture_output=True, text=True, check=True, timeout=60).stdout
    import re
    return max((tuple(int(x) for x in v.split(".")) for v in re.findall(r"GLIBC_([0-9.]+)", out)),
               default=(0,))


def test_the_manylinux_2_28_wheel_is_built_here_and_mounts(tmp_path):
    """GLIBC=2.28 scripts/build_wheel.sh: the vendored libfuse and fusefs's compiled parts
    built for glibc 2.28 by zig's compiler, tagged manylinux_2_28 by auditwheel (which
    checks every symbol version); no shared object in the wheel needs a newer glibc, the
    binding loads the wheel's libfuse3, and a mount through the installed wheel serves a
    packed file's bytes (the fast path built in)."""
    from fusefs.pack import pack
    from testkit.mounts import running_mount
    src = _copy(tmp_path)
    r = subprocess.run(["bash", str(src / "scripts" / "build_wheel.sh"), str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHON=sys.executable, GLIBC="2.28"))
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("fusefs-*.whl")
    assert wheel.name.endswith("-manylinux_2_28_x86_64.whl"), wheel.name
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    objects = [os.path.join(d, f) for d, _, fs in os.walk(site) for f in fs if ".so" in f]
    assert len(objects) == 7, objects  # the binding, the cores (cache, plan, events), the fetch reads, libfuse3, libxxhash
    assert all(_glibc_needed(so) <= (2, 28) for so in objects), {so: _glibc_needed(so) for so in objects}
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONSAFEPATH="1")  # (the wheel's fusefs, not the checkout's)
    r = subprocess.run([sys.executable, "-m", "fusefs", "--version"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=60)
    assert r.returncode == 0 and "fast path: built in" in r.stdout and "libfuse: 3.14.0" in r.stdout, r
    data = os.urandom(50_000)
    os.makedirs(tmp_path / "tree" / "a")
    (tmp_path / "tree" / "a" / "x.bin").write_bytes(data)
    pack(str(tmp_path / "tree"), str(tmp_path / "packed"), progress=False)
    with running_mount(tmp_path / "packed", tmp_path / "mnt", env=env) as (proc, _):
        assert (tmp_path / "mnt" / "a" / "x.bin").read_bytes() == data
        assert (tmp_path / "mnt" / "a" / "x.bin").read_bytes() == data  # (again: the fast path's)
        with open(f"/proc/{proc.pid}/maps") as f:
            maps = f.read()
    assert f"{site}/fusefs.libs/libfuse3-" in maps and f"{site}/fusefs/pyfuse3/__init__" in maps


def _one_line(r) -> str:
    """The build's one line about it (pip frames it with its own lines): no compiler
    diagnostics, no traceback."""
    import re
    said = r.stdout + r.stderr
    assert not re.search(r"\.(c|h|pyx|pxi):\d+", said) and "Traceback" not in said, said[-3000:]
    (line,) = [x.strip() for x in said.splitlines() if x.strip().startswith("fusefs:")]
    return line


def test_a_missing_build_dependency_stops_the_build_before_any_compile(tmp_path):
    """No working compiler (CC=false), or no xxhash.h (a compiler that fails on it): one
    line naming the Debian packages, before the binding is compiled; the fetch reads can
    be left out (FUSEFS_NO_NATIVE=1: the binding and the cores of the cache, the plan and
    the events, which need nothing more, are built), and a failure in their own compile names them too."""
    r = _wheel(tmp_path / "a", CC="/bin/false")
    assert r.returncode != 0
    line = _one_line(r)
    assert "cannot build fusefs.pyfuse3" in line and "libfuse3-dev" in line and len(line) < 250, line
    assert not list((tmp_path / "a" / "src").rglob("__init__.c"))  # (nothing was cythonized... compiled)
    no_xxhash = tmp_path / "cc-no-xxhash"
    no_xxhash.write_text('#!/bin/sh\nfor a; do case "$a" in *probe.c) grep -q xxhash "$a" && exit 1;; esac; done\n'
                         'exec gcc "$@"\n')
    no_xxhash.chmod(0o755)
    r = _wheel(tmp_path / "b", CC=str(no_xxhash))
    assert r.returncode != 0
    line = _one_line(r)
    assert "cannot build fusefs._fetchio" in line and "libxxhash-dev" in line and "FUSEFS_NO_NATIVE=1" in line, line
    # a compiler that fails on the fetch reads' own source
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\ncase "$*" in *_fetchio.c*) exit 1;; esac\nexec gcc "$@"\n')
    cc.chmod(0o755)
    r = _wheel(tmp_path / "c", CC=str(cc))
    assert r.returncode != 0
    said = r.stdout + r.stderr
    assert "fusefs._fetchio did not build" in said and "libxxhash-dev" in said
    assert "FUSEFS_NO_NATIVE=1" in said
    # (-O0: this wheel is only looked into, never run; the binding compiles in a third of the time)
    r = _wheel(tmp_path / "d", CC=str(cc), FUSEFS_NO_NATIVE="1", CFLAGS="-O0")
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "d" / "dist").glob("fusefs-*.whl")
    so = sorted(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so"))
    assert [n.split(".")[0] for n in so] == ["fusefs/_cachecore", "fusefs/_eventscore", "fusefs/_plancore",
                                             "fusefs/pyfuse3/__init__"]


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
