"""Translation validation: a fusion is kept only when the rewritten program computes as before.

A rule's checks say a region looks like the recurrence; running says it computes it. Before a
rule's fusions are committed, the original program and the rewritten one run on the same
random inputs of the traced shapes and dtypes, and everything the program hands out is
compared: its outputs, and every input and buffer after the run (where an in-place write, also
one through a view, shows). A region's value that reaches none of these cannot make the program
wrong. When the rewrite disagrees, each fusion is tried alone and the ones that disagree (or
fail to run) are left out, each with a near-miss naming its region and the worst output.
``Validator.settle`` is where every rule's fusions are rebuilt into a graph and checked.

Inputs: floats are drawn at random (scaled down until the original program stays finite);
integer and boolean inputs take the program's example inputs where it has them (token ids,
positions), zeros otherwise; parameters and constants keep their values; float buffers are
drawn like inputs (a zero state would hide a fusion that ignores the state).
"""

from __future__ import annotations

import math
import operator
import types
from typing import Any, Optional

import torch
from torch import fx
from torch.export.graph_signature import InputKind

from gdn_fx import ops  # noqa: F401  (registers torch.ops.gdn_fx.*, used below)
from gdn_fx.ops import fast_scan_kernel
from gdn_fx.passes.bounds import SAME
from gdn_fx.passes.evaluator import Float64, op_name
from gdn_fx.passes.program import graph_module_of, mutates
from gdn_fx.passes.rebuild import Fusion, rebuild
from gdn_fx.passes.result import VALIDATION_FAILED, Miss

