"""Tool calls in the model's own chat format: read per family, replies rendered
by the template, and the prompt's tools and thinking switch."""

import copy

import pytest

from chat_templates import LLAMA, QWEN
from colonnade.envs import load_environment
from colonnade.envs.toolcalls import (
    ToolCall,
    between_turns,
    family_of,
    parse_calls,
    render,
    tool_messages,
)
from colonnade.protocol.turns import chat_reply, task_prompt


@pytest.fixture
def qwen_tok(tiny):
    tok = copy.deepcopy(tiny[1])
    tok.chat_template = QWEN
    return tok


def test_hermes_calls_are_read_one_or_a_list_with_string_arguments():
    text = (
        'thinking <tool_call>\n{"name": "price", "arguments": {"item": "fig"}}\n</tool_call>'
        '<tool_call>[{"name": "a", "arguments": "{\\"x\\": 1}"}, {"name": "b"}]</tool_call>'
    )
    calls = parse_calls(text, "hermes")
    assert calls == [ToolCall("price", {"item": "fig"}), ToolCall("a", {"x": 1}), ToolCall("b")]
    assert parse_calls("The price is 12.", "hermes") == []


def test_hermes_calls_that_cannot_be_read_say_why():
    bad = parse_calls("<tool_call>{name: price}</tool_call><tool_call>[3]</tool_call>", "hermes")
    assert [c.name for c in bad] == ["", ""]
    assert "not JSON" in bad[0].error and '"name"' in bad[1].error
    # A call cut by the turn's token limit is read as far as it goes.
    assert parse_calls('<tool_call>{"name": "price", "argu', "hermes")[0].error


def test_llama_calls_are_the_turn_itself_one_or_several():
    one = '<|python_tag|>{"name": "price", "parameters": {"item": "fig"}}'
    assert parse_calls(one, "llama") == [ToolCall("price", {"item": "fig"})]
    two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}'
    assert parse_calls(two, "llama") == [ToolCall("a"), ToolCall("b", {"y": 2})]
    assert parse_calls("It costs 12 coins.", "llama") == []
    assert parse_calls('{"name": "a"} trailing', "llama")[1].error
    with pytest.raises(ValueError, match="family"):
        parse_calls("x", "mistral")


def test_family_is_told_from_the_template(qwen_tok):
    class Llama:
        chat_template = LLAMA

    assert family_of(qwen_tok) == "hermes" and family_of(Llama()) == "llama"


def test_a_template_with_tools_shows_them_and_honours_the_thinking_switch(qwen_tok):
    env = load_environment("chattools", n_tasks=10)
    msgs = env.prompt(env.tasks("train")[0])
    text = render(qwen_tok, msgs, env.tools, thinking=False)
    assert '"name": "price"' in text and text.endswith("<think>\n\n</think>\n\n")
    assert not render(qwen_tok, msgs, env.tools, thinking=True).endswith("</think>\n\n")
    assert not render(qwen_tok, msgs, env.tools).endswith("</think>\n\n")  # the default
    ids = task_prompt(qwen_tok, env, env.tasks("train")[0])
    assert qwen_tok.decode(ids) == text  # env.thinking is False by default
    thinks = load_environment("chattools", n_tasks=10, thinking=True)  # --env-arg thinking=true
    ids = task_prompt(qwen_tok, thinks, thinks.tasks("train")[0])
    assert not qwen_tok.decode(ids).endswith("</think>\n\n")


def test_a_template_without_tools_gets_them_in_a_system_block(tiny):
    tok = tiny[1]  # plain ChatML: it ignores tools=
    env = load_environment("chattools", n_tasks=10)
    text = render(tok, env.prompt(env.tasks("train")[0]), env.tools)
    assert text.count("<|im_start|>system") == 1 and "<tools>" in text and "price" in text


def test_the_text_between_turns_is_the_templates_end_of_turn_replies_and_next_turn(qwen_tok):
    msgs = [{"role": "user", "content": "q"}]
    calls = [ToolCall("price", {"item": "fig"}), ToolCall("price", {"item": "kiwi"})]
    text = between_turns(qwen_tok, msgs, tool_messages(calls, ["12", "7"]), thinking=False)
    assert text == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n12\n</tool_response>\n"
        "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\n"
    )

    class Llama:
        chat_template = LLAMA

        def apply_chat_template(self, *a, **k):
            return qwen_tok.apply_chat_template(*a, chat_template=LLAMA, **k)

    text = between_turns(Llama(), msgs, tool_messages(calls[:1], ["12"]))
    assert text == (
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n12<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chat_reply_answers_calls_and_ends_on_an_answer_or_the_last_turn(qwen_tok):
    env = load_environment("chattools", n_tasks=10, max_turns=2)
    task = env.tasks("train")[0]
    item, price = task.info["item"], task.answers[0]
    call = f'<tool_call>{{"name": "price", "arguments": {{"item": "{item}"}}}}</tool_call>'
    reply = chat_reply(qwen_tok, env, task, [call])
    assert f"<tool_response>\n{price}\n</tool_response>" in reply
    assert chat_reply(qwen_tok, env, task, [price]) is None  # an answer: over
    assert chat_reply(qwen_tok, env, task, [call, call]) is None  # max_turns used
    wrong = '<tool_call>{"name": "cost", "arguments": {}}</tool_call>'
    assert "no tool named 'cost'" in chat_reply(qwen_tok, env, task, [wrong])
    assert env.score(task, [call, f"<think>x</think>{price}"]).metrics == {
        "correct": 1.0,
        "called": 1.0,
    }
    assert env.score(task, ["1000"]).reward == 0.0
