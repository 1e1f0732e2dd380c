"""Evaluation: generation with fixed per-image seeds (`generation`), scoring and statistics (`scoring`, `stats`), the
resumable evaluation of several variants (`evaluate`) with its files (`files`) and results (`metrics`, `report`), the
reward-hacking monitors (`monitors`) and the training benchmark (`bench`)."""
