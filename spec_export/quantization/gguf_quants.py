"""A GGUF file's quantized blocks, read as ggml lays them out, in the form MatMulNBits holds.

Every supported block type is written as `w = scale·(code − zero_point) + offset`: integer codes
of 4 or 8 bits, one float32 scale per `block` (16 or 32) inputs, and for the types with a min
one float32 offset per 32 inputs. Each part is the file's own number, so in float32, in this
order, the formula gives what gguf-py's `gguf.quants.dequantize` gives, bit for bit (what
transformers loads):

    type   ggml block (bytes)                      here
    Q4_0   d, 32×4-bit q: d·(q − 8)                 4-bit, block 32, zero point 8
    Q4_1   d, m, 32×4-bit q: d·q + m                4-bit, block 32, zero point 0, offset m
    Q5_0   d, 32×5-bit q: d·(q − 16)                8-bit, block 32: code q − 16 + 128
    Q5_1   d, m, 32×5-bit q: d·q + m                8-bit, block 32: code q + 128, offset m
    Q8_0   d, 32×int8 q: d·q                        8-bit, block 32: code q + 128
    Q4_K   super-block of 256: d, dmin, 8×(6-bit sc, 6-bit mn), 256×4-bit q;
           sub-block j of 32: (d·sc_j)·q − dmin·mn_j
                                                    4-bit, block 32, zero point 0,
                                                    scale d·sc_j, offset −dmin·mn_j
    Q5_K   as Q4_K with 5-bit q                     8-bit, block 32: code q + 128, same offsets
    Q6_K   super-block of 256: 16×int8 sc, d, 256×6-bit q;
           sub-block j of 16: (d·sc_j)·(q − 32)     8-bit, block 16: code q − 32 + 128

The products d·sc_j and dmin·mn_j (an fp16 times a 6- or 8-bit integer) and the fp16 d and m are
exact in float32, so no scale or offset is rounded. Blocks.centred then moves each block's zero
point to its mean code (the same weights, for 8-bit activations' sake). Rows are found in the
file by value (RowIndex), so packed and permuted projections need no name mapping.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QK_K = 256
# bytes per block and inputs per block, as ggml defines them
LAYOUT = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
          "Q8_0": (34, 32), "Q4_K": (144, QK_K), "Q5_K": (176, QK_K), "Q6_K": (210, QK_K)}
KINDS = tuple(LAYOUT)


@dataclass
class Blocks:
    """Rows of one or more GGUF tensors in one MatMulNBits form (see the module doc)."""
    kind: str  # the GGUF type(s) of the rows, "+"-joined when rows of several types share a form
    codes: np.ndarray  # uint8 [rows, K]: the stored values, before 4-bit packing
    scales: np.ndarray  # float32 [rows, K // block]
    bits: int  # 4 or 8
    block: int  # 16 or 32
    zero_points: np.ndarray  # uint8 [rows, K // block]: the code that means 0
    offsets: np.ndarray | None  # float32 [rows, K // 32], added to a 32-block's weights

    @property
    def form(self) -> tuple:
        return self.bits, self.block, self.offsets is not None

    def weights(self) -> np.ndarray:
        """The de-quantized rows [rows, K]: scale·(code − zero point) + offset in float32, which
        is gguf-py's de-quantization bit for bit (the product is exact; the sum rounds as
        gguf-py's d·q + m does, being the same real number)."""
        w = np.repeat(self.scales, self.block, axis=1) * (self.codes.astype(np.float32) - np.repeat(
            self.zero_points.astype(np.float32), self.block, axis=1))
        if self.offsets is not None:
            w = w + np.repeat(self.offsets, 32, axis=1)
        return w

    def centred(self) -> Blocks:
        """The same weights with each block's zero point moved to its mean code and
        scale·(shift) moved into its offset, wherever that sum is exact in float32 (else the
        block stays as it is). With 8-bit activations a block's rounding errors are weighed by
        (code − zero point): codes 0..15 around 0 instead of 8 give 3.6× their variance."""
        if self.offsets is None:
            return self
        n = len(self.codes)
        mean = self.codes.reshape(n, -1, 32).mean(-1)
        zp = np.clip(np.rint(mean), 0, (1 << self.bits) - 1).astype(np.uint8)
        steps = zp.astype(np.float32) - self.zero_points.astype(np.float32)
        shift = self.scales * steps
        exact = shift.astype(np.float64) == self.scales.astype(np.float64) * steps
        offsets = shift + self.offsets
        exact &= _sum_is_exact(shift, self.offsets, offsets)
        return Blocks(self.kind, self.codes, self.scales, self.bits, self.block,
                      np.where(exact, zp, self.zero_points),
                      np.where(exact, offsets, self.offsets).astype(np.float32))


