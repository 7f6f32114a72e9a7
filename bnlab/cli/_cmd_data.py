"""``bnlab data``: list, check and download the datasets (bnlab.data)."""
from __future__ import annotations

import argparse
import sys

from bnlab.cli._common import print_json, print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="list, verify and download datasets (MNIST, Fashion-MNIST, CIFAR, digits)")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION")
    dsub.required = True

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--data-dir", default=None,
                       help="data directory (default: $BNLAB_DATA, else ~/.cache/bnlab)")
        q.add_argument("--json", action="store_true", help="machine-readable output")

    q = dsub.add_parser("list", help="each dataset, where it comes from, whether it is available here")
    common(q)
    q.set_defaults(func=_run_list)

    q = dsub.add_parser("check", help="load a dataset, verify its checksums, print shapes and class counts")
    q.add_argument("name", help="mnist, fashion_mnist, cifar10, cifar100 or digits")
    q.add_argument("--split", choices=["train", "test", "both"], default="both")
    q.add_argument("--sha256", default=None,
                   help="CIFAR only: accept an archive with this SHA-256 besides the official one "
                   "(e.g. one downloaded with data download --sha256); files next to the data are never trusted")
    common(q)
    q.set_defaults(func=_run_check)

    q = dsub.add_parser("download", help="download CIFAR-10/100 (checksum-verified, resumable)")
    q.add_argument("name", help="cifar10 or cifar100")
    q.add_argument("--url", default=None, help="a mirror's URL of the same archive (the download stops at the "
                   "official archive's size, twice that with --sha256)")
    q.add_argument("--sha256", default=None, help="expected SHA-256 when the mirror's archive differs from the official one")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    common(q)
    q.set_defaults(func=_run_download)


def _missing(exc: Exception) -> int:
    print(f"bnlab data: {exc}", file=sys.stderr)
    return 1


def _run_list(args: argparse.Namespace) -> int:
    from bnlab.data import data_dir, list_datasets

    listing = list_datasets(args.data_dir)
    root = str(data_dir(args.data_dir))
    if args.json:
        print_json({"data_dir": root, "datasets": {
            k: {"available": v.startswith("available:"), "detail": v.split(": ", 1)[1]} for k, v in listing.items()}})
    else:
        print(f"data directory: {root}")
        print_table([(k, *v.split(": ", 1)) for k, v in listing.items()], header=["name", "status", "detail"])
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from bnlab.data import DatasetNotFoundError, load_dataset

    splits = ["train", "test"] if args.split == "both" else [args.split]
    out = []
    for split in splits:
        try:
            d = load_dataset(args.name, split, data_dir=args.data_dir, sha256=args.sha256)
        except DatasetNotFoundError as exc:
            return _missing(exc)
        out.append({
            "name": d.name, "split": d.split, "n": len(d), "image_shape": list(d.image_shape),
            "x_dtype": str(d.x.dtype).removeprefix("torch."), "x_min": float(d.x.min()), "x_max": float(d.x.max()),
            "num_classes": d.num_classes, "class_counts": d.class_counts().tolist(),
            "classes": list(d.classes), "source": d.source, "verified": True,
        })
    if args.json:
        print_json(out)
    else:
        for r in out:
            print(f"{r['name']} {r['split']}: {r['n']} images {'x'.join(map(str, r['image_shape']))} "
                  f"{r['x_dtype']} in [{r['x_min']:g}, {r['x_max']:g}], {r['num_classes']} classes, checksums OK")
            print(f"  source: {r['source']}")
            width = 12 if r["num_classes"] <= 10 else 20
            rows = [(i, name[:width], c) for i, (name, c) in enumerate(zip(r["classes"], r["class_counts"]))]
            if r["num_classes"] > 10:
                counts = r["class_counts"]
                print(f"  class counts: min {min(counts)}, max {max(counts)} over {len(counts)} classes")
            else:
                print_table(rows, header=["label", "class", "count"])
    return 0


def _run_download(args: argparse.Namespace) -> int:
    from bnlab.data import download_cifar

    try:
        path = download_cifar(args.name, args.data_dir, url=args.url, sha256=args.sha256,
                              progress=not args.no_progress)
    except OSError as exc:
        return _missing(exc)
    if args.json:
        print_json({"name": args.name, "path": str(path), "verified": True})
    else:
        print(f"{args.name}: verified archive at {path}")
    return 0
