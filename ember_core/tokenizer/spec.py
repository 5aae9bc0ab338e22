"""Everything needed to rebuild a tokenizer without model files, small enough to send to a gateway."""

import msgspec


class TokenizerSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    # tiktoken's split regex: the model's pre-tokenizer written as one pattern (byte-level BPE).
    pattern: str = ""
    # Byte-level BPE as tiktoken runs it: a lower rank merges first. Ranks are token ids unless
    # rank_to_id is set.
    mergeable_ranks: dict[bytes, int] = {}
    # Control tokens: recognised in text only on request, dropped by skip_special_tokens.
    special_tokens: dict[str, int] = {}
    # User-defined added tokens: always recognised in text, always decoded.
    added_tokens: dict[str, int] = {}
    # rank_to_id[rank] is the token id when the vocabulary's ids do not follow the merge order.
    rank_to_id: list[int] | None = None
    # Vocabulary entries that BPE never produces (no merge builds them); they still decode.
    decode_only_tokens: dict[int, bytes] = {}
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # EOS plus the end-of-turn tokens a generation stops at.
    stop_token_ids: list[int] = []
    chat_template: str | None = None
    # Whether the model expects BOS in front of a prompt.
    add_bos_token: bool = False
    # tokenizer.json's Unicode normalizer ("NFC" for Qwen's), applied to a text before it is split;
    # "": none.
    unicode_normalization: str = ""
    # A SentencePiece-style tokenizer (metaspace, byte fallback), run by HF tokenizers: its
    # tokenizer.json. When set, pattern, mergeable_ranks, rank_to_id and decode_only_tokens are unused.
    tokenizer_json: str | None = None
