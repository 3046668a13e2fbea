"""Load-testing client for OpenAI-compatible servers (`ladle bench`): talks HTTP only, imports no engine."""
