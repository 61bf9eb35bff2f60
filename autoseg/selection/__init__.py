"""Model selection (`autoseg find-best`): from the folds' final validation outputs, the cross-validation Dice of
every configuration and every ensemble of two, the best of them, whether keeping only the largest connected
component helps (all foreground, then per class or region), and ``inference.json`` for prediction.

Owns: ``sources`` (finding and checking the validation outputs, splits and references), ``scoring`` (the Dice of
each candidate and the postprocessing search), ``report`` (find_best.json, find_best.md, the predict command),
``run`` (``find_best``, the entry point).
Imports: ``autoseg.predict``, ``autoseg.evaluate`` and below (the one package that needs both); not
``autoseg.train``.
"""
