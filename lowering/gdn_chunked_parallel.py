"""Candidate "chunked_parallel" for gated_delta_scan: the chunked (WY) form with every chunk's
own terms computed at once (batched over chunks), for tract's CUDA runtime (static S).

With the chunk terms of gdn_chunked_text.py (T = (I + A)^-1, U = T diag(beta) V,
W = T diag(beta e^gamma) K, the decays; q and k l2-normalized before the padding, so K and Q
below are the normalized keys and queries), chunk c maps the state S_c entering it to

    S_{c+1} = M_c S_c + B_c,   M_c = e^gamma_C I - K_r^T W,   B_c = K_r^T U,

K_r = diag(e^(gamma_C - gamma)) K, and its output is

    O_c = (Q' - L W) S_c + L U,   Q' = diag(e^gamma scale) Q,   L = Q K^T * E scale

(E the causal decay matrix), the sequential form's Q' S + L (U - W S) regrouped so that the
state meets one matmul.

What the text is shaped by (tract 0.23.9's CUDA runtime, measured on an H200):

- tract's GEMM reads both operands with the contracted axis innermost: a matmul whose right
  operand is [K, N] gets a copy of it transposed first (a "perm_weights" GpuMoveAxis, one
  full-size copy per matmul). So every matmul here is ``matmul(a, b, transposeB = true)``
  of tensors produced in that layout: keys, values, U and W are carried transposed
  ([D, C]) where they are right operands, the state as S^T, the products chosen so that
  each result comes out in the layout its reader wants. Only the block inverse's own
  products (T A T) keep a copy.
- T = (I + A)^-1 is built by doubling the block width (leaf L, then 2L, ... C). For a
  static S each level works on its real blocks (the window: on whole [C, C] matrices,
  below): A's diagonal blocks of width b come straight from a matmul of the
  keys reshaped [C/b, b, Dk] (no slice, no mask over a whole [C, C]), the leaf blocks are
  inverted by the product form, and each doubling (T <- T - T A_21 T, the 2x2 block step)
  works on [C/b, b, b] block stacks, the halves placed on the diagonal by a broadcast
  multiply with a 2x2 identity. Only the last level is [C, C].
- The state pass runs chunk after chunk: one [Dv, Dk] x [Dk, Dk] matmul and one add per
  chunk (n - 1 of each, plus the final state), instead of the log-depth prefix of the maps
  (whose M products cost log2(n) full-size matmuls and copies per level). M and B are read
  per chunk through slices of a reshaped view: tract's PushSliceUp pass (tract-core
  optim/push_split_down.rs) splits an op whose every reader is a slice along one axis into
  one op per piece, and a reshape that merges the sliced axis stops it (AxisOp::slice
  declines), so the batched chunk terms stay batched.
- ranks stay <= 5 (tract's CUDA binary ops merge to rank 5 at most): the block stacks merge
  chunks and heads into one axis.

It serves what "chunked_unrolled" serves (GDN gates, q/k l2norm in the node), any static S.

"chunked_window" is the same text for a symbolic S of at most WINDOW (512) tokens a call,
with the inverse on whole [C, C] matrices (``whole_inverse_lines``: the same products with
0/1 block masks, fewer and larger ops; a window call is bound by launches):
the tokens are zero-padded to the window (zero k and beta, log decay 0: a padded token leaves
the state exactly as it is and its output is cut off), so every shape past the padding is
static. Every call computes the whole window, so it serves only a graph that never runs
decode's one-token calls (a main / decode pair's main graph, ``Target.serves_decode``); the
NNEF records the bound ("gdn_fx_max_tokens"), the generator cuts prompts to it and refuses a
longer call; tract itself fails one (CPU) or aborts (CUDA) on the negative pad, never
computing anything wrong.

Measured on an H200 (bench/bench_cuda.py, Qwen3.5 layer core, f16 q/k/v/beta, f32 state,
State.run with the inputs on the host; bench/RESULTS.md, 20:21 run): S = 4096 in 11.4 ms
against 56.3 for the native CUDA kernel and 13.8 for the text before (6d8602b: block inverse
on whole [C, C] matrices, Hillis-Steele prefix of the maps); S = 512 in 1.78 ms against 6.34.
GPU kernels at S = 4096: 271, 3.41 ms (the text before: 163, 6.9 ms); the rest of the call is
the upload of the 50 MB of inputs through the driver's pageable staging (~6.5-7.5 ms here,
the native kernel's call pays it too; 0.95 ms from page-locked host memory, where the call
takes 4.9 ms against 49.2). Chunks of 64 and 256 and leaves of 8 and 32 were measured too
(20:00 run): 128 / 16 is within noise of the best. Computing only the lower-left block
X = T_22 A_21 T_11 at the last inverse level ([C/2, C/2] products on slices of the h-block
stacks, no [C, C] A or T A T) was measured too (20:36 run): kernels 3.44 -> 3.21 ms at S =
4096 but 6 more launches, and the call no faster (S = 4096 10.54 vs 10.44 ms, S = 512 2.20
vs 1.98, same rotation): not kept (docs/FACTS.md).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gdn_fx.lowering import gdn_chunked, gdn_chunked_text as text
from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.node_facts import ScanFacts
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

PROLOGUE_CONSTANTS = ("cum", "strict", "zero4", "zero3", "scale")
# Chunk sizes measured on an H200 (bench/bench_cuda.py): see bench/RESULTS.md. Shorter S take
# the next power of two (as "chunked_unrolled").
CHUNK = 64
LONG_CHUNK = 128
LONG_FROM = 512  # S from which LONG_CHUNK is taken
LEAF = gdn_chunked.LEAF  # the widest diagonal blocks inverted by the product form


def chunk_for(seq: int) -> int:
    """The chunk a static S is cut into."""
    return chunk_size(seq, LONG_CHUNK if seq >= LONG_FROM else CHUNK)


def chunk_size(seq: int, largest: int) -> int:
    """``largest``, or the next power of two >= S (at least 2) below it."""
    size = 2
    while size < min(seq, largest):
        size *= 2
    return size


def check(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why the batched chunks can not serve this node (None: they can): static S and batch."""
    if target.dynamic or facts.seq is None or facts.batch is None:
        return "the batched chunks need a static S and batch; the export has symbolic axes"
    return gdn_chunked.shared_reason(facts)


