#!/usr/bin/env python3
"""Fault campaign for train_gpt's checkpoints (issue #18): kill -9 during training, then --resume;
mutated checkpoints, then --resume. Python 3, standard library only.

  scripts/fault_campaign.py --train-gpt build/host/examples/train_gpt/train_gpt \
      [--kills 30] [--mutations 2000] [--seed 1] [--work build/fault-campaign] [--layouts 1,dp2]

1. Reference, per layout (--layouts: 1 = one rank, dp2, dp2-zero1, tp2, pp2; thread ranks): a
   tiny model trained --steps S uninterrupted with a checkpoint every --ckpt-every steps, twice
   (the per-step losses of metrics.jsonl and the final checkpoint's files must be identical: the
   run is deterministic), then resumed from every intermediate checkpoint (the resumed losses and
   final checkpoint must equal the uninterrupted run's bit for bit). The campaign relies on both.
2. Kills: the same run with a fresh checkpoint directory, SIGKILLed
     random: at a time uniform over the reference run's wall time (startup, steps and saves),
     save:   as soon as a step-N.partial directory of a random save appears (during a save),
     commit: as soon as `latest` names a random step (right after a commit),
   while the checkpoint directory is polled (0.5 ms) for `latest` and the .partial directories;
   then `--resume` to S steps. Pass: exit 0, resumed from at least the step `latest` named
   before the kill, metrics.jsonl has every step 1..S exactly once with the reference's losses
   (bitwise), the final checkpoint's files equal the reference's byte for byte. A kill before
   the first commit must give a clear "no checkpoint" error.
3. Mutations: one good checkpoint (the reference's step S/2, alone under a fresh root with
   `latest`) is copied per trial and mutated once (byte-level: bit flips, truncation, deletion,
   garbage, zeroed ranges, swapped or stale files, FIFOs, symlinks, directories; structure-aware:
   `latest` texts, index.json numbers and JSON structure, index.json edits resealed with
   recomputed CRC32Cs so they reach the checks behind the checksums, safetensors header edits
   and header-length fields); then resumed for one step. Outcomes: harmless (exit 0, loss and
   final checkpoint identical to the unmutated resume), clear_error (non-zero exit, a
   `train_gpt: trellis: ...` line naming a path under the checkpoint root), and the bad ones:
   crash (killed by a signal), hang (--timeout), unclear_error (any other failure), silent_wrong
   (exit 0 with a different loss or checkpoint).

Bad outcomes: crash, hang, unclear_error, silent_wrong, data_lost. Their trial directories (the
killed or mutated checkpoint as it was before the resume, logs, command) stay under --work; the
others are removed. summary.json and trials.jsonl are written to --work. Exit status 1 when any
bad outcome was seen, 2 when the reference checks fail (determinism or bitwise resume).
"""

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = {
    "1": [],
    "dp2": ["--dp", "2"],
    "dp2-zero1": ["--dp", "2", "--zero", "1"],
    "tp2": ["--tp", "2"],
    "pp2": ["--pp", "2"],
}
DEFAULT_MODEL = ("--layers 2 --heads 2 --width 64 --context 32 --batch 8 --microbatches 1 --warmup 2 "
                 "--eval-every 1000 --sample-tokens 0 --peak-gflops 10 --kernel-threads 1")
BAD = ("crash", "hang", "unclear_error", "silent_wrong", "data_lost")
MARKER = ".fault_campaign"


# ---------------------------------------------------------------------------------------------
# small helpers

def step_name(step):
    return "step-%08d" % step


def read_bytes(p):
    try:
        return Path(p).read_bytes()
    except OSError:
        return b""


def parse_latest(text):
    """The step `latest` names, as the library reads it (trailing newlines and spaces dropped)."""
    name = text.decode("utf-8", "replace").rstrip("\n ")
    m = re.fullmatch(r"step-(\d+)", name)
    return int(m.group(1)) if m else None


def read_metrics(path):
    rows, torn = [], 0
    for line in read_bytes(path).decode("utf-8", "replace").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            torn += 1
    return rows, torn


def loss_bits(x):
    return struct.pack("<d", float("nan") if x is None else float(x))


def dir_files(d):
    """name -> bytes of the regular files of a directory (None when it is missing)."""
    d = Path(d)
    if not d.is_dir():
        return None
    out = {}
    for p in sorted(d.iterdir()):
        if p.is_file() and not p.is_symlink():
            out[p.name] = p.read_bytes()
        else:
            out[p.name] = None
    return out


def leftovers(root):
    """What an interrupted save may leave and the next commit must remove."""
    root = Path(root)
    if not root.is_dir():
        return []
    bad = []
    for p in root.iterdir():
        n = p.name
        if n.endswith(".partial") or n.endswith(".old") or ".tmp." in n:
            bad.append(n)
        elif p.is_dir():
            bad += [n + "/" + q.name for q in p.iterdir() if ".tmp." in q.name]
    return sorted(bad)


def rmtree(p):
    p = Path(p)
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p, ignore_errors=True)


def run(cmd, cwd, timeout, log_prefix):
    """Runs cmd to its end (or kills it after `timeout`); stdout/stderr to log_prefix.out/.err."""
    out_p, err_p = Path(str(log_prefix) + ".out"), Path(str(log_prefix) + ".err")
    with open(out_p, "wb") as o, open(err_p, "wb") as e:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, cwd=cwd, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
        hung = False
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            hung = True
            p.kill()
            p.wait()
            rc = None
        wall = time.monotonic() - t0
    return {"rc": rc, "hung": hung, "wall": wall, "out": read_bytes(out_p).decode("utf-8", "replace"),
            "err": read_bytes(err_p).decode("utf-8", "replace")}


def error_lines(err):
    # train_gpt prints "train_gpt: <what()>"; a trellis::Error's what() starts with "trellis:".
    # Other "trellis:" lines on stderr are warnings (OpenBLAS kernels), not errors.
    return [l for l in err.splitlines() if l.startswith("train_gpt:")]


CHECKPOINT_FILE = re.compile(r"(shard|optim)-\d+\.safetensors|index\.json|step-\d{8}")


def failure_kind(res, ck_abs):
    """hang / crash / clear_error / unclear_error for a run that did not exit 0. Clear: a trellis::Error
    (`train_gpt: trellis: ...`) that names the checkpoint: a path under its root, or one of its files."""
    if res["hung"]:
        return "hang"
    if res["rc"] < 0:
        return "crash"
    for l in error_lines(res["err"]):
        if "trellis:" in l and (str(ck_abs) in l or CHECKPOINT_FILE.search(l)):
            return "clear_error"
    return "unclear_error"


def first_error(res):
    lines = error_lines(res["err"])
    if lines:
        return lines[0][:600]
    return (res["err"].strip().splitlines() or ["(no stderr)"])[-1][:600]


# ---------------------------------------------------------------------------------------------
# CRC32C and JSON that keeps duplicate keys (for structure-aware mutations)

def _crc_table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t.append(c)
    return t


_CRC = _crc_table()


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


class Obj(list):
    """A JSON object as (key, value) pairs, in order, duplicates allowed."""

    def get(self, k, default=None):
        for kk, v in self:
            if kk == k:
                return v
        return default

    def set(self, k, v):
        for i, (kk, _) in enumerate(self):
            if kk == k:
                self[i] = (k, v)
                return
        self.append((k, v))

    def drop(self, k):
        self[:] = [(kk, v) for kk, v in self if kk != k]

    def keys(self):
        return [k for k, _ in self]


def jparse(text):
    return json.loads(text, object_pairs_hook=Obj)


