"""The offline API: the same Engine, driven in-process."""

from __future__ import annotations

import array
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, replace
from typing import Self

from tqdm.auto import tqdm

from ember_core.config import DEFAULT_MODEL, EngineConfig
from ember_core.engine.engine import Engine
from ember_core.lora.request import LoRARequest
from ember_core.output_processor import ChoiceResult, OutputProcessor, fan_out
from ember_core.sampling_params import SamplingParams
from ember_proto import EmbedOptions, EngineStats, TokenLogprob

PROGRESS_BAR_MIN_PROMPTS = 8


@dataclass
class CompletionOutput:
    """One of a prompt's n completions (vLLM's CompletionOutput)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """A prompt and its completions, shaped as vLLM's: `output.outputs[0].text`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # of prompt tokens 1, 2, ... (the first has none), with SamplingParams(prompt_logprobs=...)
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return all(output.finish_reason is not None for output in self.outputs)

    # The first completion's fields, for the common n=1 case: `output.text`.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


@dataclass
class EmbeddingRequestOutput:
    """A prompt's pooled embedding (vLLM's EmbeddingRequestOutput, its outputs.embedding flattened)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if it has any (also on leaving a `with` block)."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats(expert_load=True)

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
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: the LoRA adapter the prompts run with, or one per prompt (None: the base
        model); loaded on first use (LLM(..., enable_lora=True))."""
        prompts = _prompt_list(prompts)
        adapters = self._adapters(lora_request, len(prompts))
        params = params or SamplingParams()
        param_list = list(params) if isinstance(params, SequenceABC) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")
        wrong = next((p for p in param_list if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise TypeError(f"params must be a SamplingParams or a list of them, got {type(wrong).__name__}")
        requests = [
            self._request(f"offline-{id(param_list)}-{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, param_list))
        ]
        choices = fan_out([(request.prompt_token_ids, p) for request, p in zip(requests, param_list)])
        choice_ids = [f"{requests[choice.prompt_index].request_id}-{choice.index}" for choice in choices]
        processor = OutputProcessor(self.tokenizer, choices, self.engine.stop_token_ids)
        results = [ChoiceResult(i) for i in range(len(choices))]
        try:
            for choice_id, choice in zip(choice_ids, choices):
                # the prompt's logprobs once, with its first completion
                params = choice.params if choice.index == 0 else replace(choice.params, prompt_logprobs=None)
                self.engine.add_request(choice_id, choice.prompt_ids, params, adapter=adapters[choice.prompt_index])
            show_progress = use_tqdm if use_tqdm is not None else len(choices) >= PROGRESS_BAR_MIN_PROMPTS
            self._run(processor, {choice_id: i for i, choice_id in enumerate(choice_ids)}, results, show_progress)
        except BaseException:
            self._abort(choice_ids)
            raise
        for choice, result in zip(choices, results):
            request = requests[choice.prompt_index]
            _fill(request, request.outputs[choice.index], result)
        return requests

    def _adapters(self, lora_request: LoRARequest | list[LoRARequest | None] | None, num_prompts: int) -> list[str]:
        """Each prompt's adapter name ("": none), every adapter loaded."""
        requests = list(lora_request) if isinstance(lora_request, SequenceABC) else [lora_request] * num_prompts
        if len(requests) != num_prompts:
            raise ValueError(f"got {len(requests)} LoRA requests for {num_prompts} prompts")
        for request in dict.fromkeys(r for r in requests if r is not None):
            adapters = self.engine.adapters
            if adapters is None or request.lora_name not in adapters.names:
                self.engine.add_adapter(request.lora_name, request.lora_path)
        return [r.lora_name if r is not None else "" for r in requests]

    def embed(self, prompts: str | list[str] | list[list[int]], dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, pooled as the model's files say (pooling.py); dimensions: truncate
        a Matryoshka model's embeddings to that many values."""
        outputs = [
            EmbeddingRequestOutput(f"embed-{id(prompts)}-{i}", self._prompt_ids(prompt), [])
            for i, prompt in enumerate(_prompt_list(prompts))
        ]
        by_id = {output.request_id: output for output in outputs}
        try:
            for output in outputs:
                self.engine.add_request(
                    output.request_id, output.prompt_token_ids, SamplingParams(max_tokens=0), embed=EmbedOptions(dimensions)
                )
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    by_id[delta.request_id].embedding = array.array("f", delta.embedding).tolist()
        except BaseException:
            self._abort(list(by_id))
            raise
        return outputs

    def _abort(self, request_ids: list[str]) -> None:
        """Free every request of a call that failed or was interrupted, so the engine is idle again."""
        self.engine.abort(request_ids)
        while self.engine.has_unfinished():
            self.engine.step()

    def _request(self, request_id: str, prompt: str | list[int], p: SamplingParams) -> RequestOutput:
        prompt_ids = self._prompt_ids(prompt)
        if p.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer and this model has none; use stop_token_ids")
        return RequestOutput(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt_ids,
            outputs=[CompletionOutput(index, logprobs=[] if p.logprobs is not None else None) for index in range(p.n)],
            prompt_logprobs=[] if p.prompt_logprobs is not None else None,
        )

    def _run(
        self, processor: OutputProcessor, indices: dict[str, int], results: list[ChoiceResult], show_progress: bool
    ) -> None:
        with tqdm(total=len(results), desc="generate", unit="req", disable=not show_progress) as bar:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    index = indices[delta.request_id]
                    if processor.finished(index):
                        continue  # the abort of a choice a stop string ended
                    update = processor.process(index, delta)
                    if update.ended_by_stop_string:
                        self.engine.abort([delta.request_id])
                    results[update.index].add(update)
                    if update.finish_reason is not None:
                        bar.update(1)


def _prompt_list(prompts: str | list[str] | list[list[int]]) -> list[str] | list[list[int]]:
    if not isinstance(prompts, (str, list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids or a list of those, got {type(prompts).__name__}")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return prompts


def _fill(request: RequestOutput, completion: CompletionOutput, result: ChoiceResult) -> None:
    completion.text = result.text
    completion.token_ids = result.token_ids
    completion.finish_reason = None if result.finish_reason is None else result.finish_reason.label
    if completion.logprobs is not None:
        completion.logprobs = result.logprobs
    if request.prompt_logprobs is not None and completion.index == 0:
        request.prompt_logprobs = result.prompt_logprobs