def suits(facts: ScanFacts, target: Target) -> Optional[str]:
    """Measured for the CUDA runtime; on the CPU the sequential chunk pass does less work.
    S = 1 is one step: "matmul_step" (or the native kernel) does far less."""
    if facts.seq == 1:
        return "S = 1 is one step: 'matmul_step' computes it without chunk terms"
    if target.runtime != "cuda":
        return ("written for the CUDA runtime: on the CPU 'chunked_unrolled' and 'chunked' "
                "run the same chunk pass with fewer, larger ops")
    return None


def widths(chunk: int, leaf: int = LEAF) -> list[int]:
    """The block widths of the inverse: the leaf (min(leaf, chunk)), doubled up to the chunk."""
    out = [min(chunk, leaf)]
    while out[-1] < chunk:
        out.append(out[-1] * 2)
    return out


def constant_names(chunk: int, leaf: int = LEAF, whole: bool = False) -> tuple[str, ...]:
    if whole:
        return PROLOGUE_CONSTANTS + ("eyec", "eyek", "masko", "leafm") + tuple(
            f"lowerleft{b}" for b in widths(chunk, leaf)[1:])
    return PROLOGUE_CONSTANTS + ("eyel", "eyek", "delta2", "masko") + tuple(
        f"mask{b}" for b in widths(chunk, leaf))


def _blocks(name: str, source: str, heads: str, chunk: int, width: int, tail: str) -> str:
    """``source`` [n, M, g, C, x] as block stacks [n M, g, C / width, width, x]."""
    return (f"{name} = reshape({source}, shape = [-1, {heads}, {chunk // width}, {width},"
            f" {tail}]);")


