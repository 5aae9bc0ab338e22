"""Constrained decoding in the engine (llguidance) on the default model: the output always
matches its JSON schema, regex, choice or grammar, greedy and sampled, and the constraint follows
its sequence through n choices, preemption and a resume; JSON is compact unless asked otherwise,
and ends."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import llguidance
import pytest

from ember_core import LLM, SamplingParams
from ember_core.structured_outputs import StructuredOutputError, grammar_of
from ember_core.tokenizer.chat_template import render_chat
from ember_proto import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
PROMPTS = ["Give me a JSON object about Paris.", "Describe Tokyo as JSON.", "A city, please:"]


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path: Path) -> LLM:
    # a small pool, so that 3 x n=3 sampled sequences of up to 48 tokens get preempted
    return LLM(str(smollm2_gguf_path), dtype="float32", num_blocks=12, block_size=8, max_num_seqs=9)


def test_json_schema_outputs_validate_greedy_and_sampled_through_preemption(llm: LLM) -> None:
    constraint = StructuredOutputs(json=json.dumps(SCHEMA))
    for params in (
        SamplingParams(max_tokens=48, temperature=0, structured_outputs=constraint),
        SamplingParams(max_tokens=48, temperature=1.0, seed=3, n=3, structured_outputs=constraint),
    ):
        for output in llm.generate(PROMPTS, params):
            for completion in output.outputs:
                assert completion.finish_reason == "stop", completion
                jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert llm.stats().num_preemptions > 0


def test_regex_choice_and_grammar_constrain_the_text(llm: LLM) -> None:
    regex = SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=4,
                           structured_outputs=StructuredOutputs(regex=r"[A-Z]{2}-\d{3}"))
    for completion in llm.generate(["The code is"], regex)[0].outputs:
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", completion.text) and completion.finish_reason == "stop"
    choices = ["yes", "no", "it depends"]
    choice = SamplingParams(max_tokens=8, temperature=1.0, seed=2, n=4, structured_outputs=StructuredOutputs(choice=choices))
    assert {c.text for c in llm.generate(["Is it raining?"], choice)[0].outputs} <= set(choices)
    gbnf = 'root ::= "(" [0-9]+ " + " [0-9]+ ")"'
    grammar = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputs(grammar=gbnf))
    output = llm.generate(["An addition:"], grammar)[0]
    assert re.fullmatch(r"\(\d+ \+ \d+\)", output.text) or output.finish_reason == "length", output.text


def test_a_json_object_is_any_object_and_max_tokens_cuts_with_length(llm: LLM) -> None:
    params = SamplingParams(max_tokens=64, temperature=0, structured_outputs=StructuredOutputs(json_object=True))
    assert isinstance(json.loads(llm.generate(["Some JSON:"], params)[0].text), dict)
    short = SamplingParams(max_tokens=3, temperature=0, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA)))
    output = llm.generate(["Some JSON:"], short)[0]
    assert output.finish_reason == "length" and output.text.startswith("{")


def test_a_resumed_request_continues_inside_its_constraint(llm: LLM) -> None:
    constraint = StructuredOutputs(json=json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=48, temperature=0, structured_outputs=constraint)
    whole = llm.generate(PROMPTS[:1], params)[0]
    prompt_ids = whole.prompt_token_ids
    engine = llm.engine
    engine.add_request("resumed", prompt_ids, params, output_token_ids=whole.token_ids[:5])
    tokens = list(whole.token_ids[:5])
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.new_token_ids
    assert tokens == whole.token_ids


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (StructuredOutputs(json="{not json"), "json"),
        (StructuredOutputs(regex="(unclosed"), "regex"),
        (StructuredOutputs(grammar="start: missing_rule"), "grammar"),
        (StructuredOutputs(choice=[]), "choice"),
        (StructuredOutputs(regex="a", choice=["a"]), ""),
        (StructuredOutputs(), ""),
    ],
)
def test_an_invalid_constraint_names_its_field(constraint: StructuredOutputs, field: str) -> None:
    with pytest.raises(StructuredOutputError) as error:
        grammar_of(constraint)
    assert error.value.field == field
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=constraint)


SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())


@pytest.fixture(scope="module")
def batch_llm(smollm2_gguf_path: Path) -> LLM:
    # 16 sequences at a time in a pool that holds about 8 of them: preempted, but not one at a time
    return LLM(str(smollm2_gguf_path), dtype="float32", num_blocks=40, block_size=8, max_num_seqs=16)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_twenty_schemas_validate_greedy_and_sampled_with_n_3_through_preemption(batch_llm: LLM, temperature: float) -> None:
    llm = batch_llm
    assert len(SCHEMAS) == 20
    before = llm.stats().num_preemptions
    params = [
        SamplingParams(max_tokens=64, temperature=temperature, seed=index, n=3,
                       structured_outputs=StructuredOutputs(json=json.dumps(schema)))
        for index, schema in enumerate(SCHEMAS)
    ]
    outputs = llm.generate([f"Answer in JSON ({index}):" for index in range(len(SCHEMAS))], params)
    for schema, output in zip(SCHEMAS, outputs):
        for completion in output.outputs:
            if completion.finish_reason != "length":
                jsonschema.validate(json.loads(completion.text), schema)
    assert sum(c.finish_reason == "stop" for o in outputs for c in o.outputs) >= 50
    assert llm.stats().num_preemptions > before


def test_twenty_schemas_greedy_end_with_stop(smollm2_gguf_path: Path) -> None:
    """Compact JSON, each schema in its chat prompt as a client would send it, 200 tokens of room."""
    llm = LLM(str(smollm2_gguf_path), dtype="float32", num_blocks=512, block_size=16, max_num_seqs=20)
    template = llm.tokenizer.spec.chat_template
    prompts = [
        render_chat(template, [{"role": "user", "content": f"Give me a JSON object that follows this schema: {json.dumps(schema)}"}],
                    add_generation_prompt=True)
        for schema in SCHEMAS
    ]
    params = [SamplingParams(max_tokens=200, temperature=0, structured_outputs=StructuredOutputs(json=json.dumps(schema)))
              for schema in SCHEMAS]
    outputs = llm.generate(prompts, params)
    ended = [output.outputs[0] for output in outputs if output.outputs[0].finish_reason == "stop"]
    assert len(ended) >= 19, [output.outputs[0].text for output in outputs]
    for output, schema in zip(outputs, SCHEMAS):
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_unconstrained_neighbours_keep_their_greedy_tokens(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    constrained = SamplingParams(max_tokens=24, temperature=0, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA)))
    mixed = llm.generate(PROMPTS * 2, [plain] * len(PROMPTS) + [constrained] * len(PROMPTS))
    assert [o.token_ids for o in mixed[: len(PROMPTS)]] == [o.token_ids for o in alone]


@pytest.mark.parametrize(
    ("text", "compact", "any_whitespace"),
    [
        ('{"a":[1,2]}', True, True),
        ('{ "a": [1, 2] }', True, True),
        ('{\n  "a": [\n    1,\n    2\n  ]\n}', False, True),  # pretty-printed, indented
        ('{\n\t"a":\t1}', False, True),
        ('{\n\n"a": 1}', False, False),  # a blank line
        ('{"a":  1}', False, False),  # a run of spaces
        ("{\n" + " " * 25 + '"a": 1}', False, False),  # deeper than six levels of four
    ],
)
def test_json_is_compact_and_any_whitespace_is_bounded(text: str, compact: bool, any_whitespace: bool) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {}}})
    assert _accepts(grammar_of(StructuredOutputs(json=schema)), text) == compact
    assert _accepts(grammar_of(StructuredOutputs(json=schema, any_whitespace=True)), text) == any_whitespace
    assert _accepts(grammar_of(StructuredOutputs(json_object=True)), text) == compact


def test_a_schemas_own_whitespace_option_wins() -> None:
    flexible = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    assert _accepts(grammar_of(StructuredOutputs(json=json.dumps(flexible))), '{\n\n\n  }')


class _ByteTokenizer:
    """One token per byte, and an end-of-text token: llguidance's TokenizerWrapper reads these."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b""]

    def __call__(self, text: str) -> list[int]:
        return list(text.encode())


def _accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer())), grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()
