"""The rollout: an inference engine turning prompt groups into scored trajectories."""
