"""The on-disk format of a kvbm_ext.disk pool file: what is written where, and how each
record is checked when it is read back.  No I/O here (kvbm_ext/disk.py does it).

    [superblock, ALIGN bytes][slot headers, num_slots x HEADER_BYTES][payloads, num_slots x stride]

The superblock says what the slots hold (the layout, as canonical JSON, and its 8-byte
signature), their count and sizes, where the regions start and the pool's random id.  A
slot's header says which pool, layout, slot and store (generation) its payload belongs
to, the payload's length and CRC-32C, and an optional caller key; both records end with
the CRC-32C of everything before it.  Headers sit in one table, apart from the payloads,
so that opening a pool reads them with one sequential pass.  Every region and every
record starts on an ALIGN boundary and is a whole number of ALIGN bytes, as O_DIRECT
asks.  Integers are little-endian.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from . import crc32c

ALIGN = 4096            # O_DIRECT alignment of every offset, length and buffer
HEADER_BYTES = 4096     # one slot header: a whole O_DIRECT block, so it is written alone
VERSION = 1
MAX_KEY = 1024          # bytes of the caller's key a header holds

POOL_MAGIC = b"KVBMPOOL"
SLOT_MAGIC = b"KVBMSLOT"

# superblock: magic, version, align, header bytes, num_slots, payload bytes, payload
# stride, headers offset, payloads offset, pool id, layout signature, layout JSON length
_POOL = struct.Struct("<8sIII4xQQQQQ16s8sI")
# header: magic, version, key length, layout signature, pool id, slot, generation,
# payload bytes, payload crc32c
_SLOT = struct.Struct("<8sII8s16sQQQI4x")
_CRC_AT = HEADER_BYTES - 4          # both records end with the CRC-32C of what precedes it
MAX_LAYOUT_JSON = _CRC_AT - _POOL.size
LAYOUT_KEYS = ("dims", "num_heads", "num_layers", "num_outer", "tokens_per_block", "head_dim", "dtype",
               "itemsize")


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def layout_json(layout: dict[str, Any]) -> bytes:
    return json.dumps({k: layout[k] for k in LAYOUT_KEYS}, sort_keys=True, separators=(",", ":")).encode()


def layout_signature(layout: dict[str, Any]) -> bytes:
    return hashlib.blake2b(layout_json(layout), digest_size=8).digest()


def describe(layout: dict[str, Any]) -> str:
    """A layout in words, for error messages."""
    return (f"dims {layout['dims']!r}, {layout['num_heads']} heads, {layout['num_layers']} layers, "
            f"{layout['num_outer']} outer, {layout['tokens_per_block']} tokens, head dim {layout['head_dim']}, "
            f"{layout['dtype']}")


@dataclass(frozen=True)
class Geometry:
    """Where everything of a pool lies in its file."""
    layout: dict[str, Any]
    num_slots: int
    pool_id: bytes

    @functools.cached_property
    def signature(self) -> bytes:
        return layout_signature(self.layout)

    @property
    def payload_bytes(self) -> int:
        d = self.layout
        return (d["num_heads"] * d["num_layers"] * d["num_outer"] * d["tokens_per_block"] * d["head_dim"]
                * d["itemsize"])

    @property
    def stride(self) -> int:
        return round_up(self.payload_bytes)

    @property
    def headers_offset(self) -> int:
        return ALIGN

    @property
    def payloads_offset(self) -> int:
        return self.headers_offset + self.num_slots * HEADER_BYTES

    @property
    def file_bytes(self) -> int:
        return self.payloads_offset + self.num_slots * self.stride

    def header_offset(self, slot: int) -> int:
        return self.headers_offset + slot * HEADER_BYTES

    def payload_offset(self, slot: int) -> int:
        return self.payloads_offset + slot * self.stride


def new_geometry(layout: dict[str, Any], num_slots: int) -> Geometry:
    if len(layout_json(layout)) > MAX_LAYOUT_JSON:
        raise ValueError(f"like: the layout's description is longer than the superblock holds: {layout}")
    return Geometry(dict(layout), num_slots, uuid.uuid4().bytes)


def _seal(record: bytearray) -> bytearray:
    struct.pack_into("<I", record, _CRC_AT, crc32c(memoryview(record)[:_CRC_AT]))
    return record


def _sealed(record: bytes | memoryview) -> bool:
    return struct.unpack_from("<I", record, _CRC_AT)[0] == crc32c(memoryview(record)[:_CRC_AT])


def pack_superblock(g: Geometry) -> bytearray:
    text = layout_json(g.layout)
    record = bytearray(ALIGN)
    _POOL.pack_into(record, 0, POOL_MAGIC, VERSION, ALIGN, HEADER_BYTES, g.num_slots, g.payload_bytes, g.stride,
                    g.headers_offset, g.payloads_offset, g.pool_id, g.signature, len(text))
    record[_POOL.size:_POOL.size + len(text)] = text
    return _seal(record)


def parse_superblock(record: bytes | memoryview, path: str) -> Geometry:
    """The geometry a superblock describes; ValueError naming `path` and what is wrong."""
    if bytes(record[:8]) != POOL_MAGIC:
        raise ValueError(f"{path}: not a kvbm_ext disk pool (no superblock: its first bytes are "
                         f"{bytes(record[:8])!r}, not {POOL_MAGIC!r})")
    if not _sealed(record):
        raise ValueError(f"{path}: the pool's superblock fails its checksum (corrupted): the file cannot be read")
    (_, version, align, header_bytes, num_slots, payload_bytes, stride, headers_offset, payloads_offset, pool_id,
     signature, text_len) = _POOL.unpack_from(record, 0)
    if version != VERSION or align != ALIGN or header_bytes != HEADER_BYTES:
        raise ValueError(f"{path}: written by format version {version} (alignment {align}, headers of "
                         f"{header_bytes} bytes); this kvbm_ext reads version {VERSION}")
    layout = json.loads(bytes(record[_POOL.size:_POOL.size + text_len]))
    g = Geometry(layout, num_slots, pool_id)
    if (g.signature, g.payload_bytes, g.stride, g.headers_offset, g.payloads_offset) != (
            signature, payload_bytes, stride, headers_offset, payloads_offset):
        raise ValueError(f"{path}: the superblock's sizes do not follow from its layout (corrupted)")
    return g


def pack_header(g: Geometry, slot: int, generation: int, payload_crc: int, key: bytes, into: memoryview) -> None:
    """Writes slot `slot`'s header into `into` (HEADER_BYTES)."""
    record = bytearray(HEADER_BYTES)
    _SLOT.pack_into(record, 0, SLOT_MAGIC, VERSION, len(key), g.signature, g.pool_id, slot, generation,
                    g.payload_bytes, payload_crc)
    record[_SLOT.size:_SLOT.size + len(key)] = key
    into[:] = _seal(record)


