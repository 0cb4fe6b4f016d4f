"""aotstack in other libraries' tools: ``aotstack.integrations.transformers``, a ``transformers.exporters`` backend.

These modules sit above the compiler and the runtime, and nothing of aotstack below them imports them.
"""
