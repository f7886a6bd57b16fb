"""Pass cost: gdn_fx.collapse time against torch.export time, and graph nodes before/after.

The programs are transformers' delta rules of the Qwen3.5 layer core (l2norm in kernel, initial
state given) exported with ``torch.export.export`` (training IR) at each length S: the recurrent
rule (unrolled, one step per token) and the chunk rule (one block per 64-token chunk). Each
round exports afresh and then collapses that export, so the two timings of a ratio are taken
back to back. Every round runs in a fresh process, as an export does: a collapse pays there
whatever it traces or caches for the shapes it meets. Target (issues 7, 14): collapse,
translation validation included, under 2% of the export time at S = 512.

``--against REV`` times gdn_fx as it was at git revision REV in the same run: rounds alternate
between the two trees, and the table gives this tree's collapse time over REV's.

    .venv/bin/python bench/bench_pass.py            # S = 16, 64, 256, 512 (several minutes)
    .venv/bin/python bench/bench_pass.py --quick    # S = 16, 64
    .venv/bin/python bench/bench_pass.py --against af27b6f
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

FULL_LENGTHS = (16, 64, 256, 512)
QUICK_LENGTHS = (16, 64)
RULES = ("recurrent", "chunk")


def one_round(lengths: str) -> dict:
    """Export and collapse each rule at each length once, in this process (a child's job)."""
    import torch

    import gdn_fx

    common.silence_warnings()
    # the first export and collapse of a process pay for imports and torch's caches: not
    # charged to the table (what a collapse traces for the shapes it meets still is)
    gdn_fx.collapse(torch.export.export(common.Core("recurrent"), common.core_inputs(2)))
    rows = []
    for rule in RULES:
        for seq in map(int, lengths.split(",")):
            export_s, program = common.once(lambda: torch.export.export(
                common.Core(rule), common.core_inputs(seq)))
            collapse_s, result = common.once(lambda: gdn_fx.collapse(program))
            plain_s, _ = common.once(lambda: gdn_fx.collapse(program, verify=False))
            rows.append(dict(rule=rule, seq=seq, export=export_s, collapse=collapse_s,
                             plain=plain_s, before=common.count_nodes(program),
                             after=common.count_nodes(result.program),
                             fused=result.counts.get(common.GDN_OP, 0),
                             misses=len(result.misses)))
    return {"rows": rows}


def row(runs: list[list[dict]], against: list[list[dict]], i: int) -> list:
    """One table row: medians over rounds of entry ``i``, and per-round ratios."""
    mine = [run[i] for run in runs]
    first = mine[0]

    def median(key, rows=mine):
        return statistics.median(r[key] for r in rows)

    cells = [first["rule"], first["seq"], first["before"], first["after"], first["fused"],
             common.ms(median("export")), common.ms(median("collapse")),
             common.ms(median("plain")),
             common.percent(statistics.median(r["collapse"] / r["export"] for r in mine))]
    if against:
        theirs = [run[i] for run in against]
        cells += [theirs[0]["fused"], common.ms(median("collapse", theirs)),
                  common.ratio(statistics.median(
                      m["collapse"] / t["collapse"] for m, t in zip(mine, theirs)))]
    return cells


def main(argv=None) -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", default=None,
                    help="also time gdn_fx at git revision REV, rounds alternating")
    args = ap.parse_args(argv)
    lengths = ",".join(map(str, QUICK_LENGTHS if args.quick else FULL_LENGTHS))
    rounds = common.rounds_for(args, full=3, quick=1)
    site = common.install_revision(args.against) if args.against else None
    runs, against = [], []
    for r in range(rounds):
        trees = [(runs, None), (against, site)] if site else [(runs, None)]
        for results, where in (trees if r % 2 == 0 else trees[::-1]):
            results.append(common.child("one_round", lengths, module="bench_pass",
                                        site=where)["rows"])
    columns = ["rule", "S", "nodes before", "nodes after", "fused", "export ms",
               "collapse ms", "collapse ms, verify=False", "collapse/export"]
    if site:
        columns += [f"fused at {args.against}", f"collapse ms at {args.against}",
                    f"collapse, this / {args.against}"]
    common.emit(common.header(
        "Pass cost: collapse vs torch.export",
        "wall time of torch.export.export (training IR) of transformers' recurrent and chunk "
        f"rules (B={common.BATCH}, H={common.HEADS}, Dk=Dv={common.WIDTH}) and of "
        "gdn_fx.collapse on that export (translation validation on, the default; and with "
        "verify=False), one fresh one-thread process per round (the Machine line's torch "
        "threads are this parent's); ratios are medians of per-round ratios."))
    common.emit(common.markdown(columns, [row(runs, against, i)
                                          for i in range(len(runs[0]))]))
    i = max(i for i, r in enumerate(runs[0]) if r["rule"] == "recurrent")
    last = runs[0][i]
    share = statistics.median(run[i]["collapse"] / run[i]["export"] for run in runs)
    verdict = "meets" if share < 0.02 else "MISSES"
    common.emit(f"\nAt S={last['seq']} (recurrent) collapse costs {100 * share:.3g}% of the "
                f"export: {verdict} the < 2% target (target is stated at S=512).\n")
    missed = [f"{r['rule']} S={r['seq']}: {r['misses']}" for r in runs[0] if r["misses"]]
    if missed:
        common.emit("Near-misses were reported: " + ", ".join(missed))


if __name__ == "__main__":
    main()
