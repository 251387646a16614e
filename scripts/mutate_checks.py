"""Each check of a parser is needed by some test: the script takes away or moves one check
of a module at a time, runs the given tests against each such mutant, and lists the checks
no test noticed (it puts the module back as it was, whatever happens). The mutations, by
kind (`--kind`, repeated; `raise` alone by default):

- raise: a `raise ERROR(...)` does nothing;
- skip: a `return skip(...)` (a member skipped with its reason) neither skips nor returns;
- return: an `if ...:` check's `return None` or `return` goes on instead;
- bound: a comparison in an `if`, `while` or `elif` moves by one (`>` and `>=`, `<` and
  `<=` swapped), one operator at a time: a test at the bound notices.

A line marked `# mutation: equivalent, WHY` is not mutated (`bound` and `return`): moved or
taken away it behaves the same (a shortcut the exact check after it repeats, a progress
bar's step); the run lists each with its reason.

    .venv/bin/python scripts/mutate_checks.py fusefs/index.py IndexFormatError \\
        tests/test_faults.py tests/test_untrusted.py
    .venv/bin/python scripts/mutate_checks.py fusefs/chunk.py ChunkError tests/test_chunk.py
    .venv/bin/python scripts/mutate_checks.py fusefs/order.py OrderError tests/test_order.py
    .venv/bin/python scripts/mutate_checks.py --kind raise --kind skip --kind return \\
        --kind bound fusefs/tarindex.py InPlaceError tests/test_tarindex.py

Exit status 1 if a mutant survived (docs/TESTING.md lists the last runs).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("raise", "skip", "return", "bound")
NOTHING = "(lambda *args, **kw: None)("
SWAP = {">": ">=", ">=": ">", "<": "<=", "<=": "<"}
COMPARISON = re.compile(r"(?<![<>=!-])(>=|<=|>|<)(?![<>=])")  # (not <<, >>, ->, <>)
CHECK = re.compile(r"^\s*(if|elif|while)\b")


EQUIVALENT = "# mutation: equivalent,"


def mutants(lines: list[str], error: str, kinds) -> list[tuple[int, str, str]]:
    """(line index, kind, mutated line) of every mutation of the given kinds ("equivalent"
    and the reason, for a line marked so)."""
    out = []
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0]
        if EQUIVALENT in line and ("bound" in kinds or "return" in kinds):
            out.append((i, "equivalent", line.split(EQUIVALENT, 1)[1].strip()))
            continue
        if "raise" in kinds and f"raise {error}(" in code:
            out.append((i, "raise", line.replace(f"raise {error}(", NOTHING, 1)))
        if "skip" in kinds and "return skip(" in code:
            out.append((i, "skip", line.replace("return skip(", NOTHING, 1)))
        above = lines[i - 1].split("#", 1)[0].rstrip() if i else ""
        if "return" in kinds and code.strip() in ("return None", "return") and \
                CHECK.match(above) and above.endswith(":"):
            out.append((i, "return", line.replace(code.strip(), "pass", 1)))
        if "bound" in kinds and CHECK.match(code):
            for m in COMPARISON.finditer(code):
                out.append((i, "bound", line[:m.start()] + SWAP[m.group(1)] + line[m.end():]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("module", help="the parser's source file, e.g. fusefs/index.py")
    p.add_argument("error", help="the exception its checks raise, e.g. IndexFormatError")
    p.add_argument("tests", nargs="+", help="the test files to run against each mutant")
    p.add_argument("--kind", action="append", choices=KINDS, help="mutations to make (default: raise)")
    p.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    p.add_argument("--timeout", type=float, default=600, help="seconds a mutant's tests may take "
                   "(past it, it is taken as noticed: it hung them)")
    a = p.parse_args()
    kinds = a.kind or ["raise"]
    path = os.path.join(REPO, a.module)
    with open(path) as f:
        original = f.read()
    lines = original.split("\n")
    todo = mutants(lines, a.error, kinds)
    if a.list:
        for i, kind, mutated in todo:
            print(f"{a.module}:{i + 1}: {kind}: {mutated.strip()[:100]}")
        return 0
    survivors = []
    for i, kind, why in [m for m in todo if m[1] == "equivalent"]:
        print(f"{a.module}:{i + 1}: equivalent, not mutated: {why}")
    todo = [m for m in todo if m[1] != "equivalent"]
    try:
        for i, kind, mutated in todo:
            mutant = lines.copy()
            mutant[i] = mutated
            with open(path, "w") as f:
                f.write("\n".join(mutant))
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                    *a.tests], cwd=REPO, capture_output=True, text=True, timeout=a.timeout)
                caught = r.returncode != 0
            except subprocess.TimeoutExpired:  # (a mutant that loops for ever is noticed too)
                caught = True
            print(f"{a.module}:{i + 1}: {kind}: {'caught' if caught else 'NOT CAUGHT'}: {mutated.strip()[:100]}",
                  flush=True)
            if not caught:
                survivors.append(f"{i + 1} ({kind})")
    finally:
        with open(path, "w") as f:
            f.write(original)
    print(f"{a.module}: {len(todo)} mutants, {len(survivors)} no test noticed"
          + (f": lines {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
