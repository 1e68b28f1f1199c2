"""Tools (m2flow/tools, docs/tools.md): schemas from typed functions, stateful class tools,
tool calls parsed out of a turn (good and malformed) and results rendered back, a turn's calls
run in parallel under timeouts with every failure an error observation of a counted kind, the
cut to the response limit, the calculator and BM25 search. The python sandbox: test_sandbox.py.
Fast: no Ray, no model."""

import gzip
import json
import time

import pytest

from m2flow.tools import Toolbox, ToolCall, ToolResult, error_counts, function_tool, load, parse_calls
from m2flow.tools import base
from m2flow.tools.calculator import MATH_ERROR, REFUSED, calculator
from m2flow.tools.calls import render_hermes, render_results, tool_messages, tools_prompt
from m2flow.tools.cut import CHARS_PER_TOKEN, cut


def weather(city: str, days: int = 1, unit: str = "celsius", hourly: bool | None = None) -> str:
    """Get the weather forecast for a city.

    Args:
        city: The city's name, e.g. "Paris".
        days: How many days ahead.
        unit: The temperature unit.
        hourly: Whether to give each hour.
    """
    return f"{city}: sunny for {days} days ({unit})"


def sleepy(seconds: float) -> str:
    """Sleep a while.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise KeyError("the tool broke")


class Counter:
    """A stateful tool: its count lives as long as a trajectory."""

    def __init__(self, start: int = 0):
        self.start = self.count = start

    def reset(self) -> None:
        self.count = self.start

    def call(self, step: int) -> str:
        """Add to the counter and return its value.

        Args:
            step: How much to add.
        """
        before = self.count
        time.sleep(0.05)  # calls that overlapped would lose an update
        self.count = before + step
        return str(self.count)


@pytest.fixture
def toolbox():
    return Toolbox([function_tool(weather), function_tool(sleepy), function_tool(broken),
                    load(f"{__name__}:Counter", start=10)])


def call(name, **arguments):
    return ToolCall(f"call_{name}", name, arguments)


# -- what a tool is -----------------------------------------------------------------------
def test_schema_of_a_typed_function_is_the_openai_format():
    assert function_tool(weather).schema == {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Get the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": 'The city\'s name, e.g. "Paris".'},
                    "days": {"type": "integer", "description": "How many days ahead."},
                    "unit": {"type": "string", "description": "The temperature unit."},
                    "hourly": {"type": "boolean", "nullable": True, "description": "Whether to give each hour."},
                },
                "required": ["city"],
            },
        },
    }


def test_a_stateful_class_tool_has_one_object_per_trajectory():
    tool = load(f"{__name__}:Counter", start=10)
    assert tool.name == "counter" and tool.stateful
    assert tool.schema["function"]["parameters"]["required"] == ["step"]
    assert tool.call({"step": 2}) == "12" and tool.call({"step": 3}) == "15"
    other = tool.copy()  # another trajectory's: a fresh object, its own state
    assert other.call({"step": 1}) == "11" and tool.call({"step": 0}) == "15"
    tool.reset()
    assert tool.call({"step": 0}) == "10"
    # a function is shared between trajectories, and reset does nothing to it
    fn = load(f"{__name__}:weather")
    assert fn.copy() is fn and not fn.stateful
    fn.reset()


def test_load_finds_builtins_and_refuses_what_is_not_a_tool():
    assert load("calculator").name == "calculator"
    assert load("m2flow.tools.calculator.calculator").call({"expression": "1 + 1"}) == "2"
    for bad in ("no_such_module_anywhere:x", f"{__name__}:nothing_here", "calculator_without_module"):
        with pytest.raises(ValueError, match="tool"):
            load(bad)
    with pytest.raises(ValueError, match="takes no options"):
        load("calculator", k=3)


def test_toolbox_from_config_and_its_schemas(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"title": "Paris", "text": "Paris is the capital of France."}) + "\n")
    box = Toolbox.load(["calculator", {"path": "search", "corpus": str(corpus), "k": 1},
                        f"{__name__}:weather"])
    assert [s["function"]["name"] for s in box.schemas] == ["calculator", "search", "weather"]
    assert all(s["type"] == "function" and "parameters" in s["function"] for s in box.schemas)
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        Toolbox([load("calculator"), load("calculator")])


# -- calls as text --------------------------------------------------------------------------
def test_parse_good_calls_in_order():
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "sleepy", "arguments": "{\\"seconds\\": 0}"}</tool_call>')
    assert parse_calls(text) == [ToolCall("call_0", "weather", {"city": "Paris", "days": 2}),
                                 ToolCall("call_1", "sleepy", {"seconds": 0})]
    assert parse_calls("No call here, just </tool_call> text.") == []


@pytest.mark.parametrize("text, says", [
    ('<tool_call>{"name": "weather", "arguments": {"city": "Paris"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}', "without its </tool_call>"),
    ('<tool_call>{"arguments": {"city": "Paris"}}</tool_call>', 'needs a "name"'),
    ('<tool_call>["weather"]</tool_call>', "is a JSON object"),
    ('<tool_call>{"name": "weather", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "weather", "arguments": "{oops"}</tool_call>', "arguments are not valid JSON"),
])
def test_a_malformed_call_is_an_error_observation(toolbox, text, says):
    found = parse_calls(text)
    assert len(found) == 1 and isinstance(found[0], ToolResult)
    [result] = toolbox.run(found)
    assert result.error == base.MALFORMED and says in result.text and result.text.startswith("Error: ")


def test_an_unclosed_call_before_a_good_one_is_one_error_and_one_call():
    found = parse_calls('<tool_call>{"name": "weather"\n<tool_call>{"name": "weather", '
                        '"arguments": {"city": "Rome"}}</tool_call>')
    assert found[0].error == base.MALFORMED and found[1] == ToolCall("call_1", "weather", {"city": "Rome"})


@pytest.mark.parametrize("name, arguments, kind, says", [
    ("nowcast", {"city": "Paris"}, base.UNKNOWN_TOOL, "no tool named 'nowcast'"),
    ("weather", {"city": 42}, base.BAD_ARGUMENTS, "argument 'city' must be string, not 42"),
    ("weather", {"city": "Paris", "days": "2"}, base.BAD_ARGUMENTS, "argument 'days' must be integer"),
    ("weather", {"city": "Paris", "days": True}, base.BAD_ARGUMENTS, "argument 'days' must be integer"),
    ("weather", {"days": 2}, base.BAD_ARGUMENTS, "missing argument 'city'"),
    ("weather", {"city": "Paris", "country": "FR"}, base.BAD_ARGUMENTS, "unknown argument 'country'"),
])
def test_a_call_that_does_not_fit_is_an_error_observation(toolbox, name, arguments, kind, says):
    [result] = toolbox.run([call(name, **arguments)])
    assert result.error == kind and says in result.text, result


def test_a_nullable_argument_takes_null(toolbox):
    [result] = toolbox.run([call("weather", city="Oslo", hourly=None)])
    assert result.ok and result.text == "Oslo: sunny for 1 days (celsius)"


# The hermes format in a ChatML model's own response template (transformers' parse_response).
HERMES_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close": "<|im_end|>", "content": "text"},
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    from m2flow.models.lm import byte_tokenizer

    return byte_tokenizer()


def test_calls_are_read_with_the_tokenizers_response_template(tokenizer):
    tokenizer.response_template = HERMES_RESPONSE_TEMPLATE
    try:
        text = ('Checking.<tool_call>{"name": "weather", "arguments": {"city": "Lima"}}</tool_call>'
                '<tool_call>{"name": "sleepy", "arguments": {"seconds": 0}}</tool_call><|im_end|>')
        assert parse_calls(text, tokenizer, prefix="<|im_start|>assistant\n") == [
            ToolCall("call_0", "weather", {"city": "Lima"}), ToolCall("call_1", "sleepy", {"seconds": 0})]
        assert parse_calls("No call.<|im_end|>", tokenizer, prefix="") == []
    finally:
        del tokenizer.response_template


def test_results_render_through_the_chat_template_else_as_hermes(tokenizer):
    results = [ToolResult("call_0", "weather", "Lima: sunny"), ToolResult("call_1", "sleepy", "Error: late", "timeout")]
    assert tool_messages(results)[1] == {"role": "tool", "tool_call_id": "call_1", "name": "sleepy",
                                         "content": "Error: late"}
    # the ChatML template renders a tool role: its own rendering, then the next assistant prompt
    assert render_results(results, tokenizer) == ("<|im_start|>tool\nLima: sunny<|im_end|>\n"
                                                  "<|im_start|>tool\nError: late<|im_end|>\n<|im_start|>assistant\n")
    hermes = ("<|im_start|>user\n<tool_response>\nLima: sunny\n</tool_response>\n<tool_response>\nError: late\n"
              "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert render_results(results) == render_hermes(results) == hermes
    # a template that drops tool messages, or one that refuses them, gets the hermes form
    dropping = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
    refusing = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no') }}{% endif %}{% endfor %}"
    saved = tokenizer.chat_template
    try:
        for template in (dropping, refusing):
            tokenizer.chat_template = template
            assert render_results(results, tokenizer) == hermes
    finally:
        tokenizer.chat_template = saved


def test_tools_prompt_offers_the_schemas_in_the_hermes_format():
    schema = function_tool(weather).schema
    prompt = tools_prompt([schema])
    assert json.dumps(schema) in prompt and "<tool_call>" in prompt and "</tool_call>" in prompt


# -- running a turn's calls ---------------------------------------------------------------------
def test_calls_of_a_turn_run_in_parallel(toolbox):
    started = time.monotonic()
    results = toolbox.run([call("sleepy", seconds=0.3), call("sleepy", seconds=0.3)])
    took = time.monotonic() - started
    assert [r.text for r in results] == ["slept 0.3", "slept 0.3"] and all(r.ok for r in results)
    assert took < 0.55, f"two 0.3 s calls took {took:.2f} s: they did not overlap"
    assert all(0.25 < r.seconds < 0.55 for r in results)


def test_each_call_is_a_span_of_the_trace_on_its_own_thread(toolbox):
    from m2flow.runtime.trace import get_tracer

    get_tracer().drain()
    toolbox.run([call("sleepy", seconds=0.1), call("weather", city="Rome")])
    spans = [e for e in get_tracer().drain() if e.get("cat") == "tool"]
    assert sorted(e["name"] for e in spans) == ["tool sleepy", "tool weather"]
    assert len({e["tid"] for e in spans}) == 2 and max(e["dur"] for e in spans) >= 0.1e6


def test_calls_to_one_stateful_tool_run_in_order(toolbox):
    results = toolbox.run([call("counter", step=1), call("sleepy", seconds=0.1), call("counter", step=2),
                           call("counter", step=3)])
    assert [r.text for r in results] == ["11", "slept 0.1", "13", "16"]


def test_a_call_past_its_timeout_is_an_error_and_the_turn_goes_on(toolbox):
    started = time.monotonic()
    slow, fast = toolbox.run([call("sleepy", seconds=3), call("weather", city="Rome")], timeout=0.3)
    assert time.monotonic() - started < 1.0
    assert slow.error == base.TIMEOUT and "did not finish within its 0.3 s" in slow.text
    assert fast.ok and fast.text.startswith("Rome")


def test_an_exception_is_an_error_observation(toolbox):
    [result] = toolbox.run([call("broken", x=1)])
    assert result.error == base.RAISED and result.text == "Error: KeyError: 'the tool broke'"


def test_errors_are_counted_by_kind(toolbox):
    turn = parse_calls('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
                       '<tool_call>{bad json}</tool_call><tool_call>{"name": "nope"}</tool_call>'
                       '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
                       '<tool_call>{"name": "weather", "arguments": {}}</tool_call>')
    results = toolbox.run(turn, max_calls=4)
    assert [r.call_id for r in results] == [f"call_{i}" for i in range(5)]
    assert error_counts(results) == {base.MALFORMED: 1, base.UNKNOWN_TOOL: 1, base.RAISED: 1,
                                     base.TOO_MANY_CALLS: 1}
    assert results[0].ok


def test_observations_are_cut_to_the_response_limit(tokenizer):
    long = "word " * 1000
    text, was_cut = cut(long, 100)
    assert was_cut and len(text) <= 100 * CHARS_PER_TOKEN and "[cut: " in text
    text, was_cut = cut(long, 100, tokenizer)
    assert was_cut and len(tokenizer.encode(text, add_special_tokens=False)) <= 100
    assert text.startswith("word word") and text.endswith("[cut at 100 tokens]")
    assert cut("short", 100, tokenizer) == ("short", False) and cut("short", 100) == ("short", False)
    text, was_cut = cut("x" * 10_000_000, 50, tokenizer)  # megabytes are never tokenized whole
    assert was_cut and len(tokenizer.encode(text, add_special_tokens=False)) <= 50
    box = Toolbox([function_tool(weather)])
    [result] = box.run([call("weather", city="A" * 5000)], max_response_tokens=64, tokenizer=tokenizer)
    assert result.ok and result.cut and len(tokenizer.encode(result.text, add_special_tokens=False)) <= 64


# -- the calculator ---------------------------------------------------------------------------
@pytest.mark.parametrize("expression, value", [
    ("2 * (3 + 4) ** 2 / 7", "14"), ("7 // 2", "3"), ("-7 % 3", "2"), ("-(2 ** 3)", "-8"), ("+5", "5"),
    ("1 / 3", "0.333333333333333"), ("0.1 + 0.2", "0.3"), ("2 ** 100", str(2 ** 100)), ("2 ** -1", "0.5"),
    ("sqrt(16) + factorial(5)", "124"), ("round(pi, 3)", "3.142"), ("log(e)", "1"), ("max(1, 7, 3)", "7"),
    ("comb(10, 3)", "120"), ("  3*  4 ", "12"),
])
def test_calculator_computes(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, kind, says", [
    ("__import__('os').system('true')", REFUSED, "only these functions"),
    ("x + 1", REFUSED, "unknown name 'x'"),
    ("(1).real", REFUSED, "Attribute is not allowed"),
    ("math.pi", REFUSED, "Attribute is not allowed"),
    ("[1, 2][0]", REFUSED, "is not allowed"),
    ("'a' * 3", REFUSED, "not a number: 'a'"),
    ("lambda: 1", REFUSED, "Lambda is not allowed"),
    ("sqrt(x=4)", REFUSED, "plain arguments"),
    ("9 ** 9 ** 9", REFUSED, "too large"),
    ("2 ** 100000", REFUSED, "too large"),
    ("(2 ** 6000) * (2 ** 6000)", REFUSED, "too large"),
    ("factorial(100000)", REFUSED, "too large"),
    ("1 +", REFUSED, "not an expression"),
    ("(" * 300 + "1" + ")" * 300, REFUSED, "not an expression"),
    ("1" * 2000, REFUSED, "longer than"),
    ("1 / 0", MATH_ERROR, "division by zero"),
    ("log(-1)", MATH_ERROR, "math domain error"),
    ("2.0 ** 5000", MATH_ERROR, "too large"),
    ("(-8) ** 0.5", MATH_ERROR, "not a real number"),
])
def test_calculator_refuses(expression, kind, says):
    with pytest.raises(base.ToolError) as raised:
        calculator(expression)
    assert raised.value.kind == kind and says in str(raised.value), str(raised.value)


def test_calculator_never_evals(monkeypatch):
    import builtins

    def no_eval(*args, **kwargs):
        raise AssertionError("eval was called")

    monkeypatch.setattr(builtins, "eval", no_eval)
    monkeypatch.setattr(builtins, "exec", no_eval)
    assert calculator("(1 + 2) * 3") == "9"


# -- search -----------------------------------------------------------------------------------
CORPUS = [
    {"title": "Paris", "text": "Paris is the capital and largest city of France, on the Seine."},
    {"title": "Photosynthesis", "text": "Plants turn light, water and carbon dioxide into sugar and oxygen."},
    {"title": "Mount Everest", "text": "Everest is the highest mountain above sea level, in the Himalayas."},
    "The Danube flows through ten countries, from Germany to the Black Sea.",
]


def test_search_returns_the_right_passage(tmp_path):
    from m2flow.tools.search import Search

    search = Search(CORPUS, k=2)
    answer = search.call("what is the highest mountain")
    assert answer.startswith("[1] Mount Everest\nEverest is the highest mountain")
    assert "Danube" in Search(CORPUS, k=1).call("which river flows to the Black Sea")
    assert search.call("quantum chromodynamics") == "No passage matches the query."
    assert search.call("the of and") == "No passage matches the query."  # stopwords only
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
    from_file = load("search", corpus=str(path), k=1, max_chars=20)
    assert from_file.call({"query": "capital of France"}) == "[1] Paris\nParis is the capital ..."
    gzipped = tmp_path / "corpus.jsonl.gz"
    gzipped.write_bytes(gzip.compress(path.read_bytes()))
    assert load("search", corpus=str(gzipped), k=1, max_chars=20).call({"query": "capital of France"}) == \
        "[1] Paris\nParis is the capital ..."
    with pytest.raises(ValueError, match="document 0 has no 'text'"):
        Search([{"body": "x"}])
