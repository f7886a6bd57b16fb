"""transformers' routed MoE block as one ``tract_moe_ffn`` (tract 0.23.9's fused MoE operator).

What tract computes (tract's ``transformers/src/ops/moe_ffn.rs``; spelling checked against
tract 0.23.9's Python package): ``tract_moe_ffn(x, wg, w1, w2, w3, k = K, activation =
'swiglu', gate = G)`` with x ``[T, D]`` (or ``[B, S, D]``), the router ``wg [E, D]``, and in its
canonical layout the experts ``w1, w3 [E, D, H]`` and ``w2 [E, H, D]``:

    logits = x @ wg^T; each token takes the K experts of largest logit;
    gate "softmax_topk": softmax over those K logits; "softmax_all": softmax over all E logits,
    read at the K chosen (no renormalization);
    y = sum over the K experts e of gate_e * ((silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]).

That is Qwen3.5-MoE's / Qwen3-Next's routed experts (their shared expert stays outside, as
plain ops). torch-to-nnef's own extractor emits the op from the MoE ``nn.Module``, which an
exported program no longer has, so the block is found in the graph here instead: by structure
(two ``transformers::grouped_mm_fallback`` nodes sharing their offsets, the ``topk`` they are
routed by, the tensor both the router and the experts read), and proven by running (the
program's own nodes and :func:`moe_ffn_reference` on random tokens must agree; a block that
does not, e.g. another activation or a router bias, is left to the plain-op spelling of
``moe.py``).

Both of transformers' experts kernels are read: ``grouped_mm`` (the pair of
``grouped_mm_fallback`` nodes above) and ``batched_mm``, which ``prepare_for_nnef`` and so
every generation export selects (a pair of ``bmm`` nodes, each of the rows with
``weight[expert_ids]``: one expert matrix per (token, expert) row, sharing the ids). Tokens
may be of a symbolic count (a generation graph's S): sizes the block computes (``sym_size``
nodes, e.g. S read off ``input_ids`` for the final reshape) are then derived from the tokens'
shape, and the proof draws tokens at each of TOKEN_COUNTS.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional

import torch
import torch.fx as fx
from torch import Tensor

from gdn_fx.errors import UsageError
from gdn_fx.lowering.node_facts import static_dim
from gdn_fx.lowering.t2n.placeholders import active as active_placeholders, resolve as resolve_placeholder
from gdn_fx.lowering.t2n.moe import grouped_mm_op

LOG = logging.getLogger("gdn_fx.lowering")

MOE_BRIDGE = "gdn_fx_moe_ffn"
OP = "tract_moe_ffn"
MIN_VERSION = "0.23.9"
GATES = ("softmax_topk", "softmax_all")

# The lowering choice for transformers' routed MoE blocks (``choose={"transformers_moe": ...}``).
CHOICE_KEY = "transformers_moe"
FUSED, PLAIN = "tract_moe_ffn", "gathered_bmm"
DEFAULT = FUSED  # faster at every size measured (bench/bench_moe.py, docs/benchmarks.md)

# Validation: random tokens, compared at these relative bounds (as the passes' validation).
TRIALS = 3
# Where the token count is symbolic (a generation graph's S): one draw at each of these counts
# (1: decode; 7: more (token, expert) rows than a tiny model has experts; small, because the
# batched_mm spelling evaluated here copies one expert matrix per (token, expert) row).
TOKEN_COUNTS = (1, 2, 7)
BOUNDS = {torch.float32: 1e-4, torch.float16: 5e-3}


# --- what the operator computes -------------------------------------------------------------

def _gate_weights(logits: Tensor, k: int, gate: str) -> tuple[Tensor, Tensor]:
    """(weights [T, k], experts [T, k]) as tract's router picks them (largest logits)."""
    top, experts = torch.topk(logits, k, dim=-1)
    if gate == "softmax_topk":
        return torch.softmax(top, dim=-1), experts
    return torch.softmax(logits, dim=-1).gather(-1, experts), experts


