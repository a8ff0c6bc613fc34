#!/usr/bin/env python3
"""Writes the hand-made seed inputs of fuzz/corpus/<target>/seed-* (valid and near-valid inputs).
Run from anywhere: python3 fuzz/seeds.py. Not written here: regression inputs of findings
(regress-*), and the schedule seeds gen-<name>[-compute], which are to_text(make_schedule(name, 2, 4,
v)) (v = 2 for interleaved_1f1b, else 1) with and without communication, for every
pipe::schedule_names()."""
import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def compact(v) -> bytes:  # io::json::dump: sorted keys, no spaces (ASCII content only here)
    return json.dumps(v, sort_keys=True, separators=(",", ":")).encode()


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# ---- json ----------------------------------------------------------------------------------------
for name, text in {
    "object": '{"a": 1, "b": [true, false, null], "c": {"d": "e"}}',
    "numbers": "[0, -0, -0.0, 1.5, -2e-3, 1E+10, 9223372036854775807, -9223372036854775808, "
               "9223372036854775808, 1e308, 5e-324, 0.1]",
    "strings": r'["", "plain", "esc \" \\ \/ \b \f \n \r \t", "\u00e9\u4e2d", "\ud83d\ude00", "caf\u00c3\u00a9"]',
    "nested": "[[[[[[[[[[{\"k\": [[[]]]}]]]]]]]]]]",
    "deep64": "[" * 64 + "]" * 64,
    "deep66": "[" * 66 + "]" * 66,
    "safetensors-header": '{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}',
    "trailing-comma": '{"a": 1,}',
    "duplicate-key": '{"a": 1, "a": 2}',
    "lone-surrogate": r'"\ud800x"',
    "low-surrogate": r'"\udc00"',
    "leading-zero": "[01]",
    "unterminated": '{"a": "b',
    "trailing": "{} x",
    "bad-number": "[1.2.3, -]",
    "control-char": '"a\x01b"',
    "whitespace": " \t\r\n{ \"a\" : [ 1 , 2 ] } \n",
}.items():
    write("json", name, text)

# ---- checkpoint_index ----------------------------------------------------------------------------
def index(version=3, world=2, tensors=None, seal=True):
    ranks = [{"format": "trellis-checkpoint", "rng": "42", "trellis.rank": str(r)} for r in range(world)]
    body = {
        "format": "trellis-checkpoint",
        "version": version,
        "step": 100,
        "world_size": world,
        "metadata": ranks[0],
        "rank_metadata": ranks,
        "tensors": tensors if tensors is not None else {
            "wte": {"dtype": "F32", "shape": [4, 6], "shards": [
                {"file": "shard-0.safetensors", "key": "trellis.shard.wte.0", "offsets": [0, 0],
                 "shape": [2, 6], "crc32c": "00000000"},
                {"file": "shard-1.safetensors", "key": "trellis.shard.wte.1", "offsets": [2, 0],
                 "shape": [2, 6], "crc32c": "00000000"}]},
            "step": {"dtype": "I64", "shape": [], "shards": [
                {"file": "optim-0.safetensors", "key": "step", "offsets": [], "shape": [], "crc32c": "12345678"}]},
        },
    }
    if version >= 3:
        body["rank_metadata_crc32c"] = ["%08x" % crc32c(compact(m)) for m in ranks]
    if seal:
        body["index_crc32c"] = "%08x" % crc32c(compact(body))
    return json.dumps(body, indent=1, sort_keys=True)


write("checkpoint_index", "sealed", index())
write("checkpoint_index", "unsealed", index(seal=False))
write("checkpoint_index", "version1", index(version=1, world=1, seal=False))
write("checkpoint_index", "overlap", index(tensors={"w": {"dtype": "BF16", "shape": [4], "shards": [
    {"file": "a", "key": "a", "offsets": [0], "shape": [3], "crc32c": "0"},
    {"file": "b", "key": "b", "offsets": [2], "shape": [2], "crc32c": "0"}]}}))
