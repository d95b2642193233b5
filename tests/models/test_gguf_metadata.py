"""The fast GGUF metadata reader returns what `gguf.GGUFReader` returns, field for field."""

import gguf
import numpy as np
import pytest

from stagewise.errors import StagewiseError
from stagewise.models.gguf_loader import open_gguf
from stagewise.models.gguf_metadata import GGUFMetadataReader, MetadataField


def assert_same_reading(fast: gguf.GGUFReader, stock: gguf.GGUFReader) -> None:
    assert list(fast.fields) == list(stock.fields)  # the same keys in the same order
    for key, theirs in stock.fields.items():
        ours = fast.fields[key]
        assert (ours.name, ours.offset, ours.types) == (theirs.name, theirs.offset, theirs.types), key
        a, b = ours.contents(), theirs.contents()
        assert a == b and type(a) is type(b), key
        if isinstance(a, list):
            assert [type(x) for x in a] == [type(x) for x in b], key
            if a:
                assert ours.contents(0) == theirs.contents(0) and ours.contents(slice(1, 3)) == b[1:3]
    assert fast.data_offset == stock.data_offset and fast.alignment == stock.alignment
    assert [(t.name, t.tensor_type, t.data_offset, t.data.shape) for t in fast.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.data.shape) for t in stock.tensors
    ]


def write_every_type(path, endianess=gguf.GGUFEndian.LITTLE):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    t = gguf.GGUFValueType
    scalars = [(t.UINT8, 7), (t.INT8, -3), (t.UINT16, 60000), (t.INT16, -2), (t.UINT32, 2**31)]
    scalars += [(t.INT32, -5), (t.FLOAT32, 0.1), (t.BOOL, True), (t.UINT64, 2**40)]
    scalars += [(t.INT64, -(2**40)), (t.FLOAT64, 0.1), (t.STRING, "héllo wörld")]
    for i, (kind, value) in enumerate(scalars):
        w.add_key_value(f"test.scalar.{i}", value, kind)
    w.add_array("test.strings", ["a", "", "Ġthe", "<|endoftext|>", "日本"])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 1e-5])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])  # arrays of arrays: gguf's own parser
    w.add_custom_alignment(64)
    w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b.weight", np.ones(5, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_reads_as_the_stock_reader(tmp_path, endianess):
    path = write_every_type(tmp_path / "all.gguf", endianess)
    fast, stock = GGUFMetadataReader(path), gguf.GGUFReader(path)
    assert_same_reading(fast, stock)
    assert fast.fields["test.strings"].contents() == ["a", "", "Ġthe", "<|endoftext|>", "日本"]
    assert isinstance(fast.fields["test.ints"], MetadataField)
    # the stock reader's numpy views are there too, built when asked for
    ours, theirs = fast.fields["test.ints"], stock.fields["test.ints"]
    assert ours.data == theirs.data
    assert [p.tolist() for p in ours.parts] == [p.tolist() for p in theirs.parts]
    np.testing.assert_array_equal(fast.tensors[0].data, np.arange(12, dtype=np.float32).reshape(3, 4))


def test_truncated_metadata_is_one_clear_error(tmp_path):
    path = write_every_type(tmp_path / "all.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index("Ġthe".encode()) + 2])  # inside the string array
    with pytest.raises(StagewiseError, match="not a valid GGUF file"):
        open_gguf(cut)


@pytest.mark.model
def test_the_real_file_reads_as_the_stock_reader():
    """SmolLM2's 49152 tokens, 48900 merges, token types and every other key: identical."""
    from stagewise.models.files import smollm2_gguf_path

    path = smollm2_gguf_path()
    assert_same_reading(open_gguf(path), gguf.GGUFReader(path))
