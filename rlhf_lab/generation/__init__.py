"""Generation (config group ``generation``): the :class:`~.rollout.Rollout` batch, the engine interface (:mod:`.backend`) and the default engine (:mod:`.hf`, its decode loop and key/value cache)."""
