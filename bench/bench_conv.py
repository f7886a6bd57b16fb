"""Conv update: every causal_conv1d_update lowering candidate in tract, beside torch eager.

Qwen3.5's short convolution: 6144 channels (q, k and v projections together), K = 4, SiLU, no
bias, f32, one sequence, at S = 1 (decode) and S = 64. The program is transformers'
``causal_conv1d_update`` (state cloned and returned) exported with torch.export and collapsed
by gdn_fx.collapse; when collapse does not fuse it (the conv rule not registered in
``collapse``), the fused program is written directly with ``torch.ops.gdn_fx.
causal_conv1d_update`` and the table says so. "unfused" is transformers' graph written as is
(a plain depthwise conv). Outputs are checked against the same update in float64.

A second table runs the update exported with a SYMBOLIC length (one NNEF per candidate, as a
generation-ready export holds it) at S = 1, 64 and 512.

    .venv/bin/python bench/bench_conv.py            # S = 1, 64; symbolic at 1, 64, 512
    .venv/bin/python bench/bench_conv.py --quick    # S = 1, 2 rounds
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402

CHANNELS, KERNEL = 6144, 4
FULL_LENGTHS, QUICK_LENGTHS = (1, 64), (1,)
NAMES, OUTPUTS = ["x", "conv_state"], ["out", "new_state"]
EAGER = "torch eager (transformers)"


class HFUpdate(nn.Module):
    """transformers' causal_conv1d_update as a layer calls it (silu, no bias), functional."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x, conv_state):
        from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

        state = conv_state.clone()
        out = causal_conv1d_update(x, state, self.weight, None, "silu")
        return out, state


