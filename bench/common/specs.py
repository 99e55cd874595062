"""The one list of benchmark shapes, and the inputs they describe.

Heads are `(num_qo_heads, num_kv_heads, head_dim)` of real models. A decode
spec is `batch_size` sequences at full length `seq_len` (every sequence
reads `seq_len` keys); a prefill spec is ragged: `q_lens[b]` new tokens of
sequence `b` over `kv_lens[b]` keys (the new tokens included, as in
`pkvattn.paged_prefill`), causal, with an optional `window_left`.

Inputs are random bf16 on shuffled pages in FlashInfer's NHD layout
`[num_pages, 2, page_size, num_kv_heads, head_dim]` (pkvattn's
"flashinfer" kv_cache format), so pkvattn and FlashInfer read the very same
buffers; pages no sequence owns hold NaN, so a kernel that reads past its
pages shows in its output.

`select(specs, text)` picks specs by comma-separated names, indices or
group names (`PrefillSpec.groups`), the `--specs` flag of every benchmark.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

HEADS = {
    "llama3_8b": (32, 8, 128),
    "llama3_70b": (64, 8, 128),
    "llama3_2_1b": (32, 8, 64),
    "smollm2": (9, 3, 64),
    "g6_d128": (48, 8, 128),
    "qwen2_7b": (28, 4, 128),
    "mistral_7b": (32, 8, 128),
    "gemma3_270m": (4, 1, 256),
    "gemma2_2b": (8, 4, 256),
    "gemma2_9b": (16, 8, 256),
}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SPARE_PAGES = 8


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """`batch_size` sequences of `seq_len` cached tokens, one query each.

  `table_pages`: the page table's width (an engine sizes it for
  `max_model_len`, not for the sequences' length); 0 = just the sequences'
  pages. Entries past a sequence's pages name NaN pages. `groups`: the
  benchmark sets the spec belongs to (`select`)."""
  heads: str
  batch_size: int
  seq_len: int
  page_size: int = 16
  table_pages: int = 0
  groups: tuple[str, ...] = ()

  @property
  def name(self) -> str:
    table = f"_t{self.table_pages}" if self.table_pages else ""
    return (f"{self.heads}_b{self.batch_size}_s{self.seq_len}{table}"
            f"_p{self.page_size}")

  @property
  def max_pages(self) -> int:
    """The page table's width."""
    return max(self.table_pages, -(-self.seq_len // self.page_size))

  @property
  def shape(self) -> tuple[int, int, int]:
    return HEADS[self.heads]


DECODE = [
    DecodeSpec("llama3_8b", 64, 4096, 16),
    DecodeSpec("llama3_8b", 64, 4096, 64),
    DecodeSpec("llama3_8b", 8, 16384, 16),
    DecodeSpec("llama3_8b", 256, 1024, 16),
    DecodeSpec("smollm2", 64, 4096, 16),
    DecodeSpec("smollm2", 256, 1024, 16),
    DecodeSpec("g6_d128", 64, 4096, 16),
    DecodeSpec("gemma3_270m", 64, 4096, 16),
    DecodeSpec("gemma3_270m", 256, 1024, 16),
]
# The engine's regime (group "short"): hundreds of rows, tens to hundreds of
# keys, the table sized for a 1,024-token max_model_len (64 pages of 16).
DECODE_SHORT = [
    DecodeSpec(h, b, s, 16, table_pages=64, groups=("short",))
    for h in ("smollm2", "llama3_2_1b", "llama3_8b", "gemma3_270m")
    for b in (64, 256) for s in (32, 80, 256, 1024)
]
# Extra decode shapes, by name only (`--specs`): the engine's Llama-3.2-1B
# heads and the page sizes of the Hopper page-size sweep.
DECODE_EXTRA = [
    DecodeSpec("llama3_2_1b", 256, 1024, 16),
    DecodeSpec("llama3_2_1b", 64, 4096, 16),
    *[DecodeSpec(h, 64, 4096, ps) for h in ("smollm2", "llama3_2_1b",
                                             "llama3_8b")
      for ps in (8, 32, 128)],
    *DECODE_SHORT,
]


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
  """One paged prefill call: `q_lens[b]` new tokens over `kv_lens[b]` keys.

  `groups` names the benchmark sets the spec belongs to ("main": the
  default set; "window", "d64", "d256", "fp8", "mixed", "engine")."""
  name: str
  heads: str
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...]
  page_size: int = 16
  window_left: int = -1
  groups: tuple[str, ...] = ()

  @property
  def shape(self) -> tuple[int, int, int]:
    return HEADS[self.heads]

  @property
  def is_prompt(self) -> bool:
    """Every sequence a whole prompt of one length (q_len == kv_len)."""
    return (self.q_lens == self.kv_lens) and len(set(self.q_lens)) == 1

  @property
  def num_tokens(self) -> int:
    return int(sum(self.q_lens))


def _p(name, heads, parts, page_size=16, window_left=-1, groups=()):
  """A spec from `parts = [(sequences, q_len, kv_len), ...]`."""
  q = tuple(ql for n, ql, _ in parts for _ in range(n))
  kv = tuple(kl for n, _, kl in parts for _ in range(n))
  return PrefillSpec(name, heads, q, kv, page_size, window_left, groups)


PREFILL = [
    # Prompts, Llama-3-8B heads.
    _p("llama3_8b_b4_s4096_p16", "llama3_8b", [(4, 4096, 4096)],
       groups=("main",)),
    _p("llama3_8b_b1_s16384_p16", "llama3_8b", [(1, 16384, 16384)],
       groups=("main",)),
    _p("llama3_8b_b4_s4096_p64", "llama3_8b", [(4, 4096, 4096)], 64,
       groups=("main",)),
    _p("llama3_8b_b2_s2048", "llama3_8b", [(2, 2048, 2048)]),
    _p("llama3_8b_b8_s512", "llama3_8b", [(8, 512, 512)], groups=("engine",)),
    # Engine steps: prompts with decode rows, chunks, verify steps.
    _p("llama3_8b_mixed_2x2048_64x1_kv4096", "llama3_8b",
       [(2, 2048, 2048), (64, 1, 4096)], groups=("main", "mixed")),
    _p("llama3_8b_mixed_4x512_60x4_64x1_kv2048", "llama3_8b",
       [(4, 512, 2048), (60, 4, 2048), (64, 1, 2048)],
       groups=("mixed", "engine")),
    _p("llama3_8b_mixed_2x1024_16x3_16x1_kv4096", "llama3_8b",
       [(2, 1024, 1024), (16, 3, 4096), (16, 1, 4096)],
       groups=("mixed", "engine")),
    _p("llama3_8b_verify_64x4_kv2048", "llama3_8b", [(64, 4, 2048)],
       groups=("engine",)),
    _p("llama3_70b_verify_64x4_kv2048", "llama3_70b", [(64, 4, 2048)],
       groups=("engine",)),
    _p("llama3_8b_chunk_b8_q512_kv8192", "llama3_8b", [(8, 512, 8192)],
       groups=("engine",)),
    _p("llama3_70b_chunk_b4_q1024_kv4096", "llama3_70b",
       [(4, 1024, 4096)]),
    _p("qwen2_7b_b8_s1024", "qwen2_7b", [(8, 1024, 1024)]),
    _p("smollm2_mixed_4x512_124x1_kv2048", "smollm2",
       [(4, 512, 512), (124, 1, 2048)], groups=("mixed",)),
    # Head_dim 64.
    _p("llama3_2_1b_b4_s4096_p16", "llama3_2_1b", [(4, 4096, 4096)],
       groups=("main", "d64")),
    _p("smollm2_b4_s4096_p16", "smollm2", [(4, 4096, 4096)],
       groups=("main", "d64")),
    _p("smollm2_b64_s256", "smollm2", [(64, 256, 256)], groups=("d64",)),
    _p("smollm2_b32_s512", "smollm2", [(32, 512, 512)], groups=("d64",)),
    _p("smollm2_b16_s1024", "smollm2", [(16, 1024, 1024)], groups=("d64",)),
    # Sliding windows.
    _p("mistral_7b_b2_s8192_w4096", "mistral_7b", [(2, 8192, 8192)],
       window_left=4096, groups=("window",)),
    _p("llama3_8b_chunk_b8_q512_kv8192_w2048", "llama3_8b",
       [(8, 512, 8192)], window_left=2048, groups=("window",)),
    _p("smollm2_b4_s4096_w1024", "smollm2", [(4, 4096, 4096)],
       window_left=1024, groups=("window",)),
    _p("smollm2_b64_s256_w128", "smollm2", [(64, 256, 256)],
       window_left=128, groups=("window",)),
    # Head_dim 256 (Gemma 2 / Gemma 3 layers).
    _p("gemma3_270m_b16_s512", "gemma3_270m", [(16, 512, 512)],
       groups=("d256",)),
    _p("gemma3_270m_b4_s2048", "gemma3_270m", [(4, 2048, 2048)],
       groups=("d256", "fp8")),
    _p("gemma3_270m_b4_s2048_w511", "gemma3_270m", [(4, 2048, 2048)],
       window_left=511, groups=("d256", "window")),
    _p("gemma2_2b_b4_s2048", "gemma2_2b", [(4, 2048, 2048)],
       groups=("d256",)),
    _p("gemma2_9b_b2_s4096", "gemma2_9b", [(2, 4096, 4096)],
       groups=("d256",)),
    _p("gemma3_270m_verify_64x4_kv4096", "gemma3_270m", [(64, 4, 4096)],
       groups=("engine",)),
    _p("gemma2_2b_verify_64x4_kv4096", "gemma2_2b", [(64, 4, 4096)],
       groups=("engine",)),
    # FP8 pages: short chunks read FP8 in the kernel, long prompts gather
    # and dequantize first.
    _p("llama3_8b_b4_s4096_fp8", "llama3_8b", [(4, 4096, 4096)],
       groups=("fp8",)),
    _p("gemma3_270m_b16_q128_kv2048", "gemma3_270m", [(16, 128, 2048)],
       groups=("fp8",)),
    _p("gemma3_270m_b16_q128_kv2048_w511", "gemma3_270m", [(16, 128, 2048)],
       window_left=511, groups=("fp8",)),
    _p("gemma3_270m_mixed_2x256_62x1_kv2048", "gemma3_270m",
       [(2, 256, 256), (62, 1, 2048)], groups=("fp8", "mixed")),
    _p("gemma2_9b_b4_q128_kv4096", "gemma2_9b", [(4, 128, 4096)],
       groups=("fp8",)),
]


def select(specs, text: str | None, default_group: str | None = None):
  """The specs `text` names: comma-separated names, indices into `specs`,
  or group names; None / "" gives `default_group`'s specs (all specs if
  None), "all" every spec.

  Raises:
    ValueError: a name that is no spec, index or group.
  """
  if not text:
    if default_group is None:
      return list(specs)
    return [s for s in specs if default_group in getattr(s, "groups", ())]
  if text == "all":
    return list(specs)
  out = []
  for part in text.split(","):
    hit = [s for s in specs if s.name == part]
    if not hit and part.isdigit() and int(part) < len(specs):
      hit = [specs[int(part)]]
    if not hit:
      hit = [s for s in specs if part in getattr(s, "groups", ())]
    if not hit:
      names = [s.name for s in specs]
      raise ValueError(f"--specs: {part!r} is no spec, index or group; "
                       f"expected one of {names}")
    out += [s for s in hit if s not in out]
  return out


# --------------------------------------------------------------------------
# Inputs.
# --------------------------------------------------------------------------

def quantize_fp8(x, scale):
  """`x / scale` saturated to +-448, as float8_e4m3fn (the stored value of
  an FP8 page; vLLM's and FlashInfer's per-tensor convention)."""
  y = x.astype(jnp.float32) * (1.0 / jnp.float32(scale))
  return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def fp8_pages(kv_cache, page_table):
  """`kv_cache [num_pages, 2, page_size, H, D]` -> `(FP8 pages, k_scale,
  v_scale)`: per-tensor scales, the amax of the pages `page_table` names
  mapped to 448."""
  used = jnp.asarray(np.unique(np.asarray(page_table)[np.asarray(
      page_table) >= 0]))
  amax = [float(jnp.max(jnp.abs(kv_cache[used, i].astype(jnp.float32))))
          for i in (0, 1)]
  ks, vs = (a / FP8_MAX for a in amax)
  kv8 = jnp.stack([quantize_fp8(kv_cache[:, 0], ks),
                   quantize_fp8(kv_cache[:, 1], vs)], axis=1)
  return kv8, ks, vs


def decode_inputs(spec: DecodeSpec, seed: int = 0, num_layers: int = 0):
  """`(q, kv_cache, page_table, kv_lens)` of a decode spec: q
  `[batch_size, num_qo_heads, head_dim]` (`[num_layers, ...]` with
  `num_layers`), the cache `[num_pages, 2, page_size, num_kv_heads,
  head_dim]` bf16 with NaN spare pages, page_table `i32[batch_size,
  spec.max_pages]` (numpy, shuffled; entries past a sequence's pages name
  NaN pages), kv_lens `i32[batch_size]` (numpy)."""
  hq, hkv, d = spec.shape
  b, s, ps = spec.batch_size, spec.seq_len, spec.page_size
  pages_per_seq = -(-s // ps)
  n_pages = b * pages_per_seq + SPARE_PAGES
  kk, kq, kp = jax.random.split(jax.random.key(seed), 3)
  kv = jax.random.normal(kk, (n_pages, 2, ps, hkv, d), jnp.bfloat16)
  perm = np.asarray(jax.random.permutation(kp, n_pages)).astype(np.int32)
  table = perm[:b * pages_per_seq].reshape(b, pages_per_seq)
  kv = kv.at[perm[b * pages_per_seq:]].set(jnp.nan)
  if spec.max_pages > pages_per_seq:
    spare = perm[b * pages_per_seq:]
    pad = spare[np.arange(b * (spec.max_pages - pages_per_seq))
                % len(spare)].reshape(b, -1)
    table = np.concatenate([table, pad], axis=1)
  shape = ((num_layers,) if num_layers else ()) + (b, hq, d)
  q = jax.random.normal(kq, shape, jnp.bfloat16)
  return q, kv, table, np.full((b,), s, np.int32)


def decode_bytes(spec: DecodeSpec, kv_itemsize: int = 2) -> int:
  """Bytes a decode call moves: q + out (bf16) + the K/V of every touched
  page (decimal units in the figures derived from it)."""
  hq, hkv, d = spec.shape
  touched = spec.batch_size * -(-spec.seq_len // spec.page_size) \
      * spec.page_size
  return (2 * spec.batch_size * hq * d * 2
          + 2 * touched * hkv * d * kv_itemsize)


def prefill_inputs(spec: PrefillSpec, seed: int = 0):
  """A prefill spec's inputs: dict with `q [num_tokens, num_qo_heads,
  head_dim]`, contiguous `k`, `v` `[batch_size, max_len, num_kv_heads,
  head_dim]` (for contiguous peers), the paged copy `kv_cache [num_pages,
  2, page_size, num_kv_heads, head_dim]` (shuffled pages, NaN in spares),
  `page_table` (numpy, `i32[batch_size, max_pages]`), `q_indptr`,
  `kv_lens` (numpy), all bf16."""
  hq, hkv, d = spec.shape
  ps = spec.page_size
  batch_size = len(spec.kv_lens)
  kq, kk, kv_, kp = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (spec.num_tokens, hq, d), jnp.bfloat16)
  max_pages = -(-max(spec.kv_lens) // ps)
  shape = (batch_size, max_pages * ps, hkv, d)
  k = jax.random.normal(kk, shape, jnp.bfloat16)
  v = jax.random.normal(kv_, shape, jnp.bfloat16)
  num_pages = batch_size * max_pages + SPARE_PAGES
  perm = np.asarray(jax.random.permutation(kp, num_pages)).astype(np.int32)
  table = perm[:batch_size * max_pages].reshape(batch_size, max_pages)
  blocks = jnp.stack([k, v], axis=2).reshape(
      batch_size * max_pages, ps, 2, hkv, d).transpose(0, 2, 1, 3, 4)
  cache = jnp.full((num_pages, 2, ps, hkv, d), jnp.nan, jnp.bfloat16)
  cache = cache.at[jnp.asarray(table.reshape(-1))].set(blocks)
  q_indptr = np.concatenate([[0], np.cumsum(spec.q_lens)]).astype(np.int32)
  return dict(q=q, k=k, v=v, kv_cache=cache, page_table=table,
              q_indptr=q_indptr,
              kv_lens=np.asarray(spec.kv_lens, np.int32))


def visible_pairs(q_lens, kv_lens, window_left: int = -1) -> int:
  """(query, key) pairs causal attention computes: the query at position p
  sees p + 1 keys, or min(p, window_left) + 1 with a window."""
  total = 0
  for ql, kl in zip(q_lens, kv_lens):
    pos = np.arange(kl - ql, kl)
    if window_left >= 0:
      pos = np.minimum(pos, window_left)
    total += int(np.sum(pos + 1))
  return total


def prefill_flops(spec: PrefillSpec, window_left: int = -1) -> int:
  """FLOPs of a causal prefill call: `4 * head_dim * num_qo_heads *
  visible_pairs` (QK^T and PV, 2 FLOPs per multiply-add), which for a
  whole prompt is the usual `2 * S^2 * head_dim * num_qo_heads`."""
  hq, _, d = spec.shape
  if spec.is_prompt and window_left < 0:
    s = spec.q_lens[0]
    return 2 * s * s * d * hq * len(spec.q_lens)
  return 4 * d * hq * visible_pairs(spec.q_lens, spec.kv_lens, window_left)
