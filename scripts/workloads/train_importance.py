#!/usr/bin/python3
"""Train a small CNN on an ImageFolder (through a fusefs mount), with all the data each
epoch or with trainer.ImportanceSampler; print one JSON line per epoch.

Runs under Debian's /usr/bin/python3 (torch 1.13, torchvision, scikit-learn) with the
repository on PYTHONPATH: torchvision's ImageFolder + DataLoader read the mount unchanged.
Per epoch: samples trained, samples re-evaluated, seconds (re-evaluation included), the CPU
time of all cores used and left idle meanwhile (/proc/stat), test accuracy (TEST is an
ImageFolder of the held-out images), and from the mount's statistics the backend bytes,
samples, reads and requests of the epoch, the samples fetched from each storage node, the
samples whose pages the kernel had dropped since they were pushed (kernel_dropped: each is
fetched again when read), and the share of reads served from the cache; the seconds from the start of the training loop
to its first batch (first_batch_s: how long the loader takes to start), and the mount's
counters over the re-evaluation alone (reeval_served: hits, read_waits, misses,
backend_samples, backend_reads). --drop-caches empties the whole page cache
before each epoch (the backend's, and the
program code's too); --evict PATH (repeatable) only evicts the files under PATH from it
(posix_fadvise DONTNEED): the backend's copy of the data set, the way a remote one is not
in this machine's page cache. ROOT may also be a plain folder (no mount): the same
training without hints or mount statistics, to time the training side alone.

usage: train_importance.py ROOT TEST --mode full|importance|unbiased [--epochs 15] [--keep 0.7] [--prune 0.5]
                           [--warmup 3] [--seed 0] [--workers 2] [--batch 64] [--drop-caches]
                           [--model small|resnet18] [--device auto|cpu|cuda]
                           [--evict PATH ...]
                           [--order random|chunks|echo] [--group G] [--reuse-mb 512]

--order (with --mode full) trains on HintedSampler's order modes: chunk-block orders with
G chunks per shuffle group, or data echoing (trainer/orders.py). --reuse-mb (with
--mode importance): memory for the re-evaluation's decoded batches, which training then
uses instead of reading those samples again (0: read them again). --model resnet18 trains
ResNet-18 with the CIFAR stem (3 channels, train_hybrid.py's) instead of the small CNN;
--device auto trains on the GPU where torch sees one.
"""
import argparse
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from machine import cpu_times
from nets import accuracy, resnet18_cifar, small_cnn
from trainer import HintedSampler, ImportanceSampler, LossTracker, WithIndex
from trainer.hints import find_mount, mount_stats


def evict(paths: list[str]) -> None:
    """Drop the files under paths (folders or files) from the page cache (written back
    first: DONTNEED leaves dirty pages, such as a data set just packed, in place)."""
    if paths:
        os.sync()
    for top in paths:
        files = [top] if os.path.isfile(top) else [os.path.join(folder, name)
                                                   for folder, _, names in os.walk(top) for name in names]
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def stats_of(root: str) -> dict:
    """The mount's statistics ({} for a dataset off any mount)."""
    try:
        return mount_stats(find_mount(root))
    except FileNotFoundError:
        return {}