def moe_ffn_reference(x: Tensor, wg: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, k: int,
                      gate: str) -> Tensor:
    """What ``tract_moe_ffn`` computes (module doc), in f32, returned in x's dtype."""
    tokens = x.reshape(-1, x.shape[-1]).float()
    logits = torch.nn.functional.linear(tokens, wg.float())
    weights, experts = _gate_weights(logits, k, gate)
    out = torch.zeros_like(tokens)
    for e in torch.unique(experts).tolist():  # only the experts some token chose
        token, slot = torch.nonzero(experts == e, as_tuple=True)
        rows = tokens[token]
        hidden = torch.nn.functional.silu(rows @ w1[e].float()) * (rows @ w3[e].float())
        out.index_add_(0, token, (hidden @ w2[e].float()) * weights[token, slot, None])
    return out.reshape(x.shape).to(x.dtype)


@torch.library.custom_op(f"t2n_extra::{MOE_BRIDGE}", mutates_args=())
def moe_ffn_bridge(x: Tensor, wg: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, k: int,
                   gate: str) -> Tensor:
    """A routed MoE block that torch-to-nnef writes as ``tract_moe_ffn`` (handler below)."""
    return moe_ffn_reference(x, wg, w1, w2, w3, k, gate)


@moe_ffn_bridge.register_fake
def _(x, wg, w1, w2, w3, k, gate):
    return torch.empty_like(x)


# --- the lowering choice ----------------------------------------------------------------------

def split_choice(choose: Optional[Mapping]) -> tuple[str, Optional[Mapping]]:
    """(MoE lowering, the rest of ``choose`` for the lowering table)."""
    if not isinstance(choose, Mapping) or CHOICE_KEY not in choose:
        return DEFAULT, choose
    value = choose[CHOICE_KEY]
    if value not in (FUSED, PLAIN):
        raise UsageError(f"choose[{CHOICE_KEY!r}] must be {FUSED!r} or {PLAIN!r}, got {value!r}")
    rest = {key: v for key, v in choose.items() if key != CHOICE_KEY}
    return value, rest


def fusion_refused(target) -> Optional[str]:
    """Why this target cannot take ``tract_moe_ffn`` (None: it can)."""
    if not target.at_least(MIN_VERSION):
        return f"tract {target.version_text} has no {OP} (first in {MIN_VERSION})"
    if getattr(target, "runtime", "cpu") != "cpu":
        return f"{OP} measured on tract's CPU runtime only"
    return None


# --- finding the block by structure -----------------------------------------------------------

