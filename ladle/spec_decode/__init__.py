"""Speculative decoding: propose a few tokens cheaply, verify them all in one target step.

config.py holds `--speculative-config` and the load-aware policy; ngram.py proposes by prompt
lookup; verify.py decides which drafted tokens the target keeps. The engine drives them.
"""
