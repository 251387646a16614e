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


def test_the_nodes_hotpath_table_sets_each_version_beside_the_first():
    """gpu-hotpath: a row per regime, each version's median and rounds, a later version's
    ratio to the first round by round, from the last run only."""
    def row(regime, version, cpu, started="2026-11-28T00:00:00+00:00", **extra):
        return {"bench": "bench_hotpath", "regime": regime, "version": version, "commit": "abc1234",
                "date": "2026-11-28T00:01:00+00:00", "started": started, "daemon_cpu_us_per_sample": cpu[1],
                "cpu_us_per_sample_all_rounds": cpu, "samples_per_s": 1000.0, **extra}
    rows = [row("kernel", "abc1234", [9.0, 9.0, 9.0], started="2026-11-27T00:00:00+00:00"),
            row("kernel", "abc1234", [20.0, 22.0, 24.0]),
            row("kernel", "abc1234 --fast-threads=4", [40.0, 44.0, 36.0], cpu_ratio_by_round=[2.0, 2.0, 1.5]),
            row("handlers", "abc1234", [5.0, 5.0, 5.0])]
    lines = tables.gpu_hotpath(rows).splitlines()
    assert "`abc1234 --fast-threads=4`" in lines[0] and len(lines) == 4
    assert lines[2].startswith("| `kernel` | 22.0 (20.0 / 22.0 / 24.0) | 44.0 (40.0 / 44.0 / 36.0) | 2.00 / 2.00 / 1.50 |")
    assert lines[3].startswith("| `handlers` | 5.0 (5.0 / 5.0 / 5.0) | - | - |")
    assert tables.gpu_hotpath([]).startswith("(not measured yet")
