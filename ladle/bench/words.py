"""Synthetic text of a chosen token length, without the target's tokenizer.

Prompts are built from WORDS, about 400 common lowercase English words. With
the leading space every one of them is a single token in SmolLM2's 49k BPE
vocabulary, so space-joined random draws cost DEFAULT_TOKENS_PER_WORD = 1.0
token a word (measured); larger vocabularies (Llama 3, Qwen, GPT-4 style) hold
such words whole too, while small SentencePiece vocabularies may split a few.
When the target serves `/tokenize` (vLLM, ladle, llama.cpp),
`client.measure_tokens_per_word` replaces the default with the target's own
figure, and every request records the prompt tokens the server reports in
`usage`, so the approximation only steers the lengths, never the numbers.
"""

from __future__ import annotations

import numpy as np

DEFAULT_TOKENS_PER_WORD = 1.0
CHARS_PER_TOKEN = 4.0  # OpenAI's rule of thumb for free English text (ShareGPT, tool output)

WORDS: tuple[str, ...] = tuple(dict.fromkeys("""
time people year way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face level office door health person art war history party result change morning
reason research girl guy moment air teacher force education food plan table field music
market color light voice river street garden window paper letter picture island doctor
report price course order news energy heart season project model rule space value answer
test data code file list page table image sound road train plane ship farm tree flower bird
dog cat horse fish stone glass metal wood fire rain snow wind cloud sun moon star sea lake
hill mountain forest desert bridge tower church hospital hotel bank shop club station
library museum theater kitchen bedroom floor wall roof box bag key card phone computer
screen camera machine engine tool wheel chair bed clock bottle cup plate knife shirt shoe
coat hat dress ring gold silver iron salt sugar bread milk coffee tea rice egg meat fruit
apple orange cake dinner lunch breakfast meeting event film show song dance sport ball
race goal score player coach fan league match season winner chance choice decision effort
energy feeling fear hope love peace trust truth wish dream memory mind thought sense skill
style taste voice method process theory practice purpose quality rate size speed type
unit version view
make take give find tell ask work seem feel try leave call keep begin help show hear play
run move live believe hold bring happen write provide sit stand lose pay meet include
continue set learn lead understand watch follow stop create speak read spend grow open walk
win offer remember love consider appear buy wait serve die send expect build stay fall cut
reach kill remain suggest raise pass sell require report decide pull
good new first last long great little own other old right big high different small large
next early young important few public bad same able best better sure free true full
special easy clear recent late hard strong possible whole major simple left final main
green red blue black white short dark real local social
""".split()))


def random_words(rng: np.random.Generator, n: int) -> str:
    """`n` words drawn uniformly from WORDS, space-joined."""
    if n <= 0:
        return ""
    idx = rng.integers(0, len(WORDS), size=n)
    return " ".join(WORDS[i] for i in idx)


def words_for_tokens(tokens: int, tokens_per_word: float) -> int:
    return max(1, round(tokens / tokens_per_word)) if tokens > 0 else 0


def random_text(rng: np.random.Generator, tokens: int, tokens_per_word: float) -> str:
    """About `tokens` tokens of random words."""
    return random_words(rng, words_for_tokens(tokens, tokens_per_word))


def estimate_tokens(text: str) -> int:
    """Token estimate for free text (no tokenizer at hand): about four characters a token."""
    return max(1, round(len(text) / CHARS_PER_TOKEN)) if text else 0
