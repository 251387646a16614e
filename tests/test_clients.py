"""Readers no one here wrote: `tar -cf - . | sha256sum` of the mount against the source,
and fio's random-read job over the mount's files."""
import json
import os
import subprocess

from fusefs.client import mount_stats
from fusefs.pack import pack
from testkit.synth import make_imagefolder
from testkit.mounts import running_mount


def tar_sha256(root) -> str:
    """sha256 of `tar --sort=name -cf - .` in root: names, modes, owners, mtimes and bytes."""
    out = subprocess.run("tar --sort=name -cf - . | sha256sum", shell=True, cwd=root,
                         capture_output=True, text=True, check=True, timeout=300)
    return out.stdout.split()[0]


def test_tar_of_the_mount_is_the_tar_of_the_source(tricky, tmp_path):
    src, dst, _ = tricky  # spaces, non-ASCII, nesting, empty files and folders
    mnt = str(tmp_path / "mnt")
    with running_mount(dst, mnt):
        assert tar_sha256(mnt) == tar_sha256(src)


def test_fio_random_reads_over_the_mount(tmp_path):
    src, dst, mnt = tmp_path / "src", tmp_path / "dst", str(tmp_path / "mnt")
    make_imagefolder(str(src), 120, n_classes=4, mean_bytes=20_000, progress=False)
    pack(str(src), str(dst), chunk_bytes=256 << 10, progress=False)
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs]
    with running_mount(dst, mnt, "--cache-size", "50%"):
        r = subprocess.run(["fio", "--name=randread", f"--opendir={mnt}", "--rw=randread", "--bs=4k",
                            "--readonly", "--ioengine=psync", "--output-format=json"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
        stats = mount_stats(mnt)
    assert "opendir added 120 files" in r.stdout + r.stderr  # the hidden .fusefs is not listed
    assert job["error"] == 0
    assert job["read"]["io_bytes"] == sum(s // 4096 * 4096 for s in sizes)  # every whole block once
    assert stats["eio"] == 0 and stats["opens"] >= 120
