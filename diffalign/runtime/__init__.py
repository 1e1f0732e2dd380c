"""What a run needs around the training itself: checkpoints, the run lock, faults and signals, console output, launch
and distributed (FSDP) helpers, experiment trackers, text-context warnings and media files."""
