"""What ``autoseg find-best`` reads, found and checked before any voxel is: per configuration and fold,
``results/<config>/fold_<k>/validation/`` (each validation case's label map ``{case}{ending}``, its probabilities
``{case}.npz``, ``summary.json``), the folds' validation cases from splits.json, and the references (the raw
dataset's labelsTr). Everything missing is named in one error, with the command that writes it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autoseg.core.artifacts import ArtifactError
from autoseg.core.errors import InputError
from autoseg.core.workspace import NUM_FOLDS, Splits, Workspace, make_splits
from autoseg.dataset.labels import IGNORE, LabelScheme, LabelValue, foreground_entries
from autoseg.dataset.raw import load_dataset
from autoseg.plan.plans import Plans
from autoseg.preprocess.store import list_cases


@dataclass(frozen=True)
class ValidationCase:
    fold: int
    case_id: str
    reference: Path  # labelsTr/{case}{ending}


@dataclass(frozen=True)
class CrossValidation:
    """The checked inputs: every configuration has, for every fold, the outputs of every validation case."""

    workspace: Workspace
    configurations: tuple[str, ...]  # in plans.json's order
    folds: tuple[int, ...]
    cases: tuple[ValidationCase, ...]  # fold by fold, in case id order
    scheme: LabelScheme
    foreground: dict[str, LabelValue]  # name -> label value (a tuple for a region), as evaluation scores them
    ignore: int | None
    file_ending: str

    def label_map(self, config: str, case: ValidationCase) -> Path:
        return self.workspace.results(config, case.fold) / "validation" / f"{case.case_id}{self.file_ending}"

    def probabilities(self, config: str, case: ValidationCase) -> Path:
        return self.workspace.results(config, case.fold) / "validation" / f"{case.case_id}.npz"


def collect(
    workspace: Workspace, configs: list[str] | None = None, folds: tuple[int, ...] | None = None
) -> CrossValidation:
    """Find and check the cross-validation outputs of ``configs`` (None: every planned configuration with a
    trained fold) over ``folds`` (None: every fold of splits.json, 0 1 2 3 4 for 5 cases or more); raise
    ``InputError`` naming every missing piece and the command that writes it."""
    plans = Plans.from_json(workspace.require(workspace.plans_path, "plan_and_preprocess"))
    configs = _configurations(workspace, plans, configs)
    splits = Splits.from_json(workspace.require(workspace.splits_path, "train fold 0"))
    folds = tuple(range(len(splits.folds))) if folds is None else tuple(folds)
    if len(set(folds)) != len(folds) or not folds:
        raise InputError(f"--folds {' '.join(map(str, folds))}: give one or more folds, each once")
    too_high = [f for f in folds if f >= len(splits.folds)]
    if too_high:
        raise InputError(
            f"fold(s) {too_high}: {workspace.splits_path} has {len(splits.folds)} folds (0 to "
            f"{len(splits.folds) - 1}); choose folds with --folds, e.g. --folds 0 1"
        )
    dataset = load_dataset(workspace.dataset_root())
    references = {c.case_id: c.label_path for c in dataset.cases}
    cases = []
    for fold in folds:
        for case_id in sorted(splits.folds[fold].val):
            if references.get(case_id) is None:
                raise InputError(
                    f"{dataset.root}: no label file for validation case {case_id!r} of fold {fold} "
                    f"({workspace.splits_path}); the dataset changed since training"
                )
            cases.append(ValidationCase(fold, case_id, references[case_id]))
    cv = CrossValidation(
        workspace,
        tuple(configs),
        tuple(folds),
        tuple(cases),
        plans.label_scheme,
        foreground_entries(dataset.labels),
        dataset.labels.get(IGNORE),
        dataset.file_ending,
    )
    _check_outputs(cv)
    return cv


def _configurations(workspace: Workspace, plans: Plans, configs: list[str] | None) -> list[str]:
    if configs is None:
        configs = [c for c in plans.configurations if (workspace.root / "results" / c).is_dir()]
        if not configs:
            raise InputError(
                f"{workspace.root}: no configuration has trained folds (results/<config>/ not found); "
                f"train one first: `autoseg train fold {' '.join(map(str, _every_fold(workspace, plans)))} "
                f"-c {plans.default_configuration()} -w {workspace.root}`"
            )
        return configs
    unknown = [c for c in configs if c not in plans.configurations]
    if unknown:
        raise InputError(
            f"--configs: {', '.join(unknown)} not planned; {workspace.plans_path} has {', '.join(plans.configurations)}"
        )
    if len(set(configs)) != len(configs):
        raise InputError(f"--configs {' '.join(configs)}: give each configuration once")
    return [c for c in plans.configurations if c in configs]


def _check_outputs(cv: CrossValidation) -> None:
    """Every (configuration, fold) trained and validated, with each validation case's label map and npz."""
    ws, problems = cv.workspace, []
    for config in cv.configurations:
        for fold in cv.folds:
            out = ws.results(config, fold)
            train = f"autoseg train fold {fold} -c {config} -w {ws.root}"
            if not ws.checkpoint(config, fold, "final").is_file():
                problems.append(
                    f"{config} fold {fold}: not trained ({out / 'checkpoint_final.pt'} not found); "
                    f"run `{train}`, or leave the fold out with --folds"
                )
                continue
            missing = _missing_outputs(cv, config, fold)
            if missing:
                problems.append(
                    f"{config} fold {fold}: its final validation is incomplete in {out / 'validation'} "
                    f"(missing {missing}); run `{train} --resume` (a finished fold only runs its "
                    f"validation again; if summary.json is there, move the validation folder aside first)"
                )
            foreign = _foreign_cases(cv, config, fold)
            if foreign:
                problems.append(
                    f"{config} fold {fold}: validated case(s) {foreign} that are not in fold {fold}'s "
                    f"validation cases of {ws.splits_path}: it was trained with other splits; train it "
                    f"again (`{train}`) so every configuration is compared on the same cases"
                )
    if problems:
        what = "fold is" if len(problems) == 1 else f"{len(problems)} folds are"
        raise ArtifactError(
            f"autoseg find-best compares configurations on the validation outputs of every fold; "
            f"{what} missing them:\n  " + "\n  ".join(problems)
        )


