"""Each check of a format parser is needed by some test: the script turns every
`raise ERROR(` of a module into a call that does nothing, one at a time, runs the given
tests against each such mutant, and lists the checks no test noticed missing (it puts the
module back as it was, whatever happens).

    .venv/bin/python scripts/mutate_checks.py fusefs/index.py IndexFormatError \\
        tests/test_faults.py tests/test_untrusted.py
    .venv/bin/python scripts/mutate_checks.py fusefs/chunk.py ChunkError tests/test_chunk.py
    .venv/bin/python scripts/mutate_checks.py fusefs/order.py OrderError tests/test_order.py

Exit status 1 if a mutant survived (docs/TESTING.md lists the last runs).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("module", help="the parser's source file, e.g. fusefs/index.py")
    p.add_argument("error", help="the exception its checks raise, e.g. IndexFormatError")
    p.add_argument("tests", nargs="+", help="the test files to run against each mutant")
    a = p.parse_args()
    path = os.path.join(REPO, a.module)
    with open(path) as f:
        original = f.read()
    lines = original.split("\n")
    needle = f"raise {a.error}("
    survivors = []
    try:
        for i, line in enumerate(lines):
            if needle not in line:
                continue
            mutant = lines.copy()
            mutant[i] = line.replace(needle, "(lambda *args, **kw: None)(", 1)
            with open(path, "w") as f:
                f.write("\n".join(mutant))
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *a.tests],
                               cwd=REPO, capture_output=True, text=True, timeout=1800)
            caught = r.returncode != 0
            print(f"{a.module}:{i + 1}: {'caught' if caught else 'NOT CAUGHT'}: {line.strip()[:100]}", flush=True)
            if not caught:
                survivors.append(i + 1)
    finally:
        with open(path, "w") as f:
            f.write(original)
    print(f"{a.module}: {len(survivors)} check(s) no test needs" + (f": lines {survivors}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
