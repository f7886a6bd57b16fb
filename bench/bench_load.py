"""Loading an artifact in tract: time and memory against its bytes, by archive layout.

tract 0.23.9 reads every weight of an NNEF into memory it owns (no mmap), then
``into_runnable`` optimizes the graph (packing matmul weights among other things). This
measures, for one generation-ready export written as a ``.nnef`` folder, an uncompressed
``.nnef.tar`` and a ``.nnef.tgz`` (gzip level 0, what gdn-fx writes), each loaded in a fresh
subprocess with a warm page cache (the file is read once before): the time of ``load`` and of
``into_runnable``, the resident memory after them (VmRSS) and at peak (VmHWM), and their ratio
to the artifact's bytes. The model is bench_generate's shape (``--quick``: 4 layers, vocab
32k), random f32 weights.

    .venv/bin/python bench/bench_load.py --quick                 # f32 and q4_0 (~2 min)
    .venv/bin/python bench/bench_load.py --formats f32           # the 0.8B shape
    .venv/bin/python bench/bench_load.py --formats f32 --peer /tmp/peer/full/peer/export/decoder/model.nnef.tgz

``--peer FILE``: the peer's decoder graph of the same shape (bench/peer.py writes it, f32) is
loaded by the same child in the same rounds as the f32 layouts, one after the other (the
peer's loader adds its tract_transformers ops as ours does).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from bench_generate import QUICK, SHAPE, build  # noqa: E402

CHILD = """
import json, sys, time
from pathlib import Path
def status(key):
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import tract
base = status('VmRSS:')
start = time.perf_counter()
model = tract.nnef().with_tract_transformers().load(sys.argv[1])
loaded = time.perf_counter()
after_load = status('VmRSS:') - base
runnable = model.into_runnable()
done = time.perf_counter()
rss = status('VmRSS:') - base
import ctypes  # what gdn_fx.tract_check.release_freed_memory does (importing it loads torch)
ctypes.CDLL('libc.so.6').malloc_trim(0)
print(json.dumps(dict(load=loaded - start, runnable=done - loaded, rss_load=after_load,
                      rss=rss, trimmed=status('VmRSS:') - base, peak=status('VmHWM:') - base)))
"""


def _arguments(argv):
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--formats", default="f32,q4_0", help="weight formats, e.g. f32,q4_0")
    parser.add_argument("--peer", type=Path, default=None,
                        help="the peer's decoder graph (bench/peer.py), timed beside f32")
    return parser.parse_args(argv)


def _layouts(tgz: Path) -> dict:
    """The export at ``tgz`` also as a folder and as an uncompressed tar beside it."""
    folder = tgz.with_name(tgz.name.replace(".nnef.tgz", ".nnef"))
    with tarfile.open(tgz) as archive:
        archive.extractall(folder, filter="data")
    tar = tgz.with_name(tgz.name.replace(".nnef.tgz", ".nnef.tar"))
    with tarfile.open(tar, "w") as archive:
        for item in sorted(folder.iterdir()):
            archive.add(item, arcname=item.name)
    return {".nnef folder": folder, ".nnef.tar": tar, ".nnef.tgz (gzip 0)": tgz}


def _bytes(path: Path) -> int:
    if path.is_dir():
        return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())
    return path.stat().st_size


def _warm(path: Path) -> None:
    for item in ([path] if path.is_file() else sorted(path.rglob("*"))):
        if item.is_file():
            with open(item, "rb") as handle:
                while handle.read(1 << 24):
                    pass


def _load_once(path: Path) -> dict:
    _warm(path)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _row(key: tuple, size: int, runs: list) -> list:
    pick = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
    return [*key, common.human_bytes(size), f"{pick['load']:.2f}", f"{pick['runnable']:.2f}",
            common.human_bytes(int(pick["rss_load"])), common.human_bytes(int(pick["rss"])),
            common.human_bytes(int(pick["trimmed"])), common.human_bytes(int(pick["peak"])),
            f"{pick['trimmed'] / size:.2f}x", f"{pick['peak'] / size:.2f}x"]


def main(argv=None) -> None:
    from gdn_fx.hf.generator import export_generator

    common.silence_warnings()
    args = _arguments(argv)
    shape = QUICK if args.quick else SHAPE
    folder = common.workdir(args, "load")
    rounds = common.rounds_for(args, full=3, quick=2)
    rows = []
    for fmt in args.formats.split(","):
        path = folder / f"{fmt}.nnef.tgz"
        export_generator(build(shape), path, weights=fmt, decode=False)  # one graph
        items = {(fmt, layout): item for layout, item in _layouts(path).items()}
        if fmt == "f32" and args.peer:
            items[("f32", "peer's decoder graph (.nnef.tgz)")] = args.peer
        runs = {key: [] for key in items}
        for _ in range(rounds):  # the items one after the other in each round
            for key, item in items.items():
                runs[key].append(_load_once(item))
        rows += [_row(key, _bytes(items[key]), runs[key]) for key in items]
        shutil.rmtree(path.with_name(f"{fmt}.nnef"), ignore_errors=True)
    common.emit(common.header(
        "Loading an artifact in tract, by layout",
        f"{'quick shape (4 layers, vocab 32k)' if args.quick else 'Qwen3.5-0.8B shape'}, "
        f"one-graph generation export, warm page cache, medians of {rounds} fresh processes"))
    common.emit(common.markdown(
        ["weights", "layout", "bytes", "load s", "into_runnable s", "RSS after load",
         "RSS after into_runnable", "RSS trimmed (gdn-fx's load)", "peak RSS",
         "trimmed / bytes", "peak / bytes"], rows))


if __name__ == "__main__":
    main()
