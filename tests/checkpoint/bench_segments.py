"""Segment throughput against same-run baselines (a benchmark, not a test; pytest skips it).

    .venv/bin/python -m tests.checkpoint.bench_segments [--sessions N] [--rounds R]

Write: 100,000 session records of ~2 KiB state through `SegmentWriter` (pack, digest,
buffered write, index, fsync), against a baseline that packs the same records into one
buffer and writes and fsyncs it in one go. Read: `read_index` + `read_records` of that
segment, against a baseline that reads the file and unpacks the same bytes. Rounds are
interleaved and each figure is the median; the ratio is taken within each round. It also
times the digest candidates over 100 MB. Targets (SPEC 11): write >= 0.5, read >= 0.4.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

from tether.checkpoint.segments import SegmentWriter, read_index, read_records
from tether.routing.types import new_worker_id


def make_records(count: int) -> list[dict[str, Any]]:
    owners = [new_worker_id() for _ in range(4)]
    return [
        {
            "kind": "session",
            "id": secrets.token_hex(16),
            "open": True,
            "owner": owners[i % 4],
            "state": {
                "count": i,
                "history": list(range(i % 97, i % 97 + 64)),
                "note": secrets.token_hex(850),
                "tags": ["alpha", "beta"],
            },
        }
        for i in range(count)
    ]


def baseline_write(records: list[dict[str, Any]], path: Path) -> float:
    start = time.perf_counter()
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    for record in records:
        packer.pack(record)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    view = packer.getbuffer()
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - start


def segment_write(records: list[dict[str, Any]], path: Path) -> float:
    start = time.perf_counter()
    with SegmentWriter(path) as writer:
        for record in records:
            writer.add(record)
        writer.close()
    return time.perf_counter() - start


def baseline_read(path: Path) -> float:
    start = time.perf_counter()
    with open(path, "rb") as file:
        data = file.read()
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data) or 1)
    unpacker.feed(data)
    for _ in unpacker:
        pass
    return time.perf_counter() - start


def segment_read(path: Path) -> float:
    start = time.perf_counter()
    entries = read_index(path)
    for _ in read_records(path, entries):
        pass
    return time.perf_counter() - start


def digest_speeds(megabytes: int = 100) -> dict[str, float]:
    block = os.urandom(1 << 20)
    speeds = {}
    for name in ("sha256", "blake2b"):
        best = float("inf")
        for _ in range(3):
            digest = hashlib.new(name)
            start = time.perf_counter()
            for _ in range(megabytes):
                digest.update(block)
            digest.hexdigest()
            best = min(best, time.perf_counter() - start)
        speeds[name] = megabytes * len(block) / 1e6 / best
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    for name, speed in digest_speeds().items():
        print(f"digest {name:8} {speed:7.0f} MB/s")
    records = make_records(args.sessions)
    work = Path(tempfile.mkdtemp(prefix="tt-bench-"))
    figures: dict[str, list[float]] = {k: [] for k in ("bw", "sw", "wr", "br", "sr", "rr")}
    try:
        for round_ in range(args.rounds):
            base, seg = work / f"base-{round_}.bin", work / f"seg-{round_}.msgpack"
            # Alternate the order so neither side always runs first.
            if round_ % 2:
                tb, ts = baseline_write(records, base), segment_write(records, seg)
            else:
                ts, tb = segment_write(records, seg), baseline_write(records, base)
            size = base.stat().st_size / 1e6
            figures["bw"].append(size / tb)
            figures["sw"].append(size / ts)
            figures["wr"].append(tb / ts)
            rb, rs = baseline_read(base), segment_read(seg)
            figures["br"].append(size / rb)
            figures["sr"].append(size / rs)
            figures["rr"].append(rb / rs)
            base.unlink()
            seg.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"records {args.sessions}, {size:.0f} MB of records, {args.rounds} rounds, medians")
    for what, b, s, r in (("write", "bw", "sw", "wr"), ("read", "br", "sr", "rr")):
        print(
            f"{what:6} baseline {med[b]:6.0f} MB/s  segment {med[s]:6.0f} MB/s  ratio {med[r]:.2f}"
        )
    print(f"write ratios per round: {', '.join(f'{r:.2f}' for r in figures['wr'])}")
    print(f"read ratios per round:  {', '.join(f'{r:.2f}' for r in figures['rr'])}")


if __name__ == "__main__":
    main()
