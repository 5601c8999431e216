"""One KV block in one file: the two formats ``disk`` writes and reads.

* ``.kvc`` (``checksum: true``, the default): an 8-byte header, the magic
  ``KVC1`` and a CRC-32, then the block's bytes. The CRC covers the block's
  bytes *and its name* (the store's layout fingerprint and the key), so a
  file whose bytes were flipped in place, and an intact file renamed or
  copied to another key's name, both fail verification instead of loading
  as that key's KV.
* ``.kv`` (``checksum: false``, and every store written before kvmux checked
  blocks): the block's bytes alone, trusted as they are.

The suffix says which format a file has, so a store never has to guess
from sizes. CRC-32 is zlib's: in the standard library, and about 5 GB/s per
core on 16-256 KiB blocks here, well above what a disk write or a page-cache
read of the same block costs (google-crc32c is faster on cached buffers but
takes only read-only bytes, which would mean a copy of every block, and is no
dependency of kvmux). It detects the accidental damage this is for (bit rot,
torn writes, a file put under the wrong name); it is no defence against
someone who may write the directory.
"""

from __future__ import annotations

import struct
import zlib
from io import BufferedIOBase

from kvmux.keys import BlockKey

CHECKED_SUFFIX = ".kvc"
RAW_SUFFIX = ".kv"
_MAGIC = b"KVC1"
_HEADER = struct.Struct("<4sI")
HEADER_BYTES = _HEADER.size


class BlockFormat:
    """How one store names, writes and verifies its block files.

    ``scope`` (the layout fingerprint) goes into every checksum with the key,
    so a block is bound to the store it was written for as well as to its key.
    """

    def __init__(self, *, checked: bool, scope: str) -> None:
        self.checked = checked
        self.suffix = CHECKED_SUFFIX if checked else RAW_SUFFIX
        self.foreign_suffix = RAW_SUFFIX if checked else CHECKED_SUFFIX
        self.foreign_description = (
            f"without checksums ({RAW_SUFFIX}: written with checksum=false or before kvmux "
            "checked blocks, so they cannot be verified)"
            if checked
            else f"with checksums ({CHECKED_SUFFIX})"
        )
        self._scope = scope.encode() + b"/"

    def file_name(self, key: BlockKey) -> str:
        return _quote(key.id) + self.suffix

    def key_of(self, file_name: str) -> BlockKey | None:
        """The key a file of this format is named after; None for any other file."""
        if not file_name.endswith(self.suffix):
            return None
        try:
            return BlockKey.from_id(_unquote(file_name[: -len(self.suffix)]))
        except (ValueError, TypeError):
            return None  # a stranger's file that happens to share the suffix

    def file_nbytes(self, block_nbytes: int) -> int:
        return block_nbytes + (HEADER_BYTES if self.checked else 0)

    def write(self, f: BufferedIOBase, key: BlockKey, data: memoryview) -> None:
        """Write the block ``data`` of ``key`` (its checksum first, if checked)."""
        if self.checked:
            f.write(_HEADER.pack(_MAGIC, self._crc(key, data)))
        f.write(data)

    def read_into(self, f: BufferedIOBase, key: BlockKey, target: memoryview) -> str | None:
        """Fill ``target`` with the block ``f`` holds for ``key``; None if it is
        sound, else what is wrong with the file (``target`` is then garbage)."""
        wrong_size = f"wrong size, expected {self.file_nbytes(len(target))} bytes"
        expected_crc = 0
        if self.checked:
            header = f.read(HEADER_BYTES)
            if len(header) < HEADER_BYTES:
                return wrong_size
            magic, expected_crc = _HEADER.unpack(header)
            if magic != _MAGIC:
                return f"not a kvmux block file (magic {magic!r}, expected {_MAGIC!r})"
        if f.readinto(target) != len(target) or f.read(1):
            return wrong_size
        if self.checked and self._crc(key, target) != expected_crc:
            return (
                "checksum mismatch (crc32): its bytes were damaged, "
                "or it is another key's block put under this name"
            )
        return None

    def _crc(self, key: BlockKey, data: memoryview) -> int:
        return zlib.crc32(data, zlib.crc32(key.id.encode(), zlib.crc32(self._scope)))


def _quote(key_id: str) -> str:
    """A key id as a file name: '/' and '%' are the only characters to escape."""
    return key_id.replace("%", "%25").replace("/", "%2F")


def _unquote(name: str) -> str:
    return name.replace("%2F", "/").replace("%25", "%")
