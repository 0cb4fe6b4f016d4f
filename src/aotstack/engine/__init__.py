"""The engine interface: the floor beneath ``compile/`` and ``runtime/`` that both talk to engines through.

``interface.py`` is the contract (a compile side, a run side, state updated in place),
``registry.py`` finds an engine's sides by id, ``session.py`` is the run side shared by the
engines that open one session per delegate, and ``processor.py`` says which CPU compiled code
runs on (caches key by it, libraries record what they need of it). It imports only ``format``
and ``errors``. ``pages.py`` puts the weights a session engine packs on huge pages.
"""