class FusedUpdate(nn.Module):
    """The fused op itself: what collapse produces from HFUpdate."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x, conv_state):
        return torch.ops.gdn_fx.causal_conv1d_update(x, conv_state, self.weight, None, "silu")


def inputs_for(seq: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, CHANNELS, seq, generator=gen),
            torch.randn(1, CHANNELS, KERNEL, generator=gen),
            torch.randn(CHANNELS, KERNEL, generator=gen) * 0.5)


def fused_program(hf: nn.Module, weight: torch.Tensor, args: tuple):
    """(program holding the fused node, how it was obtained, the un-collapsed program)."""
    import gdn_fx

    program = torch.export.export(hf, args)
    result = gdn_fx.collapse(program)
    if result.counts.get(common.CONV_OP, 0) == 1:
        return result.program, "gdn_fx.collapse", program
    direct = torch.export.export(FusedUpdate(weight), args)
    return direct, "written directly (collapse fused nothing)", program


def measure(seq: int, folder: Path, rounds: int) -> tuple[list[list], str]:
    """Rows of one length: torch eager, each candidate, the unfused graph."""
    x, state, weight = inputs_for(seq)
    hf = HFUpdate(weight)
    with torch.no_grad():
        want = HFUpdate(weight.double())(x.double(), state.double())
    fused, how, unfused = fused_program(hf, weight, (x, state))
    written = [common.write_nnef(fused, folder / f"s{seq}_{name}.nnef.tgz", name,
                                 {common.CONV_OP: name}, NAMES, OUTPUTS)
               for name in common.candidates(common.CONV_OP)]
    written.append(common.write_nnef(unfused, folder / f"s{seq}_unfused.nnef.tgz", "unfused",
                                     None, NAMES, OUTPUTS))
    arrays = common.numpy_inputs((x, state))
    loaded, failures = load_all(written, arrays, want)
    calls = {EAGER: lambda: _no_grad(hf, x, state)}
    calls.update({n: common.tract_call(got[0].runnable, arrays) for n, got in loaded.items()})
    samples = common.interleave(calls, rounds)
    rows = [[seq, EAGER, None, None, common.ms(samples.median(EAGER)), "1x",
             common.error_cell(_eager_error(hf, x, state, want))]]
    for item in written:
        if item.name in failures:
            rows.append([seq, item.name, None, None, None, None, failures[item.name]])
            continue
        got, error = loaded[item.name]
        rows.append([seq, item.name, common.ms(got.load), common.ms(got.optimize),
                     common.ms(samples.median(item.name)),
                     common.ratio(samples.ratio(item.name, EAGER)), common.error_cell(error)])
    return rows, how


def load_all(written: list[common.Written], arrays: list, want) -> tuple[dict, dict]:
    """({name: (Loaded, rel. error)}, {name: why it is missing}) for the written files."""
    loaded, failures = {}, {}
    for item in written:
        if item.path is None:
            failures[item.name] = f"not written: {item.error}"
            continue
        try:
            got = common.tract_load(item.path)
            loaded[item.name] = (got, common.rel_error(got.runnable, arrays, want))
        except Exception as exc:  # noqa: BLE001  (the table says why)
            failures[item.name] = f"tract: {type(exc).__name__}: {common.first_line(exc)}"
    return loaded, failures


def _no_grad(module: nn.Module, *args):
    with torch.no_grad():
        return module(*args)


def _eager_error(hf: nn.Module, x, state, want) -> float:
    from gdn_fx.tract_check import relative_error

    got = _no_grad(hf, x, state)
    return max(relative_error(g.numpy(), w) for g, w in zip(got, want))


SYMBOLIC_LENGTHS = (1, 64, 512)


def measure_symbolic(folder: Path, rounds: int) -> list[list]:
    """Each candidate written once with a symbolic S, run at every SYMBOLIC_LENGTHS."""
    import gdn_fx
    from gdn_fx import tract_check

    module = FusedUpdate(torch.randn(CHANNELS, KERNEL, generator=torch.Generator().manual_seed(0)))
    example = inputs_for(8)[:2]  # x and the state: the weight is the module's
    program = torch.export.export(module, example, dynamic_shapes=(
        {2: torch.export.Dim("S", min=1)}, None))
    names = ("depthwise", "portable")
    runnables = {name: tract_check.load(gdn_fx.export_nnef(
        program, folder / f"symbolic_{name}.nnef.tgz", choose={"*": name}, input_names=NAMES,
        output_names=OUTPUTS, dynamic_axes={"x": {2: "S"}})) for name in names}
    rows = []
    for seq in SYMBOLIC_LENGTHS:
        args = inputs_for(seq)[:2]
        arrays = common.numpy_inputs(args)
        with torch.no_grad():
            want = module(*args)
        calls = {name: common.tract_call(r, arrays) for name, r in runnables.items()}
        samples = common.interleave(calls, rounds)
        for name in names:
            rows.append([seq, name, common.ms(samples.median(name)),
                         common.ratio(samples.ratio(name, "portable")),
                         common.error_cell(common.rel_error(runnables[name], arrays, want))])
    return rows


def main(argv=None) -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    common.silence_warnings()
    torch.set_num_threads(1)
    folder = common.workdir(args, "conv")
    rounds = common.rounds_for(args)
    rows, hows = [], set()
    for seq in QUICK_LENGTHS if args.quick else FULL_LENGTHS:
        found, how = measure(seq, folder, rounds)
        rows += found
        hows.add(how)
    common.emit(common.header(
        "Conv update: lowering candidates vs torch eager",
        f"causal_conv1d_update, C={CHANNELS}, K={KERNEL}, SiLU, no bias, f32, B=1: tract load, "
        f"into_runnable (one load each) and run time (median over {rounds} interleaved rounds), "
        "run / torch eager (transformers' function, 1 thread) as the median of per-round "
        f"ratios; fused program: {', '.join(sorted(hows))}; candidates forced with choose."))
    common.emit(common.markdown(["S", "path", "load ms", "into_runnable ms", "run ms",
                                 "run / torch eager", "rel. err vs f64"], rows))
    common.emit("")
    if args.quick:
        return
    common.emit(common.header(
        "Conv update with a symbolic length",
        f"the fused op exported with a symbolic S (one NNEF per candidate), C={CHANNELS}, "
        f"K={KERNEL}, SiLU, f32, B=1, run at each S; median over {rounds} interleaved rounds; "
        "error against the op's eager kernel (transformers' arithmetic)"))
    common.emit(common.markdown(["S", "path", "run ms", "run / portable", "rel. err"],
                                measure_symbolic(folder, rounds)))
    common.emit("")


if __name__ == "__main__":
    main()
