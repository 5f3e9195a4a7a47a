"""The bytes kvbm_ext.nixl's ranks exchange: a rank's record (what a peer needs to reach
it) and the notifications of a call.  Fixed little-endian layouts and length-prefixed
blobs, decoded with bounds checks: a peer's bytes are never unpickled.

Notifications (every one begins with `PREFIX`: magic, kind, the sender's rank, the
Resharder's channel, the receiver's nonce for the call):

- HELLO (on connecting, either way): the sender's record, so that a peer that restarted
  is loaded again by the ranks it talks to.
- READY (receiver -> sender, at the start of its call): the receiver's header record
  (what it expects), its refused arguments if any, and its receive buffer: address,
  bytes, device id, memory kind, registration id and NIXL's partial metadata of it.
- DATA (sender -> receiver, attached to the WRITE of piece p, delivered once the piece
  is in the receiver's memory): the piece index and the sender's header record.
- MISMATCH (sender -> receiver, instead of data): the sender's header record and its
  refused arguments if any.
- ABORT (receiver -> sender): the receiver gave up on the call of that nonce.

And `PeerError`, what a call raises when a peer is lost (kvbm_ext.nixl exports it).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Sequence

from ._reshard import HEADER

MAGIC = b"KVRS"
HELLO, READY, DATA, MISMATCH, ABORT = range(1, 6)
KINDS = {HELLO: "HELLO", READY: "READY", DATA: "DATA", MISMATCH: "MISMATCH", ABORT: "ABORT"}
MEMORY = ("DRAM", "VRAM")

PREFIX = struct.Struct("<4sBxxxIqQ")        # magic, kind, rank, channel, nonce
_BUFFER = struct.Struct("<QQqQB7x")          # address, bytes, device id, registration id, memory kind
_PIECE = struct.Struct("<I4x")
_LENGTH = struct.Struct("<I")
_RECORD = struct.Struct("<4sIQ")             # magic, rank, incarnation
HEADER_BYTES = HEADER.size


class WireError(ValueError):
    """Bytes that are not a record or a notification of this protocol."""


@dataclasses.dataclass(frozen=True)
class Record:
    """What a peer needs to reach a rank: its NIXL agent name, host, incarnation (a number
    drawn when its transport was made: a restarted rank has another) and agent metadata."""

    rank: int
    name: str
    host: str
    incarnation: int
    metadata: bytes


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A receive buffer as READY describes it."""

    address: int
    nbytes: int
    device_id: int
    registration: int
    memory: str
    metadata: bytes          # NIXL's partial metadata of its registration


@dataclasses.dataclass(frozen=True)
class Note:
    """A decoded notification; the fields its kind does not carry are None."""

    kind: int
    rank: int
    channel: int
    nonce: int
    header: bytes | None = None
    reason: tuple[str, str] | None = None
    piece: int | None = None
    buffer: Buffer | None = None
    record: Record | None = None


def _blob(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


class _Reader:
    def __init__(self, data: bytes, offset: int) -> None:
        self.data, self.offset = data, offset

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.data):
            raise WireError(f"truncated: {len(self.data)} bytes, needed {self.offset + size}")
        chunk = self.data[self.offset:self.offset + size]
        self.offset += size
        return bytes(chunk)

    def unpack(self, layout: struct.Struct) -> tuple:
        return layout.unpack(self.take(layout.size))

    def blob(self) -> bytes:
        return self.take(self.unpack(_LENGTH)[0])


def _reason(reason: tuple[str, str] | None) -> bytes:
    return _blob(b"" if reason is None else f"{reason[0]}\0{reason[1]}".encode())


def _read_reason(reader: _Reader) -> tuple[str, str] | None:
    text = reader.blob().decode(errors="replace")
    if not text:
        return None
    kind, _, message = text.partition("\0")
    return kind, message


