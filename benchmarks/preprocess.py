"""Wall time, cases/s and peak memory of `plan_and_preprocess` on a generated dataset (run by hand).

Generates (once, cached) ``--cases`` synthetic cases of about ``--shape`` voxels (z y x) with
``autoseg.demo_data``, runs ``autoseg plan_and_preprocess`` in a subprocess with ``--processes`` workers, and
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MiB = 1024**2
NNUNET_DATASET_ID = 977


def make_dataset(root: Path, num_cases: int, shape_zyx: tuple[int, int, int]) -> Path:
    """The nnU-Net-layout dataset, generated once per (cases, shape)."""
    from autoseg.demo_data import make_demo_dataset

    tag = f"{num_cases}x{'x'.join(map(str, shape_zyx))}"
    dataset = root / f"Dataset{NNUNET_DATASET_ID:03d}_Bench{tag}"
    marker = dataset / ".complete"
    if not marker.is_file():
        t0 = time.perf_counter()
        make_demo_dataset(dataset, num_train=num_cases, num_test=0, shape_zyx=shape_zyx, seed=0)
        marker.write_text(tag)
        seconds = time.perf_counter() - t0
        print(f"generated {num_cases} cases of about {shape_zyx} in {seconds:.0f} s: {dataset}")
    return dataset


def _children(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc/*/stat)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += parents.get(p, [])
    return tree


def _memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of one process, 0 if it is gone."""
    try:
        rss = pss = 0
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
        return rss, pss
    except (OSError, ValueError):
        return 0, 0


def run_measured(cmd: list[str], env: dict[str, str] | None = None, log_path: Path | None = None) -> dict:
    """Run ``cmd``; wall seconds and the peak summed RSS / PSS of its process tree (polled every 0.1 s)."""
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    peak_rss = peak_pss = peak_procs = 0
    while proc.poll() is None:
        tree = _children(proc.pid)
        usage = [_memory(p) for p in tree]
        peak_rss = max(peak_rss, sum(u[0] for u in usage))
        peak_pss = max(peak_pss, sum(u[1] for u in usage))
        peak_procs = max(peak_procs, len(tree))
        time.sleep(0.1)
    seconds = time.perf_counter() - t0
    if log_path:
        out.close()
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:] if log_path else ""
        raise SystemExit(f"{cmd[:3]} ... failed with exit code {proc.returncode}\n{tail}")
    return {"seconds": seconds, "peak_rss_bytes": peak_rss, "peak_pss_bytes": peak_pss,
            "processes": peak_procs}


def run_autoseg(dataset: Path, work: Path, processes: int, configs: list[str], augmentations: int) -> dict:
    ws = work / "autoseg_workspace"
    shutil.rmtree(ws, ignore_errors=True)
    cmd = [sys.executable, "-m", "autoseg", "-q", "plan_and_preprocess", str(dataset), "-w", str(ws),
           "--gpu-memory", "8GiB", "--device", "cpu", "--processes", str(processes), "-c", *configs,
           "--precompute-augmentations", str(augmentations)]
    result = run_measured(cmd, log_path=work / "autoseg.log")
    reports = {c: ws / "preprocessed" / f"{c}_report.json" for c in configs}
    result["reports"] = {c: json.loads(p.read_text()) for c, p in reports.items()}
    result["workspace"] = ws
    return result


def nnunet_python(requested: str | None) -> str | None:
    if requested:
        return requested
    try:
        import nnunetv2  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def run_nnunet(python: str, dataset: Path, work: Path, processes: int, configs: list[str]) -> dict:
    """nnUNetv2_plan_and_preprocess on the same files (linked into a fresh nnUNet_raw)."""
    raw, pre, res = work / "nnUNet_raw", work / "nnUNet_preprocessed", work / "nnUNet_results"
    for d in (raw, pre, res):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    (raw / dataset.name).symlink_to(dataset)
    env = {**os.environ, "nnUNet_raw": str(raw), "nnUNet_preprocessed": str(pre), "nnUNet_results": str(res)}
    entry = ("from nnunetv2.experiment_planning.plan_and_preprocess_entrypoints import "
             "plan_and_preprocess_entry; plan_and_preprocess_entry()")
    cmd = [python, "-c", entry, "-d", str(NNUNET_DATASET_ID), "-c", *configs,
           "-np", *[str(processes)] * len(configs), "-npfp", str(processes), "--verify_dataset_integrity"]
    return run_measured(cmd, env=env, log_path=work / "nnunet.log")


