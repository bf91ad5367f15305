"""The kernels in Triton, reading and writing the KV pool in place.

Keys are visited in tiles of ``BLOCK_N`` consecutive positions of one sequence; each position's
row is found through the block table (``table[pos // block_size]``, offset ``pos % block_size``),
so any block size works and no context is ever copied into a padded grid. Attention keeps the
online softmax of flash attention in float32: a running maximum ``m``, a running sum ``l`` of
``exp(score - m)`` and an accumulator rescaled whenever ``m`` grows.

Which kernel object runs: ``triton.jit`` for CUDA tensors; Triton's interpreter for CPU tensors
(the only way Triton runs there). The interpreter also needs triton's own library functions
(``tl.sum``, ``tl.max``, ...) built for it, which triton decides once, when it is first imported,
from ``TRITON_INTERPRET``; so on a machine without CUDA this module sets ``TRITON_INTERPRET=1``
before importing triton, unless triton is already imported (then CPU launches raise, saying so).
"""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# a @triton.jit kernel reads only module-level constexprs (a plain float is a compile error on a
# GPU, while the interpreter accepts it)
NEG_INF = tl.constexpr(float("-inf"))


def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_tokens, block_size,
                     s_kt, s_kh, s_vt, s_vh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                     HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """One program per BLOCK_T new tokens: their (Hkv, D) rows of k and v into their slots; -1 skipped."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    block, offset = slot // block_size, slot % block_size
    t3 = t[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    ok = (slot >= 0)[:, None, None] & (h < HKV) & (d < HEAD_DIM)  # (BLOCK_T, BLOCK_H, BLOCK_D)
    k = tl.load(k_ptr + t3 * s_kt + h * s_kh + d, mask=ok)
    v = tl.load(v_ptr + t3 * s_vt + h * s_vh + d, mask=ok)
    k_row = (block * s_kcb + offset * s_kcs)[:, None, None]
    v_row = (block * s_vcb + offset * s_vcs)[:, None, None]
    tl.store(kc_ptr + k_row + h * s_kch + d, k, mask=ok)
    tl.store(vc_ptr + v_row + h * s_vch + d, v, mask=ok)


def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, scale,
                         block_size, tokens_per_split, s_qb, s_qh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                         s_btb, s_ob, s_oh,
                         GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (b, kv head, split): the group's queries over the split's positions of sequence b.

    Writes the partial output (normalised by its own sum) and its log-sum-exp to the mid buffers
    ``(B, Hq, NUM_SPLITS, D)`` / ``(B, Hq, NUM_SPLITS)``; a split past the context writes -inf.
    With one split the partial output is the output, written straight to ``out`` (no merge).
    """
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, ctx)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + h  # (BLOCK_H,) the query heads reading this KV head
    q_ok = (h < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + d[None, :], mask=q_ok, other=0.0)  # (BLOCK_H, BLOCK_D)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n  # (BLOCK_N,)
        p_ok = pos < hi
        block = tl.load(bt_ptr + b * s_btb + pos // block_size, mask=p_ok, other=0).to(tl.int64)
        offset = pos % block_size
        kv_ok = p_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(kc_ptr + block[:, None] * s_kcb + offset[:, None] * s_kcs + kvh * s_kch + d[None, :],
                    mask=kv_ok, other=0.0)  # (BLOCK_N, BLOCK_D)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_H, BLOCK_N)
        s = tl.where(p_ok[None, :], s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # keeps exp(-inf - -inf) out of the sums
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + block[:, None] * s_vcb + offset[:, None] * s_vcs + kvh * s_vch + d[None, :],
                    mask=kv_ok, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), NEG_INF)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * s_ob + head[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=q_ok)
    else:
        row = (b * GROUP * tl.num_programs(1) + head) * NUM_SPLITS + split  # (BLOCK_H,) in (B, Hq, NUM_SPLITS)
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=q_ok)
        tl.store(mid_lse_ptr + row, lse, mask=h < GROUP)


