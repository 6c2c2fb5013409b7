"""Guided decoding: output held to a JSON Schema (or to any JSON object) token by token, on llguidance.

tokenizer.py gives llguidance the model's vocabulary, grammar.py compiles a schema (bounded, cached),
guide.py is one request's matcher, masks.py computes the masks off the engine thread and applies them.
"""
