"""A run's prompts: where they come from and how each becomes the tokens a server is given.

    rows.py     the rows of a file: JSONL, Parquet, a save_to_disk dataset
    prompts.py  a row as a Prompt (prompt text or chat messages, answer, the row's fields)
    stream.py   the seeded stream of prompts a run draws from (one file, or several mixed by
                weight), with its checkpointed cursor
    chat.py     a prompt as token ids: the chat template, the system prompt
"""

from rlctl.data.prompts import Prompt
from rlctl.data.rows import DataError
from rlctl.data.stream import (MixedStream, PromptStream, prompt_stream, read_file_prompts, read_prompts, read_source,
                               rng_from_json, rng_to_json)

__all__ = ["DataError", "MixedStream", "Prompt", "PromptStream", "read_source", "prompt_stream", "read_file_prompts", "read_prompts", "rng_from_json", "rng_to_json"]