def encode_record(record: Record) -> bytes:
    return (_RECORD.pack(MAGIC, record.rank, record.incarnation) + _blob(record.name.encode())
            + _blob(record.host.encode()) + _blob(record.metadata))


def decode_record(data: bytes) -> Record:
    reader = _Reader(data, 0)
    magic, rank, incarnation = reader.unpack(_RECORD)
    if magic != MAGIC:
        raise WireError("not a kvbm_ext.nixl record (wrong magic)")
    name, host = reader.blob().decode(), reader.blob().decode()
    return Record(rank, name, host, incarnation, reader.blob())


def hello(rank: int, record: bytes) -> bytes:
    return PREFIX.pack(MAGIC, HELLO, rank, 0, 0) + _blob(record)


def ready(rank: int, channel: int, nonce: int, header: bytes, reason: tuple[str, str] | None,
          buffer: Buffer | None) -> bytes:
    described = buffer or Buffer(0, 0, 0, 0, "DRAM", b"")
    return (PREFIX.pack(MAGIC, READY, rank, channel, nonce) + header + _reason(reason)
            + _BUFFER.pack(described.address, described.nbytes, described.device_id, described.registration,
                           MEMORY.index(described.memory))
            + _blob(described.metadata))


def data(rank: int, channel: int, nonce: int, piece: int, header: bytes) -> bytes:
    return PREFIX.pack(MAGIC, DATA, rank, channel, nonce) + _PIECE.pack(piece) + header


def mismatch(rank: int, channel: int, nonce: int, header: bytes, reason: tuple[str, str] | None) -> bytes:
    return PREFIX.pack(MAGIC, MISMATCH, rank, channel, nonce) + header + _reason(reason)


def abort(rank: int, channel: int, nonce: int) -> bytes:
    return PREFIX.pack(MAGIC, ABORT, rank, channel, nonce)


def decode(message: bytes) -> Note:
    reader = _Reader(message, 0)
    magic, kind, rank, channel, nonce = reader.unpack(PREFIX)
    if magic != MAGIC or kind not in KINDS:
        raise WireError(f"not a kvbm_ext.nixl notification (magic {magic!r}, kind {kind})")
    if kind == HELLO:
        return Note(kind, rank, channel, nonce, record=decode_record(reader.blob()))
    if kind == ABORT:
        return Note(kind, rank, channel, nonce)
    if kind == DATA:
        (piece,) = reader.unpack(_PIECE)
        return Note(kind, rank, channel, nonce, header=reader.take(HEADER_BYTES), piece=piece)
    header = reader.take(HEADER_BYTES)
    reason = _read_reason(reader)
    if kind == MISMATCH:
        return Note(kind, rank, channel, nonce, header=header, reason=reason)
    address, nbytes, device_id, registration, memory = reader.unpack(_BUFFER)
    if memory >= len(MEMORY):
        raise WireError(f"READY: memory kind {memory}")
    buffer = Buffer(address, nbytes, device_id, registration, MEMORY[memory], reader.blob())
    return Note(kind, rank, channel, nonce, header=header, reason=reason, buffer=buffer if nbytes else None)


class PeerError(ConnectionError, TimeoutError):
    """A peer was lost in a reshard: it disconnected, NIXL reported an error on the way to
    it, or it did not answer within the call's timeout.  The text is the same on every
    rank that was exchanging with the peer; `peers`: their ranks; `detail`: what this rank
    saw (also the exception's cause where NIXL raised)."""

    def __init__(self, peers: Sequence[tuple[int, str]], detail: str) -> None:
        names = " and ".join(f"rank {rank} (NIXL agent {name!r})" for rank, name in sorted(peers))
        super().__init__(f"{names}: lost during this reshard (it disconnected, NIXL reported an error, or it did not "
                         "answer within the timeout); the moves with it did not complete, no piece that did not "
                         "arrive was unpacked, and the next call connects again")
        self.peers = tuple(rank for rank, _ in sorted(peers))
        self.detail = detail