# Bounds on max|rewritten - original| / max|original| per output, by the output's dtype: the
# fused ops compute in f32 whatever their inputs, in another order than an unrolled loop.
BOUNDS = {torch.float64: 1e-5, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
SCALES = (0.5, 0.05)  # input scales tried in turn until the original's outputs are finite
SEED = 20261201
# The wide probes (``Validator._wide_probes``): drawn inputs scaled by each of WIDE, and
# made negative (-|x|) and NEGATIVE times larger; each input alone where at most ALONE.
WIDE = (1e3, 1e5, 1e-6)
NEGATIVE = 1e3
ALONE = 8
NUDGE = 1e-12  # the relative move of a probe's inputs (float64) that must not move its outputs
SCAN_OP = torch.ops.gdn_fx.gated_delta_scan.default
LINEAR_OP = torch.ops.gdn_fx.gated_linear_scan.default


class Validator:
    """The original program run once on probe inputs; rewritten graphs compared against it."""

    def __init__(self, gm: fx.GraphModule, ep: Optional[torch.export.ExportedProgram] = None,
                 example_inputs: Optional[tuple] = None, wide: bool = True,
                 lenient: bool = False):
        self.root = gm
        self.use_wide = wide  # the wide probes too (compare_programs; collapse on request)
        # a wide probe the other program cannot run (in float64: a dtype assert) tells
        # nothing (compare_programs' second way, where that program is the original)
        self.lenient = lenient
        self.placeholders = _placeholders(gm)
        self.fixed = _fixed_values(ep, self.placeholders)
        examples = example_inputs if example_inputs is not None else (
            ep.example_inputs if ep is not None else None)
        self.examples = _user_examples(ep, self.placeholders, examples)
        self.inputs, self.reference, self.failure = None, None, None
        self.finite = []  # per reference tensor: all finite
        self.wide: Optional[list] = None  # (inputs, reference) at the wide probes
        self.roled: dict = {}  # roles -> (inputs, reference) of the probe drawn by role
        self.as_traced: list = []  # probes run as traced besides the ordinary one (by role)

    def _run_original(self) -> None:
        """Run the original once (when a first rewrite needs checking: a program with nothing
        to fuse costs nothing), scaling inputs down until its outputs are finite."""
        for scale in SCALES:
            try:
                self.inputs = self._probe(scale)
                self.reference = self._run(self.root)
            except Exception as error:  # noqa: BLE001 (any failure: nothing to compare with)
                self.failure = f"the original program fails on probe inputs: {_brief(error)}"
                return
            self.finite = [_finite(t) for _, t in self.reference]
            if all(self.finite):
                return

    def mismatch(self, graph: fx.Graph | fx.GraphModule) -> Optional[str]:
        """Why ``graph`` (a rewrite of the original's graph, or a module taking the same
        inputs) does not compute what the original did; None when it does."""
        if self.reference is None and self.failure is None:
            self._run_original()
        if self.failure:
            return self.failure
        module = graph if isinstance(graph, fx.GraphModule) else fx.GraphModule(self.root, graph)
        problem = self._checked(module, self.inputs, self.reference, self.finite)
        if problem is None:
            problem = self._by_role(module)
        if problem is None and self.use_wide:
            for inputs, which, reference, what in self._wide_probes():
                problem = self._checked(module, inputs, reference, None)
                if problem is not None and self._conditioned(inputs, which, reference):
                    return f"{problem}, on inputs {what}"
            problem = None
        return problem

    def _checked(self, module, inputs, reference, finite) -> Optional[str]:
        problem = self._compare(module, inputs, reference, finite, chunks=True)
        if problem is not None and any(n.target in (SCAN_OP, LINEAR_OP)
                                       for n in module.graph.nodes):
            # the verdict is the step-by-step kernel's: the chunked one only speeds up the
            # common case, where it agrees (it rounds differently, so it could err alone)
            problem = self._compare(module, inputs, reference, finite, chunks=False)
        return problem

    def _compare(self, module: fx.GraphModule, inputs, reference, finite,
                 chunks: bool) -> Optional[str]:
        try:
            got = self._run(module, chunks, inputs)
        except Exception as error:  # noqa: BLE001 (a rewrite that does not run is wrong)
            if self.lenient and inputs is not self.inputs:
                return None
            return f"the rewritten program fails: {_brief(error)}"
        if [name for name, _ in got] != [name for name, _ in reference]:
            return (f"the rewritten program hands out {len(got)} tensors, not "
                    f"{len(reference)}")
        finite = finite or [None] * len(reference)
        # a wide probe runs in float64 and is held to the bounds of the dtypes as traced
        dtypes = [t.dtype for _, t in self.reference]
        worst = max((_disagreement(g, w, f, dt) + (name,) for (name, g), (_, w), f, dt in
                     zip(got, reference, finite, dtypes)), key=lambda r: r[0])
        error, bound, name = worst
        if error <= bound:
            return None
        return f"translation validation: '{name}' differs by {error:.3g} relative (bound {bound:g})"

    def _by_role(self, module: fx.GraphModule) -> Optional[str]:
        """Why ``module`` differs from the original where the inputs that are a fused scan's
        gate, decay or beta (through views and casts) are drawn by role, as the meaning
        rules draw them (log gates down to -10, decays in [0, 1], beta over [0, 1] with
        both ends: ``_role_draw``): a floor or cap the ordinary probe's randn * 0.5 never
        reaches shows there. Run as traced (two runs, as the ordinary probe); None when it agrees or
        no input plays such a role."""
        roles = {i: kind for i, kind in _operand_roles(module.graph, self.placeholders).items()
                 if self.placeholders[i].name not in self.fixed and
                 self.placeholders[i].name not in self.examples}
        if not roles:
            return None
        key = tuple(sorted(roles.items()))
        if key not in self.roled:
            generator = torch.Generator().manual_seed(SEED + 2)
            inputs = [_role_draw(roles[i], x, generator) if i in roles else x
                      for i, x in enumerate(self.inputs)]
            self.as_traced.append(inputs)
            try:
                reference = self._run(self.root, True, inputs)
            except Exception:  # noqa: BLE001 (an original that fails there proves nothing)
                reference = None
            self.roled[key] = (inputs, reference)
        inputs, reference = self.roled[key]
        if reference is None:
            return None
        problem = self._checked(module, inputs, reference, [_finite(t) for _, t in reference])
        names = ", ".join(f"{self.placeholders[i].name} as a {kind}" for i, kind in key)
        return None if problem is None else f"{problem}, on inputs drawn by role ({names})"

    def _wide_probes(self) -> list:
        """(inputs, changed, reference, what) at inputs far from the probe's, run in
        float64: a region that equals the original only at small values (a cap of the
        state at 1e3, a floor of the gate at -5) differs there, whatever operation spells
        it. The drawn float inputs are scaled together by each of ``WIDE``, and made
        negative and large (log gates past -100: resets); where they are few, each alone
        too, and each alone all zeros (a fresh state). A probe at which the original hands
        out a value that is not finite is left out (nothing to compare with there)."""
        if self.wide is not None:
            return self.wide
        drawn = [i for i, (node, x) in enumerate(zip(self.placeholders, self.inputs))
                 if node.name not in self.fixed and node.name not in self.examples and
                 isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()]
        # each probe: {input index: its factor}, and what it is in words
        probes = [({i: f for i in drawn}, f"scaled by {f:g}") for f in WIDE] + \
            [({i: -NEGATIVE for i in drawn}, f"made negative and {NEGATIVE:g} times larger")]
        if len(drawn) <= ALONE:
            names = {i: self.placeholders[i].name for i in drawn}
            probes += [({i: f}, f"with {names[i]} scaled by {f:g}" if f else
                        f"with {names[i]} all zeros") for i in drawn
                       for f in (WIDE[1], -NEGATIVE, 0.0)]
            # all small, one of them zero (a fresh state beside small values: a stray
            # epsilon shows there)
            probes += [({j: 0.0 if j == i else WIDE[-1] for j in drawn},
                        f"scaled by {WIDE[-1]:g}, {names[i]} all zeros") for i in drawn]
        self.wide = []
        for factors, what in probes:
            inputs = [_changed(x, factors[i]) if i in factors else _widened(x)
                      for i, x in enumerate(self.inputs)]
            try:
                reference = self._run(self.root, True, inputs)
            except Exception:  # noqa: BLE001 (an original that fails there proves nothing)
                continue
            if all(_finite(t) for _, t in reference):
                self.wide.append((inputs, list(factors), reference, what))
        return self.wide

    def _conditioned(self, inputs: list, which: list, reference: list) -> bool:
        """Whether the original's outputs at ``inputs`` stay within the bounds when the
        changed inputs move by NUDGE (relative): where they do not (a recurrence that grows
        without bound at large keys), two correct programs differ by rounding alone, and
        the probe tells nothing. Asked only of a probe where the programs differ."""
        generator = torch.Generator().manual_seed(SEED + 1)
        moved = [x * (1 + NUDGE * (torch.rand(x.shape, generator=generator,
                                              dtype=torch.float64) * 2 - 1))
                 if i in which else x for i, x in enumerate(inputs)]
        try:
            got = self._run(self.root, True, moved)
        except Exception:  # noqa: BLE001
            return False
        return all(error <= bound / 4 for error, bound in
                   (_disagreement(g, w) for (_, g), (_, w) in zip(got, reference)))

    def settle(self, name: str, graph: fx.Graph, fusions: list[Fusion]
               ) -> tuple[fx.Graph, list[Fusion], list[Miss]]:
        """(graph, fusions kept, near-misses) once every fusion of rule ``name`` on ``graph``
        has been checked; the graph returned is ``graph`` rebuilt with the fusions kept.

        All of them are tried together first; when that disagrees, each one alone, and only
        those that agree are made (and then checked together once more).
        """
        new = rebuild(graph, fusions)
        problem = self.mismatch(new)
        if problem is None:
            return new, fusions, []
        if len(fusions) == 1:
            return graph, [], [Miss(name, problem, node=fusions[0].key, kind=VALIDATION_FAILED)]
        good, misses = [], []
        for fusion in fusions:
            problem = self.mismatch(rebuild(graph, [fusion]))
            if problem is None:
                good.append(fusion)
            else:
                misses.append(Miss(name, problem, node=fusion.key, kind=VALIDATION_FAILED))
        if not good:
            return graph, [], misses
        new = rebuild(graph, good)
        problem = self.mismatch(new)
        if problem is not None:  # each agrees alone but not together: keep none
            return graph, [], misses + [Miss(name, f"together: {problem}", node=f.key,
                                                     kind=VALIDATION_FAILED)
                                        for f in good]
        return new, good, misses

    # --- running ----------------------------------------------------------------------------

    def _probe(self, scale: float) -> list:
        generator = torch.Generator().manual_seed(SEED)
        inputs = []
        for node in self.placeholders:
            if node.name in self.fixed:
                inputs.append(self.fixed[node.name])
            elif node.name in self.examples:
                inputs.append(self.examples[node.name])
            else:
                inputs.append(_draw(node, generator, scale))
        return inputs

    def _run(self, module: fx.GraphModule, chunks: bool = True, inputs=None) -> list:
        """What the program hands out, as (label, tensor): its outputs, then each input
        after the run (a copy, unless the program cannot write: ``_may_write``).
        ``chunks``: whether gated_delta_scan may run chunked; ``inputs``: the probe's (a
        wide one runs in float64; the ordinary one and those of ``as_traced`` as traced)."""
        writes = _may_write(module.graph)
        inputs = self.inputs if inputs is None else inputs
        wide = inputs is not self.inputs and not any(inputs is p for p in self.as_traced)
        args = [a.clone() if writes and isinstance(a, torch.Tensor) and n.name not in self.fixed
                else a for n, a in zip(self.placeholders, inputs)]
        run = Float64(module, rounding=True).run if wide else _direct_forward(module)
        with torch.inference_mode(), fast_scan_kernel(chunks):  # no autograd bookkeeping
            outputs = torch.utils._pytree.tree_leaves(run(*args))
        labelled = [(f"output {i}", t) for i, t in enumerate(outputs)]
        labelled += [(f"input {n.name} after the run", a)
                     for n, a in zip(self.placeholders, args) if n.name not in self.fixed]
        return [(label, t) for label, t in labelled if isinstance(t, torch.Tensor)]


def compare_programs(original: Any, rewritten: Any, example_inputs: Optional[tuple] = None
                     ) -> Optional[str]:
    """Why ``rewritten`` does not compute what ``original`` does, or None when it does.

    Both are ExportedPrograms or GraphModules taking the same inputs (``rewritten`` is, e.g.,
    ``gdn_fx.collapse(original).program``); they run on the same random inputs and every
    output, and every input and buffer after the run, is compared as ``collapse`` does.
    Both ways: a probe where one program's outputs are not finite tells nothing of it (it is
    scaled down, or left out), so where ``original`` is NaN and ``rewritten`` finite (a
    decay's log taken where it is negative), only ``rewritten``'s probes show the two apart.
    """
    gm, ep = graph_module_of(original)
    other, other_ep = graph_module_of(rewritten)
    if len(_placeholders(other)) != len(_placeholders(gm)):
        return (f"the programs take {len(_placeholders(gm))} and {len(_placeholders(other))} "
                "inputs")
    problem = Validator(gm, ep, example_inputs).mismatch(other)
    if problem is None:
        back = Validator(other, other_ep, example_inputs, lenient=True).mismatch(gm)
        problem = None if back is None else f"{back} (comparing the second with the first)"
    return problem


def _may_write(graph: fx.Graph) -> bool:
    """Whether running ``graph`` may write a tensor in place: it calls an op whose schema
    says it mutates, or anything without a schema (a module, a method, a higher-order op).
    A graph that cannot write hands its inputs back as they came, uncopied."""
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.op != "call_function":
            return True
        if node.target is operator.getitem:
            continue
        if getattr(node.target, "_schema", None) is None or mutates(node):
            return True
    return False


def _direct_forward(module: fx.GraphModule):
    """``module``'s generated forward, with every ``torch.ops.<ns>.<op>.<overload>`` it names
    resolved to the overload's C++ entry (``OpOverload._op``, which is all that
    ``OpOverload.__call__`` calls): the same calls without one Python frame each, ~1 us a
    node, ~11 ms of the ~95 ms unrolled original at S = 512 (12,327 nodes). A module with
    hooks (an unlifted export checks its inputs in one) is called as it is."""
    hooks = torch.nn.modules.module
    if module._forward_pre_hooks or module._forward_hooks or \
            hooks._global_forward_pre_hooks or hooks._global_forward_hooks:
        return module
    forward = type(module).forward
    names = dict(forward.__globals__, torch=_DIRECT_TORCH)
    direct = types.FunctionType(forward.__code__, names, forward.__name__,
                                forward.__defaults__, forward.__closure__)
    direct.__kwdefaults__ = forward.__kwdefaults__
    return types.MethodType(direct, module)


class _Lookup:
    """Stands for ``torch``, ``torch.ops``, one namespace or one op packet in a copy of a
    generated forward: each name is looked up once, then kept as an attribute."""

    def __init__(self, real, resolve):
        self._real, self._resolve = real, resolve

    def __getattr__(self, name: str):
        found = self._resolve(getattr(self._real, name), name)
        setattr(self, name, found)
        return found


def _overload(value, name):
    return value._op if type(value).__call__ is torch._ops.OpOverload.__call__ else value


def _packet(value, name):
    return _Lookup(value, _overload) if isinstance(value, torch._ops.OpOverloadPacket) else value


def _namespace(value, name):
    return _Lookup(value, _packet) if isinstance(value, torch._ops._OpNamespace) else value


_DIRECT_TORCH = _Lookup(torch, lambda value, name: _Lookup(value, _namespace)
                        if name == "ops" else value)


def _placeholders(gm: fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _fixed_values(ep, placeholders: list) -> dict:
    """Parameters and constants of an ExportedProgram, which keep their values."""
    if ep is None:
        return {}
    fixed = {}
    for spec, node in zip(ep.graph_signature.input_specs, placeholders):
        if spec.kind is InputKind.TOKEN:
            fixed[node.name] = torch.tensor([])
        elif spec.kind in (InputKind.PARAMETER, InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ,
                           InputKind.BUFFER):
            value = (ep.state_dict if spec.target in ep.state_dict else ep.constants)[spec.target]
            if spec.kind is not InputKind.BUFFER or not value.dtype.is_floating_point:
                fixed[node.name] = value  # floating buffers (caches) are drawn
    return fixed


def _user_examples(ep, placeholders: list, examples) -> dict:
    """Integer and boolean example inputs by placeholder name (token ids, positions, masks)."""
    if examples is None:
        return {}
    leaves = [t for t in torch.utils._pytree.tree_leaves(examples) if isinstance(t, torch.Tensor)]
    if ep is not None:
        users = [n for s, n in zip(ep.graph_signature.input_specs, placeholders)
                 if s.kind is InputKind.USER_INPUT]
    else:
        users = list(placeholders)
    if len(users) != len(leaves):
        return {}
    found = {}
    for node, leaf in zip(users, leaves):
        value = node.meta.get("val")
        if (isinstance(value, torch.Tensor) and not leaf.dtype.is_floating_point
                and leaf.dtype == value.dtype and leaf.dim() == value.dim()):
            found[node.name] = leaf
    return found


def _draw(node: fx.Node, generator: torch.Generator, scale: float) -> Any:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return value
    sizes = [int(d.node.hint) if isinstance(d, torch.SymInt) else int(d) for d in value.shape]
    if value.dtype.is_floating_point:
        # scaled in place: the same values as scale * randn, without a second tensor
        return torch.randn(sizes, generator=generator).mul_(scale).to(value.dtype)
    if value.dtype == torch.bool:
        return torch.ones(sizes, dtype=torch.bool)
    return torch.zeros(sizes, dtype=value.dtype)


# the scans' operands by position: the ones drawn by role (the others stay randn)
ROLE_OPERANDS = {SCAN_OP: {3: "gate", 4: "beta"}, LINEAR_OP: {3: "gate"}}


def _operand_roles(graph: fx.Graph, placeholders: list) -> dict:
    """{placeholder index: 'gate' | 'decay' | 'beta'} for the inputs that are a fused scan's
    gate or beta through views and casts (a log taken outside the node: a decay); an input
    met in two roles is left out."""
    index = {node.name: i for i, node in enumerate(placeholders)}  # another graph's nodes
    roles: dict = {}
    for node in graph.nodes:
        for position, role in ROLE_OPERANDS.get(node.target, {}).items():
            source, kind = node.args[position], role
            while isinstance(source, fx.Node) and source.op != "placeholder" and \
                    source.op == "call_function" and source.args and \
                    op_name(source) in SAME | {"log"}:
                kind = "decay" if op_name(source) == "log" else kind
                source = source.args[0]
            at = index.get(source.name) if isinstance(source, fx.Node) and \
                source.op == "placeholder" else None
            if at is not None:
                roles[at] = kind if roles.get(at, kind) == kind else None
    return {i: kind for i, kind in roles.items() if kind is not None}


def _role_draw(kind: str, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` drawn again as a ``kind`` (``_operand_roles``), in its own dtype: log gates
    -1e-6 .. -10 log-uniformly, one element in 8 exactly 0; a decay exp of one; beta
    uniform in [0, 1], one element in 8 at each end. Not past -10, nor resets: a chunked
    program in f32 loses digits there itself (cumulative gates of 1e4 keep 1e-3 of a
    difference), and the op, which does not, would be told apart from it; the meaning
    rules' float64 draws cover those."""
    unit = torch.rand(x.shape, generator=generator, dtype=torch.float64)
    pick = torch.rand(x.shape, generator=generator, dtype=torch.float64)
    if kind == "beta":
        value = torch.where(pick < 0.125, 0.0, torch.where(pick < 0.25, 1.0, unit))
    else:
        value = torch.where(pick < 0.125, 0.0, -(10.0 ** (unit * 7 - 6)))
        value = value.exp() if kind == "decay" else value
    return value.to(x.dtype)


def _changed(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` in float64, scaled by ``factor``; made negative first when ``factor`` is."""
    x = _widened(x)
    return x * factor if factor >= 0 else x.abs() * factor


def _widened(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in ``tensor``. Any of them makes the sum NaN or infinite, so a
    finite sum proves it at 1/25 the cost of the elementwise test, which decides when the
    sum is not finite (it may overflow)."""
    if not tensor.is_floating_point():
        return True
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _disagreement(got: torch.Tensor, want: torch.Tensor, finite: Optional[bool] = None,
                  traced: Optional[torch.dtype] = None) -> tuple[float, float]:
    """(relative error, bound); an error of inf for a change of shape, dtype or finiteness.
    ``finite``: whether ``want`` is known to be all finite (tested here when None);
    ``traced``: the dtype whose bound applies (``want``'s when None)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf"), 0.0
    bound = BOUNDS.get(traced or want.dtype, 1e-4) if want.is_floating_point() else 0.0
    # most values handed out (inputs left as they were) are equal, or the very tensor (an
    # input that neither program can write is handed back uncopied)
    if got is want or torch.equal(got, want):
        return 0.0, bound
    if not want.is_floating_point():
        return float("inf"), bound
    if finite if finite is not None else _finite(want):
        # a NaN or infinity in ``got`` alone makes the difference's maximum NaN or infinite
        error = _relative(got, want)
        return (error if math.isfinite(error) else float("inf")), bound
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf"), bound
    got, want = got[finite], want[finite]
    if want.numel() == 0:
        return 0.0, bound
    return _relative(got, want), bound


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (want finite and not empty)."""
    scale = want.abs().max().double().item() or 1.0
    if want.dtype not in (torch.float32, torch.float64):  # f16/bf16: the difference may round
        got, want = got.double(), want.double()
    # f32 and f64 differences are taken as they are (the difference of two f32 values is
    # within 6e-8 of itself in f32, far below any bound; an overflow to inf only rejects),
    # without f64 copies of the outputs.
    return (got - want).abs().max().item() / scale


def _brief(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
