"""Constrained generation: JSON schemas, regexes, choices, grammars, and token-level controls.

- params.py         StructuredOutputsParams (vLLM's names); a leaf, imported by sampling.py
- grammars.py       what a request asks for -> an llguidance grammar, checked, with clear errors
- compiler.py       grammars compiled on a thread pool, cached by (grammar, tokenizer)
- constraints.py    one sequence's constraints: its grammar matcher, allowed / banned tokens
- token_masks.py    a step's token bitmask: filled on the host, applied to logits on the device
- manager.py        what the engine calls: add, ready?, masks for a step, accept tokens, release
"""
