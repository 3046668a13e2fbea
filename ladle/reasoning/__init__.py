"""Reasoning models: think-block parsing and thinking budgets."""
