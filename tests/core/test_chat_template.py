"""render_chat must render exactly what transformers' apply_chat_template(tokenize=False) renders."""

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
]


def transformers_render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    reference = PreTrainedTokenizerFast(
        tokenizer_object=HfTokenizer(models.BPE()), bos_token=BOS, eos_token=EOS, chat_template=template
    )
    return reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


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
    ],
)
def test_template_errors_are_value_errors(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render_chat(template, [{"role": "tool", "content": "x"}])
