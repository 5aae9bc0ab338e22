"""Health probe: exit 0 when an engine at ADDRESS answers Hello with Ready within the timeout."""

from __future__ import annotations

import sys
import uuid

import zmq

from ember_proto import PROBE_ID_PREFIX, PROTOCOL_VERSION, Hello, Ready, decode_engine_message, encode, make_socket

TIMEOUT_MS = 4000


def probe(address: str, timeout_ms: int = TIMEOUT_MS) -> bool:
    context = zmq.Context()
    gateway_id = f"{PROBE_ID_PREFIX}{uuid.uuid4().hex[:8]}"
    socket = make_socket(context, zmq.DEALER, address, bind=False, identity=gateway_id.encode())
    try:
        socket.send(encode(Hello(PROTOCOL_VERSION, gateway_id)))
        while socket.poll(timeout_ms):
            if isinstance(decode_engine_message(socket.recv()), Ready):
                return True
        return False
    finally:
        socket.close()
        context.term()


def main() -> None:
    address = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5555"
    sys.exit(0 if probe(address) else 1)


if __name__ == "__main__":
    main()
