"""The tool library: TRL-style tool functions and environments run unchanged through Toolbox, find_tool_calls and
run_tool_calls; every failure is a tool message and a count; the appended span of tool messages is the chat
template's own rendering, checked on the tiny model's tokenizer and on a Qwen-style template."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from covey.models import default
from covey.models.tiny import tiny_tokenizer as build_tiny_tokenizer
from covey.rollout.tools import (
    Toolbox,
    ToolCall,
    ToolError,
    ToolStats,
    add_tool_system_prompt,
    append_to_last_user,
    chat_template_supports_tools,
    find_tool_calls,
    run_tool_calls,
    start_episode,
    tool_call_format,
    tool_messages_ids,
    tool_system_prompt,
)
from covey.tasks.tools import calculator

# --------------------------------------------------------------------------- tools as TRL users write them


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The name of the city.

    Returns:
        A short description of the weather.
    """
    return f"Sunny, 22 degrees in {city}."


async def get_population(city: str, year: int = 2020) -> int:
    """Look up how many people live in a city.

    Args:
        city: The name of the city.
        year: The census year.
    """
    await asyncio.sleep(0.01)
    return {"Paris": 2_100_000}.get(city, 0)


class CounterEnv:
    """An environment as TRL's environment_factory takes one: built with no arguments, reset with the row."""

    def __init__(self):
        self.count = 0
        self.target = 0

    def reset(self, **kwargs) -> str:
        self.count = 0
        self.target = kwargs["target"]
        return f" Count up to {self.target}."

    def increment(self, step: int) -> int:
        """Add a step to the counter.

        Args:
            step: How much to add.

        Returns:
            The counter after the step.
        """
        self.count += step
        return self.count

    def double(self) -> int:
        """Double the counter."""
        self.count *= 2
        return self.count

    def get_reward(self) -> float:
        return 1.0 if self.count == self.target else 0.0

    def _check(self) -> bool:
        return self.count >= 0

    @property
    def remaining(self) -> int:
        return self.target - self.count


def call_text(*calls: tuple[str, dict]) -> str:
    return "Let me check. " + "\n".join(
        f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)


def error_of(message: dict) -> str:
    return json.loads(message["content"])["error"]


def test_trl_style_functions_run_unchanged():
    box = Toolbox([get_weather, get_population, calculator])
    assert box.names == ["get_weather", "get_population", "calculator"]
    params = box.schemas[1]["function"]["parameters"]
    assert params["properties"]["year"]["type"] == "integer" and params["required"] == ["city"]
    text = call_text(("get_weather", {"city": "Paris"}), ("get_population", {"city": "Paris"}),
                     ("calculator", {"expression": "3 * 12 - 7"}))
    out = run_tool_calls(box, find_tool_calls(text, "tags"), timeout_s=5)
    assert out == [{"role": "tool", "name": "get_weather", "content": "Sunny, 22 degrees in Paris."},
                   {"role": "tool", "name": "get_population", "content": "2100000"},  # async, awaited; int as JSON
                   {"role": "tool", "name": "calculator", "content": "29"}]
    assert box.stats.as_dict() == {"calls": 3, "errors": 0, "timeouts": 0, "truncated": 0}


def test_environment_as_trl_environment_factory():
    box, text = start_episode(CounterEnv, {"prompt": [{"role": "user", "content": "Count."}], "target": 6})
    assert box.names == ["increment", "double"]  # not reset, get_reward, _check nor the property
    assert text == " Count up to 6."
    prompt = append_to_last_user([{"role": "system", "content": "S"}, {"role": "user", "content": "Count."}], text)
    assert prompt[-1]["content"] == "Count. Count up to 6." and prompt[0]["content"] == "S"
    assert box.reward() == 0.0
    # an environment's calls share its state: in the order written, (0 + 1) * 2 + 4 = 6, never (0 * 2 + 1) + 4
    calls = find_tool_calls(call_text(("increment", {"step": 1}), ("double", {}), ("increment", {"step": 4})))
    out = run_tool_calls(box, calls, timeout_s=5)
    assert [m["content"] for m in out] == ["1", "2", "6"]
    assert box.reward() == 1.0


