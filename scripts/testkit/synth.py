"""Synthetic ImageFolder datasets of real JPEG files, for the demo, tests and benchmarks.

Each image is random noise, encoded by Pillow; the side length is drawn per image so that
file sizes vary around the requested mean (noise compresses poorly, so size follows pixel
count). Deterministic for a given seed.

With `learnable=True` the label can be learned: each image blends its class's grey level
with the noise, at a noise share drawn per image between 0.5 and 0.97, so most images are
easy and some are nearly pure noise (hard, their loss keeps moving), as in real data.
"""
from __future__ import annotations

import io
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Measured with Pillow at quality 90: bytes per pixel of the noise images below.
_BYTES_PER_PIXEL = 0.91


def jpeg_bytes(rng: np.random.Generator, side: int, quality: int = 90,
               level: float | None = None) -> bytes:
    """A JPEG of noise; with level (0..255), the noise blended with that grey level."""
    from PIL import Image
    noise = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    if level is not None:
        share = rng.uniform(0.5, 0.97)
        noise = (share * noise + (1 - share) * level).astype(np.uint8)
    img = Image.fromarray(noise)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def make_imagefolder(root: str, n_files: int, n_classes: int = 10, mean_bytes: int = 110_000,
                     seed: int = 0, workers: int = 4, progress: bool = False,
                     learnable: bool = False) -> dict:
    """Write n_files JPEGs in n_classes class folders under root; return a summary."""
    from tqdm import tqdm

    side = int((mean_bytes / _BYTES_PER_PIXEL) ** 0.5)
    sides = np.random.default_rng(seed).integers(int(side * 0.75), int(side * 1.2) + 1, n_files)
    for c in range(n_classes):
        os.makedirs(os.path.join(root, f"class_{c:04d}"), exist_ok=True)

    def one(i: int) -> int:
        c = i % n_classes
        path = os.path.join(root, f"class_{c:04d}", f"img_{i:08d}.jpg")
        level = 255 * c / max(1, n_classes - 1) if learnable else None
        data = jpeg_bytes(np.random.default_rng([seed, i]), int(sides[i]), level=level)
        with open(path, "wb") as f:
            f.write(data)
        return len(data)

    with ThreadPoolExecutor(workers) as pool:
        sizes = list(tqdm(pool.map(one, range(n_files)), total=n_files, desc="generate",
                          unit="file", disable=not progress))
    return {"files": n_files, "classes": n_classes, "bytes": int(sum(sizes)),
            "mean_bytes": float(np.mean(sizes)) if sizes else 0.0}


def make_digits(root: str, seed: int = 0) -> None:
    """load_digits as train/ and test/ ImageFolders of 32x32 PNGs (stratified 80/20)."""
    from PIL import Image
    from sklearn.datasets import load_digits  # (scikit-learn: the trainer extra)
    from sklearn.model_selection import train_test_split
    if os.path.isdir(os.path.join(root, "test")):
        return
    d = load_digits()
    idx = np.arange(len(d.target))
    tr, te = train_test_split(idx, test_size=0.2, random_state=seed, stratify=d.target)
    for split, ids in (("train", tr), ("test", te)):
        for i in ids:
            folder = os.path.join(root, split, str(d.target[i]))
            os.makedirs(folder, exist_ok=True)
            img = Image.fromarray((d.images[i] * (255 / 16)).astype(np.uint8), "L")
            img.resize((32, 32), Image.BILINEAR).save(os.path.join(folder, f"{i:04d}.png"))