def _inputs(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def _ancestors(node: fx.Node, stop: frozenset = frozenset()) -> set[fx.Node]:
    """Every node ``node`` reads, transitively, not walking past the nodes in ``stop``."""
    seen, todo = set(), [node]
    while todo:
        for parent in _inputs(todo.pop()):
            if parent not in seen:
                seen.add(parent)
                if parent not in stop:
                    todo.append(parent)
    return seen


def _constant_only(node: fx.Node, cache: dict) -> bool:
    """Whether ``node`` is computed from parameters and buffers alone (no program input)."""
    if node not in cache:
        if node.op == "placeholder":
            cache[node] = False
        elif node.op == "get_attr":
            cache[node] = True
        else:
            cache[node] = all(_constant_only(p, cache) for p in _inputs(node))
    return cache[node]


def _val(node: fx.Node):
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


class Product:
    """One expert product: ``node`` multiplies ``rows`` by the expert weights ``weight``
    ``[E, ., .]`` as routed by ``key`` (a grouped_mm's offsets, a batched_mm's expert ids)."""

    def __init__(self, node: fx.Node, key: fx.Node, weight: fx.Node, rows: fx.Node):
        self.node, self.key, self.weight, self.rows = node, key, weight, rows


def _product(node: fx.Node, grouped) -> Optional[Product]:
    """The expert product ``node`` is, in either of transformers' kernels: ``grouped_mm``
    (``grouped_mm_fallback(rows, weight, offsets)``) or ``batched_mm`` (``bmm`` of the rows
    with ``weight[expert_ids]``, one expert matrix per (token, expert) row)."""
    if grouped is not None and node.target is grouped:
        return Product(node, node.args[2], node.args[1], node.args[0])
    if node.target is not torch.ops.aten.bmm.default:
        return None
    for side, operand in enumerate(node.args[:2]):
        if isinstance(operand, fx.Node) and operand.target is torch.ops.aten.index.Tensor \
                and len(operand.args[1]) == 1 and isinstance(operand.args[1][0], fx.Node):
            return Product(node, operand.args[1][0], operand.args[0], node.args[1 - side])
    return None


class Block:
    """One routed MoE block found by structure: what a fusion candidate is tried from."""

    def __init__(self, up: Product, down: Product, topk: fx.Node, x: fx.Node):
        self.up, self.down, self.topk, self.x = up, down, topk, x

    @property
    def k(self) -> int:
        return int(self.topk.args[1])

    @property
    def name(self) -> str:
        return self.up.node.name


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def _pairs(graph: fx.Graph) -> list[tuple[Product, Product]]:
    """(up, down): the two expert products routed by one key, down reading up."""
    grouped = grouped_mm_op()
    by_key: dict = {}
    for node in graph.nodes:
        product = _product(node, grouped)
        if product is not None:
            by_key.setdefault(product.key, []).append(product)
    return [(up, down) for up, down in (v for v in by_key.values() if len(v) == 2)
            if down.node in _descendants(up.node)]


def _router_topk(key: fx.Node) -> Optional[fx.Node]:
    """The latest ``topk`` the routing key derives from (earlier ones route earlier layers)."""
    order = {n: i for i, n in enumerate(key.graph.nodes)}
    found = [n for n in _ancestors(key) | {key} if n.target is torch.ops.aten.topk.default]
    return max(found, key=order.__getitem__) if found else None


def _tokens_shaped(value, widths: tuple) -> bool:
    """A 2-D float value ``[T, D]``, D static and one of ``widths``; T static or a symbol."""
    if value is None or value.dim() != 2 or not value.is_floating_point():
        return False
    rows, width = value.shape
    return isinstance(width, int) and width in widths and _symbol_or_int(rows)


def _symbol_or_int(size) -> bool:
    return isinstance(size, int) or size.node.expr.is_Symbol


def _token_candidates(up: Product, topk: fx.Node) -> list[fx.Node]:
    """2-D float nodes of the experts' input width that both the router and the experts
    read, latest first: the block's tokens are the latest that everything else derives from
    (a reshape the router alone reads is not)."""
    weight = _val(up.weight)
    widths = tuple(weight.shape[1:]) if weight is not None and weight.dim() == 3 else ()
    common = _ancestors(topk) & _ancestors(up.rows) | ({up.rows} & _ancestors(topk))
    order = {n: i for i, n in enumerate(topk.graph.nodes)}
    shaped = [n for n in common if _tokens_shaped(_val(n), widths)]
    return sorted(shaped, key=order.__getitem__, reverse=True)


def _read_block(up: Product, down: Product) -> tuple[Optional[Block], str]:
    """(the block of one pair of expert products, "") or (None, why it cannot be read)."""
    topk = _router_topk(up.key)
    if topk is None:
        return None, "no topk routes it"
    cache: dict = {}
    candidates = [n for n in _token_candidates(up, topk) if not _constant_only(n, cache)]
    for x in candidates:
        block = Block(up, down, topk, x)
        if _outputs_after(block):
            return block, ""
    if not candidates:
        return None, "no tokens [T, D] (T static or one symbol) that router and experts read"
    return None, ("nothing after the experts is shaped like the tokens and computed from "
                  "them alone")


def find_blocks(graph: fx.Graph, misses: Optional[list] = None) -> list[Block]:
    """Every routed block whose parts are where the structure says (not yet proven); each
    pair of expert products that is not read as one goes to ``misses`` as (name, why)."""
    blocks = []
    for up, down in _pairs(graph):
        block, why = _read_block(up, down)
        if block is not None:
            blocks.append(block)
        elif misses is not None:
            misses.append((up.node.name, why))
    return blocks


# --- proving a block by running it ------------------------------------------------------------

def _size_leaf(node: fx.Node) -> bool:
    """A node that computes a size (``sym_size`` and arithmetic on sizes): the region takes
    it as an input computed from the tokens' shape (:func:`_size_value`), not from the
    program input it was read off (a generation graph reads S off ``input_ids``)."""
    return isinstance(node.meta.get("val"), (torch.SymInt, int)) and node.op != "get_attr"


def _region_nodes(out: fx.Node, x: fx.Node) -> tuple[set, list]:
    """(the nodes ``out`` is computed by from ``x``, the size leaves they read, in order)."""
    seen, todo, leaves = set(), [out], []
    while todo:
        for parent in _inputs(todo.pop()):
            if parent in seen or parent is x:
                continue
            seen.add(parent)
            if _size_leaf(parent):
                leaves.append(parent)
            else:
                todo.append(parent)
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    return (seen - set(leaves)) | {out}, sorted(leaves, key=order.__getitem__)


def _subgraph(module: fx.GraphModule, outputs: list, x: Optional[fx.Node],
              leaves: list = ()) -> fx.GraphModule:
    """A module computing ``outputs`` from ``x`` and ``leaves`` (placeholders, in that order)
    and the module's attributes."""
    stop = frozenset({x, *leaves}) if x is not None else frozenset()
    needed = set(outputs).union(*(_ancestors(o, stop) for o in outputs)) - stop
    graph, env = fx.Graph(), {}
    if x is not None:
        env[x] = graph.placeholder("x")
    for index, leaf in enumerate(leaves):
        env[leaf] = graph.placeholder(f"size{index}")
    for node in module.graph.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(module, graph)


def _token_symbols(x: fx.Node) -> dict:
    """{symbol: axis} of the tokens' symbolic sizes (e.g. {s70: 0} for ``[S, D]``)."""
    return {size.node.expr: axis for axis, size in enumerate(_val(x).shape)
            if not isinstance(size, int)}


def _size_value(leaf: fx.Node, shape: tuple, symbols: dict) -> Optional[int]:
    """What ``leaf`` is when the tokens have ``shape`` (None: it depends on something else)."""
    value = leaf.meta["val"]
    if isinstance(value, int):
        return value
    expr = value.node.expr
    if not expr.free_symbols <= set(symbols):
        return None
    return int(expr.xreplace({s: shape[axis] for s, axis in symbols.items()}))


def _reads_only(out: fx.Node, x: fx.Node) -> bool:
    """Whether ``out`` depends on no program input but through ``x`` (and on constants and
    sizes that ``x``'s shape decides)."""
    nodes, leaves = _region_nodes(out, x)
    symbols = _token_symbols(x)
    shape = tuple(1 if not isinstance(d, int) else d for d in _val(x).shape)
    return all(n.op != "placeholder" for n in nodes) and \
        all(_size_value(leaf, shape, symbols) is not None for leaf in leaves)


def _same_shape(a, b) -> bool:
    """Equal shapes, symbolic sizes compared by expression (no guard is added)."""
    return len(a.shape) == len(b.shape) and all(str(p) == str(q) for p, q in zip(a.shape,
                                                                                   b.shape))


def _outputs_after(block: Block, limit: int = 8) -> list[fx.Node]:
    """Nodes downstream of the down projection shaped like the tokens: where the block may end."""
    want, after = _val(block.x), _descendants(block.down.node)
    shaped = [n for n in block.x.graph.nodes if n in after and _val(n) is not None
              and _same_shape(_val(n), want) and _val(n).dtype == want.dtype]
    return [n for n in shaped[:limit] if _reads_only(n, block.x)]


def _relative(got: Tensor, want: Tensor) -> float:
    scale = want.abs().max().item()
    return (got.float() - want.float()).abs().max().item() / max(scale, 1e-30)


class Proof:
    """How the operator's operands are read off one block, once the program's nodes agreed
    with them: the block's end ``out``, the ``router`` constant node, the ``reading`` of the
    expert stacks ((up transposed, down transposed), :func:`_readings`) and the ``gate``;
    ``like`` holds each operand's shape and dtype (meta tensors)."""

    def __init__(self, out: fx.Node, router: fx.Node, reading: tuple, gate: str, like: dict):
        self.out, self.router, self.reading, self.gate, self.like = (out, router, reading,
                                                                     gate, like)


class _Valued(fx.Interpreter):
    """Runs a module with every attribute it reads passed through ``value`` first."""

    def __init__(self, module: fx.GraphModule, value) -> None:
        super().__init__(module)
        self.value = value

    def get_attr(self, target, args, kwargs):
        return self.value(super().get_attr(target, args, kwargs))


def _stand_ins():
    """What the proof runs the program's constants as: themselves, except the placeholders
    of a streamed export (t2n/placeholders.py: a NaN without values), each a random tensor of
    its shape, the same wherever it is read. The proof is one of structure (which reading
    of the weights the nodes compute): random weights decide it as well as the stored ones.
    Costs one block's expert weights in memory while that block is proven."""
    placeholders = active_placeholders()
    if placeholders is None:
        return lambda tensor: tensor
    generator, drawn = torch.Generator().manual_seed(1), {}

    def value(tensor):
        source = placeholders.source(tensor)
        if source is None:
            return tensor
        if source.name not in drawn:
            # scaled as a trained matrix is (1 / sqrt(fan-in)), so that products at real
            # widths stay O(1): unit draws overflowed f16 in a 256-expert block (no fusion)
            scale = max(source.shape[-2:]) ** -0.5 if len(source.shape) > 1 else 1.0
            drawn[source.name] = (torch.randn(source.shape, generator=generator) * scale
                                  ).to(tensor.dtype)
        return drawn[source.name]
    return value


def _constants(module: fx.GraphModule, nodes: list, value) -> list[Tensor]:
    """The values of constant ``nodes``, each attribute read as ``value`` of it."""
    with torch.no_grad():
        return [t.detach() for t in _Valued(_subgraph(module, nodes, None), value).run()]


def _router_candidates(module: fx.GraphModule, block: Block, experts: int) -> list[fx.Node]:
    """Constant [E, D] nodes the router reads: the router weight is one of them. Sizes are
    compared as ints (``static_dim``), never as SymInts: ``s == 3`` on a symbolic size asks
    torch's ShapeEnv, which records the answer as a guard, and where the example extent was 3
    (a generation export traces S = 3) it specializes the symbol in every node of the program:
    a model with 3 experts had its fused scans lowered for a static S (issue 54, item 5)."""
    cache: dict = {}
    width = static_dim(_val(block.x).shape[-1])
    return [n for n in _ancestors(block.topk, frozenset({block.x}))
            if _val(n) is not None and tuple(map(static_dim, _val(n).shape)) == (experts, width)
            and _val(n).is_floating_point() and _constant_only(n, cache)]


def _readings(up_shape, down_shape, width: int) -> list[tuple[bool, bool]]:
    """Every (up transposed, down transposed) under which the stored expert stacks are
    tract's layout (w1, w3 ``[E, D, H]``, w2 ``[E, H, D]``): grouped_mm reads ``[E, D, 2H]``
    and ``[E, H, D]``, batched_mm transformers' own ``[E, 2H, D]`` and ``[E, D, H]``; where
    D = 2H both orientations are tried (which one the program computes is decided by
    running it). The gate half comes first (transformers' chunk(2) of gate_up)."""
    found = []
    for up_t in (False, True):
        rows, cols = (up_shape[2], up_shape[1]) if up_t else (up_shape[1], up_shape[2])
        if rows != width or cols % 2:
            continue
        for down_t in (False, True):
            inner, outer = (down_shape[2], down_shape[1]) if down_t else down_shape[1:]
            if outer == width and inner == cols // 2:
                found.append((up_t, down_t))
    return found


def _up_halves(up: Tensor, transposed: bool) -> tuple[Tensor, Tensor]:
    """(w1, w3): the gate and up halves of a stored gate_up stack, in tract's layout."""
    up = up.transpose(1, 2) if transposed else up
    half = up.shape[-1] // 2
    return up[..., :half], up[..., half:]


def _down(down: Tensor, transposed: bool) -> Tensor:
    """w2 of a stored down stack, in tract's layout."""
    return down.transpose(1, 2) if transposed else down


def _region_runs(module: fx.GraphModule, block: Block, out: fx.Node, draws: list,
                 value) -> list:
    """What the program's own nodes make of each draw of tokens, from ``x`` to ``out``
    (attributes read as ``value`` of them)."""
    _, leaves = _region_nodes(out, block.x)
    region = _Valued(_subgraph(module, [out], block.x, leaves), value)
    symbols = _token_symbols(block.x)
    with torch.no_grad():
        return [region.run(x, *(_size_value(leaf, tuple(x.shape), symbols)
                                for leaf in leaves))[0] for x in draws]


def prove(module: fx.GraphModule, block: Block) -> tuple[Optional[Proof], str]:
    """(how to read the operands, "") when one reading of the block computes what the
    program does on random tokens (at a few token counts where their count is symbolic),
    else (None, why not)."""
    cache: dict = {}
    if not all(_constant_only(n, cache) for n in (block.up.weight, block.down.weight)):
        return None, "the expert weights are computed from a program input"
    value = _stand_ins()
    up_w, down_w = _constants(module, [block.up.weight, block.down.weight], value)
    if up_w.dim() != 3 or down_w.dim() != 3:
        return None, f"expert weights {tuple(up_w.shape)}, {tuple(down_w.shape)}"
    readings = _readings(up_w.shape, down_w.shape, _val(block.x).shape[-1])
    bound = BOUNDS.get(_val(block.x).dtype)
    if bound is None:
        return None, f"tokens are {_val(block.x).dtype}"
    if not readings:
        return None, f"expert weights {tuple(up_w.shape)}, {tuple(down_w.shape)}"
    routers = _router_candidates(module, block, up_w.shape[0])
    weights = dict(zip(routers, _constants(module, routers, value))) if routers else {}
    draws = _draws(block)
    rows = sum(x.numel() // x.shape[-1] for x in draws)
    for out in _outputs_after(block):
        wants = _region_runs(module, block, out, draws, value)
        for router, gate, reading in ((r, g, o) for r in weights for g in GATES
                                      for o in readings):
            (w1, w3), w2 = _up_halves(up_w, reading[0]), _down(down_w, reading[1])
            agreed = [_agreeing_rows(x, want, (weights[router], w1, w2, w3), block.k, gate,
                                     bound) for x, want in zip(draws, wants)]
            if None not in agreed and 2 * sum(agreed) >= rows:
                like = {name: torch.empty(t.shape, dtype=t.dtype, device="meta")
                        for name, t in zip(("wg", "w1", "w2", "w3"),
                                           (weights[router], w1, w2, w3))}
                return Proof(out, router, reading, gate, like), ""
    return None, (f"no reading of the block (router among {len(weights)} [E, D] constants, "
                  f"gate {' or '.join(GATES)}, SwiGLU experts) computes what its nodes do")


def _decided(x: Tensor, wg: Tensor, k: int, bound: float) -> Tensor:
    """Which tokens of ``x`` are routed without a near-tie: the k-th router logit (in f32)
    above the next by more than ``bound`` times the largest. At a near-tie the program (in
    its dtype) and the f32 reference may pick different experts, which says nothing of what
    the block computes: f16 blocks of 256 random router rows hit such ties."""
    logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), wg.float())
    if k >= logits.shape[-1]:
        return torch.ones(logits.shape[0], dtype=torch.bool)
    top = torch.topk(logits, k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k] > bound * logits.abs().max()