write("checkpoint_index", "gap", index(tensors={"w": {"dtype": "F16", "shape": [4, 1], "shards": [
    {"file": "a", "key": "a", "offsets": [0, 0], "shape": [1, 1], "crc32c": "0"}]}}))
write("checkpoint_index", "huge-shape", index(tensors={"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "shards": []}}))
write("checkpoint_index", "world-mismatch", index(world=3).replace('"world_size": 3', '"world_size": 2'))

# ---- safetensors ---------------------------------------------------------------------------------
def safetensors(tensors, metadata=None, with_crc=True, pad=True, data_extra=b""):
    header, blobs, off = {}, [], 0
    meta = dict(metadata or {})
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(blob)]}
        if with_crc:
            meta["crc32c." + name] = "%08x" % crc32c(blob)
        blobs.append(blob)
        off += len(blob)
    if meta:
        header["__metadata__"] = meta
    text = compact(header)
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs) + data_extra


w = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
write("safetensors", "two-tensors", safetensors({"w": ("F32", [2, 3], w), "b": ("I64", [2], struct.pack("<2q", 7, -7))},
                                                  {"format": "pt"}))
write("safetensors", "all-dtypes", safetensors({
    "f64": ("F64", [1], struct.pack("<d", 1.5)), "f16": ("F16", [2], b"\x00\x3c\x00\xc0"),
    "bf16": ("BF16", [1], b"\x80\x3f"), "i8": ("I8", [3], b"\x01\x02\xff"), "u8": ("U8", [1], b"\xff"),
    "i32": ("I32", [1], struct.pack("<i", -1)), "u32": ("U32", [1], struct.pack("<I", 1)),
    "u64": ("U64", [1], struct.pack("<Q", 2)), "empty": ("F32", [0, 5], b""), "scalar": ("F32", [], b"\x00" * 4)}))
write("safetensors", "no-crc", safetensors({"w": ("F32", [2, 3], w)}, with_crc=False, pad=False))
write("safetensors", "bad-crc", safetensors({"w": ("F32", [2, 3], w)}, {"crc32c.w": "deadbeef"}, with_crc=False))
write("safetensors", "truncated", safetensors({"w": ("F32", [2, 3], w)})[:-5])
write("safetensors", "extra-bytes", safetensors({"w": ("F32", [2, 3], w)}, data_extra=b"\x00" * 4))
write("safetensors", "header-too-long", struct.pack("<Q", 1 << 40) + b"{}")
write("safetensors", "short", b"\x02\x00\x00")
write("safetensors", "huge-shape", safetensors({"w": ("F32", [1 << 62, 1 << 62], b"")}, with_crc=False))
write("safetensors", "overlap",
      struct.pack("<Q", 88) + b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                              b'"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}'.ljust(88) + b"abc")

# ---- schedule ------------------------------------------------------------------------------------
for name, text in {
    "1f1b": "# 1F1B, 2 ranks, 3 microbatches\n@ name=mine placement=loop backward=full\n"
            "F0 F1 B0 W0 F2 B1 W1 B2 W2\nF0 B0 W0 F1 B1 W1 F2 B2 W2\n",
    "explicit-comm": "@ name=c stages=2 microbatches=1 chunks=1\nF0 Sa0>1 Rg0<1 B0 W0\nRa0<0 F0 B0 Sg0>0 W0\n",
    "interleaved": "@ chunks=2\nF0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0 W0.0 W1.0 W0.1 W1.1\n"
                   "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0 W0.0 W1.0 W0.1 W1.1\n",
    "vee": "@ placement=vee\nF0.0 F0.1 B0.1 B0.0 W0.1 W0.0\nF0.0 F0.1 B0.1 B0.0 W0.1 W0.0\n",
    "local-loss": "@ loss=local backward=split\r\nF0 B0 W0\r\nF0 B0 W0\r\n",
    "deadlock": "@ stages=2 microbatches=1\nRg0<1 F0 Sa0>1 B0 W0\nRa0<0 F0 B0 Sg0>0 W0\n",
    "missing": "F0 B0\nF0 B0 W0\n",
    "unknown-action": "F0 X1\n",
    "header-after": "F0 B0 W0\n@ name=late\n",
    "big-numbers": "@ microbatches=1000000000 chunks=1000000000\nF999999999.999999999\nF0\nF0\n",
    "too-large": "F10000000000\n",
    "bad-peer": "F0 Sa0>7 B0 W0\n",
    "comments-only": "# nothing here\n\n   \n",
}.items():
    write("schedule", name, text)

