"""Prompt sets (:mod:`.prompts`): the embedded ``movie_prompts``, local jsonl/csv files or folders, hub datasets (config group ``data``)."""
