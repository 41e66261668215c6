"""Where a run executes: precision (:mod:`.precision`), processes (:mod:`.distributed`), the cache folder, the console."""
