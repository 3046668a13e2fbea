"""Tool calling: tool_choice as grammars, tool calls parsed out of model text, tool prompts."""
