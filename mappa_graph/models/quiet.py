"""Loading and saving models without console noise that is not the user's to act on."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Load and save without transformers' per-shard progress bars ("Loading weights", "Writing model shards":
    noise in a job's log, garbage when it is not a terminal) and without the FutureWarning peft triggers in
    transformers 5 (`is_gradient_checkpointing` is deprecated): neither is the user's to act on."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
