"""A request in flight at an engine: where its outputs go and what it has received, so that it can
be continued on another engine (`Generate.output_token_ids`) or failed, never dropped.

Every engine request of an HTTP request shares one asyncio.Queue; each StepOutputs is fanned out
to those queues in O(deltas).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from ember_proto import Generate, RequestDelta, StepOutputs


@dataclass(frozen=True)
class EngineFailure:
    status: int  # the HTTP status the client gets
    message: str


class Output(NamedTuple):
    index: int  # position of the engine request in its submission
    item: RequestDelta | EngineFailure
    previous_message_at: float  # time.monotonic() when the gateway received the engine's previous message


@dataclass(eq=False)
class InFlightRequest:
    queue: asyncio.Queue[Output]
    index: int
    generate: Generate
    output_token_ids: list[int] = field(default_factory=list)  # received so far

    def resumed(self) -> Generate:
        """The request for a new engine: it continues after the tokens already received, and does
        not ask again for the prompt logprobs that came with the first of them."""
        if not self.output_token_ids:
            return self.generate
        sampling = msgspec.structs.replace(self.generate.sampling, prompt_logprobs=None)
        return msgspec.structs.replace(self.generate, sampling=sampling, output_token_ids=list(self.output_token_ids))

    def fail(self, failure: EngineFailure) -> None:
        self.queue.put_nowait(Output(self.index, failure, time.monotonic()))


InFlight = dict[str, InFlightRequest]  # by request id


def deliver(in_flight: InFlight, message: StepOutputs, previous_message_at: float) -> None:
    """Put each delta on its request's queue; a finished request leaves in_flight."""
    for delta in message.outputs:
        request = in_flight.get(delta.request_id)
        if request is None:
            continue  # finished, aborted or failed here already
        if delta.finish_reason is not None:
            del in_flight[delta.request_id]
        else:  # for a resume on another engine
            request.output_token_ids.extend(delta.new_token_ids)
        request.queue.put_nowait(Output(request.index, delta, previous_message_at))


def fail(in_flight: InFlight, message: str) -> None:
    """End every request of in_flight with a 503 and empty it."""
    failure = EngineFailure(503, message)
    for request in in_flight.values():
        request.fail(failure)
    in_flight.clear()
