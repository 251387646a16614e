"""scripts/bench/tables.py: docs/BENCHMARKS.md's generated tables match the results files,
and a table that differs from them is caught."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = os.path.join(REPO, "scripts", "bench", "tables.py")
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))
import tables  # noqa: E402  (scripts/bench/tables.py)


def test_the_docs_tables_are_those_the_results_give():
    r = subprocess.run([sys.executable, TABLES, "--check"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_table_that_differs_from_the_results_is_rewritten():
    with open(tables.DOC) as f:
        doc = f.read()
    start = doc.index("<!-- generated: gpu-node -->\n") + len("<!-- generated: gpu-node -->\n")
    stale = doc[:start] + "| edited by hand |\n" + doc[doc.index("<!-- end generated -->", start):]
    new, changed = tables.render(stale)
    assert changed == ["gpu-node"]
    assert new == doc
    assert "| raw | 4 |" in new[start:new.index("<!-- end generated -->", start)]


def test_hotpaths_table_comes_from_bench_hotpaths_results():
    with open(tables.HOTPATH) as f:
        doc = f.read()
    start = doc.index("<!-- generated: hotpath -->\n") + len("<!-- generated: hotpath -->\n")
    stale = doc[:start] + "| edited by hand |\n" + doc[doc.index("<!-- end generated -->", start):]
    new, changed = tables.render(stale, tables.HOTPATH)
    assert changed == ["hotpath"]
    assert new == doc
    assert "| `kernel_paced` |" in new[start:new.index("<!-- end generated -->", start)]
