"""What a person looks at to check segmentations: pictures (``pictures``: slices through a chosen point with the
label maps outlined, ``drawing``: colours, outlines, the legend, ``png``: the file) and statistics (``statistics``:
per case and structure voxels, volume, connected components and image intensities; the cohort's CSV and JSON).

Owns: ``png`` (``write_png``), ``drawing``, ``pictures`` (``error_picture``, ``preview_picture``, ``picture_bytes``),
``statistics`` (``case_statistics``, ``CaseStatistics``, the per-case rows and the cohort files).
Imports: ``autoseg.dataset``, ``autoseg.core``; ``autoseg.predict`` and ``autoseg.evaluate`` call it.
"""
