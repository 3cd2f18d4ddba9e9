"""Remote side of `dflashctl tunnel`: one TCP connection inside the container, relayed over this
process's stdin and stdout (which the SSH channel carries). Stdlib only.

    python -c <this source> PORT

Connects to 127.0.0.1:PORT inside the container's network namespace (a pct or docker container
needs no address of its own that the laptop can reach), then copies stdin to the socket and the
socket to stdout until either side closes. A refused connection is one line on stderr, exit 3.

stdin carries frames, `length (4 bytes, big endian) | bytes`: a frame of length 0 means the local
client has finished sending (the server's end is half-closed, as the client's was), while the end
of stdin itself means the tunnel dropped this connection (Ctrl-C, a lost link): the relay exits at
once, whatever the server does with its end.
"""

import os
import socket
import struct
import sys
import threading


def read_exact(n):
    """n bytes of stdin, or None at its end."""
    buf = b""
    while len(buf) < n:
        part = os.read(0, n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def pump_in(sock):
    """stdin frames -> socket; exits the process when stdin ends."""
    broken = False
    while True:
        head = read_exact(4)
        if head is None:
            os._exit(0)  # the tunnel let go of this connection: so does the relay (the socket closes)
        size = struct.unpack("!I", head)[0]
        data = read_exact(size) if size else b""
        if data is None:
            os._exit(0)
        if broken:
            continue  # the server stopped reading; what it still sends goes on to the client
        try:
            if data:
                sock.sendall(data)
            else:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            broken = True


def main(argv):
    """Relay one connection to 127.0.0.1:PORT; returns the exit code."""
    port = int(argv[0])
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError as exc:
        sys.stderr.write("relay: cannot connect to port %d in the container: %s\n" % (port, exc.strerror or exc))
        return 3
    sock.settimeout(None)
    threading.Thread(target=pump_in, args=(sock,), daemon=True).start()
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            view = memoryview(data)
            while view:
                view = view[os.write(1, view) :]
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
