"""The key/value header of a GGUF file, read in one pass with `struct` instead of numpy slices.

A GGUF file starts with typed metadata: a key (a length-prefixed UTF-8 string), a type tag,
then the value, which may be an array:

    key_len u64 | key bytes | type u32 | value
    value of an array:  item_type u32 | count u64 | count items
    value of a string:  len u64 | bytes

A tokenizer lives there: SmolLM2's file holds 49152 tokens and 48900 merges, i.e. about
98 000 little strings. The `gguf` package's reader cuts every length and every string out of
a `numpy.memmap` as its own array (each slice runs numpy's Python-level memmap hooks), which
takes seconds for those two arrays alone. Here each string is one `struct.unpack_from` of
its length and one slice of bytes; numeric arrays are one `numpy.frombuffer` each.

`GGUFMetadataReader` is `gguf.GGUFReader` with only that step replaced: the tensors (their
names, types, shapes and memory-mapped data) are read by `gguf` itself, and every field's
`contents()` returns what the stock reader's does (a test compares the two on the real file).
"""

import struct
import sys

import gguf
import numpy as np

STRING, ARRAY = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
# scalar value type -> struct format (bool is one byte, as in numpy)
STRUCT_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"}
STRUCT_FORMATS |= {10: "Q", 11: "q", 12: "d"}


class MetadataField:
    """One key/value pair, with `contents()` like gguf's ReaderField (strings decode on demand).

    `parts` and `data` (the stock reader's per-item numpy views) are built only if asked for.
    """

    def __init__(self, reader, offset: int, name: str, types: list, value, strings: bool):
        self.offset = offset  # where the key starts in the file
        self.name = name
        self.types = types  # [type] or [ARRAY, item type] (an empty array: [ARRAY])
        self._reader = reader
        self._value = value  # a Python scalar, bytes, or a list of numbers / of bytes
        self._strings = strings  # the value is a string or a list of strings, not yet decoded

    def contents(self, index_or_slice: int | slice = slice(None)):
        if self._strings:  # decoded on first use, as the stock reader decodes on each use
            if isinstance(self._value, list):
                self._value = [str(b, encoding="utf-8") for b in self._value]
            else:
                self._value = str(self._value, encoding="utf-8")
            self._strings = False
        if isinstance(self._value, list):
            return self._value[index_or_slice]
        return self._value

    @property
    def parts(self) -> list:
        return self._reader.stock_field(self.offset).parts

    @property
    def data(self) -> list[int]:
        return self._reader.stock_field(self.offset).data


class GGUFMetadataReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose key/value section is parsed with `struct` (see the module)."""

    def _build_fields(self, offs: int, count: int) -> int:
        view = memoryview(self.data)  # the memory-mapped file, as bytes
        host_little = sys.byteorder == "little"
        order = "<" if (self.byte_order == "I") == host_little else ">"

        def unpack(fmt: str, at: int):
            return struct.unpack_from(order + fmt, view, at)[0]

        def raw_string(at: int) -> tuple[bytes, int]:
            n = unpack("Q", at)
            if at + 8 + n > len(view):
                raise ValueError(f"a string at byte {at} runs past the end of the file")
            return view[at + 8 : at + 8 + n].tobytes(), at + 8 + n

        for _ in range(int(count)):
            start = offs
            key, offs = raw_string(offs)
            kind = gguf.GGUFValueType(unpack("I", offs))
            offs += 4
            strings = kind == STRING
            if kind == STRING:
                value, offs = raw_string(offs)
                types = [kind]
            elif kind in STRUCT_FORMATS:
                value, types = unpack(STRUCT_FORMATS[kind], offs), [kind]
                offs += struct.calcsize(STRUCT_FORMATS[kind])
            elif kind == ARRAY and unpack("I", offs) in (*STRUCT_FORMATS, STRING):
                item = gguf.GGUFValueType(unpack("I", offs))
                n = unpack("Q", offs + 4)
                offs += 12
                types = [kind, item] if n else [kind]
                strings = item == STRING
                if strings:
                    value = []
                    for _ in range(n):
                        b, offs = raw_string(offs)
                        value.append(b)
                else:
                    dtype = np.dtype(self.gguf_scalar_to_np[item]).newbyteorder(order)
                    value = np.frombuffer(view, dtype=dtype, count=n, offset=offs).tolist()
                    offs += n * dtype.itemsize
            else:  # arrays of arrays (none in llama.cpp's files so far): gguf's own parser
                field = self.stock_field(start)
                self._push_field(field, skip_sum=True)
                offs = start + sum(int(p.nbytes) for p in field.parts)
                continue
            name = str(key, encoding="utf-8")
            self._push_field(MetadataField(self, start, name, types, value, strings), True)
        return offs

    def stock_field(self, start: int) -> gguf.ReaderField:
        """The field at byte `start` as the stock reader builds it (numpy views into the file)."""
        key_len, key = self._get_str(start)
        offs = start + int(key_len.nbytes + key.nbytes)
        raw_type = self._get(offs, np.uint32)
        _size, parts, idxs, types = self._get_field_parts(offs + 4, raw_type[0])
        return gguf.ReaderField(
            start,
            str(bytes(key), encoding="utf-8"),
            [key_len, key, raw_type, *parts],
            [i + 3 for i in idxs],
            types,
        )