# ---- flags ---------------------------------------------------------------------------------------
for name, words in {
    "layout": ["--dp", "2", "--tp=2", "--pp", "2", "--sp", "--zero1", "--schedule", "zb_v", "--lr", "1e-3"],
    "model": ["--layers", "2", "--heads", "2", "--width", "64", "--vocab", "50257", "--context", "32"],
    "cuda": ["--backend", "cuda", "--dtype", "bf16", "--heads", "3", "--width", "100"],
    "output": ["--ckpt-dir", "out/ck", "--ckpt-every", "5", "--keep-last", "2", "--resume", "--log", "out/m.jsonl",
               "--export-hf", "hf", "--init-from", "gpt2.safetensors"],
    "data": ["--data", "a.bin,b.bin", "--val-fraction", "0.2", "--prompt", "Once upon", "--temperature", "0"],
    "numbers": ["--steps", "-1", "--warmup", "2147483647", "--seed", "-5", "--peak-gflops", "nan",
                "--weight-decay", "inf", "--dropout", "1e309"],
    "overflow": ["--width", "2147483648", "--layers", "-2147483648", "--heads", "-1"],
    "huge-model": ["--width", "1048576", "--layers", "100000", "--dp", "1000", "--tp", "1000", "--pp", "1000"],
    "missing-value": ["--dp"],
    "unknown": ["--bogus", "--help"],
    "schedule-file": ["--pp", "2", "--schedule-file", "/dev/null", "--schedule", "gpipe", "--overlap", "4"],
    "checked-values": ["--keep-last", "1", "--weight-decay", "-0.5", "--peak-gflops", "0"],
    "custom-schedule": ["--pp", "2", "--microbatches", "2", "--layers", "2", "--schedule-file", "mine.txt"],
}.items():
    write("flags", name, "\n".join(words))

# ---- data_shard ----------------------------------------------------------------------------------
def shard(tokens, magic=20240520, version=1, count=None, vocab_byte=0, cut=0):
    header = [0] * 256
    header[0], header[1] = magic, version
    header[2] = len(tokens) if count is None else count
    header[3] = vocab_byte
    blob = struct.pack("<256i", *header) + struct.pack("<%dH" % len(tokens), *tokens)
    return blob[: len(blob) - cut] if cut else blob


write("data_shard", "valid", shard([1, 2, 3, 50256, 0]))
write("data_shard", "empty", shard([]))
write("data_shard", "small-vocab", shard([1, 2, 3], vocab_byte=3))
write("data_shard", "bad-magic", shard([1], magic=20240521))
write("data_shard", "bad-version", shard([1], version=2))
write("data_shard", "negative-count", shard([], count=-1))
write("data_shard", "count-too-big", shard([1, 2], count=0x7FFFFFFF))
write("data_shard", "truncated", shard([1, 2, 3], cut=1))
write("data_shard", "short", b"\x28\x0b\x35\x01")
write("data_shard", "position", "seed=1234;next_batch=17")
write("data_shard", "position-max", "seed=18446744073709551615;next_batch=9223372036854775807")
write("data_shard", "position-bad", "seed=-1;next_batch=99999999999999999999")
