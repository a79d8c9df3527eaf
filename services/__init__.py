"""robustrl services: coordinator, monitor, trainer, rollout, plus what they share."""
