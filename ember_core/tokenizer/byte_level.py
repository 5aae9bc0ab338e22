"""GPT-2's byte-level alphabet: every byte is written as one printable character in vocab files."""


def _byte_to_char() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    # The remaining bytes (controls, space, ...) are shifted past 255 in byte order.
    for offset, byte in enumerate(byte for byte in range(256) if byte not in table):
        table[byte] = chr(256 + offset)
    return table


BYTE_TO_CHAR: dict[int, str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {char: byte for byte, char in BYTE_TO_CHAR.items()}


def token_bytes(token: str) -> bytes | None:
    """The bytes a byte-level token stands for, or None when it is not written in the alphabet."""
    try:
        return bytes(CHAR_TO_BYTE[char] for char in token)
    except KeyError:
        return None