def jdump(v, indent=None, lvl=0):
    def wrap(o, c, items):
        if not items:
            return o + c
        if indent is None:
            return o + ",".join(items) + c
        pad, end = "\n" + " " * (indent * (lvl + 1)), "\n" + " " * (indent * lvl)
        return o + pad + ("," + pad).join(items) + end + c

    if isinstance(v, Obj):
        sep = ": " if indent is not None else ":"
        return wrap("{", "}", [json.dumps(k, ensure_ascii=False) + sep + jdump(x, indent, lvl + 1) for k, x in v])
    if isinstance(v, list):
        return wrap("[", "]", [jdump(x, indent, lvl + 1) for x in v])
    return json.dumps(v, ensure_ascii=False)


def plain(v):
    if isinstance(v, Obj):
        return {k: plain(x) for k, x in v}
    if isinstance(v, list):
        return [plain(x) for x in v]
    return v


def compact(v):
    return json.dumps(plain(v), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sorted_obj(v):
    if isinstance(v, Obj):
        return Obj(sorted(((k, sorted_obj(x)) for k, x in v), key=lambda kv: kv[0]))
    if isinstance(v, list):
        return [sorted_obj(x) for x in v]
    return v


def reseal(index, ranks=True):
    """Recomputes index.json's checksums as the library does (docs/checkpoint.md)."""
    rm = index.get("rank_metadata")
    if ranks and isinstance(rm, list):
        index.set("rank_metadata_crc32c", ["%08x" % crc32c(compact(m).encode()) for m in rm])
    body = Obj([(k, v) for k, v in index if k != "index_crc32c"])
    index.set("index_crc32c", "%08x" % crc32c(compact(body).encode()))
    index[:] = sorted_obj(index)


def write_index(path, index):
    Path(path).write_text(jdump(index, indent=1) + "\n", encoding="utf-8")


def st_split(b):
    n = struct.unpack("<Q", b[:8])[0]
    return b[8:8 + n], b[8 + n:]


def st_join(header_text, data):
    h = header_text.encode("utf-8")
    h += b" " * ((-(8 + len(h))) % 8)
    return struct.pack("<Q", len(h)) + h + data


# ---------------------------------------------------------------------------------------------
# mutations: each takes (rng, ck root, step dir name, ctx) and returns a description

EDGE_INTS = [0, -1, 1, 2, 3, -5, 7, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -2**63]
EDGE_TEXT_NUMBERS = ["0", "-1", "-0", "1e308", "1e999", "-1e999", "99999999999999999999", "18446744073709551615",
                     "9223372036854775808", "-9223372036854775809", "1.5", "0.0", "00", "0x10", "NaN",
                     "Infinity", "1e", "--1", "+1", "4294967296", "2147483648"]


class Mutator:
    def __init__(self, ctx):
        self.ctx = ctx

    # targets --------------------------------------------------------------------------------
    def files(self, ck, step):
        d = Path(ck) / step
        return ["latest"] + sorted(step + "/" + p.name for p in d.iterdir())

    def pick(self, rng, ck, step, want=None):
        fs = self.files(ck, step)
        if want == "safetensors":
            fs = [f for f in fs if f.endswith(".safetensors")]
        elif want == "json":
            fs = [f for f in fs if f.endswith(".json")]
        return rng.choice(fs)

    # byte-level -----------------------------------------------------------------------------
    def flip_bits(self, rng, ck, step, header_only=False):
        f = self.pick(rng, ck, step, "safetensors" if header_only else None)
        p = Path(ck) / f
        b = bytearray(p.read_bytes())
        if not b:
            return {"file": f, "op": "empty file, nothing flipped"}
        limit = len(b)
        if header_only:
            limit = min(len(b), 8 + struct.unpack("<Q", bytes(b[:8]))[0])
        n = rng.randint(1, 8)
        bits = sorted(rng.randrange(limit * 8) for _ in range(n))
        for bit in bits:
            b[bit // 8] ^= 1 << (bit % 8)
        p.write_bytes(bytes(b))
        return {"file": f, "op": "%d bit(s)" % n, "bits": bits}

    def truncate(self, rng, ck, step):
        f = self.pick(rng, ck, step)
        p = Path(ck) / f
        size = p.stat().st_size
        n = rng.randrange(size) if size else 0
        os.truncate(p, n)
        return {"file": f, "op": "truncated %d -> %d bytes" % (size, n)}

    def delete(self, rng, ck, step):
        f = rng.choice(self.files(ck, step) + [step])
        rmtree(Path(ck) / f)
        return {"file": f, "op": "deleted"}

    def append_garbage(self, rng, ck, step):
        f = self.pick(rng, ck, step)
        n = rng.choice([1, 2, 7, 8, 64, rng.randint(1, 4096)])
        what = rng.choice(["random", "NUL", "spaces", "newlines", "JSON"])
        g = {"random": lambda: bytes(rng.randrange(256) for _ in range(n)), "NUL": lambda: b"\0" * n,
             "spaces": lambda: b" " * n, "newlines": lambda: b"\n" * n,
             "JSON": lambda: (b'{"x":1}' * n)[:n]}[what]()
        with open(Path(ck) / f, "ab") as fh:
            fh.write(g)
        return {"file": f, "op": "appended %d %s bytes" % (len(g), what)}

    def overwrite_range(self, rng, ck, step):
        f = self.pick(rng, ck, step)
        p = Path(ck) / f
        b = bytearray(p.read_bytes())
        if not b:
            return {"file": f, "op": "empty file"}
        n = min(len(b), rng.choice([1, 4, 8, 16, 64, 256]))
        at = rng.randrange(len(b) - n + 1)
        fill = rng.choice(["zeros", "ones", "random"])
        b[at:at + n] = {"zeros": b"\0" * n, "ones": b"\xff" * n,
                        "random": bytes(rng.randrange(256) for _ in range(n))}[fill]
        p.write_bytes(bytes(b))
        return {"file": f, "op": "%s over [%d, %d)" % (fill, at, at + n)}

    def swap_files(self, rng, ck, step):
        fs = self.files(ck, step)
        a, b = rng.sample(fs, 2)
        pa, pb, tmp = Path(ck) / a, Path(ck) / b, Path(ck) / "swap.tmp"
        os.rename(pa, tmp)
        os.rename(pb, pa)
        os.rename(tmp, pb)
        return {"file": a, "op": "swapped with " + b}

    def stale_copy(self, rng, ck, step):
        """A file replaced by a valid file of another save: the previous step, or another rank."""
        d = Path(ck) / step
        names = sorted(p.name for p in d.iterdir())
        other = self.ctx["other_step_dir"]
        choices = [("other step", n, other / n) for n in names if (other / n).exists()]
        ranks = [n for n in names if re.fullmatch(r"(shard|optim)-\d+\.safetensors", n)]
        for n in ranks:
            for m in ranks:
                if n != m and n.split("-")[0] == m.split("-")[0]:
                    choices.append(("other rank", n, d / m))
        how, name, src = rng.choice(choices)
        data = src.read_bytes()
        (d / name).write_bytes(data)
        return {"file": step + "/" + name, "op": "replaced by %s's %s" % (how, src.name)}

    def special_file(self, rng, ck, step):
        f = rng.choice(self.files(ck, step) + [step])
        p = Path(ck) / f
        op = rng.choice(["empty", "directory", "fifo", "symlink to /dev/zero", "symlink loop", "dangling symlink",
                         "symlink to another file"])
        if f == step and op == "empty":
            op = "empty directory"
        other = [q for q in self.files(ck, step) if q != f and not q.startswith(f + "/") and (Path(ck) / q).is_file()]
        rmtree(p)
        if op == "empty":
            p.write_bytes(b"")
        elif op == "empty directory":
            p.mkdir()
        elif op == "directory":
            p.mkdir()
            (p / "x").write_bytes(b"x")
        elif op == "fifo":
            os.mkfifo(p)
        elif op == "symlink to /dev/zero":
            os.symlink("/dev/zero", p)
        elif op == "symlink loop":
            os.symlink(p.name, p)
        elif op == "dangling symlink":
            os.symlink(p.name + ".missing", p)
        else:
            target = rng.choice(other)
            os.symlink(os.path.relpath(Path(ck) / target, p.parent), p)
            op += " (" + target + ")"
        return {"file": f, "op": op}

    # structure-aware: latest ----------------------------------------------------------------
    def latest_text(self, rng, ck, step):
        s = step
        texts = ["", "\n", " ", "step-", "step-\n", "step-99999999\n", s, s + "\n\n", s + " \n", " " + s + "\n",
                 s + "\t\n", s + "\r\n", "step-%d\n" % self.ctx["base_step"], s + ".partial\n", s + ".old\n",
                 s + "/\n", "./" + s + "\n", "../" + Path(ck).name + "/" + s + "\n", str(Path(ck) / s) + "\n",
                 "/etc/passwd\n", s + "\0\n", s + "\0garbage", "STEP" + s[4:] + "\n", "latest\n", ".\n", "..\n",
                 s + "\n" + step_name(self.ctx["base_step"] - 2) + "\n", "step-" + "9" * 5000 + "\n",
                 "step-" + "0" * 300 + "6\n", "step-%08d\n" % (self.ctx["base_step"] + 2), "step-0000000６\n",
                 "step-00000006é\n", None]
        t = rng.choice(texts)
        if t is None:
            data = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
            op = "random bytes"
        else:
            data = t.encode("utf-8")
            op = repr(t[:60])
        p = Path(ck) / "latest"
        rmtree(p)
        p.write_bytes(data)
        return {"file": "latest", "op": op}

    # structure-aware: index.json, not resealed ----------------------------------------------
    def json_number(self, rng, ck, step):
        p = Path(ck) / step / "index.json"
        lines = p.read_text(encoding="utf-8").split("\n")
        cand = [i for i, l in enumerate(lines) if re.fullmatch(r'\s*(?:"[^"]*": )?-?\d[\d.eE+-]*,?', l)]
        i = rng.choice(cand)
        m = re.fullmatch(r'(\s*(?:"[^"]*": )?)(-?\d[\d.eE+-]*)(,?)', lines[i])
        new = rng.choice([t for t in EDGE_TEXT_NUMBERS + [str(int(m.group(2)) + rng.choice([-1, 1]))]
                          if t != m.group(2)])
        lines[i] = m.group(1) + new + m.group(3)
        p.write_text("\n".join(lines), encoding="utf-8")
        return {"file": step + "/index.json", "op": "line %d: %s -> %s" % (i + 1, m.group(2), new)}

    def _nodes(self, v, path=()):
        """Every (container, key, value, path) below v."""
        out = []
        if isinstance(v, Obj):
            for i, (k, x) in enumerate(v):
                out.append((v, i, x, path + (k,)))
                out += self._nodes(x, path + (k,))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                out.append((v, i, x, path + (i,)))
                out += self._nodes(x, path + (i,))
        return out

    @staticmethod
    def _replace(container, i, value):
        if isinstance(container, Obj):
            container[i] = (container[i][0], value)
        else:
            container[i] = value

    def json_structure(self, rng, ck, step, f=None):
        f = f or step + "/index.json"
        p = Path(ck) / f
        text = p.read_text(encoding="utf-8")
        op = rng.choice(["duplicate key", "delete key", "change string", "change type", "deep nesting", "BOM",
                         "trailing garbage", "comment", "trailing comma", "invalid UTF-8", "lone surrogate",
                         "escaped key", "empty document", "other document", "long string"])
        detail = op
        if op in ("duplicate key", "delete key", "change string", "change type", "deep nesting", "escaped key",
                  "long string"):
            tree = jparse(text)
            nodes = self._nodes(tree)
            if op in ("duplicate key", "delete key", "escaped key"):
                nodes = [n for n in nodes if isinstance(n[0], Obj)]
            if op in ("change string", "long string"):
                nodes = [n for n in nodes if isinstance(n[2], str)] or nodes
            c, i, x, path = rng.choice(nodes)
            where = "/".join(map(str, path))
            if op == "duplicate key":
                k = c[i][0]
                dup = rng.choice([x, 0, "x", None])
                c.insert(i + rng.choice([0, 1]), (k, dup))
                detail += " %s (second value %s)" % (where, json.dumps(plain(dup))[:40])
            elif op == "delete key":
                del c[i]
                detail += " " + where
            elif op == "escaped key":  # the same key again, spelt with an escape: equal after parsing
                k = c[i][0]
                if not k:
                    k = "_"
                c.insert(i + 1, ("\u0000dup\u0000", x))
                esc = '"\\u%04x' % ord(k[0]) + json.dumps(k, ensure_ascii=False)[2:]
                text = (jdump(tree, indent=1) + "\n").replace(json.dumps("\u0000dup\u0000"), esc, 1)
                p.write_text(text, encoding="utf-8")
                return {"file": f, "op": "duplicate key spelt with an escape " + where}
            elif op == "change string":
                new = rng.choice([t for t in ["", "x", "../../x", "shard-0.safetensors", "F32", "0", "-1",
                                              "step-00000006", "\u00e9", "\x01", "a" * 300] if t != x])
                self._replace(c, i, new)
                detail += " %s -> %r" % (where, new[:40])
            elif op == "long string":
                self._replace(c, i, "x" * rng.choice([70000, 1 << 20]))
                detail += " " + where
            elif op == "change type":
                new = rng.choice([None, True, 0, -1, "", [], Obj(), [x], Obj([("x", x)])])
                self._replace(c, i, new)
                detail += " %s -> %s" % (where, json.dumps(plain(new))[:40])
            else:
                depth = rng.choice([63, 64, 65, 100, 10000])
                self._replace(c, i, "\u0000deep\u0000")
                detail += " %s in %d arrays" % (where, depth)
                text = (jdump(tree, indent=1) + "\n").replace(json.dumps("\u0000deep\u0000"),
                                                             "[" * depth + jdump(x) + "]" * depth, 1)
                p.write_text(text, encoding="utf-8")
                return {"file": f, "op": detail}
            text = jdump(tree, indent=1) + "\n"
            p.write_text(text, encoding="utf-8")
            return {"file": f, "op": detail}
        b = text.encode("utf-8")
        if op == "BOM":
            b = b"\xef\xbb\xbf" + b
        elif op == "trailing garbage":
            b = b.rstrip() + rng.choice([b"}", b",", b"\0", b" x", b"{}", b"\n]"])
        elif op == "comment":
            b = rng.choice([b"// x\n", b"/* x */"]) + b
        elif op == "trailing comma":
            b = b.rstrip()
            b = b[:-1].rstrip() + b",\n}"
        elif op == "invalid UTF-8":
            i = b.index(b'"', rng.randrange(len(b) // 2)) + 1
            b = b[:i] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf"]) + b[i:]
        elif op == "lone surrogate":
            i = b.index(b'"', rng.randrange(len(b) // 2)) + 1
            b = b[:i] + rng.choice([b"\\ud800", b"\\udc00", b"\\ud800\\u0041"]) + b[i:]
        elif op == "empty document":
            b = rng.choice([b"", b" ", b"\n", b"{}", b"[]", b"null", b"0", b'""'])
            detail += " " + repr(b)
        else:  # "other document": a valid JSON document that is not an index
            b = json.dumps({"format": "trellis-checkpoint", "version": 3, "step": 6}).encode()
        p.write_bytes(b)
        return {"file": f, "op": detail}

    # structure-aware: index.json, resealed --------------------------------------------------
    def resealed_index(self, rng, ck, step):
        p = Path(ck) / step / "index.json"
        index = jparse(p.read_text(encoding="utf-8"))
        tensors = index.get("tensors")
        names = tensors.keys()
        name = rng.choice(names)
        t = tensors.get(name)
        shards = t.get("shards")
        files = sorted(q.name for q in (Path(ck) / step).iterdir())
        op = rng.choice(["number", "number", "number", "drop shard", "duplicate shard", "retarget file", "rekey",
                         "dtype", "drop tensor", "add tensor", "rename tensor", "swap tensors", "format", "version",
                         "shard crc", "drop member", "metadata differs from rank 0", "empty tensors",
                         "world size"])
        detail = op
        if op == "number":
            nums = [n for n in self._nodes(index) if isinstance(n[2], int) and not isinstance(n[2], bool)]
            c, i, x, path = rng.choice(nums)
            new = rng.choice(EDGE_INTS + [x + 1, x - 1, x * 2, 1.5, float(x), str(x)])
            if new == x and type(new) is type(x):
                new = x + 1
            self._replace(c, i, new)
            detail += " %s: %s -> %s" % ("/".join(map(str, path)), x, json.dumps(new))
        elif op == "drop shard":
            del shards[rng.randrange(len(shards))]
            detail += " of " + name
        elif op == "duplicate shard":
            shards.append(json.loads(json.dumps(plain(rng.choice(shards))), object_pairs_hook=Obj))
            detail += " of " + name
        elif op == "retarget file":
            s = rng.choice(shards)
            new = rng.choice([q for q in files if q != s.get("file")] +
                             ["missing.safetensors", "", "../" + step + "/shard-0.safetensors", "/dev/zero",
                              "index.json", "shard-7.safetensors"])
            s.set("file", new)
            detail += " %s -> %r" % (name, new)
        elif op == "rekey":
            s = rng.choice(shards)
            new = rng.choice([q for q in names if q != name] + ["missing", "", name + "#0"])
            s.set("key", new)
            detail += " %s -> %r" % (name, new)
        elif op == "dtype":
            new = rng.choice(["F16", "BF16", "F64", "I32", "U8", "I64", "BOOL", "XYZ", ""])
            t.set("dtype", new)
            detail += " %s -> %s" % (name, new)
        elif op == "drop tensor":
            tensors.drop(name)
            detail += " " + name
        elif op == "add tensor":
            tensors.append((name + ".extra", json.loads(json.dumps(plain(t)), object_pairs_hook=Obj)))
            detail += " copy of " + name
        elif op == "rename tensor":
            new = rng.choice([name + "x", "h.9.attn.c_attn.weight", "optimizer.m." + name, ""])
            tensors.drop(name)
            tensors.append((new, t))
            detail += " %s -> %r" % (name, new)
        elif op == "swap tensors":
            other = rng.choice([q for q in names if q != name])
            o = tensors.get(other)
            tensors.set(name, o)
            tensors.set(other, t)
            detail += " %s <-> %s" % (name, other)
        elif op == "format":
            new = rng.choice(["", "trellis-checkpoint2", "safetensors", None, 3])
            index.set("format", new)
            detail += " -> " + json.dumps(new)
        elif op == "version":
            new = rng.choice([0, 1, 2, 4, 99, -3, "3", None])
            index.set("version", new)
            detail += " -> " + json.dumps(new)
        elif op == "shard crc":
            s = rng.choice(shards)
            new = rng.choice(["00000000", "ffffffff", "%08x" % rng.getrandbits(32), "", "xyz", "0" * 9,
                              s.get("crc32c").upper()])
            s.set("crc32c", new)
            detail += " %s -> %r" % (name, new)
        elif op == "drop member":
            k = rng.choice(index.keys())
            index.drop(k)
            detail += " " + k
        elif op == "metadata differs from rank 0":
            md = index.get("metadata")
            k = rng.choice(md.keys())
            md.set(k, md.get(k) + "0")
            detail += " (%s)" % k
        elif op == "empty tensors":
            index.set("tensors", Obj())
        else:  # world size
            new = rng.choice([w for w in [0, 1, 2, 3, 4, -1, 2**31, 2**63 - 1] if w != index.get("world_size")])
            index.set("world_size", new)
            detail += " -> %d" % new
        if detail != "drop member index_crc32c":  # (that one is not resealed: it would come back)
            reseal(index, ranks=not op.startswith("drop member"))  # a dropped rank_metadata_crc32c stays dropped
        write_index(p, index)
        return {"file": step + "/index.json", "op": detail}

    def resealed_metadata(self, rng, ck, step):
        """A rank's saved metadata edited so it contradicts the rest, both checksums recomputed."""
        p = Path(ck) / step / "index.json"
        index = jparse(p.read_text(encoding="utf-8"))
        rms = index.get("rank_metadata")
        world = len(rms)
        r = rng.randrange(world)
        md = rms[r]
        s = self.ctx["base_step"]
        ops = ["train.step", "train.data seed", "train.data malformed", "train.data next_batch invalid",
               "train.rng malformed", "model field", "drop key", "add key"]
        if world > 1:
            ops += ["train.data differs between ranks", "train.rng copied from another rank"]
        op = rng.choice(ops)
        if op == "train.step":
            new = rng.choice([str(s + 1), str(s - 1), "0", "-5", "", "6.0", " 6", "99999999999999999999",
                              "9223372036854775807", "0x6"])
            md.set("train.step", new)
        elif op == "train.data seed":
            new = re.sub(r"seed=\d+", "seed=%d" % rng.choice([1, 4321, 0]), md.get("train.data"))
            md.set("train.data", new)
        elif op == "train.data malformed":
            new = rng.choice(["", "seed=1234", "next_batch=6", "seed=1234;next_batch=", "seed=x;next_batch=6",
                              "seed=1234;next_batch=6;x=1", "seed=1234,next_batch=6", "seed=1234;;next_batch=6"])
            md.set("train.data", new)
        elif op == "train.data next_batch invalid":
            new = re.sub(r"next_batch=\d+", "next_batch=" + rng.choice(
                ["-1", "9223372036854775808", "99999999999999999999", "1e3", "+6", " 6"]), md.get("train.data"))
            md.set("train.data", new)
        elif op == "train.rng malformed":
            rngs = md.get("train.rng")
            new = rng.choice([rngs[:-1], rngs + "0", "g" + rngs[1:], rngs.upper(), "", "0" * 64])
            md.set("train.rng", new)
        elif op == "model field":
            k = rng.choice([k for k in md.keys() if k.startswith("model.")])
            new = rng.choice(["", "-1", "0", "3", "999999", "2.0", "x", str(int(md.get(k)) + 1)])
            op += " %s: %r -> %r" % (k, md.get(k), new)
            md.set(k, new)
        elif op == "drop key":
            k = rng.choice(md.keys())
            md.drop(k)
            op += " " + k
        elif op == "add key":
            md.append(("train.extra", "1"))
        elif op == "train.data differs between ranks":
            new = re.sub(r"next_batch=(\d+)", lambda m: "next_batch=%d" % (int(m.group(1)) + 1), md.get("train.data"))
            md.set("train.data", new)
        else:
            o = rng.choice([q for q in range(world) if q != r])
            md.set("train.rng", rms[o].get("train.rng"))
            op += " %d" % o
        if r == 0 and rng.random() < 0.7:  # usually keep "metadata" = rank_metadata[0], as a real index has
            index.set("metadata", json.loads(json.dumps(plain(md)), object_pairs_hook=Obj))
        reseal(index)
        write_index(p, index)
        return {"file": step + "/index.json", "op": "rank %d: %s" % (r, op)}

    # structure-aware: safetensors headers ---------------------------------------------------
    def st_header(self, rng, ck, step):
        f = self.pick(rng, ck, step, "safetensors")
        p = Path(ck) / f
        header, data = st_split(p.read_bytes())
        h = jparse(header.decode("utf-8"))
        entries = [k for k in h.keys() if k != "__metadata__"]
        k = rng.choice(entries) if entries else None  # a rank may hold no tensor (dp > 1: metadata only)
        e = h.get(k)
        meta = h.get("__metadata__")
        ops = ["metadata value", "metadata value", "drop metadata key", "drop __metadata__", "add tensor"]
        if entries:
            ops += ["number", "number", "number", "dtype", "drop tensor", "duplicate key", "rename tensor",
                    "entry type", "overlapping offsets"]
        op = rng.choice(ops)
        detail = op
        if op == "number":
            field = rng.choice(["shape", "data_offsets"])
            arr = e.get(field)
            i = rng.randrange(len(arr))
            x = arr[i]
            arr[i] = rng.choice([v for v in EDGE_INTS + [x + 1, x - 1, x + 4, x - 4, x * 2, 1.5] if v != x])
            detail += " %s.%s[%d]: %s -> %s" % (k, field, i, x, arr[i])
        elif op == "dtype":
            new = rng.choice(["F16", "BF16", "F64", "I32", "U8", "I64", "BOOL", "XYZ", ""])
            e.set("dtype", new)
            detail += " %s -> %s" % (k, new)
        elif op == "drop tensor":
            h.drop(k)
            detail += " " + k
        elif op == "duplicate key":
            h.insert(h.keys().index(k) + 1, (k, rng.choice([e, h.get(rng.choice(entries))])))
            detail += " " + k
        elif op == "rename tensor":
            i = h.keys().index(k)
            h[i] = (k + "x", e)
            detail += " " + k
        elif op == "add tensor":
            h.append(("extra", Obj([("data_offsets", [0, 4]), ("dtype", "F32"), ("shape", [1])])))
        elif op == "entry type":
            new = rng.choice([None, 0, "x", [], Obj()])
            h.set(k, new)
            detail += " %s -> %s" % (k, json.dumps(plain(new)))
        elif op == "overlapping offsets":
            other = h.get(rng.choice([q for q in entries if q != k] or entries))
            e.set("data_offsets", list(other.get("data_offsets")))
            detail += " " + k
        elif op in ("metadata value", "drop metadata key"):
            mk = rng.choice(meta.keys())
            if op == "drop metadata key":
                meta.drop(mk)
                detail += " " + mk
            else:
                v = meta.get(mk)
                if mk.startswith("trellis.shard."):
                    s = json.loads(v)
                    fld = rng.choice(["global_shape", "offsets"])
                    j = rng.randrange(len(s[fld]))
                    s[fld][j] = rng.choice([s[fld][j] + 1, -1, 0, 2**40])
                    new = json.dumps(s, separators=(",", ":"), sort_keys=True)
                elif re.fullmatch(r"[0-9a-f]{8}", v):
                    new = rng.choice(["%08x" % rng.getrandbits(32), "", v.upper(), "0" * 8])
                elif re.fullmatch(r"-?\d+", v):
                    new = rng.choice([str(int(v) + 1), "-1", "", "99999999999999999999", "x"])
                else:
                    new = rng.choice(["", v + "x", "x"])
                meta.set(mk, new)
                detail += " %s: %r -> %r" % (mk, v[:40], new[:40])
        else:
            h.drop("__metadata__")
        p.write_bytes(st_join(jdump(h), data))
        return {"file": f, "op": detail}

    def st_length(self, rng, ck, step):
        f = self.pick(rng, ck, step, "safetensors")
        p = Path(ck) / f
        b = bytearray(p.read_bytes())
        n = struct.unpack("<Q", bytes(b[:8]))[0]
        new = rng.choice([0, 1, 2, 7, n - 1, n + 1, n - 8, n + 8, len(b) - 8, len(b) - 7, len(b), 2**31, 2**32,
                          2**63, 2**64 - 1, 2**64 - 8, 100 * 1024 * 1024])
        b[:8] = struct.pack("<Q", new % 2**64)
        p.write_bytes(bytes(b))
        return {"file": f, "op": "header length %d -> %d" % (n, new)}


KINDS = {
    "flip_bits": lambda m, r, c, s: m.flip_bits(r, c, s),
    "flip_bits_header": lambda m, r, c, s: m.flip_bits(r, c, s, header_only=True),
    "truncate": lambda m, r, c, s: m.truncate(r, c, s),
    "delete": lambda m, r, c, s: m.delete(r, c, s),
    "append_garbage": lambda m, r, c, s: m.append_garbage(r, c, s),
    "overwrite_range": lambda m, r, c, s: m.overwrite_range(r, c, s),
    "swap_files": lambda m, r, c, s: m.swap_files(r, c, s),
    "stale_copy": lambda m, r, c, s: m.stale_copy(r, c, s),
    "special_file": lambda m, r, c, s: m.special_file(r, c, s),
    "latest_text": lambda m, r, c, s: m.latest_text(r, c, s),
    "json_number": lambda m, r, c, s: m.json_number(r, c, s),
    "json_structure": lambda m, r, c, s: m.json_structure(r, c, s),
    "resealed_index": lambda m, r, c, s: m.resealed_index(r, c, s),
    "resealed_metadata": lambda m, r, c, s: m.resealed_metadata(r, c, s),
    "st_header": lambda m, r, c, s: m.st_header(r, c, s),
    "st_length": lambda m, r, c, s: m.st_length(r, c, s),
}


# ---------------------------------------------------------------------------------------------
# the campaign

class Campaign:
    def __init__(self, a):
        self.a = a
        self.exe = str(Path(a.train_gpt).resolve())
        self.work = Path(a.work).resolve()
        self.model = shlex.split(a.model)
        self.S, self.E = a.steps, a.ckpt_every
        self.ckpt_steps = [s for s in range(self.E, self.S, self.E)] + [self.S]
        self.M = a.base_step or self.ckpt_steps[(len(self.ckpt_steps) - 1) // 2]
        assert self.M in self.ckpt_steps and self.M > self.E, "--base-step must be a checkpoint step after the first"
        self.refs = {}
        self.bases = {}
        self.trials = open(self.work / "trials.jsonl", "w")
        self.t0 = time.monotonic()
        self.notes = []

    def cmd(self, layout, ck, log, steps=None, resume=False):
        c = [self.exe] + self.model + LAYOUTS[layout] + ["--steps", str(steps or self.S), "--ckpt-dir", str(ck),
                                                         "--ckpt-every", str(self.E), "--log", str(log)]
        return c + (["--resume"] if resume else [])

    def record(self, rec):
        self.trials.write(json.dumps(rec, sort_keys=True) + "\n")
        self.trials.flush()

    def elapsed(self):
        return time.monotonic() - self.t0

    def out_of_time(self):
        return self.a.time_limit and self.elapsed() > self.a.time_limit

    # reference ------------------------------------------------------------------------------
    def reference(self, layout):
        d = self.work / "ref" / layout
        rmtree(d)
        d.mkdir(parents=True)
        runs = []
        for tag in ("a", "b", "c"):
            ck, log = d / tag / "ck", d / tag / "metrics.jsonl"
            (d / tag).mkdir()
            res = run(self.cmd(layout, ck, log), d / tag, self.a.timeout, d / tag / "run")
            if res["rc"] != 0:
                sys.exit("reference run %s/%s failed (rc %s): %s" % (layout, tag, res["rc"], first_error(res)))
            rows, torn = read_metrics(log)
            runs.append({"wall": res["wall"], "losses": {r["step"]: loss_bits(r["loss"]) for r in rows},
                         "final": dir_files(ck / step_name(self.S)), "ck": ck, "rows": len(rows), "torn": torn})
        a = runs[0]
        ok = True
        if sorted(a["losses"]) != list(range(1, self.S + 1)) or a["rows"] != self.S:
            print("reference %s: metrics rows %s" % (layout, sorted(a["losses"])))
            ok = False
        for r in runs[1:]:
            if r["losses"] != a["losses"] or r["final"] != a["final"]:
                diff = [k for k in a["final"] if a["final"].get(k) != (r["final"] or {}).get(k)]
                print("reference %s is not deterministic: losses %s, files differ: %s" %
                      (layout, "equal" if r["losses"] == a["losses"] else "differ", diff))
                ok = False
        # resuming from every intermediate checkpoint gives the same bits
        resumes = []
        for k in self.ckpt_steps[:-1]:
            rd = d / ("resume-%d" % k)
            rd.mkdir()
            ck = rd / "ck"
            ck.mkdir()
            shutil.copytree(a["ck"] / step_name(k), ck / step_name(k))
            (ck / "latest").write_text(step_name(k) + "\n")
            log = rd / "metrics.jsonl"
            src_rows = read_bytes(d / "a" / "metrics.jsonl").decode().splitlines()
            log.write_text("".join(l + "\n" for l in src_rows if json.loads(l)["step"] <= k + 1))  # one extra row: trimmed
            res = run(self.cmd(layout, ck, log, resume=True), rd, self.a.timeout, rd / "run")
            rows, torn = read_metrics(log)
            losses = {r["step"]: loss_bits(r["loss"]) for r in rows}
            good = (res["rc"] == 0 and ("at step %d" % k) in res["out"] and losses == a["losses"] and
                    len(rows) == self.S and torn == 0 and dir_files(ck / step_name(self.S)) == a["final"])
            resumes.append({"from": k, "ok": good, "rc": res["rc"]})
            if not good:
                print("reference %s: resume from step %d is not bitwise (rc %s): %s" %
                      (layout, k, res["rc"], first_error(res) if res["rc"] else "losses or checkpoint differ"))
                ok = False
        walls = sorted(r["wall"] for r in runs)
        ref = {"losses": a["losses"], "final": a["final"], "ck": a["ck"], "wall": walls[len(walls) // 2],
               "walls": walls, "resumes": resumes, "ok": ok, "metrics": d / "a" / "metrics.jsonl"}
        print("reference %-9s: %d steps, run %.3f s (median of %s), deterministic and bitwise resume from steps %s: %s"
              % (layout, self.S, ref["wall"], ", ".join("%.3f" % w for w in walls),
                 ",".join(str(k) for k in self.ckpt_steps[:-1]), "yes" if ok else "NO"), flush=True)
        self.refs[layout] = ref
        return ok

    # kills ----------------------------------------------------------------------------------
    def observe(self, ck):
        try:
            names = os.listdir(ck)
        except OSError:
            names = []
        latest = None
        if "latest" in names:
            latest = parse_latest(read_bytes(Path(ck) / "latest"))
        partial = sorted(n for n in names if n.endswith(".partial"))
        return latest, partial

    def kill_trial(self, layout, idx, mode, rng):
        ref = self.refs[layout]
        d = self.work / "kills" / ("%04d-%s-%s" % (idx, layout, mode))
        rmtree(d)
        d.mkdir(parents=True)
        ck, log = d / "ck", d / "metrics.jsonl"
        cmd = self.cmd(layout, ck, log)
        target = None
        if mode == "random":
            target = rng.uniform(0, ref["walls"][0])  # the shortest reference run: few kills land after the end
        else:
            target = rng.choice(self.ckpt_steps)
        seen_latest, last_partial, killed_at, phase = 0, [], None, None
        with open(d / "killed.out", "wb") as o, open(d / "killed.err", "wb") as e:
            t0 = time.monotonic()
            p = subprocess.Popen(cmd, cwd=d, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
            while p.poll() is None:
                latest, partial = self.observe(ck)
                now = time.monotonic() - t0
                if latest is not None:
                    seen_latest = max(seen_latest, latest)
                fire = ((mode == "random" and now >= target) or
                        (mode == "save" and step_name(target) + ".partial" in partial) or
                        (mode == "commit" and latest == target))
                if fire:
                    rows, _ = read_metrics(log)
                    phase = "save" if partial else ("startup" if latest is None and not rows else "train")
                    os.kill(p.pid, signal.SIGKILL)
                    killed_at = now
                    break
                if now > self.a.timeout:
                    os.kill(p.pid, signal.SIGKILL)
                    killed_at = now
                    phase = "hang"
                    break
                time.sleep(0.0005)
            rc_killed = p.wait()
        finished = rc_killed == 0
        after_kill = read_bytes(ck / "latest") if (ck / "latest").exists() else None
        committed = max(seen_latest, parse_latest(after_kill) or 0) if after_kill is not None else seen_latest
        snapshot = d / "ck.after-kill"
        if ck.exists():
            shutil.copytree(ck, snapshot, symlinks=True)
        rows_before, torn_before = read_metrics(log)
        res = run(cmd + ["--resume"], d, self.a.timeout, d / "resume")
        rec = {"trial": "kill", "id": d.name, "layout": layout, "mode": mode, "target": target,
               "killed_at_s": killed_at, "phase": "finished" if finished else phase, "rc_killed": rc_killed,
               "committed_before_kill": committed, "metrics_rows_before_resume": len(rows_before),
               "torn_rows_before_resume": torn_before, "resume_rc": res["rc"], "resume_wall_s": res["wall"],
               "cmd": shlex.join(cmd)}
        reasons = []
        outcome = "ok"
        if phase == "hang":
            outcome, reasons = "hang", ["the run did not end within %s s" % self.a.timeout]
        elif rc_killed not in (0, -signal.SIGKILL):
            outcome = "crash" if rc_killed < 0 else "unclear_error"
            reasons.append("the run failed by itself before the kill (rc %d): %s" %
                           (rc_killed, (read_bytes(d / "killed.err").decode("utf-8", "replace").strip()
                                        .splitlines() or [""])[-1][:300]))
        elif res["hung"] or res["rc"] != 0:
            kind = failure_kind(res, ck)
            if kind in ("hang", "crash"):
                outcome = kind
            elif committed == 0 and after_kill is None and "no checkpoint under" in res["err"] and kind == "clear_error":
                outcome = "ok_nothing_committed"
            elif kind == "clear_error":
                outcome = "data_lost"
                reasons.append("a checkpoint (step %d) was committed before the kill but --resume failed" % committed)
            else:
                outcome = "unclear_error"
            reasons.append(first_error(res) if not res["hung"] else "resume timed out")
        else:
            m = re.search(r"resumed from (\S+) at step (\d+)", res["out"])
            resumed = int(m.group(2)) if m else None
            rec["resumed_from"] = resumed
            rec["resumed_path"] = m.group(1) if m else None
            rows, torn = read_metrics(log)
            steps = [r["step"] for r in rows]
            dup = sorted({s for s in steps if steps.count(s) > 1})
            missing = sorted(set(range(1, self.S + 1)) - set(steps))
            wrong = [r["step"] for r in rows if ref["losses"].get(r["step"]) != loss_bits(r["loss"])]
            final = dir_files(ck / step_name(self.S))
            left = leftovers(ck)
            rec.update({"duplicate_rows": dup, "missing_rows": missing, "wrong_losses": wrong, "torn_rows": torn,
                        "final_checkpoint_equal": final == ref["final"], "leftovers": left})
            if resumed is None:
                outcome = "silent_wrong"
                reasons.append("exit 0 but no 'resumed from' line")
            elif resumed < committed:
                outcome = "data_lost"
                reasons.append("resumed from step %d, but latest named step %d before the kill" % (resumed, committed))
            if wrong or final != ref["final"] or dup or torn:
                outcome = "silent_wrong" if outcome == "ok" else outcome
                if wrong:
                    reasons.append("losses differ from the reference at steps %s" % wrong)
                if final != ref["final"]:
                    reasons.append("final checkpoint differs from the reference")
                if dup:
                    reasons.append("duplicate metrics rows for steps %s" % dup)
                if torn:
                    reasons.append("%d torn metrics lines left" % torn)
            if missing:
                outcome = "data_lost" if outcome == "ok" else outcome
                reasons.append("metrics.jsonl lacks the rows of steps %s" % missing)
            if left:
                rec["note"] = "left behind after the resume's saves: %s" % left
        rec["outcome"] = outcome
        rec["reasons"] = reasons
        self.record(rec)
        if outcome in BAD:
            (d / "repro.txt").write_text(
                "# killed run (SIGKILL at %.4f s, mode %s, target %s), then:\n%s --resume\n# ck.after-kill: the "
                "checkpoint directory right after the kill\n%s\n" % (killed_at or -1, mode, target, shlex.join(cmd),
                                                                     "\n".join(reasons)))
        elif not self.a.keep_all:
            rmtree(d)
        return rec

    # mutations ------------------------------------------------------------------------------
    def base(self, layout):
        ref = self.refs[layout]
        d = self.work / "base" / layout
        rmtree(d)
        d.mkdir(parents=True)
        ck = d / "ck"
        ck.mkdir()
        shutil.copytree(ref["ck"] / step_name(self.M), ck / step_name(self.M))
        (ck / "latest").write_text(step_name(self.M) + "\n")
        shutil.copytree(ref["ck"] / step_name(self.M - self.E), d / "other" / step_name(self.M - self.E))
        rows = read_bytes(ref["metrics"]).decode().splitlines()
        (d / "metrics.jsonl").write_text("".join(l + "\n" for l in rows if json.loads(l)["step"] <= self.M))
        # the unmutated resume, twice
        outs = []
        for tag in ("u1", "u2"):
            t = d / tag
            shutil.copytree(ck, t / "ck")
            shutil.copy(d / "metrics.jsonl", t / "metrics.jsonl")
            res = run(self.cmd(layout, t / "ck", t / "metrics.jsonl", steps=self.M + 1, resume=True), t,
                      self.a.timeout, t / "run")
            if res["rc"] != 0:
                sys.exit("unmutated resume %s failed: %s" % (layout, first_error(res)))
            rows, _ = read_metrics(t / "metrics.jsonl")
            outs.append(({r["step"]: loss_bits(r["loss"]) for r in rows}, dir_files(t / "ck" / step_name(self.M + 1))))
        ok = outs[0] == outs[1] and outs[0][0].get(self.M + 1) == ref["losses"][self.M + 1]
        print("base %-9s: step %d; unmutated resume for one step deterministic and equal to the reference: %s"
              % (layout, self.M, "yes" if ok else "NO"), flush=True)
        # reseal must reproduce the stored checksums
        idx = (ck / step_name(self.M) / "index.json").read_text()
        orig = jparse(idx)
        again = jparse(idx)
        reseal(again)
        reseal_ok = (again.get("index_crc32c") == orig.get("index_crc32c") and
                     again.get("rank_metadata_crc32c") == orig.get("rank_metadata_crc32c"))
        if not reseal_ok:
            self.notes.append("reseal does not reproduce the stored checksums for %s: resealed kinds reach only the "
                              "checksum check" % layout)
        self.bases[layout] = {"ck": ck, "metrics": d / "metrics.jsonl", "losses": outs[0][0], "final": outs[0][1],
                              "other": d / "other" / step_name(self.M - self.E), "reseal_ok": reseal_ok}
        return ok

    def mutation_trial(self, layout, idx, kind, seed):
        b = self.bases[layout]
        d = self.work / "mutations" / ("%05d-%s-%s" % (idx, layout, kind))
        rmtree(d)
        d.mkdir(parents=True)
        ck = d / "ck"

        def make(where):
            shutil.copytree(b["ck"], where)
            m = Mutator({"other_step_dir": b["other"], "base_step": self.M})
            return KINDS[kind](m, random.Random(seed), where, step_name(self.M))

        try:
            desc = make(ck)
        except Exception as e:  # a bug of this script: counted apart, never as an outcome of the library
            rec = {"trial": "mutation", "id": d.name, "layout": layout, "kind": kind, "seed": seed,
                   "outcome": "mutation_error", "error": repr(e)}
            self.record(rec)
            return rec
        shutil.copy(b["metrics"], d / "metrics.jsonl")
        cmd = self.cmd(layout, ck, d / "metrics.jsonl", steps=self.M + 1, resume=True)
        res = run(cmd, d, self.a.timeout, d / "resume")
        rec = {"trial": "mutation", "id": d.name, "layout": layout, "kind": kind, "seed": seed, "rc": res["rc"],
               "wall_s": res["wall"], "stderr_bytes": len(res["err"].encode()), **desc}
        if res["rc"] == 0 and not res["hung"]:
            rows, torn = read_metrics(d / "metrics.jsonl")
            losses = {r["step"]: loss_bits(r["loss"]) for r in rows}
            same = losses == b["losses"] and torn == 0 and dir_files(ck / step_name(self.M + 1)) == b["final"]
            outcome = "harmless" if same else "silent_wrong"
            if not same:
                m = re.search(r"resumed from .*", res["out"])
                rec["reason"] = ("loss differs" if losses != b["losses"] else "final checkpoint differs") + \
                    ("; " + m.group(0) if m else "")
        else:
            outcome = failure_kind(res, ck)
            rec["error"] = first_error(res) if not res["hung"] else "timed out after %s s" % self.a.timeout
            if outcome == "clear_error":
                f = desc.get("file", "")
                rec["names_file"] = bool(f) and Path(f).name in rec["error"]
                rec["names_path"] = str(ck) in res["err"]
        rec["outcome"] = outcome
        self.record(rec)
        if outcome in BAD:
            make(d / "ck.mutated")  # the same mutation again, on a fresh copy, for inspection
            (d / "repro.txt").write_text(
                "# mutation %s seed %d: %s %s\n# ck.mutated: the mutated checkpoint before the resume\n%s\n%s\n" %
                (kind, seed, desc.get("file"), desc.get("op"), shlex.join(cmd), rec.get("error", rec.get("reason"))))
        elif not self.a.keep_all:
            rmtree(d)
        return rec


def table(counts, cols, title):
    rows = sorted(counts)
    w = max([len(title)] + [len(r) for r in rows]) + 2
    lines = [title.ljust(w) + "".join(c.rjust(max(8, len(c) + 2)) for c in cols + ["total"])]
    for r in rows:
        lines.append(r.ljust(w) + "".join(str(counts[r].get(c, 0)).rjust(max(8, len(c) + 2)) for c in cols) +
                     str(sum(counts[r].values())).rjust(7))
    tot = {c: sum(counts[r].get(c, 0) for r in rows) for c in cols}
    lines.append("total".ljust(w) + "".join(str(tot[c]).rjust(max(8, len(c) + 2)) for c in cols) +
                 str(sum(tot.values())).rjust(7))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-gpt", required=True, help="the train_gpt executable")
    ap.add_argument("--kills", type=int, default=30, help="random-time kills (default 30)")
    ap.add_argument("--targeted-kills", type=int, default=None,
                    help="kills during a save and right after a commit (default: as many as --kills)")
    ap.add_argument("--mutations", type=int, default=2000, help="mutated checkpoints (default 2000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default="build/fault-campaign", help="work directory (emptied first)")
    ap.add_argument("--layouts", "--ranks-layout", default="1,dp2",
                    help="comma-separated, trials spread round-robin: %s" % ", ".join(LAYOUTS))
    ap.add_argument("--kinds", default=",".join(KINDS), help="mutation kinds, spread round-robin")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ckpt-every", type=int, default=2)
    ap.add_argument("--base-step", type=int, default=0, help="the checkpoint mutated (default: the middle one)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="train_gpt flags of the model and run")
    ap.add_argument("--timeout", type=float, default=60, help="seconds before a run counts as hung")
    ap.add_argument("--time-limit", type=float, default=0, help="stop starting trials after this many seconds")
    ap.add_argument("--keep-all", action="store_true", help="keep every trial's directory")
    a = ap.parse_args()
    layouts = a.layouts.split(",")
    kinds = a.kinds.split(",")
    for l in layouts:
        if l not in LAYOUTS:
            ap.error("unknown layout %r" % l)
    for k in kinds:
        if k not in KINDS:
            ap.error("unknown mutation kind %r" % k)
    if a.targeted_kills is None:
        a.targeted_kills = a.kills
    work = Path(a.work)
    if work.exists() and any(work.iterdir()) and not (work / MARKER).exists():
        sys.exit("--work %s exists, is not empty and was not made by this script" % work)
    rmtree(work)
    work.mkdir(parents=True)
    (work / MARKER).write_text("")
    c = Campaign(a)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    ok = all([c.reference(l) for l in layouts])
    ok = all([c.base(l) for l in layouts]) and ok
    if not ok:
        print("the reference checks failed: the run is not deterministic or the resume is not bitwise; stopping")
        sys.exit(2)
    rng = random.Random(a.seed)

    kill_counts, kill_phase, kill_recs = {}, {}, []
    plan = ["random"] * a.kills + [("save", "commit")[i % 2] for i in range(a.targeted_kills)]
    for i, mode in enumerate(plan):
        if c.out_of_time():
            break
        layout = layouts[i % len(layouts)]
        rec = c.kill_trial(layout, i, mode, random.Random("%d-kill-%d" % (a.seed, i)))
        kill_recs.append(rec)
        key = "%s %s" % (layout, mode)
        kill_counts.setdefault(key, {})
        kill_counts[key][rec["outcome"]] = kill_counts[key].get(rec["outcome"], 0) + 1
        kill_phase.setdefault(key, {})
        kill_phase[key][rec["phase"]] = kill_phase[key].get(rec["phase"], 0) + 1
        if rec["outcome"] in BAD:
            print("  kill %s: %s: %s" % (rec["id"], rec["outcome"], "; ".join(rec["reasons"])), flush=True)
        if (i + 1) % 20 == 0:
            print("  %d kills done (%.0f s)" % (i + 1, c.elapsed()), flush=True)
    t_kills = c.elapsed()

    mut_counts, mut_layout, names_file, mut_recs = {}, {}, {"yes": 0, "no": 0}, []
    for i in range(a.mutations):
        if c.out_of_time():
            break
        layout = layouts[(i // len(kinds)) % len(layouts)]
        kind = kinds[i % len(kinds)]
        seed = rng.getrandbits(48)
        rec = c.mutation_trial(layout, i, kind, seed)
        mut_recs.append(rec)
        o = rec["outcome"]
        mut_counts.setdefault(kind, {})
        mut_counts[kind][o] = mut_counts[kind].get(o, 0) + 1
        mut_layout.setdefault(layout, {})
        mut_layout[layout][o] = mut_layout[layout].get(o, 0) + 1
        if o == "clear_error":
            names_file["yes" if rec.get("names_file") else "no"] += 1
        if o in BAD:
            print("  mutation %s: %s: %s %s -> %s" % (rec["id"], o, rec.get("file"), rec.get("op"),
                                                      rec.get("error", rec.get("reason"))), flush=True)
        if (i + 1) % 200 == 0:
            print("  %d mutations done (%.0f s)" % (i + 1, c.elapsed()), flush=True)
    wall = c.elapsed()

    kill_cols = ["ok", "ok_nothing_committed"] + list(BAD)
    mut_cols = ["harmless", "clear_error", "crash", "hang", "unclear_error", "silent_wrong"]
    bad = {b: sum(1 for r in kill_recs + mut_recs if r["outcome"] == b) for b in BAD}
    summary = {
        "started": started, "wall_s": round(wall, 1), "kills_wall_s": round(t_kills, 1),
        "train_gpt": c.exe, "model": a.model, "steps": a.steps, "ckpt_every": a.ckpt_every, "base_step": c.M,
        "layouts": layouts, "seed": a.seed, "timeout_s": a.timeout, "time_limit_s": a.time_limit,
        "reference": {l: {"wall_s": r["walls"], "ok": r["ok"], "resumes": r["resumes"]} for l, r in c.refs.items()},
        "kills": {"requested": len(plan), "done": len(kill_recs), "by_layout_mode": kill_counts,
                  "phase_at_kill": kill_phase,
                  "with_leftovers_after_resume": sum(1 for r in kill_recs if r.get("leftovers"))},
        "mutations": {"requested": a.mutations, "done": len(mut_recs), "by_kind": mut_counts, "by_layout": mut_layout,
                      "clear_errors_naming_the_mutated_file": names_file},
        "bad": bad, "notes": c.notes,
        "mutation_errors_of_this_script": sorted(r["id"] for r in mut_recs if r["outcome"] == "mutation_error"),
        "clear_errors_without_the_checkpoint_path": sorted(r["id"] for r in mut_recs if r["outcome"] == "clear_error"
                                                           and not r.get("names_path")),
        "errors_over_2000_bytes": sorted(r["id"] for r in mut_recs if r.get("stderr_bytes", 0) > 2000),
        "kept": sorted(r["id"] for r in kill_recs + mut_recs if r["outcome"] in BAD),
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    print()
    print(table(kill_counts, kill_cols, "kills (layout, mode)"))
    print()
    print(table(kill_phase, ["startup", "train", "save", "finished", "hang"], "phase at the kill"))
    print()
    print(table(mut_counts, mut_cols, "mutations (kind)"))
    print()
    print(table(mut_layout, mut_cols, "mutations (layout)"))
    print()
    print("clear errors naming the mutated file: %d of %d" % (names_file["yes"], names_file["yes"] + names_file["no"]))
    print("clear errors without the checkpoint's path (naming only a file of it): %d"
          % len(summary["clear_errors_without_the_checkpoint_path"]))
    if summary["mutation_errors_of_this_script"]:
        print("mutations this script failed to apply (not counted): %s" % summary["mutation_errors_of_this_script"])
    print("bad outcomes: " + ", ".join("%s %d" % (k, v) for k, v in bad.items()))
    print("kills %d (%.0f s), mutations %d; wall %.0f s; summary: %s" %
          (len(kill_recs), t_kills, len(mut_recs), wall, work / "summary.json"))
    for n in c.notes:
        print("note: " + n)
    sys.exit(1 if any(bad.values()) else 0)


if __name__ == "__main__":
    main()
