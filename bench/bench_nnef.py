"""NNEF size: operations and file size of the collapsed program (each lowering candidate) against
the unrolled one, for the Qwen3.5 layer core at S = 8, 64, 256.

The unrolled NNEF is the UN-collapsed torch.export program written by the same
``gdn_fx.export_nnef`` (static shapes, no dynamic axes: export_nnef refuses a symbolic axis
over an unrolled loop), so both sides go through the same torch-to-nnef path.
Operations are the statements of the NNEF main graph body (fragment definitions, written once
whatever S, are counted apart; ``variable`` statements are counted and also shown apart).

    .venv/bin/python bench/bench_nnef.py            # S = 8, 64, 256 (the unrolled S=256 file
                                                    # alone takes ~20 min to write)
    .venv/bin/python bench/bench_nnef.py --unrolled-max 64   # skip that one
    .venv/bin/python bench/bench_nnef.py --quick    # S = 8
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

FULL_LENGTHS = (8, 64, 256)
QUICK_LENGTHS = (8,)


def files_for(seq: int, folder: Path, unrolled_max: int) -> list[common.Written]:
    """One NNEF per lowering candidate of the collapsed program, then the unrolled one."""
    import gdn_fx

    program = common.export_core(seq)
    collapsed = gdn_fx.collapse(program).program
    written = [common.write_nnef(collapsed, folder / f"s{seq}_{name}.nnef.tgz", name,
                                 choose={common.GDN_OP: name}, input_names=common.CORE_INPUTS)
               for name in common.candidates(common.GDN_OP)]
    if seq <= unrolled_max:
        written.append(common.write_nnef(program, folder / f"s{seq}_unrolled.nnef.tgz",
                                         "unrolled", input_names=common.CORE_INPUTS))
    return written


def stats(item: common.Written) -> dict:
    text = common.graph_text(item.path)
    ops, variables, fragment_ops = common.nnef_ops(text)
    size, raw = common.archive_bytes(item.path)
    return dict(ops=ops, variables=variables, fragment_ops=fragment_ops,
                text=len(text.encode()), size=size, raw=raw)


def rows_for(seq: int, written: list[common.Written]) -> list[list]:
    measured = {w.name: stats(w) for w in written if w.path is not None}
    unrolled = measured.get("unrolled")
    rows = []
    for item in written:
        if item.path is None:
            rows.append([seq, item.name, *[None] * 7, f"refused: {item.error}"])
            continue
        m = measured[item.name]
        times = ""
        if unrolled and item.name != "unrolled":
            times = (f"{unrolled['ops'] / m['ops']:.3g}x the ops, "
                     f"{unrolled['raw'] / m['raw']:.3g}x the bytes")
        rows.append([seq, item.name, m["ops"], m["variables"], m["fragment_ops"],
                     common.human_bytes(m["text"]), common.human_bytes(m["raw"]),
                     common.human_bytes(m["size"]), common.ms(item.write_seconds), times])
    return rows


def main(argv=None) -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--unrolled-max", type=int, default=max(FULL_LENGTHS),
                    help="longest S whose unrolled NNEF is written (torch-to-nnef takes ~20 min "
                         "at S=256 on a 2-core machine; default %(default)s)")
    args = ap.parse_args(argv)
    common.silence_warnings()
    folder = common.workdir(args, "nnef")
    rows = []
    for seq in QUICK_LENGTHS if args.quick else FULL_LENGTHS:
        rows += rows_for(seq, files_for(seq, folder, args.unrolled_max))
    common.emit(common.header(
        "NNEF size: collapsed vs unrolled",
        "statements in the NNEF main graph, graph.nnef text size, uncompressed size of all "
        "files (text + weights), .nnef.tgz file size (torch-to-nnef writes it uncompressed) and "
        "time to write it (gdn_fx.export_nnef), for transformers' recurrent rule "
        f"(B={common.BATCH}, H={common.HEADS}, Dk=Dv={common.WIDTH}); collapsed rows force one "
        "lowering candidate each; 'unrolled' is the un-collapsed export."))
    common.emit(common.markdown(
        ["S", "program", "ops", "of which variables", "ops in fragments", "graph.nnef",
         "all files", ".nnef.tgz", "write ms",
         "unrolled / this"], rows))
    common.emit("")


if __name__ == "__main__":
    main()
