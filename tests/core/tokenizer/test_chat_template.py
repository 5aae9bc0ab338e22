"""render_chat must render exactly what transformers' apply_chat_template(tokenize=False) renders:
for templates that exercise jinja's corners, and for the published templates of each model family
(tests/core/data/chat_templates) over conversations with system messages, turns, tools, tool calls
and their results, and reasoning."""

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from ember_core.tokenizer import Tokenizer, render_chat, tokenizer_from_gguf

BOS, EOS = "<|im_start|>", "<|im_end|>"

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 日本語 😀"},
    ],
    [
        {"role": "system", "content": "You translate.\nKeep   spacing."},
        {"role": "user", "content": "  leading spaces\n\nand blank lines  "},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "done", "name": None},
    ],
]

# Exercises what templates in the wild use: tojson, namespace, loop controls, generation blocks,
# tools defined as None, bos/eos tokens, raise_exception, strftime_now, None-valued keys.
FEATURE_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0) -%}
{% if tools is none %}[no tools]{% endif %}
{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role ' + message.role) }}
    {% endif %}
    {% if message.content is not defined %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message.role == 'assistant' %}{% generation %}{{ message.content | trim }}{{ eos_token }}{% endgeneration %}
    {% else %}{{ message | tojson(indent=2) }}
    {% endif %}
    {% if loop.index > 4 %}{% break %}{% endif %}
{% endfor %}
turns={{ ns.turns }} year={{ strftime_now('%Y') }}
{% if add_generation_prompt %}<assistant>{% endif %}"""


# OpenAI-style content=None, and more turns than the template's loop takes.
FEATURE_CONVERSATIONS = [
    *CONVERSATIONS,
    [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
        *[{"role": "user", "content": f"turn {index}"} for index in range(6)],
    ],
    # reasoning under another name reaches the template under every name, in transformers' key order
    [{"role": "user", "content": "Hi", "reasoning": "Greet back.", "name": "ana"}],
]


def transformers_render(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    bos_token: str | None = BOS,
    eos_token: str | None = EOS,
    **extra: Any,
) -> str:
    reference = _reference_tokenizer(template, bos_token, eos_token)
    return reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


@functools.cache
def _reference_tokenizer(template: str, bos_token: str | None, eos_token: str | None) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=HfTokenizer(models.BPE()), bos_token=bos_token, eos_token=eos_token, chat_template=template
    )


@pytest.fixture(scope="module")
def smollm(smollm2_reader: Any) -> Tokenizer:
    return tokenizer_from_gguf(smollm2_reader)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_gguf_template_matches_transformers(
    smollm: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    assert smollm.chat_template is not None
    expected = transformers_render(smollm.chat_template, messages, add_generation_prompt)
    actual = render_chat(smollm.chat_template, messages, add_generation_prompt, bos_token=BOS, eos_token=EOS)
    assert actual == expected
    assert smollm.render_chat(messages, add_generation_prompt) == expected


def test_gguf_template_renders_the_chatml_prompt(smollm: Tokenizer) -> None:
    prompt = smollm.render_chat([{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids == smollm.encode(prompt, allow_special=True)
    assert ids[0] == smollm.special_tokens["<|im_start|>"]
    assert ids.count(smollm.special_tokens["<|im_end|>"]) == 2


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", FEATURE_CONVERSATIONS)
def test_template_features_match_transformers(messages: list[dict[str, Any]], add_generation_prompt: bool) -> None:
    expected = transformers_render(FEATURE_TEMPLATE, messages, add_generation_prompt)
    assert expected.startswith(BOS + "[no tools]") and "turns=" in expected
    assert render_chat(FEATURE_TEMPLATE, messages, add_generation_prompt, bos_token=BOS, eos_token=EOS) == expected


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}{{ m.content }", "chat template error"),
        ("{{ messages | no_such_filter }}", "No filter named 'no_such_filter'"),
        (FEATURE_TEMPLATE, "bad role tool"),
        ("{{ messages[0].content + 1 }}", "chat template error"),
        ("{{ messages.__class__.__init__.__globals__ }}", "chat template error"),
        ("{% set ns = namespace() %}{% set ns.__class__ = 1 %}", "underscore name"),
        ("{{ (messages | length) / 0 }}", "division by zero"),
    ],
)
def test_template_errors_are_value_errors(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render_chat(template, [{"role": "tool", "content": "x"}])


TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"


@functools.cache
def family_template(name: str) -> str:
    return (TEMPLATES / name).read_text()


# template file: (bos_token, eos_token) of the model's tokenizer; Qwen's has no BOS.
FAMILIES = {
    "qwen2.5-instruct.jinja": (None, "<|im_end|>"),
    "qwen3.jinja": (None, "<|im_end|>"),
    "mistral-7b-instruct-v0.3.jinja": ("<s>", "</s>"),
    "gemma-2-it.jinja": ("<bos>", "<eos>"),
    "gemma-3-it.jinja": ("<bos>", "<eos>"),
    "phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>"),
    "phi-4.jinja": ("<|endoftext|>", "<|im_end|>"),
    "olmo-2-instruct.jinja": ("<|endoftext|>", "<|endoftext|>"),
    "qwen3.5.jinja": (None, "<|im_end|>"),
    "lfm2.5-instruct.jinja": ("<|startoftext|>", "<|im_end|>"),
    "granite-4.0.jinja": ("<|end_of_text|>", "<|end_of_text|>"),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time, as \"HH:MM\"",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """An assistant's tool call in OpenAI's shape (ids of 9 characters, which Mistral's template demands)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


FAMILY_CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hi"}],
    "system": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}],
    "turns": [
        {"role": "system", "content": "You translate.\nKeep   spacing."},
        {"role": "user", "content": "  leading spaces\n\nand blank lines  "},
        {"role": "assistant", "content": " Espacios. "},
        {"role": "user", "content": "Another one, in 日本語 😀"},
    ],
    "system only": [{"role": "system", "content": "Be terse."}],
    "call and result": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("abc123def", "get_weather", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "abc123def", "content": "21 C"},
        {"role": "assistant", "content": "It is 21 C in Paris."},
        {"role": "user", "content": "Thanks"},
    ],
    # OpenAI's arguments are JSON text; calls with content; results in a row, the last message
    "parallel calls, arguments as text": [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            call("abc123def", "get_weather", '{"city": "Paris"}'), call("ghi456jkl", "get_time", '{"city": "Paris"}'),
        ]},
        {"role": "tool", "tool_call_id": "abc123def", "content": '{"celsius": 21}'},
        {"role": "tool", "tool_call_id": "ghi456jkl", "content": "14:05"},
    ],
    # the shape Qwen's templates read too: {"name", "arguments"} without "function"
    "calls in the template's shape": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]},
        {"role": "tool", "content": "3 C"},
    ],
    # OpenAI's ids, which Mistral's template refuses
    "openai call ids": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "tool_calls": [call("call_0123456789abcdef01234567", "get_weather", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "25 C"},
    ],
    "reasoning in the content": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"},
    ],
    # under each name clients send it: the template reads reasoning_content
    "reasoning as a field": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning": "Add again."},
    ],
}

