"""tract's x86 matmul kernels leave the vector registers' upper halves dirty; f16 pays for it.

tract 0.23.9's hand-written x86-64 matmul kernels (``avx512_mmm_f32_16x12`` and the ``fma_*``
ones, read in the wheel's shared library with objdump) return without ``vzeroupper``. Code in
the legacy SSE encoding that runs next is then slowed down by the CPU; tract's f16 element-wise
ops and f16 <-> f32 casts are such code on this machine (no f16 arithmetic), its f32 ones are
not. This times one small graph of each kind (a cast and a multiply on 32 768 elements),
always after one call of a graph holding a matmul: once as it is ("after a tract matmul"),
once after a numpy addition in between (numpy's vector loops end with ``vzeroupper``:
"upper state cleared"). Same process, same inputs, interleaved rounds.

    .venv/bin/python bench/bench_upper_state.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402


class MatMul(nn.Module):
    def forward(self, x, w):
        return x @ w


class ElementWise(nn.Module):
    """A cast to ``dtype`` and a multiply, the shape of a model's small element-wise ops."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return (x * 2).to(self.dtype) * 3


def _runnable(module: nn.Module, args: tuple, folder: Path, name: str):
    import gdn_fx
    from gdn_fx import tract_check

    path = gdn_fx.export_nnef(torch.export.export(module, args), folder / f"{name}.nnef.tgz")
    return tract_check.load(path)


def main(argv=None) -> None:
    import tract

    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    common.silence_warnings()
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="gdn_fx_upper_"))
    x, w = torch.randn(256, 128), torch.randn(128, 128)
    matmul = _runnable(MatMul(), (x, w), folder, "matmul")
    matmul_args = [tract.Tensor.from_numpy(a.numpy()) for a in (x, w)]
    ones = np.ones(4096, np.float32)
    calls = {}
    for dtype in (torch.float16, torch.float32):
        graph = _runnable(ElementWise(dtype), (x,), folder, str(dtype).split(".")[-1])
        inputs = [tract.Tensor.from_numpy(x.numpy())]
        for state, clear in (("after a tract matmul", False), ("upper state cleared", True)):
            def call(graph=graph, inputs=inputs, clear=clear):
                matmul.run(matmul_args)  # leaves the upper state dirty
                if clear:
                    np.add(ones, ones)  # ends with vzeroupper
                graph.run(inputs)
            calls[(str(dtype).split(".")[-1], state)] = call
    samples = common.interleave({f"{k[0]}|{k[1]}": v for k, v in calls.items()},
                                common.rounds_for(args))
    rows = []
    for dtype in ("float16", "float32"):
        dirty, clean = f"{dtype}|after a tract matmul", f"{dtype}|upper state cleared"
        rows.append([dtype, common.ms(samples.median(dirty)), common.ms(samples.median(clean)),
                     common.ratio(samples.ratio(dirty, clean))])
    common.emit(common.header(
        "tract's matmul kernels leave the upper vector state dirty",
        "a cast and a multiply on 32,768 elements in tract, each call right after one call of "
        "a [256, 128] x [128, 128] tract matmul, as it is or with a numpy addition in between "
        "(ms per call, matmul and addition included; medians and the median per-round ratio of "
        "interleaved rounds)"))
    common.emit(common.markdown(["element-wise dtype", "after a tract matmul",
                                 "upper state cleared", "slowdown"], rows))


if __name__ == "__main__":
    main()
