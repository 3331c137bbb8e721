"""Constrained generation: JSON schemas, regexes, choices, grammars, and token-level controls.

- params.py         StructuredOutputsParams (vLLM's names); a leaf, imported by sampling.py
- grammars.py       what a request asks for -> an llguidance grammar, checked, with clear errors
- compiler.py       grammars compiled on a thread pool, cached by (grammar, tokenizer)
- constraints.py    one sequence's constraints: its grammar matcher (advanced on each token the
                    scheduler reads), allowed / banned tokens, biases
- token_masks.py    a step's token bitmask: filled on the host, applied to logits on the device
- manager.py        what the engine calls: check and attach at add_request, a step's masks
"""
