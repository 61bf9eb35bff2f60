"""Evaluation (`autoseg evaluate`): Dice, IoU, HD95, normalized surface Dice and the reference's connected
components found per class or region, the ignore label left out, summary.json; with ``--images`` a picture per case
and index.html (``pictures``); `autoseg statistics` of a folder of segmentations (``folder_statistics``).

Owns: ``metrics`` (the counts, means, summary.json and table), ``files`` (the file pairs compared, their geometry
check and label maps), ``surface`` (HD95 and NSD of one case), ``detection`` (the reference's connected components
the prediction touches), ``pictures`` (the pictures through each case's largest error, index.html),
``folder_statistics`` (a folder's statistics.csv and statistics.json).
Imports: ``autoseg.review``, ``autoseg.dataset``, ``autoseg.core``; not ``autoseg.predict``.
"""
