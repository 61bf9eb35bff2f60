"""The files ``autoseg predict`` writes for a case: its label map, in the asked format (``--output-format``), and
what is asked beside it; with all of them there, ``--continue`` skips the case."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from autoseg.dataset.dicom_write import output_ending
from autoseg.dataset.imageio import supported_ending
from autoseg.dataset.raw import Case
from autoseg.predict.case_review import review_paths
from autoseg.predict.uncertainty import UncertaintyOptions
from autoseg.predict.uncertainty import outputs as uncertainty_outputs


class Asked(Protocol):
    """What of ``autoseg.predict.predictor.PredictOptions`` says which files a case gets."""

    save_probabilities: bool
    output_format: str
    preview: bool
    statistics: bool
    uncertainty: UncertaintyOptions


def every_output(case: Case, output_dir: Path, options: Asked) -> list[Path]:
    """Every file ``predict`` writes for ``case`` with ``options``: ``case_outputs``, then the preview picture and
    statistics row asked for (``review_paths``), the uncertainty row and map (``uncertainty.outputs``); with
    all of them there, ``--continue`` skips the case."""
    return (
        case_outputs(case, output_dir, options.save_probabilities, options.output_format)
        + review_paths(output_dir, case.case_id, options.preview, options.statistics)
        + uncertainty_outputs(output_dir, case.case_id, options.uncertainty)
    )


def case_outputs(case: Case, output_dir: Path, save_probabilities: bool, output_format: str = "nifti") -> list[Path]:
    """The label map (the case id with its image's ending, a DICOM series' .nii.gz; or ``output_format``'s:
    ``output_ending``), then, if asked, the probabilities ({case}.npz)."""
    nifti = ".nii.gz" if case.series_uid is not None else supported_ending(case.image_paths[0].name)
    return [output_dir / f"{case.case_id}{output_ending(output_format, nifti)}"] + (
        [output_dir / f"{case.case_id}.npz"] if save_probabilities else []
    )
