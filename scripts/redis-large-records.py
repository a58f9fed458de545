#!/usr/bin/env python3
"""redis-server CPU per large completion, three ways, measured against one running redis-server.

    scripts/redis-large-records.py PORT PID MODE N [SIZE]

Sends N operations (pipelined 16 at a time, on one connection, each on a new key as the load
bench's 64k-new-key does) to the redis-server on 127.0.0.1:PORT whose process id is PID, and
prints the server's CPU per operation (utime + stime from /proc/PID/stat, over the N
operations). SIZE is the body's length (default 65536); the record is that plus a 38-byte
header, as the proxy frames it. MODE:

    set      SET key <record> PX ttl: the plain write the target compares with
    inline   SET key <claim> NX PX lease GET, then EVALSHA of the inline completion script
             with the record as its argument (what the proxy did before)
    staged   the same claim, then SET <staging key> <record> PX ttl and EVALSHA of the staged
             completion script (RENAME over the claim), sent together (what it does now)

The scripts are copies of src/store/redis/scripts.rs. Only loopback; bounded by N. Use a
redis-server of your own (never one that holds data): the keys stay, with a TTL of a day, so
FLUSHALL between runs.
"""
import os
import socket
import sys

COMPLETE = b"""
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
if v == ARGV[2] then
  return 1
end
return 0"""

COMPLETE_STAGED = b"""
local held = ARGV[1]
if redis.call('STRLEN', KEYS[1]) == #held and redis.call('GET', KEYS[1]) == held then
  if redis.call('EXISTS', KEYS[2]) == 0 then
    return 3
  end
  redis.call('RENAME', KEYS[2], KEYS[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
local n = redis.call('STRLEN', KEYS[2])
if n == 0 then
  return 3
end
local same = redis.call('STRLEN', KEYS[1]) == n
  and redis.call('GET', KEYS[1]) == redis.call('GET', KEYS[2])
redis.call('DEL', KEYS[2])
if same then
  return 1
end
return 0"""

BATCH = 16
TTL = 86_400_000
LEASE = 10_000


def command(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = str(a).encode()
        out += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(out)


class Connection:
    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = b""

    def send(self, data):
        self.sock.sendall(data)

    def _fill(self):
        data = self.sock.recv(1 << 20)
        if not data:
            raise EOFError("redis-server closed the connection")
        self.buf += data

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind in (b"+", b":"):
            return rest
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self._fill()
            value, self.buf = self.buf[:n], self.buf[n + 2:]
            return value
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        raise RuntimeError(f"unexpected reply {line!r}")


def server_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    port, pid, mode, n = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    size = int(sys.argv[5]) if len(sys.argv) == 6 else 65536
    if mode not in ("set", "inline", "staged"):
        sys.exit(f"unknown mode {mode!r}\n{__doc__}")
    conn = Connection(port)
    shas = {}
    for name, script in (("inline", COMPLETE), ("staged", COMPLETE_STAGED)):
        conn.send(command("SCRIPT", "LOAD", script))
        shas[name] = conn.reply()
    token = os.urandom(16)
    claim = b"IDP\x01P" + token + os.urandom(32)
    body = os.urandom(size)
    run = os.urandom(4).hex()

    def operation(i):
        key = f"idemproxy-load:idempotent:{run}{i:056x}"
        record = b"IDP\x01D" + os.urandom(32) + b"R" + body
        if mode == "set":
            return [command("SET", key, record, "PX", TTL)]
        first = command("SET", key, claim, "NX", "PX", LEASE, "GET")
        if mode == "inline":
            return [first, command("EVALSHA", shas["inline"], 1, key, claim, record, TTL)]
        staging = f"{key}:staged:{token.hex()}{{{key}}}"
        return [
            first,
            command("SET", staging, record, "PX", TTL),
            command("EVALSHA", shas["staged"], 2, key, staging, claim, TTL),
        ]

    before = server_cpu(pid)
    for start in range(0, n, BATCH):
        batch = [c for i in range(start, min(n, start + BATCH)) for c in operation(i)]
        conn.send(b"".join(batch))
        for _ in batch:
            answer = conn.reply()
            if isinstance(answer, bytes) and answer.isdigit() and answer != b"1":
                sys.exit(f"a completion script answered {answer!r}")
    used = server_cpu(pid) - before
    print(f"{mode:7} size={size} n={n}: redis-server {used * 1e6 / n:.1f} µs CPU per operation")


if __name__ == "__main__":
    main()
