"""docs/BENCHMARKS.md's and docs/HOTPATH.md's generated tables, from the benchmarks' JSON lines in
scripts/bench/results/: each table sits between `<!-- generated: NAME -->` and
`<!-- end generated -->`, and this script rewrites what is between (--check: exit 1 if the
docs differ from what it would write, and say which table).

Tables: mount (bench_mount: index, pack, random reads), order (bench_order: the settings
on the GlusterFS test bed), clients (bench_clients: fio and tar), faults (faults.py), soak
(soak.py), memory (bench_memory.py), hammer (bench_hammer.py), commit (bench_commit.py), scale (bench_scale.py), scale-drop (bench_scale.py --drop-pages), scale-epochs
(bench_scale.py --epochs), uring (bench_uring.py: the minimal raw-protocol daemon over /dev/fuse and
over io_uring), each from the benchmark's last run (its rows share `started`); gpu-node
(bench_node on the GPU node: loose files, fusefs and the minimal C daemon by loader and
workers), gpu-hybrid (bench_hybrid's epoch rows, by model, mode and seed), gpu-swap
(bench_swap's rows, and the exit status of each swap part that ended without them) and
gpu-importance (bench_unbiased --local on the node), gpu-pages, gpu-hotpath and gpu-scale-epochs
(page_cost.py, bench_hotpath.py by version and bench_scale.py --epochs on the node); in HOTPATH.md, hotpath
(bench_hotpath.py --results: fusefs, --no-fast-path and the minimal daemons, by regime) and
wake (wake_cost.py: an idle loop's wake, trio's and a bare epoll loop's) and pages
(page_cost.py: a sample's read into fresh memory and into memory present).

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
HOTPATH = os.path.join(REPO, "docs", "HOTPATH.md")


def load(name: str) -> list[dict]:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_run(rows: list[dict], bench: str) -> list[dict]:
    """The rows of the benchmark's last run (the latest `started`)."""
    rows = [r for r in rows if r.get("bench") == bench]
    if not rows:
        return []
    started = max(r["started"] for r in rows)
    return [r for r in rows if r["started"] == started]


def slashed(xs, fmt="{:,.0f}") -> str:
    return " / ".join(fmt.format(x) for x in xs)


def not_measured(bench: str) -> str:
    return f"(not measured yet: run scripts/bench/{bench}.py)"


def mount(rows: list[dict]) -> str:
    run = last_run(rows, "bench_mount")
    if not run:
        return not_measured("bench_mount")
    out = ["| what | figure | commit, date |", "| --- | --- | --- |"]
    for r in run:
        if r["part"] == "pack":
            out.append(f"| pack, {r['files']:,} JPEGs ({r['bytes'] / 1e9:.2f} GB) | {r['mb_per_s']:,.0f} MB/s "
                       f"({r['seconds']:.1f} s) | {where(r)} |")
        elif r["part"] == "index":
            out.append(f"| index of {r['samples']:,} samples | {r['index_bytes'] / 1e6:.0f} MB file, loads in "
                       f"{r['load_s']:.2f} s, +{r['rss_added_mb']:.0f} MB RSS | {where(r)} |")
        else:
            out.append(f"| random-order reads, {r['readers']} reader(s): source folder / mount | "
                       f"{r['source_files_s']:,.0f} / {r['mount_files_s']:,.0f} files/s ({r['ratio']:.2f}x) "
                       f"| {where(r)} |")
    return "\n".join(out)


ORDER_NOTES = {"a": "", "r": "the peer a user would pick; shuffled, no hints", "d": "epoch 2 from the daemon's cache"}


