"""One HTTP request's spans (tracing.py makes one per POST): the request's own, and its steps as
children, each from the end of the previous one: `validate`, `tokenize`, then `generate`, whose
context the engine requests carry."""

from __future__ import annotations

import time

from opentelemetry import trace

from ember_core.output_processor import ChoiceRequest
from ember_core.tracing import traceparent_of


class RequestTrace:
    def __init__(self, tracer: trace.Tracer, span: trace.Span, start_ns: int) -> None:
        self._tracer = tracer
        self._context = trace.set_span_in_context(span)
        self._mark_ns = start_ns  # where the next step's span starts
        self._generate: trace.Span | None = None

    def step_done(self, name: str) -> None:
        """A child span from the end of the previous step (or the request's start) to now."""
        now = time.time_ns()
        self._tracer.start_span(name, context=self._context, start_time=self._mark_ns).end(end_time=now)
        self._mark_ns = now

    def generation_started(self, request_id: str, model: str, choices: list[ChoiceRequest]) -> str:
        """Opens the `generate` span (after `tokenize`); its traceparent, for the Generates."""
        self.step_done("tokenize")
        params = choices[0].params
        self._generate = self._tracer.start_span("generate", context=self._context, attributes={
            "gen_ai.request.id": request_id,
            "gen_ai.request.model": model,
            "gen_ai.request.n": len(choices),
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.prompt_tokens": sum(len(choice.prompt_ids) for choice in choices),
        })
        return traceparent_of(self._generate)

    def routed(self, engine: str, reason: str) -> None:
        """reason: the router's (router.REASONS), or `only` where one engine could take it."""
        if self._generate is not None:
            self._generate.set_attributes({"ember.engine": engine, "ember.routing.reason": reason})

    def first_token(self, time_to_first_token: float) -> None:
        if self._generate is not None:
            self._generate.add_event("first token")
            self._generate.set_attribute("gen_ai.latency.time_to_first_token", time_to_first_token)

    def generation_ended(self, completion_tokens: int) -> None:
        if self._generate is not None:
            self._generate.set_attribute("gen_ai.usage.completion_tokens", completion_tokens)
            self.close()
            self._mark_ns = time.time_ns()

    def close(self) -> None:
        """Ends the `generate` span if a submission that failed (no engine: 503) left it open."""
        if self._generate is not None:
            self._generate.end()
            self._generate = None
