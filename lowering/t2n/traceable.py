"""Turn an ExportedProgram or GraphModule into a plain module torch-to-nnef can trace.

torch-to-nnef traces with ``torch.jit.trace``; ``ep.module()`` can not be traced as it is (its
train()/eval() overrides raise, its forward goes through pytree specs and a guard submodule).
So the graph is copied into a fresh ``GraphModule``: positional tensor inputs, a flat tuple
of outputs, parameters and buffers as attributes, no guard call. The caller's program is
never modified. Example inputs for the trace are made from the placeholders' ``meta["val"]``.
Symbolic sizes of a program exported with dynamic dims are respelled so that the trace keeps
them as computations (``gdn_fx.lowering.t2n.traced_sizes``).
The rewrites torch-to-nnef and tract need before tracing live in ``gdn_fx.lowering.t2n.fixes``.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from gdn_fx.errors import DTypeError, UnsupportedProgram
from gdn_fx.lowering.node_facts import static_dim
from gdn_fx.lowering.fx_nodes import Program, source_module
from gdn_fx.lowering.t2n.traced_sizes import trace_sizes

def _is_guard(node: fx.Node) -> bool:
    return node.op == "call_module" and node.target == "_guards_fn" and not node.users


def traceable_module(program: Program) -> fx.GraphModule:
    """A fresh, plain GraphModule computing the program (see the module docstring)."""
    source = source_module(program)
    graph = fx.Graph()
    result = graph.graph_copy(source.graph, {})
    graph.output(result)
    for node in [n for n in graph.nodes if _is_guard(n)]:
        graph.erase_node(node)
    # A fresh GraphModule copies only what the graph references from ``source``: not the
    # train()/eval() overrides ep.module() installs.
    module = fx.GraphModule(source, graph)
    trace_sizes(module)  # symbolic sizes stay computations in the trace (traced_sizes.py)
    return module


def input_names(module: fx.GraphModule) -> list[str]:
    """The placeholder names, in call order."""
    return [n.name for n in module.graph.nodes if n.op == "placeholder"]


def _example(node: fx.Node, generator: torch.Generator) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise UnsupportedProgram(f"input '{node.name}' has no meta['val'] tensor; export the "
                                 "program with torch.export so its inputs carry shapes")
    shape = [static_dim(d) for d in val.shape]
    if None in shape:  # a symbolic extent without a constant: take its trace-time hint
        shape = [int(d.node.hint) if isinstance(d, torch.SymInt) else int(d) for d in val.shape]
    if val.dtype.is_floating_point:
        return (0.5 * torch.randn(shape, generator=generator)).to(val.dtype)
    return torch.zeros(shape, dtype=val.dtype)


def example_inputs(module: fx.GraphModule, seed: int = 0) -> tuple:
    """One tensor per placeholder, shaped and typed as its meta['val'] (values are arbitrary)."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(_example(n, generator) for n in module.graph.nodes if n.op == "placeholder")


def refuse_bfloat16(module: fx.GraphModule) -> None:
    """Neither torch-to-nnef nor tract has bfloat16: fail early, naming the first such node."""
    for node in module.graph.nodes:
        vals = node.meta.get("val")
        for val in vals if isinstance(vals, (tuple, list)) else [vals]:
            if isinstance(val, torch.Tensor) and val.dtype == torch.bfloat16:
                raise DTypeError(f"node '{node.name}' produces a bfloat16 tensor "
                                 f"{list(val.shape)}; torch-to-nnef and tract have no bfloat16: "
                                 "cast the model to float16 or float32 before export")
