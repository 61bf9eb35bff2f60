"""Wall time, cases/s and peak memory of `plan_and_preprocess` on a generated dataset (run by hand).

Generates (once, cached) ``--cases`` synthetic cases of about ``--shape`` voxels (z y x) with
``autoseg.demo.data``, runs ``autoseg plan_and_preprocess`` in a subprocess with ``--processes`` workers, and
polls the whole process tree every 0.1 s for its summed RSS and PSS (PSS shares the pages of libraries
and of the page cache between the processes mapping them, so it does not count them once per worker).
If nnU-Net v2 can be imported, here or by ``--nnunet-python PATH`` (an interpreter of another venv), it
runs ``nnUNetv2_plan_and_preprocess`` on the same files with the same process count and prints the ratios.

``--storage`` also compares the preprocessed arrays stored as .npy (memory-mapped) and as blosc2
(chunked, compressed): write time, disk size, and the time to read random training patches, from the page
cache and after dropping the files from it.

    python benchmarks/preprocess.py [--cases 20] [--shape 100 256 256] [--processes 2] [--storage]
        [--precompute-augmentations K] [--nnunet-python /path/to/venv/bin/python] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import make_dataset, nnunet_python, run_measured, run_nnunet

from autoseg.core.units import MiB


def run_autoseg(dataset: Path, work: Path, processes: int, configs: list[str], augmentations: int) -> dict:
    ws = work / "autoseg_workspace"
    shutil.rmtree(ws, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "autoseg",
        "-q",
        "plan_and_preprocess",
        str(dataset),
        "-w",
        str(ws),
        "--gpu-memory",
        "8GiB",
        "--device",
        "cpu",
        "--processes",
        str(processes),
        "-c",
        *configs,
        "--precompute-augmentations",
        str(augmentations),
    ]
    result = run_measured(cmd, log_path=work / "autoseg.log")
    reports = {c: ws / "preprocessed" / f"{c}_report.json" for c in configs}
    result["reports"] = {c: json.loads(p.read_text()) for c, p in reports.items()}
    result["workspace"] = ws
    return result


def storage_comparison(folder: Path, patch_zyx: tuple[int, ...], reads: int = 400) -> list[dict]:
    """.npy vs blosc2 on the preprocessed data arrays of ``folder``: write s, MiB on disk, patch read ms."""
    import blosc2

    from autoseg.preprocess.store import case_files, list_complete_cases

    rng = np.random.default_rng(0)
    arrays = [case_files(folder, c).data for c in list_complete_cases(folder)]  # not the augmented copies
    tmp = Path(tempfile.mkdtemp(prefix="storage_", dir=folder.parent))
    formats = {
        "npy, np.load mmap": (".npy", _save_npy, lambda p, box: np.load(p, mmap_mode="r")[box]),
        "npy, autoseg loader": (".npy", _save_npy, _read_like_the_loader),
        "blosc2 lz4 clevel 5": (
            ".b2nd",
            _blosc2_writer(blosc2, blosc2.Codec.LZ4, 5, patch_zyx),
            lambda p, box: blosc2.open(str(p), mmap_mode="r")[box],
        ),
        "blosc2 zstd clevel 8": (
            ".b2nd",
            _blosc2_writer(blosc2, blosc2.Codec.ZSTD, 8, patch_zyx),
            lambda p, box: blosc2.open(str(p), mmap_mode="r")[box],
        ),
    }
    rows = []
    for name, (suffix, write, read) in formats.items():
        paths, write_s = [], 0.0
        for src in arrays:
            a = np.load(src)
            dst = tmp / (src.stem + suffix)
            t0 = time.perf_counter()
            write(a, dst)
            write_s += time.perf_counter() - t0
            paths.append(dst)
        shapes = [np.load(p, mmap_mode="r").shape for p in arrays]
        picks = rng.integers(len(paths), size=reads)  # cases in random order, as training samples them
        boxes = [(paths[k], _random_box(rng, shapes[k], patch_zyx)) for k in picks]
        cold = _read_patches(paths, boxes, read, drop_cache=True)
        read_mib = sum(_cached_bytes(p) for p in paths) / MiB  # what the cold reads brought into memory
        warm = _read_patches(paths, boxes, read, drop_cache=False)
        disk_mib = sum(p.stat().st_size for p in paths) / MiB
        rows.append(
            {
                "format": name,
                "write_s": write_s,
                "disk_mib": disk_mib,
                "read_ms_warm": warm,
                "read_ms_cold": cold,
                "read_from_disk_mib": read_mib,
                "patches": reads,
            }
        )
    shutil.rmtree(tmp)
    return rows


def _blosc2_writer(blosc2, codec, clevel: int, patch_zyx: tuple[int, ...]):
    def write(a: np.ndarray, path: Path) -> None:
        chunks = (1, *(min(p, s) for p, s in zip(patch_zyx, a.shape[1:], strict=True)))
        blosc2.asarray(
            np.ascontiguousarray(a),
            urlpath=str(path),
            mode="w",
            chunks=chunks,
            cparams={"codec": codec, "clevel": clevel, "nthreads": 1},
        )

    return write


def _random_box(rng: np.random.Generator, shape: tuple[int, ...], patch: tuple[int, ...]) -> tuple[slice, ...]:
    starts = [int(rng.integers(0, max(s - p, 0) + 1)) for s, p in zip(shape[1:], patch, strict=True)]
    return (slice(None), *(slice(a, a + p) for a, p in zip(starts, patch, strict=True)))


def _cached_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (mincore on a fresh read-only mapping, which touches nothing)."""
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    view = np.frombuffer(mapping, np.uint8)
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
    del view
    mapping.close()
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