def _agreeing_rows(x: Tensor, want: Tensor, weights: tuple, k: int, gate: str,
                   bound: float) -> Optional[int]:
    """How many tokens of ``x`` were compared, when the operator's reference agrees with
    what the program made of them (``want``) on every token routed without a near-tie;
    None when it does not."""
    rows = _decided(x, weights[0], k, bound)
    if not bool(rows.any()):
        return 0
    got = moe_ffn_reference(x, *weights, k, gate).reshape(-1, x.shape[-1])
    ok = _relative(got[rows], want.reshape(-1, x.shape[-1])[rows]) <= bound
    return int(rows.sum()) if ok else None


def _warn_ties(wg: Tensor, block: Block) -> None:
    """Warn when two router rows are equal: those experts tie on every token, torch's topk
    keeps the lower index and tract's (in tract_moe_ffn as in the plain spelling's
    ``tract_core_topk``) may keep the other, so tract then routes, and answers, differently.
    A router that is still zero-initialized (transformers builds one so) is all ties."""
    distinct = torch.unique(wg, dim=0).shape[0]
    if distinct < wg.shape[0]:
        LOG.warning("MoE block at %s: the router has %d repeated rows of %d; tied experts "
                    "may be picked differently by tract than by torch", block.name,
                    wg.shape[0] - distinct, wg.shape[0])