def inverse_lines(facts: ScanFacts, chunk: int, leaf: int) -> list[str]:
    """T = (I + A)^-1 for every chunk, by block width doubling on real blocks.

    A_ij = beta_i k_i.k_j e^(gamma_i - gamma_j) below the diagonal (k normalized): the
    block stack of width b is matmul(ks_b, k_b^T) * exp(gamma_i - gamma_j + mask_b), with
    ks = beta k (rows) and mask_b the leaf's strict lower triangle (b = leaf) or the
    lower-left (b/2)-block of each b block (0 there, -inf elsewhere)."""
    g = facts.groups
    sizes = widths(chunk, leaf)
    lines = []
    for b in sizes:
        lines += [_blocks(f"kb{b}", "kk", "1", chunk, b, str(facts.dk)),
                  _blocks(f"ksb{b}", "ks", str(g), chunk, b, str(facts.dk)),
                  *(line for part in ("f", "w") for line in (
                      _blocks(f"{part}cb{b}", f"{part}c", str(g), chunk, b, "1"),
                      f"{part}rb{b} = reshape({part}r, shape = [-1, {g}, {chunk // b}, 1,"
                      f" {b}]);")),
                  f"ab{b} = mul(matmul(ksb{b}, kb{b}, transposeB = true),"
                  f" {text.pair_decay(f'cb{b}', f'rb{b}', f'mask{b}')});"]
    first = sizes[0]
    lines += text.inverse_lines(f"ab{first}", f"tb{first}", first, "eyel", "bi")
    for b in sizes[1:]:
        h = b // 2
        lines += [f"te{b} = reshape(mul(reshape(tb{h}, shape = [-1, 2, {h}, 1, {h}]), delta2),"
                  f" shape = [-1, {g}, {chunk // b}, {b}, {b}]);",
                  f"tb{b} = sub(te{b}, matmul(matmul(te{b}, ab{b}), te{b}));"]
    return lines + [f"tt = reshape(tb{chunk}, shape = [{{n}}, -1, {g}, {chunk}, {chunk}]);"]


def whole_inverse_lines(chunk: int, leaf: int) -> list[str]:
    """T = (I + A)^-1 for every chunk on whole [C, C] matrices, fewer and larger ops than
    the block stacks (for the window, bound by launches: bench/RESULTS.md).

    A = matmul(ks, k^T) * dec * strict (dec the causal decays e^(gamma_i - gamma_j), strict
    the strict lower triangle, 0/1); the leaf blocks (A * leafm, leafm 1 on the diagonal
    blocks of width leaf) are inverted together by the product form (their powers stay on
    those blocks), and each doubling to width b is T <- T - T (A * lowerleft_b) T with
    lowerleft_b 1 on the lower-left (b/2)-block of each diagonal b block: T being block
    diagonal, T A_b T is exactly the blocks T_22 A_21 T_11 of the 2x2 block step."""
    sizes = widths(chunk, leaf)
    lines = ["ab = mul(matmul(ks, kk, transposeB = true), mul(dec, strict));",
             "al = mul(ab, leafm);"]
    lines += text.inverse_lines("al", f"tw{sizes[0]}", sizes[0], "eyec", "bi")
    for b in sizes[1:]:
        h = b // 2
        lines.append(f"tw{b} = sub(tw{h}, matmul(matmul(tw{h}, mul(ab, lowerleft{b})),"
                     f" tw{h}));")
    return lines + [f"tt = copy(tw{chunk});"]


def chunk_terms_lines(facts: ScanFacts) -> list[str]:
    """Per chunk, batched over all chunks, each matmul with its operands contracted on their
    last axis: K^T, V^T, U^T, W^T, the map (M, B^T), L and Q'. q and k arrive normalized;
    dec holds the causal decays e^(gamma_i - gamma_j) (0 above the diagonal)."""
    return [f"dec = {text.pair_decay('c', 'r', 'masko')};",
            "ks = mul(kk, bc);",
            "kt = transpose(kk, axes = [0, 1, 2, 4, 3]);",
            "vt = transpose(vv, axes = [0, 1, 2, 4, 3]);"]


def map_lines() -> list[str]:
    return ["ut = matmul(mul(vt, br), tt, transposeB = true);",
            "wt = matmul(mul(kt, mul(br, egr)), tt, transposeB = true);",
            "krt = mul(kt, rr);",
            "mm = sub(mul(ac, eyek), matmul(krt, wt, transposeB = true));",
            "bt = matmul(ut, krt, transposeB = true);"]


