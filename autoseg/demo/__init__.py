"""`autoseg demo` and `autoseg make-demo-dataset`: a synthetic dataset (``data``) and the whole pipeline on it
(``run``).

Owns: ``data``, ``run``.
Imports: every stage; only ``autoseg.cli`` imports it.
"""