def _draws(block: Block) -> list[Tensor]:
    """Random tokens: TRIALS draws at the traced shape, or, where the token count is
    symbolic, one draw at each of TOKEN_COUNTS tokens."""
    generator = torch.Generator().manual_seed(0)
    value = _val(block.x)
    if not _token_symbols(block.x):
        shapes = [tuple(value.shape)] * TRIALS
    else:
        shapes = [tuple(d if isinstance(d, int) else count for d in value.shape)
                  for count in TOKEN_COUNTS]
    return [torch.randn(shape, generator=generator).to(value.dtype) for shape in shapes]


# --- the rewrite ------------------------------------------------------------------------------

_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def _attribute(module: fx.GraphModule, name: str, value: Tensor) -> fx.Node:
    # A frozen Parameter, so that the weight formats (t2n/weights.py) store it as the others.
    setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    node = module.graph.get_attr(name)
    node.meta["val"] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    return node


def _operands(module: fx.GraphModule, block: Block, proof: Proof) -> dict[str, Tensor]:
    """{wg, w1, w2, w3}: the operator's weights, read off the program's constants as the
    proof read them. In a streamed export, one computed from a placeholder is a placeholder
    too, whose source computes it from the stored weights when the writer writes it: the
    expert stacks are never in memory before (one block's at a time, then)."""
    up_t, down_t = proof.reading
    reads = {"wg": (proof.router, lambda t: t),
             "w1": (block.up.weight, lambda t: _up_halves(t, up_t)[0]),
             "w2": (block.down.weight, lambda t: _down(t, down_t)),
             "w3": (block.up.weight, lambda t: _up_halves(t, up_t)[1])}
    placeholders, operands = active_placeholders(), {}
    for name, (node, part) in reads.items():
        constant = _subgraph(module, [node], None)  # a copy: the block's nodes go below

        def load(constant=constant, part=part) -> Tensor:
            with torch.no_grad():
                return part(_Valued(constant, resolve_placeholder).run()[0].detach()).contiguous()
        stored = [t for t in (*constant.parameters(), *constant.buffers())
                  if placeholders is not None and placeholders.source(t) is not None]
        if not stored:
            operands[name] = load()
        else:
            like = proof.like[name]
            operands[name] = placeholders.make(f"{block.name}.{name}", like.shape, like.dtype,
                                               load)
    return operands


