#!/usr/bin/python3
"""Train the small CNN on an ImageFolder through a fusefs mount, plain (one replica) or with
trainer.HybridTrainer (CPU replica + accelerator replica; two CPU replicas without one);
print one JSON line per epoch: test accuracy, samples/s, R, merges, snapshots written.

Runs under Debian's /usr/bin/python3 (torch 1.13 + torchvision) with the repository on
PYTHONPATH. Same seeds for both modes: the same initial weights and batch order.

usage: train_hybrid.py ROOT TEST --mode plain|hybrid|accel [--epochs 15] [--batch 64]
                       [--snapshots DIR] [--seed 0]
  accel: plain training on the accelerator (cuda when torch sees one), for samples/s
"""
import argparse
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_importance import accuracy, small_cnn  # noqa: E402

from trainer import HybridTrainer  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("test")
    p.add_argument("--mode", choices=("plain", "hybrid", "accel"), required=True)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--snapshots")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    tf = transforms.Compose([transforms.Grayscale(1), transforms.Resize((32, 32)), transforms.ToTensor()])
    train = datasets.ImageFolder(a.root, transform=tf)
    test = DataLoader(datasets.ImageFolder(a.test, transform=tf), batch_size=256)
    g = torch.Generator().manual_seed(a.seed)
    loader = DataLoader(train, batch_size=a.batch, shuffle=True, generator=g, num_workers=a.workers,
                        persistent_workers=True)

    def make_model():
        torch.manual_seed(a.seed)
        return small_cnn(len(train.classes))

    def make_opt(params):
        return torch.optim.SGD(params, lr=a.lr, momentum=0.9)

    criterion = nn.CrossEntropyLoss()
    if a.mode == "hybrid":
        ht = HybridTrainer(make_model, make_opt, criterion, loader, snapshot_dir=a.snapshots)
        ht.calibrate()
        model = ht.model
    else:
        dev = torch.device("cuda" if a.mode == "accel" and torch.cuda.is_available() else "cpu")
        model = make_model().to(dev)
        opt = make_opt(model.parameters())
    for epoch in range(a.epochs):
        if a.mode == "hybrid":
            row = ht.train_epoch()
            row.update(tc=ht.tc, tg=ht.tg, merges=ht.merges,
                       snapshots_written=ht.writer.written if ht.writer else 0)
        else:
            t0, n = time.perf_counter(), 0
            for x, y in loader:
                x, y = x.to(dev), y.to(dev)
                opt.zero_grad()
                criterion(model(x), y).backward()
                opt.step()
                n += len(y)
            dt = time.perf_counter() - t0
            row = {"samples": n, "seconds": dt, "samples_per_s": n / dt}
        cpu_model = model if a.mode == "hybrid" else model.to("cpu")
        row.update(epoch=epoch, mode=a.mode, test_acc=round(accuracy(cpu_model, test), 4),
                   device=str(getattr(ht, "accel", None) if a.mode == "hybrid" else dev))
        if a.mode != "hybrid":
            model.to(dev)
        print(json.dumps(row), flush=True)
    if a.mode == "hybrid":
        ht.close()


if __name__ == "__main__":
    main()