TEMPLATE_KWARGS = [
    {},
    {"tools": [WEATHER, TIME]},
    {"enable_thinking": False},
    {"enable_thinking": True, "tools": [WEATHER]},
]


@pytest.mark.parametrize("conversation", FAMILY_CONVERSATIONS)
@pytest.mark.parametrize("template_name", FAMILIES)
def test_family_templates_render_as_transformers(template_name: str, conversation: str) -> None:
    """Same text, or the same refusal (Gemma 2's system role, Gemma's alternation, Mistral's ids)."""
    template, (bos_token, eos_token) = family_template(template_name), FAMILIES[template_name]
    messages = FAMILY_CONVERSATIONS[conversation]
    for add_generation_prompt, extra in itertools.product([True, False], TEMPLATE_KWARGS):
        try:
            expected = transformers_render(template, messages, add_generation_prompt, bos_token, eos_token, **extra)
        except Exception as refusal:  # noqa: BLE001 - the template rejects the messages
            with pytest.raises(ValueError) as raised:
                render_chat(template, messages, add_generation_prompt, bos_token or "", eos_token or "", **extra)
            assert str(refusal) in str(raised.value), (add_generation_prompt, extra)
            continue
        actual = render_chat(template, messages, add_generation_prompt, bos_token or "", eos_token or "", **extra)
        assert actual == expected, (add_generation_prompt, extra)


def render_family(
    template_name: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
) -> str:
    bos_token, eos_token = FAMILIES[template_name]
    return render_chat(
        family_template(template_name), messages, add_generation_prompt, bos_token or "", eos_token or "", **extra
    )