def pass_lines(facts: ScanFacts, chunks: int) -> list[str]:
    """The state pass, S^T chunk after chunk: S_{c+1}^T = S_c^T M_c^T + B_c^T, M_c and B_c^T
    read through slices of views that merge the chunk axis with the heads (so tract does not
    split their producers); ``sin`` holds the state entering every chunk, ``fin`` the last."""
    g, dk, dv = facts.groups, facts.dk, facts.dv
    heads = facts.batch * facts.key_heads
    lines = ["st0t = transpose(st0, axes = [0, 1, 3, 2]);",
             f"mmv = reshape(mm, shape = [-1, {g}, {dk}, {dk}]);",
             f"btv = reshape(bt, shape = [-1, {g}, {dv}, {dk}]);"]
    state = "st0t"
    for c in range(chunks):
        rows = f"axes = [0], begin = [{c * heads}], end = [{(c + 1) * heads}]"
        lines.append(f"st{c + 1}t = add(matmul({state}, slice(mmv, {rows}), transposeB = true),"
                     f" slice(btv, {rows}));")
        state = f"st{c + 1}t"
    entering = ", ".join(f"st{c}t" for c in range(chunks))
    sin = f"concat([{entering}], axis = 0)" if chunks > 1 else "st0t"
    return lines + [f"sin = reshape({sin}, shape = [{chunks}, -1, {g}, {dv}, {dk}]);",
                    f"fin = transpose({state}, axes = [0, 1, 3, 2]);"]


def output_lines() -> list[str]:
    """O = L U + (Q' - L W) S for every chunk (S the state entering it, as S^T; qq is q
    scale / |q|, scaled before the padding). The operands are in the order tract visits
    them (its eval order is a depth-first walk from the outputs, inputs in order): L U
    first reaches q, k and then v, so the three large
    uploads come before the block inverse and the state pass (v first met in the state pass
    left the GPU idle during its upload, with those kernels queued behind it)."""
    return ["lam = mul(matmul(qq, kk, transposeB = true), dec);",
            "zz = sub(mul(qq, egc), matmul(lam, wt, transposeB = true));",
            "oo = add(matmul(lam, ut, transposeB = true), matmul(zz, sin, transposeB = true));"]


def definitions(facts: ScanFacts, chunk: int, chunks: int, suffix: str,
                leaf: int = LEAF, pad: Optional[str] = None,
                base: str = "gdn_fx_chunked_parallel", whole: bool = False) -> str:
    """The one fragment of a node configuration: ``chunks`` chunks of ``chunk``, the tokens
    zero-padded by ``pad`` (NNEF text; default: the static S up to whole chunks); the
    inverse on whole [C, C] matrices where ``whole``, else on block stacks."""
    pad = pad or str(chunks * chunk - facts.seq)
    inverse = whole_inverse_lines(chunk, leaf) if whole else \
        [line.replace("{n}", str(chunks)) for line in inverse_lines(facts, chunk, leaf)]
    main = (text.prepare_lines(facts, chunk, pad, suffix, normalized_qk=True)
            + chunk_terms_lines(facts) + inverse
            + map_lines() + pass_lines(facts, chunks) + output_lines()
            + text.finish_lines(facts))
    return common.fragment_text(f"{base}{suffix}",
                                ["q", "k", "v", "g", "beta", "s0",
                                 *constant_names(chunk, leaf, whole)],
                                ["out", "final"], main)


