"""Shared basics, written once: byte units, the precision table, anisotropy of a spacing, versioned JSON artifacts and
atomic writes, the workspace's paths and splits, what the machine offers and how work is spread over it
(``resources.processes_for``: process and worker counts from a RAM budget), per-machine measurements kept between
runs (graphs too: ``MachineCache.kept_file``) and torch's CPU threads (``machine``), the process pool that runs
cases, and the lock of each part of a workspace a command writes (``lock``).

Owns: ``errors``, ``units``, ``precision``, ``spacing``, ``artifacts``, ``workspace``, ``resources``, ``machine``,
``workers``, ``lock``, ``extras`` (an optional extra's module imported, or an error naming the extra).
Imports: no other autoseg package.
"""
