"""Evaluation (`autoseg evaluate`): Dice and IoU per class or region, the ignore label left out, summary.json.

Owns: ``metrics``.
Imports: ``autoseg.dataset``, ``autoseg.core``; not ``autoseg.predict``.
"""