def _fuse(module: fx.GraphModule, block: Block, proof: Proof, index: int) -> None:
    graph, out = module.graph, proof.out
    values = _operands(module, block, proof)
    _warn_ties(resolve_placeholder(values["wg"]), block)  # the stored router: small
    with graph.inserting_before(out):
        operands = [_attribute(module, f"gdn_fx_moe{index}_{name}", value)
                    for name, value in values.items()]
        fused = graph.call_function(torch.ops.t2n_extra.gdn_fx_moe_ffn.default,
                                    (block.x, *operands, block.k, proof.gate))
    fused.meta["val"] = out.meta["val"]
    out.replace_all_uses_with(fused)
    # What only the block used goes: walk back from its old end, erasing what has no users.
    nodes, leaves = _region_nodes(out, block.x)
    region = sorted(nodes | set(leaves), key={n: i for i, n in enumerate(graph.nodes)}.__getitem__,
                    reverse=True)
    for node in region:
        # export's dtype assertions on the block's values would keep the whole block alive
        for user in [u for u in node.users if u.target is _ASSERT_METADATA]:
            graph.erase_node(user)
        if not node.users and node.op != "placeholder" and not node.is_impure():
            graph.erase_node(node)


def fuse_moe_blocks(module: fx.GraphModule, target) -> int:
    """Replace, in place, every proven routed MoE block by one ``tract_moe_ffn`` bridge op;
    how many. A block that is not proven is left for ``moe.py``'s plain ops (logged why)."""
    refused = fusion_refused(target)
    misses: list = []
    blocks = find_blocks(module.graph, misses)
    for name, why in misses:
        LOG.info("expert products at %s not read as a routed MoE block (%s): plain ops",
                 name, why)
    if refused is not None:
        if blocks:
            LOG.info("%d MoE blocks left as plain ops: %s", len(blocks), refused)
        return 0
    count = 0
    for block in blocks:
        proof, why = prove(module, block)
        if proof is None:
            LOG.info("MoE block at %s left as plain ops: %s", block.name, why)
            continue
        _fuse(module, block, proof, count)
        count += 1
    if count:
        module.graph.lint()
        module.recompile()
    return count


# --- torch-to-nnef handler --------------------------------------------------------------------

def _register_handler() -> None:
    from torch_to_nnef.op.extras import register

    @register(MOE_BRIDGE)
    def gdn_fx_moe_ffn(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
        """``t2n_extra::gdn_fx_moe_ffn`` -> ``tract_moe_ffn`` (canonical expert layout)."""
        from nnef_tools.model import Operation as NOperation
        from torch_to_nnef.op.helper import add_tensor_variable_node_as_nnef_tensor

        tensors = [op_helper.get_or_add_tensor_variable_in_nnef(n) for n in node.inputs[:5]]
        k, gate = (n.data for n in node.inputs[5:7])
        out = add_tensor_variable_node_as_nnef_tensor(g, node.outputs[0], name_to_tensor,
                                                      prevent_variable=True)
        NOperation(g, type=OP, inputs=tuple(tensors), outputs=(out,),
                   attribs={"k": int(k), "activation": "swiglu", "gate": gate})
        return ["tract_transformers"]


_register_handler()