def _sum_is_exact(a: np.ndarray, b: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Whether the float32 `total` = a + b was exact (Knuth's TwoSum error term is zero)."""
    bb = total - a
    return (a - (total - bb)) + (b - bb) == 0


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per value (last axis) as float16, widened to float32 (exact)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit packing [..., 16·c] → [..., 32·c]: in each 16-byte group, element j is the
    low nibble of byte j and element j + 16 the high nibble (Q4_0/Q4_1/Q5_x low bits)."""
    g = qs.reshape(*qs.shape[:-1], -1, 16)
    return np.concatenate([g & 15, g >> 4], axis=-1).reshape(*qs.shape[:-1], -1)


def _bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Little-endian bits of bytes [..., m] → [..., 8·m] in bit order (byte 0 bit 0 first)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :n]


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes → 8 six-bit scales and 8 six-bit mins (ggml get_scale_min_k4):
    j < 4: sc = s[j] & 63, mn = s[j+4] & 63; j ≥ 4: the low 4 bits from s[j+4] (low / high
    nibble), the high 2 bits from the top of s[j−4] / s[j]."""
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def parse(kind: str, raw: np.ndarray) -> Blocks:
    """Rows of raw GGUF blocks (uint8 [rows, bytes per row]) of type `kind` → Blocks."""
    size = LAYOUT[kind][0]
    rows = raw.shape[0]

    def blocks(q, scales, bits, block, zero, offsets):
        zp = np.full(scales.shape, zero, np.uint8)
        return Blocks(kind, q.reshape(rows, -1), scales, bits, block, zp, offsets)

    b = np.asarray(raw, np.uint8).reshape(rows, -1, size)  # [rows, blocks, bytes]
    flat = (rows, -1)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b[..., 0:2])
        m = _f16(b[..., 2:4]) if kind in ("Q4_1", "Q5_1") else None
        if kind == "Q8_0":
            q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return blocks(q, d, 8, 32, 128, None)
        start = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[kind]
        q = _nibbles(b[..., start:])
        if kind in ("Q4_0", "Q4_1"):
            return blocks(q, d, 4, 32, 8 if m is None else 0, m)
        q = q | (_bits(b[..., start - 4:start], 32) << 4)  # qh: bit j is element j's fifth bit
        q = q.astype(np.int16) + (128 if m is not None else 112)  # Q5_0: q − 16 + 128
        return blocks(q.astype(np.uint8), d, 8, 32, 128, m)
    if kind == "Q6_K":
        ql, qh, sc = b[..., 0:128], b[..., 128:192], b[..., 192:208].view(np.int8)
        d = _f16(b[..., 208:210])
        # each half of 128 values: 64 ql bytes (low nibbles: values 0..63, high: 64..127) and
        # 32 qh bytes (bits 2k..2k+1 of byte l: value l + 32k)
        ql = ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        qh = qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = (ql & 15).reshape(rows, -1, 2, 128) | ((qh & 3).reshape(rows, -1, 2, 128) << 4)
        q = q.astype(np.int16) + (128 - 32)
        scales = d[..., None] * sc.astype(np.float32)  # [rows, blocks, 16]
        return blocks(q.astype(np.uint8), scales.reshape(flat), 8, 16, 128, None)
    # Q4_K, Q5_K
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    # qs: 4 groups of 32 bytes; the low nibbles are sub-block 2c, the high ones 2c + 1
    qs = b[..., -128:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (qs & 15).reshape(rows, -1, 8, 32)
    scales = (d[..., None] * sc).reshape(flat)
    offsets = (-(dmin[..., None] * mn)).reshape(flat)
    if kind == "Q4_K":
        return blocks(q, scales, 4, 32, 0, offsets)
    # Q5_K: qh, 32 bytes: bit j of byte i is the fifth bit of sub-block j's element i
    qh = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [rows, blocks, 32, 8]
    q = q | (np.swapaxes(qh, -1, -2) << 4)
    return blocks((q + 128).astype(np.uint8), scales, 8, 32, 128, offsets)


def concat(parts: list[Blocks]) -> Blocks:
    """Rows of several Blocks of one form, stacked in order."""
    kinds = sorted({k for p in parts for k in p.kind.split("+")})
    first = parts[0]
    if len(parts) == 1:
        return first
    return Blocks("+".join(kinds), np.concatenate([p.codes for p in parts]),
                  np.concatenate([p.scales for p in parts]), first.bits, first.block,
                  np.concatenate([p.zero_points for p in parts]),
                  None if first.offsets is None else np.concatenate([p.offsets for p in parts]))


def _tensor_rows(t) -> np.ndarray | None:
    """A gguf-py ReaderTensor's raw block rows (uint8 [rows, bytes]), or None unless it is a 2-D
    tensor of a supported type."""
    if t.tensor_type.name not in LAYOUT or len(t.shape) != 2:
        return None
    raw = np.asarray(t.data)
    return raw.reshape(int(t.shape[1]), -1)


def read_blocks(gguf_path: str | Path) -> dict[str, Blocks]:
    """The 2-D tensors of `gguf_path` stored in a supported block type (others are left out)."""
    import gguf

    return {t.name: parse(t.tensor_type.name, raw) for t in gguf.GGUFReader(str(gguf_path)).tensors
            if (raw := _tensor_rows(t)) is not None}


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, np.float32).tobytes(), digest_size=16).digest()


