"""Tools a model may call in a multi-turn rollout, and the parser of its calls.

A call is written Hermes / Qwen style, one JSON object between tags:

    <tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>

`task.tools` names the tools: the built-ins `calculator` (arithmetic on numbers, evaluated from
the syntax tree, nothing else) and `python` (code run in the sandbox of `task.sandbox`, its stdout
returned), or a dotted path to a user function `fn(**arguments) -> str` whose name, docstring and
annotated parameters become its schema. A tool that raises, an unknown tool or a call that is not
valid JSON never stops the run: the model is shown the error as the observation and the failure
is counted (`rollout/tool_errors`).
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
from dataclasses import dataclass
from typing import Callable

from miles.config.schema import RunCfg, SandboxCfg
from miles.data.plugins import import_dotted

CALL_PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolError(ValueError):
    """A tool call the model got wrong (not JSON, unknown tool, bad arguments) or a tool that failed."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., str]

    def schema(self) -> dict:
        """The OpenAI / HF `tools` entry chat templates render."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_tool_calls(text: str) -> list[ToolCall | ToolError]:
    """Every <tool_call> of a model turn, in order; a malformed one is a ToolError in its place."""
    calls: list[ToolCall | ToolError] = []
    for body in CALL_PATTERN.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(ToolError(f"tool call is not valid JSON ({error.msg})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolError('tool call needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolError("tool call arguments must be a JSON object"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


class ToolBox:
    """The tools of a task, called by name; `run` turns any failure into an error observation."""

    def __init__(self, tools: list[Tool]):
        self.tools = {tool.name: tool for tool in tools}

    def schemas(self) -> list[dict]:
        return [tool.schema() for tool in self.tools.values()]

    def run(self, call: ToolCall | ToolError) -> tuple[str, bool]:
        """(observation, failed)."""
        if isinstance(call, ToolError):
            return f"error: {call}", True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(self.tools)})", True
        try:
            return str(tool.fn(**call.arguments)), False
        except Exception as error:  # a tool's failure is the model's observation, not the run's end
            return f"error: {type(error).__name__}: {error}", True


# --- the calculator -------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # 9**99999999 would hang the rollout: powers stay small


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ToolError(f"unsupported expression: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."""
    try:
        tree = ast.parse(str(expression), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def python_tool(limits: SandboxCfg) -> Callable[..., str]:
    from miles.data.sandbox import check_sandbox, run_python

    check_sandbox(limits)  # fail closed when the tool is built (validation: exit 2), not per call

    def python(code: str) -> str:
        """Run Python code in a sandbox and return what it prints."""
        result = run_python(str(code), limits)
        if result.timed_out:
            raise ToolError("the code ran past its time limit")
        if result.returncode != 0:
            raise ToolError((result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1])
        return result.stdout

    return python


def function_tool(fn: Callable[..., str], name: str | None = None) -> Tool:
    """A Tool from a plain function: its name, first docstring line and annotated parameters."""
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        properties[param.name] = {"type": _JSON_TYPES.get(param.annotation, "string")}
        if param.default is param.empty:
            required.append(param.name)
    description = (inspect.getdoc(fn) or "").split("\n")[0]
    return Tool(name or fn.__name__, description,
                {"type": "object", "properties": properties, "required": required}, fn)


def build_toolbox(specs: list[str], limits: SandboxCfg) -> ToolBox:
    """`task.tools` -> a ToolBox; an unknown name or a path that does not import is a ValueError."""
    tools = []
    for spec in specs:
        if spec == "calculator":
            tools.append(function_tool(calculator))
        elif spec == "python":
            tools.append(function_tool(python_tool(limits), "python"))
        elif "." in spec:
            tools.append(function_tool(import_dotted(spec, "task.tools")))
        else:
            raise ValueError(f"task.tools: unknown tool {spec!r}; built-ins: calculator, python, "
                             "or a dotted path to your function (pkg.module.fn)")
    return ToolBox(tools)


def tool_problems(cfg: RunCfg) -> list[str]:
    """task.tools must resolve before anything starts (miles/validate.py runs this with the config's
    rules): each a built-in or a function that imports, and `python` only where its sandbox works."""
    try:
        build_toolbox(cfg.task.tools, cfg.task.sandbox)
    except ValueError as error:
        return [str(error)]
    return []
