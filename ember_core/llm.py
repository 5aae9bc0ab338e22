"""The offline API: the same Engine, driven in-process."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm

from ember_core.config import DEFAULT_MODEL, EngineConfig
from ember_core.core.engine import Engine
from ember_core.sampling_params import SamplingParams, choice_seed
from ember_core.tokenizer import OutputText, StopRules
from ember_proto import EngineStats, FinishReason, TokenLogprob

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
class _Choice:
    """An engine request of LLM.generate: one completion of one prompt."""

    request: RequestOutput
    completion: CompletionOutput
    text: OutputText


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
        wrong = next((p for p in param_list if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise TypeError(f"params must be a SamplingParams or a list of them, got {type(wrong).__name__}")
        outputs: list[RequestOutput] = []
        choices: dict[str, _Choice] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, param_list)):
                prompt_ids = self._prompt_ids(prompt)
                if p.stop and self.tokenizer is None:
                    raise ValueError("stop strings need a tokenizer and this model has none; use stop_token_ids")
                request = RequestOutput(
                    request_id=f"offline-{id(outputs)}-{i}",
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=prompt_ids,
                    outputs=[CompletionOutput(c, logprobs=[] if p.logprobs is not None else None) for c in range(p.n)],
                    prompt_logprobs=[] if p.prompt_logprobs is not None else None,
                )
                outputs.append(request)
                for completion in request.outputs:
                    # as the gateway's n: seed + choice, and the prompt's logprobs computed once
                    choice_params = replace(
                        p, seed=choice_seed(p.seed, completion.index),
                        prompt_logprobs=p.prompt_logprobs if completion.index == 0 else None,
                    )
                    choice_id = f"{request.request_id}-{completion.index}"
                    text = OutputText(self.tokenizer, StopRules(p.stop, p.min_tokens, p.include_stop_str_in_output))
                    choices[choice_id] = _Choice(request, completion, text)
                    self.engine.add_request(choice_id, prompt_ids, choice_params)
            self._run(choices, use_tqdm if use_tqdm is not None else len(choices) >= PROGRESS_BAR_MIN_PROMPTS)
        except BaseException:
            self.engine.abort(list(choices))
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        return outputs

    def _run(self, choices: dict[str, _Choice], show_progress: bool) -> None:
        with tqdm(total=len(choices), desc="generate", unit="req", disable=not show_progress) as bar:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    choice = choices[delta.request_id]
                    out = choice.completion
                    if out.finish_reason is not None:
                        continue  # the abort of an output a stop string ended
                    out.token_ids.extend(delta.new_token_ids)
                    if out.logprobs is not None:
                        out.logprobs.extend(delta.logprobs)
                    if choice.request.prompt_logprobs is not None:
                        choice.request.prompt_logprobs.extend(delta.prompt_logprobs)
                    final = delta.finish_reason is not None
                    match = choice.text.push(delta.new_token_ids, final, stop_token=delta.finish_reason is FinishReason.STOP)
                    out.text += match.text
                    if match.stopped:
                        self.engine.abort([delta.request_id])
                        out.finish_reason = FinishReason.STOP.label
                    elif final:
                        out.finish_reason = delta.finish_reason.label
                    if out.finish_reason is not None:
                        bar.update(1)
