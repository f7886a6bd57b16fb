"""FX passes: find unrolled GDN/KDA loops and conv updates, collapse each into one op.

``collapse(program)`` runs every rule and returns a :class:`CollapseResult` with the rewritten
program (a new one unless ``inplace``), fusion counts and near-misses.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
from typing import Any, Optional, Union, Sequence

import torch
from torch import fx
from torch.export.graph_signature import InputKind

from gdn_fx.errors import InternalError
from gdn_fx.passes import chunk_meaning, conv_meaning, gdn_recurrent, hop, single_step
from gdn_fx.passes.program import (LITERAL, finish, graph_module_of, guards_paused, has_dead,
                                   literal, remove_dead, sync_signature_names)
from gdn_fx.passes.rebuild import rebuild
from gdn_fx.passes.result import CHECK_FAILED, VALIDATION_FAILED, CollapseResult, Miss
from gdn_fx.passes.rule import Rule
from gdn_fx.passes.validate import Validator, compare_programs

log = logging.getLogger(__name__)

# Every rule plans fusions on the graph it is handed, read-only (rule.py); ``_collapse``
# rebuilds, validates and hands the result to the next rule. The loop rules run first, on
# the original graph, since unrolled loops are most of it; the later ones see what is left.
# To add a rule: one more entry here.
GDN, CONV = gdn_recurrent.NAME, conv_meaning.NAME
RULES: tuple[Rule, ...] = (
    Rule("recurrence", GDN, gdn_recurrent.plan_recurrences, gdn_recurrent.find_unrolled),
    # a loop kept as one scan node; near-misses for other loop HOPs
    Rule("scan_hop", GDN, hop.plan_scan_hops, hop.hop_unrolled),
    # chunked forms (prefill): transformers' chunk rules, FLA's references, any chunk algebra
    Rule("chunk", GDN, chunk_meaning.plan_chunks_by_meaning, chunk_meaning.find_chunk_forms),
    Rule("conv_update", CONV, conv_meaning.plan_conv_updates, conv_meaning.find_conv_updates),
    # a state updated once with no time axis (a decode step without a loop): a near-miss
    Rule("single_step", GDN, single_step.plan_single_steps, single_step.find_single_steps),
)
if len({rule.name for rule in RULES}) != len(RULES):
    raise InternalError(f"two rules share a name: {[rule.name for rule in RULES]}")


def collapse(program: Any, *, inplace: bool = False, verify: Union[bool, str] = True,
             example_inputs: Optional[tuple] = None,
             rules: Optional[Sequence[Rule]] = None) -> CollapseResult:
    """Collapse every unrolled GDN/KDA recurrence and conv update in ``program``.

    ``program`` is a torch.export.ExportedProgram or a torch.fx.GraphModule whose nodes carry
    meta['val'] (as torch.export and make_fx leave them). The result's ``program`` has the same
    kind; the input is left untouched unless ``inplace``.

    ``verify`` (on by default) is translation validation: the rewritten program and the
    original run on the same random inputs and every output, input and buffer after the run
    must agree; a fusion that disagrees is not made and leaves a near-miss (validate.py).
    Integer inputs (token ids, positions) are taken from ``example_inputs`` (the program's
    call arguments; an ExportedProgram's own by default), zeros otherwise. Each fused
    region was drawn over the wide domain by its meaning rule already (evaluator.py);
    ``verify="wide"`` also runs the whole programs at the wide probes ``compare_programs``
    uses (in float64: ~3x the check's time on a 512-token loop). ``verify=False``
    trusts the rules' structural checks alone. ``rules``: the rules to run, in order
    (default ``RULES``); counts are kept per op, each rule adding to its ``op``'s.
    """
    with _cyclic_gc_paused(), guards_paused(graph_module_of(program)[0].graph):
        return _collapse(program, inplace, verify, example_inputs,
                         RULES if rules is None else tuple(rules))


@contextlib.contextmanager
def _cyclic_gc_paused():
    """An exported program holds ~10^5 objects at S = 512; the cyclic collector rescanning
    them while the pass allocates doubled the pass time there and made it grow faster than
    the graph. The pass makes no garbage that must be freed before it returns."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _collapse(program: Any, inplace: bool, verify: bool, example_inputs,
              rules: tuple) -> CollapseResult:
    gm, ep = graph_module_of(program)
    validator = Validator(gm, ep, example_inputs, wide=verify == "wide") if verify else None
    planned, kept = _planned(gm, ep)
    graph, counts, misses = planned, {}, _wrapped_misses(kept, rules)
    for rule in rules:
        fusions, found = rule.plan(graph)
        misses.extend(found)
        counts.setdefault(rule.op, 0)
        if not fusions:
            continue
        if validator is None:
            graph = rebuild(graph, fusions)
        else:
            graph, fusions, rejected = validator.settle(rule.op, graph, fusions)
            misses.extend(rejected)
        for fusion in fusions:  # a rule's op, or another it proved (a gated linear loop)
            counts[fusion.op or rule.op] = counts.get(fusion.op or rule.op, 0) + 1
        log.debug("rule %s: %d %s fusion(s) kept", rule.name, len(fusions), rule.op)
    misses = _still_standing(misses, graph)
    for miss in misses:
        log.debug("near-miss (%s): %s", miss.kind, miss)
    rewrote = graph is not planned
    if not rewrote:  # wrappers inlined for planning only: the program stays as traced
        graph = gm.graph
    if not rewrote and not inplace:  # no fusion was made: the input stays untouched
        graph = copy.deepcopy(graph)
    if inplace:
        gm.graph = graph
    else:
        gm = fx.GraphModule(gm, graph)
    if rewrote:  # dead code only where a rewrite left it: an unfused graph stays as traced
        finish(gm)
    if ep is not None:
        ep = _sync_export(ep, gm, inplace)
    return CollapseResult(gm if ep is None else ep, counts, misses)


def _planned(gm: fx.GraphModule, ep) -> tuple[fx.Graph, list]:
    """The graph the rules plan on, and the wrapper nodes left in it: ``gm.graph`` with its
    mode wrappers inlined (``with torch.no_grad():`` in a forward: hop.inline_wrappers), and
    an export's constant inputs that may index one position (``x.index_select(1,
    torch.tensor([t]))``) marked with their values, which loops.time_read reads (the
    training IR's fake values keep them, the decompositions' do not). ``gm.graph`` itself
    when neither applies; values nothing reads (make_fx's detach of each parameter)
    dropped. The input program is never changed."""
    graph, kept = hop.inline_wrappers(gm.graph)
    constants = _index_constants(graph, ep)
    dead = has_dead(graph)
    if (constants or dead) and graph is gm.graph:
        graph = _copied(graph)
        kept = hop.wrappers(graph)
    if dead:  # a value nothing reads must not count as a reader of a loop's values
        remove_dead(graph)
    for node in graph.find_nodes(op="placeholder") if constants else ():
        if node.name in constants:
            node.meta[LITERAL] = constants[node.name]
    return graph, kept


def _index_constants(graph: fx.Graph, ep) -> dict:
    """Placeholder name -> value, for an export's constant inputs of one integer whose
    value the graph does not record."""
    if ep is None:
        return {}
    found, places = {}, graph.find_nodes(op="placeholder")
    for spec, node in zip(ep.graph_signature.input_specs, places):
        value = ep.constants.get(spec.target) if spec.kind is InputKind.CONSTANT_TENSOR \
            else None
        if isinstance(value, torch.Tensor) and value.numel() == 1 and literal(node) is None \
                and not value.dtype.is_floating_point:
            found[node.name] = value
    return found


def _copied(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes' metadata can be added to (each node's own dict)."""
    new = fx.Graph(owning_module=graph.owning_module)
    out = new.graph_copy(graph, {})
    new.output(out).meta = dict(next(iter(graph.find_nodes(op="output"))).meta)
    return new


def _wrapped_misses(kept: list, rules: Sequence[Rule]) -> list:
    """A near-miss for each wrapper left whole (an enabled autocast region) around what a
    rule would fuse."""
    misses = []
    for node in kept:
        body = hop.wrapper_body(node)
        for rule in rules if body is not None else ():
            found = rule.unrolled(body.graph)
            if found:
                misses.append(Miss(rule.op, f"{found[0]} inside {hop.describe_wrapper(node)}: "
                                   "no rule looks inside it, since its ops' dtypes are chosen "
                                   "when it runs (run_decompositions() spells them out)",
                                   node=node.name))
    return misses


def _still_standing(misses: list, graph: fx.Graph) -> list:
    """The near-misses whose region is still in the graph: one a later rule fused (the rows
    loop inside transformers' chunked rule, which the chunk rule takes whole) is no miss."""
    names = {n.name for n in graph.nodes}
    return [m for m in misses if m.node is None or m.node in names]


def find_unrolled(program: Any, rules: Optional[Sequence[Rule]] = None) -> list[str]:
    """What in ``program`` is frozen at the traced sequence length (empty when nothing is).

    Unrolled recurrence steps, chunked forms (by the shape of the region the meaning rule
    would decide: transformers', FLA's, a per-chunk loop, also when it is not the delta
    rule), conv updates whose output slice is a literal, and loops kept as one higher-order
    node that no rule fused (``scan``, ``while_loop``: passes/hop.py):
    each rule's ``unrolled`` (``rules``: default ``RULES``).
    """
    graph, kept = _planned(*graph_module_of(program))
    graphs = [graph] + [body.graph for body in map(hop.wrapper_body, kept) if body is not None]
    return [found for rule in (RULES if rules is None else rules) for g in graphs
            for found in rule.unrolled(g)]


def _sync_export(ep: torch.export.ExportedProgram, gm: fx.GraphModule, inplace: bool):
    """``ep`` (in place) or a new ExportedProgram around ``gm`` sharing its weights."""
    signature = ep.graph_signature if inplace else copy.deepcopy(ep.graph_signature)
    calls = ep.module_call_graph if inplace else copy.deepcopy(ep.module_call_graph)
    sync_signature_names(gm.graph, signature, calls)
    if inplace:
        return ep
    return torch.export.ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=signature, state_dict=ep.state_dict,
        range_constraints=ep.range_constraints, module_call_graph=calls,
        example_inputs=ep.example_inputs, constants=ep.constants, verifiers=ep.verifiers)


__all__ = ["CHECK_FAILED", "VALIDATION_FAILED", "CollapseResult", "Miss", "Rule", "collapse",
           "compare_programs", "find_unrolled"]
