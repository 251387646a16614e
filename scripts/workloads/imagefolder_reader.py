#!/usr/bin/python3
"""Read a tree with torchvision's ImageFolder + DataLoader, exactly as training code would.

Runs under Debian's /usr/bin/python3 (torch 1.13 + torchvision), a Python separate from
fusefs's own: the "unmodified training code" case. Prints one JSON line:
  classes, per-file sha256 (relative path -> hex), labels, and per epoch samples/s, the CPU
  seconds of the loader's processes (this one and its workers) and how busy the machine's
  cores were, and, with --decode, a checksum of the decoded tensors.

usage: imagefolder_reader.py ROOT [--workers N] [--batch B] [--epochs E] [--decode [--size S]] [--shuffle]
                              [--hinted [--mode random|chunks|echo] [--group G]] [--drop-caches]

--hinted uses trainer.HintedSampler (the two-line change; needs the repository on
PYTHONPATH); on a fusefs mount, the daemon's statistics after each epoch's first batch
and at its end are included; --mode picks HintedSampler's order mode (chunk-block orders
with --group G chunks per shuffle group, or data echoing). --drop-caches empties the page
cache before each epoch.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from machine import cpu_times  # (scripts/workloads/machine.py)


def raw_loader(path):
    with open(path, "rb") as f:
        return f.read()


def cpu_seconds():
    """CPU seconds of this process and of its children that ended (the DataLoader's workers,
    joined at each epoch's end)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def collate_digests(batch):
    return [(hashlib.sha256(data).hexdigest(), len(data), label) for data, label in batch]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--decode", action="store_true", help="decode images (default loader + ToTensor)")
    p.add_argument("--size", type=int, default=0,
                   help="with --decode: RandomResizedCrop(SIZE) and a random flip before ToTensor, "
                        "the ImageNet training transform (images of several sizes then batch)")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hinted", action="store_true", help="shuffle with trainer.HintedSampler")
    p.add_argument("--mode", default="random", choices=("random", "chunks", "echo"))
    p.add_argument("--group", type=int, default=1)
    p.add_argument("--drop-caches", action="store_true")
    p.add_argument("--no-digests", action="store_true", help="skip the byte-check passes")
    a = p.parse_args()
    stats_path = os.path.join(a.root, ".fusefs", "stats")

    torch.manual_seed(a.seed)
    if a.decode:
        steps = [transforms.RandomResizedCrop(a.size), transforms.RandomHorizontalFlip()] if a.size else []
        ds = datasets.ImageFolder(a.root, transform=transforms.Compose([*steps, transforms.ToTensor()]))
        collate = None
    else:
        ds = datasets.ImageFolder(a.root, loader=raw_loader, is_valid_file=lambda p: True)
        collate = collate_digests
    out = {"classes": ds.classes, "n": len(ds), "epochs": []}
    digests = {}
    sampler = None
    if a.hinted:
        from trainer import HintedSampler
        sampler = HintedSampler(ds, seed=a.seed, mode=a.mode, group=a.group, batch_size=a.batch)
    for epoch in range(a.epochs):
        if a.drop_caches:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        if sampler is not None:
            sampler.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=a.batch, shuffle=a.shuffle and sampler is None,
                            sampler=sampler, num_workers=a.workers, collate_fn=collate,
                            persistent_workers=False)
        t0, cpu0, (busy0, idle0) = time.perf_counter(), cpu_seconds(), cpu_times()
        count, nbytes, tensor_sum = 0, 0, 0.0
        first_stats = start_stats = None
        if os.path.exists(stats_path):
            with open(stats_path) as f:
                start_stats = json.load(f)
        for batch in loader:
            if first_stats is None and os.path.exists(stats_path):
                with open(stats_path) as f:
                    first_stats = json.load(f)
            if a.decode:
                images, labels = batch
                count += len(labels)
                tensor_sum += float(images.double().sum())
            else:
                for digest, size, label in batch:
                    count += 1
                    nbytes += size
        dt = time.perf_counter() - t0
        busy1, idle1 = cpu_times()
        ep = {"samples": count, "seconds": dt, "samples_per_s": count / dt, "bytes": nbytes,
              "cpu_s": cpu_seconds() - cpu0,
              "busy": min(1.0, (busy1 - busy0) / max(1e-9, busy1 - busy0 + idle1 - idle0)),
              "tensor_sum": tensor_sum}
        if first_stats is not None:
            with open(stats_path) as f:
                ep["stats_first_batch"], ep["stats_end"] = first_stats, json.load(f)
            ep["stats_start"] = start_stats
        out["epochs"].append(ep)
    if not a.decode and not a.no_digests:  # per-file digests, in ImageFolder's own order, for byte checks
        for path, label in ds.samples:
            digests[os.path.relpath(path, a.root)] = [hashlib.sha256(raw_loader(path)).hexdigest(), label]
        # and the digests as delivered through the DataLoader's worker processes:
        loader = DataLoader(ds, batch_size=a.batch, num_workers=a.workers, collate_fn=collate)
        delivered = [d for batch in loader for d, _, _ in batch]
        out["delivered"] = delivered
    out["files"] = digests
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
