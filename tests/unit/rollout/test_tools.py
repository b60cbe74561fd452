"""Tool calls: the Hermes-style parser, the calculator, failures as observations, user tools."""

import sys

import pytest

from miles.config.schema import SandboxCfg
from miles.rollout.tools import ToolBox, ToolCall, ToolError, build_toolbox, calculator, function_tool, parse_tool_calls


def test_parser_reads_every_call_and_marks_malformed_ones():
    text = ('first <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call> then '
            '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
            '<tool_call>{not json}</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": [1]}</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "2*3"}), ToolCall("f", {"x": 1})]
    assert [type(c) for c in calls[2:]] == [ToolError] * 3
    assert "not valid JSON" in str(calls[2]) and "name" in str(calls[3]) and "JSON object" in str(calls[4])
    assert parse_tool_calls("no call here") == [] and parse_tool_calls("<tool_call>unclosed") == []


@pytest.mark.parametrize("expression, value", [("123*456", "56088"), ("(2+3)**2-1", "24"), ("7/2", "3.5"),
                                               ("8/4", "2"), ("-3 % 5", "2"), ("17//5", "3")])
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "x + 1", "2**1000", "[1, 2]", "1 +", "True + 1"])
def test_calculator_rejects_everything_else(expression):
    with pytest.raises(ToolError):
        calculator(expression)


def test_failures_become_observations_and_are_flagged():
    def broken(x: int) -> str:
        raise RuntimeError("disk on fire")

    box = ToolBox([function_tool(calculator), function_tool(broken)])
    assert box.run(ToolCall("calculator", {"expression": "1+1"})) == ("2", False)
    assert box.run(ToolCall("broken", {"x": 1})) == ("error: RuntimeError: disk on fire", True)
    assert box.run(ToolCall("nope", {}))[0].startswith("error: unknown tool 'nope'")
    assert box.run(ToolCall("calculator", {"wrong": "1"}))[1]  # a bad argument name is a TypeError
    assert box.run(ToolError("tool call is not valid JSON")) == ("error: tool call is not valid JSON", True)


def test_user_tools_by_dotted_path_get_a_schema(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        "def lookup(city: str, days: int = 1) -> str:\n"
        "    '''Weather forecast for a city.\n\n    Longer text.'''\n"
        "    return f'{city}: sunny for {days} days'\n")
    monkeypatch.chdir(tmp_path)
    try:
        box = build_toolbox(["calculator", "my_tools.lookup"], SandboxCfg())
    finally:
        sys.modules.pop("my_tools", None)
    assert box.schemas()[1] == {"type": "function", "function": {
        "name": "lookup", "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}}
    assert box.run(ToolCall("lookup", {"city": "Oslo", "days": 2})) == ("Oslo: sunny for 2 days", False)
    with pytest.raises(ValueError, match="unknown tool 'abacus'"):
        build_toolbox(["abacus"], SandboxCfg())
    with pytest.raises(ValueError, match="task.tools=no_such_module.fn: cannot import it"):
        build_toolbox(["no_such_module.fn"], SandboxCfg())


def test_python_tool_runs_in_the_sandbox_and_reports_failures():
    box = build_toolbox(["python"], SandboxCfg(wall_time_s=2, cpu_time_s=1))
    assert box.run(ToolCall("python", {"code": "print(sum(range(10)))"})) == ("45\n", False)
    observation, failed = box.run(ToolCall("python", {"code": "1/0"}))
    assert failed and observation == "error: ToolError: ZeroDivisionError: division by zero"
    observation, failed = box.run(ToolCall("python", {"code": "while True: pass"}))
    assert failed and ("time limit" in observation or "exit status" in observation)  # CPU or wall limit
