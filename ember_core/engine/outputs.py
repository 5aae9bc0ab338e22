"""What a step's sampled tokens do to their sequences: appended up to the first that finishes one
(a stop token past min_tokens, a complete constraint, max_tokens, the context's end), and the
RequestDelta each request streams back."""

from __future__ import annotations

from ember_core.engine.sequence import Sequence
from ember_proto import FinishReason, RequestDelta, TokenLogprob


def append_tokens(
    seq: Sequence, tokens: list[TokenLogprob], stop_token_ids: frozenset[int], max_model_len: int
) -> FinishReason | None:
    """Append tokens to seq up to the first that finishes it; why it finishes, if one does."""
    for token in tokens:
        seq.token_ids.append(token.token_id)
        if seq.matcher is not None:
            seq.matcher.consume_token(token.token_id)
        if token.logprob is not None:
            seq.logprobs.append(token)
        if (reason := _stop_reason(seq, token.token_id, stop_token_ids, max_model_len)) is not None:
            return reason
    return None


def _stop_reason(seq: Sequence, token_id: int, stop_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    params = seq.params
    if seq.matcher is not None and seq.matcher.is_stopped():  # the constraint is complete
        return FinishReason.STOP
    stop_token = token_id in (params.stop_token_ids or ()) or (not params.ignore_eos and token_id in stop_token_ids)
    if stop_token and seq.num_output_tokens >= params.min_tokens:
        return FinishReason.STOP
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def delta(
    seq: Sequence,
    new_token_ids: list[int],
    logprobs: list[TokenLogprob],
    prompt_logprobs: list[TokenLogprob],
    embedding: bytes = b"",
) -> RequestDelta:
    """What one step produced for one request (its finish reason once it has one)."""
    return RequestDelta(
        request_id=seq.request_id,
        new_token_ids=new_token_ids,
        num_prompt_tokens=seq.num_prompt_tokens,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        prompt_logprobs=prompt_logprobs,
        embedding=embedding,
    )
