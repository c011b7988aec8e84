"""What checkpoint integrity and the replica check cost, against what they guard, in one run.

    OMP_NUM_THREADS=1 python bench/checkpoint_integrity.py [--model bert-large] [--dir /tmp] [--repeats 3]

The checkpoint: the model's fp32 weights (one file, as mp_rank_00_model_states.pt) and its AdamW state with fp32
master weights (another, as a ZeRO shard): about 5.4 GB for BERT-large, written with torch.save. Timed, each
the median of --repeats: the save (torch.save and fsync), the manifest at save (xxh3-64 of every file, as
integrity.hash_share; the files just written, in the page cache as a save leaves them), the same with zlib's
crc32, reading back torch.save's own per-record CRC32s (zipfile), and the load (torch.load). The replica check:
its fingerprint of the weights (replicas.fingerprint; the all-reduce of ~400 integers beside it is negligible)
against one AdamW update of the same weights, a lower bound of a training step (which adds the forward and the
backward). Prints `RESULT manifest/save=... manifest/load=... fingerprint/update=...`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from truneg.train.checkpointing import integrity  # noqa: E402
from truneg.train.ranks import replicas  # noqa: E402

SIZES = {"bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
         "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)}


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def save(state: dict, path: Path) -> None:
    torch.save(state, path)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(integrity.CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def zip_crcs(path: Path) -> None:
    """What zipfile.testzip does: every record read and its CRC32 compared with the directory's."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            with archive.open(info) as record:
                while record.read(integrity.CHUNK):
                    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=SIZES, default="bert-large")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoint is written (and removed)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=30522, **SIZES[args.model]))
    params = [p for p in model.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # its states exist from here
    update = timed(optimizer.step, args.repeats)
    fingerprint = timed(lambda: replicas.fingerprint(params), args.repeats)

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        tag = Path(folder)
        model_file, optim_file = tag / "mp_rank_00_model_states.pt", tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        optim_state = {"optimizer": optimizer.state_dict(), "master": [p.detach().clone() for p in params]}

        def write() -> None:
            save({"module": model.state_dict()}, model_file)
            save(optim_state, optim_file)

        saving = timed(write, args.repeats)
        files = [model_file, optim_file]
        size = sum(f.stat().st_size for f in files)
        manifest = timed(lambda: integrity.checksums(tag, integrity.tag_files(tag)), args.repeats)
        crc = timed(lambda: [crc32(f) for f in files], args.repeats)
        zip_crc = timed(lambda: [zip_crcs(f) for f in files], args.repeats)
        loading = timed(lambda: [torch.load(f, map_location="cpu", weights_only=False) for f in files], args.repeats)
    print(f"{args.model}: {sum(p.numel() for p in params) / 1e6:.0f} M parameters, checkpoint {size / 1e9:.2f} GB, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeats}")
    print(f"  save (torch.save + fsync)        {saving:8.2f} s")
    print(f"  manifest, xxh3-64 (integrity)    {manifest:8.2f} s  {manifest / saving:.3f}x the save, "
          f"{size / manifest / 1e9:.1f} GB/s")
    print(f"  zlib crc32 of the same bytes     {crc:8.2f} s  {crc / saving:.3f}x the save")
    print(f"  torch.save's zip CRC32s read back{zip_crc:8.2f} s  {zip_crc / loading:.3f}x the load")
    print(f"  load (torch.load)                {loading:8.2f} s  manifest check {manifest / loading:.3f}x the load")
    print(f"  replica fingerprint              {fingerprint * 1e3:8.1f} ms  {fingerprint / update:.3f}x one AdamW "
          f"update ({update * 1e3:.0f} ms); every 100 steps: {fingerprint / update / 100:.5f}x")
    print(f"RESULT manifest/save={manifest / saving:.3f} manifest/load={manifest / loading:.3f} "
          f"zipcrc/load={zip_crc / loading:.3f} fingerprint/update={fingerprint / update:.3f}")


if __name__ == "__main__":
    main()
