"""Which address a run's coordinator listens on (docs/decisions.md item 113).

The engines' coordinators accept any connection that reaches them, without authentication:
torch.distributed's TCPStore (process 0), jax's coordination service (process 0), and every
tensorflow worker's gRPC server. By default each binds every interface (`*:port`, `[::]:port`).

- A local run (`--processes N` alone, or a coordinator on a loopback address) binds 127.0.0.1 only:
  torch's store is given a socket bound there (`master_listen_fd`), gloo's connections use the loopback
  interface (GLOO_SOCKET_IFNAME), jax's service gets `coordinator_bind_address`.
- A run over several machines must be reachable by them: it keeps the engines' binding, and process 0
  says on stderr which address and port it exposes (`announce`), so nobody exposes a port unknowingly.
- tensorflow's gRPC servers have no setting for their bind address: every worker listens on all
  interfaces, even in a local run, and says so on stderr.
"""

import ipaddress
import socket
import sys


def is_loopback(host):
    """Whether `host` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interface():
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def listening_socket(host, port):
    """A TCP socket bound to host:port (a loopback address) and listening, for torch's TCPStore."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1" if host == "localhost" else host.strip("[]"), port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def announce(what, port):
    """One line on stderr: the address (every interface, `port`) this process exposes to other machines."""
    where = f"*:{port}" if port is not None else "every interface, at its TF_CONFIG port"
    print(f"attnkit: {what} listens on {where}, unauthenticated: any machine that reaches this one can connect; "
          "keep the port behind a firewall", file=sys.stderr, flush=True)
