"""The torch-to-nnef plug-in: found through its entry point, no clash with torch-to-nnef's own
GDN handler, usable from a plain torch-to-nnef call, and the head-major native surface."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import torch
from nnef_tools.model import Tensor as NTensor

import gdn_fx.lowering.t2n.plugin  # noqa: F401  (registers the handlers)
from gdn_fx import tract_check
from gdn_fx.lowering import emit_native_gdn_recurrent
from gdn_fx.lowering.t2n.offline_target import offline_tract_target
from lowering_programs import SCAN, scan_inputs


def test_entry_point_names_the_plugin():
    found = {ep.name: ep.value for ep in entry_points(group="torch_to_nnef.extras")}
    assert found.get("gdn_fx") == "gdn_fx.lowering.t2n.plugin"


def test_handlers_sit_beside_torch_to_nnef_own_gdn_handler():
    from torch_to_nnef.op.extras import _T2N_EXTRA_REGISTRY

    for name in ("gdn_fx_gated_delta_scan", "gdn_fx_causal_conv1d_update", "gated_delta_scan"):
        assert callable(_T2N_EXTRA_REGISTRY.get(name))


DIRECT_USE = """
import sys, tempfile, pathlib, torch
import torch_to_nnef.op.extras  # torch-to-nnef's own handlers, gated_delta_scan included
from torch_to_nnef.export import export_model_to_nnef
import gdn_fx.lowering.t2n.bridge  # defines torch.ops.t2n_extra.gdn_fx_* (handlers not loaded)
from gdn_fx.lowering.t2n.offline_target import offline_tract_target
from gdn_fx import tract_check
assert "gdn_fx.lowering.t2n.plugin" not in sys.modules

class Direct(torch.nn.Module):
    def forward(self, x, state, weight):
        return torch.ops.t2n_extra.gdn_fx_causal_conv1d_update(x, state, weight, None, "silu",
                                                                "auto")

args = (torch.randn(2, 5, 3), torch.randn(2, 5, 4), torch.randn(5, 4))
path = pathlib.Path(tempfile.mkdtemp()) / "direct.nnef"
with torch.inference_mode():
    written = export_model_to_nnef(Direct(), args, path, offline_tract_target("0.23.9"),
                                   input_names=["x", "state", "weight"], compression_level=None,
                                   discover_extra_entrypoints=True)
assert "gdn_fx.lowering.t2n.plugin" in sys.modules
text = tract_check.nnef_text(written)
# "auto": the handler decides by the table; f32 K=4 at S=3 takes the depthwise-conv form
assert "gdn_fx_conv_update_dw_k4_silu" in text, text
assert "tract_transformers_causal_conv1d_update" not in text
comparison = tract_check.compare(written, Direct()(*args), args)
assert comparison.ok, comparison
print("OK", comparison)
"""


def test_plain_torch_to_nnef_call_finds_the_handlers():
    """A fresh process: only discover_extra_entrypoints=True brings the handlers in."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(DIRECT_USE)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "OK" in run.stdout


# ---- emit_native_gdn_recurrent with head-major operands, through a test-only bridge op -----

@torch.library.custom_op("t2n_extra::gdn_fx_test_head_major", mutates_args=())
def head_major_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw q/k [B, H, S, D], g/beta [B, H, S]: the native op's math, head-major."""
    def seq_major(x):
        return x.transpose(1, 2)

    out, state = SCAN(seq_major(q), seq_major(k), seq_major(v), seq_major(g), seq_major(beta),
                      s0, scale=q.shape[-1] ** -0.5, qk_l2norm=True)
    return seq_major(out).contiguous(), state


def _register_head_major_handler():
    from torch_to_nnef.op.extras import _T2N_EXTRA_REGISTRY, register

    try:
        _T2N_EXTRA_REGISTRY.get("gdn_fx_test_head_major")
        return
    except Exception:  # not registered yet
        pass

    @register("gdn_fx_test_head_major")
    def _handler(g, node, name_to_tensor, op_helper, **kwargs):
        operands = [op_helper.get_or_add_tensor_variable_in_nnef(i) for i in node.inputs]
        outs = []
        for out, like in zip(node.outputs, (operands[2], operands[5])):
            tensor = NTensor(g, name=out.export_name, dtype=like.dtype, shape=tuple(like.shape))
            name_to_tensor[out.export_name] = tensor
            outs.append(tensor)
        return emit_native_gdn_recurrent(g, operands, outs, head_major=True)


class HeadMajor(torch.nn.Module):
    def forward(self, q, k, v, g, beta, s0):
        return torch.ops.t2n_extra.gdn_fx_test_head_major(q, k, v, g, beta, s0)


def test_emit_native_head_major_runs_in_tract(tmp_path):
    from torch_to_nnef.export import export_model_to_nnef

    _register_head_major_handler()
    q, k, v, g, beta, s0 = scan_inputs(b=2, s=3, hk=2, dk=16, dv=16)
    args = tuple(x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)) + (s0,)
    with torch.inference_mode():
        written = export_model_to_nnef(HeadMajor(), args, tmp_path / "hm.nnef",
                                       offline_tract_target("0.23.9"), compression_level=None)
    text = tract_check.nnef_text(written)
    assert text.count("transpose(") == 6  # five operands in, the output back
    comparison = tract_check.compare(written, HeadMajor()(*args), args)
    assert comparison.ok, comparison
