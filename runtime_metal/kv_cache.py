"""The KV cache, defined once, in its two forms:

* `KVCache`, one layer of one sequence (the engine's generation loop): buffers preallocated in
  blocks of 256 positions (mlx-lm's shape), rows written in place, and the one definition of a
  cache write (`write_rows`), which the node-by-node executor and the compiled program
  (decode.py) both use. Buffers are [batch, kv_heads, capacity, head_dim]; `offset` is how
  many positions are cached.
* the block cache of the batch decoder (batch.py): `BlockCache`, every layer's pool of
  fixed-size blocks [blocks, kv_heads, BLOCK, head_dim], and `BlockPool`, their free list and
  reference counts. A sequence holds a block table (its blocks in position order), so a row
  holds the blocks of its own length, and a prompt prefix is shared between tables by
  reference, copied only when a table writes into a shared block (`BlockPool.writable`).
  `write_blocks` / `read_blocks` are the block forms of the write and of the read attention
  does (attention.Attention.over_cache), through a step's `BlockIndex` (the index math over
  the table, once a step for every layer); the CUDA attention kernel reads and writes through
  the table itself (cuda_kernels/sources.py).

Both forms hold K/V either in the activation dtype or quantized (`KVQuant`, `--kv-bits`):
then each buffer is the triple mx.quantize makes, (packed uint32, scales, biases), with the
position axis where a float buffer has it, so every write, read, gather and copy below applies
to each of the three arrays alike (`Buffer`), new rows are quantized as they are written, and
attention reads the triple directly (attention.Attention.attend: quantized matmuls, no
dequantized copy of the cache). The triple describes itself given the head dim (`spec_of`).
On MLX-CUDA, with the fused attention's quantized forms on (FUSELM_KV_ATTN; off by default
until measured on a GPU), a decode step over an 8-bit cache runs that kernel instead
(cuda_kernels/sources.py): it rotates and quantizes the new rows itself, exactly as `quantize`
below, and reads the codes directly; so does a 4-bit cache's decode step that completes no key
group (its new key into the float tail, as `write_key_groups` with seal=False puts it).

A quantized buffer holds its rows rotated (`rotate`, before quantizing): a fixed orthogonal
matrix, normalized Walsh-Hadamard blocks, mixes each head's channels, so the few channels of
large magnitude that RoPE'd keys carry are spread over the group instead of setting its scale
alone (QuaRot's idea); every group then rounds values of one size, and a 4-bit cache loses far
less (BENCHMARKS.md "Quantized KV cache"). Attention rotates the queries the same way (q·kᵀ is
unchanged by an orthogonal matrix) and rotates its output back (p·V is in V's rotated basis);
`dequantized` returns the rows as they were written (rotated back).

A 4-bit cache stores its keys per channel instead (KIVI; `KVQuant.keys_per_channel`): a
single-sequence cache's key buffer is four arrays, the keys transposed (positions last) and
quantized in groups of KEY_GROUP positions, each channel with its own scale and bias per group,
unrotated, plus a float tail, the keys of the row's two newest groups (`write_key_groups`).
A group is quantized once, by the write that completes it; attention reads each query's own
group from the floats until it is full (`recent_keys`), the rest as stored, so the open
group's codes are never read (nor written). The block cache holds this form too
(`key_blocks_zeros`): a block is one key group, and each decoder slot has its own float tail
(BlockIndex.tails).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

# A K or V buffer: one array, or a quantized one's (packed, scales, biases), axis 2 positions
Buffer = mx.array | tuple[mx.array, ...]

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)  # those mx.quantize takes


@dataclass(frozen=True)
class KVQuant:
    """K/V stored quantized: `bits` per value, a scale and a bias per `group_size` values of
    a head (mx.quantize's affine scheme; mlx-lm's kv_bits / kv_group_size)."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}")
        if self.group_size not in KV_GROUP_SIZES:
            raise ValueError("kv_group_size must be one of "
                             f"{', '.join(map(str, KV_GROUP_SIZES))}")

    def quantize(self, rows: mx.array) -> tuple[mx.array, ...]:
        """Rows [.., d] in stored form: rotated (`rotate`), then quantized."""
        return tuple(mx.quantize(rotate(rows), group_size=self.group_size, bits=self.bits))

    def zeros(self, lead: tuple[int, ...], dim: int, dtype: mx.Dtype) -> tuple[mx.array, ...]:
        """An empty buffer [*lead, dim] in stored form (scales and biases in `dtype`)."""
        return (mx.zeros((*lead, dim * self.bits // 32), mx.uint32),
                mx.zeros((*lead, dim // self.group_size), dtype),
                mx.zeros((*lead, dim // self.group_size), dtype))

    def bytes_per_value(self, dtype: mx.Dtype) -> float:
        """Stored bytes per cached value: the packed bits plus a scale and a bias per group."""
        return self.bits / 8 + 2 * dtype.size / self.group_size

    @property
    def keys_per_channel(self) -> bool:
        """Whether keys are stored per channel (KIVI: `key_groups_zeros`): at 4 bits, where
        per-token key groups cost SmolLM2 +3.3 % perplexity and per-channel ones +1.2 %; at
        8 bits per-token groups already read within 0.02 % of float (BENCHMARKS.md
        "Quantized KV cache") and need no float tail."""
        return self.bits == 4

    def misfit(self, dim: int) -> str:
        """Why a head of `dim` values cannot be stored so ("" when it can)."""
        if dim % self.group_size:
            return f"the head dim {dim} is not a multiple of the group size {self.group_size}"
        return ""


@cache
def _rotation(dim: int, transposed: bool, dtype: mx.Dtype) -> mx.array:
    """[dim, dim] in `dtype` (made once per head size and dtype, not cast at every
    attention call): Sylvester-Hadamard blocks of the largest power of two dividing dim
    (all of a 64- or 128-value head; a quantized head's dim is a multiple of its power-of-two
    group, so a block never straddles groups), scaled by 1/sqrt(block) to be orthogonal."""
    n = dim & -dim
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    r = np.kron(np.eye(dim // n), h / np.sqrt(n)).astype(np.float32)
    return mx.array(r.T if transposed else r, dtype=dtype)  # a constant, also in a trace


def rotate(x: mx.array) -> mx.array:
    """x [.., d] in the rotated basis a quantized buffer stores (x·R, R orthogonal)."""
    return x @ _rotation(x.shape[-1], False, x.dtype)


def unrotate(x: mx.array) -> mx.array:
    """rotate's inverse (x·Rᵀ)."""
    return x @ _rotation(x.shape[-1], True, x.dtype)


def empty(quant: KVQuant | None, lead: tuple[int, ...], dim: int, dtype: mx.Dtype) -> Buffer:
    """Zeros [*lead, dim]: one array, or quantized."""
    return quant.zeros(lead, dim, dtype) if quant else mx.zeros((*lead, dim), dtype)


def spec_of(buf: tuple[mx.array, ...], dim: int) -> KVQuant:
    """The quantization of a stored buffer whose heads hold `dim` values (its packed width
    gives the bits, its scales' width the group size)."""
    return KVQuant(buf[0].shape[-1] * 32 // dim, dim // buf[1].shape[-1])


def parts(buf: Buffer) -> tuple[mx.array, ...]:
    """The arrays a buffer is made of (one, or a quantized buffer's three)."""
    return buf if isinstance(buf, tuple) else (buf,)


def rebuild(like: Buffer, arrays: list[mx.array] | tuple[mx.array, ...]) -> Buffer:
    """A buffer of `like`'s form from its arrays (parts' inverse)."""
    return tuple(arrays) if isinstance(like, tuple) else arrays[0]


def positions(buf: Buffer) -> int:
    """The positions a buffer holds (axis 2; a per-channel key buffer's capacity)."""
    if is_key_groups(buf):
        return key_group_positions(buf)  # type: ignore[arg-type]
    return parts(buf)[0].shape[2]


def stored_values(buf: Buffer, dim: int) -> mx.array:
    """The float values a buffer stores: a quantized buffer's dequantized, still rotated (what
    attention reads with rotated queries); a float buffer as it is."""
    if not isinstance(buf, tuple):
        return buf
    q = spec_of(buf, dim)
    return mx.dequantize(*buf, group_size=q.group_size, bits=q.bits)


def dequantized(buf: Buffer, dim: int) -> mx.array:
    """The float values of a buffer's rows as written (a quantized buffer's rotated back; a
    float buffer as it is; a per-channel key buffer's up to its capacity)."""
    if is_key_groups(buf):
        return key_group_values(buf)  # type: ignore[arg-type]
    return unrotate(stored_values(buf, dim)) if isinstance(buf, tuple) else buf


def split_layers(arrays: list[mx.array] | tuple[mx.array, ...], layers: int
                 ) -> list[tuple[Buffer, Buffer]]:
    """The compiled program's flat cache arrays (KVCache.buffers of every layer, in order)
    back into each layer's (K, V) buffers: 2 arrays a layer float, 6 quantized, 7 with keys
    per channel (4 of them the keys')."""
    per = len(arrays) // layers
    nk = (per + 1) // 2
    out: list[tuple[Buffer, Buffer]] = []
    for i in range(layers):
        k, v = arrays[per * i: per * i + nk], arrays[per * i + nk: per * (i + 1)]
        out.append((tuple(k), tuple(v)) if per > 2 else (k[0], v[0]))
    return out


def join_layers(pairs: list[tuple[Buffer, Buffer]]) -> list[mx.array]:
    """split_layers' inverse."""
    return [a for k, v in pairs for a in (*parts(k), *parts(v))]


def _write_one(buf: mx.array, rows: mx.array, off: mx.array) -> mx.array:
    if rows.shape[2] == 1:
        index = mx.broadcast_to(off.reshape(-1, 1, 1, 1), rows.shape)
        return mx.put_along_axis(buf, index, rows, axis=2)
    if off.size != 1:
        raise ValueError("a per-row offset writes one position per row")
    return mx.slice_update(buf, rows, off.reshape(1), axes=(2,))


def stored(buf: Buffer, rows: mx.array) -> tuple[mx.array, ...]:
    """Float rows [.., d] in `buf`'s stored form (quantized as buf is, or cast to its dtype)."""
    if isinstance(buf, tuple):
        return spec_of(buf, rows.shape[-1]).quantize(rows.astype(buf[1].dtype))
    return (rows.astype(buf.dtype),)


def write_rows(buf: Buffer, rows: mx.array, offset: mx.array | int, seal: bool = True,
               recent: RecentKeys | None = None) -> Buffer:
    """buf[:, :, offset:offset + s] = rows [b, h, s, d]; in place when `buf` is donated (the
    compiled program) or the only reference. `offset`: a scalar (every row at one position) or
    an int32 array [b] (one position per batch row; s must then be 1).

    One row per batch entry is a scatter: MLX-CUDA launches its dynamic slice update over the
    whole destination (measured: the cost grows with the cache's capacity) plus an offset
    kernel; the scatter is one launch over the rows. A quantized `buf`: the rows quantized,
    each of its arrays written so. A per-channel key buffer: write_key_groups (`seal`,
    `recent`)."""
    if is_key_groups(buf):
        return write_key_groups(buf, rows, offset, seal, recent)  # type: ignore[arg-type]
    off = offset if isinstance(offset, mx.array) else mx.array(offset, mx.int32)
    return rebuild(buf, [_write_one(b, r, off)
                         for b, r in zip(parts(buf), stored(buf, rows), strict=True)])


def write_stored(buf: Buffer, rows: Buffer, start: int) -> Buffer:
    """buf[:, :, start:start + s] = rows, rows already in buf's stored form (a copy between
    caches: nothing is quantized again)."""
    off = mx.array([start], mx.int32)
    return rebuild(buf, [mx.slice_update(b, r, off, axes=(2,))
                         for b, r in zip(parts(buf), parts(rows), strict=True)])


def first(buf: Buffer, n: int) -> Buffer:
    """Positions 0..n-1 of a buffer (views). A per-channel key buffer: its groups up to the
    one holding position n-1 and the spare (attention reads as many keys as values)."""
    if is_key_groups(buf):
        g = -(-n // KEY_GROUP) + 1
        return (buf[0][..., :g * KEY_WORDS], buf[1][..., :g], buf[2][..., :g], buf[3])
    return rebuild(buf, [a[:, :, :n] for a in parts(buf)])


class KVCache:
    step = 256

    def __init__(self, quant: KVQuant | None = None) -> None:
        self.quant = quant  # None: K/V in the activation dtype
        self.keys: Buffer | None = None
        self.values: Buffer | None = None
        self.offset = 0
        # a per-channel key buffer's tail holds the float keys of positions tail_from..offset-1
        self.tail_from = 0
        self.recent: RecentKeys | None = None  # the last update_and_fetch's (attention's)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else positions(self.keys)

    @property
    def nbytes(self) -> int:
        """The bytes the buffers hold (every position up to capacity)."""
        return sum(a.nbytes for a in self.buffers()) if self.keys is not None else 0

    @property
    def fixed_nbytes(self) -> int:
        """The part of nbytes that is not per position: a per-channel key buffer's float tail
        and its spare group (0 for the other forms)."""
        if self.keys is None or not is_key_groups(self.keys):
            return 0
        spare = sum(a.nbytes for a in self.keys[:3]) * KEY_GROUP // (self.capacity + KEY_GROUP)
        return self.keys[3].nbytes + spare

    def allocate(self, batch: int, kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype,
                 capacity: int = 0) -> None:
        """Empty buffers (capacity rounded up to whole blocks); drops what was cached."""
        n = -(-capacity // self.step) * self.step
        self.keys = (key_groups_zeros((batch, kv_heads), n, k_dim, dtype)
                     if self.quant and self.quant.keys_per_channel
                     else empty(self.quant, (batch, kv_heads, n), k_dim, dtype))
        self.values = empty(self.quant, (batch, kv_heads, n), v_dim, dtype)
        self.offset = self.tail_from = 0

    def reserve(self, n: int) -> None:
        """Capacity for n positions, grown in whole blocks (each capacity is one compiled
        shape for the program: traced once, then cached). Needs allocated buffers."""
        assert self.keys is not None and self.values is not None, "allocate first"
        if n <= self.capacity:
            return
        extra = -(-(n - self.capacity) // self.step) * self.step

        def grow(buf: Buffer) -> Buffer:
            if is_key_groups(buf):  # positions last (packed 8 a word, a scale per group)
                return tuple(mx.concatenate(
                    [a, mx.zeros((*a.shape[:3], extra * a.shape[3] // (positions(buf)
                                                                       + KEY_GROUP)),
                                 a.dtype)], axis=3) for a in buf[:3]) + (buf[3],)
            return rebuild(buf, [mx.concatenate(
                [a, mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)], axis=2)
                for a in parts(buf)])
        self.keys, self.values = grow(self.keys), grow(self.values)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        """Append [b, Hk, s, D] keys/values at `offset`; return views of everything cached
        (stored form: quantized triples for a quantized cache)."""
        if self.keys is None:
            b, h, s, d = keys.shape
            self.allocate(b, h, d, values.shape[3], keys.dtype)
        prev = self.offset
        self.reserve(prev + keys.shape[2])
        assert self.keys is not None and self.values is not None
        self.recent = (recent_keys(self.keys, keys, prev)  # type: ignore[arg-type]
                       if is_key_groups(self.keys) else None)
        self.keys = write_rows(self.keys, keys, prev, recent=self.recent)
        self.values = write_rows(self.values, values, prev)
        self.offset = prev + keys.shape[2]
        self.wrote(prev)
        return self.state()

    def wrote(self, prev: int) -> None:
        """Positions prev..offset-1 were just written: the tail now holds the floats of the
        KEY_TAIL positions before offset, and of any earlier ones it held that no new position
        overwrote."""
        self.tail_from = max(self.tail_from if prev >= self.tail_from else prev,
                             self.offset - KEY_TAIL)

    def buffers(self) -> list[mx.array]:
        """The whole buffers' arrays (every position up to capacity; K's then V's), for the
        compiled program."""
        assert self.keys is not None and self.values is not None
        return [*parts(self.keys), *parts(self.values)]

    def adopt(self, arrays: list[mx.array], offset: int) -> None:
        """Take the buffers a compiled call returned (it wrote rows into donated copies)."""
        assert self.keys is not None and self.values is not None
        if [a.shape for a in arrays] != [a.shape for a in self.buffers()]:
            raise ValueError("adopted buffers must keep the cache's shape")
        half = len(parts(self.keys))
        self.keys, self.values = rebuild(self.keys, arrays[:half]), rebuild(self.values,
                                                                            arrays[half:])
        prev, self.offset = self.offset, offset
        self.wrote(prev)

    def state(self) -> tuple[Buffer, Buffer]:
        assert self.keys is not None and self.values is not None
        return first(self.keys, self.offset), first(self.values, self.offset)

    def dense(self, k_dim: int, v_dim: int) -> tuple[mx.array, mx.array]:
        """The cached positions in float (a graph fed past K/V as inputs reads these)."""
        k, v = self.state()
        if is_key_groups(k):
            return key_group_read(k, self.offset), dequantized(v, v_dim)  # type: ignore
        return dequantized(k, k_dim), dequantized(v, v_dim)

    def trim(self, n: int) -> None:
        """Forget the last n positions (the buffer is kept). With keys per channel, the group
        holding the new end is open again (read from the tail's floats, and quantized again by
        the write that completes it); a trim past
        what the tail holds (more than a group back: a new prompt's common prefix, not a
        rejected draft) forgets back to that group's start instead, and `offset` says so
        (callers re-read it)."""
        self.offset = max(self.offset - n, 0)
        if self.keys is not None and is_key_groups(self.keys):
            start = self.offset // KEY_GROUP * KEY_GROUP
            if start < self.tail_from:
                self.offset = start
            self.tail_from = min(self.tail_from, self.offset)

    def reset(self) -> None:
        self.offset = 0
        self.tail_from = 0


# ---- the block cache (batch.py): fixed-size blocks, a free list, shared prefixes --------------

BLOCK = 64  # positions a block holds (a power of two: the attention kernel divides by it)


class BlockPool:
    """Which blocks of a pool are free and how many block tables hold each. A block held by
    two tables (a shared prompt prefix) is read by both and written by neither: the table that
    writes into it first takes a private copy (`writable`: copy on write)."""

    def __init__(self, blocks: int) -> None:
        if blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.refs = [0] * blocks
        self.free = list(range(blocks - 1, -1, -1))  # popped from the end: block 0 first

    @property
    def available(self) -> int:
        return len(self.free)

    def alloc(self) -> int:
        """A free block, held once; IndexError when none is free."""
        if not self.free:
            raise IndexError("no free KV block")
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def share(self, block: int) -> int:
        """One more table holds `block` (by reference: no copy)."""
        assert self.refs[block] > 0, "sharing a free block"
        self.refs[block] += 1
        return block

    def release(self, blocks: list[int]) -> None:
        """A table lets go of `blocks`; a block no table holds goes back to the free list."""
        for b in blocks:
            assert self.refs[b] > 0, "releasing a free block"
            self.refs[b] -= 1
            if not self.refs[b]:
                self.free.append(b)

    def writable(self, block: int) -> tuple[int, bool]:
        """The block a table may write in place of `block`: itself when it holds it alone,
        else a new one (the caller copies the contents over and drops its hold on the shared
        one: returns (new, True))."""
        if self.refs[block] == 1:
            return block, False
        new = self.alloc()
        self.release([block])
        return new, True


class BlockIndex:
    """A step's block table [n, W] and the index math over it, done once a step for every
    layer that reads or writes through it (write_blocks, read_blocks; memoized by the pools'
    heads and block size): each layer then adds a gather or a scatter and nothing else.
    offset [n]: each row's first new position, s new positions a row (the writes').
    tails [n]: each row's slot in the key tail pools (a 4-bit cache's: BlockCache).
    Nothing is built until a layer asks: the CUDA attention kernel reads `table` itself."""

    def __init__(self, table: mx.array, offset: mx.array | None = None, s: int = 1,
                 tails: mx.array | None = None) -> None:
        self.table, self.offset, self.s, self.tails = table, offset, s, tails
        self._rows: dict[tuple[int, int], tuple[mx.array, mx.array, mx.array]] = {}
        self._slots: dict[tuple[int, int], tuple[mx.array, mx.array, mx.array]] = {}

    def rows(self, heads: int, block: int) -> tuple[mx.array, mx.array, mx.array]:
        """Where the positions the table holds lie: (block id, head, position in the
        block), each [n, heads, W * block], row r's head h in position order."""
        key = (heads, block)
        if key not in self._rows:
            n, w = self.table.shape
            blk = self.table.reshape(n, 1, w, 1)
            head = mx.arange(heads, dtype=mx.int32).reshape(heads, 1, 1)
            slot = mx.arange(block, dtype=mx.int32)
            b, hd, sl = (mx.broadcast_to(i, (n, heads, w, block)).reshape(n, heads, w * block)
                         for i in (blk, head, slot))
            self._rows[key] = (b, hd, sl)
        return self._rows[key]

    def slots(self, heads: int, block: int) -> tuple[mx.array, mx.array, mx.array]:
        """Where the new positions go, in the order of new rows [n, s, heads, d] flattened:
        (block id, head, position in the block), each [n * s * heads] (a layer's scatter
        then reshapes and broadcasts nothing but its rows)."""
        key = (heads, block)
        if key not in self._slots:
            assert self.offset is not None, "a block index for writing needs the offsets"
            n = self.table.shape[0]
            off = self.offset.reshape(n, 1)
            pos = off if self.s == 1 else off + mx.arange(self.s, dtype=off.dtype)  # [n, s]
            blk = mx.take_along_axis(self.table, pos // block, axis=1)
            shape = (n, self.s, heads)
            self._slots[key] = (
                mx.broadcast_to(blk[..., None], shape).reshape(-1),
                mx.broadcast_to(mx.arange(heads, dtype=mx.int32), shape).reshape(-1),
                mx.broadcast_to((pos % block)[..., None], shape).reshape(-1))
        return self._slots[key]


def write_blocks(pool: Buffer, rows: mx.array, index: BlockIndex, seal: bool = True,
                 recent: RecentKeys | None = None) -> Buffer:
    """pool [blocks, h, BLOCK, d] with row r's new positions rows[r] ([n, s, h * d], the
    projection's layout, or [n, s, h, d]) written at offset[r]..offset[r]+s-1, each in its
    block table[r, position // BLOCK] (`index`): one scatter on the pool itself (no reshape
    of it in between: the compiled program's donated pool is updated in place); a quantized
    pool: the rows quantized, one scatter per array. s > 1 is the speculative step's drafts.
    A per-channel key pool: write_key_blocks (`seal`, `recent`)."""
    if is_key_groups(pool):
        return write_key_blocks(pool, rows, index, seal, recent)  # type: ignore[arg-type]
    n, s = rows.shape[:2]
    h = parts(pool)[0].shape[1]
    at = index.slots(h, positions(pool))
    for a, r in zip(parts(pool), stored(pool, rows.reshape(n * s * h, -1)), strict=True):
        a[at] = r
    return pool


def read_blocks(pool: Buffer, index: BlockIndex | mx.array) -> Buffer:
    """The positions a block table [n, W] (or a step's BlockIndex of one) holds, gathered:
    [n, h, W * BLOCK, d], in one gather of the pool's rows (no transposed copy after it); per
    array of a quantized pool."""
    if not isinstance(index, BlockIndex):
        index = BlockIndex(index)
    if is_key_groups(pool):
        return read_key_blocks(pool, index)  # type: ignore[arg-type]
    _, h, bs, _ = parts(pool)[0].shape
    at = index.rows(h, bs)
    return rebuild(pool, [a[at] for a in parts(pool)])


class BlockCache:
    """Every layer's K/V pool ([blocks, kv_heads, BLOCK, head_dim] each; quantized triples
    with `quant`) and their one BlockPool: a block id names the same block in every layer.
    Keys per channel (a 4-bit cache): each layer's key pool is key_blocks_zeros', a block one
    key group, with a float tail per decoder slot (`rows` of them; a step's BlockIndex.tails
    says which row uses which)."""

    def __init__(self, layout: list[tuple[int, int, int, mx.Dtype]], blocks: int,
                 quant: KVQuant | None = None, rows: int = 1) -> None:
        self.pool = BlockPool(blocks)
        self.quant = quant
        self.keys = [key_blocks_zeros(blocks, rows, hk, dk, dt)
                     if quant is not None and quant.keys_per_channel
                     else empty(quant, (blocks, hk, BLOCK), dk, dt) for hk, dk, _, dt in layout]
        self.values = [empty(quant, (blocks, hk, BLOCK), dv, dt) for hk, _, dv, dt in layout]

    def buffers(self) -> list[mx.array]:
        """k_0, v_0, k_1, v_1, ... (each buffer's arrays): the compiled program's cache
        inputs (kv_cache.split_layers reads them back)."""
        return join_layers(list(zip(self.keys, self.values, strict=True)))

    def adopt(self, arrays: list[mx.array]) -> None:
        """Take the pools a compiled call returned (it wrote rows into donated buffers)."""
        pairs = split_layers(arrays, len(self.keys))
        self.keys, self.values = [k for k, _ in pairs], [v for _, v in pairs]

    def copy_block(self, src: int, dst: int) -> None:
        """dst's contents := src's, in every layer (the copy of copy on write; a per-channel
        key pool's blocks, not its tails, which are the decoder slots')."""
        for buffers in (self.keys, self.values):
            for buf in buffers:
                for a in parts(buf)[:3]:
                    a[dst:dst + 1] = a[src:src + 1]

    @property
    def keys_per_channel(self) -> bool:
        """Whether the key pools are per-channel (key_blocks_zeros: a block one key group)."""
        return is_key_groups(self.keys[0])

    def copy_tail(self, src: int, dst: int) -> None:
        """Decoder slot dst's key tails := src's, in every layer (a fork: it reads the shared
        open group from these floats, and its write that completes the group quantizes it from
        them)."""
        for buf in self.keys:
            buf[3][dst:dst + 1] = buf[3][src:src + 1]

    def gather(self, blocks: list[int], n: int) -> list[KVCache]:
        """Positions 0..n-1 of the blocks, as one single-sequence cache per layer (the stored
        form copied as it is; per-channel keys: n a whole number of key groups, all of them
        quantized, so the cache's tail holds nothing)."""
        out = []
        idx = mx.array(np.asarray(blocks, np.int32).reshape(1, -1))
        for k, v in zip(self.keys, self.values, strict=True):
            c = KVCache(self.quant)
            if is_key_groups(k):
                assert n % KEY_GROUP == 0, "per-channel keys gathered by whole groups"
                cap = -(-n // KVCache.step) * KVCache.step
                seq = key_groups_zeros((1, k[0].shape[1]), cap, k[0].shape[2], k[1].dtype)
                got = read_key_blocks(k, BlockIndex(idx[:, :n // KEY_GROUP]))
                c.keys = tuple(mx.concatenate([g, a[..., g.shape[-1]:]], axis=-1)
                               for g, a in zip(got[:3], seq[:3], strict=True)) + (seq[3],)
                c.tail_from = n
            else:
                c.keys = write_stored(_sized(k, n), first(read_blocks(k, idx), n), 0)
            c.values = write_stored(_sized(v, n), first(read_blocks(v, idx), n), 0)
            c.offset = n
            out.append(c)
        return out

    def scatter(self, caches: list[KVCache], blocks: list[int], start: int, end: int,
                row: int = 0) -> None:
        """Positions start..end-1 of single-sequence `caches` into `blocks` (the table that
        holds them alone: writable); per-channel keys: the groups holding them, and the
        caches' tails into decoder slot `row`'s."""
        for i, c in enumerate(caches):
            if self.keys_per_channel:
                k, src = self.keys[i], c.state()[0]
                words = KEY_WORDS
                for g in range(start // KEY_GROUP, -(-end // KEY_GROUP)):
                    b = blocks[g]
                    k[0][b:b + 1] = src[0][..., g * words:(g + 1) * words]
                    k[1][b:b + 1] = src[1][..., g:g + 1]
                    k[2][b:b + 1] = src[2][..., g:g + 1]
                k[3][row:row + 1] = src[3]
            for buffers, src in zip((self.keys, self.values)[self.keys_per_channel:],
                                    c.state()[self.keys_per_channel:], strict=True):
                for a, rows in zip(parts(buffers[i]), parts(src), strict=True):
                    p = start
                    while p < end:
                        b, lo = blocks[p // BLOCK], p % BLOCK
                        hi = min(BLOCK, lo + end - p)
                        a[b:b + 1, :, lo:hi] = rows[:, :, p:p + hi - lo]
                        p += hi - lo


def _sized(pool: Buffer, n: int) -> Buffer:
    """An empty one-sequence buffer of the pool's form for n positions (whole KVCache steps)."""
    cap = -(-n // KVCache.step) * KVCache.step
    return rebuild(pool, [mx.zeros((1, a.shape[1], cap, a.shape[3]), a.dtype)
                          for a in parts(pool)])


# ---- keys per channel (KIVI): the 4-bit cache's keys ------------------------------------------

KEY_GROUP = BLOCK  # positions one per-channel key group spans: a block of the block cache
KEY_WORDS = KEY_GROUP * 4 // 32  # uint32 words of one channel's 4-bit codes in a group
KEY_TAIL = 2 * KEY_GROUP  # float positions kept per row: the newest group and the one before


def completes_no_key_group(offsets: int | np.ndarray) -> bool:
    """Whether a one-token write at each of `offsets` (an int or an int array: the positions
    written) leaves every row's key group open (the 4-bit cache's step_open programs)."""
    return bool(np.all((np.asarray(offsets) + 1) % KEY_GROUP))


def key_groups_zeros(lead: tuple[int, int], capacity: int, dim: int, dtype: mx.Dtype
                     ) -> tuple[mx.array, ...]:
    """An empty per-channel key buffer for `capacity` positions (a multiple of KEY_GROUP):
    (packed [b, h, d, (capacity + G) / 8] uint32, scales and biases [b, h, d, capacity / G + 1]
    in `dtype`, tail [b, h, KEY_TAIL, d] in `dtype`). Keys are stored transposed (positions
    last: mx.quantize groups the last axis, so each channel gets its own scale and bias per
    KEY_GROUP positions) and unrotated (a rotation would mix the channels this separates).
    One spare group past the capacity takes the groups a write of s > 1 positions at a device
    offset may touch past its last one (their contents are never read)."""
    n = capacity // KEY_GROUP + 1
    return (mx.zeros((*lead, dim, n * KEY_WORDS), mx.uint32),
            mx.zeros((*lead, dim, n), dtype), mx.zeros((*lead, dim, n), dtype),
            mx.zeros((*lead, KEY_TAIL, dim), dtype))


def is_key_groups(buf: Buffer) -> bool:
    """Whether a buffer is a per-channel key buffer (key_groups_zeros' four arrays)."""
    return isinstance(buf, tuple) and len(buf) == 4


@dataclass(frozen=True)
class RecentKeys:
    """The float keys of the key groups a write of s positions at `offset` touches, before
    any is quantized: keys [b, h, L, d] at positions pos [1 or b, L] (L = whole groups from
    the one holding offset; positions at or past offset + s hold copies of the new rows, not
    keys), and the new positions query [1 or b, s]. Attention reads a query's own group from
    these while the group is not full (Attention.attend)."""

    keys: mx.array
    pos: mx.array
    query: mx.array


def recent_keys(buf: tuple[mx.array, ...], rows: mx.array, offset: mx.array | int
                ) -> RecentKeys:
    """RecentKeys of a write of keys [b, h, s, d] at `offset` (an int, a scalar array, or [b]
    per row) into a per-channel key buffer, taken before the write: the positions before
    offset from its tail, the new ones from `rows`."""
    tail = buf[-1]
    b, h, s, d = rows.shape
    rows = rows.astype(tail.dtype)
    if isinstance(offset, int):
        groups = (offset + s - 1) // KEY_GROUP - offset // KEY_GROUP + 1
        off = mx.array([offset], mx.int32)
    else:
        groups = (s + KEY_GROUP - 2) // KEY_GROUP + 1  # the most a write of s may touch
        off = offset.reshape(-1).astype(mx.int32)
    off = off.reshape(-1, 1)  # [1 or b, 1]
    pos = (off // KEY_GROUP) * KEY_GROUP + mx.arange(groups * KEY_GROUP, dtype=mx.int32)

    def at(src: mx.array, idx: mx.array) -> mx.array:
        return mx.take_along_axis(src, mx.broadcast_to(idx[:, None, :, None],
                                                       (b, h, idx.shape[1], d)), axis=2)
    keys = mx.where((pos < off)[:, None, :, None], at(tail, pos % KEY_TAIL),
                    at(rows, mx.clip(pos - off, 0, s - 1)))
    return RecentKeys(keys, pos, off + mx.arange(s, dtype=mx.int32))


def write_key_groups(buf: tuple[mx.array, ...], rows: mx.array, offset: mx.array | int,
                     seal: bool = True, recent: RecentKeys | None = None
                     ) -> tuple[mx.array, ...]:
    """Keys [b, h, s, d] written at `offset` (an int, a scalar array, or [b] per row) into a
    per-channel key buffer: the tail takes the new rows (the last KEY_TAIL of them), and each
    group the write completes (its last position among the new ones) is quantized, once, from
    its floats (recent_keys: its positions before `offset` from the tail, the new ones from
    `rows`): a stored group is always mx.quantize of exactly its KEY_GROUP keys, whatever
    chunks wrote them. The open group (the one holding offset + s - 1, unless the write fills
    it) stays unquantized: attention reads it from the tail (Attention._channels), so its
    stored codes are never read. An int offset quantizes the completed groups alone; a device
    offset (the compiled program's) quantizes every group the write may touch and stores those
    it completes, the others' codes going to the spare group past the capacity (never read);
    `seal=False` says that the write completes no group (the caller knows its offset: a decode
    step at a position that is not a group's last), so it quantizes nothing. `recent`: the
    caller's recent_keys of this very write (buf, rows, offset), not made again."""
    packed, scales, biases, tail = buf
    b, h, s, d = rows.shape
    dt = scales.dtype
    rows = rows.astype(dt)
    words = KEY_WORDS
    if seal and isinstance(offset, int):
        g0, done = offset // KEY_GROUP, (offset + s) // KEY_GROUP - offset // KEY_GROUP
        if done:
            keys = (recent or recent_keys(buf, rows, offset)).keys[:, :, :done * KEY_GROUP]
            q = mx.quantize(keys.swapaxes(-1, -2), group_size=KEY_GROUP, bits=4)
            at = mx.array([g0], mx.int32)
            packed = mx.slice_update(packed, q[0], at * words, axes=(3,))
            scales = mx.slice_update(scales, q[1].astype(dt), at, axes=(3,))
            biases = mx.slice_update(biases, q[2].astype(dt), at, axes=(3,))
    elif seal:
        recent = recent or recent_keys(buf, rows, offset)
        keys, pos, off = recent.keys, recent.pos, recent.query[:, :1]
        q = mx.quantize(keys.swapaxes(-1, -2), group_size=KEY_GROUP, bits=4)
        g = pos[:, ::KEY_GROUP] // KEY_GROUP  # [1 or b, groups]
        spare = scales.shape[-1] - 1
        g = mx.where((g + 1) * KEY_GROUP <= off + s, g, spare)  # completed here, or the spare

        def put(dst: mx.array, src: mx.array, width: int) -> mx.array:
            idx = (g[..., None] * width + mx.arange(width, dtype=mx.int32)).reshape(
                g.shape[0], -1)  # [1 or b, groups * width]
            return mx.put_along_axis(dst, mx.broadcast_to(idx[:, None, None, :], src.shape),
                                     src, axis=3)
        packed = put(packed, q[0], words)
        scales, biases = put(scales, q[1].astype(dt), 1), put(biases, q[2].astype(dt), 1)
    off = (mx.array([offset], mx.int32) if isinstance(offset, int)
           else offset.reshape(-1).astype(mx.int32)).reshape(-1, 1)
    k = min(s, KEY_TAIL)
    slot = (off + s - k + mx.arange(k, dtype=mx.int32)) % KEY_TAIL  # [1 or b, k]
    tail = mx.put_along_axis(tail, mx.broadcast_to(slot[:, None, :, None], (b, h, k, d)),
                             rows[:, :, s - k:], axis=2)
    return packed, scales, biases, tail


def key_group_values(buf: tuple[mx.array, ...], n: int | None = None) -> mx.array:
    """The float keys a per-channel key buffer stores, [b, h, n, d] (n: every position up to
    the capacity by default), as attention reads them where it cannot use the quantized
    matmul (MLX-CUDA) or the tests compare."""
    packed, scales, biases, _ = buf
    n = key_group_positions(buf) if n is None else n
    g = -(-n // KEY_GROUP)
    k = mx.dequantize(packed[..., :g * KEY_WORDS], scales[..., :g], biases[..., :g],
                      group_size=KEY_GROUP, bits=4)
    return k.swapaxes(-1, -2)[:, :, :n]


def key_group_read(buf: tuple[mx.array, ...], n: int) -> mx.array:
    """Positions 0..n-1 of a per-channel key buffer as a later query reads them, [b, h, n, d]:
    the complete groups dequantized, the open one (n not a multiple of KEY_GROUP: its codes
    are not written yet) from the tail's floats."""
    start = n - n % KEY_GROUP
    if start == n:
        return key_group_values(buf, n)
    recent = buf[3][:, :, mx.arange(start, n, dtype=mx.int32) % KEY_TAIL]
    return mx.concatenate([key_group_values(buf, start), recent], axis=2) if start else recent


def key_group_positions(buf: tuple[mx.array, ...]) -> int:
    """The positions a per-channel key buffer holds (its capacity: the spare group aside)."""
    return (buf[1].shape[-1] - 1) * KEY_GROUP


# ---- keys per channel in the block cache ------------------------------------------------------


def key_blocks_zeros(blocks: int, rows: int, heads: int, dim: int, dtype: mx.Dtype
                     ) -> tuple[mx.array, ...]:
    """An empty per-channel key pool: (packed [blocks + 1, h, d, BLOCK / 8] uint32, scales and
    biases [blocks + 1, h, d, 1] in `dtype`: a block is one key group, positions last, as
    key_groups_zeros stores a sequence's, and the last one a sink no table names, where a write
    at a device offset puts the codes of the groups it does not complete (write_key_blocks);
    tails [rows, h, KEY_TAIL, d] in `dtype`: each decoder slot's float keys of its two newest
    groups, as a sequence's tail)."""
    return (mx.zeros((blocks + 1, heads, dim, BLOCK * 4 // 32), mx.uint32),
            mx.zeros((blocks + 1, heads, dim, 1), dtype),
            mx.zeros((blocks + 1, heads, dim, 1), dtype),
            mx.zeros((rows, heads, KEY_TAIL, dim), dtype))


def block_recent(pool: tuple[mx.array, ...], rows: mx.array, index: BlockIndex
                 ) -> RecentKeys:
    """recent_keys of a step's new keys (rows [n, s, h * d] or [n, s, h, d], the
    projection's layout) written through `index` into a per-channel key pool: each row's
    positions before its offset from its tail (index.tails), taken before the write."""
    assert index.offset is not None and index.tails is not None
    n, s = rows.shape[:2]
    tail = pool[3][index.tails]
    kh = rows.reshape(n, s, tail.shape[1], -1).transpose(0, 2, 1, 3)
    return recent_keys((tail,), kh, index.offset)


def write_key_blocks(pool: tuple[mx.array, ...], rows: mx.array, index: BlockIndex,
                     seal: bool = True, recent: RecentKeys | None = None
                     ) -> tuple[mx.array, ...]:
    """write_key_groups through a block table: each group a row's write completes quantized,
    once, from its floats (block_recent) into the row's block of that group, and the row's
    tail (index.tails) given the new keys. The offsets are on the device, so every group a
    write of s positions may touch (recent_keys' span) is quantized and those it does not
    complete (the row's open group, and any past it, perhaps past the table's last block)
    are stored in the pool's sink block (key_blocks_zeros), never read: no scatter lands in a
    row's open group or in a block past the row's. `seal=False`: the caller knows that the
    write completes no row's group (BatchDecoder: no row writes a group's last position), so
    nothing is quantized, the tails alone written. `recent`: the caller's block_recent of this
    very write (pool, rows, index), not made again."""
    packed, scales, biases, tail = pool
    assert index.offset is not None and index.tails is not None
    n, s = rows.shape[:2]
    h, d = tail.shape[1], tail.shape[3]
    dt = scales.dtype
    kh = rows.reshape(n, s, h, d).transpose(0, 2, 1, 3).astype(dt)
    off = index.offset.reshape(n, 1).astype(mx.int32)
    if seal:
        recent = recent or block_recent(pool, rows, index)
        keys, pos = recent.keys, recent.pos
        groups = pos.shape[1] // KEY_GROUP
        q = mx.quantize(keys.swapaxes(-1, -2), group_size=KEY_GROUP, bits=4)
        g = pos[:, ::KEY_GROUP] // KEY_GROUP  # [n, groups]
        w = index.table.shape[1]
        blk = mx.take_along_axis(index.table, mx.minimum(g, w - 1), axis=1)
        blk = mx.where((g + 1) * KEY_GROUP <= off + s, blk, packed.shape[0] - 1).reshape(-1)

        def per_group(a: mx.array) -> mx.array:  # [n, h, d, groups * x] -> [n * groups, ..]
            return a.reshape(n, h, d, groups, -1).transpose(0, 3, 1, 2, 4).reshape(
                n * groups, h, d, -1)
        packed[blk] = per_group(q[0])
        scales[blk] = per_group(q[1].astype(dt))
        biases[blk] = per_group(q[2].astype(dt))
    k = min(s, KEY_TAIL)
    slot = (off + s - k + mx.arange(k, dtype=mx.int32)) % KEY_TAIL  # [n, k]
    ti = mx.broadcast_to(index.tails.reshape(n, 1, 1), (n, h, k))
    hi = mx.broadcast_to(mx.arange(h, dtype=mx.int32).reshape(1, h, 1), (n, h, k))
    si = mx.broadcast_to(slot[:, None, :], (n, h, k))
    tail[ti, hi, si] = kh[:, :, s - k:]
    return packed, scales, biases, tail


def read_key_blocks(pool: tuple[mx.array, ...], index: BlockIndex) -> tuple[mx.array, ...]:
    """The per-channel keys a block table [n, W] holds, as a sequence's key buffer of W * BLOCK
    positions (positions last; no spare group: attention reads them all): packed
    [n, h, d, W * BLOCK / 8], scales and biases [n, h, d, W], and the rows' tails."""
    n, w = index.table.shape

    def gather(a: mx.array) -> mx.array:  # [blocks, h, d, x] -> [n, h, d, W * x]
        g = a[index.table]  # [n, W, h, d, x]
        return g.transpose(0, 2, 3, 1, 4).reshape(n, g.shape[2], g.shape[3], -1)
    tail = pool[3] if index.tails is None else pool[3][index.tails]
    return gather(pool[0]), gather(pool[1]), gather(pool[2]), tail
