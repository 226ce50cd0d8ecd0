"""OLMo's templates of tool use (open-instruct's `olmo*`, and the Olmo 3 Think models' own, written so): a tool's
result is an `environment` turn, a turn's calls a `function_calls` string written `<function_calls>…</function_calls>`
and the tools a system (or user) message's `functions` string. They have no `tool` role (open-instruct's leave such
a turn out; open_sft's own copies refuse it: "no turn for role tool") and read no OpenAI `tool_calls`. A row in
OpenAI's form is refused with the hint that says so (`environment_hint`), not converted: what the `function_calls`
string holds is the data's choice (Olmo 3 Instruct's own template writes `name(key=value, ...)`, a line a call), not
the template's.
"""

from __future__ import annotations

from typing import Optional

from open_sft.data.formats import Messages


def writes_environment_turns(source: Optional[str]) -> bool:
    """Whether the template is of that form: it writes `environment` turns and a `function_calls` string, and reads no
    `tool_calls`."""
    return bool(source) and "'environment'" in source and "function_calls" in source and "tool_calls" not in source


def environment_hint(source: Optional[str], messages: Messages) -> str:
    """The hint for a row of OpenAI's tool messages or `tool_calls` under such a template, "" for any other."""
    if not writes_environment_turns(source) or not any(
            m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        return ""
    return ("; this template (OLMo's, as open-instruct and Olmo 3's Think models write it) has no 'tool' role and "
            "reads no OpenAI 'tool_calls': it writes a tool's result as an 'environment' turn (role 'environment'), "
            "a turn's calls from its 'function_calls' string (written <function_calls>…</function_calls>, the calls "
            "as the model writes them, as Olmo 3 Instruct's template does: get_weather(city=\"Oslo\"), a line a call) "
            "and the tools from a system message's 'functions' string; give the rows in that form, or train with a "
            "template that reads OpenAI's (Olmo 3 Instruct's own, allenai/Olmo-3-7B-Instruct's, with "
            "--chat_template_path FILE)")
