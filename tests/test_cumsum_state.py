"""A cumulative sum in an exported program stays right on a tract State that is run again
(torch-to-nnef writes cumsum as a scan that kept its sum between runs: lowering/t2n/scan_reset.py)."""

import numpy as np
import pytest
import torch

import gdn_fx
from gdn_fx import tract_check
from gdn_fx.errors import InternalError
from gdn_fx.lowering.t2n.scan_reset import reset_cumsum_scans


class Cumulative(torch.nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=1) * 2


@pytest.mark.parametrize("suffix", [".nnef.tgz", ".nnef"])
def test_cumsum_is_right_on_every_run_of_one_state(tmp_path, suffix):
    import tract

    x = torch.randn(2, 5)
    path = gdn_fx.export_nnef(torch.export.export(Cumulative(), (x,)), tmp_path / f"c{suffix}")
    assert "reset_every_turn = true" in tract_check.nnef_text(path)
    state = tract_check.load(path).spawn_state()
    inputs = [tract.Tensor.from_numpy(x.numpy())]
    want = np.cumsum(x.numpy(), axis=1) * 2  # numpy's, not the program's
    for _ in range(3):
        assert np.allclose(state.run(inputs)[0].to_numpy(), want, rtol=1e-6, atol=1e-6)


def test_the_rewrite_touches_only_that_fragment_and_refuses_another_form():
    text = ("fragment tract_cumsum(\n) -> ()\n{\n    o = tract_core_scan(reset_every_turn = "
            "false);\n}\nfragment other(\n) -> ()\n{\n    o = tract_core_scan(reset_every_turn"
            " = false);\n}\n")
    fixed = reset_cumsum_scans(text)
    assert fixed.count("reset_every_turn = true") == 1
    assert fixed.index("reset_every_turn = true") < fixed.index("fragment other")
    assert reset_cumsum_scans(fixed) == fixed
    with pytest.raises(InternalError, match="tract_cumsum"):
        reset_cumsum_scans("fragment tract_cumsum(\n{\n    o = x;\n}\n")


def test_compare_runs_a_kept_state_twice_and_sees_a_scan_that_keeps_its_sum(tmp_path):
    # The written graph with its cumsum scan put back to torch-to-nnef's reset_every_turn =
    # false: a fresh State answers right, so only the second run of one State shows the bug.
    x = torch.randn(2, 5)
    path = gdn_fx.export_nnef(torch.export.export(Cumulative(), (x,)), tmp_path / "c.nnef")
    want = [torch.from_numpy(np.cumsum(x.numpy(), axis=1) * 2)]  # numpy's, not the program's
    assert tract_check.compare(path, want, [x]).ok
    graph = path / "graph.nnef"
    graph.write_text(graph.read_text().replace("reset_every_turn = true",
                                               "reset_every_turn = false"))
    first, second = tract_check.kept_state_runs(path, [x])
    assert np.allclose(first[0], want[0].numpy(), rtol=1e-6, atol=1e-6)  # a fresh State: right
    found = tract_check.compare(path, want, [x])
    assert not found.ok and found.errors[0] > 0.1, str(found)
