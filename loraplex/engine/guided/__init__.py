"""Guided decoding: output held to a JSON Schema (or to any JSON object) token by token.

schema.py compiles the schema into value nodes, matcher.py follows the output byte by byte over them,
vocab.py turns a matcher state into the set of allowed tokens, guide.py is one request's use of them.
"""