def _foreign_cases(cv: CrossValidation, config: str, fold: int) -> list[str]:
    """The cases with a ``{case}.npz`` in the fold's validation folder that splits.json does not validate there."""
    expected = {c.case_id for c in cv.cases if c.fold == fold}
    val = cv.workspace.results(config, fold) / "validation"
    return sorted(p.name[:-4] for p in val.glob("*.npz") if not p.name.startswith(".") and p.name[:-4] not in expected)


def _missing_outputs(cv: CrossValidation, config: str, fold: int) -> str:
    val = cv.workspace.results(config, fold) / "validation"
    missing = [] if (val / "summary.json").is_file() else ["summary.json"]
    for case in (c for c in cv.cases if c.fold == fold):
        missing += [p.name for p in (cv.label_map(config, case), cv.probabilities(config, case)) if not p.is_file()]
    return ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")


def _every_fold(workspace: Workspace, plans: Plans) -> range:
    """The folds a cross-validation of this workspace has: splits.json's, or before it exists the ones training
    will make (``make_splits``: five, or one per case below five preprocessed cases)."""
    if workspace.splits_path.is_file():
        return range(len(Splits.from_json(workspace.splits_path).folds))
    data = workspace.preprocessed(plans.configuration(plans.default_configuration()).data_configuration)
    cases = list_cases(data) if data.is_dir() else []
    return range(len(make_splits(cases).folds) if len(cases) >= 2 else NUM_FOLDS)  # make_splits refuses below 2