def order(rows: list[dict]) -> str:
    run = last_run(rows, "bench_order")
    if not run:
        return not_measured("bench_order")
    out = ["| setting | samples/s, epoch 1 / 2 | CPU us per sample: daemon / loader / GlusterFS client / bricks "
           "| cores busy | backend requests per sample | reads that waited, epoch 1 / 2 | daemon peak RSS / cache budget "
           "| commit, date |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in run:
        c = r["cpu_us_per_sample"]
        daemon = f"{r['daemon_cpu_us_per_sample']:,.0f}" if "daemon_cpu_us_per_sample" in r else "-"
        client = "-" if r["setting"][0] in "df" else f"{c['glusterfs_client']:,.0f}"
        bricks = "-" if r["setting"][0] in "df" else f"{c['bricks']:,.0f}"
        rate = slashed(r["samples_per_s"])
        if r["setting"][0] in "cu":
            rate = f"**{rate}**"
        reqs = f"{r['backend_requests_per_sample']:.2f}" if "backend_requests_per_sample" in r else "-"
        waited = slashed(r["reads_that_waited"]) if "reads_that_waited" in r else "-"
        rss = (f"{r['daemon_peak_rss'] / 1e6:,.0f} / {r['cache_budget'] / 1e6:,.0f} MB" if "cache_budget" in r
               else (f"{r['daemon_peak_rss'] / 1e6:,.0f} MB / -" if "daemon_peak_rss" in r else "-"))
        setting = r["setting"] if r.get("version", r["commit"]) == r["commit"] else \
            f"{r['setting']}, the daemon of {r['version']} (--against)"
        out.append(f"| {setting} | {rate} | {daemon} / {c['loader']:,.0f} / {client} / {bricks} "
                   f"| {100 * r['machine_busy']:.0f}% | {reqs} | {waited} | {rss} | {where(r)} |")
    by = {r["setting"][0]: r for r in run if r.get("version", r["commit"]) == r["commit"]}
    ratios = []
    for num, den in (("c", "a"), ("c", "r"), ("t", "c"), ("t", "s"), ("u", "c"), ("u", "b")):
        if num in by and den in by:
            ratios.append(f"{num}/{den} = " + slashed([x / y for x, y in zip(by[num]["samples_per_s"],
                                                                          by[den]["samples_per_s"])], "{:.2f}"))
    if ratios:
        out += ["", f"{' and '.join(ratios)} (epoch 1 / 2); {run[0]['files']:,} files, "
                    f"{run[0]['delay_ms']:g} ms per operation ({run[0]['probe']})."]
    if "u" in by and "c" in by and "backend_requests_per_sample_per_epoch" in by["u"]:
        u, c = (by[k]["backend_requests_per_sample_per_epoch"] for k in "uc")
        out += ["", f"Backend requests per sample, epoch 1 / 2: u {slashed(u, '{:.3f}')}, c "
                    f"{slashed(c, '{:.3f}')} (u/c {slashed([x / max(y, 1e-9) for x, y in zip(u, c)], '{:.2f}')})."]
    if "t" in by and "index_s" in by["t"]:
        t = by["t"]
        out += ["", f"Indexing the tar shards in place (t): {t['index_s']:.1f} s, {t['index_mb_per_s']:,.0f} "
                    f"MB/s ({t['index_wall_s']:.1f} s with Python's start), against `cat` of them "
                    f"{t['cat_s']:.1f} s, {t['cat_mb_per_s']:,.0f} MB/s "
                    f"({t['index_over_cat']:.2f} of cat's rate), page cache dropped before each; "
                    f"the index {t['index_bytes'] / 1e6:.1f} MB."]
    return "\n".join(out)


def autohint(rows: list[dict]) -> str:
    run = last_run(rows, "bench_autohint")
    if not run:
        return not_measured("bench_autohint")
    out = ["| samples | first batch, epoch 1: as it is / under fusefs run | first batch, later epochs | "
           "process CPU us per sample, epoch 1: as it is / under fusefs run | later epochs | peak RSS | "
           "commit, date |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in run:
        p, u = r["median"]["plain"], r["median"]["launcher"]
        cp, cu = r["epoch_cpu_us_per_sample"]["plain"], r["epoch_cpu_us_per_sample"]["launcher"]
        later = lambda xs: max(xs[1:]) if len(xs) > 1 else float("nan")
        out.append(f"| {r['samples']:,} | {p['first_batch_s'][0]:.2f} / {u['first_batch_s'][0]:.2f} s "
                   f"| {later(p['first_batch_s']):.2f} / {later(u['first_batch_s']):.2f} s "
                   f"| {cp[0]:.2f} / {cu[0]:.2f} | {later(cp):.2f} / {later(cu):.2f} "
                   f"| {p['peak_rss_mb']:,.0f} / {u['peak_rss_mb']:,.0f} MB | {where(r)} |")
    return "\n".join(out)


def clients(rows: list[dict]) -> str:
    run = last_run(rows, "bench_clients")
    if not run:
        return not_measured("bench_clients")
    systems = list(dict.fromkeys(r["system"] for r in run))
    out = ["| reader | " + " | ".join("loose files" if s == "loose" else s for s in systems)
           + " | tar digests equal | commit, date |", "| --- |" + " --- |" * (len(systems) + 2)]
    for reader, what in (("fio", "`fio --opendir --rw=randread --bs=128k --file_service_type=random`"),
                         ("tar", "`tar --sort=name -cf - . \\| sha256sum`")):
        got = [r for r in run if r["reader"] == reader]
        if not got:
            continue
        cells = [slashed([r["files_per_s"] for r in got if r["system"] == s]) for s in systems]
        agree = all(r["digest_agrees"] for r in run if r["reader"] == "tar")
        out.append(f"| {what} | " + " | ".join(cells) + f" | {'yes' if agree else 'NO'} | {where(got[0])} |")
    return "\n".join(out)


def faults(rows: list[dict]) -> str:
    run = last_run(rows, "faults")
    if not run:
        return not_measured("faults")
    out = ["| scenario | served | EIO | wrong bytes | backend requests | errors seen | retries | recovery "
           "| median read before / after the fault, ms (served / EIO) | commit, date |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in run:
        rec = "-" if r["scenario"].startswith("errors") or r.get("recovery_s") is None else f"{r['recovery_s']:.2f} s"
        ms = lambda x: "-" if x is None else f"{x:.2f}"
        after = f"{ms(r['read_ms_after_ok'])} / {ms(r['read_ms_after_eio'])}"
        out.append(f"| {r['scenario']} | {r['served']} | {r['eio']} | {r['wrong']} | {r['requests']} "
                   f"| {r['backend_errors']} | {r['retries']} | {rec} | {ms(r['read_ms_before'])} / {after} "
                   f"| {where(r)} |")
    return "\n".join(out)


def soak(rows: list[dict]) -> str:
    run = last_run(rows, "soak")
    if not run:
        return not_measured("soak")
    r = run[-1]
    return "\n".join([
        "| epochs | samples per epoch | readers killed | daemon RSS peak (first half / second half) "
        "| cache budget + index | EIO | open handles at the end | commit, date |",
        "|---|---|---|---|---|---|---|---|",
        f"| {r['epochs']} | {r['samples_per_epoch']:,} | {r['kills']} | {r['rss_peak'] / 1e6:.0f} MB "
        f"({r['rss_first_half_max'] / 1e6:.0f} / {r['rss_second_half_max'] / 1e6:.0f}) "
        f"| {r['budget'] / 1e6:.0f} + {r['index_bytes'] / 1e6:.1f} MB | {r['eio']} | {r['open_handles_at_end']} "
        f"| {where(r)} |"])


def mean(xs) -> float:
    return sum(xs) / len(xs)


def where(r: dict) -> str:
    return f"{r['commit']}, {r['date'][:10]}"


def gpu_node(rows: list[dict]) -> str:
    """Per loader and worker count, the last call that measured loose files there, and that
    call's other systems (ratios are within one call, side by side): fusefs with its default
    fast-path threads, with one (fusefs_n1) and read without an order (fusefs_shuffle), "-"
    where the call did not run it."""
    node = [r for r in rows if r.get("bench") == "bench_node"]
    out = ["| loader | workers | loose files, samples/s | fusefs (threads) | fusefs, 1 thread "
           "| fusefs, no order | minimal C daemon | fusefs / loose, per counted epoch "
           "| daemon CPU per sample: fusefs / 1 thread / no order / minimal C | commit, date |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for loader in ("raw", "decode"):
        for w in sorted({r["workers"] for r in node if r["loader"] == loader}):
            runs = [r["run"] for r in node if (r["loader"], r["workers"], r["system"]) == (loader, w, "loose")]
            if not runs:
                continue
            got = {r["system"]: r for r in node if (r["loader"], r["workers"], r["run"]) == (loader, w, runs[-1])}
            ran = {r["system"] for r in node if r["run"] == runs[-1]}

            def cell(system):
                r = got.get(system)
                if r is None:
                    return "not measured (cut by its timeout)" if system in ran else "-"
                threads = f", {r['fast_threads']}" if system == "fusefs" and "fast_threads" in r else ""
                return f"{mean(r['samples_per_s']):,.0f} ({r['ratio_to_loose']:.2f}x{threads})"

            cpu = " / ".join(f"{got[s]['daemon_cpu_us_per_sample']:.0f} us" if s in got else "-"
                             for s in ("fusefs", "fusefs_n1", "fusefs_shuffle", "minimal_c"))
            epochs = got.get("fusefs", {}).get("ratio_epochs")
            spread = slashed(epochs, "{:.2f}") if epochs else "-"
            out.append(f"| {loader} | {w} | {mean(got['loose']['samples_per_s']):,.0f} | {cell('fusefs')} "
                       f"| {cell('fusefs_n1')} | {cell('fusefs_shuffle')} | {cell('minimal_c')} | {spread} | {cpu} "
                       f"| {where(got['loose'])} |")
    return "\n".join(out)


def sd(xs: list[float]) -> float:
    m = mean(xs)
    return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0


def gpu_hybrid(rows: list[dict]) -> str:
    """Per model, from the epoch rows of its last seeded run (a run cut short counts the
    seeds it finished): GPU only against HybridTrainer, final accuracy mean and spread
    over the seeds, samples/s (median over seeds of epochs 2..), and the probe's verdicts."""
    epochs = [r for r in rows if r.get("bench") == "bench_hybrid" and "seed" in r and "epoch" in r]
    out = ["| model | mode | seeds | final test accuracy, mean ± sd (min-max) | samples/s, epochs 2.. "
           "| CPU replica (probe: on / off samples/s) | commit, date |",
           "|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in epochs):
        mine = [r for r in epochs if r["model"] == model]
        run = max(r["started"] for r in mine)
        mine = [r for r in mine if r["started"] == run]
        n_epochs = max(r["epoch"] for r in mine) + 1
        for mode in dict.fromkeys(r["mode"] for r in mine):
            runs = {}
            for r in mine:
                if r["mode"] == mode:
                    runs.setdefault(r["seed"], []).append(r)
            done = [sorted(rs, key=lambda r: r["epoch"]) for rs in runs.values() if len(rs) == n_epochs]
            if not done:
                continue
            acc = [100 * rs[-1]["test_acc"] for rs in done]
            rate = sorted(mean([r["samples_per_s"] for r in rs[1:]]) for rs in done)[len(done) // 2]
            cpu = "-"
            if mode == "hybrid":
                verdicts = []
                for rs in done:
                    p = rs[-1].get("probe") or {}
                    on_off = (f"{mean(p['on']):,.0f} / {mean(p['off']):,.0f}" if p.get("on") and p.get("off")
                              else "-")
                    verdicts.append(f"{'on' if rs[-1]['cpu_active'] else 'off'} ({on_off})")
                cpu = "; ".join(verdicts)
            out.append(f"| {model} | {'GPU only' if mode == 'accel' else mode} | {len(done)} "
                       f"| {mean(acc):.2f}% ± {sd(acc):.2f} ({min(acc):.2f}-{max(acc):.2f}) | {rate:,.0f} "
                       f"| {cpu} | {where(done[-1][-1])} |")
    out += ["", f"{n_epochs} epochs of load_digits (1,437 training images, 360 test) per run."] if epochs else []
    return "\n".join(out)


def gpu_importance(rows: list[dict]) -> str:
    """bench_unbiased on the GPU node (ResNet-18 through a local mount)."""
    return unbiased([r for r in rows if r.get("bench") == "bench_unbiased"])


def gpu_swap(rows: list[dict]) -> str:
    """bench_swap's rows on the node (the latest run of each model and budget), then the
    exit status of every swap part or command that ended without rows."""
    swap = [r for r in rows if r.get("bench") == "bench_swap" and "row" in r]
    out = ["| model, batch | budget | row | peak CUDA memory (share of no swap) | step (vs no swap) "
           "| host RSS after its step | commit, date |", "|---|---|---|---|---|---|---|"]
    latest = {}
    for r in swap:
        latest[(r["model"], r["budget"])] = r["started"]
    for r in swap:
        if latest[(r["model"], r["budget"])] != r["started"]:
            continue
        base = next(x for x in swap if x["started"] == r["started"] and x["model"] == r["model"]
                    and x["budget"] == r["budget"] and x["row"] == "no_swap")
        out.append(f"| {r['model']}, {r['batch']} | {r['budget']:.0%} | {r['row']} | {r['memory'] / 1e9:.2f} GB "
                   f"({r['memory'] / base['memory']:.0%}) | {1e3 * r['step_s']:.1f} ms ({r['time_ratio']:.2f}x) "
                   f"| {r['host_rss'] / 2**30:.1f} GiB | {where(r)} |" if "host_rss" in r else
                   f"| {r['model']}, {r['batch']} | {r['budget']:.0%} | {r['row']} | {r['memory'] / 1e9:.2f} GB "
                   f"| {1e3 * r['step_s']:.1f} ms ({r['time_ratio']:.2f}x) | - | {where(r)} |")
    parts = [r for r in rows if r.get("part") == "swap" and r.get("rc")]
    out += ["", "| call | exit status | seconds | what stopped it |", "|---|---|---|---|"]
    why = {137: "killed by the kernel (host memory)", 3: "bench_swap's host-memory watch", 124: "its timeout"}
    out += [f"| {r['run']} | {r['rc']} | {r['seconds']} | {r.get('error') or r.get('note') or why.get(r['rc'], '-')} |"
            for r in parts]
    return "\n".join(out)


def memory(rows: list[dict]) -> str:
    run = last_run(rows, "bench_memory")
    if not run:
        return not_measured("bench_memory")
    mb = lambda x: f"{x / 1e6:,.0f} MB"
    out = ["| part | figures | commit, date |", "| --- | --- | --- |"]
    for r in run:
        if r["part"] == "small":
            out.append(f"| {r['files']:,} samples of 0.5-3 KB, cache {r['cache_size']} | RSS fresh {mb(r['rss_base'])} "
                       f"(index {mb(r['index_bytes'])}), with the order {mb(r['rss_after_order'])}, after the epoch "
                       f"{mb(r['rss_end'])}: {r['cache_samples']:,} entries holding {mb(r['cache_bytes'])}, "
                       f"{r['per_entry_beyond_bytes']:,} B per entry beyond what the cache counts; {mb(r['over_budget'])} over "
                       f"fresh + budget | {where(r)} |")
        else:
            out.append(f"| {r['handles']} handles held open by `{r['held_by']}`, read a byte at a time (O_DIRECT) "
                       f"| RSS {mb(r['rss_before'])} before, {mb(r['rss_held'])} held, {mb(r['rss_after'])} after; "
                       f"{mb(r['held_bytes'])} kept for the handles | {where(r)} |")
    return "\n".join(out)


def hammer(rows: list[dict]) -> str:
    run = last_run(rows, "bench_hammer")
    if not run:
        return not_measured("bench_hammer")
    who = {"quiet": "no one", "other_user": "`nobody` (throttled)", "root": "root (rendered at every open)"}
    out = ["| stats opened in a loop by | reads | all reads, s | p50 / p90 / p99, ms | p90 vs quiet | the hammer's opens/s, texts | commit, date |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in run:
        extra = f"{r['hammer_opens_per_s']:,}, {r['hammer_texts']:,}" if "hammer_opens_per_s" in r else "-"
        out.append(f"| {who[r['setting']]} | {r['reads']:,} | {r['seconds']:.2f} | {r['p50_ms']:.2f} / {r['p90_ms']:.2f} / {r['p99_ms']:.2f} "
                   f"| {r['p90_vs_quiet']:.2f}x | {extra} | {where(r)} |")
    return "\n".join(out)


def commit(rows: list[dict]) -> str:
    run = last_run(rows, "bench_commit")
    if not run:
        return not_measured("bench_commit")
    out = ["| fusefs | samples, ranks | commits, s (slowest) | getattrs during them: median / p99 / max, ms "
           "| daemon RSS | orders held / budget | commit, date |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in run:
        held = ("-" if r.get("order_bytes") is None
                else f"{r['order_bytes'] / 2**20:,.0f} / {r['order_budget'] / 2**20:,.0f} MiB")
        out.append(f"| {r['version']} | {r['samples']:,}, {r['ranks']} | {sum(r['commit_s']):.2f} "
                   f"({r['commit_s_max']:.2f}) | {r['getattr_ms_median']:.1f} / {r['getattr_ms_p99']:.1f} / "
                   f"{r['getattr_ms_max']:.1f} | {r['rss_mb']:,.0f} MB | {held} | {where(r)} |")
    return "\n".join(out)


def ranks(rows: list[dict]) -> str:
    run = last_run(rows, "bench_ranks")
    if not run:
        return not_measured("bench_ranks")
    out = ["| fusefs | cache | daemon CPU us a sample (rounds) | samples/s (rounds) | samples fetched "
           "(rounds) | misses (rounds) | reads that waited (rounds) | commit, date |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    sizes = list(dict.fromkeys(r["cache_size"] for r in run))  # (in the order run)
    for r in sorted(run, key=lambda r: sizes.index(r["cache_size"])):
        out.append(f"| {r['version']} | {r['cache_size']} | {r['daemon_cpu_us_per_sample']:.0f} "
                   f"({slashed(r['cpu_us_per_sample_all_rounds'])}) | "
                   f"{slashed(r['samples_per_s_all_rounds'])} | {slashed(r['backend_samples_all_rounds'])} | "
                   f"{slashed(r['misses_all_rounds'])} | {slashed(r['read_waits_all_rounds'])} | {where(r)} |")
    r = run[0]
    out.append(f"\n{r['files']:,} files, {r['ranks']} ranks, two readers each; the median round of each.")
    return "\n".join(out)


def scale(rows: list[dict]) -> str:
    run = last_run(rows, "bench_scale")
    if not run:
        return not_measured("bench_scale")
    out = ["| fusefs | samples | samples/s | daemon CPU us a sample (quarters) | peak RSS against fresh + "
           "orders + budget | fetched | commit, date |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in run:
        floor = r["rss_fresh_mb"] + r["order_mb"] + r["budget_mb"]
        quarters = " / ".join(f"{q['cpu_us_per_sample']:.0f}" for q in r["quarters"])
        out.append(f"| {r['version']} | {r['samples']:,} | {r['samples_per_s']:,} | {r['daemon_cpu_us_per_sample']:.0f} "
                   f"({quarters}) | {r['rss_peak_mb']:,.0f} MB "
                   f"against {floor:,.0f} ({100 * (r['rss_peak_mb'] / floor - 1):+.1f}%) | {r['backend_samples']:,} "
                   f"| {where(r)} |")
    return "\n".join(out)


def scale_drop(rows: list[dict]) -> str:
    """bench_scale.py --drop-pages: the page cache dropped before the third quarter."""
    run = last_run(rows, "bench_scale_drop")
    if not run:
        return not_measured("bench_scale")
    out = ["| fusefs | samples | samples/s | misses a quarter (page cache dropped before the third) "
           "| daemon CPU us a sample (quarters) | fetched | commit, date |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in run:
        misses = " / ".join(f"{q['misses']:,}" for q in r["quarters"])
        quarters = " / ".join(f"{q['cpu_us_per_sample']:.0f}" for q in r["quarters"])
        out.append(f"| {r['version']} | {r['samples']:,} | {r['samples_per_s']:,} | {misses} "
                   f"| {r['daemon_cpu_us_per_sample']:.0f} ({quarters}) | {r['backend_samples']:,} | {where(r)} |")
    return "\n".join(out)


def scale_epochs(rows: list[dict]) -> str:
    """bench_scale.py --epochs N: a row per version and epoch."""
    run = last_run(rows, "bench_scale_epochs")
    if not run:
        return not_measured("bench_scale")
    out = ["| fusefs | samples | epoch | samples/s | daemon CPU us a sample | misses | fetched "
           "| RSS at its end | peak RSS so far against fresh + orders + budget | commit, date |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in run:
        floor = r["rss_fresh_mb"] + r["order_mb"] + r["budget_mb"]
        for i, e in enumerate(r["epochs"]):
            out.append(f"| {r['version']} | {r['samples']:,} | {i + 1} | {e['samples_per_s']:,} "
                       f"| {e['daemon_cpu_us_per_sample']:.0f} | {e['misses']:,} | {e['backend_samples']:,} "
                       f"| {e['rss_mb']:,.0f} MB | {e['rss_peak_mb']:,.0f} MB against {floor:,.0f} "
                       f"({100 * (e['rss_peak_mb'] / floor - 1):+.1f}%) | {where(r)} |")
    return "\n".join(out)


def uring(rows: list[dict]) -> str:
    run = last_run(rows, "bench_uring")
    if not run:
        return not_measured("bench_uring")
    by = {(r["transport"], r["epoch"]): r for r in run}
    out = ["| epoch | /dev/fuse: daemon CPU us a sample | io_uring | /dev/fuse: samples/s | io_uring "
           "| kernel | commit, date |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for epoch in dict.fromkeys(r["epoch"] for r in run):
        dev, ring = by.get(("dev", epoch)), by.get(("uring", epoch))
        cpu = lambda r: f"{r['daemon_cpu_us_per_sample']:.1f}" if r else "-"
        rate = lambda r: f"{r['samples_per_s']:,}" if r else "-"
        r = dev or ring
        out.append(f"| {epoch} | {cpu(dev)} | {cpu(ring)} | {rate(dev)} | {rate(ring)} | {r['kernel']} "
                   f"| {where(r)} |")
    return "\n".join(out)


def wake(rows: list[dict]) -> str:
    """The loop thread's CPU per wake by spacing: trio's against a bare epoll loop."""
    run = last_run(rows, "wake_cost")
    if not run:
        return not_measured("wake_cost")
    by = {(r["loop"], r["spacing_ms"]): r for r in run}
    out = ["| wakes apart | trio: loop CPU us a wake (rounds) | bare epoll loop (rounds) | commit, date |",
           "| --- | --- | --- | --- |"]
    for spacing in dict.fromkeys(r["spacing_ms"] for r in run):
        t, e = by[("trio", spacing)], by[("epoll", spacing)]
        out.append(f"| {spacing:g} ms | {t['cpu_us_per_wake']:.0f} ({slashed(t['rounds'])}) "
                   f"| {e['cpu_us_per_wake']:.0f} ({slashed(e['rounds'])}) | {where(t)} |")
    return "\n".join(out)


def gpu_hotpath(rows: list[dict]) -> str:
    """bench_hotpath on the node: by regime, each version's median round and its rounds, and
    a version's CPU per sample against the first's round by round (run side by side)."""
    run = last_run(rows, "bench_hotpath")
    if not run:
        return not_measured("bench_hotpath")
    versions = list(dict.fromkeys(r.get("version", r["commit"]) for r in run))
    by = {(r["regime"], r.get("version", r["commit"])): r for r in run}
    head = " | ".join(f"`{v}`: us a sample (rounds)" + (f" | against `{versions[0]}`" if i else "")
                      for i, v in enumerate(versions))
    out = [f"| regime | {head} | samples/s | commit, date |",
           "| --- |" + " --- |" * (2 * len(versions) - 1) + " --- | --- |"]
    for regime in dict.fromkeys(r["regime"] for r in run):
        cells, rates = [], []
        for i, v in enumerate(versions):
            r = by.get((regime, v))
            cells.append(f"{r['daemon_cpu_us_per_sample']:.1f} ({slashed(r['cpu_us_per_sample_all_rounds'], '{:.1f}')})"
                         if r else "-")
            if i:
                cells.append(slashed(r["cpu_ratio_by_round"], "{:.2f}") if r and "cpu_ratio_by_round" in r else "-")
            rates.append(f"{r['samples_per_s']:,.0f}" if r and "samples_per_s" in r else "-")
        first = next(r for r in run if r["regime"] == regime)
        out.append(f"| `{regime}` | {' | '.join(cells)} | {' / '.join(rates)} | {where(first)} |")
    return "\n".join(out)


def pages(rows: list[dict]) -> str:
    """A sample's read into fresh memory against memory already present (page_cost.py)."""
    run = last_run(rows, "page_cost")
    if not run:
        return not_measured("page_cost")
    out = ["| memory read into | CPU us a sample (rounds) | minor faults a sample | sample | commit, date |",
           "| --- | --- | --- | --- | --- |"]
    for r in run:
        out.append(f"| {r['memory']} | {r['cpu_us_per_sample']:.1f} ({slashed(r['rounds'], '{:.1f}')}) "
                   f"| {r['minor_faults_per_sample']:.1f} | {r['sample_bytes'] >> 10} KB x {r['samples']:,} "
                   f"| {where(r)} |")
    return "\n".join(out)


def fetch_loop(rows: list[dict]) -> str:
    """The loop's CPU per fetched sample in-process, and its tasks' shares (fetch_cost.py)."""
    run = last_run(rows, "fetch_cost")
    if not run:
        return not_measured("fetch_cost")
    kinds = ("deliveries", "read-ahead", "fetches", "events", "loop reads", "scheduler")
    out = ["| cache | loop CPU us a sample (passes) | reads on the loop | "
           + " | ".join(kinds) + " | samples | commit, date |",
           "| --- | --- | --- | " + " | ".join("---" for _ in kinds) + " | --- | --- |"]
    for r in run:
        shares = r["task_shares"]
        told = "" if r.get("order", True) else ", no order"
        out.append(f"| {r['cache_share']:.0%} of the set{told} | {r['loop_cpu_us_per_sample']:.1f} "
                   f"({slashed(r['passes_us_per_sample'], '{:.1f}')}) | {slashed(r['loop_reads'])} | "
                   + " | ".join(f"{shares[k] + (shares['other'] if k == 'scheduler' else 0):.0%}" for k in kinds)
                   + f" | {r['sample_bytes'] >> 10} KB x {r['samples']:,} | {where(r)} |")
    return "\n".join(out)


def hotpath(rows: list[dict]) -> str:
    """Daemon CPU us per sample by regime (the median round): fusefs (loop / other threads),
    the same with --no-fast-path, and the minimal daemons' nearest epochs."""
    run = last_run(rows, "bench_hotpath")
    if not run:
        return not_measured("bench_hotpath")
    plain = [r for r in run if " " not in r.get("version", "") and not r["regime"].startswith("minimal")]
    slow = {r["regime"]: r for r in run if "--no-fast-path" in r.get("version", "")}
    peers = {r["regime"]: r for r in run if r["regime"].startswith("minimal")}
    peer_of = {"kernel": "kernel", "kernel_paced": "paced", "daemon": "read"}
    cpu = lambda r: f"{r['daemon_cpu_us_per_sample']:.1f}" if r else ""
    out = ["| regime | fusefs (loop / other threads) | its user CPU (loop + threads) | its rounds | "
           "`--no-fast-path` | minimal pyfuse3 daemon | minimal C daemon | samples | commit, date |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in plain:
        name = r["regime"]
        split, user = "", "-"
        if "loop_cpu_us_per_sample" in r:
            split = f" ({sum(r['loop_cpu_us_per_sample'])} / {sum(r['threads_cpu_us_per_sample'])})"
            user = f"{r['loop_cpu_us_per_sample'][0] + r['threads_cpu_us_per_sample'][0]}"
        peer = peer_of.get(name)
        py = peers.get(f"minimal_{peer}") if peer else None
        c = peers.get(f"minimal_c_{peer}") if peer else None
        rounds = slashed(r["cpu_us_per_sample_all_rounds"], "{:.1f}")
        out.append(f"| `{name}` | {cpu(r)}{split} | {user} | {rounds} | {cpu(slow.get(name))} | {cpu(py)} "
                   f"| {cpu(c)} | {r['samples']:,} | {where(r)} |")
    return "\n".join(out)


def unbiased(rows: list[dict]) -> str:
    run = [r for r in last_run(rows, "bench_unbiased") if r["part"] == "summary"]
    if not run:
        return not_measured("bench_unbiased")
    what = {"full": "full epochs (HintedSampler)", "importance": "by rank, keep 0.7",
            "unbiased": "unbiased, prune 0.5"}
    out = ["| epochs | final test accuracy, mean ± sd (min-max) | vs. full | samples trained | "
           "training time | backend bytes | commit, date |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in run:
        out.append(f"| {what.get(r['mode'], r['mode'])} | {r['acc_mean']:.2f}% ± {r['acc_std']:.2f} "
                   f"({r['acc_min']:.2f}-{r['acc_max']:.2f}) | {r['acc_vs_full']:+.2f} pt | {r['trained']:,} "
                   f"| {r['seconds']:,.0f} s ({r['time_vs_full']:.2f}x) | {r['backend_bytes'] / 1e6:,.0f} MB "
                   f"({r['bytes_vs_full']:.2f}x) | {where(r)} |")
    return "\n".join(out)


def pack_table(rows: list[dict]) -> str:
    """bench_pack's last run: each version's rounds (seconds, CPU a file, peak memory)."""
    run = last_run(rows, "bench_pack")
    if not run:
        return not_measured("bench_pack")
    by_version: dict[str, list] = {}
    for r in run:
        by_version.setdefault(r["version"], []).append(r)
    out = ["| version | files | seconds (rounds) | files/s | CPU us a file | peak RSS | index | commit, date |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for version, rs in by_version.items():
        best = min(rs, key=lambda r: r["seconds"])
        out.append(f"| {version} | {best['files']:,} | {slashed([r['seconds'] for r in rs], '{:.1f}')} "
                   f"| {best['files_per_s']:,} | {slashed([r['cpu_us_per_file'] for r in rs], '{:.1f}')} "
                   f"| {best['peak_rss_mb']:,.0f} MB | {best['index_mb']:.1f} MB | {where(best)} |")
    return "\n".join(out)


TABLES = {"mount": (mount, "bench_mount.jsonl"), "pack": (pack_table, "bench_pack.jsonl"),
          "pack-inplace": (pack_table, "bench_pack_inplace.jsonl"), "unbiased": (unbiased, "bench_unbiased.jsonl"), "memory": (memory, "bench_memory.jsonl"), "hammer": (hammer, "bench_hammer.jsonl"),
          "commit": (commit, "bench_commit.jsonl"), "scale": (scale, "bench_scale.jsonl"), "scale-drop": (scale_drop, "bench_scale.jsonl"),
          "scale-epochs": (scale_epochs, "bench_scale.jsonl"), "uring": (uring, "bench_uring.jsonl"), "order": (order, "bench_order.jsonl"),
          "inplace": (order, "bench_order_inplace.jsonl"),
          "order-run": (order, "bench_order_run.jsonl"), "autohint": (autohint, "bench_autohint.jsonl"), "ranks": (ranks, "bench_ranks.jsonl"),
          "clients": (clients, "bench_clients.jsonl"), "faults": (faults, "faults.jsonl"),
          "soak": (soak, "soak.jsonl"), "gpu-node": (gpu_node, "gpu-node.jsonl"), "gpu-hybrid": (gpu_hybrid, "gpu-node.jsonl"),
          "gpu-swap": (gpu_swap, "gpu-node.jsonl"), "gpu-importance": (gpu_importance, "gpu-node.jsonl"),
          "gpu-pages": (pages, "gpu-node.jsonl"), "gpu-hotpath": (gpu_hotpath, "gpu-node.jsonl"),
          "gpu-scale-epochs": (scale_epochs, "gpu-node.jsonl"),
          "hotpath": (hotpath, "bench_hotpath.jsonl", HOTPATH),
          "wake": (wake, "wake_cost.jsonl", HOTPATH), "pages": (pages, "page_cost.jsonl", HOTPATH),
          "fetch-loop": (fetch_loop, "fetch_cost.jsonl", HOTPATH)}


def render(doc: str, path: str = DOC) -> tuple[str, list[str]]:
    """doc (the file at path) with every generated table rewritten; the names of those that
    changed."""
    changed = []
    for name, (make, results, *where_) in TABLES.items():
        if (where_[0] if where_ else DOC) != path:
            continue
        pattern = re.compile(rf"(<!-- generated: {name} -->\n)(.*?)(<!-- end generated -->)", re.S)
        if not pattern.search(doc):
            raise SystemExit(f"tables.py: {path} has no '<!-- generated: {name} -->' section")
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
    stale = 0
    for path in (DOC, HOTPATH):
        with open(path) as f:
            doc = f.read()
        new, changed = render(doc, path)
        if a.check:
            if changed:
                print(f"tables.py: stale in {path}: {', '.join(changed)} (run scripts/bench/tables.py)")
                stale = 1
            continue
        if changed:
            with open(path, "w") as f:
                f.write(new)
        print(f"tables.py: {', '.join(changed) or 'nothing'} rewritten in {path}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
