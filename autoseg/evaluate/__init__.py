"""Evaluation (`autoseg evaluate`): Dice, IoU, HD95, normalized surface Dice and the reference's connected
components found per class or region, the ignore label left out, summary.json.

Owns: ``metrics`` (the counts, means, summary.json and table), ``files`` (the file pairs compared, their geometry
check and label maps), ``surface`` (HD95 and NSD of one case), ``detection`` (the reference's connected components
the prediction touches).
Imports: ``autoseg.dataset``, ``autoseg.core``; not ``autoseg.predict``.
"""
