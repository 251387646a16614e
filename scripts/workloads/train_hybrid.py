#!/usr/bin/python3
"""Train a model on an ImageFolder through a fusefs mount: on the accelerator alone, on the
CPU alone, or with trainer.HybridTrainer (both; two CPU replicas without an accelerator);
print one JSON line per epoch: test accuracy, samples/s, samples trained by each replica.

Runs under Debian's /usr/bin/python3 (torch 1.13 + torchvision) with the repository on
PYTHONPATH. Same seeds for every mode: the same initial weights and batch order.

usage: train_hybrid.py ROOT TEST --mode accel|cpu|hybrid [--model small|resnet18]
                       [--epochs 15] [--batch 64] [--workers 1] [--snapshots DIR] [--seed 0]
"""
import argparse
import json
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from nets import accuracy, resnet18_cifar, small_cnn

from trainer import HybridTrainer
from trainer.accel.hybrid import default_cpu_threads


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("test")
    p.add_argument("--mode", choices=("accel", "cpu", "hybrid"), required=True)
    p.add_argument("--model", choices=("small", "resnet18"), default="small")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--snapshots")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    channels = 1 if a.model == "small" else 3
    tf = transforms.Compose([transforms.Grayscale(channels), transforms.Resize((32, 32)),
                             transforms.ToTensor()])
    train = datasets.ImageFolder(a.root, transform=tf)
    test = DataLoader(datasets.ImageFolder(a.test, transform=tf), batch_size=256)
    g = torch.Generator().manual_seed(a.seed)
    loader = DataLoader(train, batch_size=a.batch, shuffle=True, generator=g, num_workers=a.workers,
                        persistent_workers=a.workers > 0)
    threads = default_cpu_threads(loader)  # the same setting in every mode
    torch.set_num_threads(threads)
    build = small_cnn if a.model == "small" else resnet18_cifar

    def make_model():
        torch.manual_seed(a.seed)
        return build(len(train.classes))

    def make_opt(params):
        return torch.optim.SGD(params, lr=a.lr, momentum=0.9)

    criterion = nn.CrossEntropyLoss()
    accel = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.mode == "hybrid":
        ht = HybridTrainer(make_model, make_opt, criterion, loader, accel=accel,
                           snapshot_dir=a.snapshots, cpu_threads=threads)
        ht.calibrate()
    else:
        dev = accel if a.mode == "accel" else torch.device("cpu")
        model = make_model().to(dev)
        opt = make_opt(model.parameters())
    for epoch in range(a.epochs):
        if a.mode == "hybrid":
            row = ht.train_epoch()
            row.update(tc=ht.tc, tg=ht.tg, snapshots_written=ht.writer.written if ht.writer else 0)
            model = ht.model
        else:
            t0, n = time.perf_counter(), 0
            for x, y in loader:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                opt.zero_grad()
                criterion(model(x), y).backward()
                opt.step()
                n += len(y)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dt = time.perf_counter() - t0
            row = {"samples": n, "seconds": dt, "samples_per_s": n / dt}
        row.update(epoch=epoch, mode=a.mode, model=a.model, test_acc=round(accuracy(model, test), 4),
                   device=str(accel if a.mode != "cpu" else "cpu"), threads=threads,
                   workers=a.workers)
        print(json.dumps(row), flush=True)
    if a.mode == "hybrid":
        ht.close()


if __name__ == "__main__":
    main()
