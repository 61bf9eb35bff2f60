"""The raw dataset in nnU-Net's layout: dataset.json, its labels (``LabelScheme``: classes, the ignore label,
regions), image reading and writing with their geometry, the integrity checks, and the nonzero region a case
is cropped to.

Owns: ``raw`` (``load_dataset``, ``check_integrity``), ``case_list`` (dataset.json's ``"dataset"`` entry),
``inputs`` (what ``predict -i`` names), ``labels``, ``imageio``, ``nifti`` (a NIfTI file's truncation check and
one-pass float read), ``dicom_file`` (a truncated DICOM slice found before the series is read), ``dicom_source`` (a
label map's source DICOM series and its segments), ``dicom_write`` (``--output-format``: DICOM SEG) and
``dicom_rtstruct`` (RTSTRUCT), ``cropping``.
Imports: ``autoseg.core``.
"""