@pytest.mark.parametrize(
    ("template_name", "prompt"),
    [
        ("qwen2.5-instruct.jinja",
         "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
        ("qwen3.jinja",
         "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
        ("mistral-7b-instruct-v0.3.jinja", "<s>[INST] Be terse.\n\nWhat is 2+2?[/INST]"),
        ("gemma-3-it.jinja",
         "<bos><start_of_turn>user\nBe terse.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"),
        ("phi-3.5-mini-instruct.jinja", "<|system|>\nBe terse.<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n"),
        ("phi-4.jinja",
         ("<|im_start|>system<|im_sep|>Be terse.<|im_end|><|im_start|>user<|im_sep|>What is 2+2?<|im_end|>"
         "<|im_start|>assistant<|im_sep|>")),
        ("olmo-2-instruct.jinja", "<|endoftext|><|system|>\nBe terse.\n<|user|>\nWhat is 2+2?\n<|assistant|>\n"),
    ],
)
def test_each_family_writes_a_system_prompt_its_own_way(template_name: str, prompt: str) -> None:
    assert render_family(template_name, FAMILY_CONVERSATIONS["system"]) == prompt


def test_gemma_2_refuses_a_system_message_with_its_own_words() -> None:
    with pytest.raises(ValueError, match="System role not supported"):
        render_family("gemma-2-it.jinja", FAMILY_CONVERSATIONS["system"])
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        render_family("gemma-2-it.jinja", FAMILY_CONVERSATIONS["call and result"][1:])
    turns = render_family("gemma-2-it.jinja", FAMILY_CONVERSATIONS["turns"][1:], add_generation_prompt=False)
    assert turns == (
        "<bos><start_of_turn>user\nleading spaces\n\nand blank lines<end_of_turn>\n"
        "<start_of_turn>model\nEspacios.<end_of_turn>\n"
        "<start_of_turn>user\nAnother one, in 日本語 😀<end_of_turn>\n"
    )


@pytest.mark.parametrize("template_name", ["qwen2.5-instruct.jinja", "qwen3.jinja"])
def test_qwen_renders_tools_calls_and_results_in_hermes_blocks(template_name: str) -> None:
    prompt = render_family(template_name, FAMILY_CONVERSATIONS["parallel calls, arguments as text"], tools=[WEATHER])
    assert "# Tools" in prompt and f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' in prompt
    results = '<tool_response>\n{"celsius": 21}\n</tool_response>\n<tool_response>\n14:05\n</tool_response>'
    assert f"<|im_start|>user\n{results}<|im_end|>\n" in prompt  # one user turn holds the results in a row
    assert prompt.endswith("<|im_start|>assistant\n")


def test_qwen3_thinks_unless_told_not_to_and_keeps_the_last_turn_s_reasoning() -> None:
    messages = FAMILY_CONVERSATIONS["system"]
    assert render_family("qwen3.jinja", messages).endswith("<|im_start|>assistant\n")
    assert render_family("qwen3.jinja", messages, enable_thinking=True).endswith("<|im_start|>assistant\n")
    no_thinking = render_family("qwen3.jinja", messages, enable_thinking=False)
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    prompt = render_family("qwen3.jinja", FAMILY_CONVERSATIONS["reasoning as a field"], add_generation_prompt=False)
    assert "<|im_start|>assistant\n4<|im_end|>" in prompt  # an earlier turn's reasoning is dropped
    assert prompt.endswith("<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n")  # "reasoning" read


def test_mistral_renders_tools_calls_and_results_in_its_brackets() -> None:
    prompt = render_family("mistral-7b-instruct-v0.3.jinja", FAMILY_CONVERSATIONS["call and result"], tools=[WEATHER])
    assert prompt == (
        "<s>[INST] Weather in Paris?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123def"}]</s>'
        '[TOOL_RESULTS] {"content": 21 C, "call_id": "abc123def"}[/TOOL_RESULTS]'
        " It is 21 C in Paris.</s>"
        '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", '
        '"description": "Current weather of a city", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}, "required": ["city"]}}}][/AVAILABLE_TOOLS]'
        "[INST] Use the tools.\n\nThanks[/INST]"
    )
    with pytest.raises(ValueError, match="Tool call IDs should be alphanumeric strings with length 9!"):
        render_family("mistral-7b-instruct-v0.3.jinja", FAMILY_CONVERSATIONS["openai call ids"])
