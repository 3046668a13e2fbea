"""Speculative decoding: propose a few tokens cheaply, verify them all in one target step.

config.py holds `--speculative-config` and the load-aware policy; the drafters are ngram.py
(prompt lookup), draft_model.py (a smaller model with its own KV cache), early_exit.py (the
target's own first layers) and mtp.py (the checkpoint's multi-token prediction layer, DeepSeek V3's); verify.py decides which drafted tokens the target keeps; stats.py
counts them for the metrics. The engine drives them.
"""