def block_mask(width: int, leaf: int) -> np.ndarray:
    """[1, 1, 1, b, b]: 0 where A's block of width b is read, -inf elsewhere: the strict
    lower triangle at the leaf, the lower-left (b/2)-block above it."""
    rows, cols = np.indices((width, width))
    if width <= leaf:
        keep = rows > cols
    else:
        keep = (rows >= width // 2) & (cols < width // 2)
    return np.where(keep, 0.0, -np.inf).reshape(1, 1, 1, width, width)


def constants(facts: ScanFacts, chunk: int, leaf: int = LEAF) -> dict[str, np.ndarray]:
    """The prologue's helpers (cumulative sums, zeros), the leaf and key identities, the 2x2
    identity that places two half blocks on a block's diagonal, the causal mask of the
    output and the block masks of A; for the whole-matrix inverse the chunk's identity and
    its 0/1 masks (strict lower triangle, leaf blocks, lower-left blocks)."""
    sizes = widths(chunk, leaf)
    rows, cols = np.indices((chunk, chunk))
    values = {name: value for name, value in gdn_chunked.constants(chunk, leaf).items()
              if name in PROLOGUE_CONSTANTS}
    values.update(eyel=np.eye(sizes[0]).reshape(1, 1, 1, sizes[0], sizes[0]),
                  eyek=np.eye(facts.dk).reshape(1, 1, 1, facts.dk, facts.dk),
                  delta2=np.eye(2).reshape(1, 2, 1, 2, 1),
                  masko=np.where(rows >= cols, 0.0, -np.inf).reshape(1, 1, 1, chunk, chunk))
    values.update({f"mask{b}": block_mask(b, sizes[0]) for b in sizes})
    values.update(eyec=np.eye(chunk).reshape(1, 1, 1, chunk, chunk),
                  strict=(rows > cols).astype(np.float64).reshape(1, 1, 1, chunk, chunk),
                  leafm=tiled(chunk, sizes[0], lambda r, c: np.ones_like(r, dtype=bool)))
    values.update({f"lowerleft{b}": tiled(chunk, b, lambda r, c, h=b // 2: (r >= h) & (c < h))
                   for b in sizes[1:]})
    return values


def tiled(chunk: int, width: int, keep) -> np.ndarray:
    """[1, 1, 1, C, C], 0/1: ``keep(rows, cols)`` inside each diagonal block of ``width``,
    0 outside the diagonal blocks."""
    rows, cols = np.indices((chunk, chunk))
    same = rows // width == cols // width
    return (same & keep(rows % width, cols % width)).astype(np.float64).reshape(
        1, 1, 1, chunk, chunk)


def emit(ctx: EmitContext) -> list:
    """Write the batched chunks for one node (static S); returns the fragments it needs."""
    chunk = chunk_for(ctx.facts.seq)
    return _emit(ctx, chunk, -(-ctx.facts.seq // chunk), None, "gdn_fx_chunked_parallel",
                 whole=STATIC_WHOLE)


# --- "chunked_window": a symbolic S of at most WINDOW tokens, padded to the window ----------

WINDOW = 512  # tokens one call may take; the whole window is computed at every S
WINDOW_WHOLE = True  # the window's inverse on whole [C, C] matrices (fewer launches)
STATIC_WHOLE = False  # a static S's inverse on block stacks (less GPU work at long S)


def check_window(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why the window can not serve this node (None: it can): a static batch (the state pass
    is written per head), at most WINDOW tokens where S is static, the chunked form's
    conditions."""
    if facts.batch is None:
        return "the window's state pass is written per head: it needs a static batch"
    if facts.seq is not None and facts.seq > WINDOW:
        return f"S={facts.seq} exceeds the window of {WINDOW} tokens"
    return gdn_chunked.shared_reason(facts)


def suits_window(facts: ScanFacts, target: Target) -> Optional[str]:
    """Measured for a pair's main graph under CUDA (bench/bench_cuda_generate.py): every call
    computes the whole window, so a graph that also serves decode (S = 1) keeps the native
    kernel, and a static S the chunks of its own length. (Not a ``check``: at emission the
    facts are the traced tensors', S static there.)"""
    if not target.dynamic and facts.seq is not None:
        return f"static S={facts.seq}: 'chunked_parallel' writes the chunks of that S"
    if target.runtime != "cuda":
        return ("written for the CUDA runtime: on the CPU 'split' runs a symbolic S at the "
                "cost of its own length")
    if target.serves_decode:
        return (f"the graph serves decode: each one-token call would compute the whole "
                f"window of {WINDOW} tokens (a main / decode pair's main graph takes it)")
    return None


def emit_window(ctx: EmitContext) -> list:
    """Write the window for one node: the tokens zero-padded to WINDOW (beta, k and the log
    decay 0: the state passes padded tokens unchanged), the batched chunks of WINDOW, the
    output cut back to S. More than WINDOW tokens make the pad's length negative, so nothing
    is computed wrong: tract's CPU runtime fails the call ("tensor shape ... is too large"),
    its CUDA runtime aborts the process (it unwraps the failed device allocation; an integer
    guard broadcast first was moved to the GPU too, measured on an H100). Callers keep to the
    bound the NNEF declares (``gdn_fx_max_tokens``): the Generator refuses a longer call."""
    chunk = chunk_for(WINDOW)
    return _emit(ctx, chunk, WINDOW // chunk, f"{WINDOW} - n", "gdn_fx_chunked_window",
                 whole=WINDOW_WHOLE)


def _emit(ctx: EmitContext, chunk: int, chunks: int, pad: Optional[str], base: str,
          whole: bool = False) -> list:
    facts = ctx.facts
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work)
    leaf = LEAF
    values = constants(facts, chunk, leaf)
    consts = [common.scale_variable(ctx, work) if name == "scale" else
              common.variable(ctx, name, values[name], work)
              for name in constant_names(chunk, leaf, whole)]
    name, frag = common.fragment(
        base, lambda suffix: definitions(facts, chunk, chunks, suffix, leaf, pad, base, whole))
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(name, operands + consts, (out, final))
    common.finish_outputs(ctx, out, final)
    return [frag]