@dataclass(frozen=True)
class Header:
    generation: int
    payload_crc: int
    key: bytes


def parse_header(g: Geometry, slot: int, record: bytes | memoryview) -> Header | str:
    """Slot `slot`'s header, or why it does not describe a payload of this pool's slot."""
    if bytes(record[:8]) != SLOT_MAGIC:
        if bytes(record) == bytes(len(record)):
            return "never written (its header is blank)"
        return "its header is not a slot header (overwritten or corrupted)"
    if not _sealed(record):
        return "its header fails its checksum (torn by a crash mid-write, or corrupted)"
    _, version, key_len, signature, pool_id, named, generation, payload_bytes, payload_crc = _SLOT.unpack_from(record)
    if version != VERSION:
        return f"written by format version {version}; this kvbm_ext reads version {VERSION}"
    if signature != g.signature:
        return (f"written for another layout (signature {signature.hex()}, this pool's is "
                f"{g.signature.hex()})")
    if pool_id != g.pool_id:
        return f"written by another pool file (pool id {pool_id.hex()}, this pool's is {g.pool_id.hex()})"
    if named != slot:
        return f"its header belongs to slot {named} (misplaced)"
    if payload_bytes != g.payload_bytes or key_len > MAX_KEY:
        return f"its header says {payload_bytes} payload bytes and a {key_len}-byte key (corrupted)"
    return Header(generation, payload_crc, bytes(record[_SLOT.size:_SLOT.size + key_len]))