def test_one_environment_per_episode():
    first, _ = start_episode(CounterEnv, {"target": 1})
    second, _ = start_episode(CounterEnv, {"target": 2})
    run_tool_calls(first, [ToolCall("increment", {"step": 1})], timeout_s=5)
    assert first.environment is not second.environment
    assert (first.environment.count, second.environment.count) == (1, 0)


def test_a_reset_without_kwargs_is_one_line_naming_the_environment():
    class Strict:
        def reset(self, target: int) -> None:
            pass

    with pytest.raises(ToolError, match=r"environment Strict: raised TypeError: .*give it \*\*kwargs"):
        start_episode(Strict, {"target": 1, "prompt": []})


def test_a_function_without_a_docstring_is_one_line_naming_it():
    def lookup(city):
        return city

    with pytest.raises(ToolError, match=r"^tool lookup: .*docstring.*Args: line per parameter"):
        Toolbox([lookup])


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ToolError, match="two tools are named 'get_weather'"):
        Toolbox([get_weather, get_weather])


# --------------------------------------------------------------------------- running: the failure outcomes


def test_a_hung_tool_does_not_hold_the_others():
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "late"

    box = Toolbox([slow, get_weather])
    start = time.perf_counter()
    out = run_tool_calls(box, [ToolCall("slow", {"seconds": 5}), ToolCall("get_weather", {"city": "Oslo"})], 0.5)
    assert time.perf_counter() - start < 1.5
    assert error_of(out[0]) == "slow did not return within 0.5 s"
    assert out[1]["content"] == "Sunny, 22 degrees in Oslo."
    assert box.stats.as_dict() == {"calls": 2, "errors": 1, "timeouts": 1, "truncated": 0}


def test_an_environment_call_after_one_that_timed_out_is_not_run():
    class SlowEnv(CounterEnv):
        def wait(self, seconds: float) -> str:
            """Sleep.

            Args:
                seconds: How long.
            """
            time.sleep(seconds)
            return "done"

    box, _ = start_episode(SlowEnv, {"target": 1})
    out = run_tool_calls(box, [ToolCall("wait", {"seconds": 3}), ToolCall("increment", {"step": 1})], 0.3)
    assert "did not return within 0.3 s" in error_of(out[0])
    assert error_of(out[1]).startswith("not run: the environment is still running wait")
    assert box.environment.count == 0 and box.stats.timeouts == 1 and box.stats.errors == 2


def test_each_failure_is_a_tool_message_and_a_count():
    def broken(x: int) -> str:
        """Fail.

        Args:
            x: Anything.
        """
        raise KeyError(x)

    def leaves(code: int) -> str:
        """Exit.

        Args:
            code: The exit code.
        """
        raise SystemExit(code)

    box = Toolbox([broken, leaves, get_weather])
    calls = [ToolCall("broken", {"x": 1}), ToolCall("leaves", {"code": 3}), ToolCall("search", {"q": "x"}),
             ToolCall("get_weather", {}), ToolCall("get_weather", {"city": "Oslo", "town": "Oslo"}),
             *find_tool_calls("<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"),
             *find_tool_calls('<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>')]
    out = run_tool_calls(box, calls, timeout_s=5)
    errors = [error_of(m) for m in out]
    assert errors[0] == "broken raised KeyError: 1"
    assert errors[1] == "leaves called sys.exit(3)"
    assert errors[2] == "unknown tool 'search'; the tools are: broken, leaves, get_weather"
    assert errors[3].startswith("bad arguments for get_weather: missing a required argument: 'city'")
    assert errors[4].startswith("bad arguments for get_weather: got an unexpected keyword argument 'town'")
    assert errors[5].startswith("the tool call is not valid JSON")
    assert errors[6].startswith('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    assert errors[7] == "the arguments of get_weather must be a JSON object, not [1]"
    assert [m["name"] for m in out][:5] == ["broken", "leaves", "search", "get_weather", "get_weather"]
    assert box.stats.as_dict() == {"calls": 8, "errors": 8, "timeouts": 0, "truncated": 0}


def test_results_become_text_and_huge_ones_are_cut():
    def fetch(kind: str) -> object:
        """Return something.

        Args:
            kind: Which thing.
        """
        return {"dict": {"a": 1, "b": [1, 2]}, "list": [1, "x"], "float": 2.5, "none": None,
                "set": {3}, "huge": "x" * 10_000}[kind]

    box = Toolbox([fetch])
    kinds = ["dict", "list", "float", "none", "set", "huge"]
    out = run_tool_calls(box, [ToolCall("fetch", {"kind": k}) for k in kinds], timeout_s=5, max_chars=100)
    assert [m["content"] for m in out[:5]] == ['{"a": 1, "b": [1, 2]}', '[1, "x"]', "2.5", "None", "{3}"]
    assert out[5]["content"] == "x" * 100 + "\n[truncated: the tool returned 10000 characters; the first 100 are shown]"
    assert box.stats.as_dict() == {"calls": 6, "errors": 0, "timeouts": 0, "truncated": 1}


def test_calls_past_the_turn_limit_are_not_run_and_stats_can_go_elsewhere():
    stats = ToolStats()
    out = run_tool_calls(Toolbox([get_weather]), [ToolCall("get_weather", {"city": "A"})] * 3, 5, max_calls=2,
                         stats=stats)
    assert [m["content"] for m in out[:2]] == ["Sunny, 22 degrees in A."] * 2
    assert error_of(out[2]) == "more than 2 tool calls in one turn; this one was not run"
    assert stats.as_dict() == {"calls": 3, "errors": 1, "timeouts": 0, "truncated": 0}


def test_the_timeout_must_be_positive():
    with pytest.raises(ToolError, match="positive number of seconds"):
        run_tool_calls(Toolbox([get_weather]), [], 0)


# --------------------------------------------------------------------------- tool-call formats


def test_find_tool_calls_in_the_qwen_format():
    text = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2 + 2\\"}"}\n</tool_call>'
            '<|im_end|>')  # the second call's arguments as a JSON string, as some models write them
    assert find_tool_calls(text, "qwen") == [ToolCall("get_weather", {"city": "Paris"}),
                                             ToolCall("calculator", {"expression": "2 + 2"})]
    assert find_tool_calls("The answer is 4.", "qwen") == []
    with pytest.raises(ToolError, match="unknown tool-call format 'json'"):
        find_tool_calls(text, "json")


