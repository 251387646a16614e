"""Time single small reads on a folder (to confirm the GlusterFS delay is in effect).

usage: gluster_probe.py DIR [N]   writes N files of 4 KiB under DIR/.probe, drops the
page cache, and prints the median time of open+read+close of one file.
"""
import os
import statistics
import sys
import time


def probe(root: str, n: int = 30) -> float:
    d = os.path.join(root, ".probe")
    os.makedirs(d, exist_ok=True)
    for i in range(n):
        with open(os.path.join(d, f"p{i}"), "wb") as f:
            f.write(os.urandom(4096))
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass
    times = []
    for i in range(n):
        t = time.perf_counter()
        with open(os.path.join(d, f"p{i}"), "rb") as f:
            f.read()
        times.append(time.perf_counter() - t)
    for i in range(n):
        os.unlink(os.path.join(d, f"p{i}"))
    os.rmdir(d)
    return statistics.median(times)


if __name__ == "__main__":
    ms = probe(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30) * 1e3
    print(f"median open+read of a 4 KiB file: {ms:.2f} ms")
