"""Structured outputs: grammars compiled to token masks (xgrammar), one matcher per sequence."""
