"""Remote side of `dflashctl tunnel`: one TCP connection inside the container, relayed over this
process's stdin and stdout (which the SSH channel carries). Stdlib only.

    python -c <this source> PORT

Connects to 127.0.0.1:PORT inside the container's network namespace (a pct or docker container
needs no address of its own that the laptop can reach), then copies stdin to the socket and the
socket to stdout until either side closes. A refused connection is one line on stderr, exit 3.
"""

import os
import socket
import sys
import threading


def pump_in(sock):
    """stdin -> socket, then half-close so the server sees the end of the request."""
    try:
        while True:
            data = os.read(0, 65536)
            if not data:
                break
            sock.sendall(data)
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


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
                view = view[os.write(1, view):]
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
