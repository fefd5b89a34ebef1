"""A reply that tells its worker when the caller has read it (``ReplyAck``).

Pure (no torch; Ray only to learn the node's address): the worker wraps a reply in it, and the caller,
the coordinator, runs ``_acknowledge`` as Ray deserialises the reply there, so this module must stay
importable without torch. Used by a worker's fault hook (raytrain.worker.phases), which must not kill its
worker before the reply to the step before has left it.
"""

from __future__ import annotations

import socket

ACK_CONNECT_TIMEOUT_S = 5.0
"""Bound on the caller's connection back to a worker that waits for it (see ``ReplyAck``)."""


class ReplyAck:
    """Learn when the caller has read one reply: the reply connects back here as it is deserialised.

    Ray deserialises an actor method's result in the caller's process, when the caller gets it; so
    a result whose unpickling opens a connection to this worker proves that the caller holds it.
    Unpickled, the reply is the report it carried. Nothing here sleeps or guesses a delay.
    """

    def __init__(self):
        self._server = socket.create_server(("", 0))  # every interface: the caller may be on another node
        self.address = (_node_address(), self._server.getsockname()[1])

    def attach(self, result):
        return _AckingReply(result, self.address)

    def wait(self, timeout_s: float) -> bool:
        """Block until the reply was read (True) or ``timeout_s`` passed (False)."""
        self._server.settimeout(timeout_s)
        try:
            conn, _ = self._server.accept()
            conn.close()
            return True
        except TimeoutError:
            return False
        finally:
            self._server.close()


class _AckingReply:
    """A reply that, unpickled in the caller, connects back to the worker and becomes the reply itself."""

    def __init__(self, result, address: tuple[str, int]):
        self.result, self.address = result, address

    def __reduce__(self):
        return _acknowledge, (self.result, self.address)


def _acknowledge(result, address: tuple[str, int]):
    """Runs in the caller as it deserialises the reply: tell the worker, return the reply itself."""
    try:
        socket.create_connection(address, timeout=ACK_CONNECT_TIMEOUT_S).close()
    except OSError:
        pass  # the worker is gone already: nobody waits for this
    return result


def _node_address() -> str:
    """This machine's address as Ray knows it (loopback outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"