def storage_comparison(folder: Path, patch_zyx: tuple[int, ...], reads: int = 400) -> list[dict]:
    """.npy vs blosc2 on the preprocessed data arrays of ``folder``: write s, MiB on disk, patch read ms."""
    import blosc2

    import autoseg.loader  # noqa: F401  (imports torch: not inside the timed reads)

    rng = np.random.default_rng(0)
    arrays = sorted(folder.glob("*_data.npy"))
    arrays = [p for p in arrays if "_aug" not in p.name]
    tmp = Path(tempfile.mkdtemp(prefix="storage_", dir=folder.parent))
    formats = {
        "npy, np.load mmap": (".npy", _save_npy, lambda p, box: np.load(p, mmap_mode="r")[box]),
        "npy, autoseg loader": (".npy", _save_npy, _read_like_the_loader),
        "blosc2 lz4 clevel 5": (".b2nd", _blosc2_writer(blosc2, blosc2.Codec.LZ4, 5, patch_zyx),
                                lambda p, box: blosc2.open(str(p), mmap_mode="r")[box]),
        "blosc2 zstd clevel 8": (".b2nd", _blosc2_writer(blosc2, blosc2.Codec.ZSTD, 8, patch_zyx),
                                 lambda p, box: blosc2.open(str(p), mmap_mode="r")[box]),
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
        rows.append({"format": name, "write_s": write_s, "disk_mib": disk_mib, "read_ms_warm": warm,
                     "read_ms_cold": cold, "read_from_disk_mib": read_mib, "patches": reads})
    shutil.rmtree(tmp)
    return rows


def _blosc2_writer(blosc2, codec, clevel: int, patch_zyx: tuple[int, ...]):
    def write(a: np.ndarray, path: Path) -> None:
        chunks = (1, *(min(p, s) for p, s in zip(patch_zyx, a.shape[1:], strict=True)))
        blosc2.asarray(np.ascontiguousarray(a), urlpath=str(path), mode="w", chunks=chunks,
                       cparams={"codec": codec, "clevel": clevel, "nthreads": 1})
    return write


def _random_box(rng: np.random.Generator, shape: tuple[int, ...],
                patch: tuple[int, ...]) -> tuple[slice, ...]:
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
    from autoseg.loader import open_npy_for_patches, prefetch_pages  # imported before the timing starts

    array = open_npy_for_patches(path)
    prefetch_pages(array, box)
    return array[box]


def _read_patches(paths: list[Path], boxes: list[tuple[Path, tuple[slice, ...]]], read,
                  drop_cache: bool) -> float:
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
    parser.add_argument("--storage-only", action="store_true",
                        help="only the storage comparison, on the workspace of a previous run")
    args = parser.parse_args()

    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    dataset = make_dataset(root, args.cases, tuple(args.shape))
    print(f"dataset: {args.cases} cases, about {tuple(args.shape)} voxels; {args.processes} process(es); "
          f"configs {args.configs}; {os.cpu_count()} CPUs; load average before {os.getloadavg()[0]:.1f}")
    if args.storage_only:
        print_storage(root / "autoseg_workspace", args.configs[0])
        return
    ours = run_autoseg(dataset, root, args.processes, args.configs, args.precompute_augmentations)
    _print("autoseg", ours, args.cases)
    for config, report in ours["reports"].items():
        cases = report["cases"]
        ratio = max(c["measured_peak_rss_bytes"] / c["predicted_peak_bytes"] for c in cases)
        print(f"  {config}: preprocessing stage {report['seconds']:.1f} s; per-case peak RSS measured "
              f"max {max(c['measured_peak_rss_bytes'] for c in cases) / MiB:.0f} MiB, predicted max "
              f"{max(c['predicted_peak_bytes'] for c in cases) / MiB:.0f} MiB "
              f"(measured/predicted <= {ratio:.2f}); "
              f"disk {report['disk_bytes'] / MiB:.0f} MiB "
              f"(augmented copies {report['augmented_disk_bytes'] / MiB:.0f})")
    python = nnunet_python(args.nnunet_python)
    if python is None:
        print("nnU-Net v2: not importable here; pass --nnunet-python PATH to compare")
    else:
        theirs = run_nnunet(python, dataset, root, args.processes, args.configs)
        _print("nnU-Net v2", theirs, args.cases)
        print(f"autoseg / nnU-Net: wall time {ours['seconds'] / theirs['seconds']:.2f}, peak PSS "
              f"{ours['peak_pss_bytes'] / theirs['peak_pss_bytes']:.2f}, peak RSS "
              f"{ours['peak_rss_bytes'] / theirs['peak_rss_bytes']:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f} (other processes on the machine slow everything)")
    if args.storage:
        print_storage(ours["workspace"], args.configs[0])


def print_storage(workspace: Path, config: str) -> None:
    plans = json.loads((workspace / "plans.json").read_text())
    patch = tuple(plans["configurations"][config]["patch_size"])
    for row in storage_comparison(workspace / "preprocessed" / config, patch):
        print(f"  {row['format']:<22} write {row['write_s']:5.2f} s, disk {row['disk_mib']:6.1f} MiB, "
              f"patch {patch} read {row['read_ms_cold']:5.2f} ms cold, {row['read_ms_warm']:5.2f} ms warm; "
              f"{row['patches']} cold patches read {row['read_from_disk_mib']:6.1f} MiB from disk")


def _print(name: str, r: dict, cases: int) -> None:
    print(f"{name}: plan_and_preprocess {r['seconds']:.1f} s wall, {cases / r['seconds']:.2f} cases/s, "
          f"peak of the process tree RSS {r['peak_rss_bytes'] / MiB:.0f} MiB, "
          f"PSS {r['peak_pss_bytes'] / MiB:.0f} MiB ({r['processes']} processes)")


if __name__ == "__main__":
    main()
