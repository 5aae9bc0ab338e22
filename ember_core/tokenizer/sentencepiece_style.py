"""SentencePiece-style vocabularies (metaspace, byte fallback; BPE or Unigram) run by HF tokenizers,
which needs no torch: the spec that carries one to a gateway, and the encoder rebuilt from it."""

import json
import threading
from collections.abc import Iterable

import tokenizers

from ember_core.tokenizer.piece_decoder import piece_decoder
from ember_core.tokenizer.spec import TokenizerSpec
from ember_core.tokenizer.vocab import stop_token_ids


def sentencepiece_spec(
    tokenizer: tokenizers.Tokenizer,
    *,
    bos_token_id: int | None,
    eos_token_id: int | None,
    extra_stop_ids: Iterable[int] = (),
    chat_template: str | None = None,
    add_bos_token: bool = False,
) -> TokenizerSpec:
    """tokenizer's added tokens flagged special are the control tokens; the others are user-defined."""
    added = tokenizer.get_added_tokens_decoder()
    special_tokens = {token.content: token_id for token_id, token in added.items() if token.special}
    added_tokens = {token.content: token_id for token_id, token in added.items() if not token.special}
    # A tokenizer.json may pad or truncate encodings; prompts must be neither.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return TokenizerSpec(
        special_tokens=special_tokens,
        added_tokens=added_tokens,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids(special_tokens, eos_token_id, extra_stop_ids),
        chat_template=chat_template,
        add_bos_token=add_bos_token,
        tokenizer_json=tokenizer.to_str(),
    )


class SentencePieceStyle:
    def __init__(self, tokenizer_json: str) -> None:
        self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
        decoder = self._tokenizer.decoder
        decoder_json = None if decoder is None else json.loads(decoder.__getstate__())
        pieces = piece_decoder(decoder_json)
        self.spaces_stripped_at_start = pieces.spaces_stripped_at_start
        added_ids = self._tokenizer.get_added_tokens_decoder()
        size = max([self._tokenizer.get_vocab_size(with_added_tokens=True), *(token_id + 1 for token_id in added_ids)])
        tokens = [self._tokenizer.id_to_token(token_id) for token_id in range(size)]
        while tokens and tokens[-1] is None:
            tokens.pop()
        self.token_bytes = [None if token is None else pieces.token_bytes(token) for token in tokens]
        # Whether special tokens count in text is a setting of the tokenizer, not of one call.
        self._encode_lock = threading.Lock()

    def encode(self, text: str, allow_special: bool) -> list[int]:
        with self._encode_lock:
            self._tokenizer.encode_special_tokens = not allow_special
            return self._tokenizer.encode(text, add_special_tokens=False).ids