def train_step(model, opt, criterion, x, y, idx, tracker, weights=None):
    """One step: each sample's loss recorded, their mean weighted by weights(idx) (the
    unbiased sampler's: 1 / (1 - prune) for a kept well-learned sample) when given, so that
    the epoch's gradient is the full epoch's in expectation."""
    losses = criterion(model(x), y)
    tracker.record(idx, losses)
    opt.zero_grad()
    (losses * weights(idx).to(losses.device) if weights is not None else losses).mean().backward()
    opt.step()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("test")
    p.add_argument("--mode", choices=("full", "importance", "unbiased"), required=True,
                   help="importance: ImportanceSampler's rank mode (--keep); unbiased: its "
                        "InfoBatch mode (--prune, weighted losses, annealed last epochs)")
    p.add_argument("--prune", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--keep", type=float, default=0.7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--drop-caches", action="store_true")
    p.add_argument("--evict", action="append", default=[], metavar="PATH")
    p.add_argument("--order", default="random", choices=("random", "chunks", "echo"))
    p.add_argument("--group", type=int, default=1)
    p.add_argument("--reuse-mb", type=float, default=512)
    p.add_argument("--model", choices=("small", "resnet18"), default="small")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    a = p.parse_args()
    dev = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
                       else "cpu")

    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    channels = 1 if a.model == "small" else 3
    tf = transforms.Compose([transforms.Grayscale(channels), transforms.Resize((32, 32)), transforms.ToTensor()])
    train = datasets.ImageFolder(a.root, transform=tf)
    test = DataLoader(datasets.ImageFolder(a.test, transform=tf), batch_size=256)
    if a.model == "small":
        model = small_cnn(len(train.classes))
    else:
        model = resnet18_cifar(len(train.classes))
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs)
    criterion = nn.CrossEntropyLoss(reduction="none")
    tracker = LossTracker(len(train), window=a.warmup)
    if a.mode == "full":  # off any mount (a plain folder) it only shuffles, as ImportanceSampler
        sampler = HintedSampler(train, seed=a.seed, mode=a.order, group=a.group, batch_size=a.batch,
                                write=bool(stats_of(a.root)))
    else:
        sampler = ImportanceSampler(train, tracker, keep=a.keep, warmup=a.warmup, seed=a.seed,
                                    reuse_bytes=int(a.reuse_mb * 2**20),
                                    mode="unbiased" if a.mode == "unbiased" else "rank",
                                    prune=a.prune, epochs=a.epochs)
    indexed = WithIndex(train)
    loader = DataLoader(indexed, batch_size=a.batch, sampler=sampler, num_workers=a.workers,
                        persistent_workers=a.workers > 0)
    sampled = a.mode != "full"  # (importance or unbiased: re-evaluation, held batches)
    if sampled:  # one loader for every epoch's re-evaluation: no new workers
        # small batches: a set of a few hundred samples in batches of 64 leaves one worker
        # idle for up to a batch at the end (the held ones are re-batched for training)
        reloader = DataLoader(indexed, batch_size=16, sampler=sampler.reevaluation_sampler,
                              num_workers=a.workers, persistent_workers=a.workers > 0)
    for epoch in range(a.epochs):
        if a.drop_caches:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        evict(a.evict)
        s0 = stats_of(a.root)
        c0 = cpu_times()
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        n_re = 0
        t_split = time.perf_counter()
        if sampled:
            n_re = sampler.reevaluate(model, reloader, criterion, device=dev)
        t_re = time.perf_counter()
        s_mid = stats_of(a.root) if n_re else {}
        trained = 0
        t_first = None
        for x, y, idx in (sampler.batches(loader) if sampled else loader):
            if t_first is None:
                t_first = time.perf_counter()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            train_step(model, opt, criterion, x, y, idx, tracker,
                       sampler.weights if a.mode == "unbiased" else None)
            trained += len(idx)
        tracker.end_epoch()
        sched.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        c1 = cpu_times()
        s1 = stats_of(a.root)
        row = {"epoch": epoch, "mode": a.mode, "order": a.order, "trained": trained, "reevaluated": n_re,
               "seconds": round(seconds, 3), "split_s": round(t_split - t0, 3),
               "reeval_s": round(t_re - t_split, 3), "samples_per_s": round((trained + n_re) / seconds, 1),
               "cpu_busy_s": round(c1[0] - c0[0], 2), "cpu_idle_s": round(c1[1] - c0[1], 2),
               "test_acc": round(accuracy(model, test), 4)}
        if s1:
            served = lambda s: s["hits"] + s["read_waits"] + s["misses"]
            row.update(backend_bytes=s1["backend_bytes"] - s0["backend_bytes"],
                       backend_samples=s1["backend_samples"] - s0["backend_samples"],
                       backend_reads=s1["backend_reads"] - s0["backend_reads"],
                       backend_requests=s1["backend_requests"] - s0["backend_requests"],
                       # pushed samples whose pages the kernel had dropped when a read came
                       kernel_dropped=s1["kernel_dropped"] - s0["kernel_dropped"],
                       node_samples=[n1["samples"] - n0["samples"] for n0, n1
                                     in zip(s0["nodes"].values(), s1["nodes"].values())],
                       hit_ratio=round((s1["hits"] - s0["hits"]) / max(1, served(s1) - served(s0)), 4),
                       pinned_samples=s1.get("pinned_samples", 0))
        if s_mid:
            row["reeval_served"] = {k: s_mid[k] - s0[k] for k in ("hits", "read_waits", "misses", "backend_samples", "backend_reads")}
        row["first_batch_s"] = None if t_first is None else round(t_first - t_re, 3)
        if sampled:
            row["fluctuating"] = int(sampler.fluctuating.sum())
            row["reused"] = sampler.reused
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
