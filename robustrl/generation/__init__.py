"""Generation: the engines (torch, vLLM), sampling, reward plug-ins, the built-in tasks and the
local model generator. Used by the rollout and by the trainer's held-out evaluation. Importing
the package needs no torch; its engine modules do."""
