"""Tools for agentic, multi-turn rollouts (docs/tools.md): what a tool is (``base``), calls as
text (``calls``), running a turn's calls (``run``) and the built-ins, ``python``
(``python``, a sandbox), ``calculator`` and ``search``. No Ray and no torch here; importing
this package imports the standard library only (transformers and bm25s when a tool is made)."""

from m2flow.tools.base import Tool, ToolCall, ToolError, ToolResult, function_tool, load, object_tool
from m2flow.tools.calls import parse_calls, render_results, tool_messages, tools_prompt
from m2flow.tools.run import Toolbox, error_counts

__all__ = ["Tool", "ToolCall", "ToolError", "ToolResult", "Toolbox", "error_counts", "function_tool", "load",
           "object_tool", "parse_calls", "render_results", "tool_messages", "tools_prompt"]
