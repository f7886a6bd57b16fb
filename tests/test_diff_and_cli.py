"""graph_diff on programs and NNEF exports, and the gdn-fx command."""

from __future__ import annotations

import torch

import gdn_fx
from gdn_fx.cli import main
from gdn_fx.diff import nnef_graph
from programs import export_form


class Scan(torch.nn.Module):
    def forward(self, q, k, v, g, beta, s0):
        return torch.ops.gdn_fx.gated_delta_scan(q, k, v, g, beta, s0, scale=8 ** -0.5,
                                                 qk_l2norm=True)


def scan_args(t=3):
    return (torch.randn(1, t, 2, 8), torch.randn(1, t, 2, 8), torch.randn(1, t, 2, 8),
            -torch.rand(1, t, 2), torch.rand(1, t, 2), torch.randn(1, 2, 8, 8))


def test_a_graph_does_not_differ_from_itself_or_its_reexport():
    program = export_form(Scan(), scan_args(), "training")
    assert not gdn_fx.graph_diff(program, program)
    again = export_form(Scan(), scan_args(), "training")
    assert not gdn_fx.graph_diff(program, again)  # names and structure are stable


def test_a_changed_literal_is_reported_as_changed():
    a = export_form(torch.nn.Linear(4, 4), (torch.randn(2, 4),), "core")
    b = export_form(torch.nn.Linear(4, 4), (torch.randn(2, 4),), "core")
    node = next(n for n in b.graph_module.graph.nodes if n.op == "call_function")
    node.args = tuple(node.args) + ((0,) if node.target is torch.ops.aten.permute.default else ())
    node.target = torch.ops.aten.relu.default if node.target is not torch.ops.aten.permute.default \
        else node.target
    diff = gdn_fx.graph_diff(a, b)
    assert diff and (diff.changed or diff.added), str(diff)


def test_nnef_exports_diff_by_lowering(tmp_path):
    program = export_form(Scan(), scan_args(), "training")
    native = gdn_fx.export_nnef(program, tmp_path / "a.nnef.tgz", choose={"*": "native"})
    scan = gdn_fx.export_nnef(program, tmp_path / "b.nnef.tgz", choose={"*": "scan"})
    graph = nnef_graph(native)
    assert any(d["target"] == "tract_transformers_gdn_recurrent" for _, d in graph.nodes(data=True))
    assert not gdn_fx.graph_diff(graph, nnef_graph(native))
    diff = gdn_fx.graph_diff(graph, nnef_graph(scan))
    assert diff.op_delta()["tract_transformers_gdn_recurrent"] == (1, 0)


def test_cli_diff_of_two_saved_programs(tmp_path, capsys):
    program = export_form(Scan(), scan_args(), "training")
    torch.export.save(program, tmp_path / "a.pt2")
    torch.export.save(program, tmp_path / "b.pt2")
    assert main(["diff", str(tmp_path / "a.pt2"), str(tmp_path / "b.pt2")]) == 0
    assert "0 removed, 0 added, 0 changed" in capsys.readouterr().out


def test_cli_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo.nnef.tgz")]) == 0
    out = capsys.readouterr().out
    assert "fused: gated_delta_scan 3/3, causal_conv1d_update 3/3" in out
    assert "tract vs eager: max relative error" in out and out.rstrip().endswith("OK")


def test_cli_export_of_a_family(tmp_path, capsys):
    path = tmp_path / "lfm2.nnef.tgz"
    assert main(["export", "--family", "lfm2", "--out", str(path)]) == 0
    assert path.exists() and "causal_conv1d_update 2/2" in capsys.readouterr().out


def test_cli_export_with_a_symbolic_sequence(tmp_path, capsys):
    path = tmp_path / "qwen.nnef.tgz"
    assert main(["export", "--family", "qwen3_5", "--seq-len", "8", "--dynamic-seq",
                 "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "symbolic S (traced at 8)" in out and "gated_delta_scan 3/3" in out
    assert "tract at S=3:" in out and "tract at S=50:" in out and out.rstrip().endswith("OK")


def test_cli_diff_says_whether_two_programs_compute_the_same(tmp_path, capsys):
    program = export_form(Scan(), scan_args(), "training")
    torch.export.save(program, tmp_path / "a.pt2")
    torch.export.save(gdn_fx.collapse(program).program, tmp_path / "b.pt2")
    assert main(["diff", str(tmp_path / "a.pt2"), str(tmp_path / "b.pt2")]) == 0
    assert "computes the same: yes" in capsys.readouterr().out


def test_cli_diff_of_a_missing_file_is_one_line(tmp_path, capsys):
    assert main(["diff", str(tmp_path / "a.pt2"), str(tmp_path / "b.pt2")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and len(err.strip().splitlines()) == 1
