"""What a run leaves behind: ``wandb_log`` (W&B, offline by default, or no logger, and a reader of
offline runs), ``sweep_jobs`` (which jobs of a sweep finished, failed or never ran),
``measured`` (each prompt's counts as it finishes), ``summary_keys`` (readers of a summary's facts
under its current keys and older ones), ``read_back`` (result files read back as untrusted input:
bounded, checked field by field), ``legend`` (what a table's acceptance columns count).

Imports no other part of the package; W&B only inside ``wandb_log``'s functions.
"""
