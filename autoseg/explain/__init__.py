"""`autoseg explain`: where every byte of a planned configuration goes (``explanation``: the memory terms, per
stage, inference, host, what-ifs) and its text rendering (``format``).

Owns: ``explanation``, ``format``.
Imports: ``autoseg.train`` and below.
"""
