"""The runtime: ``load``, the methods of a loaded package, input checks and the plan interpreter.

It imports only the format layer and, when a package names them, the backends' run sides."""
