"""docs/BENCHMARKS.md's generated tables, from the benchmarks' JSON lines in
scripts/bench/results/: each table sits between `<!-- generated: NAME -->` and
`<!-- end generated -->`, and this script rewrites what is between (--check: exit 1 if the
docs differ from what it would write, and say which table).

Tables: gpu-node (bench_node on the GPU node: loose files, fusefs and the minimal C daemon
by loader and workers), gpu-hybrid (bench_hybrid's summaries) and gpu-swap (bench_swap's
rows, or the exit status of its part where it did not finish).

usage: .venv/bin/python scripts/bench/tables.py [--check]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
DOC = os.path.join(REPO, "docs", "BENCHMARKS.md")


def load(name: str) -> list[dict]:
    with open(os.path.join(RESULTS, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def mean(xs) -> float:
    return sum(xs) / len(xs)


def where(r: dict) -> str:
    return f"{r['commit']}, {r['date'][:10]}"


def gpu_node(rows: list[dict]) -> str:
    """Per loader and worker count, the last call that measured loose files there, and that
    call's other systems (ratios are within one call, side by side)."""
    node = [r for r in rows if r.get("bench") == "bench_node"]
    out = ["| loader | workers | loose files, samples/s | fusefs | minimal C daemon "
           "| daemon CPU per sample, fusefs / minimal C | commit, date |",
           "|---|---|---|---|---|---|---|"]
    for loader in ("raw", "decode"):
        for w in sorted({r["workers"] for r in node if r["loader"] == loader}):
            runs = [r["run"] for r in node if (r["loader"], r["workers"], r["system"]) == (loader, w, "loose")]
            if not runs:
                continue
            got = {r["system"]: r for r in node if (r["loader"], r["workers"], r["run"]) == (loader, w, runs[-1])}

            def cell(system):
                r = got.get(system)
                if r is None:
                    return "not measured (cut by its timeout)"
                return f"{mean(r['samples_per_s']):,.0f} ({r['ratio_to_loose']:.2f}x)"

            cpu = " / ".join(f"{got[s]['daemon_cpu_us_per_sample']:.0f} us" if s in got else "-"
                             for s in ("fusefs", "minimal_c"))
            out.append(f"| {loader} | {w} | {mean(got['loose']['samples_per_s']):,.0f} | {cell('fusefs')} "
                       f"| {cell('minimal_c')} | {cpu} | {where(got['loose'])} |")
    return "\n".join(out)


def gpu_hybrid(rows: list[dict]) -> str:
    out = ["| model | GPU only, samples/s | CPU only | HybridTrainer | hybrid / GPU only "
           "| final accuracy, GPU only / CPU only / hybrid | CPU replica at the end | commit, date |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("bench") != "bench_hybrid" or "summary" not in r:
            continue
        s = r["summary"]
        acc = " / ".join(f"{100 * s[m]['final_acc'][-1]:.1f}%" for m in ("accel", "cpu", "hybrid"))
        out.append(f"| {r['model']} | {s['accel']['samples_per_s']:,.0f} | {s['cpu']['samples_per_s']:,.0f} "
                   f"| {s['hybrid']['samples_per_s']:,.0f} | {s['hybrid_over_accel']:.2f}x | {acc} "
                   f"| {'training' if s['hybrid_cpu_active'] else 'off'} (gain {s['hybrid_gain']:.3f}) "
                   f"| {where(r)} |")
    return "\n".join(out)


def gpu_swap(rows: list[dict]) -> str:
    swap = [r for r in rows if r.get("bench") == "bench_swap" and "row" in r]
    if swap:
        out = ["| model | row | peak CUDA memory | step | largest batch | commit, date |",
               "|---|---|---|---|---|---|"]
        for r in swap:
            out.append(f"| {r['model']} | {r['row']} | {r['memory'] / 1e9:.2f} GB | {1e3 * r['step_s']:.1f} ms "
                       f"({r['time_ratio']:.2f}x) | {r.get('largest_batch', '-')} | {where(r)} |")
        return "\n".join(out)
    parts = [r for r in rows if r.get("part") == "swap"]
    out = ["| call | exit status | seconds |", "|---|---|---|"]
    out += [f"| {r['run']} | {r['rc']}{' (killed)' if r['rc'] == 137 else ''} | {r['seconds']} |" for r in parts]
    return "\n".join(out)


TABLES = {"gpu-node": (gpu_node, "gpu-node.jsonl"), "gpu-hybrid": (gpu_hybrid, "gpu-node.jsonl"),
          "gpu-swap": (gpu_swap, "gpu-node.jsonl")}


def render(doc: str) -> tuple[str, list[str]]:
    """doc with every generated table rewritten; the names of those that changed."""
    changed = []
    for name, (make, results) in TABLES.items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n)(.*?)(<!-- end generated -->)", re.S)
        if not pattern.search(doc):
            raise SystemExit(f"tables.py: {DOC} has no '<!-- generated: {name} -->' section")
        table = make(load(results)) + "\n"
        new = pattern.sub(lambda m: m.group(1) + table + m.group(3), doc, count=1)
        if new != doc:
            changed.append(name)
        doc = new
    return doc, changed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing: exit 1 if a table is stale")
    a = p.parse_args()
    with open(DOC) as f:
        doc = f.read()
    new, changed = render(doc)
    if a.check:
        if changed:
            print(f"tables.py: stale in {DOC}: {', '.join(changed)} (run scripts/bench/tables.py)")
            return 1
        return 0
    if changed:
        with open(DOC, "w") as f:
            f.write(new)
    print(f"tables.py: {', '.join(changed) or 'nothing'} rewritten in {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
