"""`autoseg explain`: where every byte of a planned configuration goes (``explanation``: the memory terms, per
stage, what-ifs; ``inference_and_host``: inference on the median image, host RAM per case) and its text
rendering (``format``).

Owns: ``explanation``, ``inference_and_host``, ``format``.
Imports: ``autoseg.train`` and below.
"""
