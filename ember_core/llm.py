"""The offline API: the same Engine, driven in-process."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from ember_core.config import DEFAULT_MODEL, EngineConfig
from ember_core.core.engine import Engine, EngineStats
from ember_core.core.sequence import FinishReason, TokenLogprob
from ember_core.sampling_params import SamplingParams
from ember_core.tokenizer import OutputText, StopRules

PROGRESS_BAR_MIN_PROMPTS = 8


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    # of prompt tokens 1, 2, ... (the first has none), with SamplingParams(prompt_logprobs=...)
    prompt_logprobs: list[TokenLogprob] | None = None


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. between benchmark runs); running requests keep their blocks."""
        self.engine.block_manager.reset_prefix_cache()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer files: pass prompts as lists of token ids")
            return self.tokenizer.encode_prompt(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError(f"a prompt is a string or a list of token ids, got {prompt!r:.80}")
        return list(prompt)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        if not isinstance(prompts, (str, list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of those, got {type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        param_list = list(params) if isinstance(params, SequenceABC) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")
        outputs: dict[str, RequestOutput] = {}
        texts: dict[str, OutputText] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, param_list)):
                request_id = f"offline-{id(outputs)}-{i}"
                prompt_ids = self._prompt_ids(prompt)
                if p.stop and self.tokenizer is None:
                    raise ValueError("stop strings need a tokenizer and this model has none; use stop_token_ids")
                outputs[request_id] = RequestOutput(
                    request_id,
                    prompt if isinstance(prompt, str) else None,
                    prompt_ids,
                    logprobs=[] if p.logprobs is not None else None,
                    prompt_logprobs=[] if p.prompt_logprobs is not None else None,
                )
                texts[request_id] = OutputText(self.tokenizer, StopRules(p.stop, p.min_tokens, p.include_stop_str_in_output))
                self.engine.add_request(request_id, prompt_ids, p)
            self._run(outputs, texts, use_tqdm if use_tqdm is not None else len(outputs) >= PROGRESS_BAR_MIN_PROMPTS)
        except BaseException:
            self.engine.abort(list(outputs))
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        return list(outputs.values())

    def _run(self, outputs: dict[str, RequestOutput], texts: dict[str, OutputText], show_progress: bool) -> None:
        with tqdm(total=len(outputs), desc="generate", unit="req", disable=not show_progress) as bar:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    out = outputs[delta.request_id]
                    if out.finish_reason is not None:
                        continue  # the abort of an output a stop string ended
                    out.token_ids.extend(delta.new_token_ids)
                    if out.logprobs is not None:
                        out.logprobs.extend(delta.new_logprobs)
                    if out.prompt_logprobs is not None:
                        out.prompt_logprobs.extend(delta.prompt_logprobs)
                    final = delta.finish_reason is not None
                    match = texts[delta.request_id].push(
                        delta.new_token_ids, final, stop_token=delta.finish_reason is FinishReason.STOP
                    )
                    out.text += match.text
                    if match.stopped:
                        self.engine.abort([delta.request_id])
                        out.finish_reason = FinishReason.STOP.label
                    elif final:
                        out.finish_reason = delta.finish_reason.label
                    if out.finish_reason is not None:
                        bar.update(1)
