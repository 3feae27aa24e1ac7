#!/usr/bin/env python3
"""Writes the seed corpus for fuzz_safetensors into fuzz/corpus/safetensors/.

Seeds are small on purpose (libFuzzer mutates them): a few valid files covering every dtype,
scalars, empty tensors and metadata, and one file per kind of corruption the reader rejects,
so the fuzzer starts next to every validation branch. Deterministic: rerunning rewrites the
same bytes. Usage: python3 fuzz/make_corpus.py [out_dir]
"""
import json
import os
import struct
import sys

SIZES = {"F32": 4, "F64": 8, "BF16": 2, "F16": 2, "I32": 4, "I64": 8}


def pack(header, data, pad=True):
    """8-byte LE header length + header (padded with spaces to a multiple of 8) + data."""
    h = header if isinstance(header, bytes) else header.encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def valid(tensors, metadata=None):
    """tensors: list of (name, dtype, shape); data bytes are 0, 1, 2, ..."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in sorted(tensors):
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    return pack(json.dumps(header, separators=(",", ":")), bytes(i % 251 for i in range(offset)))


def entry(dtype, shape, offsets):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def raw(header_obj, data_len):
    return pack(json.dumps(header_obj, separators=(",", ":")), bytes(data_len))


def seeds():
    yield "valid_empty", valid([])
    yield "valid_one_f32", valid([("w", "F32", [2, 3])])
    yield "valid_all_dtypes", valid([(d.lower(), d, [2]) for d in SIZES])
    yield "valid_scalar_and_empty", valid([("s", "F64", []), ("e", "BF16", [0, 4]), ("i", "I64", [1])])
    yield "valid_metadata", valid([("w", "F16", [3])], {"format": "pt", "k": "v"})
    one = valid([("w", "F32", [2, 3])])
    yield "bad_truncated", one[:-3]
    yield "bad_short", one[:5]
    yield "bad_header_len", struct.pack("<Q", 1 << 40) + b"{}"
    yield "bad_json", pack('{"w":{"dtype":"F32",', b"")
    yield "bad_not_object", pack("[1,2,3]", b"")
    yield "bad_dtype", raw({"w": entry("U8", [4], [0, 4])}, 4)
    yield "bad_shape", raw({"w": entry("F32", [-1], [0, 4])}, 4)
    yield "bad_shape_overflow", raw({"w": entry("F32", [2**62, 4], [0, 0])}, 0)
    yield "bad_offsets", raw({"w": entry("F32", [1], [4, 0])}, 4)
    yield "bad_size", raw({"w": entry("F32", [2], [0, 4])}, 4)
    yield "bad_overlap", raw({"a": entry("I32", [2], [0, 8]), "b": entry("I32", [1], [4, 8])}, 8)
    yield "bad_gap", raw({"a": entry("I32", [1], [0, 4]), "b": entry("I32", [1], [8, 12])}, 12)
    yield "bad_duplicate", pack('{"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]},'
                                '"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}', bytes(4))
    yield "bad_metadata", raw({"__metadata__": {"k": 1}}, 0)
    yield "bad_nul", pack(b'{}\x00{"w":1}', b"", pad=False)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "corpus", "safetensors")
    os.makedirs(out, exist_ok=True)
    for name, data in seeds():
        with open(os.path.join(out, name + ".safetensors"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