def make_hardness(root: str, n_train: int, n_test: int, n_classes: int = 10, side: int = 32,
                  label_noise: float = 0.04, seed: int = 0) -> dict:
    """train/ and test/ ImageFolders of side x side grey PNGs that a small CNN can learn, with
    a spread of hardness as real sets have: each class has a smooth prototype pattern; an
    image is its class's prototype, shifted by up to 3 pixels, blended with another class's
    and with noise, both by a hardness drawn per image (Beta(0.7, 1.6): mostly easy, a long
    tail of hard ones); `label_noise` of the training images carry a wrong label (none of
    the test images). Deterministic for a seed; written once (an existing test/ is kept)."""
    from PIL import Image
    if os.path.isdir(os.path.join(root, "test")):
        return {"train": n_train, "test": n_test}
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side] / side
    protos = []
    for _ in range(n_classes):
        p = np.zeros((side, side))
        for _ in range(4):  # a few oriented waves and blobs: smooth, distinct per class
            fx, fy, ph = rng.uniform(-3, 3), rng.uniform(-3, 3), rng.uniform(0, 2 * np.pi)
            p += np.sin(2 * np.pi * (fx * xx + fy * yy) + ph)
            cx, cy, r = rng.uniform(0.2, 0.8, 2).tolist() + [rng.uniform(0.08, 0.2)]
            p += 2 * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))
        protos.append((p - p.mean()) / p.std())
    common = sum(protos) / n_classes  # (classes share much of their pattern: not too easy)
    protos = [(p - 0.8 * common) / (p - 0.8 * common).std() for p in protos]
    for split, n, noise in (("train", n_train, label_noise), ("test", n_test, 0.0)):
        labels = np.arange(n) % n_classes
        hard = rng.beta(0.7, 1.6, n)
        other = (labels + rng.integers(1, n_classes, n)) % n_classes
        shown = np.where(rng.random(n) < noise, rng.integers(0, n_classes, n), labels)
        for c in range(n_classes):
            os.makedirs(os.path.join(root, split, f"class{c:02d}"), exist_ok=True)
        for i in range(n):
            dx, dy = rng.integers(-3, 4, 2)
            x = np.roll(protos[labels[i]], (dy, dx), (0, 1))
            x = (1 - 0.6 * hard[i]) * x + 0.6 * hard[i] * protos[other[i]]
            x = x + rng.normal(0, 1.0 + 5.0 * hard[i], x.shape)
            img = np.clip(128 + 40 * x, 0, 255).astype(np.uint8)
            Image.fromarray(img, "L").save(os.path.join(root, split, f"class{shown[i]:02d}", f"{i:06d}.png"))
    return {"train": n_train, "test": n_test}


POOL_BYTES = 64 << 20  # the random bytes make_packed's samples are cut from


