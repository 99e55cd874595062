"""A GGUF file parsed in one pass over a memory map: metadata and tensor views.

GGUF (llama.cpp's format, version 2 and 3, little-endian) is a header, a list
of key/value pairs, a list of tensor infos, and the tensor data, aligned to
`general.alignment` bytes (default 32). `gguf.GGUFReader` builds a numpy view
per value part (several per vocabulary string), which for a 262k-token
vocabulary is over a million small arrays; here a string array is read with
one `struct.unpack_from` per string straight into a Python list, numeric
arrays are one `np.frombuffer` view each, and the tensors are views of the
memory map (nothing is copied until dequantization).

`GGUFFile` offers what the loader uses of `gguf.GGUFReader`: `tensors` (each
with `name`, `tensor_type` (`gguf.GGMLQuantizationType`), `shape` (GGUF
order, fastest dimension first), `n_elements`, `data`: the same typed,
shaped view `GGUFReader` gives) and `metadata` (`{key: value}`, arrays as
lists, strings decoded; numeric arrays as lists too, so a value compares
equal to `GGUFReader`'s `field.contents()`).

Every count read from the header (a string's length, an array's) is checked
against the bytes left before it sizes a slice or a list: a cut or corrupt
header is a `ValueError` ("truncated header"; `gguf.GGUFReader` returns a
shortened last string instead).

Big-endian files are not parsed here; `open_gguf` falls back to
`gguf.GGUFReader` for them.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType) -> struct format of one scalar.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
           7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32,
          5: np.int32, 6: np.float32, 7: np.bool_, 10: np.uint64,
          11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class NotLittleEndianError(ValueError):
  """The file's version field reads as byte-swapped (a big-endian GGUF)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
  """One tensor of a GGUF file (the fields of `gguf.ReaderTensor` the
  loader reads).

  `shape` is GGUF's order (fastest-varying first); `data` is a read-only
  view of the file: `float32` / `float16` / ... `[*reversed(shape)]` for
  plain types, `uint8[*reversed(shape)[:-1], bytes_per_row]` for block
  quantized ones.
  """
  name: str
  tensor_type: object  # gguf.GGMLQuantizationType
  shape: np.ndarray
  n_elements: int
  n_bytes: int
  data: np.ndarray


class GGUFFile:
  """A parsed GGUF file (see the module docstring).

  Args:
    path: the file.

  Raises:
    NotLittleEndianError: a big-endian file.
    ValueError: not a GGUF file (bad magic, unsupported version, truncated
      or inconsistent header, unknown value or tensor type).
  """

  def __init__(self, path: str):
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    self.path = path
    mm = np.memmap(path, mode="r", dtype=np.uint8)
    buf = memoryview(mm)
    if len(buf) < 24 or bytes(buf[:4]) != GGUF_MAGIC:
      raise ValueError(
          f"Invalid GGUF file {path!r}: expected magic {GGUF_MAGIC!r}, got "
          f"{bytes(buf[:4])!r}")
    version, = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0 and version:
      raise NotLittleEndianError(f"{path!r} is a big-endian GGUF file")
    if version not in (2, 3):
      raise ValueError(
          f"Invalid GGUF file {path!r}: expected version 2 or 3, got {version}")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    self._buf = buf
    self._pos = 24
    try:
      metadata = {}
      for _ in range(n_kv):
        key = self._string()
        vtype, = self._unpack("<I")
        metadata[key] = self._value(vtype)
      infos = []
      for _ in range(n_tensors):
        name = self._string()
        n_dims, = self._unpack("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
        self._pos += 8 * n_dims
        ttype, offset = self._unpack("<IQ")
        infos.append((name, dims, ttype, offset))
    except struct.error as e:
      raise ValueError(f"Invalid GGUF file {path!r}: truncated header ({e})"
                       ) from e
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-self._pos // align) * align
    plain = {GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64,
             GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16,
             GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    tensors, seen = [], set()
    for name, dims, ttype, offset in infos:
      if name in seen:
        raise ValueError(
            f"Invalid GGUF file {path!r}: duplicated tensor {name!r}")
      seen.add(name)
      try:
        qtype = GGMLQuantizationType(ttype)
      except ValueError:
        raise ValueError(
            f"Invalid GGUF file {path!r}: tensor {name!r} has unknown type "
            f"{ttype}") from None
      block, type_size = GGML_QUANT_SIZES[qtype]
      n_elems = int(np.prod(dims, dtype=np.int64))
      n_bytes = n_elems * type_size // block
      np_dims = tuple(reversed(dims))
      lo = start + offset
      if lo + n_bytes > mm.size:
        raise ValueError(
            f"Invalid GGUF file {path!r}: tensor {name!r} ends past the file")
      raw = mm[lo:lo + n_bytes]
      if qtype in plain:
        data = raw.view(plain[qtype]).reshape(np_dims)
      else:
        data = raw.reshape(quant_shape_to_byte_shape(np_dims, qtype))
      tensors.append(GGUFTensor(name, qtype, np.asarray(dims, np.uint64),
                                n_elems, n_bytes, data))
    del self._buf
    self.metadata = metadata
    self.tensors = tensors
    self.alignment = align
    self.data_offset = start

  def _unpack(self, fmt: str):
    out = struct.unpack_from(fmt, self._buf, self._pos)
    self._pos += struct.calcsize(fmt)
    return out

  def _need(self, n_bytes: int, what: str):
    """`struct.error` (a truncated header) unless `n_bytes` more bytes
    follow the read position: a count read from a cut or corrupt file is
    not trusted to size a slice or a list."""
    left = len(self._buf) - self._pos
    if n_bytes > left:
      raise struct.error(f"{what} of {n_bytes} bytes at byte {self._pos}, "
                         f"{left} left")

  def _string(self) -> str:
    n, = self._unpack("<Q")
    self._need(n, "a string")
    lo = self._pos
    self._pos = lo + n
    return str(self._buf[lo:lo + n], "utf-8", "replace")

  def _value(self, vtype: int):
    if vtype == _STRING:
      return self._string()
    if vtype in _SCALAR:
      v, = self._unpack(_SCALAR[vtype])
      return v
    if vtype != _ARRAY:
      raise ValueError(f"unknown GGUF value type {vtype}")
    itype, n = self._unpack("<IQ")
    if itype == _STRING:
      self._need(8 * n, f"an array of {n} strings")
      buf, pos, out = self._buf, self._pos, [None] * n
      unpack = struct.Struct("<Q").unpack_from
      for i in range(n):
        m, = unpack(buf, pos)
        if pos + 8 + m > len(buf):
          raise struct.error(f"string {i} of {n} runs past the end")
        out[i] = str(buf[pos + 8:pos + 8 + m], "utf-8", "replace")
        pos += 8 + m
      self._pos = pos
      return out
    if itype in _NUMPY:
      dt = np.dtype(_NUMPY[itype]).newbyteorder("<")
      self._need(n * dt.itemsize, f"an array of {n} {dt.name}")
      arr = np.frombuffer(self._buf, dt, count=n, offset=self._pos)
      self._pos += n * dt.itemsize
      return arr.tolist()
    # Nested arrays: each element takes at least one byte.
    self._need(n, f"an array of {n} values")
    return [self._value(itype) for _ in range(n)]
