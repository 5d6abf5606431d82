#!/usr/bin/python3
"""Seeds the fuzz corpora from real traffic: runs programs of the build under
strace, collects the bytes every thread wrote to a socket (write, writev,
send, sendto, sendmsg), and cuts them into the messages each fuzz target
decodes:

  frame      104-byte data frame headers ("SMSH")
  control    rendezvous messages, header + payload ("SMCT")
  rdma_boot  RDMA bootstrap messages, header + body ("SMSR")
  handshake  what a data connection's acceptor reads: the dialler's hello
             ("SMHI") and whatever followed it in the same stream, up to 256 B
  tcp_stream a data connection's byte stream after the handshake (frames and
             payloads), first 4 KiB, with the split points the sender used
  control_stream  a control connection's byte stream, first 4 KiB, with the
             split points the sender used

  tests/fuzz/capture_seeds.py <build dir> [corpus dir, default tests/fuzz/corpus]

Existing capture-* files of a target are replaced; hand-made seeds stay.
"""
import collections
import hashlib
import os
import re
import struct
import subprocess
import sys
import tempfile

build = sys.argv[1]
corpus = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "corpus")

RUNS = [
    # The quickstart: scheduler, 2 workers, 1 server over TCP, with a secret.
    ([os.path.join(build, "examples/quickstart/quickstart"), "--steps", "5"], {}),
    # The RDMA transport's bootstrap over the fake fabric.
    ([os.path.join(build, "tests/rdma/rdma_tests"),
      "rdma: push and reply land byte-exact in the registered slots"], {}),
    ([os.path.join(build, "tests/rdma/rdma_tests"),
      "rdma: a region registered after Connect is advertised, sends wait for it"], {}),
    # Authenticated rendezvous and data handshakes.
    ([os.path.join(build, "tests/reliability/reliability_tests"), "[auth]"], {}),
]

CALL = re.compile(r'^(\d+)\s+(write|writev|send|sendto|sendmsg)\((\d+), (.*)\)\s+=\s+(\d+)')
HEX = re.compile(r'"((?:\\x[0-9a-f]{2})*)"')


def written(line):
    m = CALL.match(line)
    if not m:
        return None
    pid, _, fd, args, ret = m.groups()
    data = b"".join(bytes.fromhex(h.replace("\\x", "")) for h in HEX.findall(args))
    return (int(pid), int(fd)), data[: int(ret)]


UNFINISHED = re.compile(r'^(\d+)\s+(.*) <unfinished \.\.\.>$')
RESUMED = re.compile(r'^(\d+)\s+<\.\.\. \w+ resumed>(.*)$')


def joined(lines):
    """strace -f splits a call that another thread interrupts into
    "<unfinished ...>" and "<... call resumed>" lines: put them back together."""
    pending = {}
    for line in lines:
        line = line.rstrip("\n")
        m = UNFINISHED.match(line)
        if m:
            pending[m.group(1)] = m.group(2)
            continue
        m = RESUMED.match(line)
        if m and m.group(1) in pending:
            yield f"{m.group(1)} {pending.pop(m.group(1))}{m.group(2)}"
            continue
        yield line


def trace(argv, env):
    if not os.path.exists(argv[0]):
        print(f"capture: {argv[0]} not built, skipped")
        return []
    with tempfile.NamedTemporaryFile(suffix=".strace") as out:
        subprocess.run(["strace", "-f", "-qq", "-xx", "-s", "65536", "-o", out.name,
                        "-e", "trace=write,writev,send,sendto,sendmsg"] + argv,
                       env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=300)
        return [w for w in map(written, joined(open(out.name, errors="replace"))) if w]


def messages(stream, magic, header, length_at, length_fmt, fixed=None):
    """Messages starting with `magic` anywhere in `stream`."""
    out, i = [], stream.find(magic)
    while i >= 0:
        if fixed is not None:
            size = fixed
        else:
            if i + header > len(stream):
                break
            size = header + struct.unpack_from(length_fmt, stream, i + length_at)[0]
        if i + size <= len(stream):
            out.append(stream[i:i + size])
        i = stream.find(magic, i + 1)
    return out


seeds = collections.defaultdict(set)
for argv, env in RUNS:
    writes = trace(argv, env)
    streams = collections.defaultdict(bytearray)
    splits = collections.defaultdict(list)
    for key, data in writes:
        splits[key].append(len(data))
        streams[key] += data
    for key, stream in streams.items():
        stream = bytes(stream)
        for m in messages(stream, b"SMSH", 104, 0, None, fixed=104):
            seeds["frame"].add(m)
        for m in messages(stream, b"SMCT", 12, 8, "<I"):
            seeds["control"].add(m)
        for m in messages(stream, b"SMSR", 8, 6, "<H"):
            seeds["rdma_boot"].add(m)
        if stream.startswith(b"SMCT"):
            # A control connection's stream with the sender's split points
            # (fuzz_control_stream's format, as for tcp_stream).
            body = stream[:4096]
            cuts, done = [], 0
            for n in splits[key]:
                done += n
                if 0 < done < len(body):
                    cuts.append(done)
            cuts = cuts[:32]
            seeds["control_stream"].add(bytes([len(cuts)]) + b"".join(
                struct.pack("<H", c) for c in cuts) + body)
        at = stream.find(b"SMHI")
        if at == 0:
            seeds["handshake"].add(stream[:256])
            # The data stream after the dialler's part of the handshake: the
            # first frame header marks where it starts.
            first = stream.find(b"SMSH")
            if first > 0:
                # Split points as the sender wrote them, as a 1-byte count
                # then u16 lengths, ahead of the bytes (fuzz_tcp_stream's format).
                body = stream[first:first + 4096]
                cuts, done = [], 0
                for n in splits[key]:
                    done += n
                    if first < done < first + len(body):
                        cuts.append(done - first)
                cuts = cuts[:32]
                seeds["tcp_stream"].add(bytes([len(cuts)]) + b"".join(
                    struct.pack("<H", min(c, 0xFFFF)) for c in cuts) + body)

for target, found in sorted(seeds.items()):
    d = os.path.join(corpus, target)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        if f.startswith("capture-"):
            os.remove(os.path.join(d, f))
    # At most 40 per target, the most distinct first (by length, then bytes).
    chosen = sorted(found, key=lambda b: (len(b), b))
    step = max(1, len(chosen) // 40)
    for data in chosen[::step][:40]:
        name = "capture-" + hashlib.sha1(data).hexdigest()[:12]
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    print(f"capture: {target}: {len(found)} distinct, kept {min(40, len(chosen[::step]))}")
