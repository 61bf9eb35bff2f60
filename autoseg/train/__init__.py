"""Training one fold (``trainer.train``, with the run's knobs in ``run_config.RunConfig``): the loop around
``autoseg.model.step.TrainStep``, exact resume (``checkpoint``), out-of-memory degradation (``degrade``), the
poly schedule and time budget (``schedule``), the per-epoch patch validation (``patch_validation``),
progress.png (``curves``) and the final validation of the fold's cases (``validation``).

Owns: ``trainer``, ``folds`` (several folds in turn, resumable as a whole), ``run_config``, ``checkpoint``,
``degrade``, ``memory_check`` (the memory model checked against the first real steps, and ``autoseg
check-memory``), ``memory_probes`` (what that check measures, on CPU and CUDA), ``memory_report`` (its rows,
verdict, log line and table), ``schedule``, ``data_pipeline`` (loader workers, precomputed copies),
``patch_validation``, ``curves``, ``validation``, ``fold_data`` (a fold's cases and, for the cascade, each case's
out-of-fold previous-stage label map).
Imports: ``autoseg.predict``, ``autoseg.evaluate``, ``autoseg.data`` and below.
"""
