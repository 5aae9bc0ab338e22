"""The one place ZeroMQ sockets are made, so every socket gets the same linger and options."""

from __future__ import annotations

from typing import Any

import zmq

LINGER_MS = 0  # pending messages to a dead peer never block shutdown


def make_socket(
    context: zmq.Context[Any],
    socket_type: int,
    address: str,
    *,
    bind: bool,
    identity: bytes | None = None,
) -> zmq.Socket[Any]:
    socket: zmq.Socket[Any] = context.socket(socket_type)
    socket.setsockopt(zmq.LINGER, LINGER_MS)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    if socket_type == zmq.DEALER:
        # Reconnect fast after an engine restart on the same address.
        socket.setsockopt(zmq.RECONNECT_IVL, 100)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    (socket.bind if bind else socket.connect)(address)
    return socket