def _decode_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, s_ob, s_oh,
                         GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, kv head): for each query head of the group, the splits' partial outputs weighted
    by exp(lse); zeros where no split saw a key."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    sp = tl.arange(0, BLOCK_S)[None, :]  # (1, BLOCK_S)
    d = tl.arange(0, BLOCK_D)[None, None, :]  # (1, 1, BLOCK_D)
    head = kvh * GROUP + h
    row = (b * GROUP * tl.num_programs(1) + head) * NUM_SPLITS + sp  # (BLOCK_H, BLOCK_S)
    ok = (h < GROUP) & (sp < NUM_SPLITS)
    lse = tl.load(mid_lse_ptr + row, mask=ok, other=NEG_INF)
    m = tl.max(lse, 1)  # (BLOCK_H,)
    w = tl.exp(lse - tl.where(m == NEG_INF, 0.0, m)[:, None])  # (BLOCK_H, BLOCK_S) 0 for empty splits
    parts = tl.load(mid_o_ptr + row[:, :, None] * HEAD_DIM + d, mask=ok[:, :, None] & (d < HEAD_DIM), other=0.0)
    total = tl.sum(w, 1)  # (BLOCK_H,)
    out = tl.sum(parts * w[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]  # (BLOCK_H, BLOCK_D)
    d2 = tl.arange(0, BLOCK_D)[None, :]
    tl.store(out_ptr + b * s_ob + head * s_oh + d2, out.to(out_ptr.dtype.element_ty),
             mask=(h < GROUP) & (d2 < HEAD_DIM))


def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, ctx_ptr, out_ptr, scale, block_size,
                    s_qt, s_qh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_btb, s_ot, s_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (b, query tile, kv head): BLOCK_M new tokens of sequence b times the group's heads.

    Row r of the tile is token ``r // BLOCK_G`` and head ``r % BLOCK_G`` of the group, so every key
    tile is loaded once for all of them; keys run up to the tile's last query position.
    """
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    ctx = tl.load(ctx_ptr + b)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    tok = tile * BLOCK_M + r // BLOCK_G  # (R,) index among the sequence's new tokens
    g = r % BLOCK_G
    row_ok = (tok < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    q_ok = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=q_ok, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = ctx - q_len + tok  # (R,) absolute position of each row's query
    # keys up to the tile's last real query; none for a tile past the sequence's new tokens
    hi = tl.where(tile * BLOCK_M < q_len, ctx - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len), 0)
    m_i = tl.full([BLOCK_M * BLOCK_G], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        pos = start + n
        p_ok = pos < hi
        block = tl.load(bt_ptr + b * s_btb + pos // block_size, mask=p_ok, other=0).to(tl.int64)
        offset = pos % block_size
        kv_ok = p_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(kc_ptr + block[:, None] * s_kcb + offset[:, None] * s_kcs + kvh * s_kch + d[None, :],
                    mask=kv_ok, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (R, BLOCK_N)
        s = tl.where(p_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + block[:, None] * s_vcb + offset[:, None] * s_vcs + kvh * s_vch + d[None, :],
                    mask=kv_ok, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_row[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_ok)


_KERNELS: dict = {}


def _kernel(fn, device: torch.device):
    """``fn`` as a launchable Triton kernel for tensors on ``device`` (interpreted on CPU), made once."""
    interpret = device.type != "cuda"
    if interpret and not isinstance(tl.standard.zeros, InterpretedFunction):
        raise RuntimeError("Triton kernels on CPU tensors run under Triton's interpreter, which needs "
                           "TRITON_INTERPRET=1 in the environment before triton is first imported")
    key = (fn, interpret)
    if key not in _KERNELS:
        _KERNELS[key] = InterpretedFunction(fn) if interpret else triton.jit(fn)
    return _KERNELS[key]


def _pow2(n: int, floor: int = 16) -> int:
    """Tile extent for ``n`` items: a power of two, at least ``floor`` (tl.dot's smallest side)."""
    return max(floor, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs multiply in full precision: TF32 would cost them ~1e-3 of accuracy
    return "ieee" if dtype == torch.float32 else "tf32"


def _widen(q: torch.Tensor) -> bool:
    """Whether 16-bit inputs go through float32 inside the kernels and out: under the interpreter
    they must, since its tl.dot misreads 16-bit operands (values off by ~1e10) and its float32 ->
    bfloat16 cast truncates instead of rounding. On a GPU they stay 16-bit for the tensor cores."""
    return q.device.type != "cuda" and q.dtype != torch.float32


def _rows(table: torch.Tensor) -> torch.Tensor:
    """The kernels step along a block table's rows by one entry: a copy only if that is not so."""
    return table if table.stride(-1) == 1 else table.contiguous()


def _check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"caches must both be (num_blocks, block_size, Hkv, D): {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches need a contiguous last (head_dim) dimension")


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    _check_pool(k_cache, v_cache)
    # cast here, not in the kernel: torch rounds to nearest wherever the kernel runs
    k, v = k.to(k_cache.dtype).contiguous(), v.to(v_cache.dtype).contiguous()
    T, hkv, dim = k.shape
    if T == 0:
        return
    block_h, block_d = triton.next_power_of_2(hkv), triton.next_power_of_2(dim)
    block_t = max(1, min(16, 4096 // (block_h * block_d)))  # tiles of at most 4096 elements
    _kernel(_store_kv_kernel, k.device)[(triton.cdiv(T, block_t),)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), T, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        HKV=hkv, HEAD_DIM=dim, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d)


def decode_splits(max_context: int, block_n: int, splits: int | None = None, max_splits: int = 16,
                  min_tokens: int = 256) -> tuple[int, int]:
    """(splits, tokens per split, a multiple of ``block_n``) for contexts up to ``max_context``.
    By default splits of at least ``min_tokens`` keys (shorter ones do not repay the merge), at most
    ``max_splits``."""
    if splits is None:
        splits = max(1, min(max_splits, -(-max_context // min_tokens)))
    per_split = -(-max(max_context, 1) // splits)
    return splits, -(-per_split // block_n) * block_n


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None):
    """See the package docstring; ``num_splits`` overrides the split count (tests use it to force splits).
    The split count follows the block table's width, not the batch's contexts, so no value is read back
    from the device and a captured graph launches the same grid every step."""
    _check_pool(k_cache, v_cache)
    q, block_tables = q.contiguous(), _rows(block_tables)
    B, hq, dim = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q, dtype=torch.float32 if _widen(q) else q.dtype)
    if B == 0:
        return out.to(q.dtype)
    group = hq // hkv
    block_n = 32
    max_context = block_tables.shape[1] * block_size
    splits, per_split = decode_splits(max_context, block_n, num_splits)
    mid_o = mid_lse = out  # one split writes the output itself: the mid buffers go unused
    if splits > 1:
        mid_o = torch.empty(B, hq, splits, dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, hq, splits, dtype=torch.float32, device=q.device)
    block_d = _pow2(dim)
    _kernel(_decode_split_kernel, q.device)[(B, hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, mid_o, mid_lse, out, scale, block_size, per_split,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), GROUP=group, NUM_SPLITS=splits, HEAD_DIM=dim, BLOCK_H=_pow2(group), BLOCK_D=block_d, BLOCK_N=block_n,
        PRECISION="ieee" if _widen(q) else _precision(q.dtype), DOT_F32=_widen(q))
    if splits > 1:
        _kernel(_decode_merge_kernel, q.device)[(B, hkv)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), GROUP=group, NUM_SPLITS=splits, HEAD_DIM=dim,
            BLOCK_H=triton.next_power_of_2(group), BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return out.to(q.dtype)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                            max_query_len=None):
    """See the package docstring. Tiles of 64 query rows (tokens x the group's heads, padded to powers of two)."""
    _check_pool(k_cache, v_cache)
    q, block_tables = q.contiguous(), _rows(block_tables)
    T, hq, dim = q.shape
    out = torch.zeros_like(q, dtype=torch.float32 if _widen(q) else q.dtype)
    B = context_lens.shape[0]
    if T == 0 or B == 0:
        return out.to(q.dtype)
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    group = hq // hkv
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_g = triton.next_power_of_2(group)
    block_m = max(1, 64 // block_g)
    tiles = -(-max_query_len // block_m)
    _kernel(_prefill_kernel, q.device)[(B, tiles, hkv)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, scale, block_size,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_D=_pow2(dim), BLOCK_N=32,
        PRECISION="ieee" if _widen(q) else _precision(q.dtype), DOT_F32=_widen(q))
    return out.to(q.dtype)
