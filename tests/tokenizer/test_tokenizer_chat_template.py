"""Chat templates: SmolLM2's against HF's rendering, HF's Jinja rules, and input validation."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from pagellm.errors import ChatTemplateError, InvalidRequestError
from pagellm.tokenizer import Tokenizer, render_chat_template
from pagellm.tokenizer.chat_template import compile_chat_template

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
USER_2 = {"role": "user", "content": "And of Japan? \u65e5\u672c \U0001f5fe"}

CONVERSATIONS = [
    [USER],
    [SYSTEM, USER],
    [USER, ASSISTANT, USER_2],
    [SYSTEM, USER, ASSISTANT, USER_2],
    [SYSTEM, USER, ASSISTANT],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "  spaces\n\nand newlines\n"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm_template_matches_hf(
    smollm, hf_smollm, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    ours = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == expected


def test_smollm_template_tokenized(smollm, hf_smollm) -> None:
    messages = [SYSTEM, USER, ASSISTANT, USER_2]
    text = hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = smollm.apply_chat_template(messages, tokenize=True)
    assert ids == hf_smollm.encode(text, add_special_tokens=False)
    assert ids[0] == smollm.bos_token_id  # <|im_start|> written by the template


def test_default_system_prompt_of_smollm(smollm) -> None:
    text = smollm.apply_chat_template([USER], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def _tiny_tokenizer(chat_template: str | None) -> Tokenizer:
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    backend = BackendTokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(backend, bos_token_id=0, eos_token_id=1, chat_template=chat_template)


def test_no_template_raises_chat_template_error() -> None:
    tokenizer = _tiny_tokenizer(chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template([USER])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat_template(None, [USER])


def test_template_given_at_call_time() -> None:
    tokenizer = _tiny_tokenizer(chat_template=None)
    text = tokenizer.apply_chat_template([USER], chat_template="{{ bos_token }}{{ messages[0].content }}")
    assert text == "<s>What is the capital of France?"


# Templates that exercise HF's Jinja settings; transformers' own renderer is the reference.
TRICKY_TEMPLATES = {
    "indented blocks (trim_blocks + lstrip_blocks)": (
        "{% for message in messages %}\n"
        "    {% if message.role == 'system' %}\n"
        "        <<SYS>>{{ message.content }}<</SYS>>\n"
        "    {% else %}\n"
        "        [{{ message.role }}] {{ message.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    ),
    "whitespace control": (
        "{%- for m in messages -%}\n  {{- m.role }}: {{ m.content -}}\n\n{%- endfor -%}\n"
        "{%- if add_generation_prompt %}\nassistant:{% endif %}"
    ),
    "loop controls and namespace": (
        "{% set ns = namespace(count=0) %}{% for m in messages %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.count = ns.count + 1 %}{{ ns.count }}={{ m.content }}|"
        "{% if ns.count >= 2 %}{% break %}{% endif %}{% endfor %}"
    ),
    "tojson keeps non-ascii and html": (
        "{{ messages | tojson }}\n{{ tools | tojson(indent=2) }}\n{{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=True) }}"
    ),
    "generation block": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
        "{% endgeneration %}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
    ),
    "special tokens and extra options": (
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
        "{% if documents %}{% for d in documents %}[{{ d.title }}]{% endfor %}{% endif %}"
    ),
    "message attribute and filters": (
        "{% for m in messages %}{{ m['role'] | upper }} {{ m.content | trim | length }} "
        "{{ loop.first }} {{ loop.last }}{{ '\\n' }}{% endfor %}"
    ),
}

TRICKY_MESSAGES = [
    {"role": "system", "content": "sys <b>bold</b> & \u00e9t\u00e9"},
    {"role": "user", "content": "q1 \u4e2d\u6587"},
    {"role": "assistant", "content": "a1 \U0001f600"},
    {"role": "user", "content": "  q2  "},
]
TRICKY_EXTRA: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f", "description": "\u00fcber <x>"}}],
    "documents": [{"title": "T\u00eftle", "text": "body"}],
    "enable_thinking": False,
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(TRICKY_TEMPLATES))
def test_rendering_matches_hf_renderer(name: str, add_generation_prompt: bool) -> None:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    template = TRICKY_TEMPLATES[name]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    (expected,), _ = chat_template_utils.render_jinja_template(
        [TRICKY_MESSAGES],
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        **special,
        **TRICKY_EXTRA,
    )
    ours = render_chat_template(
        template,
        TRICKY_MESSAGES,
        add_generation_prompt=add_generation_prompt,
        special_tokens=special,
        **TRICKY_EXTRA,
    )
    assert ours == expected


def test_tojson_does_not_escape() -> None:
    text = render_chat_template("{{ messages[0].content | tojson }}", [{"role": "user", "content": "<b>\u00e9</b>'&"}])
    assert text == '"<b>\u00e9</b>\'&"'


def test_strftime_now() -> None:
    text = render_chat_template("{{ strftime_now('%Y') }}", [USER])
    assert text in {str(datetime.now().year), str(datetime.now().year - 1)}


def test_raise_exception_is_a_request_error() -> None:
    template = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok"
    assert render_chat_template(template, [USER]) == "ok"
    with pytest.raises(InvalidRequestError, match="System role not supported") as info:
        render_chat_template(template, [SYSTEM, USER])
    assert info.value.parameter == "messages"


def test_syntax_error_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for m in messages %}{{ m.content }}", [USER])


def test_sandbox_blocks_python_internals() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [USER])


def test_compiled_once() -> None:
    template = "{{ messages | length }} compiled once"
    assert compile_chat_template(template) is compile_chat_template(template)


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ("hello", "must be a list"),
        ({"role": "user", "content": "hi"}, "must be a list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([USER, {"content": "no role"}], r"messages\[1\] needs a non-empty string 'role'"),
        ([{"role": "", "content": "x"}], "non-empty string 'role'"),
        ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
        ([{"role": "user", "content": 42}], "'content' must be a string, got int"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "'content' must be a string, got list"),
        ([{"role": "assistant", "content": None}], "'content' must be a string, got NoneType"),
    ],
)
def test_invalid_messages(messages: Any, problem: str) -> None:
    tokenizer = _tiny_tokenizer(chat_template="{{ messages }}")
    with pytest.raises(InvalidRequestError, match=problem) as info:
        tokenizer.apply_chat_template(messages)
    assert isinstance(info.value, ValueError)
    assert info.value.parameter == "messages"


def test_tool_call_message_may_have_no_content() -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    text = render_chat_template("{% for m in messages %}{{ m.tool_calls | length }}{% endfor %}", [USER, call])
    assert text == "01"


def test_messages_are_not_modified() -> None:
    messages = [dict(USER)]
    render_chat_template("{% for m in messages %}{% set _ = m %}{{ m.content }}{% endfor %}", messages)
    assert messages == [USER]


PREFILLS = [
    [USER, {"role": "assistant", "content": "The capital of France is"}],
    [SYSTEM, USER, {"role": "assistant", "content": "Paris.  "}],  # trailing spaces the template keeps
    [USER, ASSISTANT, USER_2, {"role": "assistant", "content": "\u65e5\u672c\u306e\u9996\u90fd\u306f"}],
]


@pytest.mark.parametrize("messages", PREFILLS)
def test_a_continued_final_message_matches_hf(smollm, hf_smollm, messages: list[dict[str, Any]]) -> None:
    ours = smollm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    expected = hf_smollm.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours == expected
    assert ours.endswith(messages[-1]["content"])  # left open: no end-of-turn after the prefill


@pytest.mark.parametrize("name", ["indented blocks (trim_blocks + lstrip_blocks)", "whitespace control"])
def test_a_continued_final_message_under_other_templates_matches_hf(name: str) -> None:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    messages = [*TRICKY_MESSAGES, {"role": "assistant", "content": "a2 \u00e9 "}]  # a trailing space the second strips
    (expected,), _ = chat_template_utils.render_jinja_template(
        [messages], chat_template=TRICKY_TEMPLATES[name], continue_final_message=True
    )
    assert render_chat_template(TRICKY_TEMPLATES[name], messages, add_generation_prompt=False, continue_final_message=True) == expected


def test_continuing_needs_text_to_continue_and_no_new_turn() -> None:
    template = TRICKY_TEMPLATES["whitespace control"]
    with pytest.raises(InvalidRequestError, match="set at most one"):
        render_chat_template(template, [USER, ASSISTANT], add_generation_prompt=True, continue_final_message=True)
    for final in ({"role": "assistant", "content": "  "}, {"role": "assistant", "content": None, "tool_calls": []}):
        with pytest.raises(InvalidRequestError, match="needs a last message with text"):
            render_chat_template(template, [USER, final], add_generation_prompt=False, continue_final_message=True)
    hidden = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(InvalidRequestError, match="does not write the last message"):
        render_chat_template(hidden, [USER, ASSISTANT], add_generation_prompt=False, continue_final_message=True)
