"""`pkvattn.models.gguf_reader.GGUFFile` on small GGUF files built here byte
by byte from the GGUF specification (ggml's docs/gguf.md): the header's
version (2 or 3; a big-endian file is told apart), every numeric array type
and nested arrays, `general.alignment`, tensor sizes and bounds, and the
malformed headers the parser refuses. `gguf.GGUFReader` (the package the
parser replaces) is the second opinion where it reads the file."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pkvattn.models import gguf as pk_gguf  # noqa: E402
from pkvattn.models.gguf_reader import GGUFFile  # noqa: E402
from pkvattn.models.gguf_reader import NotLittleEndianError  # noqa: E402

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

# GGUF value type -> (numpy dtype, struct format of one scalar), little-endian.
NUMERIC = {V.UINT8: ("<u1", "<B"), V.INT8: ("<i1", "<b"),
           V.UINT16: ("<u2", "<H"), V.INT16: ("<i2", "<h"),
           V.UINT32: ("<u4", "<I"), V.INT32: ("<i4", "<i"),
           V.FLOAT32: ("<f4", "<f"), V.BOOL: ("?", "<?"),
           V.UINT64: ("<u8", "<Q"), V.INT64: ("<i8", "<q"),
           V.FLOAT64: ("<f8", "<d")}


def _str(s: str) -> bytes:
  b = s.encode()
  return struct.pack("<Q", len(b)) + b


def _value(vtype, value) -> bytes:
  """A value's bytes (no type tag): scalars, strings, arrays (tagged with
  their element type, `(element_type, [values])`), nested arrays."""
  if vtype == V.STRING:
    return _str(value)
  if vtype == V.ARRAY:
    etype, items = value
    inner = etype[0] if isinstance(etype, tuple) else etype
    out = struct.pack("<IQ", inner, len(items))
    for item in items:
      out += _value(inner, (etype[1], item) if inner == V.ARRAY else item)
    return out
  return struct.pack(NUMERIC[vtype][1], value)


def _gguf(kvs=(), tensors=(), *, version=3, alignment=None, endian="<",
          trailing_pad=True):
  """A GGUF file's bytes. kvs: (key, vtype, value); tensors: (name, dims
  (GGUF order, fastest first), ggml type, raw bytes). Each tensor's offset
  is aligned to `alignment` (32 when None: `general.alignment` absent).

  Returns (bytes, data_offset, [each tensor's offset from data_offset])."""
  kvs = list(kvs)
  if alignment is not None:
    kvs.append(("general.alignment", V.UINT32, alignment))
  align = alignment or 32
  head = b"GGUF" + struct.pack(f"{endian}IQQ", version, len(tensors), len(kvs))
  for key, vtype, value in kvs:
    head += _str(key) + struct.pack("<I", vtype) + _value(vtype, value)
  data, offsets = b"", []
  for name, dims, ttype, raw in tensors:
    data += bytes(-len(data) % align)
    offsets.append(len(data))
    head += _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims,
                                     ttype, len(data))
    data += raw
  if trailing_pad:
    data += bytes(-len(data) % align)
  start = len(head) + (-len(head) % align)
  return head + bytes(start - len(head)) + data, start, offsets


def _f32(rng, *shape):
  return rng.standard_normal(shape).astype(np.float32)


def _open(tmp_path, blob, name="m.gguf"):
  path = tmp_path / name
  path.write_bytes(blob)
  return GGUFFile(str(path))


def test_numeric_arrays_of_every_type_and_nested_arrays(tmp_path, rng):
  """Arrays of each of the 11 numeric types (random values, as the type
  stores them, and an integer type's least and greatest), arrays of arrays (of numbers, of strings), each compared
  with the values written and with GGUFReader's types."""
  kvs, want = [], {}
  for vtype, (dtype, _) in NUMERIC.items():
    dt = np.dtype(dtype)
    n = int(rng.integers(1, 6))
    if dt.kind == "b":
      values = rng.integers(0, 2, n).astype(bool)
    elif dt.kind == "f":
      values = rng.standard_normal(n).astype(dt)
    else:
      info = np.iinfo(dt)
      values = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
      # The type's ends too: a value that only this type holds.
      values = rng.permutation(np.concatenate(
          [values, np.asarray([info.min, info.max], dt)]))
    kvs.append((f"a.{vtype.name}", V.ARRAY, (vtype, values.tolist())))
    want[f"a.{vtype.name}"] = values.tolist()
    # One scalar of each type too.
    kvs.append((f"s.{vtype.name}", vtype, values[0].item()))
    want[f"s.{vtype.name}"] = values[0].item()
  nested = [rng.integers(0, 256, int(rng.integers(0, 4))).tolist()
            for _ in range(3)]
  kvs.append(("n.u8", V.ARRAY, ((V.ARRAY, V.UINT8), nested)))
  want["n.u8"] = nested
  words = [["a", "日本"], [], ["▁b"]]
  kvs.append(("n.str", V.ARRAY, ((V.ARRAY, V.STRING), words)))
  want["n.str"] = words
  blob, _, _ = _gguf(kvs)
  f = _open(tmp_path, blob)
  assert f.metadata == want
  ref = gguf.GGUFReader(str(tmp_path / "m.gguf"))
  for vtype in NUMERIC:
    for key in (f"a.{vtype.name}", f"s.{vtype.name}"):
      theirs = ref.fields[key].contents()
      assert f.metadata[key] == theirs, key
      ours = f.metadata[key]
      ours, theirs = (ours[0], theirs[0]) if key[0] == "a" else (ours, theirs)
      assert type(ours) is type(theirs), key


@pytest.mark.parametrize("alignment", [None, 8, 64, 256])
def test_alignment_places_the_tensor_data(alignment, tmp_path, rng):
  """Tensor data starts at the header's end rounded up to
  `general.alignment` (32 when absent); offsets count from there."""
  a, b = _f32(rng, 3, 5), _f32(rng, 7)
  q = gguf.quants.quantize(_f32(rng, 2, 64), Q.Q8_0)  # u8[2, 68]
  name_len = int(rng.integers(1, 40))  # moves the header's end
  tensors = [("x" * name_len, (5, 3), Q.F32, a.tobytes()),
             ("b", (7,), Q.F32, b.tobytes()),
             ("q", (64, 2), Q.Q8_0, q.tobytes())]
  blob, start, offsets = _gguf([("k", V.UINT8, 1)], tensors,
                               alignment=alignment)
  f = _open(tmp_path, blob)
  assert f.alignment == (alignment or 32) and f.data_offset == start
  np.testing.assert_array_equal(f.tensors[0].data, a)
  np.testing.assert_array_equal(f.tensors[1].data, b)
  np.testing.assert_array_equal(f.tensors[2].data, q)
  assert [t.name for t in f.tensors] == ["x" * name_len, "b", "q"]
  ref = gguf.GGUFReader(str(tmp_path / "m.gguf"))
  assert ref.data_offset == start
  for ours, theirs, offset in zip(f.tensors, ref.tensors, offsets):
    assert theirs.data_offset == start + offset
    np.testing.assert_array_equal(ours.data, theirs.data)


def test_tensor_sizes(tmp_path, rng):
  """`n_elements` (the dims' product) and `n_bytes` (`n_elements / block *
  type_size`, ggml's `GGML_QUANT_SIZES`), and the data's shapes."""
  rows, blocks = (int(x) for x in rng.integers(1, 5, 2))
  cols = 32 * blocks
  q = gguf.quants.quantize(_f32(rng, rows, cols), Q.Q8_0)
  h = _f32(rng, rows, 3).astype(np.float16)
  blob, _, _ = _gguf((), [("q", (cols, rows), Q.Q8_0, q.tobytes()),
                          ("h", (3, rows), Q.F16, h.tobytes())])
  f = _open(tmp_path, blob)
  tq, th = f.tensors
  assert tq.n_elements == rows * cols and th.n_elements == rows * 3
  assert tq.n_bytes == rows * blocks * 34 and th.n_bytes == rows * 3 * 2
  assert tq.shape.tolist() == [cols, rows] and th.shape.tolist() == [3, rows]
  assert tq.data.shape == (rows, blocks * 34) and th.data.dtype == np.float16
  np.testing.assert_array_equal(th.data, h)
  with pytest.raises(dataclasses.FrozenInstanceError):
    tq.name = "r"  # open_gguf's callers share one parse


@pytest.mark.parametrize("version", [2, 3])
def test_versions_2_and_3_parse(version, tmp_path, rng):
  a = _f32(rng, 4)
  blob, _, _ = _gguf([("general.name", V.STRING, "m")],
                     [("a", (4,), Q.F32, a.tobytes())], version=version)
  f = _open(tmp_path, blob)
  assert f.metadata == {"general.name": "m"}
  np.testing.assert_array_equal(f.tensors[0].data, a)


@pytest.mark.parametrize("version", [0, 1, 4, 0x10001])
def test_other_versions_are_refused(version, tmp_path):
  blob, _, _ = _gguf([("k", V.UINT8, 1)], version=version)
  with pytest.raises(ValueError, match=f"expected version 2 or 3, got "
                     f"{version}$") as e:
    _open(tmp_path, blob)
  assert not isinstance(e.value, NotLittleEndianError)


def test_big_endian_files_go_to_gguf_reader(tmp_path, rng):
  """A big-endian GGUF (version 3 byte-swapped) is refused by `GGUFFile`
  with `NotLittleEndianError`; `open_gguf` reads it with `GGUFReader`."""
  blob, _, _ = _gguf(endian=">")
  with pytest.raises(NotLittleEndianError):
    _open(tmp_path, blob, "hand.gguf")
  a = _f32(rng, 2, 3)
  path = tmp_path / "be.gguf"
  w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
  w.add_uint32("t.n", 7)
  w.add_tensor("a", a)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(NotLittleEndianError):
    GGUFFile(str(path))
  reader = pk_gguf.open_gguf(str(path))
  assert isinstance(reader, gguf.GGUFReader)
  assert pk_gguf.read_metadata(reader)["t.n"] == 7
  np.testing.assert_array_equal(reader.tensors[0].data.astype(np.float32), a)


def test_smallest_file(tmp_path):
  """A 24-byte header with no tensors and no keys is a GGUF file; one byte
  less is not."""
  padded, start, _ = _gguf()
  assert start == 32 and padded[24:] == bytes(8)
  blob = padded[:24]  # the padding up to the (empty) data section dropped
  f = _open(tmp_path, blob)
  assert f.metadata == {} and f.tensors == []
  with pytest.raises(ValueError, match="magic"):
    _open(tmp_path, blob[:23], "short.gguf")


def test_last_tensor_may_end_the_file(tmp_path, rng):
  """No padding is needed after the last tensor; a tensor cut short by the
  file's end is refused."""
  a = _f32(rng, 5)
  blob, _, _ = _gguf((), [("a", (5,), Q.F32, a.tobytes())],
                     trailing_pad=False)
  np.testing.assert_array_equal(_open(tmp_path, blob).tensors[0].data, a)
  with pytest.raises(ValueError, match="'a' ends past the file"):
    _open(tmp_path, blob[:-1], "cut.gguf")


def test_malformed_headers_are_refused(tmp_path, rng):
  a = _f32(rng, 4).tobytes()
  dup, _, _ = _gguf((), [("t", (4,), Q.F32, a), ("t", (4,), Q.F32, a)])
  with pytest.raises(ValueError, match="duplicated tensor 't'"):
    _open(tmp_path, dup, "dup.gguf")
  unknown, _, _ = _gguf((), [("t", (4,), 4, a)])  # 4 = the removed Q4_2
  with pytest.raises(ValueError, match="'t' has unknown type 4"):
    _open(tmp_path, unknown, "type.gguf")
  good, _, _ = _gguf([("k", V.UINT32, 5)])
  bad_value = good.replace(struct.pack("<I", V.UINT32) + struct.pack("<I", 5),
                           struct.pack("<I", 13) + struct.pack("<I", 5))
  with pytest.raises(ValueError, match="unknown GGUF value type 13"):
    _open(tmp_path, bad_value, "value.gguf")
  long, _, _ = _gguf([("key", V.STRING, "v" * 64)])
  with pytest.raises(ValueError, match="truncated header"):
    _open(tmp_path, long[:40], "trunc.gguf")


@pytest.mark.parametrize("case", ["string", "string array", "numeric array",
                                  "empty strings"])
def test_a_header_cut_inside_its_last_value_is_refused(case, tmp_path):
  """A file with no tensors cut inside its last value (its count says more
  bytes than the file has) is a truncated header; cut right after that
  value, it parses."""
  key, vtype, value = {
      "string": ("k", V.STRING, "v" * 64),
      "string array": ("k", V.ARRAY, (V.STRING, ["ab", "c" * 40])),
      "numeric array": ("k", V.ARRAY, (V.UINT32, list(range(16)))),
      # 8 bytes a string (its length) and no more: the least a count of
      # strings can take.
      "empty strings": ("k", V.ARRAY, (V.STRING, ["", "", ""]))}[case]
  blob, _, _ = _gguf([(key, vtype, value)], trailing_pad=False)
  end = 24 + len(_str(key)) + 4 + len(_value(vtype, value))
  whole = _open(tmp_path, blob[:end], "whole.gguf")
  assert whole.metadata[key] == (value if vtype == V.STRING else value[1])
  with pytest.raises(ValueError, match="truncated header"):
    _open(tmp_path, blob[:end - 5], "cut.gguf")


@pytest.mark.parametrize("etype", [V.STRING, V.UINT64, V.ARRAY])
def test_huge_counts_are_refused_before_they_are_used(etype, tmp_path):
  """An array count of 2**62 in a short file (a corrupt header) is a
  truncated header, found before a list or buffer of that size is made."""
  blob = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _str("k")
          + struct.pack("<IIQ", V.ARRAY, etype, 2**62) + bytes(64))
  with pytest.raises(ValueError, match="truncated header"):
    _open(tmp_path, blob)


def test_array_of_an_unknown_element_type_is_refused(tmp_path):
  """An array whose element type is none of the spec's 0-12 (13 here) is
  refused, though its bytes would read as two 8-byte values."""
  blob = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _str("k")
          + struct.pack("<IIQ", V.ARRAY, 13, 2) + bytes(16))
  with pytest.raises(ValueError, match="unknown GGUF value type 13"):
    _open(tmp_path, blob)