def _save_npy(a: np.ndarray, path: Path) -> None:
    np.save(path, a)


def _read_like_the_loader(path: Path, box: tuple[slice, ...]) -> np.ndarray:
    from autoseg.preprocess.mapped_npy import open_npy_for_patches, prefetch_pages  # imported before the timing starts

    array = open_npy_for_patches(path)
    prefetch_pages(array, box)
    return array[box]


def _read_patches(paths: list[Path], boxes: list[tuple[Path, tuple[slice, ...]]], read, drop_cache: bool) -> float:
    """Mean milliseconds to open a case and read one patch into memory."""
    if drop_cache:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)  # dirty pages would stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    t0 = time.perf_counter()
    for path, box in boxes:
        np.array(read(path, box))
    return (time.perf_counter() - t0) / len(boxes) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--shape", type=int, nargs=3, default=(100, 256, 256), metavar=("Z", "Y", "X"))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["3d_fullres"])
    parser.add_argument("--precompute-augmentations", type=int, default=0)
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "autoseg_preprocess_bench"))
    parser.add_argument("--nnunet-python", default=None, help="python of a venv with nnunetv2 installed")
    parser.add_argument("--storage", action="store_true", help="also compare .npy and blosc2 storage")
    parser.add_argument(
        "--storage-only", action="store_true", help="only the storage comparison, on the workspace of a previous run"
    )
    args = parser.parse_args()

    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    dataset = make_dataset(root, args.cases, tuple(args.shape))
    print(
        f"dataset: {args.cases} cases, about {tuple(args.shape)} voxels; {args.processes} process(es); "
        f"configs {args.configs}; {os.cpu_count()} CPUs; load average before {os.getloadavg()[0]:.1f}"
    )
    if args.storage_only:
        print_storage(root / "autoseg_workspace", args.configs[0])
        return
    ours = run_autoseg(dataset, root, args.processes, args.configs, args.precompute_augmentations)
    _print("autoseg", ours, args.cases)
    for config, report in ours["reports"].items():
        cases = report["cases"]
        ratio = max(c["measured_peak_rss_bytes"] / c["predicted_peak_bytes"] for c in cases)
        print(
            f"  {config}: preprocessing stage {report['seconds']:.1f} s; per-case peak RSS measured "
            f"max {max(c['measured_peak_rss_bytes'] for c in cases) / MiB:.0f} MiB, predicted max "
            f"{max(c['predicted_peak_bytes'] for c in cases) / MiB:.0f} MiB "
            f"(measured/predicted <= {ratio:.2f}); "
            f"disk {report['disk_bytes'] / MiB:.0f} MiB "
            f"(augmented copies {report['augmented_disk_bytes'] / MiB:.0f})"
        )
    python = nnunet_python(args.nnunet_python)
    if python is None:
        print("nnU-Net v2: not importable here; pass --nnunet-python PATH to compare")
    else:
        theirs = run_nnunet(python, dataset, root, args.processes, args.configs)
        _print("nnU-Net v2", theirs, args.cases)
        print(
            f"autoseg / nnU-Net: wall time {ours['seconds'] / theirs['seconds']:.2f}, peak PSS "
            f"{ours['peak_pss_bytes'] / theirs['peak_pss_bytes']:.2f}, peak RSS "
            f"{ours['peak_rss_bytes'] / theirs['peak_rss_bytes']:.2f}"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes on the machine slow everything)")
    if args.storage:
        print_storage(ours["workspace"], args.configs[0])


def print_storage(workspace: Path, config: str) -> None:
    plans = json.loads((workspace / "plans.json").read_text())
    patch = tuple(plans["configurations"][config]["patch_size"])
    for row in storage_comparison(workspace / "preprocessed" / config, patch):
        print(
            f"  {row['format']:<22} write {row['write_s']:5.2f} s, disk {row['disk_mib']:6.1f} MiB, "
            f"patch {patch} read {row['read_ms_cold']:5.2f} ms cold, {row['read_ms_warm']:5.2f} ms warm; "
            f"{row['patches']} cold patches read {row['read_from_disk_mib']:6.1f} MiB from disk"
        )


def _print(name: str, r: dict, cases: int) -> None:
    print(
        f"{name}: plan_and_preprocess {r['seconds']:.1f} s wall, {cases / r['seconds']:.2f} cases/s, "
        f"peak of the process tree RSS {r['peak_rss_bytes'] / MiB:.0f} MiB, "
        f"PSS {r['peak_pss_bytes'] / MiB:.0f} MiB ({r['processes']} processes)"
    )


if __name__ == "__main__":
    main()
