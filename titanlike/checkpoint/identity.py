"""Which run a checkpoint belongs to. A run's id is drawn when it starts afresh, kept in its dump folder
(records/folder.py writes it) and in every checkpoint it saves (trainer_state.json's "run"), and carried on by
each resume. A step saved by another run than the dump folder's (copied in, or two experiments given
one checkpoint folder) is resumed from only when checkpoint.load_step names it: that branches a new run.
docs/checkpointing.md says why."""

from __future__ import annotations

import secrets


def other_run(saved_run: dict, folder_run: str | None, step_dir: str, dump_folder: str) -> str | None:
    """The words that name both runs when `saved_run` (a checkpoint's record of its run) is not the run
    `folder_run` of this dump folder; None when it is, or when either has no id (a checkpoint saved
    before runs had one, or a dump folder that holds no run yet: it takes on the checkpoint's run)."""
    theirs = saved_run.get("run_id")
    if not isinstance(theirs, str) or not theirs or not folder_run or theirs == folder_run:
        return None
    return (f"{step_dir} was saved by run {theirs} (dump folder {saved_run.get('dump_folder') or '?'}), "
            f"not by this dump folder's run {folder_run} ({dump_folder})")


def run_after_load(saved_run: dict | None, folder_run: str | None, branched: bool) -> str:
    """This run's id from here on: the resumed checkpoint's run (the dump folder's, for a checkpoint saved
    before runs had ids); a new one for a fresh start (`saved_run` None) or a branch."""
    if saved_run is not None and not branched:
        theirs = saved_run.get("run_id")
        if isinstance(theirs, str) and theirs:
            return theirs
        if folder_run:
            return folder_run
    return secrets.token_hex(6)
