"""What the tests, the demo and the benchmarks share, and the installed package does not ship:
mounts in a child process (mounts.py), synthetic ImageFolders (synth.py) and the GlusterFS
test bed's fault injection and scenarios (gluster.py). Importable with scripts/ on sys.path
(tests/conftest.py and scripts/bench/common.py put it there; scripts/demo.py runs from it)."""