@pytest.mark.parametrize("text, count", [
    ('a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>\n{"name": "g"}\n</tool_call> b', 2),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', 1),  # cut off at the token limit: the call is still read
    ("<tool_call>{oops}</tool_call> <tool_call></tool_call>", 2), ("no calls", 0), ("", 0),
])
def test_without_transformers_response_parsing_the_tags_read_the_same(text, count, monkeypatch):
    import covey.rollout.tools as tools

    with_transformers = find_tool_calls(text, "tags")
    monkeypatch.setattr(tools, "parse_response", None)  # as on a transformers older than 5.13
    assert find_tool_calls(text, "tags") == with_transformers and len(with_transformers) == count


def test_find_tool_calls_with_a_response_template():
    template = {"start_anchor": "<|im_start|>assistant\n", "fields": {
        "tool_calls": {"open": "[CALL]", "close": "[/CALL]", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close": "<|im_end|>", "content": "text"}}}
    text = 'ok [CALL]{"name": "get_weather", "arguments": {"city": "Rome"}}[/CALL]<|im_end|>'
    assert find_tool_calls(text, template) == [ToolCall("get_weather", {"city": "Rome"})]
    broken = find_tool_calls("[CALL]{oops[/CALL]", template)
    assert len(broken) == 1 and broken[0].error.startswith("could not read the tool calls")


def test_the_tags_system_prompt_teaches_the_format():
    schemas = Toolbox([calculator, get_weather]).schemas
    prompt = tool_system_prompt(schemas)
    example = prompt.splitlines()[-2]
    assert find_tool_calls(example) == [ToolCall("calculator", {"expression": "..."})]
    assert '"name": "get_weather"' in prompt and "The name of the city." in prompt
    messages = add_tool_system_prompt([{"role": "user", "content": "Hi"}], schemas)
    assert messages[0] == {"role": "system", "content": prompt} and messages[1]["content"] == "Hi"
    with_system = add_tool_system_prompt([{"role": "system", "content": "Be brief."}], schemas)
    assert with_system[0]["content"] == "Be brief.\n\n" + prompt


# --------------------------------------------------------------------------- rendering the appended span

# A Qwen-style template, written for these tests: tools listed in the system turn, calls written as
# <tool_call>{json}</tool_call>, consecutive tool results grouped in one user turn as <tool_response> blocks.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{- 'You can call these tools:\\n<tools>\\n' }}{% for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}"
    "{{- '</tools>\\nCall one by writing <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson"
    " + '\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- elif message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def qwen_style():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    return tokenizer


def sampled_turn(tokenizer, messages, schemas, reply):
    """The prompt ids and the ids a model would sample for `reply`, ending with EOS as the engines stop."""
    prompt = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return prompt_ids, tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


@pytest.mark.parametrize("which, expected_span", [
    ("tiny", "\n<|im_start|>tool\n29<|im_end|>\n<|im_start|>tool\nSunny, 22 degrees in Paris.<|im_end|>\n"
             "<|im_start|>assistant\n"),
    ("qwen_style", "\n<|im_start|>user\n<tool_response>\n29\n</tool_response>\n<tool_response>\n"
                   "Sunny, 22 degrees in Paris.\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
])
def test_the_appended_span_is_the_templates_rendering(which, expected_span, request):
    tokenizer = request.getfixturevalue(which)
    box = Toolbox([calculator, get_weather])
    messages = [{"role": "user", "content": "What is 3 * 12 - 7, and the weather in Paris?"}]
    reply = call_text(("calculator", {"expression": "3 * 12 - 7"}), ("get_weather", {"city": "Paris"}))
    prompt_ids, sampled = sampled_turn(tokenizer, messages, box.schemas, reply)
    tool_messages = run_tool_calls(box, find_tool_calls(tokenizer.decode(sampled), "qwen"), timeout_s=5)
    conversation = messages + [{"role": "assistant", "content": reply}] + tool_messages
    span = tool_messages_ids(tokenizer, conversation, box.schemas)
    assert tokenizer.decode(span) == expected_span
    # the sampled ids are kept as they are; with the span they are the template's whole conversation
    whole = tokenizer.apply_chat_template(conversation, tools=box.schemas, tokenize=False, add_generation_prompt=True)
    assert prompt_ids + sampled + span == tokenizer(whole, add_special_tokens=False)["input_ids"]


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if loop.last %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                               "<|im_end|>\n{% else %}[{{ m.role }}]{% endif %}{% endfor %}")
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"},
                    {"role": "tool", "content": "1"}]
    with pytest.raises(ToolError, match="renders earlier turns differently"):
        tool_messages_ids(tokenizer, conversation)
    with pytest.raises(ToolError, match="needs the assistant turn"):
        tool_messages_ids(tiny, conversation[:1])


def test_template_support_and_call_format(tiny, qwen_style):
    assert not chat_template_supports_tools(tiny) and tool_call_format(tiny) == "tags"
    assert chat_template_supports_tools(qwen_style) and tool_call_format(qwen_style) == "qwen"
    other = build_tiny_tokenizer()
    other.chat_template = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.role }}: "
                           "{{ m.content }}{{ m.tool_calls | tojson if m.tool_calls }}\n{% endfor %}")
    assert chat_template_supports_tools(other)
    with pytest.raises(ToolError, match="format covey does not read"):
        tool_call_format(other)
    other.response_template = {"start_anchor": "assistant: ", "fields": {
        "tool_calls": {"open": "[", "close": "]", "content": "json", "repeats": True}}}
    assert tool_call_format(other) is other.response_template


@pytest.mark.slow
def test_the_default_model_is_taught_the_tags_format():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default.prepare_default_model())
    assert tool_call_format(tokenizer) == "tags"  # SmolLM2-135M-Instruct's template has no tools
    box = Toolbox([calculator])
    messages = add_tool_system_prompt([{"role": "user", "content": "What is 3 * 12 - 7?"}], box.schemas)
    reply = call_text(("calculator", {"expression": "3 * 12 - 7"}))
    prompt_ids, sampled = sampled_turn(tokenizer, messages, None, reply)
    conversation = messages + [{"role": "assistant", "content": reply}]
    conversation += run_tool_calls(box, find_tool_calls(reply), timeout_s=5)
    span = tool_messages_ids(tokenizer, conversation)
    assert tokenizer.decode(span) == "\n<|im_start|>tool\n29<|im_end|>\n<|im_start|>assistant\n"
    whole = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert prompt_ids + sampled + span == tokenizer(whole, add_special_tokens=False)["input_ids"]
