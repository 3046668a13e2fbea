"""Learned decision heads: a small classifier on the chat model's own hidden state at a
decision's answer position, fitted from labelled examples (`ladle heads fit`, an HTTP client)
and served through /v1/decisions (`ladle serve --decision-head NAME=PATH`)."""
