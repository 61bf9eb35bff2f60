"""Training one fold (``trainer.train``): the loop around ``autoseg.model.step.TrainStep``, exact resume
(``checkpoint``), out-of-memory degradation (``degrade``), the poly schedule and time budget (``schedule``),
the per-epoch patch validation (``patch_validation``), progress.png (``curves``) and the final validation
of the fold's cases (``validation``).

Owns: ``trainer``, ``checkpoint``, ``degrade``, ``schedule``, ``patch_validation``, ``curves``, ``validation``.
Imports: ``autoseg.predict``, ``autoseg.evaluate``, ``autoseg.data`` and below.
"""
