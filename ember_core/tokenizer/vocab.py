"""Turn a byte-level BPE vocabulary and merge list (from any file format) into a TokenizerSpec."""

import itertools
from collections.abc import Iterable

from ember_core.tokenizer.byte_level import token_bytes
from ember_core.tokenizer.spec import TokenizerSpec

# Special tokens that end a turn in the chat formats we know; generation stops at them.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<|end_of_text|>", "<end_of_turn>"
)


def build_spec(
    *,
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    special_tokens: dict[str, int],
    added_tokens: dict[str, int],
    pattern: str,
    bos_token_id: int | None,
    eos_token_id: int | None,
    extra_stop_ids: Iterable[int] = (),
    chat_template: str | None = None,
    add_bos_token: bool = False,
    unicode_normalization: str = "",
) -> TokenizerSpec:
    """vocab maps byte-level-written tokens to ids; entries that are special or added tokens are
    taken as those. merges are in priority order, as in tokenizer.json / merges.txt / GGUF."""
    added_ids = {*special_tokens.values(), *added_tokens.values()}
    bytes_by_id: dict[int, bytes] = {}
    decode_only: dict[int, bytes] = {}
    for text, token_id in vocab.items():
        if token_id in added_ids:
            continue
        data = token_bytes(text)
        if data is None:
            # Not written in the byte alphabet: BPE never builds it, and HF decodes it as its text.
            decode_only[token_id] = text.encode()
        else:
            bytes_by_id[token_id] = data

    merged_ids = _merged_ids_in_order(vocab, merges, bytes_by_id)
    reachable = {token_id for token_id, data in bytes_by_id.items() if len(data) == 1} | set(merged_ids)
    for token_id, data in bytes_by_id.items():
        if token_id not in reachable:
            decode_only[token_id] = data

    if all(earlier < later for earlier, later in itertools.pairwise(merged_ids)):
        # Ids already follow the merge order, so tiktoken can use them as ranks directly (the
        # ranks of single bytes never compete: tiktoken only ranks pairs).
        mergeable_ranks = {bytes_by_id[token_id]: token_id for token_id in reachable}
        rank_to_id = None
    else:
        single_byte_ids = sorted(reachable - set(merged_ids), key=bytes_by_id.__getitem__)
        rank_to_id = single_byte_ids + merged_ids
        mergeable_ranks = {bytes_by_id[token_id]: rank for rank, token_id in enumerate(rank_to_id)}

    return TokenizerSpec(
        pattern=pattern,
        mergeable_ranks=mergeable_ranks,
        special_tokens=special_tokens,
        added_tokens=added_tokens,
        rank_to_id=rank_to_id,
        decode_only_tokens=decode_only,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids(special_tokens, eos_token_id, extra_stop_ids),
        chat_template=chat_template,
        add_bos_token=add_bos_token,
        unicode_normalization=unicode_normalization,
    )


def stop_token_ids(
    special_tokens: dict[str, int], eos_token_id: int | None, extra_stop_ids: Iterable[int]
) -> list[int]:
    """EOS, the given ids, and the special tokens that end a turn in the chat formats we know."""
    stop_ids = {*extra_stop_ids, *(special_tokens[name] for name in END_OF_TURN_TOKENS if name in special_tokens)}
    if eos_token_id is not None:
        stop_ids.add(eos_token_id)
    return sorted(stop_ids)


def _merged_ids_in_order(
    vocab: dict[str, int], merges: list[tuple[str, str]], bytes_by_id: dict[int, bytes]
) -> list[int]:
    """Ids built by the merges, each at its first merge."""
    merged: dict[int, None] = {}
    for left, right in merges:
        for part in (left, right):
            if part not in vocab:
                raise ValueError(f"merge {left!r} {right!r} uses {part!r}, which is not in the vocabulary")
        result = left + right
        if result not in vocab:
            raise ValueError(f"merge {left!r} {right!r} builds {result!r}, which is not in the vocabulary")
        result_id = vocab[result]
        # A merge of tokens outside the byte alphabet can never apply to byte-level text.
        if result_id in bytes_by_id and vocab[left] in bytes_by_id and vocab[right] in bytes_by_id:
            merged.setdefault(result_id, None)
    return list(merged)
