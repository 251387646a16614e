"""Epoch orders besides the full shuffle: chunk-block orders and data echoing (pure numpy).

Chunk-block order (the chunk as the shuffle unit, generalised). Shuffle the chunks; cut the
shuffled list into groups of G consecutive chunks; shuffle the samples within each group.
  G = 1      pure chunk order: the samples of one chunk are read together (in random order
             inside it), so the filesystem fetches each chunk in a few large sequential
             reads and its read-ahead needs to hold about one chunk.
  G large    approaches the full shuffle (G >= the number of chunks is one).
The trade-off: a batch draws from at most G chunks' worth of samples, so with an
ImageFolder packed class by class a small G gives batches of one or two classes, which
hurts SGD; a G that spans every class in a group (G times the samples per chunk well above
the samples per class) keeps batches mixed while reads stay chunk-sized. Measure it:
scripts/bench_orders.py prints samples/s and test accuracy for G = 1, 4, 16.

Data echoing (half from the backend, half from the cache). Each epoch trains on one half
of the data set fresh (the two halves of a permutation drawn every second epoch, so each
sample is fresh once per two epochs) and repeats every fresh sample once, soon after:
with h = batch_size / 2 and f_k the k-th block of h fresh samples, the order is
    f0, f1, echo(f0), f2, echo(f1), ..., f_last, echo(f_(last-1)), echo(f_last)
so each batch past the first is h fresh samples and h samples read one or two batches
before (at most 4h positions back), still in the cache (the filesystem keeps a sample until its last occurrence in the order,
then drops it). Backend bytes per trained sample halve; an echoed sample is a repeat, so
use it with random augmentation, as in Choi et al., "Faster Neural Network Training with
Data Echoing" (2019).
"""
from __future__ import annotations

import numpy as np


def chunk_block_order(chunk_of: np.ndarray, group: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of range(len(chunk_of)) in chunk-block order (see above); chunk_of[i]
    is the chunk that holds index i."""
    if group < 1:
        raise ValueError(f"group must be at least 1, got {group}")
    chunk_of = np.asarray(chunk_of, dtype=np.int64)
    chunks = np.unique(chunk_of)
    rank = np.empty(int(chunks.max()) + 1 if len(chunks) else 0, dtype=np.int64)
    rank[rng.permutation(chunks)] = np.arange(len(chunks))
    block = rank[chunk_of] // group  # the group each index falls in
    # sort by (block, random key): groups in shuffled order, samples shuffled inside
    return np.lexsort((rng.random(len(chunk_of)), block))


def echo_fresh_count(n: int, epoch: int) -> int:
    """How many indices an echo epoch reads fresh (the first half takes the odd one)."""
    return (n + 1) // 2 if epoch % 2 == 0 else n // 2


def echo_fresh(n: int, epoch: int, seed: int) -> np.ndarray:
    """The indices read fresh in an echo epoch: one half of a permutation drawn every
    second epoch (epoch 2k takes the first half, 2k+1 the second)."""
    perm = np.random.default_rng((seed, epoch // 2)).permutation(n)
    half = echo_fresh_count(n, 0)
    return perm[:half] if epoch % 2 == 0 else perm[half:]


def echo_order(n: int, batch_size: int, epoch: int, seed: int) -> np.ndarray:
    """The echo order of an epoch (see above): each fresh index twice, the second time at
    most 4 * (batch_size // 2) positions after the first."""
    fresh = echo_fresh(n, epoch, seed)
    rng = np.random.default_rng((seed, epoch, 1))
    h = max(1, batch_size // 2)
    blocks = [fresh[i:i + h] for i in range(0, len(fresh), h)]
    out = []
    for b, blk in enumerate(blocks):
        out.append(blk)
        if b:
            out.append(rng.permutation(blocks[b - 1]))
    if blocks:
        out.append(rng.permutation(blocks[-1]))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