class RowIndex:
    """Where each de-quantized row of a GGUF's block tensors lives. Rows are de-quantized by
    gguf-py, as transformers does when it loads the file, so the float weights match bit for
    bit. Blocks are parsed only for the rows a weight asks for."""

    def __init__(self, gguf_path: str | Path):
        import gguf

        self.raw: dict[str, tuple[str, np.ndarray]] = {}
        # digest → {tensor: first row}: equal rows (all-zero padding rows, say) may live in
        # tensors of different types
        self.where: dict[bytes, dict[str, int]] = {}
        for t in gguf.GGUFReader(str(gguf_path)).tensors:
            raw = _tensor_rows(t)
            if raw is None:
                continue
            self.raw[t.name] = (t.tensor_type.name, raw)
            for at in range(0, len(raw), 4096):  # rows at a time: a vocabulary is 1 GB in float32
                rows = gguf.quants.dequantize(raw[at : at + 4096], t.tensor_type)
                for r, row in enumerate(rows.reshape(len(rows), -1), start=at):
                    self.where.setdefault(_digest(row), {}).setdefault(t.name, r)

    def locate(self, weight_rows: np.ndarray) -> list[tuple[str, int]] | None:
        """(tensor, row) of the file whose de-quantization is each of `weight_rows` [N, K], or
        None when a row is not in the file. A row found in several tensors (all-zero padding
        rows, say) is taken from the one that holds most of the rows."""
        hits = [self.where.get(_digest(row)) for row in weight_rows]
        if any(h is None for h in hits):
            return None
        votes: dict[str, int] = {}
        for h in hits:
            for name in h:
                votes[name] = votes.get(name, 0) + 1
        return [(name, h[name]) for h in hits for name in [max(h, key=lambda t: votes[t])]]

    def blocks(self, rows: list[tuple[str, int]]) -> list[Blocks]:
        """The blocks of `rows` (from locate), as consecutive runs of rows of one form: one part
        unless the rows come from tensors of different forms."""
        runs: list[list[Blocks]] = []
        for at in range(0, len(rows), 4096):  # parsed 4096 rows at a time (intermediates)
            chunk = rows[at : at + 4096]
            start = 0
            while start < len(chunk):  # segments of consecutive rows from one tensor
                name, end = chunk[start][0], start + 1
                while end < len(chunk) and chunk[end][0] == name:
                    end += 1
                kind, raw = self.raw[name]
                part = parse(kind, raw[[r for _, r in chunk[start:end]]])
                if runs and runs[-1][0].form == part.form:
                    runs[-1].append(part)
                else:
                    runs.append([part])
                start = end
        return [concat(run) for run in runs]