def imagenet_tree(n: int, classes: int, ext: str) -> tuple[bytes, list[str], dict, np.ndarray]:
    """An index's tree shaped like ImageNet's: n files in `classes` folders n%08d, named
    n%08d_%06d<ext>, class by class: (names, the class names, the index's tree arrays,
    files per class). The files' chunk, offset, size and checksum arrays are the caller's."""
    per = np.full(classes, n // classes)
    per[: n % classes] += 1
    first = np.concatenate([[0], np.cumsum(per)[:-1]])
    dir_names = [f"n{c:08d}".encode() for c in range(classes)]
    file_names = [f"n{c:08d}_{i:06d}{ext}".encode() for c in range(classes) for i in range(int(per[c]))]
    names = b"".join(dir_names) + b"".join(file_names)
    dlen = np.array([len(x) for x in dir_names], np.uint32)
    flen = np.array([len(x) for x in file_names], np.uint32)
    doff = np.concatenate([[0], np.cumsum(dlen)[:-1]]).astype(np.uint64)
    foff = (np.concatenate([[0], np.cumsum(flen, dtype=np.uint64)[:-1]]) + dlen.sum()).astype(np.uint64)
    arrays = {
        "file_name_off": foff, "file_name_len": flen,
        "file_dir": (np.repeat(np.arange(classes), per) + 1).astype(np.uint32),
        "label": np.repeat(np.arange(classes), per).astype(np.int32),
        "mtime_ns": np.full(n, 1_700_000_000 * 10**9, np.int64), "mode": np.full(n, 0o644, np.uint32),
        "dir_name_off": np.concatenate([[0], doff]).astype(np.uint64),
        "dir_name_len": np.concatenate([[0], dlen]).astype(np.uint32),
        "dir_parent": np.concatenate([[-1], np.zeros(classes)]).astype(np.int32),
        "dir_mtime_ns": np.zeros(classes + 1, np.int64), "dir_mode": np.full(classes + 1, 0o755, np.uint32),
        "dir_first_file": np.concatenate([[0], first]).astype(np.uint64),
        "dir_nfiles": np.concatenate([[0], per]).astype(np.uint64),
        "dir_first_sub": np.concatenate([[1], np.full(classes, classes + 1)]).astype(np.uint32),
        "dir_nsubs": np.concatenate([[classes], np.zeros(classes)]).astype(np.uint32),
    }
    return names, [d.decode() for d in dir_names], arrays, per


class PackedSet:
    """A packed dataset made by make_packed: where it is, and each sample's expected bytes."""

    def __init__(self, dst: str, n: int, classes: int, seed: int, sizes: np.ndarray, starts: np.ndarray):
        self.dst, self.n, self.classes, self.seed = dst, n, classes, seed
        self.sizes, self.starts = sizes, starts
        self._pool = None
        per = np.full(classes, n // classes)
        per[: n % classes] += 1
        self.first = np.concatenate([[0], np.cumsum(per)[:-1]])  # each class's first sample

    def sample(self, sid: int) -> bytes:
        """The bytes of sample sid (its id in the index: class by class, by name)."""
        if self._pool is None:
            self._pool = np.random.default_rng(self.seed).bytes(POOL_BYTES)
        return self._pool[int(self.starts[sid]):int(self.starts[sid]) + int(self.sizes[sid])]

    def path(self, sid: int) -> str:
        """Sample sid's path relative to the mount."""
        c = int(np.searchsorted(self.first, sid, side="right")) - 1
        return f"n{c:08d}/n{c:08d}_{sid - int(self.first[c]):06d}.bin"


def make_packed(dst: str, n: int, classes: int = 1000, size_range=(500, 3000),
                chunk_bytes: int = 64 << 20, seed: int = 0, progress: bool = False,
                reuse: bool = False) -> PackedSet:
    """A packed dataset of n samples written straight into dst (chunks and index), as
    `fusefs pack` would write an ImageFolder of n files of size_range bytes in `classes`
    folders (imagenet_tree, `.bin`), class by class into chunks of about chunk_bytes: what
    a tree of 1.28M files packs into, made in about 15 s instead of the tree's hours. Each
    sample is a slice of random bytes (PackedSet.sample gives them back). reuse: a dst that
    holds an index already is taken as made by the same call (nothing is written); anything
    else in dst is removed first."""
    import xxhash
    from tqdm import tqdm
    from fusefs import chunk as chunkfmt
    from fusefs.index import INDEX_NAME, ChunkInfo, Index
    from fusefs.pack import CHUNKS_DIR

    rng = np.random.default_rng([seed, 1])
    sizes = rng.integers(size_range[0], size_range[1] + 1, n).astype(np.uint64)
    starts = rng.integers(0, POOL_BYTES - size_range[1], n).astype(np.int64)
    if reuse and os.path.exists(os.path.join(dst, INDEX_NAME)):
        return PackedSet(dst, n, classes, seed, sizes, starts)
    shutil.rmtree(dst, ignore_errors=True)  # (what a make_packed cut short left: no index)
    pool = np.random.default_rng(seed).bytes(POOL_BYTES)
    names, class_names, arrays, _ = imagenet_tree(n, classes, ".bin")
    # chunks: runs of samples of about chunk_bytes, in id order (pack's default)
    ends = np.searchsorted(np.cumsum(sizes, dtype=np.int64),
                           np.arange(chunk_bytes, int(sizes.sum()) + chunk_bytes, chunk_bytes), side="right")
    bounds = np.unique(np.concatenate([[0], np.minimum(ends, n), [n]]))
    chunk_of = np.zeros(n, np.uint32)
    offsets = np.zeros(n, np.uint64)
    sums = np.zeros(n, np.uint64)
    os.makedirs(os.path.join(dst, CHUNKS_DIR), exist_ok=True)
    chunks = []
    with tqdm(total=n, desc="make_packed", unit="sample", disable=not progress) as bar:
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            parts = [pool[s:s + z] for s, z in zip(starts[a:b].tolist(), sizes[a:b].tolist())]
            sums[a:b] = [xxhash.xxh3_64_intdigest(p) for p in parts]
            head = chunkfmt.encode_header(sizes[a:b], arrays["label"][a:b], sums[a:b])
            offsets[a:b] = len(head) + np.concatenate([[0], np.cumsum(sizes[a:b], dtype=np.uint64)[:-1]])
            chunk_of[a:b] = k
            rel = f"{CHUNKS_DIR}/chunk-{k:06d}.fck"
            with open(os.path.join(dst, rel), "wb") as f:
                f.write(head)
                f.write(b"".join(parts))
            chunks.append(ChunkInfo(rel, 0, len(head) + int(sizes[a:b].sum()), int(b - a)))
            bar.update(int(b - a))
    arrays.update(chunk=chunk_of, offset=offsets, size=sizes, checksum=sums)
    Index(arrays, names, class_names, chunks, ["local"]).save(os.path.join(dst, INDEX_NAME))
    return PackedSet(dst, n, classes, seed, sizes, starts)
